"""Across-stack profiling (XSP): model, layer and hardware levels, traces and spans."""

from __future__ import annotations

from dlbricks.profiling.xsp import ProfileOptions, parse_levels, profile_model, render_profile

__all__ = ["ProfileOptions", "parse_levels", "profile_model", "render_profile"]
