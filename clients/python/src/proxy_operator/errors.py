"""Exceptions of the client: every answer the API refuses becomes an :class:`ApiError` carrying
the JSON error code (``no_match``, ``unknown_lease``, ``overloaded``, ``quota_exceeded``, ...)."""

from __future__ import annotations

import math
from typing import Any


class ProxyOperatorError(Exception):
    """Anything this package raises."""


class ConfigError(ProxyOperatorError):
    """The client is missing a setting (an API URL, a token), or one is malformed."""


class TransportError(ProxyOperatorError):
    """The API could not be reached or did not answer in time."""


class ApiError(ProxyOperatorError):
    """The API answered with an error.

    ``status`` is the HTTP status, ``code`` the JSON ``error`` field, ``message`` its text,
    ``body`` the whole JSON body and ``retry_after`` the seconds of a ``Retry-After`` header
    (``None`` without one).
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        body: dict[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body or {}
        self.retry_after = retry_after


class NoMatch(ApiError):
    """409 ``no_match``: no proxy can take a lease now. ``retry_after`` is when one frees up by
    itself (a lease expiry or a cooldown end), or ``None`` when nothing will.
    :class:`RetryPolicy` waits on it within its ``no_match`` budget."""


class Unavailable(ApiError):
    """503: the ledger could not take the write in time (``overloaded``), is full
    (``ledger_full``) or cannot be reached (``ledger_unavailable``), or the pool is waking
    (:class:`PoolWaking`); nothing was written. :class:`RetryPolicy` waits on it within its
    ``unavailable`` budget (``pool_waking``'s for a waking pool)."""


class PoolWaking(Unavailable):
    """503 ``pool_waking``: the selector matches pools scaled to zero that are waking, with
    no Ready member yet. ``pools`` names them (``namespace/name``); ``wake_timeout`` is the
    body's ``wakeTimeoutSeconds``, the longest any of them may take to wake (``None`` when the
    body has none). :class:`RetryPolicy` waits that long for them (or its ``pool_waking``
    budget, when longer)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        body: dict[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, code, message, body, retry_after)
        pools = self.body.get("pools")
        self.pools: list[str] = [str(p) for p in pools] if isinstance(pools, list) else []
        self.wake_timeout = _number(self.body.get("wakeTimeoutSeconds"))


class TooManyRequests(ApiError):
    """429: the API asks the caller to slow down; waited on as ``retry_after`` says, within
    :class:`RetryPolicy`'s ``too_many`` budget. Over a tenant's quota it is
    :class:`QuotaExceeded`."""


class QuotaExceeded(TooManyRequests):
    """429 ``quota_exceeded``: the caller's tenant is at one of its quotas, and nothing was
    looked at. ``tenant`` names it, ``quota`` says which (``leases``, ``sessions``,
    ``acquiresPerSecond`` or ``bytesPerDay``), ``limit`` is that quota's limit (leases,
    sessions, acquires per second, or bytes through the gateway per UTC day) and ``burst`` the
    rate's bucket size (``None`` for the other quotas). A quota frees up by itself (a lease
    expiring, the bucket refilling, midnight UTC for ``bytesPerDay``) or when the tenant gives
    a lease back, so :class:`RetryPolicy` asks again every ``retry_after`` seconds, up to its
    ``quota_exceeded`` budget."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        body: dict[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, code, message, body, retry_after)
        tenant, quota = self.body.get("tenant"), self.body.get("quota")
        self.tenant: str | None = str(tenant) if tenant is not None else None
        self.quota: str | None = str(quota) if quota is not None else None
        self.limit = _number(self.body.get("limit"))
        burst = _number(self.body.get("burst"))
        self.burst: int | None = int(burst) if burst is not None else None


class Banned(ProxyOperatorError):
    """Raised by a caller inside ``client.lease(...)`` to say the target banned the proxy: the
    lease is reported with ``result`` (``blocked`` or ``rate_limited``) and ``retry_after``
    seconds of cooldown (the target's ``Retry-After``), then released."""

    def __init__(
        self, result: str = "blocked", retry_after: float | None = None, message: str = ""
    ) -> None:
        super().__init__(message or f"the target answered with a ban ({result})")
        self.result = result
        self.retry_after = retry_after


def _number(value: object) -> float | None:
    """A body's number that is finite and not negative, else ``None`` (absent or malformed)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value) and value >= 0:
            return float(value)
    return None
