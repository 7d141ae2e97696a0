"""kvcore.spec: the executable definition of kvcore's behaviour. Standard library only.

Read it top to bottom: ``types`` (config, keys, chunk arithmetic), ``plans`` (what a job
moves), ``lookup`` (the hit and the keep rule, by brute force), ``invariants`` (one
predicate per invariant id), and ``model``/``manager_model`` (the reference scheduler and
manager that the implementation is compared against; the store and load rules are
written there, block by block, sharing no function with ``kvcore.scheduler``).
"""

from kvcore.spec.errors import ConfigError, InvariantViolation, KVCopyError, KVCoreError
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import (
    PENDING,
    GroupKind,
    GroupSpec,
    Key,
    LookupResult,
    OffloadConfig,
    Status,
    StoreLevel,
    cdiv,
    make_key,
)

__all__ = [
    "PENDING",
    "ConfigError",
    "GroupKind",
    "GroupSpec",
    "GroupTransfer",
    "InvariantViolation",
    "JobKind",
    "KVCopyError",
    "KVCoreError",
    "Key",
    "LookupResult",
    "OffloadConfig",
    "Status",
    "StoreLevel",
    "TransferPlan",
    "cdiv",
    "make_key",
]
