"""Upstream's scheduler scenario catalogue (docs/upstream.md §7.2), on kvcore's API.

Goal: pin, scenario by scenario, what kvcore's scheduler does in each situation upstream
vLLM's offloading connector tests: which GPU block positions are stored, loaded and
flushed, what a lookup answers, when jobs complete and requests are forgotten. Each test
names its §7.2 item in its docstring. Where kvcore differs from upstream on purpose
(docs/semantics.md: no all-groups fallback, draft FULL groups are widened, store holes are
impossible, E1 uses the write frontier V, nothing is stored at finish, PENDING only when
it changes the answer, invalid config values raise instead of meaning "no cap"), the test
pins kvcore's answer and a comment says why.

Method: upstream drives a real engine with a mocked manager; kvcore has no engine, so the
fake engine of ``tests/refinement/_engine.py`` plays it (block allocation, chunked
prefill, MTP decode, preemption, worker reports), with a real ``CPUOffloadManager``
instead of a mock: a key is a hit because an earlier request stored it. Every scenario
runs the implementation (with runtime checks on) and the reference model in lockstep, so
each one pins both. Positions are reported as upstream does: ``(group, block position)``
of the request that owns the GPU block. A ``Spy`` manager records the calls upstream's
mock asserted on (touch, prepare_store, complete_store, lookup).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest
from refinement._engine import Engine, chain_hashes

from kvcore.manager import CPUOffloadManager, cpu_capacities
from kvcore.scheduler import (
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    WorkerReport,
)
from kvcore.sim._lockstep import Lockstep
from kvcore.spec.errors import ConfigError
from kvcore.spec.model import ReferenceScheduler
from kvcore.spec.plans import TransferPlan
from kvcore.spec.types import (
    PENDING,
    GroupKind,
    GroupSpec,
    Key,
    OffloadConfig,
    StoreLevel,
    group_keys,
)

FULL, SLIDING = GroupKind.FULL, GroupKind.SLIDING


class Spy(CPUOffloadManager):
    """The CPU tier, recording the calls upstream's mock manager asserted on."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, check=True)
        self.calls: list[tuple[str, tuple[Key, ...]]] = []

    def touch(self, keys: Sequence[Key]) -> None:
        self.calls.append(("touch", tuple(keys)))
        super().touch(keys)

    def prepare_store(self, keys: Sequence[Key]) -> Any:
        self.calls.append(("prepare_store", tuple(keys)))
        return super().prepare_store(keys)

    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        self.calls.append(("complete_store", tuple(keys)))
        super().complete_store(keys, success)

    def lookup(self, key: Key) -> Any:
        self.calls.append(("lookup", (key,)))
        return super().lookup(key)

    def lookup_many(self, keys: Sequence[Key]) -> Any:
        # Recorded as one lookup per key: the tests count the keys the tier is asked for.
        self.calls.extend(("lookup", (key,)) for key in keys)
        return super().lookup_many(keys)

    def named(self, name: str) -> list[tuple[Key, ...]]:
        return [keys for n, keys in self.calls if n == name]


def config(*groups: GroupSpec, hbt: int = 4, gpu: int = 100, cpu: int = 64,
           **fields: Any) -> OffloadConfig:
    speculative = any(g.is_draft for g in groups)
    return OffloadConfig(tuple(groups), hbt, gpu, cpu, speculative=speculative, **fields)


def engine(cfg: OffloadConfig, *, chunk: int = 64, spec_tokens: int = 0,
           check: bool = True) -> tuple[Engine, Spy]:
    """A fake engine over the implementation (a ``Spy`` tier) and the model, in lockstep."""
    spy = Spy(cpu_capacities(cfg))
    pair = Lockstep(OffloadScheduler(cfg, spy, check=check), ReferenceScheduler(cfg))
    return Engine(cfg, pair, prefill_chunk=chunk, spec_tokens=spec_tokens), spy


def pair(cfg: OffloadConfig) -> Lockstep:
    """Both schedulers, for scenarios scripted hook by hook (no engine)."""
    return Lockstep(OffloadScheduler(cfg, CPUOffloadManager.for_config(cfg, check=True),
                                     check=True), ReferenceScheduler(cfg))


def where(e: Engine, plans: Iterable[TransferPlan]) -> set[tuple[int, int]]:
    """(group, block position) of every GPU block the plans move."""
    return {e.owner[i][1:] for p in plans for g in p.groups for i in g.gpu_block_ids}


def settle(e: Engine) -> None:
    """Every pending worker report arrives, successful."""
    e.deliver([(j, w, True) for j, w in e.pending_reports()])


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 13 + i * 7) % 101 for i in range(n)]


def prefill(e: Engine, rid: str, local_units: int = 0) -> Any:
    """Admit the request and step once; returns (lookup answer, step plan)."""
    hit = e.admit(rid, local_units)
    return hit, e.step()


# -- §7.2 item 1: test_offloading_connector ------------------------------------------------

BS4_BPC3 = config(GroupSpec(FULL, 4, 3))  # upstream: GPU block 4 tokens, block_size_factor 3


