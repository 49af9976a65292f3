"""A Scrapy downloader middleware that sends a crawl through proxy-operator.

Enable it in the settings (it runs before Scrapy's ``HttpProxyMiddleware``, 750)::

    DOWNLOADER_MIDDLEWARES = {"proxy_operator.scrapy.ProxyOperatorMiddleware": 610}
    PROXY_OPERATOR_URL = "http://proxy-operator.proxy-operator:8080"
    PROXY_OPERATOR_GATEWAY = "http://proxy-operator.proxy-operator:8888"

**Gateway mode** (``PROXY_OPERATOR_MODE = "gateway"``, the default): every request goes
through the gateway in one of ``PROXY_OPERATOR_SESSIONS_PER_HOST`` sticky sessions of its
target host, named in the proxy URL; ``download_slot`` is the session, so Scrapy's concurrency
and delays apply per exit address. The middleware takes no lease itself.

**Lease mode** (``"lease"``): each session is a lease of the API (``target`` = the host) whose
proxy URL goes in ``meta["proxy"]``; renewed at half its TTL, released when idle for
``PROXY_OPERATOR_LEASE_IDLE`` seconds and when the spider closes. For External proxies whose
install gives credentials out (``--lease-credentials``), or a crawl that must not pass through
the gateway.

Either way, a **ban** (a status in ``PROXY_OPERATOR_BAN_STATUSES``, or what
``PROXY_OPERATOR_BAN_DETECTOR`` says of a response, such as a captcha page answered 200) is
reported for the session's proxy and target with the target's ``Retry-After``, the session is
dropped, and the request is retried on a new one, at most ``PROXY_OPERATOR_MAX_RETRIES`` times;
then the response goes through as it is. Transport errors are retried the same way. A
``request.meta["proxy_operator_session"]`` pins a request to a session name of its own.

A **pool scaled to zero** wakes on the crawl's first requests: the gateway holds each one
until a member is Ready (at most the pool's ``wakeTimeout``; Scrapy's ``DOWNLOAD_TIMEOUT``,
180 s, must be longer), and in lease mode the acquire waits through ``503 pool_waking`` for
up to the ``wakeTimeout``, even past ``PROXY_OPERATOR_MAX_WAIT`` (see :class:`RetryPolicy`).

A **tenant's quota** is never a ban: the gateway refuses a request over it with a ``503``,
``Retry-After`` and ``Proxy-Status: proxy-operator; ...; details="quota_exceeded"``, and the
request is sent again after ``Retry-After`` (like a "no proxy free" ``503``); in lease mode the
acquire waits through ``429 quota_exceeded`` (then raises :class:`QuotaExceeded`). No answer
whose ``Proxy-Status`` names ``proxy-operator`` is taken for the target's: the gateway made it.

**Waits.** Each kind of refusal a request waits on has a budget of its own, per request
(gateway mode) or per acquire (lease mode): ``no_match`` (no proxy free), ``pool_waking``
(lease mode; at least the pool's ``wakeTimeout``), ``quota_exceeded``, ``unavailable`` (the
ledger could not take the lease) and ``too_many`` (an API ``429``), each
``PROXY_OPERATOR_MAX_WAIT`` seconds unless ``PROXY_OPERATOR_MAX_WAITS`` says otherwise (see
:class:`RetryPolicy`). So a long wait on one never leaves the next kind no time.

Settings (defaults): ``PROXY_OPERATOR_MODE`` (``"gateway"``), ``PROXY_OPERATOR_URL`` and
``PROXY_OPERATOR_GATEWAY`` (the environment variables of the same names),
``PROXY_OPERATOR_TOKEN`` / ``PROXY_OPERATOR_TOKEN_FILE`` (likewise), ``PROXY_OPERATOR_CRAWLER``
(the spider's name), ``PROXY_OPERATOR_SELECTOR`` (``{}``: labels the proxies must carry),
``PROXY_OPERATOR_SESSIONS_PER_HOST`` (4), ``PROXY_OPERATOR_SESSION_TTL`` (the gateway's
default, 5m), ``PROXY_OPERATOR_BAN_STATUSES`` (``{403: "blocked", 429: "rate_limited"}``),
``PROXY_OPERATOR_BAN_DETECTOR`` (``None``; a callable or its import path, called with the
response, returning ``"blocked"``, ``"rate_limited"`` or ``None``),
``PROXY_OPERATOR_MAX_RETRIES`` (5), ``PROXY_OPERATOR_MAX_WAIT`` (30: seconds one request may
wait on each kind of refusal), ``PROXY_OPERATOR_MAX_WAITS`` (``{}``: seconds by kind of
refusal, e.g. ``{"quota_exceeded": 120}``, the others ``PROXY_OPERATOR_MAX_WAIT``),
``PROXY_OPERATOR_TIMEOUT`` (10: seconds per API call),
``PROXY_OPERATOR_LEASE_TTL`` (120) and ``PROXY_OPERATOR_LEASE_IDLE`` (60).

Stats: ``proxy_operator/sessions`` (sessions started), ``proxy_operator/bans/<result>``,
``proxy_operator/retries``, ``proxy_operator/retries_exhausted``,
``proxy_operator/unavailable`` (answers "no proxy free": the gateway's 503, the API's
409/503), ``proxy_operator/quota_exceeded`` (the gateway's quota refusals, and acquires still
refused for the quota after its wait), ``proxy_operator/errors`` (transport errors).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from scrapy import Request, Spider, signals
from scrapy.crawler import Crawler
from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.http import Response
from scrapy.settings import BaseSettings
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.misc import load_object

from .calls import REFUSALS, Refusal, RetryPolicy
from .client import AsyncClient
from .config import ENV_GATEWAY, ENV_URL, TokenSource, gateway_proxy_url, resolve_url
from .errors import ApiError, ConfigError, NoMatch, ProxyOperatorError, QuotaExceeded, Unavailable
from .models import Lease
from .sessions import SessionPool

logger = logging.getLogger(__name__)

#: ``request.meta`` key that pins a request to a session name of the caller's choosing.
SESSION_META = "proxy_operator_session"
_RETRIES_META = "proxy_operator_retries"
#: Seconds a request has waited on the gateway's refusals, by kind.
_WAITED_META = "_proxy_operator_waited"
_ASSIGNED_META = "_proxy_operator_assigned"
_PROXY_NAME_HEADER = b"X-Proxy-Name"
_PROXY_LEASE_HEADER = b"X-Proxy-Lease"
_BAN_REPORTED_HEADER = b"X-Proxy-Ban-Reported"
_PROXY_STATUS_HEADER = b"Proxy-Status"
#: The gateway's name in the ``Proxy-Status`` of the answers it makes itself.
_GATEWAY_NAME = "proxy-operator"
#: A member's name or one of its parameters in a ``Proxy-Status`` list, and the separator after.
_STATUS_PART = re.compile(r'\s*([^\s,;=]+)\s*(?:=\s*("(?:[^"\\]|\\.)*"|[^\s,;]*))?\s*([,;]?)')

BanDetector = Callable[[Response], "str | None"]
#: Seconds before the first retry after a transport error, doubled on each retry up to the cap.
TRANSPORT_BACKOFF = 0.25
TRANSPORT_BACKOFF_CAP = 4.0
#: Longest wait between two tries while the gateway refuses a request (no proxy free, a quota).
UNAVAILABLE_POLL = 5.0


def retry_after_seconds(value: bytes | str | None, now: datetime | None = None) -> float | None:
    """A ``Retry-After`` header's wait in seconds: delta-seconds or an HTTP date."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    if text.isdigit():
        return float(text)
    try:
        at = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return max(0.0, (at - (now or datetime.now(timezone.utc))).total_seconds())


