// See fpenv.hpp. The control registers are read and written with the compiler's
// intrinsics (x86-64) or one instruction each (aarch64), not through the C library's
// fenv_t, whose layout is the library's own.
#include "dlbricks/fpenv.hpp"

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace dlbricks {

#if defined(__x86_64__) || defined(_M_X64)

namespace {
constexpr unsigned kFlushBits = (1u << 15) | (1u << 6);  // MXCSR FTZ | DAZ
}

std::optional<bool> flush_denormals() { return (_mm_getcsr() & kFlushBits) == kFlushBits; }

std::optional<bool> set_flush_denormals(bool on) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(on ? (csr | kFlushBits) : (csr & ~kFlushBits));
    return (csr & kFlushBits) == kFlushBits;
}

#elif defined(__aarch64__)

namespace {
constexpr std::uint64_t kFlushBit = std::uint64_t{1} << 24;  // FPCR.FZ

std::uint64_t read_fpcr() {
    std::uint64_t v;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(v));
    return v;
}

void write_fpcr(std::uint64_t v) { __asm__ __volatile__("msr fpcr, %0" : : "r"(v)); }
}  // namespace

std::optional<bool> flush_denormals() { return (read_fpcr() & kFlushBit) != 0; }

std::optional<bool> set_flush_denormals(bool on) {
    const std::uint64_t fpcr = read_fpcr();
    write_fpcr(on ? (fpcr | kFlushBit) : (fpcr & ~kFlushBit));
    return (fpcr & kFlushBit) != 0;
}

#else

std::optional<bool> flush_denormals() { return std::nullopt; }

std::optional<bool> set_flush_denormals(bool) { return std::nullopt; }

#endif

}  // namespace dlbricks
