"""TransferEngine: the scheduler's load and store jobs, executed as validated block copies.

The engine registers the inference engine's GPU KV tensors per group and allocates the CPU
tier beside them: for every GPU tensor a CPU tensor of ``num_cpu_blocks`` chunks, each row
``blocks_per_chunk`` GPU rows wide. A job (``kvcore.spec.plans.TransferPlan``) becomes one
descriptor table over those regions, following the sequential mapping of ``spec/plans.py``:
GPU block ``i`` of a group goes to sub-block ``(block_index % bpc + i) % bpc`` of chunk
``cpu_slots[(block_index % bpc + i) // bpc]``. STORE copies GPU -> CPU, LOAD CPU -> GPU.

Checks are paired: the plan is checked in Python, where the error can name the
job, the group and the role of the bad id, and the table again in C before the first byte
moves. Either way a bad job moves zero bytes and is reported as *failed*, never complete.

Registered memory is owned: every tensor's storage bounds are checked at registration and
its storage is kept alive; its pointer and size are compared with the registered ones at
every submit and right before every copy, so a pool freed or resized by the engine is a
failed job (``KVC_E_STORAGE``), never a read of freed memory. What Python cannot see is a
pool freed *while* C copies it; the engine must ``drain()`` first (docs/native.md).

The package's modules: ``_memory`` (tensor layouts, storage, disjointness), ``_plans``
(plan checks and descriptor tables), ``_setup`` (constructor checks, the CPU tier's
buffers and regions) and ``_engine`` (the engine, its queue and worker).
"""

from __future__ import annotations

from kvcore._cuda import cuda_available, cuda_unavailable_reason
from kvcore.spec.errors import short_repr

from ._engine import TransferEngine
from ._memory import CPU_BUFFER_ALIGNMENT
from ._plans import MAX_IDS_PER_GROUP, MAX_JOB_ID
from ._results import TransferResult
from ._setup import MAX_QUEUED_JOBS, MAX_QUEUED_JOBS_LIMIT, cpu_capacity

__all__ = ["CPU_BUFFER_ALIGNMENT", "MAX_IDS_PER_GROUP", "MAX_JOB_ID", "MAX_QUEUED_JOBS",
           "MAX_QUEUED_JOBS_LIMIT", "TransferEngine", "TransferResult", "cpu_capacity",
           "cuda_available", "cuda_unavailable_reason", "short_repr"]
