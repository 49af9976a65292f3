"""The client's pure parts: proxy URLs, waits, session names, ban rules."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import httpx
import pytest

from harness import free_port
from proxy_operator import (
    REFUSALS,
    ApiError,
    ConfigError,
    NoMatch,
    PoolWaking,
    QuotaExceeded,
    RetryPolicy,
    TooManyRequests,
    Unavailable,
    gateway_proxy_url,
)
from proxy_operator.calls import NO_WAIT, error_of, refusal_of
from proxy_operator.models import LeaseProxy, parse_time
from proxy_operator.scrapy import gateway_status, retry_after_seconds
from proxy_operator.sessions import SessionPool


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, "http://crawler:t0k@gw:8888"),
        ({"session": "s1"}, "http://crawler;session=s1:t0k@gw:8888"),
        (
            {"session": "s1", "session_ttl": "30s", "selector": {"geo": "eu", "a": "b"}},
            "http://crawler;session=s1;sessionTTL=30s;a=b;geo=eu:t0k@gw:8888",
        ),
        ({"crawler": "my crawler"}, "http://my%20crawler:t0k@gw:8888"),
        (
            {"fallback": "own-then-rented", "selector": {"geo": "de"}},
            "http://crawler;fallback=own-then-rented;geo=de:t0k@gw:8888",
        ),
    ],
)
def test_gateway_proxy_urls(kwargs: dict, expected: str) -> None:
    assert gateway_proxy_url("http://gw:8888/", "t0k", **kwargs) == expected


def test_a_token_with_url_characters_is_escaped() -> None:
    assert gateway_proxy_url("http://gw:8888", "a:b@c/d") == "http://crawler:a%3Ab%40c%2Fd@gw:8888"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"session": "a;b"},
        {"session": "a:b"},
        {"selector": {"session": "x"}},
        {"selector": {"fallback": "x"}},
        {"selector": {"tls": "inspect"}},
        {"selector": {"geo": "e@u"}},
        {"crawler": "a/b"},
    ],
)
def test_gateway_options_that_would_change_meaning_are_refused(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        gateway_proxy_url("http://gw:8888", "t0k", **kwargs)


def test_a_gateway_url_must_be_http() -> None:
    with pytest.raises(ConfigError, match="not an http"):
        gateway_proxy_url("gw:8888", "t0k")


def _answer(status: int, body: object, retry_after: str | None = None) -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after else {}
    return httpx.Response(status, json=body, headers=headers)


@pytest.mark.parametrize(
    ("status", "body", "retry_after", "waited", "attempt", "wait"),
    [
        (409, {"error": "no_match", "message": "m"}, "3", 0.0, 0, 3.0),
        (409, {"error": "no_match", "message": "m"}, None, 0.0, 0, None),  # nothing frees by itself
        (503, {"error": "overloaded", "message": "m"}, "1", 0.0, 0, 1.0),
        (503, {"error": "overloaded", "message": "m"}, "1", 0.0, 3, None),  # out of attempts
        (409, {"error": "no_match", "message": "m"}, "20", 15.0, 1, None),  # past max_wait
        (404, {"error": "unknown_lease", "message": "m"}, "1", 0.0, 0, None),
        (422, {"error": "request_id_reused", "message": "m"}, None, 0.0, 0, None),
        (429, {"error": "too_many_requests", "message": "m"}, "2", 0.0, 0, 2.0),  # any 429 ...
        (429, {"error": "too_many_requests", "message": "m"}, "2", 0.0, 3, None),  # ... like a 503
        (429, {"error": "too_many_requests", "message": "m"}, "20", 15.0, 1, None),
        (429, {"error": "too_many_requests", "message": "m"}, None, 0.0, 0, None),
    ],
)
def test_which_refusals_are_waited_on(status, body, retry_after, waited, attempt, wait) -> None:
    error = error_of(_answer(status, body, retry_after))
    assert error.status == status and error.code == body["error"]
    assert RetryPolicy(attempts=3, max_wait=30.0).wait(error, waited, attempt) == wait


def _waking(wake_timeout: object = 60) -> dict[str, object]:
    body: dict[str, object] = {"error": "pool_waking", "message": "waking", "pools": ["crawl/eu"]}
    if wake_timeout is not None:
        body["wakeTimeoutSeconds"] = wake_timeout
    return body


@pytest.mark.parametrize(
    ("body", "retry_after", "waited", "attempt", "wait"),
    [
        (_waking(), "2", 0.0, 0, 2.0),
        (_waking(), "2", 28.0, 14, 2.0),  # past attempts and max_wait's 30 s ...
        (_waking(), "2", 40.0, 20, 2.0),
        (_waking(), "2", 58.0, 29, 2.0),  # ... up to wakeTimeoutSeconds
        (_waking(), "2", 60.0, 30, None),  # then raised
        (_waking(), "7", 56.0, 8, 4.0),  # the last wait ends at the limit: asked once more then
        (_waking(), "0", 10.0, 5, 1.0),  # a Retry-After of 0 does not spin
        (_waking(), None, 0.0, 0, None),  # only answers with Retry-After are waited on
        (_waking(90.5), "2", 89.0, 44, 1.5),
        (_waking(10), "2", 20.0, 10, 2.0),  # a shorter wake timeout: max_wait holds
        (_waking(10), "2", 30.0, 15, None),
        (_waking(None), "2", 20.0, 10, 2.0),  # no wakeTimeoutSeconds: max_wait
        (_waking(None), "2", 30.0, 15, None),
        (_waking("60"), "2", 30.0, 15, None),  # not a number: max_wait
        (_waking(True), "2", 30.0, 15, None),
        ({"error": "overloaded", "message": "m", "wakeTimeoutSeconds": 60}, "2", 0.0, 3, None),  # other codes: attempts
        ({"error": "overloaded", "message": "m", "wakeTimeoutSeconds": 60}, "2", 29.0, 1, None),  # and max_wait
    ],
)
def test_a_waking_pool_is_waited_on_up_to_its_wake_timeout(body, retry_after, waited, attempt, wait) -> None:
    error = error_of(_answer(503, body, retry_after))
    assert isinstance(error, PoolWaking) == (body["error"] == "pool_waking")
    assert RetryPolicy(attempts=3, max_wait=30.0).wait(error, waited, attempt) == wait


def test_a_whole_wake_is_waited_through_and_no_wait_never_waits() -> None:
    error = error_of(_answer(503, _waking(60), "2"))
    waited, waits = 0.0, 0
    while (wait := RetryPolicy().wait(error, waited, waits)) is not None:
        waited, waits = waited + wait, waits + 1
    assert (waited, waits) == (60.0, 30)
    assert NO_WAIT.wait(error, 0.0, 0) is None
    assert RetryPolicy(attempts=0, max_wait=100).wait(error, 0.0, 0) is None


#: One answer of each kind of refusal, with the Retry-After it came with.
REFUSAL_ANSWERS = {
    "no_match": (409, {"error": "no_match", "message": "m"}),
    "pool_waking": (503, {"error": "pool_waking", "message": "m", "wakeTimeoutSeconds": 4}),
    "quota_exceeded": (429, {"error": "quota_exceeded", "message": "m", "quota": "leases"}),
    "unavailable": (503, {"error": "overloaded", "message": "m"}),
    "too_many": (429, {"error": "too_many_requests", "message": "m"}),
}


def test_each_kind_of_refusal_is_known_by_its_answer() -> None:
    assert sorted(REFUSAL_ANSWERS) == sorted(REFUSALS)
    for kind, (status, body) in REFUSAL_ANSWERS.items():
        assert refusal_of(error_of(_answer(status, body, "1"))) == kind
    for other in [(503, {"error": "ledger_full", "message": "m"}), (503, {"error": "ledger_unavailable", "message": "m"})]:
        assert refusal_of(error_of(_answer(*other, "1"))) == "unavailable"
    assert refusal_of(error_of(_answer(404, {"error": "unknown_lease", "message": "m"}))) is None


@pytest.mark.parametrize("kind", sorted(REFUSAL_ANSWERS))
def test_each_kind_of_refusal_has_a_budget_of_its_own(kind: str) -> None:
    # Every budget 30 s but this kind's, 6 s: only this kind stops at 6 s (a waking pool's
    # wakeTimeoutSeconds, 4 s here, is shorter than either).
    policy = RetryPolicy(attempts=100, max_wait=30.0, **{kind: 6.0})
    for other, (status, body) in REFUSAL_ANSWERS.items():
        error = error_of(_answer(status, body, "2"))
        budget = 6.0 if other == kind else 30.0
        assert policy.budget(other) == budget, other
        assert policy.wait(error, budget - 2.0, 1) == 2.0, other
        assert policy.wait(error, budget, 1) is None, other


def test_a_long_wake_leaves_the_other_budgets_whole() -> None:
    """What a call spends on one kind of refusal is not taken from another's budget: the
    client counts the seconds and the waits of each kind apart."""
    from proxy_operator import calls
    from proxy_operator.client import Client, _Again, _Tries

    waking = _answer(503, {"error": "pool_waking", "message": "m", "wakeTimeoutSeconds": 60}, "2")
    overloaded = _answer(503, {"error": "overloaded", "message": "m"}, "1")
    no_match = _answer(409, {"error": "no_match", "message": "m"}, "1")
    call = calls.acquire(None, None, None, "py-test")
    tries = _Tries()
    with Client("http://127.0.0.1:9", token="t" * 16, retry=RetryPolicy(attempts=3, max_wait=5.0)) as client:
        for answer in [waking] * 25 + [overloaded] * 3 + [no_match] * 3:
            assert isinstance(client._settle(call, answer, tries), _Again)
        # 50 s of a wake (past max_wait: its wake timeout), then three overloaded answers and
        # three no_match ones, each kind within its own attempts and 5 s.
        assert tries.waited == {"pool_waking": 50.0, "unavailable": 3.0, "no_match": 3.0}
        assert tries.waits == {"pool_waking": 25, "unavailable": 3, "no_match": 3}
        with pytest.raises(Unavailable):
            client._settle(call, overloaded, tries)


def test_a_pool_waking_answer_is_read_into_its_fields() -> None:
    body = {"error": "pool_waking", "message": "pool crawl/eu is waking", "pools": ["crawl/eu", "crawl/eu-2"], "wakeTimeoutSeconds": 90}
    error = error_of(_answer(503, body, "2"))
    assert isinstance(error, PoolWaking) and isinstance(error, Unavailable)
    assert (error.status, error.code, error.message) == (503, "pool_waking", "pool crawl/eu is waking")
    assert error.pools == ["crawl/eu", "crawl/eu-2"] and error.wake_timeout == 90.0
    assert error.retry_after == 2.0 and error.body == body
    bare = error_of(_answer(503, {"error": "pool_waking", "message": "m"}))
    assert isinstance(bare, PoolWaking) and bare.pools == [] and bare.wake_timeout is None
    assert not isinstance(error_of(_answer(503, {"error": "overloaded", "message": "m"}, "1")), PoolWaking)
    # Only a 503 is a waking pool.
    assert type(error_of(_answer(409, body, "2"))) is not PoolWaking


def _over_quota(quota: str = "leases", **fields: object) -> dict[str, object]:
    return {"error": "quota_exceeded", "message": "over", "tenant": "team-a", "quota": quota, "limit": 1.0, "retryAfterSeconds": 5, **fields}


@pytest.mark.parametrize(
    ("retry_after", "waited", "attempt", "wait"),
    [
        ("5", 0.0, 0, 5.0),
        ("5", 20.0, 4, 5.0),  # past attempts: a quota frees up, however many answers it takes
        ("5", 27.0, 9, 3.0),  # the last wait ends at max_wait: asked once more then
        ("5", 30.0, 10, None),  # then raised
        ("0", 10.0, 2, 1.0),  # a Retry-After of 0 does not spin
        (None, 0.0, 0, None),  # only answers with Retry-After are waited on
    ],
)
def test_a_quota_is_waited_on_up_to_max_wait_however_many_answers(retry_after, waited, attempt, wait) -> None:
    error = error_of(_answer(429, _over_quota(), retry_after))
    assert isinstance(error, QuotaExceeded)
    assert RetryPolicy(attempts=3, max_wait=30.0).wait(error, waited, attempt) == wait
    assert NO_WAIT.wait(error, 0.0, 0) is None


def test_a_quota_exceeded_answer_is_read_into_its_fields() -> None:
    leases = error_of(_answer(429, _over_quota(), "5"))
    assert isinstance(leases, QuotaExceeded) and isinstance(leases, TooManyRequests) and isinstance(leases, ApiError)
    assert (leases.status, leases.code, leases.message, leases.retry_after) == (429, "quota_exceeded", "over", 5.0)
    assert (leases.tenant, leases.quota, leases.limit, leases.burst) == ("team-a", "leases", 1.0, None)
    rate = error_of(_answer(429, _over_quota("acquiresPerSecond", limit=0.5, burst=2), "2"))
    assert isinstance(rate, QuotaExceeded)
    assert (rate.quota, rate.limit, rate.burst, rate.retry_after) == ("acquiresPerSecond", 0.5, 2, 2.0)
    bare = error_of(_answer(429, {"error": "quota_exceeded", "message": "m", "limit": "20", "burst": True}))
    assert isinstance(bare, QuotaExceeded)
    assert (bare.tenant, bare.quota, bare.limit, bare.burst, bare.retry_after) == (None, None, None, None, None)
    other = error_of(_answer(429, {"error": "too_many_requests", "message": "m"}, "1"))
    assert isinstance(other, TooManyRequests) and not isinstance(other, QuotaExceeded)
    # Only a 429 is a quota refusal of the API (the gateway's is a 503, read by the middleware).
    assert not isinstance(error_of(_answer(503, _over_quota(), "5")), TooManyRequests)


def test_errors_carry_their_kind_and_code() -> None:
    assert isinstance(error_of(_answer(409, {"error": "no_match", "message": "x"})), NoMatch)
    assert isinstance(error_of(_answer(503, {"error": "ledger_full", "message": "x"}, "5")), Unavailable)
    plain = error_of(httpx.Response(502, text="<html>bad gateway</html>"))
    assert plain.code == "http_error" and "bad gateway" in plain.message


def test_times_as_the_api_writes_them() -> None:
    assert parse_time("2026-12-01T10:00:00.123456789Z") == datetime(2026, 12, 1, 10, 0, 0, 123456, timezone.utc)
    assert parse_time("2026-12-01T10:00:00Z") == datetime(2026, 12, 1, 10, 0, 0, tzinfo=timezone.utc)


def test_retry_after_in_seconds_or_as_a_date() -> None:
    now = datetime(2026, 12, 1, 10, 0, 0, tzinfo=timezone.utc)
    assert retry_after_seconds(b"120", now) == 120.0
    assert retry_after_seconds("Tue, 01 Dec 2026 10:01:00 GMT", now) == 60.0
    assert retry_after_seconds("Tue, 01 Dec 2026 09:00:00 GMT", now) == 0.0
    assert retry_after_seconds(b"soon", now) is None
    assert retry_after_seconds(None, now) is None


def _response(status: int, headers: dict[str, object]) -> object:
    from scrapy.http import Request, Response

    url = "http://shop.example/a"
    return Response(url, status=status, headers=headers, request=Request(url))


QUOTA_STATUS = 'proxy-operator; error=http_request_denied; details="quota_exceeded"'


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Proxy-Status": QUOTA_STATUS}, {"error": "http_request_denied", "details": "quota_exceeded"}),
        ({"Proxy-Status": 'proxy-operator; details="no_match"'}, {"details": "no_match"}),
        ({"Proxy-Status": "proxy-operator"}, {}),
        ({"Proxy-Status": 'squid; error=x; details="a, b; c", proxy-operator; details="upstream_failed"'}, {"details": "upstream_failed"}),
        ({"Proxy-Status": ['squid; error=connection_refused', 'proxy-operator;details="a \\"b\\""']}, {"details": 'a "b"'}),
        ({"Proxy-Status": '"proxy-operator"; details=no_match'}, {"details": "no_match"}),
        ({"Proxy-Status": 'squid; details="proxy-operator"'}, None),  # named only in a parameter
        ({"Proxy-Status": "proxy-operator-2; details=x"}, None),
        ({}, None),
    ],
)
def test_the_gateways_own_answers_are_told_by_their_proxy_status(headers, status) -> None:
    assert gateway_status(_response(503, headers)) == status


def test_the_gateways_own_answers_are_never_bans_and_a_quota_refusal_is_waited_on() -> None:
    from scrapy import Request
    from scrapy.utils.test import get_crawler

    from proxy_operator.scrapy import ProxyOperatorMiddleware

    # A ban rule that would take anything for a ban, and a lease API nothing listens on (the
    # ban reported below only logs its failure).
    crawler = get_crawler(settings_dict={
        "PROXY_OPERATOR_URL": f"http://127.0.0.1:{free_port()}",
        "PROXY_OPERATOR_GATEWAY": "http://127.0.0.1:8888",
        "PROXY_OPERATOR_TOKEN": "t" * 16,
        "PROXY_OPERATOR_BAN_STATUSES": {403: "blocked", 429: "rate_limited", 503: "blocked"},
        "PROXY_OPERATOR_BAN_DETECTOR": lambda response: "blocked",
        "PROXY_OPERATOR_MAX_WAIT": 0.05,
    })
    middleware = ProxyOperatorMiddleware.from_crawler(crawler)
    upstream = {"X-Proxy-Name": "default/px-0"}  # the old sign of a target's answer, on purpose

    async def answer(status: int, headers: dict[str, object], request: Request | None = None) -> object:
        request = request or Request("http://shop.example/a")
        await middleware.process_request(request)
        return await middleware.process_response(request, _response(status, headers))

    async def scenario() -> None:
        refused = {"Proxy-Status": QUOTA_STATUS, "Retry-After": "1", **upstream}
        again = await answer(503, refused)
        assert isinstance(again, Request) and again.dont_filter, "sent again after Retry-After"
        gone_on = await answer(503, refused, again)
        assert not isinstance(gone_on, Request) and gone_on.status == 503, "past PROXY_OPERATOR_MAX_WAIT"
        denied = await answer(403, {"Proxy-Status": 'proxy-operator; details="port_not_allowed"', **upstream})
        assert not isinstance(denied, Request) and denied.status == 403
        stats = crawler.stats.get_stats()
        assert stats.get("proxy_operator/quota_exceeded") == 2
        assert not [key for key in stats if key.startswith("proxy_operator/bans/")] and "proxy_operator/retries" not in stats
        # The same answer without the gateway's Proxy-Status is the target's: a ban.
        target = await answer(429, {**upstream, "X-Proxy-Ban-Reported": "rate_limited"})
        assert isinstance(target, Request)
        assert crawler.stats.get_value("proxy_operator/bans/rate_limited") == 1
        await middleware.spider_closed(crawler.spider)

    asyncio.run(scenario())


def test_the_gateways_refusals_are_waited_on_each_within_its_own_budget() -> None:
    from scrapy import Request
    from scrapy.utils.test import get_crawler

    from proxy_operator.scrapy import ProxyOperatorMiddleware

    crawler = get_crawler(settings_dict={
        "PROXY_OPERATOR_URL": f"http://127.0.0.1:{free_port()}",
        "PROXY_OPERATOR_GATEWAY": "http://127.0.0.1:8888",
        "PROXY_OPERATOR_TOKEN": "t" * 16,
        "PROXY_OPERATOR_MAX_WAIT": 0.05,
        "PROXY_OPERATOR_MAX_WAITS": {"no_match": 0.1},
    })
    middleware = ProxyOperatorMiddleware.from_crawler(crawler)
    quota = {"Proxy-Status": QUOTA_STATUS, "Retry-After": "1"}
    no_proxy = {"Proxy-Status": 'proxy-operator; details="no_match"', "Retry-After": "1"}
    ledger = {"Proxy-Status": 'proxy-operator; details="unavailable"', "Retry-After": "1"}

    async def answer(request: Request, status: int, headers: dict[str, object]) -> object:
        await middleware.process_request(request)
        return await middleware.process_response(request, _response(status, headers))

    async def scenario() -> None:
        request = Request("http://shop.example/a")
        # The quota's whole budget, then "no proxy free" (its own, longer budget), then the
        # ledger: each kind is waited on although the request has waited before.
        for headers in [quota, no_proxy, ledger]:
            again = await answer(request, 503, headers)
            assert isinstance(again, Request), headers
            request = again
        waited = request.meta["_proxy_operator_waited"]
        assert waited == pytest.approx({"quota_exceeded": 0.05, "no_match": 0.1, "unavailable": 0.05})
        # Each budget spent: the answers go on.
        for headers in [quota, no_proxy, ledger]:
            gone_on = await answer(request, 503, headers)
            assert not isinstance(gone_on, Request) and gone_on.status == 503, headers
        await middleware.spider_closed(crawler.spider)

    asyncio.run(scenario())


def test_a_session_pool_hands_out_its_names_in_turn_and_renames_a_retired_one() -> None:
    pool = SessionPool(2, run="r")
    first = [pool.pick("example.com") for _ in range(4)]
    assert first == ["r.0.0.example.com", "r.1.0.example.com"] * 2
    assert pool.retire("r.0.0.example.com")
    assert not pool.retire("r.0.0.example.com"), "retired once"
    assert [pool.pick("example.com") for _ in range(2)] == ["r.0.1.example.com", "r.1.0.example.com"]
    assert pool.pick("other.org") == "r.0.0.other.org"
    assert sorted(pool.live()) == ["r.0.0.other.org", "r.0.1.example.com", "r.1.0.example.com"]


def test_session_names_stay_within_what_the_gateway_takes() -> None:
    name = SessionPool(1).pick("x" * 300 + ".example.com")
    assert len(name) <= 128 and ":" not in name and ";" not in name
    assert SessionPool(1).pick("[::1]").endswith("--1-")


def test_an_empty_pool_is_refused() -> None:
    with pytest.raises(ValueError):
        SessionPool(0)


def _middleware(**settings: object) -> object:
    from scrapy.utils.test import get_crawler

    from proxy_operator.scrapy import ProxyOperatorMiddleware

    return ProxyOperatorMiddleware.from_crawler(get_crawler(settings_dict=settings))


def test_the_middleware_refuses_bad_settings_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from scrapy.exceptions import NotConfigured

    for name in ("PROXY_OPERATOR_URL", "PROXY_OPERATOR_GATEWAY", "PROXY_OPERATOR_TOKEN", "PROXY_OPERATOR_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    good = {"PROXY_OPERATOR_URL": "http://api:8090", "PROXY_OPERATOR_GATEWAY": "http://gw:8888", "PROXY_OPERATOR_TOKEN": "t" * 16}
    assert _middleware(**good) is not None
    with pytest.raises(NotConfigured):
        _middleware(**good, PROXY_OPERATOR_ENABLED=False)
    with pytest.raises(ConfigError, match="PROXY_OPERATOR_MODE"):
        _middleware(**good, PROXY_OPERATOR_MODE="direct")
    with pytest.raises(ConfigError, match="PROXY_OPERATOR_GATEWAY"):
        _middleware(**{**good, "PROXY_OPERATOR_GATEWAY": None})
    with pytest.raises(ConfigError, match="PROXY_OPERATOR_BAN_STATUSES"):
        _middleware(**good, PROXY_OPERATOR_BAN_STATUSES={403: "banned"})
    with pytest.raises(ConfigError, match="PROXY_OPERATOR_TOKEN"):
        _middleware(**{**good, "PROXY_OPERATOR_TOKEN": None})
    # Lease mode needs no gateway.
    assert _middleware(**{**good, "PROXY_OPERATOR_GATEWAY": None}, PROXY_OPERATOR_MODE="lease") is not None
    with pytest.raises(ConfigError, match="PROXY_OPERATOR_MAX_WAITS: 'overloaded' is not one of"):
        _middleware(**good, PROXY_OPERATOR_MAX_WAITS={"overloaded": 5})
    waits = _middleware(**good, PROXY_OPERATOR_MAX_WAIT=7, PROXY_OPERATOR_MAX_WAITS={"quota_exceeded": 120})
    budgets = {kind: waits.retry.budget(kind) for kind in REFUSALS}  # type: ignore[attr-defined]
    assert budgets == {"no_match": 7, "pool_waking": 7, "quota_exceeded": 120, "unavailable": 7, "too_many": 7}


@pytest.mark.parametrize(
    ("url", "host", "expected"),
    [
        ("http://10.0.0.1:3128", "10.0.0.1", "http://u%3Bx:p%40ss@10.0.0.1:3128"),
        ("socks5h://10.0.0.1:3128", "10.0.0.1", "socks5h://u%3Bx:p%40ss@10.0.0.1:3128"),
        ("http://[fd00::1]:3128", "fd00::1", "http://u%3Bx:p%40ss@[fd00::1]:3128"),
    ],
)
def test_a_lease_s_proxy_url_keeps_its_scheme_and_escapes_its_credentials(
    url: str, host: str, expected: str
) -> None:
    proxy = LeaseProxy(
        name="p", namespace="n", host=host, port=3128, url=url, username="u;x", password="p@ss"
    )
    assert proxy.url_with_credentials == expected
