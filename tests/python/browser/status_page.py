"""The status page as a person uses it, in headless Chromium: sign in, read the fleet and the
proxies, watch a proxy turn unhealthy without a reload and say why, filter and sort, read the
per-target table, check every page with axe-core, take a screenshot, sign out. Every console
message is kept, and every icon the browser fetched.

Config: `base` (the API's URL), `token`, `kill_pid` (a squid to kill with SIGKILL while the
proxies page is open), `killed` (its proxy, `namespace/name`), `target` (a target with a
cooldown), `axe` (path of axe.min.js), `screenshot` (where to write one). The result says what
was seen; the Rust test asserts on it.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from playwright.sync_api import Page, Response, sync_playwright

from chromium import launch, run, watch_console, watch_errors

#: How long a live refresh may take to show a change (the health engine needs its failure
#: threshold of probes first).
LIVE_DEADLINE_MS = 90_000


def rows(page: Page, table: str, attribute: str) -> list[str]:
    values: list[str] = page.eval_on_selector_all(
        f"#{table} tbody tr", f"rows => rows.map(r => r.getAttribute('{attribute}'))"
    )
    return values


def phases(page: Page) -> dict[str, str]:
    found: dict[str, str] = page.eval_on_selector_all(
        "#proxy-table tbody tr",
        "rows => Object.fromEntries(rows.map(r => [r.dataset.proxy, r.querySelector('td.phase').textContent]))",
    )
    return found


def axe_violations(page: Page, axe: str) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations on the loaded page."""
    page.add_script_tag(path=axe)
    found: list[dict[str, Any]] = page.evaluate(
        """async () => {
            const result = await axe.run(document);
            return result.violations
                .filter(v => v.impact === 'serious' || v.impact === 'critical')
                .map(v => ({id: v.id, impact: v.impact, nodes: v.nodes.map(n => n.html)}));
        }"""
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
        console = watch_console(page)
        icons: list[dict[str, Any]] = []

        def icon(response: Response) -> None:
            if "favicon" in response.url:
                icons.append({"url": response.url, "status": response.status, "type": response.headers.get("content-type")})

        page.on("response", icon)

        # Not signed in: every page sends you to the form.
        page.goto(base + "/proxies")
        result["unsigned_url"] = page.url
        page.fill("#token", config["token"])
        page.click("form.signin button")
        page.wait_for_url(base + "/")
        result["fleet_title"] = page.title()
        cookie = next(c for c in context.cookies() if c["name"] == "proxy_operator_session")
        result["cookie"] = {
            "httpOnly": cookie["httpOnly"],
            "sameSite": cookie["sameSite"],
            "expires_in": cookie["expires"] - time.time(),
            "holds_token": config["token"] in cookie["value"],
        }
        result["token_in_page"] = config["token"] in page.content()

        # The proxies, then one killed squid: its row turns unhealthy by the live refresh.
        page.goto(base + "/proxies")
        result["phases_before"] = phases(page)
        result["badges"] = page.eval_on_selector_all(
            "#proxy-table tbody tr",
            "rows => Object.fromEntries(rows.map(r => [r.dataset.proxy, r.querySelector('.badge').className + ' ' + r.querySelector('.badge').textContent]))",
        )
        page.evaluate("window.notReloaded = true")
        os.kill(config["kill_pid"], signal.SIGKILL)
        page.wait_for_function(
            """killed => {
                const row = document.querySelector(`#proxy-table tr[data-proxy="${killed}"]`);
                return row && row.querySelector('td.health').textContent.includes('unhealthy');
            }""",
            arg=config["killed"],
            timeout=LIVE_DEADLINE_MS,
        )
        result["not_reloaded"] = page.evaluate("window.notReloaded === true")
        result["killed_health"] = page.locator(
            f'#proxy-table tr[data-proxy="{config["killed"]}"] td.health'
        ).inner_text()
        result["phases_after"] = phases(page)

        # Filtering by name and label, sorting by a column header.
        page.fill("#name", "gw-1")
        page.click("form.filter button")
        page.wait_for_load_state()
        result["filtered_by_name"] = rows(page, "proxy-table", "data-proxy")
        page.fill("#name", "")
        page.fill("#label", "pool=elsewhere")
        page.click("form.filter button")
        page.wait_for_load_state()
        result["filtered_by_other_label"] = rows(page, "proxy-table", "data-proxy")
        page.fill("#label", "pool=gateway")
        page.click("form.filter button")
        page.wait_for_load_state()
        result["filtered_by_label"] = rows(page, "proxy-table", "data-proxy")
        page.click("#proxy-table th >> text=Proxy")
        page.wait_for_load_state()
        result["sorted_by_name_desc"] = rows(page, "proxy-table", "data-proxy")
        result["sorted_url"] = page.url
        page.click("#proxy-table th >> text=Health")
        page.wait_for_load_state()
        result["sorted_by_health"] = phases(page)
        page.screenshot(path=config["screenshot"], full_page=True)

        # Per target: the 429's cooldown, with its end.
        page.goto(base + "/targets")
        row = page.locator(f'#target-table tr[data-target="{config["target"]}"]')
        result["target_row"] = row.inner_text() if row.count() == 1 else None

        # One proxy's page, the events page.
        page.goto(base + "/proxies/" + config["killed"])
        result["proxy_page"] = page.locator("main").inner_text()
        page.goto(base + "/events")
        result["events"] = len(rows(page, "event-table", "class"))

        # The data routes with the cookie; a route that changes something never takes it.
        result["data_signed_in"] = context.request.get(base + "/v1/status/fleet").status
        result["lease_with_cookie"] = context.request.post(
            base + "/v1/leases", data={"selector": {}}
        ).status

        # Accessibility of every view, in a context that lets axe's script in (the page's
        # own CSP refuses any script not served by it, as it should).
        checked = browser.new_context(bypass_csp=True, viewport={"width": 1400, "height": 900})
        checked.add_cookies(context.cookies())
        axe_page = checked.new_page()
        violations: dict[str, Any] = {}
        for path in ["/", "/proxies", "/targets", "/spend", "/events", "/proxies/" + config["killed"]]:
            axe_page.goto(base + path)
            violations[path] = axe_violations(axe_page, config["axe"])
        checked.close()
        result["violations"] = violations

        # Sign out: the cookie is gone, the page sends you to the form, the data routes 401.
        page.goto(base + "/")
        page.click("form.signout button")
        page.wait_for_url(base + "/signin")
        result["cookies_after"] = [c["name"] for c in context.cookies()]
        result["data_signed_out"] = context.request.get(base + "/v1/status/fleet").status
        page.goto(base + "/targets")
        result["signed_out_url"] = page.url
        # Where a browser looks for an icon on an answer that names none (a JSON route).
        default_icon = context.request.get(base + "/favicon.ico")
        result["default_icon"] = {"status": default_icon.status, "type": default_icon.headers.get("content-type")}
        result["errors"] = errors
        result["console"] = console
        result["icons"] = icons
        browser.close()
    return result


if __name__ == "__main__":
    run(script)
