"""Building one request's store job for one step.

The rules (what to offer, where the cursor may go) are kvcore's own, in
``kvcore.scheduler._rules``; this module only gathers keys and GPU ids for what the manager
accepted, and returns the cursor moves for the scheduler to apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcore.scheduler._rules import (
    GroupOffer,
    chunk_source_blocks,
    group_offer,
    storable_prefix,
)
from kvcore.scheduler._state import RequestState, StaleWindows
from kvcore.spec.invariants import CursorMoveRecord, PlanRecord, StoreOfferRecord
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import GroupKind, Key, OffloadConfig


@dataclass(slots=True)
class StoreDraft:
    """Offers for every group of one request, before the manager has answered (not
    frozen, for the same reason as ``GroupOffer``)."""

    offers: tuple[GroupOffer, ...]
    keys: tuple[Key, ...]
    frontier: int


def draft_store(cfg: OffloadConfig, req: RequestState, frontier: int,
                stale: StaleWindows | None = None, storable: int | None = None,
                quiet: tuple[list[int], list[int]] | None = None) -> StoreDraft:
    """What ``req`` offers this step: candidates from each group's cursor to its end.

    Stale window positions among the candidates are zeroed first (``StaleWindows``; the
    scheduler always passes its own), so the offer skips them as null blocks. Without
    one, the tables are taken as they are (the store proofs' tables have no stale ids).
    ``storable`` is U when the caller has it already (``storable_prefix``).

    ``quiet`` is ``quiet_cursors``' answer with its busy groups, (cursors, busy): only the
    busy groups get the full offer, the others move to their quiet cursor with nothing
    offered and no skip reasons (the scheduler passes it with checks off only: the
    invariant records want every reason).
    """
    if storable is None:
        storable = storable_prefix(cfg, frontier, req.prompt_tokens, req.max_offload_tokens)
    offers = []
    keys: list[Key] = []
    cursors, tables = req.cursors, req.tables
    for group, g in enumerate(cfg.groups):
        cursor = cursors[group]
        if quiet is not None and group not in quiet[1]:
            offers.append(GroupOffer(cursor, quiet[0][group]))
            continue
        end = storable // g.tokens_per_chunk
        if end <= cursor:
            # The common decode step: no chunk completed since the last store.
            offers.append(GroupOffer(cursor, cursor))
            continue
        if stale is not None and g.kind is not GroupKind.FULL:
            bpc = g.blocks_per_chunk
            stale.zero_stale(tables[group], req.placed[group], cursor * bpc, end * bpc)
        offer = group_offer(cfg, group, cursor, frontier, storable, tables[group])
        offers.append(offer)
        if offer.offered:
            group_keys = req.keys[group]
            keys.extend([group_keys[c] for c in offer.offered])
    return StoreDraft(tuple(offers), tuple(keys), frontier)


@dataclass(frozen=True)
class BuiltStore:
    """A store plan plus what the fence and the checks need to know about it."""

    plan: TransferPlan
    positions: tuple[tuple[int, ...], ...]
    window_sources: frozenset[int]
    other_sources: frozenset[int]


_NOTHING = GroupTransfer()


def build_store(cfg: OffloadConfig, req: RequestState, draft: StoreDraft, job_id: int,
                accepted: dict[Key, int]) -> BuiltStore:
    """The plan for the keys the manager accepted (``accepted``: key -> CPU slot)."""
    groups: list[GroupTransfer] = []
    positions: list[tuple[int, ...]] = []
    window: set[int] = set()
    other: set[int] = set()
    # The draft derived each offered chunk's key, in this same order (group by group,
    # chunk by chunk): read them back instead of deriving them again.
    drafted = iter(draft.keys)
    for group, offer in enumerate(draft.offers):
        if not offer.offered:
            # Most groups of a decode store offer nothing: one shared empty transfer
            # instead of a frozen dataclass built per group (equal, and immutable).
            groups.append(_NOTHING)
            positions.append(())
            continue
        bpc = cfg.groups[group].blocks_per_chunk
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        keys: list[Key] = []
        for chunk in offer.offered:
            key = next(drafted)
            if key not in accepted:
                continue
            first, chunk_ids = chunk_source_blocks(req.tables[group], chunk, bpc)
            ids.extend(chunk_ids)
            pos.extend(range(first, first + len(chunk_ids)))
            slots.append(accepted[key])
            keys.append(key)
        target = other if cfg.groups[group].kind is GroupKind.FULL else window
        target.update(ids)
        groups.append(GroupTransfer(tuple(ids), pos[0] if pos else 0, tuple(slots),
                                    tuple(keys)))
        positions.append(tuple(pos))
    plan = TransferPlan(job_id, JobKind.STORE, req.request_id, tuple(groups))
    return BuiltStore(plan, tuple(positions), frozenset(window), frozenset(other))


def store_records(cfg: OffloadConfig, draft: StoreDraft, built: BuiltStore | None,
                  cursors: Sequence[int]) -> list[object]:
    """Spec records for one request's store step (E1, E2, and S1/S2/B1 on the plan).

    ``cursors`` are the request's cursors as they are after the step, read from its state
    rather than from the draft, so E2 judges the move that happened.
    """
    records: list[object] = []
    for group, offer in enumerate(draft.offers):
        g = cfg.groups[group]
        records.append(StoreOfferRecord(group, g.is_draft, g.tokens_per_chunk,
                                        draft.frontier, offer.offered))
        new = cursors[group]
        records.append(CursorMoveRecord(group, offer.old_cursor, new,
                                        frozenset(offer.offered), offer.skipped, cfg))
    if built is not None:
        records.append(PlanRecord(cfg, built.plan, built.positions))
    return records
