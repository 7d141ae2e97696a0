"""L1 / L2 / E3 / E4 obligations on kvcore's lookup.

Functions under test: ``kvcore.scheduler._lookup.converge`` (the convergence loop: FULL
groups first, then windows largest first; a group is re-verified when another group
shrinks the boundary below the one it was verified at; each verification of a draft
group requires exactly one extra chunk), and ``OffloadScheduler._lookup_hit`` (which runs
the loop with PENDING read as HIT and, if a PENDING was seen, as MISS, and answers
PENDING when they differ, or when another request is loading a chunk the hit would
read). They are compared with the brute-force reference hit of
``kvcore.spec.lookup`` (``hit_for``, ``spec_hit``) and with the predicates
``e3_one_pop_per_cycle``, ``e4_draft_extra_chunk_hit`` and ``l2_pending_exactly_when_uncertain``.

Hit maps are symbolic bits read lazily (``LazyStatuses``): a path is one combination of
the bits the code actually read, so "confirmed" covers every hit map of the stated size.

Mutants (one-token changes of kvcore, patched in while CrossHair runs): a non-draft
window group that is not re-verified after a shrink, a double pop per verification, the lookup
limit ignoring the window groups' "recompute the last token" rule, and PENDING read as
MISS on the first pass (so the second pass never runs).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvcore.scheduler._lookup import converge, read_blocks
from kvcore.scheduler.scheduler import OffloadScheduler
from kvcore.spec.invariants import (
    LookupRecord,
    LookupTraceRecord,
    e3_one_pop_per_cycle,
    e4_draft_extra_chunk_hit,
    l1_hit_matches_spec,
    l2_pending_exactly_when_uncertain,
)
from kvcore.spec.lookup import hit_for
from kvcore.spec.types import GroupKind, GroupSpec, Status

from ._bounded import CONFIRMED, REFUTED, Obligation, hit_maps, pick, small_config
from ._mutate import mutant

F, S, M = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA

LAYOUTS = (
    small_config(GroupSpec(F, 2, is_draft=True)),
    small_config(GroupSpec(F, 2), GroupSpec(F, 2, is_draft=True)),
    small_config(GroupSpec(S, 2, window_tokens=3, is_draft=True),
                 GroupSpec(S, 2, window_tokens=1, is_draft=True)),
    small_config(GroupSpec(F, 2), GroupSpec(S, 1, window_tokens=2, is_draft=True)),
    small_config(GroupSpec(F, 1), GroupSpec(M, 2, is_draft=True)),
    small_config(GroupSpec(S, 1, window_tokens=2, is_draft=True),
                 GroupSpec(S, 2, window_tokens=3)),
    small_config(GroupSpec(F, 2, is_draft=True), GroupSpec(S, 2, window_tokens=3, is_draft=True)),
    small_config(GroupSpec(S, 3, window_tokens=3), GroupSpec(M, 2)),
    small_config(GroupSpec(F, 1), GroupSpec(S, 1, window_tokens=2)),
    small_config(GroupSpec(S, 1, window_tokens=3), GroupSpec(M, 2)),
)
PER_GROUP = 8
N_MAX = 5
C_MAX = 1


def _converge(layout: int, num_tokens: int, computed: int, bits: list[bool]) -> bool:
    cfg = LAYOUTS[pick(layout, len(LAYOUTS))]
    n = pick(num_tokens, N_MAX + 1)
    c = pick(computed, C_MAX + 1)
    maps = hit_maps(cfg, n, bits, PER_GROUP)
    out = converge(cfg, c, n, [len(m) for m in maps],
                   lambda group, idx: maps[group][idx] is Status.HIT)
    trace = LookupTraceRecord(tuple(g.is_draft for g in cfg.groups), out.trace,
                              c + out.hit if out.hit else 0)
    record = LookupRecord(cfg, c, n, maps, None, out.hit)
    return (out.hit == hit_for(cfg, c, n, maps, Status.HIT)
            and not e3_one_pop_per_cycle(trace) and not e4_draft_extra_chunk_hit(record))


def converge_matches_spec(layout: int, num_tokens: int, computed: int,
                          bits: list[bool]) -> bool:
    """converge's hit equals the reference hit (L1), its trace satisfies E3 and the hit
    E4, on 10 layouts (a draft group beside each kind, two draft windows, SLIDING with
    MAMBA, a plain window beside FULL), every request of N <= 5 tokens with C <= 1,
    and every hit map; no load in flight and no ``max_tokens`` cap.

    pre: 0 <= layout < 10
    pre: 0 <= num_tokens <= 5
    pre: 0 <= computed <= 1
    pre: len(bits) == 16
    post: __return__
    """
    return _converge(layout, num_tokens, computed, bits)


# (Dropping the draft clause alone is an equivalent mutant: a FULL draft group that
# verified a prefix plus its extra chunk at T has every chunk it needs at any T' < T.)
WINDOWS_NOT_REVERIFIED = mutant("kvcore.scheduler._lookup:_needs_reverify",
                                "return g.kind is not GroupKind.FULL or g.is_draft",
                                "return g.is_draft",
                                "a non-draft window group is not re-verified after a shrink")
DOUBLE_POP = mutant("kvcore.scheduler._lookup:converge",
                    "lambda group, _n: cfg.groups[group].extra_chunks",
                    "lambda group, _n: 2 * cfg.groups[group].extra_chunks",
                    "each verification of a draft group pops two chunks")
LIMIT_IGNORES_WINDOWS = mutant("kvcore.scheduler._rules:lookup_limit",
                               "            top = num_tokens - 1\n",
                               "            top = num_tokens\n",
                               "with window groups the last prompt token is served")


def mutant_windows_not_reverified(layout: int, num_tokens: int, computed: int,
                                  bits: list[bool]) -> bool:
    """converge_matches_spec with _needs_reverify forgetting non-draft window groups.

    pre: 0 <= layout < 10
    pre: 0 <= num_tokens <= 5
    pre: 0 <= computed <= 1
    pre: len(bits) == 16
    post: __return__
    """
    with WINDOWS_NOT_REVERIFIED.applied():
        return _converge(layout, num_tokens, computed, bits)


def mutant_double_pop(layout: int, num_tokens: int, computed: int, bits: list[bool]) -> bool:
    """converge_matches_spec with converge's pop rule doubled.

    pre: 0 <= layout < 10
    pre: 0 <= num_tokens <= 5
    pre: 0 <= computed <= 1
    pre: len(bits) == 16
    post: __return__
    """
    with DOUBLE_POP.applied():
        return _converge(layout, num_tokens, computed, bits)


def mutant_limit_ignores_windows(layout: int, num_tokens: int, computed: int,
                                 bits: list[bool]) -> bool:
    """converge_matches_spec with lookup_limit ignoring window groups.

    pre: 0 <= layout < 10
    pre: 0 <= num_tokens <= 5
    pre: 0 <= computed <= 1
    pre: len(bits) == 16
    post: __return__
    """
    with LIMIT_IGNORES_WINDOWS.applied():
        return _converge(layout, num_tokens, computed, bits)


# -- PENDING: the scheduler's two passes ------------------------------------------------------

L2_N_MAX = 3
L2_FINE_LAYOUT = 8  # FULL/1 + SLIDING/1 window 2: checked up to N = 2


class _Manager:
    """A tier whose lookup answers from the symbolic hit maps (keys are (group, chunk))."""

    def __init__(self, maps: tuple[object, ...]) -> None:
        self.maps = maps

    def lookup(self, key: tuple[int, int]) -> Status:
        group, idx = key
        return self.maps[group][idx]  # type: ignore[index]


def _lookup_answer(cfg: Any, maps: tuple[Any, ...], computed: int, n: int,
                   loading: object) -> object:
    """``OffloadScheduler._lookup_hit``'s answer over the symbolic tier ``maps`` (keys are
    (group, chunk)), with ``loading`` as the job table's set of keys being loaded."""
    keys = [[(g, i) for i in range(len(maps[g]))] for g in range(len(cfg.groups))]
    fake = SimpleNamespace(config=cfg, manager=_Manager(maps), _read_blocks=read_blocks(cfg),
                           _by_hash=False,  # the stand-in tier takes keys, not hashes
                           _jobs=SimpleNamespace(loading=loading))
    fake._being_loaded = lambda req, c, hit: OffloadScheduler._being_loaded(
        fake, req, c, hit)  # type: ignore[arg-type]
    fake._pessimistic_floor = lambda boundary, c: OffloadScheduler._pessimistic_floor(
        fake, boundary, c)  # type: ignore[arg-type]
    result, _conv, _statuses = OffloadScheduler._lookup_hit(
        fake, SimpleNamespace(keys=keys), computed, n)  # type: ignore[arg-type]
    return result


