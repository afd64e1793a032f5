"""One bounded, thread-safe memo for per-signature results."""
from __future__ import annotations

import threading

__all__ = ["Memo"]


class Memo:
    """A dict of at most ``cap`` entries, cleared when full; safe from several threads.

    Reads take no lock (a dict lookup is atomic in CPython); inserts and clears do, so two
    threads that miss on the same key both compute the value and one of them wins, which
    is harmless for the immutable values stored here. Clearing all at once when full
    keeps the cost of a hit at one lookup (no LRU bookkeeping); a program that cycles
    through more than ``cap`` signatures pays for planning again, nothing worse.
    """

    __slots__ = ("cap", "_data", "_lock", "get")

    def __init__(self, cap: int = 4096):
        self.cap = cap
        self._data: dict = {}
        self._lock = threading.Lock()
        #: ``get(key)``: the value stored for ``key`` or ``None`` (``key`` hashable). The
        #: dict's own method, so a hit costs no Python frame; the dict is never replaced.
        self.get = self._data.get

    def put(self, key, value):
        """Store ``value`` under ``key`` (clearing everything first when full); returns it."""
        with self._lock:
            if len(self._data) >= self.cap:
                self._data.clear()
            self._data[key] = value
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def values(self) -> list:
        """The stored values (a snapshot list)."""
        return list(self._data.values())

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key) -> bool:
        return key in self._data
