"""Storage tiers: which chunks are offloaded, where they live, and what gets evicted.

``CPUOffloadManager`` is the CPU tier; ``OffloadManager`` is the interface a second tier
(disk, remote) would implement (its docstring says what such a tier needs). The value
types and the operating errors are defined in ``kvcore.spec.manager_model`` beside the
reference model the tier is tested against, and re-exported here.
"""

from kvcore.manager._arc import ARCPolicy
from kvcore.manager._base import OffloadManager
from kvcore.manager._capacity import cpu_capacities, group_capacity
from kvcore.manager._cpu import POLICIES, CPUOffloadManager
from kvcore.manager._lru import LRUPolicy
from kvcore.manager._policy import EvictionPolicy
from kvcore.spec.errors import BadKeyError, InvalidKeyError, KeyNotReadyError, NotPinnedError
from kvcore.spec.manager_model import ManagerEvent, ManagerStats, PrepareStoreResult

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "BadKeyError",
    "CPUOffloadManager",
    "EvictionPolicy",
    "InvalidKeyError",
    "KeyNotReadyError",
    "LRUPolicy",
    "ManagerEvent",
    "ManagerStats",
    "NotPinnedError",
    "OffloadManager",
    "PrepareStoreResult",
    "cpu_capacities",
    "group_capacity",
]