def _pending(layout: int, num_tokens: int, bits: list[bool], pending: list[bool]) -> bool:
    cfg = LAYOUTS[pick(layout, len(LAYOUTS))]
    n = pick(num_tokens, L2_N_MAX + 1)
    maps = hit_maps(cfg, n, bits, PER_GROUP, pending=pending)
    result = _lookup_answer(cfg, maps, 0, n, {})
    return not l2_pending_exactly_when_uncertain(
        LookupRecord(cfg, 0, n, maps, None, result))  # type: ignore[arg-type]


def pending_matches_spec(layout: int, num_tokens: int, bits: list[bool],
                         pending: list[bool]) -> bool:
    """The scheduler's lookup answer (hit, 0 or PENDING) equals spec_hit's (L1 and L2) on
    the 10 layouts, every request of N <= 3 tokens with C = 0 (N <= 2 on layout 8, whose
    1-token FULL and window groups make N = 3 alone cost about 65 CPU-s), and every
    three-valued hit map (HIT, MISS, PENDING); no load in flight (so PENDING comes only
    from the tier) and no ``max_tokens`` cap.

    pre: 0 <= layout < 10
    pre: 0 <= num_tokens <= 3
    pre: layout != L2_FINE_LAYOUT or num_tokens <= 2
    pre: len(bits) == 16
    pre: len(pending) == 16
    post: __return__
    """
    return _pending(layout, num_tokens, bits, pending)


