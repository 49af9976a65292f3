"""The client's pure parts: proxy URLs, waits, session names, ban rules."""

from __future__ import annotations

from datetime import datetime, timezone

import httpx
import pytest

from proxy_operator import ConfigError, NoMatch, RetryPolicy, Unavailable, gateway_proxy_url
from proxy_operator.calls import error_of
from proxy_operator.models import parse_time
from proxy_operator.scrapy import retry_after_seconds
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
    ],
)
def test_which_refusals_are_waited_on(status, body, retry_after, waited, attempt, wait) -> None:
    error = error_of(_answer(status, body, retry_after))
    assert error.status == status and error.code == body["error"]
    assert RetryPolicy(attempts=3, max_wait=30.0).wait(error, waited, attempt) == wait


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