def gateway_status(response: Response) -> dict[str, str] | None:
    """The parameters of the gateway's member of the answer's ``Proxy-Status`` (RFC 9209),
    such as ``{"error": "http_request_denied", "details": "quota_exceeded"}``; ``None`` when
    no member names ``proxy-operator``, so the gateway did not make the answer itself."""
    text = b", ".join(response.headers.getlist(_PROXY_STATUS_HEADER)).decode("latin-1")
    members: list[tuple[str, dict[str, str]]] = []
    starts_member = True
    for part in _STATUS_PART.finditer(text):
        key, value, separator = part.groups()
        if starts_member:
            members.append((_unquote(key), {}))
        elif value is not None:
            members[-1][1][key] = _unquote(value)
        starts_member = separator == ","
    return next((params for name, params in members if name == _GATEWAY_NAME), None)


def _unquote(value: str) -> str:
    """A structured field's string without its quotes and escapes; a token as it is."""
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return re.sub(r"\\(.)", r"\1", value[1:-1])
    return value


@dataclass(frozen=True)
class Ban:
    """A ban seen on ``session``'s request to ``host``: the ``result`` to report, the target's
    ``retry_after``, the lease the request went through when the answer names it, whether the
    gateway ``reported`` it already, and whether it is the ``first`` for this session."""

    session: str
    host: str
    result: str
    retry_after: float | None = None
    lease_id: str | None = None
    reported: bool = False
    first: bool = True


