"""E3 obligations: the implementation's convergence loop pops once per cycle and re-verifies.

``kvcore.scheduler._lookup.converge`` is the loop the scheduler runs (FULL groups first,
then windows largest first; a group is re-verified when another group strictly shrinks
the boundary below the one it was verified at; each verification of a draft group
requires exactly one extra chunk). It records a trace, and ``spec.invariants`` has the E3
predicate over that trace. ``cycle_machine`` runs the loop on every layout below, every
request of ``N <= 7`` tokens with ``C <= 2`` and every hit map of that size, and requires

- ``e3_one_pop_per_cycle(trace) == []``: one pop per verification, and every draft group
  was last verified at the boundary finally served, and
- the loop's hit equals the spec's hit (``spec.lookup.hit_for``), so the draft groups'
  extra chunks were checked where it matters (E4 follows from the spec's definition).

The layouts put a draft group beside every other kind, and include two draft window
groups: the case where upstream 0.33, re-arming the pop only on a non-draft shrink, served
a window draft group without its extra chunk.

Mutants (through the loop's ``extra_chunks`` hook, as the bug zoo does): a double pop,
and a pop that is not re-armed after the first verification.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcore.scheduler._lookup import converge
from kvcore.spec.invariants import LookupTraceRecord, e3_one_pop_per_cycle
from kvcore.spec.lookup import hit_for
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig, Status
from proofs._bounded import CONFIRMED, REFUTED, Obligation, hit_maps, pick, small_config

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
)
PER_GROUP = 8
N_MAX = 7
C_MAX = 2
PopRule = Callable[[int, int], int]


def _run(layout: int, num_tokens: int, computed: int, bits: list[bool],
         pop_rule: Callable[[OffloadConfig], PopRule] | None = None) -> bool:
    cfg = LAYOUTS[pick(layout, len(LAYOUTS))]
    n = pick(num_tokens, N_MAX + 1)
    c = pick(computed, C_MAX + 1)
    maps = hit_maps(cfg, n, bits, PER_GROUP)
    out = converge(cfg, c, n, [len(m) for m in maps],
                   lambda group, idx: maps[group][idx] is Status.HIT,
                   pop_rule(cfg) if pop_rule else None)
    record = LookupTraceRecord(tuple(g.is_draft for g in cfg.groups), out.trace,
                               c + out.hit if out.hit else 0)
    return (e3_one_pop_per_cycle(record) == []
            and out.hit == hit_for(cfg, c, n, maps, Status.HIT))


def cycle_machine(layout: int, num_tokens: int, computed: int, bits: list[bool]) -> bool:
    """
    pre: 0 <= layout < 7
    pre: 0 <= num_tokens <= 7
    pre: 0 <= computed <= 2
    pre: len(bits) == 16
    post: __return__
    """
    return _run(layout, num_tokens, computed, bits)


def mutant_double_pop(layout: int, num_tokens: int, computed: int, bits: list[bool]) -> bool:
    """Each verification of a draft group pops two chunks.

    pre: 0 <= layout < 7
    pre: 0 <= num_tokens <= 7
    pre: 0 <= computed <= 2
    pre: len(bits) == 16
    post: __return__
    """
    return _run(layout, num_tokens, computed, bits,
                lambda cfg: lambda g, _n: 2 * cfg.groups[g].extra_chunks)


def mutant_pop_not_rearmed(layout: int, num_tokens: int, computed: int,
                           bits: list[bool]) -> bool:
    """A draft group pops on its first verification only; re-verified, it needs no extra.

    pre: 0 <= layout < 7
    pre: 0 <= num_tokens <= 7
    pre: 0 <= computed <= 2
    pre: len(bits) == 16
    post: __return__
    """
    return _run(layout, num_tokens, computed, bits,
                lambda cfg: lambda g, n: cfg.groups[g].extra_chunks if n == 0 else 0)


OBLIGATIONS = (
    Obligation("cycle_machine", CONFIRMED, 240, 10),
    Obligation("mutant_double_pop", REFUTED, 20, 5, "cycle_machine"),
    Obligation("mutant_pop_not_rearmed", REFUTED, 30, 5, "cycle_machine"),
)
# The most CPU seconds this file's obligations may take together (the sum of their
# per-condition budgets must fit); measured times are far lower (see proofs/README.md).
TOTAL_BUDGET_S = 290
