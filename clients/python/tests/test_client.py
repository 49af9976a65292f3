"""The sync and async clients against the real binary (standalone) and real squids."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness import DEADLINE, TOKEN, Operator, Site, Tenant, eventually, start_operator
from proxy_operator import (
    ApiError,
    AsyncClient,
    Banned,
    Client,
    ConfigError,
    Lease,
    NoMatch,
    PoolWaking,
    QuotaExceeded,
    RetryPolicy,
    TooManyRequests,
    TransportError,
    Unavailable,
    gateway_proxy_url,
)
from proxy_operator.calls import NO_WAIT

TARGET = "127.0.0.1"
ACQUIRE_WAITING = Path(__file__).parent / "acquire_waiting.py"


def test_list_acquire_use_renew_report_release(operator: Operator, site: Site) -> None:
    with Client(operator.api, token=TOKEN) as client:
        proxies = client.list(healthy=True)
        assert sorted(p.name for p in proxies) == ["px-0", "px-1"]
        assert all(p.labels == {"pool": "python"} and p.max_leases == 16 for p in proxies)
        assert client.list(selector={"pool": "elsewhere"}) == []

        lease = client.acquire(selector={"pool": "python"}, target=TARGET, ttl=30)
        assert lease.state == "active" and lease.ttl_seconds == 30 and lease.target == TARGET
        exit_address = httpx.get(site.url("/ip"), proxy=lease.proxy_url, timeout=10).text
        assert operator.proxy_name_of(exit_address) == f"default/{lease.proxy.name}"

        renewed = client.renew(lease.lease_id, ttl=120)
        assert renewed.expires_at > lease.expires_at and renewed.ttl_seconds == 120
        client.report(lease.lease_id, "ok", target=TARGET)
        client.release(lease.lease_id)
        client.release(lease.lease_id)  # twice is no error
        released = client.get(lease.lease_id)
        assert released.state == "released" and released.released_at is not None

    kinds = operator.sql(f"SELECT kind FROM lease_history WHERE lease_id = '{lease.lease_id}' ORDER BY rowid")
    assert [k for (k,) in kinds] == ["acquired", "renewed", "reported", "released"]


def test_an_acquire_retried_with_its_request_id_is_granted_once(operator: Operator) -> None:
    with Client(operator.api, token=TOKEN) as client:
        first = client.acquire(target=TARGET, request_id="crawl-7-attempt-1")
        again = client.acquire(target=TARGET, request_id="crawl-7-attempt-1")
        assert again.lease_id == first.lease_id
        with pytest.raises(ApiError) as reused:
            client.acquire(target="other.example", request_id="crawl-7-attempt-1")
        assert reused.value.status == 422 and reused.value.code == "request_id_reused"
    assert operator.active_leases() == 1


def test_refusals_raise_with_the_json_error_code(operator: Operator) -> None:
    with Client(operator.api, token=TOKEN) as client:
        with pytest.raises(ApiError) as unknown:
            client.get("no-such-lease")
        assert (unknown.value.status, unknown.value.code) == (404, "unknown_lease")
        with pytest.raises(ApiError) as target:
            client.acquire(target="   ")
        assert (target.value.status, target.value.code) == (400, "invalid_target")
        with pytest.raises(ValueError, match="not one of"):
            client.report("x", "captcha")
        started = time.monotonic()
        with pytest.raises(NoMatch) as nothing:
            client.acquire(selector={"pool": "elsewhere"})
        assert nothing.value.retry_after is None, "nothing frees a proxy that does not exist"
        assert nothing.value.body["considered"] == 0
        assert time.monotonic() - started < 5, "not waited on"
    with Client(operator.api, token="wrong-token-0123456789") as client:
        with pytest.raises(ApiError) as denied:
            client.list()
        assert denied.value.status == 401


def test_a_full_fleet_is_waited_on_as_retry_after_says(tmp_path: Path, site: Site) -> None:
    with start_operator(tmp_path, site, squids=2, max_leases=1) as operator:
        with Client(operator.api, token=TOKEN, retry=NO_WAIT) as client:
            held = [client.acquire(ttl=2), client.acquire(ttl=2)]
            with pytest.raises(NoMatch) as full:
                client.acquire(ttl=2)
            assert full.value.retry_after is not None and full.value.retry_after <= 3
        with Client(operator.api, token=TOKEN, retry=RetryPolicy(attempts=5, max_wait=20)) as client:
            started = time.monotonic()
            lease = client.acquire(ttl=30)
            assert time.monotonic() - started >= 0.5, "it waited for an expiry"
            assert lease.lease_id not in {h.lease_id for h in held}


def test_a_ban_inside_the_lease_block_is_reported_then_released(operator: Operator) -> None:
    with Client(operator.api, token=TOKEN) as client:
        with pytest.raises(Banned):
            with client.lease(target=TARGET) as lease:
                raise Banned("rate_limited", retry_after=90)
        with client.lease(target=TARGET) as other:
            assert other.proxy.name != lease.proxy.name, "the banned proxy cools down for the target"
        with pytest.raises(KeyError):
            with client.lease(target=TARGET) as plain:
                raise KeyError("not a ban")
    rows = operator.sql(
        f"SELECT result, cooldown_seconds FROM lease_history WHERE lease_id = '{lease.lease_id}' AND kind = 'reported'"
    )
    assert rows == [("rate_limited", 90.0)]
    assert operator.sql(f"SELECT COUNT(*) FROM lease_history WHERE lease_id = '{plain.lease_id}' AND kind = 'reported'") == [(0,)]
    assert operator.active_leases() == 0


def test_the_token_comes_from_the_environment_or_a_file_read_again_after_a_401(
    operator: Operator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROXY_OPERATOR_URL", operator.api)
    monkeypatch.setenv("PROXY_OPERATOR_TOKEN", TOKEN)
    with Client() as client:
        assert len(client.list()) == 2
    monkeypatch.delenv("PROXY_OPERATOR_TOKEN")
    token_file = tmp_path / "token"
    token_file.write_text("an-old-token-0123456789\n")
    monkeypatch.setenv("PROXY_OPERATOR_TOKEN_FILE", str(token_file))
    with Client() as client:
        token_file.write_text(TOKEN + "\n")  # rotated after the client read it
        assert len(client.list()) == 2
    monkeypatch.delenv("PROXY_OPERATOR_TOKEN_FILE")
    with pytest.raises(ConfigError, match="PROXY_OPERATOR_TOKEN"):
        Client()


def test_every_call_has_a_timeout() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with Client(url, token=TOKEN, timeout=0.5) as client:
            started = time.monotonic()
            with pytest.raises(TransportError):
                client.list()
            assert time.monotonic() - started < 10


def test_the_async_client_and_gateway_sessions(operator: Operator, site: Site) -> None:
    async def scenario() -> str:
        async with AsyncClient(operator.api, token=TOKEN) as client:
            assert len(await client.list(healthy=True)) == 2
            async with client.lease(target=TARGET, ttl=30) as lease:
                assert (await client.get(lease.lease_id)).state == "active"
                await client.renew(lease.lease_id)
            assert (await client.get(lease.lease_id)).state == "released"

            # A gateway session, then its ban reported by name (as inside TLS) and the session ended.
            proxy = gateway_proxy_url(operator.gateway, TOKEN, "pytest", session="s1")
            async with httpx.AsyncClient(proxy=proxy, timeout=10) as crawler:
                first = await crawler.get(site.url("/ip"))
                assert first.status_code == 200
                session_lease = first.headers["x-proxy-lease"]
            await client.report_session("s1", "blocked", target=TARGET, retry_after=60)
            await client.end_session("s1")
            await client.end_session("s1")
            with pytest.raises(ApiError) as gone:
                await client.report_session("s1", "blocked")
            assert gone.value.code == "unknown_session"
            async with httpx.AsyncClient(proxy=proxy, timeout=10) as crawler:
                second = await crawler.get(site.url("/ip"))
            assert second.headers["x-proxy-name"] != first.headers["x-proxy-name"], "cooled down"
            return session_lease

    session_lease = asyncio.run(scenario())
    assert operator.sql(f"SELECT state FROM leases WHERE id = '{session_lease}'") == [("released",)]
    assert operator.sql(
        f"SELECT result, cooldown_seconds FROM lease_history WHERE lease_id = '{session_lease}' AND kind = 'reported'"
    ) == [("blocked", 60.0)]


@dataclass(frozen=True)
class RecordingPolicy(RetryPolicy):
    """A policy that records each wait it decides on, so a test sees a call waiting."""

    waits: list[tuple[ApiError, float]] = field(default_factory=list, compare=False, repr=False)

    def wait(self, error: ApiError, waited: float, attempt: int) -> float | None:
        seconds = super().wait(error, waited, attempt)
        if seconds is not None:
            self.waits.append((error, seconds))
        return seconds


def test_an_acquire_over_the_leases_quota_waits_until_a_lease_is_given_back(tmp_path: Path, site: Site) -> None:
    team = Tenant("team-a", "team-a-token-0123456789", {"leases": 1})
    with start_operator(tmp_path, site, squids=2, tenants=[team]) as operator:
        # attempts=1: a quota is waited on however many answers it takes, within max_wait.
        policy = RecordingPolicy(attempts=1, max_wait=DEADLINE)
        outcome: dict[str, Any] = {}

        def acquire_waiting() -> None:
            try:
                with Client(operator.api, token=team.token, retry=policy) as waiter:
                    outcome["lease"] = waiter.acquire(target=TARGET)
            except BaseException as e:  # reported by the test thread below
                outcome["error"] = e

        with Client(operator.api, token=team.token) as holder:
            held = holder.acquire(target=TARGET)
            waiter = threading.Thread(target=acquire_waiting)
            waiter.start()
            eventually("the second acquire refused for the quota", lambda: len(policy.waits) >= 1)
            assert not outcome, "no lease while the quota is full"
            holder.release(held.lease_id)
            waiter.join(timeout=DEADLINE + 10)
        if "error" in outcome:
            raise outcome["error"]
        lease: Lease = outcome["lease"]
        assert lease.state == "active" and lease.lease_id != held.lease_id
        refused, seconds = policy.waits[0]
        assert isinstance(refused, QuotaExceeded)
        assert (refused.tenant, refused.quota, refused.limit, refused.burst) == ("team-a", "leases", 1.0, None)
        assert 1 <= seconds <= 5, "Retry-After: when the quota frees up by itself, at most 5 s"
        assert all(isinstance(error, QuotaExceeded) for error, _ in policy.waits)
        assert operator.sql("SELECT COUNT(*) FROM leases WHERE tenant = 'team-a'") == [(2,)], "granted once"
        assert operator.metric('proxy_operator_tenant_refusals_total{reason="quota_leases",tenant="team-a"}') >= 1


def test_an_acquire_still_over_its_quota_raises_quota_exceeded(tmp_path: Path, site: Site) -> None:
    leases = Tenant("team-a", "team-a-token-0123456789", {"leases": 1})
    rate = Tenant("team-b", "team-b-token-0123456789", {"acquiresPerSecond": 0.1, "burst": 1})
    with start_operator(tmp_path, site, squids=2, tenants=[leases, rate]) as operator:
        with Client(operator.api, token=leases.token, retry=RetryPolicy(attempts=3, max_wait=2)) as client:
            client.acquire(target=TARGET)
            started = time.monotonic()
            with pytest.raises(QuotaExceeded) as over:
                client.acquire(target=TARGET)
            assert time.monotonic() - started >= 2, "it waited max_wait first"
        error = over.value
        assert isinstance(error, TooManyRequests) and (error.status, error.code) == (429, "quota_exceeded")
        assert (error.tenant, error.quota, error.limit, error.burst) == ("team-a", "leases", 1.0, None)
        assert error.retry_after is not None and 1 <= error.retry_after <= 5

        async def over_the_rate() -> QuotaExceeded:
            async with AsyncClient(operator.api, token=rate.token, retry=NO_WAIT) as client:
                await client.acquire(target=TARGET)
                with pytest.raises(QuotaExceeded) as over:
                    await client.acquire(target=TARGET)
                return over.value

        error = asyncio.run(over_the_rate())
        assert (error.tenant, error.quota, error.limit, error.burst) == ("team-b", "acquiresPerSecond", 0.1, 1)
        assert error.retry_after is not None and 1 <= error.retry_after <= 10, "the bucket refills one in 10 s"
        # The default tenant (DISCOVERY_TOKEN) has no quota.
        with Client(operator.api, token=TOKEN, retry=NO_WAIT) as client:
            assert client.acquire(target=TARGET).state == "active"


class WakingApi:
    """A loopback stand-in for the lease API in front of a pool scaled to zero (standalone has
    no pools): its first ``waking`` acquires are answered ``503 pool_waking`` (``Retry-After:
    0``, ``wakeTimeoutSeconds``: ``wake_timeout``), the next ``overloaded`` ones ``503
    overloaded`` (``Retry-After: 1``: the ledger's queue was full as the pool came up), then
    one is granted; releases succeed."""

    def __init__(self, waking: int, wake_timeout: float = 10, overloaded: int = 0):
        self.waking = waking
        self.overloaded = overloaded
        self.request_ids: list[str] = []
        self.released: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.request_ids.append(body["requestID"])
                if len(api.request_ids) <= api.waking:
                    answer = {"error": "pool_waking", "message": "waking", "pools": ["crawl/eu"], "wakeTimeoutSeconds": wake_timeout}
                    self._send(503, answer, {"Retry-After": "0"})
                elif len(api.request_ids) <= api.waking + api.overloaded:
                    answer = {"error": "overloaded", "message": "the ledger's queue is full"}
                    self._send(503, answer, {"Retry-After": "1"})
                else:
                    self._send(201, {
                        "leaseID": "lease-1",
                        "proxy": {"name": "eu-abc12", "namespace": "crawl", "host": "127.0.0.9", "port": 3128, "url": "http://127.0.0.9:3128"},
                        "state": "active",
                        "acquiredAt": "2026-12-01T10:00:00Z",
                        "expiresAt": "2026-12-01T10:05:00Z",
                        "ttlSeconds": 300,
                    })

            def do_DELETE(self) -> None:
                api.released.append(self.path.rsplit("/", 1)[-1])
                self._send(204, None)

            def _send(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                if data:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def waking_api() -> Iterator[WakingApi]:
    api = WakingApi(waking=3)
    yield api
    api.close()


def test_a_waking_pool_is_waited_on_past_attempts_and_max_wait(waking_api: WakingApi) -> None:
    # Three answers with Retry-After 0 (asked again a second apart): past attempts=1 and
    # max_wait=0, within the pool's wakeTimeoutSeconds.
    with Client(waking_api.url, token=TOKEN, retry=RetryPolicy(attempts=1, max_wait=0.0)) as client:
        lease = client.acquire(selector={"geo": "eu"})
    assert lease.lease_id == "lease-1" and len(waking_api.request_ids) == 4
    assert len(set(waking_api.request_ids)) == 1, "one request ID for every ask"
    with Client(waking_api.url, token=TOKEN, retry=NO_WAIT) as client:
        waking_api.request_ids.clear()
        with pytest.raises(PoolWaking) as waking:
            client.acquire()
        assert waking.value.pools == ["crawl/eu"] and waking.value.wake_timeout == 10


def test_an_overloaded_answer_after_a_long_wake_is_still_waited_on() -> None:
    # Three pool_waking answers a second apart spend 3 s, past max_wait=2 (the wake timeout
    # allows it); the overloaded answer that follows has 2 s of its own.
    api = WakingApi(waking=3, overloaded=1)
    try:
        started = time.monotonic()
        with Client(api.url, token=TOKEN, retry=RetryPolicy(attempts=3, max_wait=2.0)) as client:
            lease = client.acquire(selector={"geo": "eu"})
        assert lease.lease_id == "lease-1" and len(api.request_ids) == 5
        assert len(set(api.request_ids)) == 1, "one request ID for every ask"
        assert time.monotonic() - started >= 4, "3 s of the wake, 1 s of the overloaded ledger"
        # A budget of its own, not endless: an unavailable budget shorter than Retry-After
        # raises the overloaded answer at once.
        api.request_ids.clear()
        with Client(api.url, token=TOKEN, retry=RetryPolicy(attempts=3, max_wait=30.0, unavailable=0.5)) as client:
            with pytest.raises(Unavailable) as refused:
                client.acquire(selector={"geo": "eu"})
        assert refused.value.code == "overloaded" and len(api.request_ids) == 4
    finally:
        api.close()


def _acquire_waiting(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ACQUIRE_WAITING), *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_the_acquire_waiting_script_counts_the_answers_it_waited_through(waking_api: WakingApi) -> None:
    done = _acquire_waiting(waking_api.url, TOKEN, '{"geo": "eu"}', "30")
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["leaseID"] == "lease-1" and line["proxy"] == "crawl/eu-abc12"
    assert line["poolWakingAnswers"] == 3 and line["waitedSeconds"] >= 3.0
    assert waking_api.released == ["lease-1"]


def test_the_acquire_waiting_script_against_the_binary(operator: Operator) -> None:
    env = {"DISCOVERY_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"}
    done = _acquire_waiting(operator.api, "-", '{"pool": "python"}', "30", env=env)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["proxy"] in ("default/px-0", "default/px-1") and line["poolWakingAnswers"] == 0
    assert operator.sql(f"SELECT state FROM leases WHERE id = '{line['leaseID']}'") == [("released",)]
    refused = _acquire_waiting(operator.api, TOKEN, '{"pool": "elsewhere"}', "30")
    assert refused.returncode == 1 and json.loads(refused.stdout)["code"] == "no_match"
    assert _acquire_waiting(operator.api, TOKEN, "[]", "30").returncode == 2
