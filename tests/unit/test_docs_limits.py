"""The numbers the user docs give for kvcore's limits are the numbers the code uses.

Goal: a limit that a user plans with (how many CUDA jobs sit on the stream, a status
code, the range an option accepts) is stated once in code and repeated in ``docs/``; when
the code changes, the doc must change with it. Some limits cannot be observed on a CPU
machine at all (``MAX_IN_FLIGHT`` only shapes the CUDA worker), so this agreement is
their only check there.

Method: every place in ``docs/*.md`` and ``README.md`` that writes a constant's name in
backticks followed by a number, ``NAME`` (8) or ``NAME`` = 4096, is found by a pattern
(no list of names to keep up to date). The name is resolved where kvcore defines it:
a module-level assignment in ``kvcore/`` or ``spec/`` (read back from the imported
module, so the value is the one running code sees) or a ``#define`` in ``native/``.
Each must be defined and equal the documented number. The documented ranges of the
engine's numeric arguments are checked against what the engine accepts and refuses.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

from kvcore.spec.errors import TransferArgumentError
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig
from kvcore.transfer import TransferEngine

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
# `NAME` (8), `NAME` (24, why...) and `NAME` = 4096: an upper-case name and a decimal.
MENTION = re.compile(r"`([A-Z][A-Z0-9_]+)`(?: \(| = )(\d[\d_]*)(?=[),.;:\s]|$)", re.M)
DEFINE = re.compile(r"^#define\s+([A-Z][A-Z0-9_]+)\s+\(?(-?\d+)[uUlL]*\)?\s*(?:/[*/].*)?$",
                    re.M)


def documented() -> list[tuple[str, str, int]]:
    """(doc file, NAME, number) for each mention, in file order."""
    found: list[tuple[str, str, int]] = []
    for doc in DOCS:
        for m in MENTION.finditer(doc.read_text()):
            found.append((doc.relative_to(ROOT).as_posix(), m.group(1), int(m.group(2))))
    return found


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "spec":
        parts.insert(0, "kvcore")  # spec/ is installed as kvcore.spec
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_definitions(names: set[str]) -> dict[str, list[tuple[str, object]]]:
    """NAME -> (module, runtime value) for every module-level assignment to one of
    ``names`` (found by parsing; only the modules that define one are imported)."""
    defs: dict[str, list[tuple[str, object]]] = {}
    for path in sorted([*(ROOT / "kvcore").rglob("*.py"), *(ROOT / "spec").rglob("*.py")]):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name) and t.id in names:
                    mod = importlib.import_module(_module_name(path))
                    defs.setdefault(t.id, []).append((mod.__name__, getattr(mod, t.id)))
    return defs


def c_definitions() -> dict[str, list[tuple[str, object]]]:
    """NAME -> (header, value) for every integer ``#define`` in the native sources."""
    defs: dict[str, list[tuple[str, object]]] = {}
    for path in sorted([*(ROOT / "native").glob("*.h"), *(ROOT / "native").glob("*.c")]):
        for m in DEFINE.finditer(path.read_text()):
            defs.setdefault(m.group(1), []).append((path.name, int(m.group(2))))
    return defs


def test_the_pattern_finds_the_limits_the_docs_state() -> None:
    """The scan is not vacuous: the mentions this test exists for are found."""
    names = {name for _, name, _ in documented()}
    assert {"MAX_IN_FLIGHT", "KVC_CUDA_MAX_BATCH", "KVC_E_DST_OVERLAP"} <= names, names


def test_every_documented_constant_has_the_documented_value() -> None:
    """Kills a changed limit (``MAX_IN_FLIGHT = 9``, a renumbered status code, a new CUDA
    batch size) that the docs were not updated for, and a doc naming a constant that no
    longer exists."""
    mentions = documented()
    py, c = python_definitions({name for _, name, _ in mentions}), c_definitions()
    wrong: list[str] = []
    for doc, name, number in mentions:
        defs = py.get(name, []) + c.get(name, [])
        if not defs:
            wrong.append(f"{doc}: `{name}` ({number}) is defined nowhere in kvcore/, spec/ "
                         "or native/; rename it in the doc or drop the number")
        for where, value in defs:
            if value != number:
                wrong.append(f"{doc}: `{name}` ({number}), but {where} has {value!r}; "
                             "update the doc or the constant")
    assert not wrong, "\n".join(wrong)


def _range_in_docs(label: str) -> tuple[int, int]:
    """(lo, hi) of the first "<label> in LO..HI" in docs/native.md, HI written 2^K or
    2^K-1; ``label`` is a regex (a phrase may wrap onto the next line)."""
    text = (ROOT / "docs" / "native.md").read_text()
    m = re.search(label + r" in (\d+)\.\.(\d+)\^(\d+)(-1)?", text)
    assert m is not None, f"docs/native.md gives no range for {label}"
    hi = int(m.group(2)) ** int(m.group(3)) - (1 if m.group(4) else 0)
    return int(m.group(1)), hi


def _engine(**options: object) -> TransferEngine:
    cfg = OffloadConfig((GroupSpec(GroupKind.FULL, 4),), hash_block_tokens=4,
                        num_gpu_blocks=4, num_cpu_blocks=2)
    return TransferEngine(cfg, [[torch.zeros(4, 8)]], **options)  # type: ignore[arg-type]


def test_the_documented_max_queued_jobs_range_is_what_the_engine_accepts() -> None:
    """docs/native.md: ``max_queued_jobs`` in 1..2^20. Both ends are accepted, one past
    either end is a ``TransferArgumentError`` naming the option. Kills a bound changed in
    code only (``MAX_QUEUED_JOBS_LIMIT``) or a range check off by one."""
    lo, hi = _range_in_docs(r"\(`max_queued_jobs`")
    for ok in (lo, hi):
        _engine(max_queued_jobs=ok).close()
    for bad in (lo - 1, hi + 1):
        with pytest.raises(TransferArgumentError) as info:
            _engine(max_queued_jobs=bad)
        assert info.value.where == "max_queued_jobs", info.value


def test_the_documented_job_id_range_is_what_submit_accepts() -> None:
    """docs/native.md: a job id is an int in 0..2^63-1. Both ends are validated as plans
    (an empty job succeeds), one past either end is refused by ``submit`` itself."""
    lo, hi = _range_in_docs(r"job id\s+an int")
    engine = _engine()
    try:
        for ok in (lo, hi):
            engine.validate(TransferPlan(ok, JobKind.STORE, "r", (GroupTransfer(),)))
        for bad in (lo - 1, hi + 1):
            with pytest.raises(TransferArgumentError):
                engine.submit(TransferPlan(bad, JobKind.STORE, "r", ()))
    finally:
        engine.close()
