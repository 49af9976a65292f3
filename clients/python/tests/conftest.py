"""Fixtures: a banning loopback site, and the real binary in front of real squids."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# The package of this checkout, installed or not (an install may point at another copy).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harness import Operator, Site, start_operator  # noqa: E402


@pytest.fixture
def site() -> Iterator[Site]:
    site = Site()
    yield site
    site.close()


@pytest.fixture
def operator(tmp_path: Path, site: Site) -> Iterator[Operator]:
    """Two healthy squids (``px-0`` on 127.0.0.20, ``px-1`` on .21) behind the binary."""
    with start_operator(tmp_path, site, squids=2) as operator:
        yield operator
