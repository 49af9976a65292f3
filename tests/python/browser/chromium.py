"""Headless Debian Chromium driven by Playwright, for the browser tests (`tests/it/browser.rs`).

A script in this directory reads its config as JSON on stdin and prints its result as JSON on
its last stdout line (`run`), which `tests/support/browser.rs` (`run_script`) hands to the
Rust test. The browser is Debian's `/usr/bin/chromium`: no `playwright install` is needed (nor
possible offline); Playwright's wheel carries only its driver.

    from playwright.sync_api import sync_playwright
    from chromium import launch, run, watch_errors

    def crawl(config):
        with sync_playwright() as playwright:
            browser = launch(playwright)
            page = browser.new_page()
            errors = watch_errors(page)
            page.goto(config["url"])
            return {"title": page.title(), "errors": errors}

    if __name__ == "__main__":
        run(crawl)
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

from playwright.sync_api import (
    Browser,
    ConsoleMessage,
    Page,
    Playwright,
    ProxySettings,
    Request,
)

#: Debian's Chromium (`apt-get install -y chromium`).
EXECUTABLE = os.environ.get("CHROMIUM", "/usr/bin/chromium")

#: What this machine needs: no GPU, no sandbox as root (its namespaces need an unprivileged
#: user), and as little traffic of its own (updates, sync, QUIC) as it allows beside the pages a test loads.
FLAGS = [
    "--headless",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

#: Chromium sends requests for loopback hosts (`localhost`, `127.0.0.1`, `[::1]`) past any
#: proxy unless its bypass list removes that rule: the tests' targets are on loopback. Playwright
#: adds it too unless `PLAYWRIGHT_DISABLE_FORCED_CHROMIUM_PROXIED_LOOPBACK` is set; said here,
#: it holds either way.
PROXY_LOOPBACK = "<-loopback>"


def gateway_proxy(server: str, username: str, password: str) -> ProxySettings:
    """The `proxy` option for a gateway at `server` (`http://host:port`): `username` is
    `name[;key=value]*` (session, labels), `password` an API token; loopback included. Give it
    to `new_context` rather than `launch`: a browser-wide proxy also carries Chromium's own
    requests (to Google hosts), a context's only its pages'."""
    return {
        "server": server,
        "username": username,
        "password": password,
        "bypass": PROXY_LOOPBACK,
    }


def launch(playwright: Playwright, **kwargs: Any) -> Browser:
    """Starts headless Chromium with `FLAGS` (plus `--no-sandbox` as root), a fresh profile,
    and Playwright's `launch` options `kwargs` (`args` are added after `FLAGS`)."""
    args = list(FLAGS)
    if os.geteuid() == 0:
        args.append("--no-sandbox")
    args.extend(kwargs.pop("args", []))
    kwargs.setdefault("timeout", 60_000)
    return playwright.chromium.launch(
        executable_path=EXECUTABLE, headless=True, args=args, **kwargs
    )


def watch_errors(page: Page, *, own_site: bool = False) -> list[str]:
    """A list that fills with the page's console errors (`console: ...`), uncaught exceptions
    (`pageerror: ...`) and failed requests (`requestfailed: URL: reason`) from now on. On
    another site (`own_site` false) a missing `/favicon.ico`, which Chromium asks every site
    for, is not an error of the page; on the project's own pages every error counts, the
    icon's included. A request the browser cancelled itself (`net::ERR_ABORTED`), such as a
    page's refresh still in flight when the test navigates away, is none either. A server or
    proxy that fails a request shows another reason (reset, refused, empty response, tunnel
    failed)."""
    errors: list[str] = []

    def request_failed(request: Request) -> None:
        if request.failure != "net::ERR_ABORTED":
            errors.append(f"requestfailed: {request.url}: {request.failure}")

    def console(message: ConsoleMessage) -> None:
        url = message.location.get("url", "")
        if message.type == "error" and (own_site or not url.endswith("/favicon.ico")):
            errors.append(f"console: {message.text} ({url})")

    page.on("console", console)
    page.on("pageerror", lambda error: errors.append(f"pageerror: {error}"))
    page.on("requestfailed", request_failed)
    return errors


def watch_console(page: Page) -> list[dict[str, str]]:
    """A list that fills with every console message of the page from now on: its `type`
    (`log`, `warning`, `error`, ...), `text` and `url`."""
    messages: list[dict[str, str]] = []

    def console(message: ConsoleMessage) -> None:
        url = message.location.get("url", "")
        messages.append({"type": message.type, "text": message.text, "url": url})

    page.on("console", console)
    return messages


def run(script: Callable[[dict[str, Any]], Any]) -> None:
    """Calls `script` with the JSON config read from stdin and prints its result as JSON, one
    line, last; an exception exits non-zero with its traceback on stderr."""
    config = json.load(sys.stdin)
    result = script(config)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
