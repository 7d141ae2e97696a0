"""CPU chunk slots per group: one function that the manager and the transfer engine share.

``num_cpu_blocks`` is the number of CPU chunk slots of EACH group (a slot holds one chunk of
one group), so pinned memory is the sum over groups of ``num_cpu_blocks`` x that group's
bytes per chunk, and every pinned row is a slot the manager can hand out. The manager
(``CPUOffloadManager.for_config``) and ``TransferEngine`` (through
``kvcore.transfer.cpu_capacity``) both size group ``g`` with ``group_capacity``, so the two
cannot disagree. Torch-free, so the scheduler side imports it without the engine.
"""

from __future__ import annotations

from kvcore.spec.errors import ArgumentRangeError, ArgumentTypeError
from kvcore.spec.types import OffloadConfig


def group_capacity(config: OffloadConfig, group: int) -> int:
    """Slots of ``group``'s CPU pool: slot ids ``0..capacity-1``."""
    check_config("group_capacity", config)
    if type(group) is not int:
        raise ArgumentTypeError("group_capacity", "group", group, "int",
                                "pass a group index of the config")
    if not 0 <= group < len(config.groups):
        raise ArgumentRangeError("group_capacity", "group", group,
                                 f"0..{len(config.groups) - 1} (the config's groups)",
                                 "pass a group index of the config")
    return config.num_cpu_blocks


def check_config(where: str, config: object) -> None:
    """An ``OffloadConfig``, not a dict or a preset name: its fields are validated once."""
    if not isinstance(config, OffloadConfig):
        raise ArgumentTypeError(where, "config", config, "OffloadConfig",
                                "build one with kvcore.OffloadConfig(...) or "
                                "kvcore.presets.preset(name)")


def cpu_capacities(config: OffloadConfig) -> tuple[int, ...]:
    """Every group's slot count, in group order."""
    check_config("cpu_capacities", config)
    return tuple(group_capacity(config, g) for g in range(len(config.groups)))