async def _report(call: Awaitable[None], ban: Ban) -> None:
    """Makes a report; a failed one is logged (the crawl goes on either way)."""
    try:
        await call
    except ApiError as e:
        if e.code not in ("unknown_session", "unknown_lease"):
            logger.warning("proxy-operator: reporting %s for session %s failed: %s", ban.result, ban.session, e)
    except ProxyOperatorError as e:
        logger.warning("proxy-operator: reporting %s for session %s failed: %s", ban.result, ban.session, e)


@dataclass(frozen=True)
class BanRule:
    """What counts as a ban: a status in ``statuses`` (status → result), or what ``detector``
    says of the response."""

    statuses: dict[int, str]
    detector: BanDetector | None = None

    def of(self, response: Response) -> str | None:
        result = self.statuses.get(response.status)
        if result is None and self.detector is not None:
            result = self.detector(response)
        return result


class _Route(Protocol):
    """How a session's requests reach a proxy: through the gateway, or on a lease."""

    async def assign(self, request: Request, host: str, session: str) -> None: ...

    async def banned(self, ban: Ban) -> None: ...

    def answered(self, session: str) -> None: ...

    async def failed(self, session: str, host: str) -> None: ...

    async def drop(self, session: str) -> None: ...

    async def close(self) -> None: ...


class _GatewayRoute:
    """Sessions of the gateway: the session name goes in the proxy URL."""

    def __init__(self, api: AsyncClient, gateway: str, token: TokenSource, crawler: str, selector: dict[str, str], session_ttl: str | None):
        self.api = api
        self.gateway = gateway
        self.token = token
        self.crawler = crawler
        self.selector = selector
        self.session_ttl = session_ttl
        # Every name used, ended or not: a request in flight when its session was ended opens
        # it again at the gateway, so the spider's close ends them all once more.
        self.opened: set[str] = set()
        # Each session's proxy URL, built once per token.
        self._urls: dict[str, tuple[str, str]] = {}

    async def assign(self, request: Request, host: str, session: str) -> None:
        token = self.token.token
        cached = self._urls.get(session)
        if cached is None or cached[0] != token:
            self.opened.add(session)
            url = gateway_proxy_url(
                self.gateway,
                token,
                self.crawler,
                session=session,
                session_ttl=self.session_ttl,
                selector=self.selector,
            )
            cached = self._urls[session] = (token, url)
        request.meta["proxy"] = cached[1]

    async def banned(self, ban: Ban) -> None:
        if ban.reported:
            pass  # the gateway saw the status and reported it
        elif ban.lease_id is not None:
            # Plain HTTP names the lease the request went through: exact, even when the session
            # moved since.
            await _report(self.api.report(ban.lease_id, ban.result, ban.host, ban.retry_after), ban)
        elif ban.first:
            # Inside TLS only the session name is known: reported once per session, since
            # requests still in flight on it may have opened it again elsewhere.
            await _report(self.api.report_session(ban.session, ban.result, ban.host, ban.retry_after), ban)
        await self.drop(ban.session)

    def answered(self, session: str) -> None:
        """The gateway keeps its sessions alive by their use: nothing to note."""

    async def failed(self, session: str, host: str) -> None:
        # The gateway reported the upstream's failure itself, and retried it where it could.
        await self.drop(session)

    async def drop(self, session: str) -> None:
        try:
            await self.api.end_session(session)
        except ProxyOperatorError as e:
            logger.warning("proxy-operator: ending session %s failed: %s", session, e)

    async def close(self) -> None:
        await asyncio.gather(*(self.drop(session) for session in self.opened))


