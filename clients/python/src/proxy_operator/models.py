"""What the API answers, as typed values."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

_FRACTION = re.compile(r"\.(\d{6})\d+")


def parse_time(text: str) -> datetime:
    """An RFC 3339 time as the API writes it (``Z``, up to nanoseconds) as an aware datetime."""
    return datetime.fromisoformat(_FRACTION.sub(r".\1", text).replace("Z", "+00:00"))


@dataclass(frozen=True)
class ProxyInfo:
    """One proxy of ``GET /v1/proxies``."""

    name: str
    namespace: str
    host: str
    port: int
    url: str
    healthy: bool
    active_leases: int
    max_leases: int
    cordoned: bool
    draining: bool
    labels: dict[str, str]
    latency_ms: int | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ProxyInfo:
        return cls(
            name=body["name"],
            namespace=body["namespace"],
            host=body["host"],
            port=body["port"],
            url=body["url"],
            healthy=body["healthy"],
            active_leases=body["activeLeases"],
            max_leases=body["maxLeases"],
            cordoned=body.get("cordoned", False),
            draining=body.get("draining", False),
            labels=dict(body.get("labels", {})),
            latency_ms=body.get("latencyMs"),
        )


@dataclass(frozen=True)
class LeaseProxy:
    """The proxy a lease is on. ``username``/``password`` are there only where the install
    gives credentials out (``--lease-credentials``) and the proxy has them."""

    name: str
    namespace: str
    host: str | None = None
    port: int | None = None
    url: str | None = None
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)

    @property
    def url_with_credentials(self) -> str | None:
        """``http://user:pass@host:port`` (percent-encoded; ``socks5h://`` for a SOCKS5 proxy,
        as ``url`` says), or ``url`` without credentials; ``None`` when the proxy has left the
        inventory."""
        if self.host is None or self.port is None:
            return None
        if self.username is None:
            return self.url
        scheme = (self.url or "http://").partition("://")[0]
        userinfo = f"{quote(self.username, safe='')}:{quote(self.password or '', safe='')}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{userinfo}@{host}:{self.port}"


@dataclass(frozen=True)
class Lease:
    """A lease, as granted, renewed or read."""

    lease_id: str
    proxy: LeaseProxy
    state: str
    acquired_at: datetime
    expires_at: datetime
    ttl_seconds: int
    target: str | None = None
    released_at: datetime | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Lease:
        proxy = body["proxy"]
        released = body.get("releasedAt")
        return cls(
            lease_id=body["leaseID"],
            proxy=LeaseProxy(
                name=proxy["name"],
                namespace=proxy["namespace"],
                host=proxy.get("host"),
                port=proxy.get("port"),
                url=proxy.get("url"),
                username=proxy.get("username"),
                password=proxy.get("password"),
            ),
            state=body["state"],
            acquired_at=parse_time(body["acquiredAt"]),
            expires_at=parse_time(body["expiresAt"]),
            ttl_seconds=body["ttlSeconds"],
            target=body.get("target"),
            released_at=parse_time(released) if released else None,
        )

    @property
    def proxy_url(self) -> str | None:
        """The URL to give an HTTP client as its proxy (with credentials where given)."""
        return self.proxy.url_with_credentials
