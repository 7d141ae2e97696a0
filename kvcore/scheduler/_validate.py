"""The scheduler's stateful argument checks: what depends on the config or on the state.

Type-level checks (ints are ints, hashes are bytes of one length, counts are not
negative) happen where the values are built, in the hook dataclasses of
``kvcore.spec.hooks``; what is left needs the config (block ids below ``num_gpu_blocks``,
no null block in a FULL group) or what the scheduler holds (the hash length it has seen,
one entry per request per step). Every check runs before the hook changes anything, and
costs one pass over the ids it is given (``max``/``in`` run in C), so a step of a few ids
per request pays almost nothing.

The reference model (``kvcore.spec.model``) writes the same rules its own way; the
refinement tests and ``tests/unit/test_bad_calls.py`` hold the two to the same errors.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore._scan import ids_distinct, ids_max
from kvcore.spec.errors import BlockIdError, DuplicateRequestError, HashError
from kvcore.spec.hooks import StepInput
from kvcore.spec.types import GroupKind, OffloadConfig


def check_tables(cfg: OffloadConfig, where: str, name: str,
                 tables: Sequence[Sequence[int]], owner: str = "") -> None:
    """Every id below ``num_gpu_blocks``; 0 (the null block) only in SLIDING/MAMBA groups;
    a FULL group's ids distinct within the call.

    A FULL group's blocks all hold KV the engine computed or loads, so a null there, or
    one block at two positions, is an engine bug that would be stored or loaded as if it
    were data. ``owner`` (a request id) prefixes the argument's name in errors; names are
    built only when one is raised.
    """
    if owner:
        name = f"{owner}.{name}" if tables else name
    limit = cfg.num_gpu_blocks
    for group, ids in enumerate(tables):
        if not ids:
            continue
        # One C pass; it declines (-1) only items the hook types refuse, which never get
        # here, and Python's max answers then.
        top = ids_max(ids)
        if top < 0:
            top = max(ids)
        if top >= limit:
            bad = next(i for i, x in enumerate(ids) if x >= limit)
            raise BlockIdError(where, f"{name}[{group}][{bad}]", ids[bad],
                               f"0..{limit - 1} (num_gpu_blocks={limit})",
                               "pass ids from the engine's GPU block pool, or raise "
                               "num_gpu_blocks to the pool's size", group)
        if cfg.groups[group].kind is not GroupKind.FULL:
            continue  # window tables may repeat an id: a freed block comes back later
        if 0 in ids:
            raise BlockIdError(where, f"{name}[{group}][{list(ids).index(0)}]", 0,
                               f"1..{limit - 1}: a FULL group holds no null block",
                               "pass the real block id; only SLIDING and MAMBA groups "
                               "may pad positions they never read with 0", group)
        # The C test first (no Python set of the ids): the position is looked for only
        # when it finds a repeat (or declines items the hook types refuse).
        if not ids_distinct(ids) and (at := _first_repeat(ids)) is not None:
            # One block at two positions: a store would save one chunk's bytes under
            # several chunks' keys. Checked within the ids given (not the whole table:
            # that would cost O(context) a step).
            raise BlockIdError(where, f"{name}[{group}][{at}]", ids[at],
                               f"the ids not at positions 0..{at - 1} (a FULL group's "
                               "blocks are distinct)",
                               "pass each allocated block once: this table repeats one",
                               group)


def _first_repeat(ids: Sequence[int]) -> int | None:
    """The position of the first id seen before it, or None."""
    seen: set[int] = set()
    for at, gpu_id in enumerate(ids):
        if gpu_id in seen:
            return at
        seen.add(gpu_id)
    return None


def check_allocated(cfg: OffloadConfig, ids: frozenset[int], where: str = "build_step",
                    name: str = "allocated_ids") -> None:
    """Allocated ids are real blocks: ``1..num_gpu_blocks-1`` (0 is never handed out)."""
    limit = cfg.num_gpu_blocks
    if not ids:
        return
    # One C pass and one set probe instead of min and max over the set (a resumed 128K
    # Llama request hands out 16K ids); -1 only for items StepInput refuses.
    top = ids_max(ids)
    if top < 0 or top >= limit or 0 in ids:
        bad = min(ids) if min(ids) < 1 else max(ids)
        raise BlockIdError(where, name, bad,
                           f"1..{limit - 1} (num_gpu_blocks={limit}; 0 is the null block)",
                           "list only ids the engine handed out from its GPU pool")


def check_unique(step: StepInput) -> None:
    """One ``ScheduledRequest`` per request, and each preempted id once."""
    for field, ids in (("requests", [sr.request_id for sr in step.requests]),
                       ("preempted", list(step.preempted))):
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            for rid in ids:
                if rid in seen:
                    raise DuplicateRequestError("build_step", field, rid)
                seen.add(rid)


def hash_length(where: str, name: str, current: int | None,
                hashes: Sequence[bytes], owner: str = "") -> int | None:
    """The scheduler's hash length after ``hashes``; raises if they have another one."""
    if not hashes:
        return current
    size = len(hashes[0])
    if current is not None and size != current:
        name = f"{owner}.{name}" if owner else name
        raise HashError(where, f"len({name}[0])", size, f"{current} bytes (the length of "
                        "every hash this scheduler has seen)",
                        "pass hashes from the engine's one hash function")
    return size