@dataclass
class _Held:
    lease: Lease
    renewed: float
    used: float
    #: Requests assigned to it and not answered yet (Scrapy may hold them in its slot queue).
    in_flight: int = 0


class _LeaseRoute:
    """Sessions on leases of the API: one lease per session, its proxy URL in the request.
    A task renews each lease at half its TTL and releases one unused for ``idle`` seconds:
    Scrapy runs every middleware's ``process_request`` before a request waits for its slot,
    so request handling alone cannot keep a lease alive."""

    def __init__(self, api: AsyncClient, selector: dict[str, str], ttl: int, idle: float, clock: Callable[[], float] = time.monotonic):
        self.api = api
        self.selector = selector
        self.ttl = ttl
        self.idle = idle
        self.clock = clock
        self.held: dict[str, _Held] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._keeper: asyncio.Task[None] | None = None

    async def assign(self, request: Request, host: str, session: str) -> None:
        if self._keeper is None:
            self._keeper = asyncio.ensure_future(self._keep())
        async with self._locks.setdefault(session, asyncio.Lock()):
            held = self.held.get(session)
            if held is None:
                lease = await self.api.acquire(self.selector, target=host, ttl=self.ttl)
                held = self.held[session] = _Held(lease, self.clock(), self.clock())
        held.used = self.clock()
        held.in_flight += 1
        url = held.lease.proxy_url
        if url is None:
            raise IgnoreRequest(f"lease {held.lease.lease_id}: its proxy left the inventory")
        request.meta["proxy"] = url

    def answered(self, session: str) -> None:
        held = self.held.get(session)
        if held is not None:
            held.in_flight = max(0, held.in_flight - 1)
            held.used = self.clock()

    async def banned(self, ban: Ban) -> None:
        held = self.held.get(ban.session)
        # A request of a session already dropped finds no lease: its ban was reported.
        if held is not None:
            await _report(self.api.report(held.lease.lease_id, ban.result, ban.host, ban.retry_after), ban)
        await self.drop(ban.session)

    async def failed(self, session: str, host: str) -> None:
        await self.banned(Ban(session, host, "error"))

    async def drop(self, session: str) -> None:
        held = self.held.pop(session, None)
        if held is None:
            return
        try:
            await self.api.release(held.lease.lease_id)
        except ProxyOperatorError as e:
            logger.warning("proxy-operator: releasing lease %s failed: %s", held.lease.lease_id, e)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(max(0.2, min(self.ttl, self.idle) / 4))
            await self.keep(self.clock())

    async def keep(self, now: float) -> None:
        """Releases the leases idle at ``now``, renews those past half their TTL (a lease that
        cannot be renewed is dropped: the session's next request takes another)."""
        for session, held in list(self.held.items()):
            if held.in_flight == 0 and now - held.used >= self.idle:
                await self.drop(session)
            elif now - held.renewed >= self.ttl / 2:
                try:
                    held.lease = await self.api.renew(held.lease.lease_id, self.ttl)
                    held.renewed = now
                except ProxyOperatorError as e:
                    logger.info("proxy-operator: lease %s not renewed (%s): the session takes another", held.lease.lease_id, e)
                    await self.drop(session)

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
        for session in list(self.held):
            await self.drop(session)


