"""B1 / S1 obligations on the transfer engine's plan validation (the Python side).

Function under test: ``kvcore.transfer._plans._check_group_ranges``, the pure check every plan
goes through before any descriptor is built or the C library is called. It is compared
with the predicates ``b1_block_ids_in_range`` and ``s1_plan_shape`` (with one key per
CPU slot): a group's share of a plan is accepted iff B1 and S1 hold, ``block_index`` is
not negative and no destination (a GPU block for a load, a CPU chunk for a store) is
written twice. Rejection is a ``KVCopyError``; anything else escaping is a failure.

The domain: ``blocks_per_chunk`` 2, ``num_gpu_blocks`` 3 and ``num_cpu_blocks`` 2,
loads and stores, up to 2 GPU ids in 0..3 and up to 2 CPU slots in 0..2 (so B1 can
fail at both bounds: the null block 0 and the pool size itself), ``block_index`` 0..1 (a whole
or a half chunk first). Values are bounded because the rejection message formats
them, which makes CrossHair enumerate them; a negative ``block_index`` is rejected
first, before any other check.

Mutants (one-token changes of kvcore, patched in while CrossHair runs): a GPU bound
check that lets ``num_gpu_blocks`` itself through, and a CPU check without an upper bound.
"""

from __future__ import annotations

import kvcore.transfer._plans as transfer
from kvcore.spec.errors import KVCopyError
from kvcore.spec.invariants import PlanRecord, b1_block_ids_in_range, s1_plan_shape
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import GroupKind, GroupSpec, make_key

from ._bounded import CONFIRMED, REFUTED, Obligation, small_config
from ._mutate import mutant

KEY = make_key(b"chunk", 0)


def _validate(store: bool, bpc: int, num_gpu: int, num_cpu: int, block_index: int,
              ids: list[int], slots: list[int]) -> bool:
    cfg = small_config(GroupSpec(GroupKind.FULL, 1, bpc), num_gpu_blocks=num_gpu,
                       num_cpu_blocks=num_cpu)
    kind = JobKind.STORE if store else JobKind.LOAD
    gt = GroupTransfer(tuple(ids), block_index, tuple(slots), (KEY,) * len(slots))
    plan = TransferPlan(1, kind, "r", (gt,))
    record = PlanRecord(cfg, plan)
    written = ids if kind is JobKind.LOAD else slots
    distinct = all(written[i] != written[j] for i in range(len(written))
                   for j in range(i))
    want_ok = (block_index >= 0 and distinct and not b1_block_ids_in_range(record)
               and not s1_plan_shape(record))
    grp = transfer._GroupIds(tuple(ids), block_index, tuple(slots))
    try:
        transfer._check_group_ranges(plan, 0, grp, bpc, num_gpu, num_cpu, 0,
                                     len(ids))
    except KVCopyError:
        return not want_ok
    return want_ok


def plan_check_matches_b1_s1(store: bool, bpc: int, num_gpu: int, num_cpu: int,
                             block_index: int, ids: list[int], slots: list[int]) -> bool:
    """_check_group_ranges accepts exactly the group plans B1 and S1 accept (plus a
    non-negative block_index and no destination written twice); see the module doc.

    pre: bpc == 2
    pre: num_gpu == 3 and num_cpu == 2
    pre: 0 <= block_index <= 1
    pre: len(ids) <= 2 and all(0 <= i <= 3 for i in ids)
    pre: len(slots) <= 2 and all(0 <= s <= 2 for s in slots)
    post: __return__
    """
    return _validate(store, bpc, num_gpu, num_cpu, block_index, ids, slots)


GPU_BOUND_INCLUSIVE = mutant("kvcore.transfer._plans:_check_group_ranges",
                             "if not 0 < b < num_gpu_blocks:",
                             "if not 0 < b <= num_gpu_blocks:",
                             "GPU id num_gpu_blocks accepted (one row past the pool)")
CPU_UNBOUNDED = mutant("kvcore.transfer._plans:_check_group_ranges",
                       "if not 0 <= s < num_cpu_blocks:", "if not 0 <= s:",
                       "CPU slots are not checked against the tier's size")


def mutant_gpu_bound_inclusive(store: bool, bpc: int, num_gpu: int, num_cpu: int,
                               block_index: int, ids: list[int], slots: list[int]) -> bool:
    """plan_check_matches_b1_s1 with the GPU upper bound off by one.

    pre: bpc == 2
    pre: num_gpu == 3 and num_cpu == 2
    pre: 0 <= block_index <= 1
    pre: len(ids) <= 2 and all(0 <= i <= 3 for i in ids)
    pre: len(slots) <= 2 and all(0 <= s <= 2 for s in slots)
    post: __return__
    """
    with GPU_BOUND_INCLUSIVE.applied():
        return _validate(store, bpc, num_gpu, num_cpu, block_index, ids, slots)


def mutant_cpu_unbounded(store: bool, bpc: int, num_gpu: int, num_cpu: int,
                         block_index: int, ids: list[int], slots: list[int]) -> bool:
    """plan_check_matches_b1_s1 without the CPU upper bound.

    pre: bpc == 2
    pre: num_gpu == 3 and num_cpu == 2
    pre: 0 <= block_index <= 1
    pre: len(ids) <= 2 and all(0 <= i <= 3 for i in ids)
    pre: len(slots) <= 2 and all(0 <= s <= 2 for s in slots)
    post: __return__
    """
    with CPU_UNBOUNDED.applied():
        return _validate(store, bpc, num_gpu, num_cpu, block_index, ids, slots)


OBLIGATIONS = (
    Obligation("plan_check_matches_b1_s1", CONFIRMED, 720, 20, 143.9),
    Obligation("mutant_gpu_bound_inclusive", REFUTED, 75, 20, 14.4, "plan_check_matches_b1_s1"),
    Obligation("mutant_cpu_unbounded", REFUTED, 90, 20, 15.5, "plan_check_matches_b1_s1"),
)
