"""The spend view in headless Chromium with JavaScript off: sign in with the form, read the spend
tables and the charts (inline SVG drawn by the server), each with its name, its description
and its data table; then axe-core on the same view, in a context that lets its script in.

Config: `base` (the API's URL), `token`, `axe` (path of axe.min.js). The result says what was
seen; the Rust test asserts on it.
"""

from __future__ import annotations

from typing import Any

from playwright.sync_api import sync_playwright

from chromium import launch, run, watch_errors
from status_page import axe_violations


def script(config: dict[str, Any]) -> dict[str, Any]:
    base = config["base"]
    result: dict[str, Any] = {}
    with sync_playwright() as playwright:
        browser = launch(playwright)
        context = browser.new_context(java_script_enabled=False, viewport={"width": 1400, "height": 900})
        page = context.new_page()
        errors = watch_errors(page, own_site=True)
        page.goto(base + "/signin")
        page.fill("#token", config["token"])
        page.click("form.signin button")
        page.wait_for_url(base + "/")
        page.goto(base + "/spend")
        result["title"] = page.title()
        result["tenant_rows"] = page.eval_on_selector_all(
            "#day-tenants tbody tr", "rows => rows.map(r => Array.from(r.cells).map(c => c.textContent))"
        )
        result["charts"] = page.eval_on_selector_all(
            "figure.chart",
            """figures => figures.map(f => {
                const svg = f.querySelector('svg');
                const box = svg.getBoundingClientRect();
                const named = (svg.getAttribute('aria-labelledby') || '').split(' ')
                    .map(id => document.getElementById(id)).filter(e => e !== null);
                return {
                    role: svg.getAttribute('role'),
                    name: named.map(e => e.textContent).join(' | '),
                    width: box.width,
                    height: box.height,
                    bars: svg.querySelectorAll('rect.bar').length,
                    lines: svg.querySelectorAll('polyline.line, circle.point').length,
                    rows: f.querySelectorAll('table tbody tr').length,
                };
            })""",
        )
        result["errors"] = errors
        checked = browser.new_context(bypass_csp=True, viewport={"width": 1400, "height": 900})
        checked.add_cookies(context.cookies())
        axe_page = checked.new_page()
        axe_page.goto(base + "/spend")
        result["violations"] = axe_violations(axe_page, config["axe"])
        checked.close()
        browser.close()
    return result


if __name__ == "__main__":
    run(script)