PENDING_AS_MISS = mutant("kvcore.scheduler.scheduler:OffloadScheduler._lookup_hit",
                         "optimistic = run(HitTest(reader, pending_is_hit=True))",
                         "optimistic = run(HitTest(reader, pending_is_hit=False))",
                         "PENDING read as MISS on the first pass: never deferred")


def mutant_pending_as_miss(layout: int, num_tokens: int, bits: list[bool],
                           pending: list[bool]) -> bool:
    """pending_matches_spec with the first pass reading PENDING as MISS.

    pre: 0 <= layout < 10
    pre: 0 <= num_tokens <= 3
    pre: layout != L2_FINE_LAYOUT or num_tokens <= 2
    pre: len(bits) == 16
    pre: len(pending) == 16
    post: __return__
    """
    with PENDING_AS_MISS.applied():
        return _pending(layout, num_tokens, bits, pending)


# -- PENDING: a load in flight ---------------------------------------------------------------


class _LoadingKeys:
    """The scheduler's loading set: key ``(group, chunk)`` is being loaded by another
    request iff its bit is set, read only when asked. Never empty to ``bool``: the
    scheduler's "nothing loading" shortcut must not decide for it."""

    def __init__(self, bits: list[bool]) -> None:
        self._bits = bits

    def __bool__(self) -> bool:
        return True

    def __contains__(self, key: object) -> bool:
        group, idx = key  # type: ignore[misc]
        return self._bits[group * PER_GROUP + idx]