def _max_waits(settings: BaseSettings) -> dict[Refusal, float]:
    """``PROXY_OPERATOR_MAX_WAITS``: seconds by kind of refusal."""
    waits: dict[Refusal, float] = {}
    for kind, seconds in dict(settings.getdict("PROXY_OPERATOR_MAX_WAITS")).items():
        known = next((refusal for refusal in REFUSALS if refusal == kind), None)
        if known is None:
            raise ConfigError(f"PROXY_OPERATOR_MAX_WAITS: {kind!r} is not one of {', '.join(REFUSALS)}")
        waits[known] = float(seconds)
    return waits


def _gateway_refusal(status: int, details: str | None) -> Refusal | None:
    """The kind of a refusal the gateway made itself: its ``Proxy-Status`` details for a quota,
    else any ``503`` (no proxy free, or a ledger that could not take the lease)."""
    if details == "quota_exceeded":
        return "quota_exceeded"
    if status != 503:
        return None
    return "no_match" if details in (None, "no_match") else "unavailable"


def _ban_statuses(settings: BaseSettings) -> dict[int, str]:
    value = settings.get("PROXY_OPERATOR_BAN_STATUSES") or {403: "blocked", 429: "rate_limited"}
    statuses = {int(status): str(result) for status, result in dict(value).items()}
    for status, result in statuses.items():
        if result not in ("blocked", "rate_limited", "error"):
            raise ConfigError(f"PROXY_OPERATOR_BAN_STATUSES: {status} maps to {result!r}, not blocked, rate_limited or error")
    return statuses