def test_store_only_the_middle_chunk() -> None:
    """§7.2 item 1: three chunks offered, only the absent middle one stored: blocks 3, 4, 5.

    Upstream's mock ``prepare_store`` simply returns the middle key. With a real tier a
    chunk is absent because nobody stored it, and keys chain, so the middle chunk is made
    absent by failing its store (X1 removes the key) while chunks 0 and 2 complete.
    """
    e, spy = engine(BS4_BPC3, chunk=12)
    first = e.arrive(tokens(36), 1)
    e.admit(first)
    jobs = [e.step().stores[0].job_id for _ in range(3)]
    e.deliver([(jobs[0], 0, True), (jobs[1], 0, False), (jobs[2], 0, True)])
    e.prefill_chunk = 36
    again = e.arrive(tokens(36), 1, skip_reading=True)
    _, plan = prefill(e, again)
    assert spy.named("prepare_store")[-1] == tuple(group_keys(BS4_BPC3, 0, e.reqs[again].hashes))
    assert where(e, plan.stores) == {(0, 3), (0, 4), (0, 5)}
    assert [g.block_index for g in plan.stores[0].groups] == [3]


def test_incomplete_chunk_is_not_stored() -> None:
    """§7.2 item 1: a chunk missing one token is not offloaded (nothing offered at all).

    Upstream also checks that ``touch`` is not called; kvcore never touches on a store
    (recency is refreshed by lookups; a stored key becomes most recent when its write
    completes), so no store path calls ``touch`` in any case.
    """
    e, spy = engine(BS4_BPC3)
    rid = e.arrive(tokens(11), 1)
    e.admit(rid)
    spy.calls.clear()
    plan = e.step()
    assert plan.stores == ()
    assert spy.named("prepare_store") == [] and spy.named("touch") == []


def test_prepare_store_none_retries_next_step() -> None:
    """§7.2 item 1: ``prepare_store`` answering None (no room) stores nothing, moves no
    cursor, and the same chunks are offered again at the next step."""
    cfg = config(GroupSpec(FULL, 4, 3), cpu=1)
    e, spy = engine(cfg, chunk=24)
    rid = e.arrive(tokens(30), 4)
    _, plan = prefill(e, rid)
    keys = group_keys(cfg, 0, e.reqs[rid].hashes)
    assert plan.stores == () and spy.named("prepare_store") == [tuple(keys[:2])]
    assert e.sched.impl.cursors(rid) == (0,)
    e.step()
    assert spy.named("prepare_store")[-1] == tuple(keys[:2])
    assert e.sched.impl.stats().store_skipped_no_room == 2


def test_empty_store_output_moves_the_cursor() -> None:
    """§7.2 item 1: every offered key already stored: no job, but the cursor advances."""
    e, spy = engine(BS4_BPC3)
    first = e.arrive(tokens(24), 1)
    prefill(e, first)
    settle(e)
    again = e.arrive(tokens(24), 4, skip_reading=True)
    _, plan = prefill(e, again)
    assert spy.named("prepare_store")[-1] == tuple(group_keys(BS4_BPC3, 0, e.reqs[again].hashes))
    assert plan.stores == () and e.sched.impl.cursors(again) == (2,)


def test_lookup_touches_every_key() -> None:
    """§7.2 item 1: a lookup touches all of a FULL group's keys (upstream: all 6)."""
    e, spy = engine(BS4_BPC3)
    rid = e.arrive(tokens(72), 1)
    spy.calls.clear()
    e.admit(rid)
    assert spy.named("touch") == [tuple(group_keys(BS4_BPC3, 0, e.reqs[rid].hashes))]
    assert len(spy.named("touch")[0]) == 6


def test_requests_differing_in_the_last_token_share_all_other_keys() -> None:
    """§7.2 item 1: two prompts that differ only in the last token have equal keys except
    the last (keys chain the prefix; K1 keeps the differing ones apart)."""
    a, b = tokens(36), tokens(36)
    b[-1] += 1
    ka = group_keys(BS4_BPC3, 0, chain_hashes(a, 0, b"", 4))
    kb = group_keys(BS4_BPC3, 0, chain_hashes(b, 0, b"", 4))
    assert ka[:-1] == kb[:-1] and ka[-1] != kb[-1]


def test_hit_shorter_than_one_chunk_reads_nothing() -> None:
    """§7.2 item 1: when the tokens beyond C are fewer than one chunk, the tier is not
    asked at all and the answer is 0. (Runtime checks off: the checker reads every key.)"""
    e, spy = engine(BS4_BPC3, check=False)
    rid = e.arrive(tokens(11), 1)
    spy.calls.clear()
    assert e.admit(rid) == 0
    assert spy.named("lookup") == []


def test_single_chunk_miss_reads_one_key() -> None:
    """§7.2 item 1: a one-chunk request that misses asks the tier for exactly one key."""
    e, spy = engine(BS4_BPC3, check=False)
    rid = e.arrive(tokens(12), 1)
    spy.calls.clear()
    assert e.admit(rid) == 0
    assert len(spy.named("lookup")) == 1


def test_single_chunk_hit_loads_blocks_0_to_2() -> None:
    """§7.2 item 1: a one-chunk hit loads GPU blocks (0, 1, 2)."""
    e, _ = engine(BS4_BPC3)
    first = e.arrive(tokens(12), 1)
    prefill(e, first)
    settle(e)
    again = e.arrive([*tokens(12), 5], 1)
    hit, plan = prefill(e, again)
    assert hit == 12
    assert where(e, plan.loads) == {(0, 0), (0, 1), (0, 2)}


