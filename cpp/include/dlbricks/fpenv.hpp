// The calling thread's flush-to-zero mode: subnormal results (and, on x86, inputs)
// read as zero. Timing sets it explicitly, because onnxruntime sets it only for the
// first session of a process and never undoes it, so a brick's mode would otherwise
// depend on what ran before (see dlbricks/timing/fpenv.py).
#pragma once

#include <optional>

namespace dlbricks {

/// Whether this thread flushes subnormals: on x86-64 both MXCSR bits FTZ (15, results)
/// and DAZ (6, inputs) set, on aarch64 FPCR.FZ (24); nullopt on other CPUs. O(1).
std::optional<bool> flush_denormals();

/// Sets (both bits on x86-64) or clears this thread's flush-to-zero mode and returns
/// the previous state as flush_denormals() reads it; nullopt, changing nothing, on
/// other CPUs. Only the flush bits change: rounding mode and exception flags stay. O(1).
std::optional<bool> set_flush_denormals(bool on);

}  // namespace dlbricks
