"""Across-stack profiling (XSP): model, layer and hardware levels, traces and spans.

- :mod:`.xsp`         :func:`profile_model`: the levels, measured one by one
- :mod:`.options`     :class:`ProfileOptions` and the level names
- :mod:`.sessions`    the profiler's sessions, on :mod:`dlbricks.timing.session`
- :mod:`.ort_profile` onnxruntime's profile, its calibration and the executed graph
- :mod:`.join`        kernels joined to layers and brick digests
- :mod:`.layer`       the layer level and its correction for the profiler's cost
- :mod:`.hw`          the hw level: perf counters on each kernel's brick, in a worker
- :mod:`.worker`      that worker's process: ``python -m dlbricks.profiling.worker``
- :mod:`.render`      the text summary
- :mod:`.perfevents`  Linux perf event counters
- :mod:`.tracing`     spans, Chrome traces and OpenTelemetry
"""

from __future__ import annotations

from dlbricks.profiling.options import ProfileOptions, parse_levels
from dlbricks.profiling.render import render_profile
from dlbricks.profiling.xsp import profile_model

__all__ = ["ProfileOptions", "parse_levels", "profile_model", "render_profile"]
