"""What the tests run against: real squids on their own loopback addresses, a loopback site that
bans exit addresses, and the real ``proxy-operator standalone`` binary in front of them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

TOKEN = "python-client-token-0123456789"
#: How long a condition that involves real processes may take (a loaded 2-core machine).
DEADLINE = 60.0
REPO = Path(__file__).resolve().parents[3]


def eventually(what: str, check: Callable[[], T | None], deadline: float = DEADLINE) -> T:
    """Polls ``check`` until it returns something other than ``None``/``False``."""
    end = time.monotonic() + deadline
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline:.0f}s: {what}")
        time.sleep(0.05)


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def binary() -> Path:
    """The binary under test: ``PROXY_OPERATOR_BIN``, else the debug build of this checkout."""
    path = Path(os.environ.get("PROXY_OPERATOR_BIN") or REPO / "target" / "debug" / "proxy-operator")
    if not path.is_file():
        raise RuntimeError(f"no proxy-operator binary at {path}: run `cargo build` or set PROXY_OPERATOR_BIN")
    return path


class Site:
    """A loopback HTTP site: ``/page/<n>`` pages, ``/ip`` (the caller's address) and
    ``/generate_204`` (the proxies' probe). An address in ``bans`` gets its ban once it has
    fetched ``ban_after`` pages: ``"429"`` (with ``Retry-After: 120``) or ``"captcha"`` (a 200
    captcha page)."""

    def __init__(self, bans: dict[str, str] | None = None, ban_after: int = 1_000_000):
        self.bans = bans or {}
        self.ban_after = ban_after
        self.pages_by_address: Counter[str] = Counter()
        self.bans_served: Counter[str] = Counter()
        self.served: set[str] = set()
        self.lock = threading.Lock()
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                site.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        address = request.client_address[0]
        path = request.path.split("?")[0]
        if path == "/generate_204":
            return self._send(request, 204, b"")
        if path == "/ip":
            return self._send(request, 200, address.encode())
        if not path.startswith("/page/"):
            return self._send(request, 404, b"not found")
        with self.lock:
            ban = self.bans.get(address)
            if ban is not None and self.pages_by_address[address] >= self.ban_after:
                banned = ban
                self.bans_served[address] += 1
            else:
                banned = None
                self.pages_by_address[address] += 1
                self.served.add(path)
        if banned == "429":
            return self._send(request, 429, b"slow down", {"Retry-After": "120"})
        if banned == "captcha":
            return self._send(request, 200, b"<html><body>Please solve this captcha</body></html>")
        return self._send(request, 200, f"<html><body>page {path} from {address}</body></html>".encode())

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        request.send_response(status)
        for name, value in (headers or {}).items():
            request.send_header(name, value)
        request.send_header("Content-Type", "text/html; charset=utf-8")
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Squid:
    """A real squid listening on ``address`` and connecting out from it (the site sees which
    squid a request left through)."""

    def __init__(self, address: str):
        self.address = address
        # Its own directory straight under the temp dir: squid drops to its own user, which
        # must reach it (pytest's temp dirs are private to the user running the tests).
        self.dir = Path(tempfile.mkdtemp(prefix="squid-"))
        os.chmod(self.dir, 0o777)
        self.port = free_port(address)
        (self.dir / "squid.conf").write_text(
            f"http_port {address}:{self.port}\n"
            f"tcp_outgoing_address {address}\n"
            f"pid_filename {self.dir}/squid.pid\n"
            f"access_log stdio:{self.dir}/access.log\n"
            f"cache_log {self.dir}/cache.log\n"
            "cache_store_log none\ncache deny all\n"
            f"coredump_dir {self.dir}\npinger_enable off\n"
            "visible_hostname proxy-operator-test\nshutdown_lifetime 0 seconds\n"
            "http_access allow all\n"
        )
        squid = shutil.which("squid") or "/usr/sbin/squid"
        self.process = subprocess.Popen(
            [squid, "-N", "-f", str(self.dir / "squid.conf")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        eventually(f"squid on {address}:{self.port} accepting", self._accepting)

    def _accepting(self) -> bool:
        if self.process.poll() is not None:
            log = (self.dir / "cache.log").read_text(errors="replace") if (self.dir / "cache.log").exists() else ""
            raise RuntimeError(f"squid exited: {log[-2000:]}")
        try:
            socket.create_connection((self.address, self.port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Operator:
    """A running ``proxy-operator standalone`` with its squids."""

    process: subprocess.Popen[bytes]
    api: str
    gateway: str
    metrics: str
    ledger: Path
    log: Path
    squids: list[Squid] = field(default_factory=list)

    def proxy_name_of(self, address: str) -> str:
        """The Proxy name of the squid that connects out from ``address``."""
        for i, squid in enumerate(self.squids):
            if squid.address == address:
                return f"default/px-{i}"
        raise KeyError(address)

    def sql(self, query: str) -> list[tuple[Any, ...]]:
        """Rows of ``query`` on the ledger file, read as ``sqlite3`` would."""
        with sqlite3.connect(f"file:{self.ledger}?mode=ro", uri=True) as db:
            return db.execute(query).fetchall()

    def active_leases(self) -> int:
        return self.sql("SELECT COUNT(*) FROM leases WHERE state = 'active'")[0][0]

    def metric(self, sample: str) -> float:
        """The value of one sample of ``/metrics``, named with its labels as the binary writes
        them (``name{a="x",b="y"}``); 0 when it has none yet."""
        for line in httpx.get(f"{self.metrics}/metrics", timeout=10).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name == sample:
                return float(value)
        return 0.0

    def __enter__(self) -> Operator:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for squid in self.squids:
            squid.kill()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass(frozen=True)
class Tenant:
    """A tenant of the binary's tenants file: its ``token`` (the file holds its SHA-256) and its
    ``quotas`` (``leases``, ``sessions``, ``acquiresPerSecond``, ``burst``)."""

    name: str
    token: str
    quotas: dict[str, float] = field(default_factory=dict)

    def entry(self) -> dict[str, Any]:
        digest = hashlib.sha256(self.token.encode()).hexdigest()
        return {"name": self.name, "tokens": [f"sha256:{digest}"], "quotas": self.quotas}


def lost_a_port(operator: Operator) -> bool:
    """Whether the binary exited at start because a port it was given was taken meanwhile
    (it binds every port before it serves, so an answering ``/healthz`` means it holds them)."""
    def settled() -> bool:
        if operator.process.poll() is not None:
            return True
        try:
            return httpx.get(f"{operator.api}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    eventually("the binary listening or exited", settled)
    return operator.process.poll() is not None and "Address already in use" in operator.log_text()


def start_operator(
    directory: Path,
    site: Site,
    squids: int,
    extra_args: list[str] | None = None,
    max_leases: int = 16,
    tenants: list[Tenant] | None = None,
) -> Operator:
    """Starts ``squids`` squids on 127.0.0.20, .21, ... and the binary on an inventory of them
    (``px-0``, ``px-1``, ...; label ``pool: python``), and waits until every one is healthy.
    ``tenants`` go in a tenants file (``TOKEN`` stays the unrestricted tenant ``default``)."""
    fleet = [Squid(f"127.0.0.{20 + i}") for i in range(squids)]
    documents = [
        f"""apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: px-{i}
  labels: {{pool: python}}
spec:
  mode: External
  endpoint: {{host: {squid.address}, port: {squid.port}}}
  maxLeases: {max_leases}
  healthCheck:
    probeURL: {site.url('/generate_204')}
    interval: 1s
    timeout: 1s
"""
        for i, squid in enumerate(fleet)
    ]
    inventory = directory / "inventory.yaml"
    inventory.write_text("---\n".join(documents))
    args = list(extra_args or [])
    if tenants:
        tenants_file = directory / "tenants.yaml"
        # JSON is YAML.
        tenants_file.write_text(json.dumps({"tenants": [tenant.entry() for tenant in tenants]}))
        args += ["--tenants-file", str(tenants_file)]
    log = directory / "operator.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_OPERATOR_")}
    env.update(DISCOVERY_TOKEN=TOKEN, RUST_LOG=env.get("RUST_LOG", "info"))
    # A port found free can be taken by another process (other tests run beside these) before
    # the binary binds it; the binary then exits naming it, and is started on other ports.
    for attempt in range(3):
        api, metrics, gateway = free_port(), free_port(), free_port()
        with log.open("wb") as out:
            process = subprocess.Popen(
                [
                    str(binary()),
                    "standalone",
                    "--inventory", str(inventory),
                    "--ledger", str(directory / "ledger.db"),
                    "--discovery-addr", f"127.0.0.1:{api}",
                    "--metrics-addr", f"127.0.0.1:{metrics}",
                    "--gateway-addr", f"127.0.0.1:{gateway}",
                    "--gateway-allowed-ports", str(site.port),
                    # The squids and the site are on loopback, which the gateway opens only
                    # when told.
                    "--gateway-allowed-destinations", "127.0.0.0/8",
                    *args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        operator = Operator(
            process=process,
            api=f"http://127.0.0.1:{api}",
            gateway=f"http://127.0.0.1:{gateway}",
            metrics=f"http://127.0.0.1:{metrics}",
            ledger=directory / "ledger.db",
            log=log,
            squids=fleet,
        )
        if not lost_a_port(operator) or attempt == 2:
            break
        process.wait()

    def all_healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"proxy-operator exited:\n{operator.log_text()}")
        try:
            answer = httpx.get(f"{operator.api}/v1/proxies", params={"healthy": "true"}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2)
        except httpx.HTTPError:
            return False
        return answer.status_code == 200 and answer.json()["count"] == squids

    try:
        eventually(f"{squids} healthy proxies", all_healthy)
    except BaseException:
        operator.stop()
        raise
    return operator


def run_spider(directory: Path, spider_source: str, settings: dict[str, Any], timeout: float = 180.0) -> dict[str, Any]:
    """Runs a Scrapy crawl of ``spider_source`` in its own process (Twisted's reactor starts
    once per process) with ``settings``; returns the crawl's stats and the items it scraped."""
    script = directory / "spider.py"
    script.write_text(spider_source)
    out = directory / "result.json"
    runner = directory / "run.py"
    runner.write_text(
        "import json\n"
        "from scrapy.crawler import CrawlerProcess\n"
        "import spider as module\n"
        f"settings = json.loads({json.dumps(json.dumps(settings))})\n"
        "items = []\n"
        "process = CrawlerProcess(settings)\n"
        "crawler = process.create_crawler(module.Spider)\n"
        "from scrapy import signals\n"
        "def collect(item, **_):\n"
        "    items.append(dict(item))\n"
        "crawler.signals.connect(collect, signal=signals.item_scraped)\n"
        "process.crawl(crawler)\n"
        "process.start()\n"
        "stats = {k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in crawler.stats.get_stats().items()}\n"
        f"open({str(out)!r}, 'w').write(json.dumps({{'stats': stats, 'items': items}}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_OPERATOR_")}
    done = subprocess.run(
        [sys.executable, str(runner)],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    (directory / "crawl.log").write_text(done.stderr)
    if done.returncode != 0 or not out.exists():
        raise AssertionError(f"the crawl failed ({done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads(out.read_text())
