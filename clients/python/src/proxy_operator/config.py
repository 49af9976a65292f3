"""Where the client finds the API, the gateway and its token.

Environment variables, read when a value is not given in code:

``PROXY_OPERATOR_URL``
    The lease API, e.g. ``http://proxy-operator.proxy-operator:8090``.
``PROXY_OPERATOR_GATEWAY``
    The gateway, e.g. ``http://proxy-operator.proxy-operator:8888``.
``PROXY_OPERATOR_TOKEN``
    The API token.
``PROXY_OPERATOR_TOKEN_FILE``
    A file holding the API token (a mounted Secret); read again when the API answers 401, so a
    rotated token is taken without a restart.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote, urlsplit

from .errors import ConfigError

ENV_URL = "PROXY_OPERATOR_URL"
ENV_GATEWAY = "PROXY_OPERATOR_GATEWAY"
ENV_TOKEN = "PROXY_OPERATOR_TOKEN"
ENV_TOKEN_FILE = "PROXY_OPERATOR_TOKEN_FILE"


def resolve_url(url: str | None, env: str) -> str:
    """``url``, else the environment variable ``env``; an http(s) URL without a trailing slash."""
    value = url or os.environ.get(env)
    if not value:
        raise ConfigError(f"no URL given and {env} is not set")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{value!r} is not an http:// or https:// URL")
    return value.rstrip("/")


class TokenSource:
    """The API token: given in code, or read from a file (again after a 401, for rotation)."""

    def __init__(self, token: str | None = None, token_file: str | os.PathLike[str] | None = None):
        if token is None and token_file is None:
            token = os.environ.get(ENV_TOKEN) or None
            token_file = os.environ.get(ENV_TOKEN_FILE) or None
        if token is None and token_file is None:
            raise ConfigError(f"no API token: pass token= or token_file=, or set {ENV_TOKEN} or {ENV_TOKEN_FILE}")
        self._file = Path(token_file) if token is None and token_file is not None else None
        self._token = token or ""
        self._token = self._read()

    def _read(self) -> str:
        if self._file is None:
            return self._token
        try:
            token = self._file.read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read the API token file {self._file}: {e}") from e
        if not token:
            raise ConfigError(f"the API token file {self._file} is empty")
        return token

    @property
    def token(self) -> str:
        return self._token

    def reload(self) -> bool:
        """Reads the token file again; whether the token changed (never, for a given token)."""
        if self._file is None:
            return False
        token = self._read()
        changed = token != self._token
        self._token = token
        return changed


def gateway_proxy_url(
    gateway: str,
    token: str,
    crawler: str = "crawler",
    *,
    session: str | None = None,
    session_ttl: str | None = None,
    selector: dict[str, str] | None = None,
    fallback: str | None = None,
) -> str:
    """The proxy URL that sends requests through the gateway with these options, e.g.
    ``http://crawler;session=s1;geo=eu:TOKEN@gateway:8888``. ``session_ttl`` is a duration
    such as ``"5m"``; ``selector`` the labels the upstream proxy must carry; ``fallback`` the
    name of a fallback chain of the gateway's rules file (own proxies first, a vendor next)."""
    parts = [crawler]
    if session is not None:
        parts.append(f"session={session}")
    if session_ttl is not None:
        parts.append(f"sessionTTL={session_ttl}")
    if fallback is not None:
        parts.append(f"fallback={fallback}")
    for key, value in sorted((selector or {}).items()):
        if key in ("session", "sessionTTL", "tls", "fallback"):
            raise ConfigError(f"selector label {key!r} is a reserved gateway option")
        parts.append(f"{key}={value}")
    for part in parts:
        if any(c in part for c in ":@/;"):
            raise ConfigError(f"gateway option {part!r} may not contain ':', '@', '/' or ';'")
    base = urlsplit(resolve_url(gateway, ENV_GATEWAY))
    # ';' and '=' are allowed in a URL's userinfo; everything else that is not is escaped.
    user = quote(";".join(parts), safe=";=")
    host = base.netloc.rpartition("@")[2]
    return f"{base.scheme}://{user}:{quote(token, safe='')}@{host}"
