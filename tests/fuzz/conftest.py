"""Hypothesis settings profiles for the fuzz tests.

`ci` (the default) keeps the whole folder under a minute on a shared two-core machine; `dev` digs
deeper. Choose with OOBLECK_FUZZ_PROFILE=dev. deadline=None: file and socket I/O on a loaded machine
has no stable per-example time, and a slow example is not a failure here; hangs are bounded by
socket timeouts and the loaders' own limits instead.

The profiles are registered, not loaded: loading one here would change every other hypothesis test
of a whole-suite run. Each fuzz test is decorated with `fuzz_settings(...)` from fuzzlib instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

# fuzzlib (helpers shared by the fuzz modules) is imported by name: tests/ is not a package.
sys.path.insert(0, str(Path(__file__).resolve().parent))

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=40, deadline=None, print_blob=True, suppress_health_check=_QUIET)
settings.register_profile("dev", max_examples=500, deadline=None, print_blob=True, suppress_health_check=_QUIET)