def test_middle_chunk_hit_loads_blocks_3_to_5() -> None:
    """§7.2 item 1: with chunk 0 on the GPU already (C = 12), a hit on the next chunk loads
    GPU blocks (3, 4, 5) and starts at block_index 3."""
    e, _ = engine(BS4_BPC3)
    first = e.arrive(tokens(24), 1)
    prefill(e, first)
    settle(e)
    again = e.arrive([*tokens(24), 5], 1)
    hit, plan = prefill(e, again, local_units=3)
    assert hit == 12
    assert where(e, plan.loads) == {(0, 3), (0, 4), (0, 5)}
    assert plan.loads[0].groups[0].block_index == 3


# -- §7.2 item 2: test_request_preemption ------------------------------------------------------


def test_request_preemption() -> None:
    """§7.2 item 2: a preempted request's stores are flushed (then stored); re-admitted, it
    loads what was stored (blocks 0-8) and stores the rest (9-11); no job is left."""
    cfg = config(GroupSpec(FULL, 4), gpu=13)
    e, _ = engine(cfg, chunk=36)
    rid = e.arrive(tokens(48), 1)
    _, plan = prefill(e, rid)
    assert where(e, plan.stores) == {(0, p) for p in range(9)}
    flushed = e.step(preempt=(rid,))
    assert flushed.flush == tuple(s.job_id for s in plan.stores)
    settle(e)
    hit, plan = prefill(e, rid)
    assert hit == 36
    assert where(e, plan.loads) == {(0, p) for p in range(9)}
    settle(e)
    plan = e.step()
    assert where(e, plan.stores) == {(0, 9), (0, 10), (0, 11)}
    settle(e)
    e.run(20)
    assert not e.sched.impl.has_pending_work()


def test_long_block_lists_enter_the_tables_in_order() -> None:
    """A prefill's or a resumed request's block lists of 64 ids or more enter the tables
    through struct packing, not ``array.extend``: every stored chunk must still read the
    ids at its own positions (the engine's ownership witness checks each one), for a
    prefill of 130 blocks and again after a preemption resends them whole."""
    cfg = config(GroupSpec(FULL, 4), gpu=300, cpu=300)
    e, _ = engine(cfg, chunk=4 * 130)
    rid = e.arrive(tokens(4 * 131), 1)
    _, plan = prefill(e, rid)
    (store,) = plan.stores
    assert [e.owner[i][2] for i in store.groups[0].gpu_block_ids] == list(range(130))
    e.step(preempt=(rid,))
    settle(e)
    hit, plan = prefill(e, rid)  # resumed: its 131 ids are sent whole
    assert hit == 4 * 130 and where(e, plan.loads) == {(0, p) for p in range(130)}
    settle(e)
    assert where(e, e.step().stores) == {(0, 130)}  # read from the resent table


# -- §7.2 items 3, 5, 11: completion order, aborts, one complete_store per job ------------------


def test_request_forgotten_only_after_its_last_completion() -> None:
    """§7.2 item 3: a request finished with stores in flight stays tracked; every
    ``complete_store`` comes first, and the request is forgotten exactly once, after the
    last. (kvcore's tier has no ``on_request_finished``; forgetting the request is the
    observable counterpart.)"""
    e, spy = engine(BS4_BPC3, chunk=12)
    rid = e.arrive(tokens(24), 1)
    prefill(e, rid)
    e.step()
    e.abort(rid)
    assert rid in e.sched.impl.tracked_requests()
    jobs = sorted(e.live)
    e.deliver([(jobs[1], 0, True)])
    assert rid in e.sched.impl.tracked_requests()
    e.deliver([(jobs[0], 0, True)])
    assert rid not in e.sched.impl.tracked_requests()
    assert len(spy.named("complete_store")) == 2


def test_abort_while_loading() -> None:
    """§7.2 item 5: an aborted request stays tracked until its load completes, then goes."""
    e, _ = engine(BS4_BPC3)
    first = e.arrive(tokens(24), 1)
    prefill(e, first)
    settle(e)
    again = e.arrive([*tokens(24), 1], 1)
    assert e.admit(again) == 24
    e.step()
    e.abort(again)
    assert again in e.sched.impl.tracked_requests()
    out = e.deliver([(e.reqs[again].load_job or 0, 0, True)])
    assert out.finished_loads == (again,)
    assert again not in e.sched.impl.tracked_requests()


def test_complete_store_once_per_job_with_its_keys() -> None:
    """§7.2 item 11: one ``complete_store`` per job, each with exactly that job's keys."""
    e, spy = engine(BS4_BPC3, chunk=12)
    rid = e.arrive(tokens(36), 1)
    e.admit(rid)
    plans = [e.step().stores[0] for _ in range(3)]
    e.deliver([(p.job_id, 0, True) for p in reversed(plans)])
    assert spy.named("complete_store") == [p.keys for p in reversed(plans)]


# -- §7.2 item 4 and 15: deferrals ---------------------------------------------------------


def test_concurrent_lookups_of_the_same_prefix() -> None:
    """§7.2 item 4: while one request loads a prefix, a second request for it waits
    (PENDING) instead of issuing a second load; once the load lands it hits.

    Upstream's second request then hits the GPU prefix cache; kvcore has no GPU cache, so
    the pinned answer is the CPU hit on the retry.
    """
    e, _ = engine(BS4_BPC3)
    first = e.arrive(tokens(24), 1)
    prefill(e, first)
    settle(e)
    a, b = e.arrive([*tokens(24), 1], 1), e.arrive([*tokens(24), 2], 1)
    assert e.admit(a) == 24
    assert e.admit(b) is PENDING
    e.step()
    settle(e)
    assert e.admit(b) == 24