class ProxyOperatorMiddleware:
    """The downloader middleware (see the module's documentation for its settings)."""

    def __init__(self, crawler: Crawler) -> None:
        settings = crawler.settings
        self.stats = crawler.stats
        mode = settings.get("PROXY_OPERATOR_MODE", "gateway")
        if mode not in ("gateway", "lease"):
            raise ConfigError(f"PROXY_OPERATOR_MODE must be 'gateway' or 'lease', not {mode!r}")
        self.mode = mode
        self.url = resolve_url(settings.get("PROXY_OPERATOR_URL"), ENV_URL)
        self.token = TokenSource(settings.get("PROXY_OPERATOR_TOKEN"), settings.get("PROXY_OPERATOR_TOKEN_FILE"))
        self.gateway = resolve_url(settings.get("PROXY_OPERATOR_GATEWAY"), ENV_GATEWAY) if mode == "gateway" else None
        self.crawler_name = settings.get("PROXY_OPERATOR_CRAWLER")
        self.selector = {str(k): str(v) for k, v in dict(settings.getdict("PROXY_OPERATOR_SELECTOR")).items()}
        self.session_ttl = settings.get("PROXY_OPERATOR_SESSION_TTL")
        self.pool = SessionPool(settings.getint("PROXY_OPERATOR_SESSIONS_PER_HOST", 4))
        detector = settings.get("PROXY_OPERATOR_BAN_DETECTOR")
        self.ban_rule = BanRule(_ban_statuses(settings), load_object(detector) if isinstance(detector, str) else detector)
        self.max_retries = settings.getint("PROXY_OPERATOR_MAX_RETRIES", 5)
        # A waking pool's 503 pool_waking is waited on up to its wakeTimeout, past its budget;
        # a tenant's 429 quota_exceeded up to its budget, however many answers that takes.
        waits = _max_waits(settings)
        self.retry = RetryPolicy(
            attempts=10,
            max_wait=settings.getfloat("PROXY_OPERATOR_MAX_WAIT", 30.0),
            no_match=waits.get("no_match"),
            pool_waking=waits.get("pool_waking"),
            quota_exceeded=waits.get("quota_exceeded"),
            unavailable=waits.get("unavailable"),
            too_many=waits.get("too_many"),
        )
        self.timeout = settings.getfloat("PROXY_OPERATOR_TIMEOUT", 10.0)
        self.lease_ttl = settings.getint("PROXY_OPERATOR_LEASE_TTL", 120)
        self.lease_idle = settings.getfloat("PROXY_OPERATOR_LEASE_IDLE", 60.0)
        self._route: _Route | None = None
        self._api: AsyncClient | None = None
        self._started: set[str] = set()

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> ProxyOperatorMiddleware:
        if not crawler.settings.getbool("PROXY_OPERATOR_ENABLED", True):
            raise NotConfigured("PROXY_OPERATOR_ENABLED is false")
        middleware = cls(crawler)
        crawler.signals.connect(middleware.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(middleware.spider_closed, signal=signals.spider_closed)
        return middleware

    def spider_opened(self, spider: Spider) -> None:
        if self.crawler_name is None:
            self.crawler_name = spider.name

    async def spider_closed(self, spider: Spider) -> None:
        if self._route is not None:
            await self._route.close()
        if self._api is not None:
            await self._api.aclose()

    def _route_now(self) -> _Route:
        """The route, made on first use inside the running event loop (httpx's async client
        belongs to the loop it first runs in)."""
        if self._route is None:
            self._api = AsyncClient(self.url, tokens=self.token, timeout=self.timeout, retry=self.retry)
            if self.gateway is not None:
                self._route = _GatewayRoute(self._api, self.gateway, self.token, self.crawler_name or "scrapy", self.selector, self.session_ttl)
            else:
                self._route = _LeaseRoute(self._api, self.selector, self.lease_ttl, self.lease_idle)
        return self._route

    def _inc(self, key: str) -> None:
        if self.stats is not None:
            self.stats.inc_value(f"proxy_operator/{key}")

    async def process_request(self, request: Request, spider: Spider | None = None) -> None:
        if request.meta.get("proxy") is not None and _ASSIGNED_META not in request.meta:
            return  # a proxy chosen by someone else
        host = urlparse_cached(request).hostname
        if not host:
            return
        session = request.meta.get(SESSION_META) or self.pool.pick(host)
        if session not in self._started:
            self._started.add(session)
            self._inc("sessions")
        try:
            await self._route_now().assign(request, host, session)
        except (NoMatch, Unavailable):
            self._inc("unavailable")
            raise
        except QuotaExceeded:
            self._inc("quota_exceeded")
            raise
        request.meta[_ASSIGNED_META] = session
        request.meta["download_slot"] = session

    async def process_response(self, request: Request, response: Response, spider: Spider | None = None) -> Request | Response:
        session = request.meta.get(_ASSIGNED_META)
        if session is None:
            return response
        self._route_now().answered(session)
        host = urlparse_cached(request).hostname or ""
        if self.gateway is not None and request.url.startswith("http:"):
            # The gateway's own answers name it in Proxy-Status and name no upstream proxy
            # (inside TLS, every answer is the target's).
            status = gateway_status(response)
            if status is not None or _PROXY_NAME_HEADER not in response.headers:
                return await self._gateway_answer(request, response, session, (status or {}).get("details"))
        result = self.ban_rule.of(response)
        if result is None:
            return response
        self._inc(f"bans/{result}")
        lease = response.headers.get(_PROXY_LEASE_HEADER) if self.gateway is not None else None
        ban = Ban(
            session,
            host,
            result,
            retry_after=retry_after_seconds(response.headers.get(b"Retry-After")),
            lease_id=lease.decode("latin-1") if lease else None,
            reported=response.headers.get(_BAN_REPORTED_HEADER) is not None,
            first=self.pool.retire(session) or SESSION_META in request.meta,
        )
        await self._route_now().banned(ban)
        return self._retry(request, f"ban ({result})") or response

    async def _gateway_answer(self, request: Request, response: Response, session: str, details: str | None) -> Request | Response:
        """An answer of the gateway itself (not of the target), so never a ban: a refusal for
        the tenant's quota (``details`` ``quota_exceeded``) and 503 "no proxy free" are waited
        on, 502 (every upstream failed) retried on a new session; anything else (400, 407:
        bad settings) goes through."""
        kind = _gateway_refusal(response.status, details)
        if kind == "quota_exceeded":
            self._inc("quota_exceeded")
            return await self._wait(request, response, kind, "over the tenant's quota")
        if kind is not None:
            self._inc("unavailable")
            return await self._wait(request, response, kind, "no proxy free")
        if response.status == 502:
            self._inc("errors")
            await self._route_now().drop(session)
            self.pool.retire(session)
            return self._retry(request, "the gateway's upstreams failed") or response
        if response.status in (400, 407):
            logger.error(
                "proxy-operator: the gateway refused %s (%s): %s",
                request.url,
                response.status,
                response.body[:300].decode("utf-8", "replace"),
            )
        return response

    async def _wait(self, request: Request, response: Response, kind: Refusal, why: str) -> Request | Response:
        """The request again after the answer's ``Retry-After``, or the answer once the request
        has waited its budget for this ``kind`` of refusal."""
        waits: dict[str, float] = dict(request.meta.get(_WAITED_META, {}))
        waited = waits.get(kind, 0.0)
        left = self.retry.budget(kind) - waited
        if left <= 0:
            logger.info("proxy-operator: %s for %.0f s; giving up on %s", why, waited, request.url)
            return response
        # Retry-After says when a lease, a cooldown or the quota's wait ends; a proxy can also
        # come back healthy (a lease be given back) sooner, so look again at least every
        # UNAVAILABLE_POLL seconds.
        after = retry_after_seconds(response.headers.get(b"Retry-After")) or 1.0
        wait = min(after, UNAVAILABLE_POLL, left)
        await asyncio.sleep(wait)
        retry = request.replace(dont_filter=True)
        retry.meta[_WAITED_META] = {**waits, kind: waited + wait}
        return retry

    async def process_exception(self, request: Request, exception: BaseException, spider: Spider | None = None) -> Request | None:
        session = request.meta.get(_ASSIGNED_META)
        if session is None:
            return None
        self._route_now().answered(session)
        if isinstance(exception, (IgnoreRequest, ProxyOperatorError)):
            return None
        self._inc("errors")
        await self._route_now().failed(session, urlparse_cached(request).hostname or "")
        self.pool.retire(session)
        retry = self._retry(request, f"{type(exception).__name__}: {exception}")
        if retry is None:
            return None
        # A proxy that just died is still listed until its probes fail: back off a little
        # more on each retry, so the next session lands on a proxy known to be alive.
        await asyncio.sleep(min(TRANSPORT_BACKOFF_CAP, TRANSPORT_BACKOFF * 2 ** request.meta.get(_RETRIES_META, 0)))
        return retry

    def _retry(self, request: Request, why: str) -> Request | None:
        """The request again on a new session, or ``None`` once it was retried enough."""
        retries = request.meta.get(_RETRIES_META, 0)
        if retries >= self.max_retries:
            self._inc("retries_exhausted")
            logger.info("proxy-operator: %s after %d retries; giving up on %s", why, retries, request.url)
            return None
        self._inc("retries")
        retry = request.replace(dont_filter=True)
        retry.meta[_RETRIES_META] = retries + 1
        retry.meta.pop(_ASSIGNED_META, None)
        retry.meta.pop("proxy", None)
        logger.debug("proxy-operator: %s; retrying %s on another session", why, request.url)
        return retry
