"""kvcore: a formally specified KV-cache offloading core for LLM inference engines.

The public surface is exactly the names below; everything else lives in underscore
modules or subpackages. The safety rules are defined once, as executable invariants, in
``kvcore.spec``. ``TransferEngine`` is loaded on first use, so importing kvcore for the
scheduler alone does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcore import _scan
from kvcore.manager import CPUOffloadManager, OffloadManager
from kvcore.scheduler import (
    LoadFailure,
    OffloadScheduler,
    OutputResult,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    StepPlan,
    WorkerReport,
)
from kvcore.spec.errors import (
    ConfigError,
    InvariantViolation,
    KVCopyError,
    KVCoreError,
    TransferArgumentError,
)
from kvcore.spec.hooks import install_scans
from kvcore.spec.types import PENDING, GroupKind, GroupSpec, OffloadConfig, StoreLevel

# The hook dataclasses' item checks ask these C scans first (kvcore.spec.hooks says why
# the spec is handed them instead of importing them).
install_scans(_scan.ids_max, _scan.hashes_len)

if TYPE_CHECKING:
    from kvcore.transfer import TransferEngine, TransferResult

__all__ = [
    "PENDING",
    "CPUOffloadManager",
    "ConfigError",
    "GroupKind",
    "GroupSpec",
    "InvariantViolation",
    "KVCopyError",
    "KVCoreError",
    "LoadFailure",
    "OffloadConfig",
    "OffloadManager",
    "OffloadScheduler",
    "OutputResult",
    "RequestInfo",
    "ScheduledRequest",
    "StepInput",
    "StepPlan",
    "StoreLevel",
    "TransferArgumentError",
    "TransferEngine",
    "TransferResult",
    "WorkerReport",
]


def __getattr__(name: str) -> object:
    if name in ("TransferEngine", "TransferResult"):
        from kvcore import transfer
        return getattr(transfer, name)
    raise AttributeError(f"module 'kvcore' has no attribute {name!r}")
