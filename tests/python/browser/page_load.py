"""How long the status page's views take to load in headless Chromium: sign in with `token`
at `base`, then open each of `paths` and read its navigation timing (request start to the
load event). Result: `{"timings": {path: ms}, "rows": {path: rows of its first table}}`."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import sync_playwright

from chromium import launch, run


def script(config: dict[str, Any]) -> dict[str, Any]:
    base = config["base"]
    timings: dict[str, float] = {}
    rows: dict[str, int] = {}
    with sync_playwright() as playwright:
        browser = launch(playwright)
        page = browser.new_page()
        page.goto(base + "/signin")
        page.fill("#token", config["token"])
        page.click("form.signin button")
        page.wait_for_url(base + "/")
        for path in config["paths"]:
            # Twice: the first load of a view warms what every later one shares.
            for _ in range(2):
                page.goto(base + path, wait_until="load")
            timings[path] = page.evaluate(
                """() => {
                    const [nav] = performance.getEntriesByType('navigation');
                    return nav.loadEventEnd - nav.requestStart;
                }"""
            )
            rows[path] = page.locator("table").first.locator("tbody tr").count()
        browser.close()
    return {"timings": timings, "rows": rows}


if __name__ == "__main__":
    run(script)
