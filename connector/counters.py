"""Monotonic counters as per-owner dataclasses: a misspelt name is an ``AttributeError`` where
it is written or read, never a silent new key that reads 0.

Each owner (the tree, the scheduler half, the fetch ledger, the worker's copies, the worker's
storage traffic) declares its counters as fields. Subscript access (``c["name"]``, ``c.get``)
exists for readers that select counters by name (stats, metrics, tests) and checks the name
the same way; ``as_dict`` is the snapshot ``stats()`` reports.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class Counters:
    def __getitem__(self, name: str) -> Any:
        if name not in self._names():
            raise AttributeError(f"{type(self).__name__} has no counter {name!r}")
        return getattr(self, name)

    def __setitem__(self, name: str, value: Any) -> None:
        if name not in self._names():
            raise AttributeError(f"{type(self).__name__} has no counter {name!r}")
        setattr(self, name, value)

    def get(self, name: str, default: Any = 0) -> Any:
        """Like ``self[name]``: ``default`` is accepted for dict-shaped readers, but an unknown
        name still raises."""
        return self[name]

    def keys(self) -> list[str]:
        return list(self._names())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def _names(cls) -> frozenset[str]:
        names = cls.__dict__.get("_field_names")
        if names is None:
            names = frozenset(f.name for f in fields(cls))
            cls._field_names = names  # type: ignore[attr-defined]
        return names
