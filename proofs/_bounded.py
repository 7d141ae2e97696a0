"""Shared machinery for the CrossHair obligations: bounded inputs and declared expectations.

Every obligation is a small pure function with a PEP316 docstring contract (``pre:`` bounds
its inputs, ``post: __return__`` states the property). Its inputs are kept symbolic but
bounded, in the two forms CrossHair explores efficiently:

- ``pick(x, n)`` turns a small symbolic int into a concrete one by explicit enumeration, so
  each value is its own path and the spec's arithmetic then runs on plain ints (CrossHair's
  solver struggles with nonlinear ``//`` and ``%`` over symbolic ints; the layouts and
  request sizes are few, so enumerating them loses nothing).
- ``LazyStatuses`` presents a list of symbolic bools as a hit map that branches on a bit
  only when the spec reads that chunk. Hit maps stay symbolic: a path is one combination of
  the bits the spec actually looked at, so CrossHair covers every hit map of the bounded
  size while exploring far fewer paths than 2**bits.

"Confirmed over all paths" therefore means: for every layout in the obligation's table,
every request size and C in its bounds, and every hit map of that many chunks, the
property holds. Each obligation file declares, in ``OBLIGATIONS``, the expected status of
each function and the CrossHair budget it runs under; ``proofs/test_proofs.py`` runs them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from kvcore.spec.types import GroupSpec, OffloadConfig, Status

# Expected outcomes. CONFIRMED: CrossHair must say "Confirmed over all paths" (an
# exhaustive check of the stated domain). REFUTED: a mutant; CrossHair must find a
# counterexample. There is no "searched without finding" status: every proof either
# exhausts its domain or is reported inconclusive.
CONFIRMED = "confirmed"
REFUTED = "refuted"


@dataclass(frozen=True)
class Obligation:
    """One function to check, its expected status and its CrossHair budget (CPU seconds).

    ``budget_s`` is ``--per_condition_timeout`` and ``per_path_s`` is
    ``--per_path_timeout`` (both CPU seconds; Z3 also gets half of ``per_path_s`` as a
    wall-clock query limit, so it is kept generous). ``measured_s`` is the CPU the
    obligation took on the development machine (see proofs/README.md); the budget must
    be at least five times it. ``mutant_of`` names the proof a REFUTED mutant guards:
    every proof must have at least one, so that none can pass vacuously.
    """

    function: str
    expect: str
    budget_s: float
    per_path_s: float
    measured_s: float
    mutant_of: str | None = None


def pick(x: int, bound: int) -> int:
    """The concrete int equal to symbolic ``x``, given ``0 <= x < bound`` (one path each)."""
    for i in range(bound):
        if x == i:
            return i
    raise ValueError(f"{x} is outside 0..{bound - 1}")


class LazyStatuses(Sequence[Status]):
    """Chunks ``[0, length)`` of a hit map: bit ``offset + i`` True means HIT, else MISS.

    With ``pending`` bits, a set one makes the chunk PENDING instead; with ``resolve`` bits
    too, that PENDING is resolved to HIT (set) or MISS.

    Indexing and slicing read (and so branch on) only the bits asked for.
    """

    def __init__(self, bits: Sequence[bool], offset: int, length: int, flipped: int = -1,
                 pending: Sequence[bool] | None = None,
                 resolve: Sequence[bool] | None = None) -> None:
        self._bits = bits
        self._offset = offset
        self._length = length
        self._flipped = flipped
        self._pending = pending
        self._resolve = resolve

    def __len__(self) -> int:
        return self._length

    def _status(self, i: int) -> Status:
        if i == self._flipped:
            return Status.HIT
        j = self._offset + i
        if self._pending is not None and self._pending[j]:
            if self._resolve is None:
                return Status.PENDING
            return Status.HIT if self._resolve[j] else Status.MISS
        return Status.HIT if self._bits[j] else Status.MISS

    @overload
    def __getitem__(self, index: int) -> Status: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Status]: ...

    def __getitem__(self, index: int | slice) -> Status | Sequence[Status]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step != 1:
                return [self._status(i) for i in range(start, stop, step)]
            return _Window(self, start, max(stop, start))
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(index)
        return self._status(index)

    def __iter__(self) -> Iterator[Status]:
        for i in range(self._length):
            yield self._status(i)


class _Window(Sequence[Status]):
    """A contiguous slice of a ``LazyStatuses``, still lazy."""

    def __init__(self, base: LazyStatuses, start: int, stop: int) -> None:
        self._base = base
        self._start = start
        self._stop = stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> Status: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Status]: ...

    def __getitem__(self, index: int | slice) -> Status | Sequence[Status]:
        if isinstance(index, slice):
            start, stop, _ = index.indices(len(self))
            return self._base[self._start + start:self._start + max(stop, start)]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._base[self._start + index]

    def __iter__(self) -> Iterator[Status]:
        for i in range(self._start, self._stop):
            yield self._base[i]


def hit_maps(cfg: OffloadConfig, num_tokens: int, bits: Sequence[bool], per_group: int,
             flip: tuple[int, int] | None = None, pending: Sequence[bool] | None = None,
             resolve: Sequence[bool] | None = None) -> tuple[LazyStatuses, ...]:
    """One lazy hit map per group: ``N // o`` chunks (keys exist for complete chunks only).

    ``flip = (group, chunk)`` reads that one chunk as HIT whatever its bit says;
    ``pending`` and ``resolve`` are as in ``LazyStatuses``.
    """
    out = []
    for i, g in enumerate(cfg.groups):
        length = min(num_tokens // g.tokens_per_chunk, per_group)
        flipped = flip[1] if flip is not None and flip[0] == i else -1
        out.append(LazyStatuses(bits, i * per_group, length, flipped, pending, resolve))
    return tuple(out)


def small_config(*groups: GroupSpec, hash_block_tokens: int = 1,
                 num_gpu_blocks: int = 64, num_cpu_blocks: int = 64,
                 max_offload_tokens: int | None = None,
                 prompt_only: bool = False) -> OffloadConfig:
    """A valid config for tiny layouts; ``speculative`` follows the draft flags."""
    return OffloadConfig(tuple(groups), hash_block_tokens=hash_block_tokens,
                         num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                         max_offload_tokens=max_offload_tokens, prompt_only=prompt_only,
                         speculative=any(g.is_draft for g in groups))


class OutsideDomain(LookupError):
    """An obligation read a table position outside the window its domain states."""


class WindowTable(Sequence[int]):
    """A block table of ``size`` positions whose window ``[base, base + len(ids))`` holds
    the free ints ``ids`` (0 is the null block; any other value, negative or huge, is
    passed through as an id); it is never materialized, since ``size`` may be symbolic.

    Reading a position outside the window raises ``OutsideDomain``, so an obligation whose
    stated window is too small fails loudly instead of checking less than it says.
    """

    def __init__(self, size: int, base: int, ids: Sequence[int]) -> None:
        self._size = size
        self._base = base
        self._ids = ids

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            # Plain non-negative slices only, without slice.indices(), which would make
            # CrossHair enumerate symbolic bounds.
            start = 0 if index.start is None else index.start
            stop = self._size if index.stop is None else min(index.stop, self._size)
            if index.step not in (None, 1) or start < 0 or stop < 0:
                raise ValueError("WindowTable supports plain non-negative slices only")
            return [self[i] for i in range(start, stop)]
        if not 0 <= index < self._size:
            raise IndexError(index)
        offset = index - self._base
        if not 0 <= offset < len(self._ids):
            raise OutsideDomain(f"position {index} is outside the window [{self._base}, "
                                f"{self._base + len(self._ids)})")
        return self._ids[offset]
