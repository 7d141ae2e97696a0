"""The reviewed list of equivalent mutants (tools/mutate_equivalent.toml) stays honest.

Goal: ``tools/mutate.py`` leaves a reviewed equivalent out of its second kill rate, so an
entry that no longer describes kvcore's code would hide nothing today but could match a
different line tomorrow; and the rate must leave out only survivors. Method: every entry
names a line that is in its file now, with a different mutated line and a reason; the
rate arithmetic is checked on hand-made mutants (a killed mutant listed as equivalent
stays counted, so a wrong review cannot raise the score).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "mutate.py"


def tool() -> ModuleType:
    if not TOOL.exists():
        pytest.skip("tools/ is not in this tree (an installed wheel's tests)")
    spec = importlib.util.spec_from_file_location("kvcore_mutate_tool", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_every_entry_names_a_line_that_is_there() -> None:
    mutate = tool()
    reviewed = mutate.load_equivalent()
    for (path, before, after), why in reviewed.items():
        lines = {line.strip() for line in (ROOT / path).read_text().splitlines()}
        assert before in lines, f"{path}: no line reads {before!r} any more; review again"
        assert after != before and after, f"{path}: {before!r} has no mutated line"
        assert len(why) > 40, f"{path}: {before!r} -> {after!r} needs its argument"


def test_only_surviving_equivalents_leave_the_rate() -> None:
    mutate = tool()
    made = [mutate.Mutant(f"m{i}", "x.py", i, "f", "op", before="a", after=f"b{i}")
            for i in range(5)]
    made[0].check = made[1].check = "killed"
    made[2].check = made[3].check = "survived"
    made[4].check = "not a mutant (no change, or does not build)"
    mutate.mark_equivalent(made, {("x.py", "a", "b1"): "killed: the review is wrong",
                                  ("x.py", "a", "b2"): "equivalent"})
    assert mutate.rate(made, "check") == "2/4 = 50%"
    assert mutate.rate(made, "check", drop_equivalent=True) == "2/3 = 67%"
