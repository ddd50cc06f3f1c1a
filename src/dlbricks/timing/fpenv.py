"""Denormal (subnormal) numbers: counting them, and the thread's flush-to-zero mode."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    pass

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
    """Control flush-to-zero on this thread, and restore the thread's FP state after.

    onnxruntime applies ``session.set_denormal_as_zero`` to the calling thread only
    for the *first* session of the process (a ``std::call_once``) and never undoes
    it, so the mode a brick runs in on this thread would depend on history: the
    runner sets FTZ/DAZ itself (x86-64 MXCSR bits 15 and 6, aarch64 FPCR.FZ) through
    glibc's ``fegetenv``/``fesetenv``, and puts the saved environment back after
    timing so later numpy code on the thread is unaffected. Elsewhere it is a no-op
    (the observed mode is still recorded in the measurement).
    """

    _libm: Any = None
    _loaded = False
    # (byte offset of the control register in fenv_t, flush bits) per architecture.
    _LAYOUT = {"x86_64": (28, 0x8040), "amd64": (28, 0x8040), "aarch64": (0, 1 << 24), "arm64": (0, 1 << 24)}

    @classmethod
    def _lib(cls) -> Any:
        if not cls._loaded:
            cls._loaded = True
            try:
                import ctypes
                import ctypes.util

                name = ctypes.util.find_library("m")
                lib = ctypes.CDLL(name) if name else None
                if lib is not None and hasattr(lib, "fegetenv") and hasattr(lib, "fesetenv"):
                    cls._libm = lib
            except OSError:
                cls._libm = None
        return cls._libm

    def __init__(self) -> None:
        import ctypes
        import platform

        self._buf = ctypes.create_string_buffer(256)  # > sizeof(fenv_t) on every glibc ABI
        lib = self._lib()
        self._saved = lib is not None and lib.fegetenv(self._buf) == 0
        self._layout = self._LAYOUT.get(platform.machine().lower()) if sys.platform.startswith("linux") else None

    def set_flush(self, on: bool) -> None:
        """Turn flush-to-zero/denormals-are-zero on or off for this thread."""
        lib = self._lib()
        if lib is None or not self._saved or self._layout is None:
            return
        import ctypes

        offset, bits = self._layout
        env = ctypes.create_string_buffer(256)
        if lib.fegetenv(env) != 0:
            return
        reg = int.from_bytes(env.raw[offset : offset + 4], sys.byteorder)
        reg = (reg | bits) if on else (reg & ~bits & 0xFFFFFFFF)
        ctypes.memmove(ctypes.addressof(env) + offset, reg.to_bytes(4, sys.byteorder), 4)
        lib.fesetenv(env)

    def restore(self) -> None:
        """Put back the environment saved at construction."""
        lib = self._lib()
        if lib is not None and self._saved:
            lib.fesetenv(self._buf)
