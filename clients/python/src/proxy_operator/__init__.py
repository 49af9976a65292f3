"""Client of proxy-operator: the lease API (:class:`Client`, :class:`AsyncClient`), gateway
proxy URLs (:func:`gateway_proxy_url`) and a Scrapy downloader middleware
(:mod:`proxy_operator.scrapy`)."""

from .calls import REFUSALS, RetryPolicy
from .client import AsyncClient, Client
from .config import ENV_GATEWAY, ENV_TOKEN, ENV_TOKEN_FILE, ENV_URL, gateway_proxy_url
from .errors import (
    ApiError,
    Banned,
    ConfigError,
    NoMatch,
    PoolWaking,
    ProxyOperatorError,
    QuotaExceeded,
    TooManyRequests,
    TransportError,
    Unavailable,
)
from .models import Lease, LeaseProxy, ProxyInfo

__all__ = [
    "ENV_GATEWAY",
    "ENV_TOKEN",
    "ENV_TOKEN_FILE",
    "ENV_URL",
    "REFUSALS",
    "ApiError",
    "AsyncClient",
    "Banned",
    "Client",
    "ConfigError",
    "Lease",
    "LeaseProxy",
    "NoMatch",
    "PoolWaking",
    "ProxyInfo",
    "ProxyOperatorError",
    "QuotaExceeded",
    "RetryPolicy",
    "TooManyRequests",
    "TransportError",
    "Unavailable",
    "gateway_proxy_url",
]
