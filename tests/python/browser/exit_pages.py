"""The status page's exits in headless Chromium: sign in, filter the proxies by exit (`shared`,
then a country), read each row's exit cell, open one proxy's page, and check both views with
axe-core.

config (JSON on stdin): `base` (the API's URL), `token`, `proxy` (`namespace/name` whose page
to open), `axe` (path of axe.min.js).

result (JSON, last stdout line): {"shared": {proxy: exit cell text}, "by_country": [proxy],
"proxy_page": text of its Exit section, "violations": {path: [violation]}, "errors": [...]}
"""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Page, sync_playwright

from chromium import launch, run, watch_errors
from status_page import axe_violations


def exit_cells(page: Page) -> dict[str, str]:
    found: dict[str, str] = page.eval_on_selector_all(
        "#proxy-table tbody tr",
        "rows => Object.fromEntries(rows.map(r => [r.dataset.proxy, r.querySelector('td.exit').textContent.trim()]))",
    )
    return found


def script(config: dict[str, Any]) -> dict[str, Any]:
    base = config["base"]
    result: dict[str, Any] = {}
    with sync_playwright() as playwright:
        browser = launch(playwright)
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        page = context.new_page()
        errors = watch_errors(page, own_site=True)
        page.goto(base + "/signin")
        page.fill("#token", config["token"])
        page.click("form.signin button")
        page.wait_for_url(base + "/")

        page.goto(base + "/proxies")
        page.fill("#exit", "shared")
        page.click("form.filter button")
        page.wait_for_url("**exit=shared**")
        result["shared"] = exit_cells(page)
        page.fill("#exit", "de")
        page.click("form.filter button")
        page.wait_for_url("**exit=de**")
        result["by_country"] = sorted(exit_cells(page))

        page.goto(base + "/proxies/" + config["proxy"])
        result["proxy_page"] = page.inner_text("#exit")

        checked = browser.new_context(bypass_csp=True, viewport={"width": 1400, "height": 900})
        checked.add_cookies(context.cookies())
        axe_page = checked.new_page()
        violations: dict[str, Any] = {}
        for path in ["/proxies", "/proxies?exit=shared", "/proxies/" + config["proxy"]]:
            axe_page.goto(base + path)
            violations[path] = axe_violations(axe_page, config["axe"])
        checked.close()
        result["violations"] = violations
        result["errors"] = errors
        browser.close()
    return result


if __name__ == "__main__":
    run(script)
