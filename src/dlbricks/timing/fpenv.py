"""Denormal (subnormal) numbers: counting them, and the thread's flush-to-zero mode."""

from __future__ import annotations

from typing import Any

import numpy as np

from dlbricks import _core


def count_denormals(array: Any) -> int:
    """Number of subnormal (denormal) values in a floating-point array.

    Subnormals make x86 arithmetic tens of times slower unless flushed to zero, so a
    brick fed (or producing) them would be timed on a slow path a real model may
    never take. The count reads bit patterns (zero exponent, non-zero mantissa)
    rather than comparing magnitudes: once onnxruntime has set denormals-are-zero
    on this thread, float comparisons would see every subnormal as 0.

    Args:
        array: anything ``np.asarray`` accepts; non-float dtypes have none.

    Returns:
        The count (real and imaginary parts counted separately for complex arrays).
    """
    a = np.asarray(array)
    if a.dtype.kind == "c":
        return count_denormals(a.real) + count_denormals(a.imag)
    if a.dtype.kind != "f":
        return 0
    info = np.finfo(a.dtype)
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}.get(a.dtype.itemsize)
    if uint is None:  # long double: no portable bit layout; fall back to magnitudes
        mag = np.abs(a)
        return int(np.count_nonzero((mag > 0) & (mag < info.tiny)))
    bits = np.ascontiguousarray(a).view(uint)
    mant_bits = info.nmant
    exp_mask = uint(((1 << info.iexp) - 1) << mant_bits)
    mant_mask = uint((1 << mant_bits) - 1)
    return int(np.count_nonzero(((bits & exp_mask) == 0) & ((bits & mant_mask) != 0)))


def denormals_flushed() -> bool:
    """Whether this thread currently flushes subnormals (FTZ/DAZ in effect)."""
    tiny = np.finfo(np.float32).tiny
    with np.errstate(all="ignore"):
        return bool(np.float32(tiny) * np.float32(0.5) == 0)


class FloatEnv:
    """Control flush-to-zero on this thread, and restore the thread's mode after.

    onnxruntime applies ``session.set_denormal_as_zero`` to the calling thread only
    for the *first* session of the process (a ``std::call_once``) and never undoes
    it, so the mode a brick runs in on this thread would depend on history: the
    runner sets FTZ/DAZ itself (x86-64 MXCSR bits 15 and 6, aarch64 FPCR.FZ) through
    the extension (``_core.set_flush_denormals``), and puts the mode saved at
    construction back after timing so later numpy code on the thread is unaffected.
    Only the flush bits are touched (a thread that had one of FTZ and DAZ without the
    other gets both back cleared). On other CPUs it is a no-op (the observed mode is
    still recorded in the measurement).
    """

    def __init__(self) -> None:
        self._saved = _core.flush_denormals()  # None: this CPU has no control here

    def set_flush(self, on: bool) -> None:
        """Turn flush-to-zero/denormals-are-zero on or off for this thread."""
        _core.set_flush_denormals(on)

    def restore(self) -> None:
        """Put back the mode saved at construction."""
        if self._saved is not None:
            _core.set_flush_denormals(self._saved)
