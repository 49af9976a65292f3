"""Real Scrapy crawls through the middleware, against the real binary in front of three real
squids, of a site that bans two of their exit addresses after a few pages: one with 429 and
Retry-After, one with a 200 captcha page only the spider's ban detector recognises."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scrapy import Request

from harness import DEADLINE, TOKEN, Operator, Site, Tenant, eventually, run_spider, start_operator
from proxy_operator import AsyncClient
from proxy_operator.scrapy import _LeaseRoute

PAGES = 60
BAN_AFTER = 5
RATE_LIMITING = "127.0.0.20"  # px-0
CAPTCHA = "127.0.0.21"  # px-1
CONCURRENCY = 8

SPIDER = """
import scrapy

def captcha(response):
    return "blocked" if b"captcha" in response.body else None

class Spider(scrapy.Spider):
    name = "pages"

    async def start(self):
        for n in range({pages}):
            yield scrapy.Request("{base}/page/%d" % n)

    def parse(self, response):
        yield {{"url": response.url, "status": response.status, "body": response.text}}
"""


@pytest.fixture
def banning_site() -> Iterator[Site]:
    site = Site(bans={RATE_LIMITING: "429", CAPTCHA: "captcha"}, ban_after=BAN_AFTER)
    yield site
    site.close()


@pytest.fixture
def fleet(tmp_path: Path, banning_site: Site) -> Iterator[Operator]:
    with start_operator(tmp_path, banning_site, squids=3) as operator:
        yield operator


def crawl(directory: Path, site: Site, operator: Operator, **settings: Any) -> dict[str, Any]:
    return run_spider(
        directory,
        SPIDER.format(pages=PAGES, base=site.url("")),
        {
            "DOWNLOADER_MIDDLEWARES": {"proxy_operator.scrapy.ProxyOperatorMiddleware": 610},
            "PROXY_OPERATOR_URL": operator.api,
            "PROXY_OPERATOR_GATEWAY": operator.gateway,
            "PROXY_OPERATOR_TOKEN": TOKEN,
            "PROXY_OPERATOR_BAN_DETECTOR": "spider.captcha",
            "PROXY_OPERATOR_SESSIONS_PER_HOST": 3,
            "CONCURRENT_REQUESTS": CONCURRENCY,
            "CONCURRENT_REQUESTS_PER_DOMAIN": CONCURRENCY,
            "ROBOTSTXT_OBEY": False,
            "TELNETCONSOLE_ENABLED": False,
            "LOG_LEVEL": "INFO",
            **settings,
        },
    )


def assert_every_page_crawled(result: dict[str, Any], site: Site) -> None:
    items = result["items"]
    pages = sorted(item["url"].rsplit("/", 1)[1] for item in items)
    assert pages == sorted(str(n) for n in range(PAGES)), result["stats"]
    assert all(item["status"] == 200 and "captcha" not in item["body"] for item in items)
    assert site.served == {f"/page/{n}" for n in range(PAGES)}


def assert_bans_steered_elsewhere(site: Site) -> None:
    """Each banning address was hit past its ban only by the requests in flight on it when
    the ban came: the cooldown keeps new sessions off it."""
    for address in (RATE_LIMITING, CAPTCHA):
        assert 1 <= site.bans_served[address] <= CONCURRENCY, site.bans_served
        assert site.pages_by_address[address] == BAN_AFTER


def reports(operator: Operator) -> set[tuple[str, str]]:
    rows = operator.sql("SELECT proxy, result FROM lease_history WHERE kind = 'reported'")
    return {(proxy.rsplit("/", 1)[-1], result) for proxy, result in rows}


def test_a_crawl_through_the_gateway_gets_every_page_past_the_bans(
    tmp_path: Path, banning_site: Site, fleet: Operator
) -> None:
    result = crawl(tmp_path, banning_site, fleet)
    stats = result["stats"]
    assert_every_page_crawled(result, banning_site)
    assert_bans_steered_elsewhere(banning_site)
    # The gateway saw the 429 itself; only the spider knew the captcha page for a ban.
    assert {("px-0", "rate_limited"), ("px-1", "blocked")} <= reports(fleet)
    # Each 429 reported once (by the gateway, which marks it so the spider does not again),
    # and a ban blamed on the proxy it came through, never on the clean one.
    rate_limited = fleet.sql("SELECT COUNT(*) FROM lease_history WHERE kind = 'reported' AND result = 'rate_limited'")
    assert rate_limited == [(banning_site.bans_served[RATE_LIMITING],)]
    assert not {("px-2", "blocked"), ("px-2", "rate_limited")} & reports(fleet)
    assert stats.get("proxy_operator/bans/rate_limited", 0) >= 1
    assert stats.get("proxy_operator/bans/blocked", 0) >= 1
    assert stats.get("proxy_operator/retries", 0) >= 2
    assert stats.get("proxy_operator/sessions", 0) >= 3
    assert "proxy_operator/retries_exhausted" not in stats
    clients = fleet.sql("SELECT DISTINCT client FROM leases")
    assert clients == [("pages",)], "leases name the crawler: the spider"
    assert fleet.active_leases() == 0, "the spider's sessions ended when it closed"


def test_a_crawl_on_leases_gets_every_page_past_the_bans(
    tmp_path: Path, banning_site: Site, fleet: Operator
) -> None:
    result = crawl(tmp_path, banning_site, fleet, PROXY_OPERATOR_MODE="lease", PROXY_OPERATOR_LEASE_TTL=30)
    stats = result["stats"]
    assert_every_page_crawled(result, banning_site)
    assert_bans_steered_elsewhere(banning_site)
    assert {("px-0", "rate_limited"), ("px-1", "blocked")} <= reports(fleet)
    assert not {("px-2", "blocked"), ("px-2", "rate_limited")} & reports(fleet)
    cooldowns = fleet.sql(
        "SELECT cooldown_seconds FROM lease_history WHERE kind = 'reported' AND result = 'rate_limited'"
    )
    assert (120.0,) in cooldowns, "the target's Retry-After became the cooldown"
    assert stats.get("proxy_operator/bans/rate_limited", 0) >= 1
    assert stats.get("proxy_operator/bans/blocked", 0) >= 1
    assert fleet.active_leases() == 0, "every lease released when the spider closed"
    history = fleet.sql("SELECT COUNT(*) FROM lease_history WHERE kind = 'released'")[0][0]
    assert history >= 3


@pytest.mark.parametrize("mode", ["gateway", "lease"])
def test_an_upstream_killed_mid_crawl_costs_no_page(tmp_path: Path, site: Site, mode: str) -> None:
    with start_operator(tmp_path, site, squids=3) as operator:
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = crawl(
                    tmp_path, site, operator, PROXY_OPERATOR_MODE=mode, DOWNLOAD_DELAY=0.05
                )
            except BaseException as e:  # reported by the test thread below
                outcome["error"] = e

        crawler = threading.Thread(target=run)
        crawler.start()
        eventually("a third of the pages crawled", lambda: len(site.served) >= PAGES // 3)
        operator.squids[0].kill()
        served_before_the_kill = len(site.served)
        crawler.join(timeout=300)
        if "error" in outcome:
            raise outcome["error"]
        assert served_before_the_kill < PAGES, "killed mid-crawl"
        assert_every_page_crawled(outcome["result"], site)
        if mode == "lease":  # through the gateway, the gateway retries before Scrapy sees it
            assert outcome["result"]["stats"].get("proxy_operator/errors", 0) >= 1
            assert ("px-0", "error") in reports(operator)
        assert operator.active_leases() == 0


@pytest.mark.parametrize("mode", ["gateway", "lease"])
def test_a_crawl_over_its_tenants_rate_waits_out_the_quota_and_reports_no_ban(tmp_path: Path, site: Site, mode: str) -> None:
    # One acquire every 2 s: the crawl's three sessions (each on a lease) cannot all open at
    # once, so some of its first requests are refused for the quota.
    team = Tenant("team-a", "team-a-token-0123456789", {"acquiresPerSecond": 0.5, "burst": 1})
    with start_operator(tmp_path, site, squids=3, tenants=[team]) as operator:
        result = crawl(
            tmp_path,
            site,
            operator,
            PROXY_OPERATOR_MODE=mode,
            PROXY_OPERATOR_TOKEN=team.token,
            PROXY_OPERATOR_MAX_WAIT=DEADLINE,
            # Even with 503 for a ban, the gateway's quota refusal is none.
            PROXY_OPERATOR_BAN_STATUSES={403: "blocked", 429: "rate_limited", 503: "blocked"},
        )
        stats = result["stats"]
        assert_every_page_crawled(result, site)
        refused = operator.metric('proxy_operator_tenant_refusals_total{reason="quota_acquiresPerSecond",tenant="team-a"}')
        assert refused >= 1, "the quota refused some acquires"
        if mode == "gateway":
            assert stats.get("proxy_operator/quota_exceeded", 0) >= 1, stats
            assert operator.metric('proxy_operator_gateway_requests_total{kind="http",outcome="quota_exceeded"}') >= 1
        else:  # the client waited through the API's 429s: none reached the middleware
            assert "proxy_operator/quota_exceeded" not in stats, stats
        assert not [key for key in stats if key.startswith("proxy_operator/bans/")], stats
        assert "proxy_operator/retries" not in stats and "proxy_operator/retries_exhausted" not in stats, stats
        assert reports(operator) == set(), "nothing reported as a ban"
        assert operator.active_leases() == 0


def test_lease_mode_renews_its_lease_while_requests_wait_and_releases_it_at_close(tmp_path: Path, site: Site) -> None:
    with start_operator(tmp_path, site, squids=1) as operator:
        result = run_spider(
            tmp_path,
            SPIDER.format(pages=12, base=site.url("")),
            {
                "DOWNLOADER_MIDDLEWARES": {"proxy_operator.scrapy.ProxyOperatorMiddleware": 610},
                "PROXY_OPERATOR_MODE": "lease",
                "PROXY_OPERATOR_URL": operator.api,
                "PROXY_OPERATOR_TOKEN": TOKEN,
                "PROXY_OPERATOR_SESSIONS_PER_HOST": 1,
                "PROXY_OPERATOR_LEASE_TTL": 2,
                "DOWNLOAD_DELAY": 0.25,
                "TELNETCONSOLE_ENABLED": False,
            },
        )
        assert len(result["items"]) == 12
        kinds = [k for (k,) in operator.sql("SELECT kind FROM lease_history ORDER BY seq")]
        assert kinds.count("acquired") == 1, kinds
        assert kinds.count("renewed") >= 2, kinds
        assert kinds[-1] == "released" and "expired" not in kinds, kinds


def test_the_lease_keeper_renews_at_half_the_ttl_and_releases_only_idle_leases(operator: Operator) -> None:
    now = [1000.0]

    async def scenario() -> tuple[str, str]:
        async with AsyncClient(operator.api, token=TOKEN) as api:
            route = _LeaseRoute(api, {}, ttl=60, idle=30, clock=lambda: now[0])
            busy, idle = Request("http://127.0.0.1/a"), Request("http://127.0.0.1/b")
            await route.assign(busy, "127.0.0.1", "busy")
            await route.assign(idle, "127.0.0.1", "idle")
            route.answered("idle")
            busy_lease, idle_lease = (route.held[s].lease for s in ("busy", "idle"))
            assert busy.meta["proxy"] == busy_lease.proxy_url
            now[0] += 29
            await route.keep(now[0])  # before half the TTL, nothing idle long enough
            assert set(route.held) == {"busy", "idle"}
            now[0] += 2
            await route.keep(now[0])  # past half the TTL; idle past 30 s; busy still waits
            assert set(route.held) == {"busy"}
            assert route.held["busy"].lease.expires_at > busy_lease.expires_at
            await route.close()
            return busy_lease.lease_id, idle_lease.lease_id

    busy_id, idle_id = asyncio.run(scenario())
    def kinds(lease_id: str) -> list[str]:
        rows = operator.sql(f"SELECT kind FROM lease_history WHERE lease_id = '{lease_id}' ORDER BY seq")
        return [kind for (kind,) in rows]

    assert kinds(idle_id) == ["acquired", "released"]
    assert kinds(busy_id) == ["acquired", "renewed", "released"]
