"""Compiled grammars kept for reuse, bounded in bytes: most guided traffic repeats a few
schemas, which then compile once. The compiler processes (grammar_process.py) keep no
cache of their own, so this is the one bound (xgrammar's default cache is unbounded:
every distinct schema a client sends would stay in memory). Shared by the compile
threads; least recently used first out."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Optional


def cache_key(field: str, value: Any) -> str:
    """The text that is compiled: not sorted, since a schema's key order is the order the
    grammar makes the model write its properties in."""
    return field + "\0" + (value if isinstance(value, str) else json.dumps(value))


class GrammarCache:
    def __init__(self, limit_bytes: int) -> None:
        self._items: "OrderedDict[str, tuple[Any, int]]" = OrderedDict()
        self._bytes = 0
        self._limit = limit_bytes
        self._lock = threading.Lock()

    def get(self, key: str) -> Optional[Any]:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: str, compiled: Any, size: int) -> None:
        if size > self._limit:
            return                      # larger than the whole cache: not kept
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[key] = (compiled, size)
            self._bytes += size
            while self._bytes > self._limit:
                _, (_, dropped) = self._items.popitem(last=False)
                self._bytes -= dropped

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)
