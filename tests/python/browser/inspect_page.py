"""Loads pages in headless Chromium through a gateway that intercepts HTTPS, the browser
trusting the gateway's CA the way a user makes it trust one: a certificate added to the NSS
database in `$HOME/.pki/nssdb` (made with `certutil`), which Chromium on Linux reads for
locally trusted roots. No switch that ignores certificate errors is used, and Playwright's
`ignore_https_errors` stays false: a page whose certificate does not verify fails to load.

config (JSON on stdin):
    gateway: {server, username, password}: the context's proxy (`chromium.gateway_proxy`)
    home: the HOME given to the browser process (holding `.pki/nssdb`)
    untrusted: {home, gateway}, or null: `urls[0]` is first loaded by a browser started with
        `home`, one without that database, through `gateway` (its own session), to see it
        refuse the gateway's certificate
    urls: URLs loaded in turn in one tab; `{ip}` in one is the text of the page before it

result (JSON, last stdout line):
    {"untrusted": {url, error} or null,
     "pages": [{url, status, text, proxy, moved, ban_reported, errors}]}
    where text is the page's body text, and proxy, moved and ban_reported the answer's
    X-Proxy-Name, X-Proxy-Session-Moved and X-Proxy-Ban-Reported (null when absent)
"""

from __future__ import annotations

import os
from typing import Any

from playwright.sync_api import Error, Playwright, sync_playwright

from chromium import gateway_proxy, launch, run, watch_errors


def browser_with_home(playwright: Playwright, home: str):
    """Chromium started with `HOME=home`: its NSS database is `home/.pki/nssdb`."""
    return launch(playwright, env={**os.environ, "HOME": home})


def untrusted(playwright: Playwright, config: dict[str, Any]) -> dict[str, Any]:
    """What a browser without the gateway's CA got for `urls[0]`."""
    url = config["urls"][0]
    browser = browser_with_home(playwright, config["untrusted"]["home"])
    try:
        context = browser.new_context(proxy=gateway_proxy(**config["untrusted"]["gateway"]))
        page = context.new_page()
        try:
            response = page.goto(url, wait_until="load", timeout=60_000)
            return {"url": url, "error": None, "status": response.status if response else None}
        except Error as error:
            return {"url": url, "error": error.message.splitlines()[0]}
    finally:
        browser.close()


def load(config: dict[str, Any]) -> dict[str, Any]:
    with sync_playwright() as playwright:
        refused = untrusted(playwright, config) if config.get("untrusted") else None
        browser = browser_with_home(playwright, config["home"])
        context = browser.new_context(proxy=gateway_proxy(**config["gateway"]))
        page = context.new_page()
        errors = watch_errors(page)
        pages = []
        text = ""
        for template in config["urls"]:
            url = template.replace("{ip}", text)
            del errors[:]
            response = page.goto(url, wait_until="load", timeout=60_000)
            text = page.inner_text("body").strip()
            headers = response.headers if response else {}
            pages.append(
                {
                    "url": url,
                    "status": response.status if response else None,
                    "text": text,
                    "proxy": headers.get("x-proxy-name"),
                    "moved": headers.get("x-proxy-session-moved"),
                    "ban_reported": headers.get("x-proxy-ban-reported"),
                    "errors": list(errors),
                }
            )
        browser.close()
        return {"untrusted": refused, "pages": pages}


if __name__ == "__main__":
    run(load)
