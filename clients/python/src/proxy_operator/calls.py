"""The API's calls, described once for the sync and the async client: what to send, how to
read the answer, and when a refusal is worth waiting for."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar
from urllib.parse import quote

import httpx

from .errors import ApiError, NoMatch, PoolWaking, QuotaExceeded, TooManyRequests, Unavailable
from .models import Lease, ProxyInfo

T = TypeVar("T")

REPORT_RESULTS = ("ok", "blocked", "rate_limited", "error")


@dataclass(frozen=True)
class RetryPolicy:
    """How long a call waits on ``409 no_match``, ``429`` and ``503`` answers that carry
    ``Retry-After`` before it raises: at most ``attempts`` waits and ``max_wait`` seconds in
    all. A wait longer than what is left is not started: the error is raised at once.

    Two refusals say "not yet" rather than "no", and are asked again every ``Retry-After``
    seconds (at least ``MIN_POLL`` apart) however many answers that takes, up to a limit: a
    ``503 pool_waking`` (:class:`PoolWaking`: a pool scaled to zero is waking) up to its
    ``wakeTimeoutSeconds`` when that is longer than ``max_wait`` (else, or without one, up to
    ``max_wait``), and a ``429 quota_exceeded`` (:class:`QuotaExceeded`: the tenant is at a
    quota, which frees up by itself or when the tenant gives a lease back) up to ``max_wait``.
    Their last wait is cut short to end at the limit, so the API is asked once more then.
    ``attempts=0`` (:data:`NO_WAIT`) never waits. ``waited`` counts every wait of the call."""

    attempts: int = 3
    max_wait: float = 30.0

    def wait(self, error: ApiError, waited: float, attempt: int) -> float | None:
        """Seconds to wait before trying again after ``error``, or ``None`` to raise it."""
        if not isinstance(error, (NoMatch, TooManyRequests, Unavailable)) or error.retry_after is None:
            return None
        if self.attempts <= 0:
            return None
        limit = self._not_yet_limit(error)
        if limit is not None:
            left = limit - waited
            return min(max(error.retry_after, MIN_POLL), left) if left > 0 else None
        if attempt >= self.attempts or waited + error.retry_after > self.max_wait:
            return None
        return error.retry_after

    def _not_yet_limit(self, error: ApiError) -> float | None:
        """How long a "not yet" refusal is asked again, whatever ``attempts`` says; ``None``
        for the other refusals."""
        if isinstance(error, PoolWaking):
            return max(self.max_wait, error.wake_timeout or 0.0)
        if isinstance(error, QuotaExceeded):
            return self.max_wait
        return None


#: Shortest wait between two asks of a "not yet" refusal (a ``Retry-After: 0`` would spin).
MIN_POLL = 1.0
NO_WAIT = RetryPolicy(attempts=0, max_wait=0.0)


@dataclass(frozen=True)
class Call(Generic[T]):
    """One API call: ``method path`` with ``body``; ``read`` turns the 2xx answer into the
    result; ``waits``: a 409/429/503 with ``Retry-After`` is waited on (safe for acquire with
    its request ID, renew and writes that are idempotent)."""

    method: str
    path: str
    read: Callable[[httpx.Response], T]
    body: Any = None
    params: dict[str, str] | None = None
    waits: bool = True


def retry_after(response: httpx.Response) -> float | None:
    """The seconds of a ``Retry-After`` header (its delta-seconds form, the only one the API
    sends)."""
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def error_of(response: httpx.Response) -> ApiError:
    """The exception for a non-2xx answer."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"error": "http_error", "message": response.text[:500]}
    code = str(body.get("error", "http_error"))
    message = str(body.get("message", ""))
    kind = ApiError
    if response.status_code == 409 and code == "no_match":
        kind = NoMatch
    elif response.status_code == 429:
        kind = QuotaExceeded if code == "quota_exceeded" else TooManyRequests
    elif response.status_code == 503:
        kind = PoolWaking if code == "pool_waking" else Unavailable
    return kind(response.status_code, code, message, body, retry_after(response))


def _nothing(_: httpx.Response) -> None:
    return None


def _lease(response: httpx.Response) -> Lease:
    return Lease.from_json(response.json())


def _proxies(response: httpx.Response) -> list[ProxyInfo]:
    return [ProxyInfo.from_json(p) for p in response.json()["proxies"]]


def _selector_text(selector: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def list_proxies(selector: dict[str, str] | None, healthy: bool | None) -> Call[list[ProxyInfo]]:
    params = {}
    if selector:
        params["selector"] = _selector_text(selector)
    if healthy is not None:
        params["healthy"] = "true" if healthy else "false"
    return Call("GET", "/v1/proxies", _proxies, params=params)


def acquire(
    selector: dict[str, str] | None,
    target: str | None,
    ttl: int | None,
    request_id: str | None,
) -> Call[Lease]:
    """An acquire under one request ID (a new one unless given), so waiting and retrying it
    can never grant twice."""
    body: dict[str, Any] = {"requestID": request_id or f"py-{uuid.uuid4().hex}"}
    if selector:
        body["selector"] = dict(selector)
    if target is not None:
        body["target"] = target
    if ttl is not None:
        body["ttlSeconds"] = int(ttl)
    return Call("POST", "/v1/leases", _lease, body=body)


def get(lease_id: str) -> Call[Lease]:
    return Call("GET", f"/v1/leases/{_segment(lease_id)}", _lease)


def renew(lease_id: str, ttl: int | None) -> Call[Lease]:
    body = {} if ttl is None else {"ttlSeconds": int(ttl)}
    return Call("POST", f"/v1/leases/{_segment(lease_id)}/renew", _lease, body=body)


def release(lease_id: str) -> Call[None]:
    return Call("DELETE", f"/v1/leases/{_segment(lease_id)}", _nothing)


def _report_body(result: str, target: str | None, retry_after_seconds: float | None) -> dict[str, Any]:
    if result not in REPORT_RESULTS:
        raise ValueError(f"result {result!r} is not one of {', '.join(REPORT_RESULTS)}")
    body: dict[str, Any] = {"result": result}
    if target is not None:
        body["target"] = target
    if retry_after_seconds is not None:
        body["retryAfterSeconds"] = max(0, int(round(retry_after_seconds)))
    return body


def report(
    lease_id: str, result: str, target: str | None, retry_after_seconds: float | None
) -> Call[None]:
    body = _report_body(result, target, retry_after_seconds)
    return Call("POST", f"/v1/leases/{_segment(lease_id)}/report", _nothing, body=body)


def report_session(
    name: str, result: str, target: str | None, retry_after_seconds: float | None
) -> Call[None]:
    body = _report_body(result, target, retry_after_seconds)
    return Call("POST", f"/v1/sessions/{_segment(name)}/report", _nothing, body=body)


def end_session(name: str) -> Call[None]:
    return Call("DELETE", f"/v1/sessions/{_segment(name)}", _nothing)


def _segment(value: str) -> str:
    """``value`` as one path segment."""
    return quote(value, safe="")
