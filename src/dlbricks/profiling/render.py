"""The text summary of a profile: levels and overheads, the reconciliation, the top
kernels and the per-op-type totals."""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["fmt_pct", "fmt_us", "render_profile"]


_TIME_UNITS = ((1e6, " s"), (1e3, " ms"), (1.0, " us"))
_COUNT_UNITS = ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""))


def _scaled(v: Any, units: tuple[tuple[float, str], ...]) -> str:
    """``v`` to 3 significant digits in the largest of ``units`` it reaches (the
    last one below them all); ``-`` when it is no finite number."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return "-"
    if not math.isfinite(x):
        return "-"
    factor, suffix = next(((f, s) for f, s in units if abs(x) >= f), units[-1])
    return f"{x / factor:.3g}{suffix}"


def fmt_us(us: float | None) -> str:
    """Microseconds in the largest unit that keeps them readable (``-`` when unknown)."""
    return _scaled(us, _TIME_UNITS)


def fmt_pct(x: float | None) -> str:
    """A signed percentage (``-`` when unknown)."""
    return "-" if x is None or not math.isfinite(x) else f"{x:+.1%}"


def render_profile(result: Mapping[str, Any], *, top: int = 15) -> str:
    """The text summary: levels and overheads, the reconciliation, top kernels by
    corrected time (with in-model against isolated brick time and counters),
    per-op-type totals."""
    lines: list[str] = []
    m = result["model"]
    ctx = result["context"]
    lines.append(
        f"dlbricks profile: {m['name']} ({m['layers']} layers; onnxruntime {ctx['onnxruntime']}, "
        f"intra-op threads {ctx['intra_op_threads']})"
    )
    ml, ll, hw = result.get("model_level"), result.get("layer_level"), result.get("hw_level")
    lines.append("")
    lines.append("levels (each measured in its own run)")
    if ml:
        lines.append(
            f"  model  latency {fmt_us(ml['latency_us'])} (median of {ml['n']}, 95% CI "
            f"{fmt_us(ml['ci_low_us'])}..{fmt_us(ml['ci_high_us'])}), profiling off"
        )
    if ll:
        cal = ll.get("instrumentation") or {}
        lines.append(
            f"  layer  profiled run {fmt_us(ll['profiled_wall_us'])}: overhead {fmt_us(ll['overhead_us'])} "
            f"({fmt_pct(ll['overhead_rel'])}) vs {ll['reference']}; same session unprofiled "
            f"{fmt_us(ll['unprofiled_same_session_us'])} (profiler {fmt_us(ll['overhead_per_kernel_us'])}/kernel)"
        )
        if cal:
            lines.append(
                f"         profiler cost per kernel (calibrated): {cal['in_span_us']:.1f} us inside the span, "
                f"{cal['out_span_us']:.1f} us between spans (profiler cost {fmt_us(ll['profiler_cost_us'])} per run)"
            )
    if hw:
        if hw.get("message"):
            lines.append(f"  hw     {hw['message']}")
        mo = hw.get("model") or {}
        if mo.get("counted_us") is not None:
            lines.append(
                f"  hw     counters {', '.join(hw['events']) or 'none'}: whole model {fmt_us(mo['counted_us'])} "
                f"counted vs {fmt_us(mo['uncounted_us'])} not (overhead {fmt_us(mo['overhead_us'])}, "
                f"{fmt_pct(hw.get('overhead_rel'))}); {hw['bricks']} bricks, {hw['failed']} failed"
            )
    if ll:
        ref = ll["reference_us"]
        lines.append("")
        lines.append(f"reconciliation against {ll['reference']} {fmt_us(ref)}")
        lines.append(f"  sum of raw kernel times       {fmt_us(ll['raw_sum_us']):>10}  ({fmt_pct(ll['error_before'])})")
        lines.append(f"  sum of corrected layer times  {fmt_us(ll['corrected_sum_us']):>10}  ({fmt_pct(ll['error_after'])})")
        lines.append(
            f"  framework overhead            {fmt_us(ll['framework_overhead_us']):>10}  "
            f"({fmt_pct(ll['framework_overhead_rel'])}: time between kernels less the profiler's share, "
            f"and the call into onnxruntime)"
        )
        lines.append(
            f"  scale to the reference {ll['scale']:.3f}; run-to-run variation {fmt_us(ll['run_variation_us'])} "
            f"(median run's kernel time less the sum of per-kernel medians)"
        )
    kernels = list(result.get("kernels") or [])
    if kernels and (ll or hw):
        has_iso = any(k.get("isolated_us") is not None for k in kernels)
        has_ipc = any((k.get("derived") or {}).get("ipc") is not None for k in kernels)
        lines.append("")
        lines.append(f"top {min(top, len(kernels))} layers by {'corrected' if ll else 'isolated brick'} time")
        hdr = f"  {'#':>3} {'layer(s)':<24} {'op':<30} {'corrected':>10} {'share':>6} {'raw':>9} {'GOP/s':>8}"
        if has_iso:
            hdr += f" {'isolated':>9} {'in/iso':>6}"
        if has_ipc:
            hdr += f" {'IPC':>5}"
        hdr += "  counters"
        lines.append(hdr)
        def time_of(k: Mapping[str, Any]) -> float:
            corrected = k.get("corrected_us")
            return float(corrected if corrected is not None else k.get("isolated_us") or 0.0)

        for i, k in enumerate(sorted(kernels, key=lambda k: -time_of(k))[:top], 1):
            names = ",".join(x["name"] for x in k["layers"]) or k["kernel"]
            if len(names) > 24:
                names = names[:21] + "..."
            label = k["label"] if len(k["label"]) <= 30 else k["label"][:27] + "..."
            row = (
                f"  {i:>3} {names:<24} {label:<30} {fmt_us(k.get('corrected_us')):>10} "
                f"{_fmt_share(k.get('share')):>6} {fmt_us(k.get('raw_us')):>9} "
                f"{_fmt_num(k.get('gops', k.get('gflops'))):>8}"
            )
            if has_iso:
                iso = k.get("isolated_us")
                ratio = k.get("in_model_over_isolated")
                row += f" {fmt_us(iso):>9} {_fmt_num(ratio):>6}"
            if has_ipc:
                ipc = (k.get("derived") or {}).get("ipc")
                row += f" {_fmt_num(ipc):>5}"
            c = k.get("counters") or {}
            row += "  " + (", ".join(_fmt_counter(name, v) for name, v in c.items() if v is not None) or "-")
            lines.append(row)
        iso_pairs = [(k["corrected_us"], k["isolated_us"]) for k in kernels
                     if k.get("isolated_us") and k.get("corrected_us") is not None]
        if iso_pairs:
            a = sum(p[0] for p in iso_pairs)
            b = sum(p[1] for p in iso_pairs)
            lines.append(
                f"  in-model vs isolated bricks: {fmt_us(a)} in the model against {fmt_us(b)} isolated "
                f"over {len(iso_pairs)} kernels (ratio {a / b:.2f})"
            )
    if result.get("op_types"):
        lines.append("")
        lines.append("per op type (fused layers together)")
        for t in result["op_types"][:top]:
            lines.append(
                f"  {t['op_type']:<44} {t['kernels']:>4} kernels {fmt_us(t['corrected_us']):>10} "
                f"{(t['share'] or 0):>6.1%}"
            )
    join = result.get("join")
    if join:
        lines.append("")
        lines += _join_lines(join)
    for w in result.get("warnings") or []:
        lines.append(f"warning: {w}")
    return "\n".join(lines) + "\n"


#: How a kernel's source layers were found (:class:`~dlbricks.profiling.join.Join`), in words.
_HOW = {"name": "by name", "output": "by output tensor", "shape": "by op type and shape",
        "fused": "fused into a neighbour's kernel", "unmatched": "not traced"}


def _ops(ops: Mapping[str, int]) -> str:
    return ", ".join(f"{op} {n}" for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))


def _join_lines(join: Mapping[str, Any]) -> list[str]:
    """Which layers the kernels are: how many are attributed (to the runtime graph's
    layers, or to source layers), how their source layers were found, and what
    onnxruntime inserted."""
    n = join["kernels"]
    attributed = join.get("attributed")
    where = "the runtime graph's layers" if join.get("graph") == "runtime" else "source layers"
    if attributed is None:  # a profile from before attribution was counted
        head = f"join: {n} kernels"
    elif attributed == n:
        head = f"join: all {n} kernels attributed to {where}"
    else:
        head = (f"join: {attributed} of {n} kernels attributed to {where}; not: "
                f"{_ops(join.get('unattributed_ops') or {})}")
    by = {h: v for h, v in (join.get("by_match") or {}).items() if h not in ("inserted", "runtime")}
    traced = ", ".join(f"{v} {_HOW.get(h, h)}" for h, v in by.items()) or "none"
    lines = [head, f"  traced to source layers: {traced}; {join['unassigned_layers']} source layers without a kernel"]
    if join.get("inserted_ops"):
        lines.append(f"  inserted by onnxruntime (no source layer): {_ops(join['inserted_ops'])}")
    return lines


def _fmt_share(v: float | None) -> str:
    return f"{v:.1%}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _fmt_num(v: float | None) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) and math.isfinite(v) and v else "-"


def _fmt_counter(name: str, v: float) -> str:
    # task-clock counts nanoseconds of CPU time; the others are event counts.
    return f"{name}={fmt_us(v / 1e3)}" if name == "task-clock" else f"{name}={_fmt_count(v)}"


def _fmt_count(v: float) -> str:
    return _scaled(v, _COUNT_UNITS)
