"""Fetches a site's paths in turn through a gateway that intercepts HTTPS, with one crawler
library configured as its users configure it (a proxy URL, the gateway's CA), on kept-alive
connections, printing one JSON line per answer as it comes:

    {"path", "status", "ip", "captcha", "proxy", "lease", "moved", "ban_reported"}

`ip` is the address the site saw (the exit): the `<p id="ip">` of an HTML page, else the
text of the body; `captcha` whether the body holds "captcha"; the others are the gateway's
`X-Proxy-Name`, `X-Proxy-Lease`, `X-Proxy-Session-Moved` and `X-Proxy-Ban-Reported` (null
when absent). A path may hold `{ip}`: the `ip` of the answer before it, so a step can name
the exit the crawler was on (`/ban/{ip}/429`).

usage: inspect_crawl.py KIND PROXY_URL CA_FILE BASE_URL PATH...
    KIND: requests | httpx | scrapy
    PROXY_URL: http://name;tls=inspect[;session=...]:TOKEN@gateway
    CA_FILE: the gateway's CA certificate (PEM), which requests and httpx verify against
"""

from __future__ import annotations

import json
import os
import re
import ssl
import sys
from typing import Any, Callable, Mapping

IP = re.compile(r'<p id="ip">([^<]*)</p>')


def describe(
    path: str, status: int, body: str, header: Callable[[str], str | None]
) -> dict[str, Any]:
    """One answer's line."""
    found = IP.search(body)
    return {
        "path": path,
        "status": status,
        "ip": found.group(1) if found else body.strip(),
        "captcha": "captcha" in body.lower(),
        "proxy": header("X-Proxy-Name"),
        "lease": header("X-Proxy-Lease"),
        "moved": header("X-Proxy-Session-Moved"),
        "ban_reported": header("X-Proxy-Ban-Reported"),
    }


def emit(result: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def fill(path: str, ip: str | None) -> str:
    """`path` with `{ip}` replaced by the exit of the answer before it."""
    return path.replace("{ip}", ip or "")


def with_requests(proxy: str, ca: str, base: str, paths: list[str]) -> None:
    import requests

    session = requests.Session()
    # The test's own environment (a proxy or CA bundle variable) must not change what runs.
    session.trust_env = False
    session.proxies = {"http": proxy, "https": proxy}
    session.verify = ca
    ip = None
    for path in paths:
        filled = fill(path, ip)
        response = session.get(base + filled, timeout=30)
        result = describe(filled, response.status_code, response.text, response.headers.get)
        ip = result["ip"]
        emit(result)


def with_httpx(proxy: str, ca: str, base: str, paths: list[str]) -> None:
    import httpx

    # httpx 0.28 deprecates `verify=<path>`: a context verifying against the file is the same.
    verify = ssl.create_default_context(cafile=ca)
    with httpx.Client(proxy=proxy, verify=verify, trust_env=False, timeout=30) as client:
        ip = None
        for path in paths:
            filled = fill(path, ip)
            response = client.get(base + filled)
            result = describe(filled, response.status_code, response.text, response.headers.get)
            ip = result["ip"]
            emit(result)


def with_scrapy(proxy: str, base: str, paths: list[str]) -> int:
    import scrapy
    from scrapy.crawler import CrawlerProcess

    class StepsSpider(scrapy.Spider):
        """An ordinary spider: each answer's callback asks for the next path."""

        name = "steps"

        async def start(self):
            yield self.step(0, None)

        def step(self, index: int, ip: str | None) -> scrapy.Request:
            path = fill(paths[index], ip)
            # `dont_filter`: `/ip` is asked more than once.
            return scrapy.Request(
                base + path, cb_kwargs={"index": index, "path": path}, dont_filter=True
            )

        def parse(self, response, index: int, path: str):
            def header(name: str) -> str | None:
                value = response.headers.get(name)
                return value.decode() if value is not None else None

            result = describe(path, response.status, response.text, header)
            emit(result)
            if index + 1 < len(paths):
                yield self.step(index + 1, result["ip"])

    # The proxy, as a crawler's shell exports it: Scrapy's HttpProxyMiddleware reads it from
    # the environment and turns its user part into `Proxy-Authorization`. Nothing else is
    # configured in code.
    os.environ["https_proxy"] = proxy
    os.environ["http_proxy"] = proxy
    for name in ("no_proxy", "NO_PROXY"):
        os.environ.pop(name, None)
    process = CrawlerProcess(
        settings={
            # Scrapy does not verify certificates by default (its context factory accepts any
            # chain): it talks to the gateway's leaf without being given the gateway's CA, and
            # would as well to anything else. Its users who want verification set
            # DOWNLOADER_CLIENTCONTEXTFACTORY to a verifying factory of their own.
            "ROBOTSTXT_OBEY": False,
            # The gateway retries and reports; Scrapy's own retry would hide what it did.
            "RETRY_ENABLED": False,
            # A 403 or 429 the gateway passes on reaches the callback, to be printed.
            "HTTPERROR_ALLOW_ALL": True,
            "CONCURRENT_REQUESTS": 1,
            "LOG_LEVEL": "WARNING",
            "TELNETCONSOLE_ENABLED": False,
        }
    )
    crawler = process.create_crawler(StepsSpider)
    process.crawl(crawler)
    process.start()
    stats = crawler.stats.get_stats()
    errors = stats.get("log_count/ERROR", 0)
    if errors:
        print(f"scrapy logged {errors} errors", file=sys.stderr)
    return 1 if errors else 0


def main() -> int:
    kind, proxy, ca, base, paths = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
    if kind == "requests":
        with_requests(proxy, ca, base, paths)
    elif kind == "httpx":
        with_httpx(proxy, ca, base, paths)
    elif kind == "scrapy":
        return with_scrapy(proxy, base, paths)
    else:
        print(f"unknown client {kind!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
