"""The lookup cap (``max_tokens``): the hit is the largest supported boundary under the cap.

An engine may bound how far a load reaches (vLLM's ``max_num_new_tokens``). Clamping the
uncapped hit down to the cap would be wrong: a window or Mamba group that supports the
uncapped boundary need not support the cap. These tests hold kvcore's convergence loop,
the scheduler (with its runtime checks) and the reference model to the spec's definition,
and the spec itself to a brute force over every boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.manager import CPUOffloadManager
from kvcore.scheduler import OffloadScheduler, RequestInfo
from kvcore.scheduler._lookup import converge
from kvcore.spec.errors import BadStepError
from kvcore.spec.lookup import group_supports, hit_for, lookup_limit, spec_hit
from kvcore.spec.model import ReferenceScheduler
from kvcore.spec.types import (
    PENDING,
    GroupKind,
    GroupSpec,
    Key,
    OffloadConfig,
    Status,
    group_keys,
)
from tests.unit.spec_strategies import HIT, MISS, Request, lookups, make_config, parse_statuses

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA


def brute_capped(cfg: OffloadConfig, computed: int, num_tokens: int,
                 hits: Sequence[Sequence[Status]], pending_as: Status, cap: int | None) -> int:
    """Every boundary T from the capped limit down; independent of candidate_boundaries."""
    limit = lookup_limit(cfg, num_tokens)
    if cap is not None:
        limit = min(limit, computed + cap)
    min_new = max(g.tokens_per_chunk for g in cfg.groups)
    for boundary in range(limit, computed, -1):
        if boundary - computed >= min_new and all(
                group_supports(g, hits[i], boundary, computed, pending_as)
                for i, g in enumerate(cfg.groups)):
            return boundary - computed
    return 0


class MapTier:
    """A CPU tier that answers lookups from a fixed hit map (and ignores touches)."""

    def __init__(self, statuses: dict[Key, Status]) -> None:
        self.statuses = statuses

    def lookup(self, key: Key) -> Status:
        return self.statuses.get(key, Status.MISS)

    def touch(self, keys: Sequence[Key]) -> None:
        del keys

    def _unused(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("a lookup test's tier is only read")

    # The rest of the manager interface, which OffloadScheduler checks for at construction.
    prepare_load = complete_load = prepare_store = complete_store = _unused
    reset = take_events = stats = _unused


def request_for(cfg: OffloadConfig, req: Request) -> tuple[RequestInfo, dict[Key, Status]]:
    """A request whose chunk i of group g has status ``req.hits[g][i]``."""
    hashes = tuple(i.to_bytes(4, "big") for i in range(req.num_tokens // cfg.hash_block_tokens))
    statuses: dict[Key, Status] = {}
    for g in range(len(cfg.groups)):
        for key, status in zip(group_keys(cfg, g, hashes), req.hits[g], strict=False):
            statuses[key] = status
    return RequestInfo("r", req.num_tokens, hashes), statuses


def caps(req: Request) -> st.SearchStrategy[int | None]:
    return st.none() | st.integers(0, req.num_tokens - req.computed + 2)


@settings(max_examples=300, deadline=None)
@given(lookups(), st.data())
def test_converge_with_cap_equals_spec(case: tuple[OffloadConfig, Request], data: Any) -> None:
    """Mutant killed: converge ignoring max_tokens, or clamping the uncapped hit to the cap."""
    cfg, req = case
    cap = data.draw(caps(req))
    num_keys = [len(h) for h in req.hits]
    for pending_as in (HIT, MISS):
        def is_hit(g: int, i: int, pa: Status = pending_as) -> bool:
            s = req.hits[g][i]
            return (pa if s is Status.PENDING else s) is Status.HIT

        got = converge(cfg, req.computed, req.num_tokens, num_keys, is_hit, max_tokens=cap)
        want = hit_for(cfg, req.computed, req.num_tokens, req.hits, pending_as,
                       max_tokens=cap)
        assert got.hit == want
        assert want == brute_capped(cfg, req.computed, req.num_tokens, req.hits, pending_as,
                                    cap)
        if cap is not None:
            assert want <= cap


@settings(max_examples=150, deadline=None)
@given(lookups(), st.data())
def test_scheduler_and_model_capped_lookup_equal_spec_hit(
        case: tuple[OffloadConfig, Request], data: Any) -> None:
    """The whole hook, checks on (L1/L2 now read the cap): scheduler == model == spec_hit.

    Mutant killed: scheduler.lookup not passing max_tokens to the loop (or to its check).
    """
    cfg, req = case
    cap = data.draw(caps(req))
    info, statuses = request_for(cfg, req)
    impl = OffloadScheduler(cfg, MapTier(statuses), check=True)
    impl.add_request(info)
    model = ReferenceScheduler(cfg, MapTier(statuses))
    model.add_request(info)
    want = spec_hit(cfg, req.computed, req.num_tokens, req.hits, max_tokens=cap)
    assert impl.lookup("r", req.computed, req.num_tokens, max_tokens=cap) == want
    assert model.lookup("r", req.computed, req.num_tokens, max_tokens=cap) == want


def one_lookup(groups: Sequence[GroupSpec], rows: Sequence[str], num_tokens: int,
               cap: int | None) -> Any:
    cfg = make_config(*groups, hash_block_tokens=4)
    hits = tuple(parse_statuses(r) for r in rows)
    info, statuses = request_for(cfg, Request(0, num_tokens, hits))
    sched = OffloadScheduler(cfg, MapTier(statuses), check=True)
    sched.add_request(info)
    got = sched.lookup("r", 0, num_tokens, max_tokens=cap)
    assert got == spec_hit(cfg, 0, num_tokens, hits, max_tokens=cap)
    return got


WINDOW = [GroupSpec(FULL, 4), GroupSpec(SLIDING, 4, window_tokens=8)]
MAMBA_MIX = [GroupSpec(FULL, 4), GroupSpec(MAMBA, 8)]


@pytest.mark.parametrize(("groups", "rows", "num_tokens", "cap", "want"), [
    # Window of 2 chunks; chunk 2 missing. Uncapped: 24. Under a cap of 16 the window at
    # 16 (and 12) reads chunk 2, so the hit is 8, not the cap.
    (WINDOW, ["HHHHHH", "HHMHHH"], 25, None, 24),
    (WINDOW, ["HHHHHH", "HHMHHH"], 25, 20, 20),
    (WINDOW, ["HHHHHH", "HHMHHH"], 25, 16, 8),
    # Mamba state exists only at 8-token ends: a cap of 12 gives 8, a cap of 16 gives 16.
    (MAMBA_MIX, ["HHHH", "HH"], 17, None, 16),
    (MAMBA_MIX, ["HHHH", "HH"], 17, 12, 8),
    (MAMBA_MIX, ["HHHH", "HH"], 17, 7, 0),
    # Full attention alone supports any boundary: exactly the cap (>= one chunk).
    ([GroupSpec(FULL, 4)], ["HHHH"], 16, 10, 10),
    ([GroupSpec(FULL, 4)], ["HHHH"], 16, 3, 0),
    ([GroupSpec(FULL, 4)], ["HHHH"], 16, 0, 0),
    # A PENDING chunk above the cap cannot change the answer: no deferral.
    ([GroupSpec(FULL, 4)], ["HHP"], 12, None, PENDING),
    ([GroupSpec(FULL, 4)], ["HHP"], 12, 8, 8),
    # A draft group still needs its extra chunk beyond the capped boundary.
    ([GroupSpec(FULL, 4, is_draft=True)], ["HHHM"], 16, 12, 8),
    ([GroupSpec(FULL, 4, is_draft=True)], ["HHHH"], 16, 12, 12),
])
def test_capped_lookup_directed(groups: list[GroupSpec], rows: list[str], num_tokens: int,
                                cap: int | None, want: Any) -> None:
    """Mutant killed: ``min(uncapped_hit, cap)`` (gives 16 and 12 where 8 is right)."""
    assert one_lookup(groups, rows, num_tokens, cap) == want


class _LyingInt(int):
    """An int subclass that says it is not negative and adds as a float."""

    def __lt__(self, other: object) -> bool:
        return False

    def __radd__(self, other: object) -> float:
        return 10.5


@pytest.mark.parametrize("bad", [-1, True, 2.5, "8", _LyingInt(8), _LyingInt(-4)])
def test_bad_cap_is_refused_and_changes_nothing(bad: Any) -> None:
    cfg = make_config(GroupSpec(FULL, 4), hash_block_tokens=4)
    for sched in (OffloadScheduler(cfg, CPUOffloadManager(8), check=True),
                  ReferenceScheduler(cfg, CPUOffloadManager(8))):
        sched.add_request(RequestInfo("r", 8, (b"a", b"b")))
        with pytest.raises(BadStepError, match="max_tokens"):
            sched.lookup("r", 0, 8, max_tokens=bad)
        assert sched.stats().lookups == 0


def test_the_pop_rule_is_told_each_groups_verification_number() -> None:
    """``extra_chunks(group, n)`` gets 0 for a group's first verification, then 1, 2, ...

    The default rule ignores ``n``; the bug zoo's rules (``pop-once-only``) key on it, so a
    loop that numbered from 1, or skipped numbers, would change what the zoo tests. Here the
    draft window shrinks the boundary after the FULL group passed, the window-2 group then
    shrinks it again, and the draft group is verified a second time.
    """
    cfg = make_config(GroupSpec(FULL, 2), GroupSpec(SLIDING, 2, window_tokens=2),
                      GroupSpec(SLIDING, 2, window_tokens=4, is_draft=True))
    rows = ["HH.HHH", "H..HHH", "HHHHHH"]
    calls: dict[int, list[int]] = {}

    def pops(group: int, n: int) -> int:
        calls.setdefault(group, []).append(n)
        return cfg.groups[group].extra_chunks

    got = converge(cfg, 0, 13, [6, 6, 6], lambda g, i: rows[g][i] == "H", pops)
    assert got.hit == 2
    assert calls == {0: [0], 1: [0], 2: [0, 1]}


def test_a_lookup_no_group_can_support_reads_no_key() -> None:
    """A draft group with only its volatile chunk rules out any hit before a key is read.

    9 tokens: the 2-token group has 4 keys, the 8-token draft group 1, all of which is the
    chunk its verification needs beyond the boundary. No boundary is supported, so the loop
    must not scan the other group's keys first (each read is a manager call).
    """
    cfg = make_config(GroupSpec(FULL, 2), GroupSpec(FULL, 8, is_draft=True))
    reads: list[tuple[int, int]] = []

    def is_hit(group: int, idx: int) -> bool:
        reads.append((group, idx))
        return True

    got = converge(cfg, 0, 9, [4, 1], is_hit)
    assert (got.hit, got.trace, reads) == (0, (), [])
