"""The API's calls, described once for the sync and the async client: what to send, how to
read the answer, and when a refusal is worth waiting for."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Generic, Literal, TypeVar, get_args
from urllib.parse import quote

import httpx

from .errors import ApiError, NoMatch, PoolWaking, QuotaExceeded, TooManyRequests, Unavailable
from .models import Lease, ProxyInfo

T = TypeVar("T")

REPORT_RESULTS = ("ok", "blocked", "rate_limited", "error")


#: The kinds of refusal a call waits on, each within a wait budget of its own (see
#: :class:`RetryPolicy`).
Refusal = Literal["no_match", "pool_waking", "quota_exceeded", "unavailable", "too_many"]
REFUSALS: tuple[Refusal, ...] = get_args(Refusal)


def refusal_of(error: ApiError) -> Refusal | None:
    """The kind of a refusal a call may wait on, or ``None`` for an error that is raised at
    once."""
    if isinstance(error, NoMatch):
        return "no_match"
    if isinstance(error, PoolWaking):
        return "pool_waking"
    if isinstance(error, QuotaExceeded):
        return "quota_exceeded"
    if isinstance(error, Unavailable):
        return "unavailable"
    if isinstance(error, TooManyRequests):
        return "too_many"
    return None


@dataclass(frozen=True)
class RetryPolicy:
    """How long a call waits on refusals that carry ``Retry-After`` before it raises them.

    Each kind of refusal has a wait budget of its own, in seconds, spent only on answers of
    that kind, so a long wait on one (a pool waking) leaves the others' whole (an
    ``overloaded`` answer right after it is still waited on):

    ``no_match``
        ``409 no_match`` (:class:`NoMatch`): no proxy can take a lease now; ``Retry-After``
        says when one frees up by itself.
    ``pool_waking``
        ``503 pool_waking`` (:class:`PoolWaking`): a pool scaled to zero is waking. Waited on
        up to its ``wakeTimeoutSeconds`` when that is longer than the budget.
    ``quota_exceeded``
        ``429 quota_exceeded`` (:class:`QuotaExceeded`): the tenant is at a quota, which frees
        up by itself or when the tenant gives a lease back.
    ``unavailable``
        Any other ``503`` (:class:`Unavailable`: ``overloaded``, ``ledger_full``,
        ``ledger_unavailable``): nothing was written; the ledger asks for a moment.
    ``too_many``
        Any other ``429`` (:class:`TooManyRequests`): slow down.

    A budget left ``None`` is ``max_wait``. ``no_match``, ``unavailable`` and ``too_many`` are
    waited on at most ``attempts`` times each; ``pool_waking`` and ``quota_exceeded`` say "not
    yet" rather than "no", and are asked again every ``Retry-After`` seconds (at least
    ``MIN_POLL`` apart) however many answers that takes, their last wait cut short to end at
    the budget so the API is asked once more then. A wait longer than what is left of its
    budget is not started: the error is raised at once. ``attempts=0`` (:data:`NO_WAIT`)
    never waits."""

    attempts: int = 3
    max_wait: float = 30.0
    no_match: float | None = None
    pool_waking: float | None = None
    quota_exceeded: float | None = None
    unavailable: float | None = None
    too_many: float | None = None

    def budget(self, kind: Refusal) -> float:
        """Seconds one call may wait on refusals of ``kind`` in all (a waking pool's wake
        timeout aside)."""
        own: float | None = getattr(self, kind)
        return self.max_wait if own is None else own

    def wait(self, error: ApiError, waited: float, attempt: int) -> float | None:
        """Seconds to wait before trying again after ``error``, or ``None`` to raise it.
        ``waited`` and ``attempt`` are the seconds and the waits the call has spent on
        refusals of the same kind (:func:`refusal_of`) so far."""
        kind = refusal_of(error)
        if kind is None or error.retry_after is None or self.attempts <= 0:
            return None
        limit = self.budget(kind)
        if isinstance(error, PoolWaking):
            limit = max(limit, error.wake_timeout or 0.0)
        if kind in ("pool_waking", "quota_exceeded"):
            left = limit - waited
            return min(max(error.retry_after, MIN_POLL), left) if left > 0 else None
        if attempt >= self.attempts or waited + error.retry_after > limit:
            return None
        return error.retry_after


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
