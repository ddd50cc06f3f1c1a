"""Lower bounds and what-ifs (Benanza): per-layer cost model, machine peaks, roofline analysis.

- :mod:`.costmodel` a layer's FLOPs, MACs and minimum bytes (the public API)
- :mod:`.formulas`  the per-op formulas behind it
- :mod:`.peaks`     measured compute and memory peaks, cached per machine
- :mod:`.analysis`  bounds against measured layers, headroom and what-if scenarios
- :mod:`.results`   the analysis's result types
- :mod:`.render`    the analysis as JSON, text tables and a plot (:func:`~.render.draw_roofline`,
                    the one roofline drawing, is the HTML report's too)
"""

from __future__ import annotations