def test_a_draft_extra_chunk_another_load_reads_does_not_defer() -> None:
    """A lookup defers (PENDING) only for a load of a chunk it would serve. A draft
    group's chunk past the hit is read to verify the hit, never served, so another
    request loading it changes nothing here (L2: PENDING only when it changes the answer).

    ``a`` holds 16 tokens on the GPU and loads chunks 4..8 (hit to 36; chunk 9 verifies
    it). ``b`` shares the prompt's first 5 chunks only: its hit is 16, served from chunks
    0..3 and verified by chunk 4, which ``a`` is loading. Mutant: ``served_chunks`` keeps
    the draft group's extra chunk (``hi - 0``), and ``b`` waits for a load it never needs.
    """
    e, _ = engine(config(GroupSpec(FULL, 4, is_draft=True), cpu=64))
    first = e.arrive(tokens(44), 1)
    prefill(e, first)
    settle(e)
    a = e.arrive([*tokens(40), 1], 1)
    assert e.admit(a, local_units=4) == 20  # from 16 to 36, chunk 9 verifying it
    b = e.arrive([*tokens(20), *tokens(20, seed=5)], 1)
    assert e.admit(b) == 16


def test_jobs_in_flight_defer_the_lookup() -> None:
    """§7.2 item 15: a request preempted with stores in flight is re-admitted only after
    they complete: its lookup answers PENDING until then (J1)."""
    e, _ = engine(BS4_BPC3)
    rid = e.arrive(tokens(24), 2)
    prefill(e, rid)
    e.step(preempt=(rid,))
    assert e.admit(rid) is PENDING
    settle(e)
    assert e.admit(rid) == 24


# -- §7.2 item 6, 16, 17: sliding windows ---------------------------------------------------


def full_and_window(**fields: Any) -> OffloadConfig:
    """Upstream's layout: full attention and a 2-block sliding window, 4-token blocks."""
    return config(GroupSpec(FULL, 4), GroupSpec(SLIDING, 4, window_tokens=8), **fields)


def test_two_groups_full_and_sliding_window() -> None:
    """§7.2 item 6: a full hit loads (0,0),(0,1),(0,2),(1,1),(1,2); a partial GPU hit
    (C = 12) loads (0,3),(1,3); each lookup touches once per group, the window group only
    its last W + e chunks from the boundary reached."""
    cfg = full_and_window()
    e, spy = engine(cfg)
    first = e.arrive(tokens(16), 1)
    prefill(e, first)
    settle(e)
    again = e.arrive(tokens(13), 1)
    spy.calls.clear()
    hit, plan = prefill(e, again)
    assert hit == 12
    assert where(e, plan.loads) == {(0, 0), (0, 1), (0, 2), (1, 1), (1, 2)}
    touched = spy.named("touch")
    keys = [group_keys(cfg, g, e.reqs[again].hashes) for g in (0, 1)]
    assert touched == [tuple(keys[0]), tuple(keys[1][1:])]
    third = e.arrive(tokens(17), 1)
    hit, plan = prefill(e, third, local_units=3)
    assert hit == 4
    assert where(e, plan.loads) == {(0, 3), (1, 3)}


