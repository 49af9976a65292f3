"""Session names a crawler spreads its requests over: a pool per target host. A banned session
is retired and its slot gets a new name, so the next request starts on another proxy."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

_UNSAFE = re.compile(r"[^A-Za-z0-9.-]")
# The gateway takes session names of up to 128 characters.
_HOST_CHARS = 80


@dataclass
class _Slots:
    generations: list[int]
    next: int = 0


@dataclass
class SessionPool:
    """``size`` session names per host, handed out in turn. Names carry ``run`` (unique per
    process unless given), so two crawlers sharing a token never share a session."""

    size: int
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    _hosts: dict[str, _Slots] = field(default_factory=dict)
    _owners: dict[str, tuple[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a session pool needs at least 1 session per host, not {self.size}")

    def pick(self, host: str) -> str:
        """The next session name for ``host``."""
        slots = self._hosts.setdefault(host, _Slots([0] * self.size))
        slot = slots.next
        slots.next = (slot + 1) % self.size
        name = self._name(host, slot, slots.generations[slot])
        self._owners[name] = (host, slot)
        return name

    def retire(self, name: str) -> bool:
        """Retires ``name`` (its slot gets a new one); whether it was still in use."""
        owner = self._owners.pop(name, None)
        if owner is None:
            return False
        host, slot = owner
        generations = self._hosts[host].generations
        if self._name(host, slot, generations[slot]) == name:
            generations[slot] += 1
        return True

    def live(self) -> list[str]:
        """Every name handed out and not retired."""
        return list(self._owners)

    def _name(self, host: str, slot: int, generation: int) -> str:
        return f"{self.run}.{slot}.{generation}.{_UNSAFE.sub('-', host)[:_HOST_CHARS]}"
