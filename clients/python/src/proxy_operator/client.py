"""Clients of the lease API: :class:`Client` for scripts, :class:`AsyncClient` for asyncio code
(the Scrapy middleware). Both take the same arguments and have the same calls."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from . import calls
from .calls import Call, RetryPolicy
from .config import ENV_URL, TokenSource, resolve_url
from .errors import Banned, TransportError
from .models import Lease, ProxyInfo

T = TypeVar("T")

DEFAULT_TIMEOUT = 10.0
USER_AGENT = "proxy-operator-python/0.1"


@dataclass
class _Tries:
    """What one call has tried so far: the seconds and the waits spent on each kind of
    refusal (each has a budget of its own), and whether the token was read again."""

    waited: dict[calls.Refusal, float] = field(default_factory=dict)
    waits: dict[calls.Refusal, int] = field(default_factory=dict)
    reloaded: bool = False


@dataclass(frozen=True)
class _Again:
    """Send the call again after ``seconds``."""

    seconds: float


class _Base:
    """What both clients share: settings, the request to send and how an answer is read."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        tokens: TokenSource | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        """``url`` or ``PROXY_OPERATOR_URL``; the token given, read from ``token_file``, taken
        from a shared ``tokens`` source, or from the environment (see :mod:`.config`)."""
        self.url = resolve_url(url, ENV_URL)
        self.timeout = timeout
        self.retry = retry
        self._token = tokens or TokenSource(token, token_file)

    def _request_args(self, call: Call[Any]) -> dict[str, Any]:
        args: dict[str, Any] = {
            "headers": {"Authorization": f"Bearer {self._token.token}"},
            "params": call.params,
        }
        if call.body is not None:
            args["json"] = call.body
        return args

    def _settle(self, call: Call[T], response: httpx.Response, tries: _Tries) -> T | _Again:
        """The result of ``response``, or how long to wait before sending ``call`` again;
        raises the error when it is not worth another try."""
        if response.is_success:
            return call.read(response)
        error = calls.error_of(response)
        # A 401 is worth one more try when the token file holds a new token.
        if error.status == 401 and not tries.reloaded and self._token.reload():
            tries.reloaded = True
            return _Again(0.0)
        kind = calls.refusal_of(error) if call.waits else None
        if kind is None:
            raise error
        wait = self.retry.wait(error, tries.waited.get(kind, 0.0), tries.waits.get(kind, 0))
        if wait is None:
            raise error
        tries.waited[kind] = tries.waited.get(kind, 0.0) + wait
        tries.waits[kind] = tries.waits.get(kind, 0) + 1
        return _Again(wait)

    def _transport_error(self, call: Call[Any], error: httpx.HTTPError) -> TransportError:
        return TransportError(f"{call.method} {self.url}{call.path}: {error}")

    def _exit_report(self, lease: Lease, target: str | None, error: BaseException | None) -> Call[None] | None:
        """The report a ``lease(...)`` block ending with ``error`` makes."""
        if isinstance(error, Banned):
            return calls.report(lease.lease_id, error.result, target, error.retry_after)
        return None


class Client(_Base):
    """A blocking client. Every call has a timeout (``timeout`` seconds); ``409 no_match``,
    ``429`` and ``503`` answers are waited on as ``retry`` says (each kind of refusal within a
    wait budget of its own, a waking pool up to its wake timeout), then raised as
    :class:`NoMatch`, :class:`TooManyRequests` (:class:`QuotaExceeded`) or
    :class:`Unavailable` (:class:`PoolWaking`); other refusals raise :class:`ApiError` with
    the JSON error code."""

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._http = httpx.Client(
            base_url=self.url, timeout=self.timeout, headers={"User-Agent": USER_AGENT}
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _send(self, call: Call[T]) -> T:
        tries = _Tries()
        while True:
            try:
                response = self._http.request(call.method, call.path, **self._request_args(call))
            except httpx.HTTPError as e:
                raise self._transport_error(call, e) from e
            outcome = self._settle(call, response, tries)
            if not isinstance(outcome, _Again):
                return outcome
            time.sleep(outcome.seconds)

    def list(self, selector: dict[str, str] | None = None, healthy: bool | None = None) -> list[ProxyInfo]:
        """Proxies matching ``selector`` (labels), only healthy (or unhealthy) ones if asked."""
        return self._send(calls.list_proxies(selector, healthy))

    def acquire(
        self,
        selector: dict[str, str] | None = None,
        target: str | None = None,
        ttl: int | None = None,
        request_id: str | None = None,
    ) -> Lease:
        """Leases the least-loaded healthy proxy matching ``selector``, not cooling down for
        ``target``. One request ID (generated unless given) covers every retry of the call."""
        return self._send(calls.acquire(selector, target, ttl, request_id))

    def get(self, lease_id: str) -> Lease:
        """Reads a lease."""
        return self._send(calls.get(lease_id))

    def renew(self, lease_id: str, ttl: int | None = None) -> Lease:
        """Extends an active lease by ``ttl`` seconds (the server's default if ``None``)."""
        return self._send(calls.renew(lease_id, ttl))

    def report(
        self, lease_id: str, result: str, target: str | None = None, retry_after: float | None = None
    ) -> None:
        """Records what the target answered through the lease's proxy: ``ok``, ``blocked``,
        ``rate_limited`` or ``error``; a ban cools the proxy down for ``target`` (for
        ``retry_after`` seconds, when given)."""
        self._send(calls.report(lease_id, result, target, retry_after))

    def report_session(
        self, name: str, result: str, target: str | None = None, retry_after: float | None = None
    ) -> None:
        """Like :meth:`report`, for the lease of one of this token's gateway sessions."""
        self._send(calls.report_session(name, result, target, retry_after))

    def end_session(self, name: str) -> None:
        """Ends one of this token's gateway sessions, giving its lease back."""
        self._send(calls.end_session(name))

    def release(self, lease_id: str) -> None:
        """Gives a lease back (releasing twice is not an error)."""
        self._send(calls.release(lease_id))

    @contextlib.contextmanager
    def lease(
        self,
        selector: dict[str, str] | None = None,
        target: str | None = None,
        ttl: int | None = None,
    ) -> Iterator[Lease]:
        """``with client.lease(target="example.com") as lease:`` — released on exit; a block
        that raises :class:`Banned` reports the ban first (the exception goes on)."""
        lease = self.acquire(selector, target, ttl)
        try:
            yield lease
        except BaseException as error:
            report = self._exit_report(lease, target, error)
            if report is not None:
                self._send(report)
            raise
        finally:
            self.release(lease.lease_id)


class AsyncClient(_Base):
    """The asyncio twin of :class:`Client` (``httpx.AsyncClient``): the same calls, awaited."""

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._http = httpx.AsyncClient(
            base_url=self.url, timeout=self.timeout, headers={"User-Agent": USER_AGENT}
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def _send(self, call: Call[T]) -> T:
        tries = _Tries()
        while True:
            try:
                response = await self._http.request(call.method, call.path, **self._request_args(call))
            except httpx.HTTPError as e:
                raise self._transport_error(call, e) from e
            outcome = self._settle(call, response, tries)
            if not isinstance(outcome, _Again):
                return outcome
            await asyncio.sleep(outcome.seconds)

    async def list(self, selector: dict[str, str] | None = None, healthy: bool | None = None) -> list[ProxyInfo]:
        return await self._send(calls.list_proxies(selector, healthy))

    async def acquire(
        self,
        selector: dict[str, str] | None = None,
        target: str | None = None,
        ttl: int | None = None,
        request_id: str | None = None,
    ) -> Lease:
        return await self._send(calls.acquire(selector, target, ttl, request_id))

    async def get(self, lease_id: str) -> Lease:
        return await self._send(calls.get(lease_id))

    async def renew(self, lease_id: str, ttl: int | None = None) -> Lease:
        return await self._send(calls.renew(lease_id, ttl))

    async def report(
        self, lease_id: str, result: str, target: str | None = None, retry_after: float | None = None
    ) -> None:
        await self._send(calls.report(lease_id, result, target, retry_after))

    async def report_session(
        self, name: str, result: str, target: str | None = None, retry_after: float | None = None
    ) -> None:
        await self._send(calls.report_session(name, result, target, retry_after))

    async def end_session(self, name: str) -> None:
        await self._send(calls.end_session(name))

    async def release(self, lease_id: str) -> None:
        await self._send(calls.release(lease_id))

    @contextlib.asynccontextmanager
    async def lease(
        self,
        selector: dict[str, str] | None = None,
        target: str | None = None,
        ttl: int | None = None,
    ) -> AsyncIterator[Lease]:
        lease = await self.acquire(selector, target, ttl)
        try:
            yield lease
        except BaseException as error:
            report = self._exit_report(lease, target, error)
            if report is not None:
                await self._send(report)
            raise
        finally:
            await self.release(lease.lease_id)
