"""What the Scrapy middleware costs a crawl: 2,000 loopback pages through the middleware (gateway
mode: gateway → squid → site) against the same crawl on a fixed list of the same squids with
no middleware (each request's ``meta["proxy"]`` set by the spider), in one run, alternating,
three times each. Prints pages/s of each and the ratio of their medians; exits 1 when it is
below 0.8.

Run with ``cargo bench --bench scrapy`` (it sets ``PROXY_OPERATOR_BIN`` to the release build),
or directly with ``PROXY_OPERATOR_BIN`` set.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness import TOKEN, Site, run_spider, start_operator  # noqa: E402

PAGES = int(os.environ.get("PROXY_OPERATOR_BENCH_PAGES", "2000"))
SQUIDS = 3
CONCURRENCY = 32
MIN_RATIO = 0.8
RUNS = 3

SPIDER = """
import itertools
import scrapy

PROXIES = itertools.cycle({proxies!r})

class Spider(scrapy.Spider):
    name = "bench"

    async def start(self):
        for n in range({pages}):
            meta = {{"proxy": next(PROXIES)}} if {fixed!r} else {{}}
            yield scrapy.Request("{base}/page/%d" % n, meta=meta)

    def parse(self, response):
        yield {{"n": len(response.body)}}
"""

COMMON = {
    "CONCURRENT_REQUESTS": CONCURRENCY,
    "CONCURRENT_REQUESTS_PER_DOMAIN": CONCURRENCY,
    "TELNETCONSOLE_ENABLED": False,
    "LOG_LEVEL": "WARNING",
}


def pages_per_second(result: dict) -> float:
    stats = result["stats"]
    crawled = len(result["items"])
    if crawled != PAGES:
        raise SystemExit(f"the crawl got {crawled} of {PAGES} pages: {stats}")
    return crawled / float(stats["elapsed_time_seconds"])


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="scrapy-bench-") as tmp:
        directory = Path(tmp)
        site = Site()
        operator = start_operator(directory, site, squids=SQUIDS, max_leases=CONCURRENCY)
        proxies = [f"http://{s.address}:{s.port}" for s in operator.squids]
        try:
            runs: dict[str, list[float]] = {"fixed proxy list": [], "middleware": []}
            for _ in range(RUNS):
                fixed = SPIDER.format(proxies=proxies, pages=PAGES, fixed=True, base=site.url(""))
                runs["fixed proxy list"].append(pages_per_second(run_spider(directory, fixed, COMMON)))
                through = SPIDER.format(proxies=proxies, pages=PAGES, fixed=False, base=site.url(""))
                settings = {
                    **COMMON,
                    "DOWNLOADER_MIDDLEWARES": {"proxy_operator.scrapy.ProxyOperatorMiddleware": 610},
                    "PROXY_OPERATOR_URL": operator.api,
                    "PROXY_OPERATOR_GATEWAY": operator.gateway,
                    "PROXY_OPERATOR_TOKEN": TOKEN,
                    "PROXY_OPERATOR_SESSIONS_PER_HOST": SQUIDS,
                }
                runs["middleware"].append(pages_per_second(run_spider(directory, through, settings)))
        finally:
            operator.stop()
            site.close()
    print(f"Scrapy crawl of {PAGES} loopback pages, {CONCURRENCY} concurrent, {SQUIDS} squids, {RUNS} runs each")
    for name, rates in runs.items():
        print(f"{name:<20} pages/s {' '.join(f'{r:8.1f}' for r in rates)}")
    median = {name: statistics.median(rates) for name, rates in runs.items()}
    ratio = median["middleware"] / median["fixed proxy list"]
    print(f"ratio {ratio:.2f} (of the medians; at least {MIN_RATIO})")
    return 0 if ratio >= MIN_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
