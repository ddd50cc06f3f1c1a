"""Lower bounds and what-ifs (Benanza): per-layer cost model, machine peaks, roofline analysis."""

from __future__ import annotations
