"""The suite's Hypothesis settings: the same examples on every machine and every run.

`derandomize` draws each property test's examples from a seed fixed by the test's name, so a
fresh clone on CI runs exactly what ran here; no deadline and no too-slow health check, which
measure the machine's load, not tcpc. `HYPOTHESIS_PROFILE=explore pytest ...` draws new
examples each run (with the example database), to hunt for failures on purpose.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_UNTIMED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("deterministic", derandomize=True, database=None, **_UNTIMED)
settings.register_profile("explore", **_UNTIMED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