class _LoadingChunks:
    """The spec's view of the same set for one group: chunk indexes, the same bits."""

    def __init__(self, bits: list[bool], group: int) -> None:
        self._bits, self._group = bits, group

    def __contains__(self, idx: object) -> bool:
        return self._bits[self._group * PER_GROUP + idx]  # type: ignore[operator]


# Up to this many tokens the hit map is free too; above it (to N_MAX) every key is READY:
# both free at N = 5 cost about 530 CPU-s, at N <= 3 about 23.
LOADING_FREE_HITS_N = 3


def _being_loaded(layout: int, num_tokens: int, computed: int, bits: list[bool],
                  loading: list[bool]) -> bool:
    cfg = LAYOUTS[pick(layout, len(LAYOUTS))]
    n = pick(num_tokens, N_MAX + 1)
    c = pick(computed, C_MAX + 1)
    maps = hit_maps(cfg, n, bits if n <= LOADING_FREE_HITS_N else [True] * 16, PER_GROUP)
    result = _lookup_answer(cfg, maps, c, n, _LoadingKeys(loading))
    spec_loading = tuple(_LoadingChunks(loading, g) for g in range(len(cfg.groups)))
    record = LookupRecord(cfg, c, n, maps, spec_loading, result)  # type: ignore[arg-type]
    return not l1_hit_matches_spec(record) and not l2_pending_exactly_when_uncertain(record)


def loading_matches_spec(layout: int, num_tokens: int, computed: int, bits: list[bool],
                         loading: list[bool]) -> bool:
    """The being-loaded half of L2 (and L1 beside it): the scheduler's answer equals
    spec_hit's while another request loads any set of chunks (any chunk of any group), on
    the 10 layouts with C <= 1: every request of N <= 3 tokens with every HIT/MISS map,
    and of N = 4..5 with every key READY (the hit is then the largest supported boundary);
    no PENDING key, no max_tokens.

    pre: 0 <= layout < 10
    pre: 0 <= num_tokens <= 5
    pre: 0 <= computed <= 1
    pre: len(bits) == 16
    pre: len(loading) == 16
    post: __return__
    """
    return _being_loaded(layout, num_tokens, computed, bits, loading)


LOADING_DRAFT_EXTRA = mutant("kvcore.scheduler.scheduler:OffloadScheduler._being_loaded",
                             "rng = served_chunks(g, computed + hit, computed)",
                             "rng = needed_chunks(g, computed + hit, computed)",
                             "a draft group's volatile extra chunk, which a load never "
                             "reads, makes the reader wait when another request loads it")


def mutant_loading_draft_extra(layout: int, num_tokens: int, computed: int,
                               bits: list[bool], loading: list[bool]) -> bool:
    """loading_matches_spec with the wait judged on the needed chunks (the draft extra
    chunk included) instead of the served ones.

    pre: 0 <= layout < 10
    pre: 0 <= num_tokens <= 5
    pre: 0 <= computed <= 1
    pre: len(bits) == 16
    pre: len(loading) == 16
    post: __return__
    """
    with LOADING_DRAFT_EXTRA.applied():
        return _being_loaded(layout, num_tokens, computed, bits, loading)


OBLIGATIONS = (
    Obligation("converge_matches_spec", CONFIRMED, 300, 20, 58.5),
    Obligation("mutant_windows_not_reverified", REFUTED, 200, 20, 37.3, "converge_matches_spec"),
    Obligation("mutant_double_pop", REFUTED, 30, 20, 1.3, "converge_matches_spec"),
    Obligation("mutant_limit_ignores_windows", REFUTED, 60, 20, 12.0, "converge_matches_spec"),
    Obligation("pending_matches_spec", CONFIRMED, 150, 20, 27.8),
    Obligation("mutant_pending_as_miss", REFUTED, 30, 20, 1.8, "pending_matches_spec"),
    Obligation("loading_matches_spec", CONFIRMED, 180, 20, 35.9),
    Obligation("mutant_loading_draft_extra", REFUTED, 30, 20, 1.1, "loading_matches_spec"),
)
