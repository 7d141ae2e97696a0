"""Transfer plans: what one load or store job moves, as plain data.

A job moves, per group, a list of GPU block ids to or from a list of CPU chunk slots.
The mapping between them is sequential (the rule the copy path relies on, S1/S2):
GPU block ``i`` of a group's list goes to CPU sub-block position ``block_index % bpc + i``,
that is chunk ``cpu_slots[pos // bpc]``, sub-block ``pos % bpc``. Only the first chunk may
start mid-way (a load that starts mid-chunk, or a store whose leading sub-blocks are null),
so every later chunk is covered whole, except that a load's last chunk may stop early.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvcore.spec.types import Key, cdiv


class JobKind(enum.Enum):
    LOAD = "load"
    STORE = "store"


@dataclass(frozen=True)
class GroupTransfer:
    """One group's share of a job. Empty tuples mean the group moves nothing."""

    gpu_block_ids: tuple[int, ...] = ()
    block_index: int = 0
    cpu_slots: tuple[int, ...] = ()
    keys: tuple[Key, ...] = ()


@dataclass(frozen=True)
class TransferPlan:
    """One job: a load (CPU -> GPU) or a store (GPU -> CPU) for one request."""

    job_id: int
    kind: JobKind
    request_id: str
    groups: tuple[GroupTransfer, ...]

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(len(g.gpu_block_ids) for g in self.groups)

    @property
    def block_indices(self) -> tuple[int, ...]:
        return tuple(g.block_index for g in self.groups)

    @property
    def keys(self) -> tuple[Key, ...]:
        return tuple(k for g in self.groups for k in g.keys)


def chunks_spanned(num_gpu_blocks: int, block_index: int, blocks_per_chunk: int) -> int:
    """CPU chunks a run of GPU blocks touches when it starts at ``block_index``."""
    if num_gpu_blocks == 0:
        return 0
    return cdiv(num_gpu_blocks + block_index % blocks_per_chunk, blocks_per_chunk)


def sub_block_position(i: int, block_index: int, blocks_per_chunk: int) -> tuple[int, int]:
    """(chunk ordinal in the job's slot list, sub-block) of the group's ``i``-th GPU block."""
    pos = block_index % blocks_per_chunk + i
    return pos // blocks_per_chunk, pos % blocks_per_chunk
