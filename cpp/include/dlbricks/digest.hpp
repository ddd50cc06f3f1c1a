// 128-bit digests: BLAKE2b (RFC 7693) with a 16-byte output and no key.
//
// The algorithm is fixed and documented because digests key persisted benchmark
// results: the same bytes give the same digest on every machine, process and run.
// It is bit-identical to Python's hashlib.blake2b(data, digest_size=16), which the
// Python side uses for layer digests and the tests use as the reference.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace dlbricks {

struct Digest128 {
    std::array<std::uint8_t, 16> bytes{};

    // Two 8-byte loads instead of a call to memcmp: this runs once per hash lookup.
    bool operator==(const Digest128& other) const {
        std::uint64_t a[2], b[2];
        std::memcpy(a, bytes.data(), 16);
        std::memcpy(b, other.bytes.data(), 16);
        return ((a[0] ^ b[0]) | (a[1] ^ b[1])) == 0;
    }
    bool operator!=(const Digest128& other) const { return !(*this == other); }
    bool operator<(const Digest128& other) const { return bytes < other.bytes; }
};

/// Hash functor for hash maps keyed by digests. A digest is already uniform, so its
/// first 8 bytes are a good hash. Cost: O(1).
struct Digest128Hash {
    std::size_t operator()(const Digest128& d) const noexcept {
        std::uint64_t h;
        std::memcpy(&h, d.bytes.data(), sizeof h);
        return static_cast<std::size_t>(h);
    }
};

/// Whether `n` bytes at `a` and at `b` are equal. Inline word compares: hash tables
/// compare short keys (tensor names, ~25 bytes) once per lookup, where a call to
/// memcmp costs more than the compare. Cost: O(n).
inline bool bytes_equal(const void* a, const void* b, std::size_t n) {
    const auto* x = static_cast<const unsigned char*>(a);
    const auto* y = static_cast<const unsigned char*>(b);
    auto word = [](const unsigned char* p) {
        std::uint64_t w;
        std::memcpy(&w, p, 8);
        return w;
    };
    if (n >= 8) {
        for (std::size_t k = 0; k + 8 < n; k += 8)
            if (word(x + k) != word(y + k)) return false;
        return word(x + n - 8) == word(y + n - 8);  // the last 8 bytes (may overlap)
    }
    for (std::size_t k = 0; k < n; ++k)
        if (x[k] != y[k]) return false;
    return true;
}

/// A fast non-cryptographic 64-bit hash of a byte string, for hash tables that compare
/// the keys themselves on a match (never for identity, never stored). Two
/// multiply-xorshift lanes over alternate 8-byte words, so that the two multiply chains
/// overlap (sequence keys are ~70 bytes: one chain was a latency-bound loop); the last
/// partial word is read as the string's last 8 bytes when there are 8 (the length is in
/// the seed), else byte by byte. A final mix makes both the low bits (the slot) and the
/// high bits (a check) depend on every byte. Cost: O(size).
inline std::uint64_t bytes_hash(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    constexpr std::uint64_t kMulA = 0x9e3779b97f4a7c15ull, kMulB = 0xc2b2ae3d27d4eb4full;
    std::uint64_t a = 0x243f6a8885a308d3ull ^ (n * kMulA), b = 0x13198a2e03707344ull;
    auto word = [p](std::size_t at) {
        std::uint64_t w;
        std::memcpy(&w, p + at, 8);
        return w;
    };
    std::size_t k = 0;
    for (; k + 16 <= n; k += 16) {
        a = (a ^ word(k)) * kMulA;
        b = (b ^ word(k + 8)) * kMulB;
        a ^= a >> 32;
        b ^= b >> 29;
    }
    if (k + 8 <= n) {
        a = (a ^ word(k)) * kMulA;
        a ^= a >> 32;
        k += 8;
    }
    if (k < n) {
        std::uint64_t w = 0;
        if (n >= 8) {
            w = word(n - 8) >> (8 * (8 - (n - k)));  // the remaining n - k bytes
        } else {
            for (unsigned shift = 0; k < n; ++k, shift += 8) w |= static_cast<std::uint64_t>(p[k]) << shift;
        }
        b = (b ^ w) * kMulB;
        b ^= b >> 29;
    }
    std::uint64_t h = (a ^ (b * kMulA)) * 0xff51afd7ed558ccdull;
    return h ^ (h >> 33);
}

/// One message of a batch for blake2b128_jobs: the chaining state and byte count of a
/// BLAKE2b-128 hash so far, and the rest of the message, `size` bytes at `offset` of
/// the batch's buffer, none of it compressed yet (Blake2b128::job makes one).
struct Blake2bJob {
    std::uint64_t h[8];
    std::uint64_t counter = 0;
    std::size_t offset = 0, size = 0;
};

/// Finishes every job: out[i] is the digest of job i's message, exactly what
/// Blake2b128::update(rest) then finish() give. With AVX2 (checked at run time) four
/// messages are compressed at once, one per 64-bit lane: one message's compressions
/// depend on each other, different messages' do not. Cost: O(total bytes).
void blake2b128_jobs(const std::uint8_t* buffer, const Blake2bJob* jobs, std::size_t n, Digest128* out);

/// Incremental BLAKE2b-128. Precondition: none. Cost: O(bytes fed).
class Blake2b128 {
public:
    Blake2b128();
    void update(const void* data, std::size_t size);
    void update_u32(std::uint32_t value);  // little-endian, fixed width
    void update_u64(std::uint64_t value);  // little-endian, fixed width
    Digest128 finish();
    /// A job that continues this hash: appends the bytes fed but not compressed yet to
    /// `buffer` (anything with size() and append(const char*, n)), where the caller
    /// appends the rest of the message and sets the job's size (buffer.size() - offset).
    /// Cost: O(128).
    template <class Buffer>
    Blake2bJob job(Buffer& buffer) const {
        Blake2bJob j = job_at(buffer.size());
        buffer.append(reinterpret_cast<const char*>(buffer_), buffered_);
        return j;
    }

private:
    Blake2bJob job_at(std::size_t offset) const;  // state, counter, offset, pending size
    std::uint64_t h_[8];
    std::uint64_t counter_ = 0;  // bytes compressed so far (inputs < 2^64 bytes)
    std::uint8_t buffer_[128];
    std::size_t buffered_ = 0;
};

/// One-shot BLAKE2b-128 of a byte string. Cost: O(size).
Digest128 digest128(const void* data, std::size_t size);

/// Lower-case hex form of a digest (32 characters).
std::string to_hex(const Digest128& digest);

}  // namespace dlbricks
