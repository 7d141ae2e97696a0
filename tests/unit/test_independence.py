"""The reference shares no rule function with kvcore: an import walk over spec/ and kvcore/.

Goal: the lock step (``tests/refinement``) is worth something only if the reference model
and the implementation compute each rule apart. This test parses (``ast``) every module of
``spec/`` and ``kvcore/`` and fails when

- a reference module (``kvcore.spec.model``, ``kvcore.spec.manager_model``), or any spec
  module, imports anything from ``kvcore`` outside ``kvcore.spec`` (the arrows point
  kvcore -> kvcore.spec, never back);
- a kvcore library module imports from ``kvcore.spec`` anything but types, errors, hook
  dataclasses, plans and the invariant predicates and records: the modules in
  ``ALLOWED_MODULES`` (each imported object must also be *defined* there, so a rule
  function re-exported through ``invariants`` is caught), plus the named dataclasses of
  ``ALLOWED_NAMES``. ``kvcore.spec.lookup`` (the spec's hit and keep rule),
  ``kvcore.spec.model`` and the rest of ``kvcore.spec.manager_model`` are the reference's;
- kvcore names a forbidden spec module in a string (``importlib.import_module``), or spec
  names a kvcore module outside ``kvcore.spec`` in one;
- a module reaches a forbidden object through a module it imported whole
  (``from kvcore.spec import invariants as I`` then ``I.served_chunks``, or ``import
  kvcore`` then ``kvcore.spec.lookup.spec_hit``): attribute chains on module names are
  resolved like imports;
- a module imports by a computed name (``import_module(name)``), which no walk can judge,
  outside the two modules that must (``DYNAMIC_IMPORTERS``).

The argument validators of ``kvcore.spec.hooks`` (``check_ids``, ``check_keys``, ...)
are shared on purpose: they define the hooks' domain, not a rule, and the lock step
compares the two sides only on calls both accept; ``tests/unit/test_lying_inputs.py`` and
the bad-calls stage judge them directly (docs/semantics.md, "Independence").

Imports inside functions count as much as top-level ones. Method: the checker is a pure
function over {module name: source}; the real tree must pass, and each kind of leak,
injected into a copy of the real source, must be reported.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = frozenset({"kvcore.spec.model", "kvcore.spec.manager_model"})

# What kvcore library code may take from kvcore.spec: whole modules of types, errors,
# hook dataclasses, plan shapes, and invariant predicates and records ...
ALLOWED_MODULES = frozenset({"kvcore.spec.types", "kvcore.spec.errors", "kvcore.spec.hooks",
                             "kvcore.spec.invariants"})
# ... and, from the reference manager's module, only its interface dataclasses.
ALLOWED_NAMES = {"kvcore.spec.manager_model": frozenset({
    "ManagerEvent", "ManagerStats", "PrepareStoreResult"}),
    # ... from the plans, the plan types: not the sequential mapping (``chunks_spanned``,
    # ``sub_block_position``), which S1 judges plans with.
    "kvcore.spec.plans": frozenset({"GroupTransfer", "JobKind", "TransferPlan"}),
    # ... and from the copy library's reference, the header's codes and constants.
    "kvcore.spec.descriptors": frozenset({
        "Status", "Side", "REGION_REFUSE_ROW0", "REGION_DEVICE", "I64", "U64"})}
FORBIDDEN_MODULES = ("kvcore.spec.lookup", "kvcore.spec.model", "kvcore.spec.manager_model")
# Checkers, not the implementation: the simulator's shadow tier runs the reference manager
# in lock step beside kvcore's (``kvcore check``'s M2 refinement), and the copy-library
# stage compares the C library with the descriptor reference, and the refinement stage
# runs the reference scheduler in lock step (R1), and the bad-calls stage's twins take the
# chunks a lookup verified from the spec (``served_chunks``), so the error they expect
# cannot agree with kvcore's by sharing its rule. Only these modules may.
# The simulated engine and the engine check build their byte models from the spec's
# sequential mapping, so the bytes they expect do not come from kvcore's copy path.
CHECKERS = frozenset({"kvcore.sim._shadow", "kvcore.sim._lockstep", "kvcore._copycheck",
                      "kvcore.sim._hostile", "kvcore.sim._engine", "kvcore._enginecheck"})
# Modules that must import by a computed name, and why: the proof runner loads the proofs
# package's obligation modules; the vLLM shim imports vLLM's modules by their paths.
DYNAMIC_IMPORTERS = frozenset({"kvcore._proofs", "kvcore.integrations.vllm._compat"})
# A string that is a whole dotted module name (not a docstring mentioning one).
_MODULE_STRING = re.compile(r"kvcore(\.\w+)+")


def module_name(path: Path) -> str:
    """``spec/x.py`` -> ``kvcore.spec.x``; ``kvcore/a/b.py`` -> ``kvcore.a.b``."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "spec":
        parts = ["kvcore", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def real_sources() -> dict[str, str]:
    files = sorted((ROOT / "spec").rglob("*.py")) + sorted((ROOT / "kvcore").rglob("*.py"))
    return {module_name(p): p.read_text() for p in files}


def imports(module: str, source: str, is_package: bool) -> list[tuple[str, str | None, int]]:
    """(module imported from, name or None for a whole module, line) for every import."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                out.append((base, alias.name, node.lineno))
    return out


def module_attributes(module: str, source: str, is_package: bool
                      ) -> list[tuple[str, str, int]]:
    """(module, attribute, line) for every ``alias.attr`` read where ``alias`` names a
    module of kvcore: ``import kvcore`` + ``kvcore.spec.lookup.spec_hit`` is
    ``("kvcore.spec.lookup", "spec_hit")``, as if imported by name."""
    aliases: dict[str, str] = {}
    for origin, name, _ in imports(module, source, is_package):
        if not origin.startswith("kvcore"):
            continue
        if name is None:
            aliases[origin.split(".")[0]] = origin.split(".")[0]
        elif _is_module(f"{origin}.{name}"):
            aliases[name] = f"{origin}.{name}"
    tree = ast.parse(source)
    # ``import kvcore.spec.model as m`` binds the whole path to its alias.
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name.startswith("kvcore"):
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname and alias.name in aliases:
                    aliases[alias.asname] = aliases.pop(alias.name)
    out: list[tuple[str, str, int]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain: list[str] = []
        inner: ast.expr = node
        while isinstance(inner, ast.Attribute):
            chain.append(inner.attr)
            inner = inner.value
        if not isinstance(inner, ast.Name) or inner.id not in aliases:
            continue
        path, rest = aliases[inner.id], chain[::-1]
        while rest and _is_module(f"{path}.{rest[0]}"):
            path = f"{path}.{rest.pop(0)}"
        if rest:  # the first name past the modules is the object read
            out.append((path, rest[0], node.lineno))
    return out


def spec_object_allowed(origin: str, name: str | None) -> bool:
    """May kvcore library code import ``name`` (None: the whole module) from ``origin``?"""
    if name is None:
        return origin in ALLOWED_MODULES
    if _is_module(f"{origin}.{name}"):  # ``from kvcore.spec import lookup``
        return f"{origin}.{name}" in ALLOWED_MODULES
    if name in ALLOWED_NAMES.get(origin, frozenset()):
        return True
    if origin not in ALLOWED_MODULES | {"kvcore.spec"}:
        return False
    obj = getattr(importlib.import_module(origin), name, None)
    if obj is None:
        return False
    if isinstance(obj, type) and obj.__module__ == "builtins":
        return True  # an alias such as ``Key = bytes``
    if callable(obj):
        # A function or class must be defined in an allowed module, not re-exported.
        return getattr(obj, "__module__", None) in ALLOWED_MODULES
    return True  # a constant or type alias (PENDING, LookupResult, limits)


def _is_module(full: str) -> bool:
    try:
        return importlib.util.find_spec(full) is not None
    except (ImportError, AttributeError, ValueError):
        return False


PACKAGES = frozenset(module_name(p) for p in [*(ROOT / "spec").rglob("__init__.py"),
                                               *(ROOT / "kvcore").rglob("__init__.py")])


def violations(sources: dict[str, str]) -> list[str]:
    """Every import that breaks the independence rules, as ``module:line: what``."""
    out: list[str] = []
    for module, source in sources.items():
        in_spec = module == "kvcore.spec" or module.startswith("kvcore.spec.")
        for origin, name, line in imports(module, source, module in PACKAGES):
            what = f"{module}:{line}: from {origin} import {name or '*module*'}"
            from_kvcore = origin == "kvcore" or origin.startswith("kvcore.")
            from_spec = origin == "kvcore.spec" or origin.startswith("kvcore.spec.")
            if in_spec and from_kvcore and not from_spec:
                role = "the reference" if module in REFERENCE else "spec"
                out.append(f"{what} ({role} imports kvcore code)")
            elif (not in_spec and module not in CHECKERS and from_spec
                  and not spec_object_allowed(origin, name)):
                out.append(f"{what} (kvcore imports a spec rule, not a type/error/predicate)")
        if not in_spec and module not in CHECKERS:
            for origin, name, line in module_attributes(module, source, module in PACKAGES):
                if ((origin == "kvcore.spec" or origin.startswith("kvcore.spec."))
                        and not spec_object_allowed(origin, name)):
                    out.append(f"{module}:{line}: reads {origin}.{name} (kvcore imports a "
                               "spec rule, not a type/error/predicate)")
        if in_spec:
            for origin, name, line in module_attributes(module, source, module in PACKAGES):
                if not (origin == "kvcore.spec" or origin.startswith("kvcore.spec.")):
                    out.append(f"{module}:{line}: reads {origin}.{name} (spec imports "
                               "kvcore code)")
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and _MODULE_STRING.fullmatch(node.value)):
                named_spec = node.value == "kvcore.spec" or node.value.startswith("kvcore.spec.")
                if (in_spec and not named_spec) or (
                        not in_spec and module not in CHECKERS
                        and node.value.startswith(FORBIDDEN_MODULES)):
                    out.append(f"{module}:{node.lineno}: names {node.value!r} in a string")
            elif (isinstance(node, ast.Call) and module not in DYNAMIC_IMPORTERS
                  and _called_name(node.func) in {"import_module", "__import__"}
                  and not (node.args and isinstance(node.args[0], ast.Constant))):
                out.append(f"{module}:{node.lineno}: imports by a computed name")
    return out


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def test_the_real_tree_is_independent() -> None:
    sources = real_sources()
    assert "kvcore.spec.model" in sources and "kvcore.scheduler._rules" in sources
    assert violations(sources) == []


def test_the_reference_imports_only_spec_and_the_standard_library() -> None:
    """Stronger than the rule above, for the reference alone: every import is kvcore.spec
    or a standard-library module."""
    sources = real_sources()
    for module in REFERENCE:
        for origin, _, line in imports(module, sources[module], False):
            top = origin.split(".")[0]
            assert origin.startswith("kvcore.spec") or top in sys.stdlib_module_names, \
                (module, line, origin)


def inject(module: str, line: str, into_function: bool = False) -> dict[str, str]:
    """The real sources with ``line`` added to ``module`` (at the top, or in a function)."""
    sources = real_sources()
    if into_function:
        sources[module] += f"\n\ndef _injected() -> None:\n    {line}\n"
    else:
        head, sep, rest = sources[module].partition("from __future__ import annotations\n")
        sources[module] = head + sep + line + "\n" + rest
    return sources


LEAKS = [
    pytest.param("kvcore.spec.model", "from kvcore.scheduler._rules import group_offer", False,
                 "the reference imports kvcore code", id="reference-imports-kvcore-rule"),
    pytest.param("kvcore.spec.model", "from kvcore.scheduler import scheduler", True,
                 "the reference imports kvcore code", id="reference-lazy-import"),
    pytest.param("kvcore.spec.manager_model", "from kvcore.manager._lru import LRUPolicy",
                 False, "the reference imports kvcore code", id="manager-model-imports-lru"),
    pytest.param("kvcore.spec.lookup", "from ..scheduler._lookup import converge", True,
                 "spec imports kvcore code", id="spec-relative-import-of-kvcore"),
    pytest.param("kvcore.scheduler._rules", "from kvcore.spec.lookup import needed_chunks",
                 False, "kvcore imports a spec rule", id="kvcore-imports-spec-lookup"),
    pytest.param("kvcore.scheduler.scheduler", "from kvcore.spec.model import load_blocks",
                 False, "kvcore imports a spec rule", id="kvcore-imports-reference-rule"),
    pytest.param("kvcore.scheduler._store", "from kvcore.spec import lookup", False,
                 "kvcore imports a spec rule", id="kvcore-imports-spec-module"),
    pytest.param("kvcore.zoo", "import kvcore.spec.model", True,
                 "kvcore imports a spec rule", id="kvcore-imports-whole-model"),
    pytest.param("kvcore.scheduler._rules", "from kvcore.spec.invariants import spec_hit",
                 False, "kvcore imports a spec rule", id="rule-laundered-through-invariants"),
    pytest.param("kvcore.manager._cpu",
                 "from kvcore.spec.manager_model import ReferenceManager", False,
                 "kvcore imports a spec rule", id="kvcore-imports-reference-manager"),
    pytest.param("kvcore.manager._cpu",
                 "from kvcore.spec.manager_model import check_capacity", False,
                 "kvcore imports a spec rule", id="kvcore-shares-manager-validation"),
    pytest.param("kvcore.scheduler._lookup",
                 "_m = __import__('importlib').import_module('kvcore.spec.lookup')", True,
                 "in a string", id="dynamic-import-by-name"),
    pytest.param("kvcore.scheduler._store",
                 "from kvcore.spec import invariants as inv; inv.served_chunks", True,
                 "reads kvcore.spec.invariants.served_chunks", id="rule-read-off-a-module"),
    pytest.param("kvcore.scheduler._store", "import kvcore; kvcore.spec.lookup.spec_hit",
                 True, "reads kvcore.spec.lookup.spec_hit", id="rule-read-off-kvcore"),
    pytest.param("kvcore.scheduler._store",
                 "import kvcore.spec.model as ref; ref.ReferenceScheduler", True,
                 "kvcore imports a spec rule", id="reference-module-aliased"),
    pytest.param("kvcore.transfer._plans", "from kvcore.spec.plans import chunks_spanned",
                 False, "kvcore imports a spec rule", id="kvcore-shares-plan-mapping"),
    pytest.param("kvcore.scheduler._lookup",
                 "import importlib; importlib.import_module('kvcore.spec.' + 'lookup')", True,
                 "computed name", id="dynamic-import-computed"),
    pytest.param("kvcore.spec.model",
                 "import importlib; importlib.import_module('kvcore.scheduler._rules')", True,
                 "in a string", id="reference-imports-kvcore-by-name"),
    pytest.param("kvcore.spec.model", "import kvcore; kvcore.scheduler._rules.group_offer",
                 True, "spec imports kvcore code", id="reference-reads-kvcore-attribute"),
]


@pytest.mark.parametrize(("module", "line", "into_function", "fragment"), LEAKS)
def test_an_injected_leak_is_reported(module: str, line: str, into_function: bool,
                                      fragment: str) -> None:
    found = violations(inject(module, line, into_function))
    assert found, f"{line!r} in {module} was not reported"
    assert any(fragment in v and v.startswith(module) for v in found), found


def test_allowed_imports_stay_allowed() -> None:
    """Types, errors, hook dataclasses, plans and predicates: what kvcore may share."""
    for module, line in [
        ("kvcore.scheduler._rules",
         "from kvcore.spec.invariants import l3_load_covers_every_block"),
        ("kvcore.scheduler._rules", "from kvcore.spec.types import cdiv"),
        ("kvcore.scheduler._rules", "from kvcore.spec import OffloadConfig"),
        ("kvcore.manager._cpu", "from kvcore.spec.manager_model import PrepareStoreResult"),
    ]:
        assert violations(inject(module, line)) == [], line
