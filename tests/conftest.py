"""Shared pytest set-up for the whole test tree: the Hypothesis profiles.

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

import os

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
