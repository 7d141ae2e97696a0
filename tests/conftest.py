"""Shared pytest set-up for the whole test tree: the Hypothesis profiles, and a fixture
that runs Python code inside the next garbage collection.

Three profiles, chosen once here so that every property test runs under the same budget
(a limit on everything, passed explicitly rather than trusting Hypothesis's defaults):

- ``dev`` (the default): modest example counts for a fast edit-test loop.
- ``ci``: derandomized, so a CI run is reproducible from the commit alone; prints the
  reproduction blob of any failure. Loaded automatically when ``CI=true``.
- ``fuzz``: many examples, for long local or GPU-runner sessions.

Select one with ``KVCORE_HYPOTHESIS_PROFILE=<name>`` (``CI=true`` wins). No profile has a
per-example deadline: tests never assert on time, and a slow shared runner must not turn
into a flaky failure. ``too_slow`` is suppressed because the spec's reference functions
are written for clarity, not speed, and some strategies (whole hit maps) are large.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow]

settings.register_profile(
    "dev",
    max_examples=40,
    deadline=None,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "ci",
    max_examples=120,
    derandomize=True,
    print_blob=True,
    deadline=None,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "fuzz",
    max_examples=5_000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[*_SLOW_OK, HealthCheck.data_too_large],
)


def _profile_name() -> str:
    if os.environ.get("CI", "").lower() == "true":
        return "ci"
    return os.environ.get("KVCORE_HYPOTHESIS_PROFILE", "dev")


settings.load_profile(_profile_name())


@pytest.fixture
def inside_next_collection() -> Iterator[Callable[[Callable[[], None]], list[bool]]]:
    """``arm(action)``: the next allocation of a tracked object runs a collection, and
    ``action`` runs at its start; the returned list gets True once it has run.

    A C function that allocates a list may run a collection, and a gc callback (or a
    ``__del__``) there may change the Python objects it is reading; the C code must read
    them again after the allocation. The tests of those re-reads fire ``action`` inside
    that allocation: gen 0 is filled to its threshold, so the allocation is the one that
    collects. Arm it right before that call (inside ``pytest.raises``, not before it):
    any tracked allocation in between collects first.
    """
    threshold = gc.get_threshold()
    pending: list[Callable[[], None]] = []
    fired: list[bool] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if pending and phase == "start":
            pending.pop()()
            fired.append(True)

    junk: list[object] = []  # kept until teardown: freeing it lowers the gen 0 count

    def arm(action: Callable[[], None]) -> list[bool]:
        gc.set_threshold(100)
        gc.collect()
        while gc.get_count()[0] < 100:
            junk.append([])
        pending.append(action)
        return fired

    gc.callbacks.append(callback)
    try:
        yield arm
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)
