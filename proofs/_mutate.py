"""Mutants of kvcore's own functions, patched in while CrossHair runs an obligation.

A mutant is kvcore's source with one textual change (``old`` -> ``new``), compiled at
import time in the function's own module namespace, so it is exactly the code under test
with one bug, not an alternative written here. ``Mutant.applied()`` swaps it in for the
original everywhere kvcore or the obligations hold a reference to it (the defining module
and every module that imported the name, or the class for a method) and restores the
original on exit.

If kvcore's source no longer contains ``old`` exactly once, building the mutant raises
``MutationError``: the obligation module then fails to import and the run reports it, so a
refactor cannot silently turn a mutant into the original.
"""

from __future__ import annotations
import __future__

import importlib
import inspect
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


class MutationError(RuntimeError):
    """The mutant's pattern is not (exactly once) in the kvcore function's source."""


@dataclass(frozen=True)
class Mutation:
    """One kvcore function (``module:qualname``) with ``old`` replaced by ``new``."""

    target: str
    old: str
    new: str
    why: str

    @property
    def module_name(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]

    def original(self) -> Any:
        obj: Any = importlib.import_module(self.module_name)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def build(self) -> Any:
        """The mutated function object (raises MutationError when the pattern is gone)."""
        orig = self.original()
        func = orig.__func__ if isinstance(orig, (staticmethod, classmethod)) else orig
        source = textwrap.dedent(inspect.getsource(func))
        count = source.count(self.old)
        if count != 1:
            raise MutationError(f"mutant of {self.target}: pattern {self.old!r} occurs "
                                f"{count} times in its source (want exactly 1); update the "
                                "mutant to the current code")
        code = compile(source.replace(self.old, self.new), inspect.getfile(func), "exec",
                       flags=__future__.annotations.compiler_flag, dont_inherit=True)
        namespace = dict(func.__globals__)
        exec(code, namespace)
        return namespace[func.__name__]

    def sites(self) -> list[tuple[Any, str]]:
        """(holder, attribute) pairs that refer to the original function."""
        if "." in self.qualname:  # a method: patch it on its class
            owner_path, name = self.qualname.rsplit(".", 1)
            owner: Any = importlib.import_module(self.module_name)
            for part in owner_path.split("."):
                owner = getattr(owner, part)
            return [(owner, name)]
        orig = self.original()
        out = []
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or mod_name.split(".", 1)[0] not in ("kvcore", "proofs"):
                continue
            for attr, value in list(vars(mod).items()):
                if value is orig:
                    out.append((mod, attr))
        return out


class Mutant:
    """A built mutation and where to patch it; build once, apply inside each run."""

    def __init__(self, mutation: Mutation) -> None:
        self.mutation = mutation
        self.replacement = mutation.build()
        self.sites = mutation.sites()
        if not self.sites:
            raise MutationError(f"mutant of {mutation.target}: nothing in kvcore refers to it")

    @contextmanager
    def applied(self) -> Iterator[None]:
        saved = [(holder, attr, holder.__dict__[attr]) for holder, attr in self.sites]
        try:
            for holder, attr, _ in saved:
                setattr(holder, attr, self.replacement)
            yield
        finally:
            for holder, attr, value in saved:
                setattr(holder, attr, value)


def mutant(target: str, old: str, new: str, why: str) -> Mutant:
    """Build the mutant of ``target`` (``"kvcore.module:function"``) now, at import."""
    return Mutant(Mutation(target, old, new, why))