def test_draft_window_touch_reaches_its_extra_chunk() -> None:
    """§7.2 item 6, with a draft window group: the lookup touches the window group's keys
    from W + e chunks before the boundary (upstream: W) to e chunks past it, so the extra
    chunk a later lookup needs stays as recent as the window itself, and none beyond."""
    cfg = config(GroupSpec(FULL, 4), draft(SLIDING, 8))
    e, spy = engine(cfg, spec_tokens=1)
    rid = e.arrive(tokens(25), 1)
    spy.calls.clear()
    assert e.admit(rid) == 0
    keys = group_keys(cfg, 1, e.reqs[rid].hashes)
    # Boundary C = 0: only the extra chunk a lookup at 0 reads, not the rest of the prompt.
    assert spy.named("touch")[1] == tuple(keys[:1])
    e.run(10)
    again = e.arrive(tokens(25), 1)
    spy.calls.clear()
    assert e.admit(again) == 16  # chunk 4 is the draft group's extra chunk beyond 16
    assert spy.named("touch")[1] == tuple(keys[16 // 4 - 3:16 // 4 + 1])


def test_swa_alignment_skip() -> None:
    """§7.2 item 16: full attention with 16-token blocks and a 4-token window group
    (window 8): only the last W = 2 chunks of each 4-chunk segment are stored,
    (1,2),(1,3),(1,6),(1,7), and a hit at 32 loads (1,6),(1,7)."""
    cfg = config(GroupSpec(FULL, 16), GroupSpec(SLIDING, 4, window_tokens=8))
    e, _ = engine(cfg)
    first = e.arrive(tokens(32), 1)
    _, plan = prefill(e, first)
    assert where(e, plan.stores) == {(0, 0), (0, 1), (1, 2), (1, 3), (1, 6), (1, 7)}
    settle(e)
    again = e.arrive(tokens(33), 1)
    hit, plan = prefill(e, again)
    assert hit == 32
    assert where(e, plan.loads) == {(0, 0), (0, 1), (1, 6), (1, 7)}


def test_stale_sliding_window_block_after_prepare_store_failure() -> None:
    """§7.2 item 17: window blocks freed and handed out again while the store waited for
    room are zeroed, so only positions 2 and 3 are stored (never a stale block).

    A window of one token (R = 0) lets the engine free positions 0 and 1 as soon as the
    second prefill chunk starts; four usable GPU blocks force their reuse at once.
    """
    cfg = config(GroupSpec(SLIDING, 4, window_tokens=1), gpu=5, cpu=2)
    e, _ = engine(cfg, chunk=8)
    other = e.arrive(tokens(8, seed=1), 1)
    _, plan = prefill(e, other)
    blocker = plan.stores[0].job_id  # two chunks being written: the tier is full
    rid = e.arrive(tokens(16), 2)
    _, plan = prefill(e, rid)
    assert plan.stores == () and e.sched.impl.stats().store_skipped_no_room == 1
    e.deliver([(blocker, 0, True)])
    plan = e.step()
    assert where(e, plan.stores) == {(0, 2), (0, 3)}


# -- §7.2 item 7: different block sizes -------------------------------------------------------


def test_two_groups_different_block_sizes() -> None:
    """§7.2 item 7: groups of 12 and 16 tokens, hashes of 4: chunks are stored as each
    group's frontier passes them (24, 32, 36, 48 tokens), and a repeat loads 48 tokens."""
    cfg = config(GroupSpec(FULL, 12), GroupSpec(FULL, 16))
    e, _ = engine(cfg, chunk=20)
    rid = e.arrive(tokens(20), 30)
    e.admit(rid)
    stored_at: list[tuple[int, set[tuple[int, int]]]] = []
    while e.reqs[rid].state != "finished":
        frontier = e.reqs[rid].computed
        plan = e.step()
        if plan.stores:
            stored_at.append((frontier + 1 if frontier else 20, where(e, plan.stores)))
    assert stored_at == [(20, {(0, 0), (1, 0)}), (24, {(0, 1)}), (32, {(1, 1)}),
                         (36, {(0, 2)}), (48, {(0, 3), (1, 2)})]
    settle(e)
    again = e.arrive(e.reqs[rid].tokens[:50], 1)
    hit, plan = prefill(e, again)
    assert hit == 48
    assert where(e, plan.loads) == {(0, p) for p in range(4)} | {(1, p) for p in range(3)}


# -- §7.2 item 8: the primitive lookups, as whole lookups --------------------------------------


def lookup_with(groups: Sequence[GroupSpec], statuses: Sequence[str], num_tokens: int) -> Any:
    """The lookup of a request whose chunk i of group g is ``statuses[g][i]``: H (stored),
    P (being written) or M (absent). Every group has 4-token blocks, one per chunk; the
    request's hashes cover every chunk named, which may reach beyond ``num_tokens`` (as
    upstream's tests hand the lookup more keys than N covers)."""
    cfg = config(*groups, cpu=64)
    s = pair(cfg)
    hashes = chain_hashes(tokens(4 * max(map(len, statuses))), 0, b"", 4)
    for manager in (s.impl.manager, s.model.manager):
        for g, row in enumerate(statuses):
            keys = group_keys(cfg, g, hashes)
            manager.prepare_store([k for k, st in zip(keys, row, strict=False) if st != "M"])
            manager.complete_store([k for k, st in zip(keys, row, strict=False) if st == "H"])
    s.add_request(RequestInfo("r", num_tokens, tuple(hashes)))
    return s.lookup("r", 0, num_tokens)


def hit_map_lookup(kind: GroupKind, statuses: str, num_tokens: int, window: int | None = None
                   ) -> Any:
    """The lookup of a one-group request (see ``lookup_with``)."""
    return lookup_with([GroupSpec(kind, 4, window_tokens=window)], [statuses], num_tokens)


@pytest.mark.parametrize(("statuses", "want"), [
    ("HH", 8), ("MM", 0), ("HHM", 8), ("MH", 0), ("H", 4), ("", 0),
    ("PH", PENDING), ("HP", PENDING),
    # Upstream: None, with exactly 2 tier reads. kvcore agrees on PENDING: read as a hit,
    # chunk 0 would give 4 tokens; read as a miss, 0.
    ("PMH", PENDING),
])
def test_maximal_prefix_lookup(statuses: str, want: Any) -> None:
    """§7.2 item 8 (TestMaximalPrefixLookup): a FULL group's hit is its hit prefix."""
    assert hit_map_lookup(FULL, statuses, 4 * len(statuses)) == want


@pytest.mark.parametrize(("statuses", "window", "want"), [
    ("HH", 8, 8), ("M", 4, 0), ("MHH", 8, 12), ("MHHM", 8, 12), ("HHM", 12, 8),
    ("MHH", 4, 12), ("HHHMH", 8, 12), ("HHMHH", 8, 20), ("HMHHH", 16, 4), ("", 8, 0),
    # Upstream answers None whenever any key is unknown. kvcore defers only when the
    # unknown key can change the hit (L2): here the window ending at chunk 3 is all hits
    # whatever chunk 0 turns out to be.
    ("PHH", 8, 12),
    ("HHP", 8, PENDING),
])
def test_sliding_window_lookup(statuses: str, window: int, want: Any) -> None:
    """§7.2 item 8 (TestSlidingWindowLookup): a window group's hit ends at the rightmost
    run of W hit chunks (the limit is N - 1, so N is one token past the chunks)."""
    assert hit_map_lookup(SLIDING, statuses, 4 * len(statuses) + 1, window) == want


# -- §7.2 item 9, 12, 13, 18: what gets stored ---------------------------------------------------


@pytest.mark.parametrize(("level", "cursor", "offered"), [
    (StoreLevel.BLOCK, (2,), 1), (StoreLevel.REQUEST, (0,), 3)])
def test_request_level_policy_offers_hit_chunks(level: StoreLevel, cursor: tuple[int, ...],
                                                offered: int) -> None:
    """§7.2 item 9: under REQUEST level the hit chunks are offered again (the cursor stays
    at 0); under BLOCK level the cursor jumps past the hit. A real tier stores only absent
    keys, so the hit chunks are offered but not written twice."""
    cfg = config(GroupSpec(FULL, 4, 3), store_level=level)
    e, spy = engine(cfg)
    first = e.arrive(tokens(24), 1)
    prefill(e, first)
    settle(e)
    again = e.arrive([*tokens(36), 1], 1)
    assert e.admit(again) == 24
    assert e.sched.impl.cursors(again) == cursor
    e.step()
    settle(e)
    spy.calls.clear()
    plan = e.step()
    assert len(spy.named("prepare_store")[0]) == offered
    assert where(e, plan.stores) == {(0, 6), (0, 7), (0, 8)}


def test_block_level_cursor_after_an_unaligned_hit() -> None:
    """§7.2 item 9 (BLOCK level): with a window group the limit is N - 1, so a 16-token
    repeat hits 15 tokens; the cursor jumps to cdiv(15, 4) = 4 in both groups (the
    partly loaded chunk 3 is on the CPU already) and nothing is offered again."""
    cfg = full_and_window()
    e, spy = engine(cfg)
    first = e.arrive(tokens(16), 1)
    prefill(e, first)
    settle(e)
    again = e.arrive(tokens(16), 4)
    assert e.admit(again) == 15
    assert e.sched.impl.cursors(again) == (4, 4)
    e.step()
    settle(e)
    spy.calls.clear()
    e.step()
    assert spy.named("prepare_store") == []


@pytest.mark.parametrize("bad", ["24", 24.5, -1, True])
def test_max_offload_tokens_rejects_bad_values(bad: Any) -> None:
    """§7.2 item 12: upstream reads these as "no cap"; kvcore never falls back silently,
    so each is a ConfigError naming the field."""
    with pytest.raises(ConfigError) as info:
        config(GroupSpec(FULL, 4, 3), max_offload_tokens=bad)
    assert info.value.field == "max_offload_tokens"


@pytest.mark.parametrize(("cap", "stored"), [(None, 3), (0, 0), (24, 2)])
def test_max_offload_tokens(cap: int | None, stored: int) -> None:
    """§7.2 item 12: no cap stores every chunk, 0 stores nothing, 24 tokens two chunks."""
    e, _ = engine(config(GroupSpec(FULL, 4, 3), max_offload_tokens=cap))
    rid = e.arrive(tokens(36), 1)
    _, plan = prefill(e, rid)
    assert len(where(e, plan.stores)) == 3 * stored


def test_per_request_max_offload_tokens() -> None:
    """§7.2 item 12: the cap can also be given per request (``RequestInfo``)."""
    e, _ = engine(BS4_BPC3)
    rid = e.arrive(tokens(36), 1, max_offload_tokens=12)
    _, plan = prefill(e, rid)
    assert where(e, plan.stores) == {(0, 0), (0, 1), (0, 2)}


@pytest.mark.parametrize(("prompt_only", "chunks"), [(True, 1), (False, 3)])
def test_offload_prompt_only(prompt_only: bool, chunks: int) -> None:
    """§7.2 item 13: with ``prompt_only`` only the prompt's chunks are ever offered.
    (kvcore's default is False, like upstream's tests, not like upstream's default.)"""
    cfg = config(GroupSpec(FULL, 4), prompt_only=prompt_only)
    e, spy = engine(cfg)
    rid = e.arrive(tokens(5), 8)
    e.run(20)
    offered = {k for keys in spy.named("prepare_store") for k in keys}
    assert offered == set(group_keys(cfg, 0, e.reqs[rid].hashes)[:chunks])


def test_skip_reading_prefix_cache() -> None:
    """§7.2 item 18: a request that skips reading gets 0 without the tier being asked and
    loads nothing, but still stores."""
    e, spy = engine(BS4_BPC3, check=False)
    first = e.arrive(tokens(24), 1)
    prefill(e, first)
    settle(e)
    rid = e.arrive(tokens(36), 1, skip_reading=True)
    spy.calls.clear()
    hit, plan = prefill(e, rid)
    assert hit == 0 and spy.named("lookup") == [] and plan.loads == ()
    assert where(e, plan.stores) == {(0, 6), (0, 7), (0, 8)}


# -- §7.2 item 10: the fence ---------------------------------------------------------------------


def test_loads_do_not_populate_the_fence() -> None:
    """§7.2 item 10: a load's destination blocks are not fenced: handed out again (which
    an engine never does while the load runs; scripted here), they flush nothing."""
    s = pair(BS4_BPC3)
    hashes = tuple(chain_hashes(tokens(12), 0, b"", 4))
    s.add_request(RequestInfo("a", 12, hashes))
    s.lookup("a", 0, 12)
    step = ScheduledRequest("a", 12, 0, 12, ((1, 2, 3),))
    store = s.build_step(StepInput((step,), (), frozenset({1, 2, 3}))).stores[0]
    s.worker_output([WorkerReport(0, store.job_id)])
    s.add_request(RequestInfo("b", 13, hashes))
    assert s.lookup("b", 0, 13) == 12
    load = s.after_alloc("b", ((5, 6, 7),), (0,), 0, 12)
    plan = s.build_step(StepInput((), (), frozenset({5, 6, 7})))
    assert plan.loads == (load,) and plan.flush == ()


def test_fence_at_after_alloc() -> None:
    """§7.2 item 10: blocks handed out at admission (before ``build_step``: here a local
    prefix hit) that an unfinished store of a finished request reads are flushed in that
    step. (Upstream W24 missed these when nothing was loaded; #46951 fixed it.)"""
    e, _ = engine(config(GroupSpec(FULL, 4), gpu=3))
    first = e.arrive(tokens(8), 1)
    _, plan = prefill(e, first)
    assert e.reqs[first].state == "finished"
    sources = {i for g in plan.stores[0].groups for i in g.gpu_block_ids}
    second = e.arrive(tokens(8, seed=3), 1)
    assert e.admit(second, local_units=1) == 0
    assert e.allocated & sources
    assert e.step().flush == (plan.stores[0].job_id,)


def test_fence_at_store_for_window_blocks() -> None:
    """§7.2 item 10: a window block is fenced when its store is created: handed out again
    while the request still runs, the store is flushed."""
    cfg = config(GroupSpec(SLIDING, 4, window_tokens=4), gpu=4)
    e, _ = engine(cfg, chunk=8)
    rid = e.arrive(tokens(20), 1)
    _, plan = prefill(e, rid)
    store = plan.stores[0].job_id
    assert e.step().flush == (store,)


def test_finished_request_fences_its_full_blocks() -> None:
    """§7.2 item 10: full-attention sources are fenced when the request finishes; every
    in-flight store reading a re-allocated block is flushed."""
    e, _ = engine(config(GroupSpec(FULL, 4), gpu=5), chunk=8)
    first = e.arrive(tokens(16), 1)
    e.admit(first)
    jobs = [e.step().stores[0].job_id for _ in range(2)]
    assert e.reqs[first].state == "finished"
    e.prefill_chunk = 16
    second = e.arrive(tokens(16, seed=4), 1)
    _, plan = prefill(e, second)
    assert plan.flush == tuple(jobs)


def test_mixed_full_and_window_fence_timing() -> None:
    """§7.2 item 10: a store's window ids are fenced when it is created, its full ids
    only when the request finishes. (Direct hook calls: an engine never hands out a
    running request's full block, so only a scripted step can show the second rule.)"""
    s = pair(full_and_window())
    s.add_request(RequestInfo("a", 8, tuple(chain_hashes(tokens(8), 0, b"", 4))))
    assert s.lookup("a", 0, 8) == 0
    step = ScheduledRequest("a", 8, 0, 8, ((1, 2), (3, 4)))
    job = s.build_step(StepInput((step,), (), frozenset({1, 2, 3, 4}))).stores[0].job_id
    assert s.build_step(StepInput((), (), frozenset({3}))).flush == (job,)
    assert s.build_step(StepInput((), (), frozenset({1}))).flush == ()
    s.request_finished("a")
    assert s.build_step(StepInput((), (), frozenset({2}))).flush == (job,)


# -- §7.2 item 14: reset ----------------------------------------------------------------------


def test_reset_cache() -> None:
    """§7.2 item 14: reset returns every job to wait for, empties the tier, sends cursors
    back to 0, ignores the old jobs' late reports, and forgets finished requests that
    still had stores in flight."""
    e, _ = engine(BS4_BPC3, chunk=12)
    rid = e.arrive(tokens(36), 4)
    done = e.arrive(tokens(12, seed=6), 1)
    e.admit(rid)
    e.admit(done)
    plan = e.step()
    e.abort(done)
    assert done in e.sched.impl.tracked_requests()
    assert e.reset() == tuple(sorted(s.job_id for s in plan.stores))
    assert done not in e.sched.impl.tracked_requests()
    assert e.sched.impl.cursors(rid) == (0,)
    assert e.sched.impl.manager.stats().used == 0
    out = e.deliver([(j, w, True) for j, w in e.pending_reports()])
    assert out.completed == ()


# -- §7.2 item 19: TestEagle -----------------------------------------------------------------


def draft(kind: GroupKind = FULL, window: int | None = None) -> GroupSpec:
    return GroupSpec(kind, 4, window_tokens=window, is_draft=True)


@pytest.mark.parametrize(("name", "groups", "statuses", "n", "want"), [
    ("full_attn_lookup_pops_one_block", [draft()], ["HHH"], 12, 8),
    ("full_attn_lookup_single_block_returns_zero", [draft()], ["H"], 4, 0),
    ("full_attn_lookup_no_hits_returns_zero", [draft()], ["MMM"], 12, 0),
    # Upstream widens the query to 4 keys and serves 12: kvcore likewise reads the extra
    # chunk beyond T = 12 (the request's hashes reach 16 tokens).
    ("sw_lookup_inflates_query_max", [draft(SLIDING, 8)], ["HHHH"], 13, 12),
    ("sw_lookup_requires_extra_window_block", [draft(SLIDING, 8)], ["HH"], 9, 4),
    ("sw_lookup_w_plus_one_hits_returns_w_blocks", [draft(SLIDING, 8)], ["HHH"], 13, 8),
    ("eagle_verified_prevents_double_pop", [GroupSpec(FULL, 4), draft()], ["HHH", "HHH"],
     12, 8),
    # Upstream: 0 (W24 does not widen a FULL draft group, so at M = 4 it reads one key and
    # pops it). kvcore widens every draft group (docs/semantics.md, after #52771): chunk 1 is the
    # extra hit chunk beyond T = 4, so 4 tokens are served.
    ("non_eagle_tighten_clears_eagle_verified", [GroupSpec(FULL, 4), draft()],
     ["HMM", "HHH"], 12, 4),
    # Two draft window groups (W = 1). Group 0 is verified at 16 (chunks 3, 4); group 1
    # shrinks the boundary to 8. Upstream keeps group 0's verification across a draft
    # shrink and re-checks its window without the extra chunk, serving 8 although group
    # 0's extra chunk 2 is a miss. kvcore ends the cycle on any shrink (E3): group 0 is
    # re-verified at 8 with its extra chunk, fails, and nothing is served.
    ("eagle_verified_survives_eagle_tighten", [draft(SLIDING, 4), draft(SLIDING, 4)],
     ["MHMHH", "MHHMM"], 17, 0),
])
def test_eagle_lookup(name: str, groups: list[GroupSpec], statuses: list[str], n: int,
                      want: int) -> None:
    """§7.2 item 19 (TestEagle lookup tests, §2.3's worked examples): a draft group needs
    one hit chunk beyond the boundary it serves (E4), popped once per cycle (E3)."""
    assert lookup_with(groups, statuses, n) == want, name


def test_eagle_full_attn_store_excludes_trailing_block() -> None:
    """§7.2 item 19: 3-chunk prompt: the FULL group stores 0, 1, 2; the draft group only
    0 and 1 (its chunk at the frontier V = 12 is volatile, E1)."""
    e, _ = engine(config(GroupSpec(FULL, 4), draft(), cpu=64), spec_tokens=1)
    rid = e.arrive(tokens(12), 1)
    _, plan = prefill(e, rid)
    assert where(e, plan.stores) == {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)}


def test_eagle_sw_store_excludes_trailing_block() -> None:
    """§7.2 item 19: a draft window group (W = 2) with a 3-chunk prompt stores 0 and 1."""
    e, _ = engine(config(draft(SLIDING, 8)), spec_tokens=1)
    rid = e.arrive(tokens(12), 1)
    _, plan = prefill(e, rid)
    assert where(e, plan.stores) == {(0, 0), (0, 1)}


def test_eagle_single_block_nothing_stored() -> None:
    """§7.2 item 19: a single draft group and a one-chunk prompt: nothing is offered."""
    e, spy = engine(config(draft()), spec_tokens=1)
    rid = e.arrive(tokens(4), 1)
    prefill(e, rid)
    assert spy.named("prepare_store") == []


def test_eagle_full_attn_store_then_load() -> None:
    """§7.2 item 19: store, then a 13-token request loads (0,0),(0,1),(1,0),(1,1): the
    draft group's chunk 2 is its extra chunk (verified, never served)."""
    cfg = config(GroupSpec(FULL, 4), draft(), cpu=64)
    e, _ = engine(cfg, spec_tokens=1)
    first = e.arrive(tokens(16), 1)
    prefill(e, first)
    settle(e)
    again = e.arrive(tokens(13), 1)
    hit, plan = prefill(e, again)
    assert hit == 8
    assert where(e, plan.loads) == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_eagle_chunked_prefill_leaves_no_hole() -> None:
    """§7.2 item 19, a gap upstream left: with chunked prefill the draft group's chunk at
    each frontier is held back, then stored once the frontier moves on: the stored chunks
    form one run from 0, never a hole (E2; W24 lost one chunk per prefill chunk)."""
    cfg = config(GroupSpec(FULL, 4), draft(), cpu=64)
    e, spy = engine(cfg, chunk=6, spec_tokens=1)
    rid = e.arrive(tokens(30), 2)
    e.run(40)
    keys = group_keys(cfg, 1, e.reqs[rid].hashes)
    offered = [k for ks in spy.named("prepare_store") for k in ks if k in keys]
    assert offered == keys[:len(offered)] and len(offered) >= 6


def test_eagle_nothing_stored_at_finish() -> None:
    """§7.2 item 19: upstream (W33) lifts the tail exclusion at finish; kvcore stores
    nothing at finish, so the draft group's last chunk stays unstored (its KV was
    rewritten by the drafter and may not match its key)."""
    cfg = config(draft(), cpu=64)
    e, spy = engine(cfg, spec_tokens=1)
    rid = e.arrive(tokens(8), 1)
    e.run(10)
    keys = group_keys(cfg, 0, e.reqs[rid].hashes)
    offered = {k for ks in spy.named("prepare_store") for k in ks}
    assert offered == {keys[0]}


def test_speculative_without_a_draft_group_is_an_error() -> None:
    """§7.2 item 19 / §8: no all-groups fallback (the #52735 fallback zeroed Mamba hits):
    declaring speculative decoding without a draft group is a ConfigError."""
    with pytest.raises(ConfigError) as info:
        OffloadConfig((GroupSpec(FULL, 4),), 4, 16, 16, speculative=True)
    assert info.value.field == "speculative"

