"""A deep, comparable snapshot of a scheduler's or a manager's whole state.

Used by the bad-call table and the hostile-API fuzzer to show that a rejected call
changed nothing. It walks every attribute of every object reachable from the root
(``__dict__`` and ``__slots__``), so a field added later is covered without editing a
list: requests, block tables, cursors, hashes, keys, the job table and fence index, the
window index, queued loads, the manager's entries, slots, free list, policy order,
pending events and every counter. Order is kept where it is observable (dicts, lists,
deques: LRU order lives in an OrderedDict); sets are sorted. Only the frozen config is
left out (its cached properties fill in lazily, which is not a state change).
"""

from __future__ import annotations

import enum
from array import array
from collections import deque
from typing import Any

_SKIP = frozenset({"config"})
_ATOMS = (type(None), bool, int, float, str, bytes, enum.Enum)


def snapshot(root: object) -> Any:
    """Plain nested tuples describing everything reachable from ``root``."""
    return _plain(root, ())


# Exact types whose values are plain already: containers of only these are copied whole,
# which keeps a snapshot of a busy tier (tens of thousands of ints) in milliseconds.
_FLAT = frozenset({type(None), bool, int, float, str, bytes})


def _flat(values: Any) -> bool:
    return all(type(v) in _FLAT for v in values)


def _plain(value: object, path: tuple[int, ...]) -> Any:
    if isinstance(value, _ATOMS):
        return value
    if id(value) in path:
        return ("<cycle>", type(value).__name__)
    path = (*path, id(value))
    if isinstance(value, dict):
        if _flat(value) and _flat(value.values()):
            return ("dict", tuple(value.items()))
        return ("dict", tuple((_plain(k, path), _plain(v, path)) for k, v in value.items()))
    if isinstance(value, list | tuple | deque):
        if _flat(value):
            return (type(value).__name__, tuple(value))
        return (type(value).__name__, tuple(_plain(v, path) for v in value))
    if isinstance(value, array):  # block tables and stamps: no __dict__, no __slots__
        return ("array", value.typecode, tuple(value))
    if isinstance(value, set | frozenset):
        if _flat(value):
            return ("set", tuple(sorted(value, key=repr)))
        return ("set", tuple(sorted((_plain(v, path) for v in value), key=repr)))
    fields: dict[str, object] = {}
    for cls in type(value).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(value, name):
                fields[name] = getattr(value, name)
    fields.update(getattr(value, "__dict__", {}))
    if not fields and callable(value):
        return ("callable", getattr(value, "__qualname__", type(value).__name__))
    return (type(value).__name__, tuple((k, _plain(v, path)) for k, v in sorted(fields.items())
                                        if k not in _SKIP))
