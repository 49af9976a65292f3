"""A Scrapy crawl of a site through a proxy: the index page and every page it links to, each
item saying which address the page was served to (the proxy's exit address) and which
upstream proxy the gateway chose.

usage: spider.py PROXY_URL START_URL OUTPUT.jsonl
"""

import sys

import scrapy
from scrapy.crawler import CrawlerProcess


class SiteSpider(scrapy.Spider):
    name = "site"

    def __init__(self, start_page, proxy, **kwargs):
        super().__init__(**kwargs)
        self.start_page = start_page
        self.proxy = proxy

    async def start(self):
        yield scrapy.Request(self.start_page, meta={"proxy": self.proxy})

    def parse(self, response):
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href, self.parse_page, meta={"proxy": self.proxy})

    def parse_page(self, response):
        yield {
            "url": response.url,
            "status": response.status,
            "ip": response.css("#ip::text").get(),
            "upstream": response.headers.get("X-Proxy-Name", b"").decode(),
        }


def main() -> int:
    proxy, start, output = sys.argv[1], sys.argv[2], sys.argv[3]
    process = CrawlerProcess(
        settings={
            "FEEDS": {output: {"format": "jsonlines"}},
            "CONCURRENT_REQUESTS": 8,
            "ROBOTSTXT_OBEY": False,
            "RETRY_ENABLED": False,
            "LOG_LEVEL": "INFO",
            "TELNETCONSOLE_ENABLED": False,
        }
    )
    crawler = process.create_crawler(SiteSpider)
    process.crawl(crawler, start_page=start, proxy=proxy)
    process.start()
    stats = crawler.stats.get_stats()
    errors = stats.get("log_count/ERROR", 0)
    print(f"responses {stats.get('response_received_count', 0)} errors {errors}", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
