"""CPU chunk slots per group: one function that the manager and the transfer engine share.

``num_cpu_blocks`` is the number of CPU chunk slots of EACH group (a slot holds one chunk of
one group), so pinned memory is the sum over groups of ``num_cpu_blocks`` x that group's
bytes per chunk, and every pinned row is a slot the manager can hand out. The manager
(``CPUOffloadManager.for_config``) and ``TransferEngine`` (through
``kvcore.transfer.cpu_capacity``) both size group ``g`` with ``group_capacity``, so the two
cannot disagree. Torch-free, so the scheduler side imports it without the engine.
"""

from __future__ import annotations

from kvcore.spec.types import OffloadConfig


def group_capacity(config: OffloadConfig, group: int) -> int:
    """Slots of ``group``'s CPU pool: slot ids ``0..capacity-1``."""
    if not 0 <= group < len(config.groups):
        raise IndexError(f"group={group} is not a group of this config "
                         f"(0..{len(config.groups) - 1})")
    return config.num_cpu_blocks


def cpu_capacities(config: OffloadConfig) -> tuple[int, ...]:
    """Every group's slot count, in group order."""
    return tuple(group_capacity(config, g) for g in range(len(config.groups)))
