"""Navigates one tab of headless Chromium to each URL in turn, in one browser context, and
reports what it saw of each page and of every response the page loaded.

config (JSON on stdin):
    urls: list of URLs, visited in order
    gateway: {server, username, password}: the context's proxy (`chromium.gateway_proxy`,
        loopback included), or null for none
    args: extra Chromium flags (e.g. `--proxy-server=...`), default none
    ignore_https_errors: accept the test site's certificate, default false

result (JSON, last stdout line): {"pages": [{
    url, status, proxy (its X-Proxy-Name), ip (the text of `#ip`, or null),
    responses: [{url, status, proxy, peer (X-Peer)}] of the document and its subresources,
    images (decoded), stylesheets (with rules), scripts (`window.assetScripts`),
    errors (see `chromium.watch_errors`)}]}
"""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Response, sync_playwright

from chromium import gateway_proxy, launch, run, watch_errors

#: What the page's DOM says was loaded: decoded images, stylesheets with their rules, and the
#: scripts that ran (the site's `/assets` scripts push their number to `window.assetScripts`).
LOADED = """() => ({
    ip: document.getElementById("ip")?.textContent ?? null,
    images: [...document.images].filter((img) => img.complete && img.naturalWidth > 0).length,
    stylesheets: [...document.styleSheets].filter((sheet) => sheet.cssRules.length > 0).length,
    scripts: window.assetScripts ?? [],
})"""


def navigate(config: dict[str, Any]) -> dict[str, Any]:
    with sync_playwright() as playwright:
        browser = launch(playwright, args=config.get("args", []))
        context = browser.new_context(
            proxy=gateway_proxy(**gateway) if (gateway := config.get("gateway")) else None,
            ignore_https_errors=config.get("ignore_https_errors", False),
        )
        page = context.new_page()
        errors = watch_errors(page)
        responses: list[dict[str, Any]] = []

        def seen(response: Response) -> None:
            responses.append(
                {
                    "url": response.url,
                    "status": response.status,
                    "proxy": response.headers.get("x-proxy-name"),
                    "peer": response.headers.get("x-peer"),
                }
            )

        page.on("response", seen)
        pages = []
        for url in config["urls"]:
            del errors[:], responses[:]
            response = page.goto(url, wait_until="load", timeout=60_000)
            loaded = page.evaluate(LOADED)
            pages.append(
                {
                    "url": url,
                    "status": response.status if response else None,
                    "proxy": response.headers.get("x-proxy-name") if response else None,
                    **loaded,
                    "responses": list(responses),
                    "errors": list(errors),
                }
            )
        browser.close()
        return {"pages": pages}


if __name__ == "__main__":
    run(navigate)
