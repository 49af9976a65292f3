"""Acquires one lease with the real :class:`Client` and its default :class:`RetryPolicy`, waiting
through ``503 pool_waking`` answers while a pool scaled to zero wakes, then releases it. For the
project's end-to-end test of a waking pool (driven from the Rust side against a real Kubernetes
API server); not a pytest module.

usage: acquire_waiting.py API_URL TOKEN SELECTOR_JSON TIMEOUT_SECONDS

``TOKEN`` may be ``-`` (or left out) to take it from ``DISCOVERY_TOKEN``. ``SELECTOR_JSON`` is
a JSON object of labels, such as ``'{"geo":"eu"}'``. ``TIMEOUT_SECONDS`` bounds the whole run
(and each API call, at most 10 s). On success it prints one JSON line and exits 0::

    {"leaseID": "...", "proxy": "ns/name", "waitedSeconds": 12.3, "poolWakingAnswers": 6}

``waitedSeconds`` is the time from the first ask to the grant; ``poolWakingAnswers`` the
``pool_waking`` answers waited through. On failure it prints the error (one JSON line on
stdout with ``error``, ``status``, ``code``, ``waitedSeconds`` and ``poolWakingAnswers``, and
the message on stderr) and exits 1; bad arguments exit 2.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The package of this checkout, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from proxy_operator import ApiError, Client, PoolWaking, ProxyOperatorError, RetryPolicy  # noqa: E402
from proxy_operator.client import DEFAULT_TIMEOUT  # noqa: E402

USAGE = "usage: acquire_waiting.py API_URL TOKEN SELECTOR_JSON TIMEOUT_SECONDS"


@dataclass(frozen=True)
class CountingPolicy(RetryPolicy):
    """The default policy (same attempts, max_wait and rule), counting the ``pool_waking``
    answers it waits through."""

    waited_through: list[PoolWaking] = field(default_factory=list, compare=False, repr=False)

    def wait(self, error: ApiError, waited: float, attempt: int) -> float | None:
        seconds = super().wait(error, waited, attempt)
        if seconds is not None and isinstance(error, PoolWaking):
            self.waited_through.append(error)
        return seconds


class Deadline(Exception):
    """TIMEOUT_SECONDS passed."""


def _on_deadline(signum: int, frame: Any) -> None:
    raise Deadline("no lease within TIMEOUT_SECONDS")


def _arguments(argv: list[str]) -> tuple[str, str, dict[str, str], float]:
    if len(argv) == 3:
        argv = [argv[0], "-", *argv[1:]]
    if len(argv) != 4:
        raise ValueError("expected 4 arguments")
    url, token, selector_text, timeout_text = argv
    if token in ("", "-"):
        token = os.environ.get("DISCOVERY_TOKEN", "")
        if not token:
            raise ValueError("TOKEN is '-' and DISCOVERY_TOKEN is not set")
    selector = json.loads(selector_text)
    if not isinstance(selector, dict) or not all(isinstance(v, str) for v in selector.values()):
        raise ValueError(f"SELECTOR_JSON is not an object of strings: {selector_text}")
    timeout = float(timeout_text)
    if not timeout > 0:
        raise ValueError(f"TIMEOUT_SECONDS must be above 0, not {timeout_text}")
    return url, token, {str(k): v for k, v in selector.items()}, timeout


def main(argv: list[str]) -> int:
    try:
        url, token, selector, timeout = _arguments(argv)
    except ValueError as e:
        print(f"{USAGE}\n{e}", file=sys.stderr)
        return 2
    policy = CountingPolicy()
    started = time.monotonic()
    signal.signal(signal.SIGALRM, _on_deadline)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with Client(url, token=token, timeout=min(DEFAULT_TIMEOUT, timeout), retry=policy) as client:
            try:
                lease = client.acquire(selector=selector or None)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            waited = time.monotonic() - started
            client.release(lease.lease_id)
    except (ProxyOperatorError, Deadline) as e:
        print(
            json.dumps(
                {
                    "error": str(e),
                    "status": getattr(e, "status", None),
                    "code": getattr(e, "code", None),
                    "waitedSeconds": round(time.monotonic() - started, 3),
                    "poolWakingAnswers": len(policy.waited_through),
                }
            ),
            flush=True,
        )
        print(f"acquire_waiting: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "leaseID": lease.lease_id,
                "proxy": f"{lease.proxy.namespace}/{lease.proxy.name}",
                "waitedSeconds": round(waited, 3),
                "poolWakingAnswers": len(policy.waited_through),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
