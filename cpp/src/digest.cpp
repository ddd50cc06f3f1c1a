#include "dlbricks/digest.hpp"

#include <algorithm>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace dlbricks {
namespace {

constexpr std::uint64_t kIv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

// Message word schedule of RFC 7693, section 2.7; rounds 10 and 11 reuse rows 0 and 1.
constexpr std::uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

constexpr std::size_t kOutBytes = 16;

inline std::uint64_t rotr(std::uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

inline std::uint64_t load_le64(const std::uint8_t* p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
#else
    std::uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
#endif
}

inline void mix(std::uint64_t* v, int a, int b, int c, int d, std::uint64_t x, std::uint64_t y) {
    v[a] = v[a] + v[b] + x;
    v[d] = rotr(v[d] ^ v[a], 32);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 24);
    v[a] = v[a] + v[b] + y;
    v[d] = rotr(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 63);
}

// The compression function F of RFC 7693 on chaining state h, after `counter` bytes.
void compress_block(std::uint64_t* h, const std::uint8_t* block, std::uint64_t counter, bool last) {
    std::uint64_t m[16];
    for (int i = 0; i < 16; ++i) m[i] = load_le64(block + 8 * i);
    std::uint64_t v[16];
    for (int i = 0; i < 8; ++i) {
        v[i] = h[i];
        v[i + 8] = kIv[i];
    }
    v[12] ^= counter;  // low word of the 128-bit counter; the high word stays 0
    if (last) v[14] = ~v[14];
#pragma GCC unroll 12
    for (const auto& s : kSigma) {
        mix(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
        mix(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
        mix(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
        mix(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
        mix(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
        mix(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
        mix(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
        mix(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

Digest128 digest_of(const std::uint64_t* h) {
    Digest128 out;
    for (std::size_t i = 0; i < kOutBytes; ++i) out.bytes[i] = static_cast<std::uint8_t>(h[i / 8] >> (8 * (i % 8)));
    return out;
}

// Blocks a job compresses: every full one but the last, then the last (zero-padded,
// and the only one when there are no bytes at all) with the final flag.
std::size_t n_blocks(const Blake2bJob& job) { return job.size == 0 ? 1 : (job.size + 127) / 128; }

// The digest of a message whose first `counter` bytes chaining state h has absorbed
// and whose rest is `left` bytes at p, none compressed yet: the blocks n_blocks counts,
// the last zero-padded with the final flag. h is used up.
Digest128 finish_message(std::uint64_t* h, std::uint64_t counter, const std::uint8_t* p, std::size_t left) {
    for (; left > 128; left -= 128, p += 128) {
        counter += 128;
        compress_block(h, p, counter, false);
    }
    std::uint8_t last[128] = {};
    if (left) std::memcpy(last, p, left);
    compress_block(h, last, counter + left, true);
    return digest_of(h);
}

void finish_job(const std::uint8_t* buffer, const Blake2bJob& job, Digest128& out) {
    std::uint64_t h[8];
    std::memcpy(h, job.h, sizeof h);
    out = finish_message(h, job.counter, buffer + job.offset, job.size);
}

#if defined(__x86_64__) && defined(__GNUC__)
// Four jobs at once, job k in 64-bit lane k of each AVX2 register: the same rounds as
// compress_block on vectors. Jobs of different lengths run for the longest one's
// blocks; a lane whose job is done keeps its state (its results are masked out).
__attribute__((target("avx2"))) inline __m256i rotr_v(__m256i x, int n) {
    switch (n) {
        case 32: return _mm256_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1));
        case 24: return _mm256_shuffle_epi8(x, _mm256_setr_epi8(3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10,
                                                                3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10));
        case 16: return _mm256_shuffle_epi8(x, _mm256_setr_epi8(2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9,
                                                                2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9));
        default: return _mm256_or_si256(_mm256_srli_epi64(x, 63), _mm256_add_epi64(x, x));  // 63
    }
}

__attribute__((target("avx2"))) inline void mix_v(__m256i* v, int a, int b, int c, int d, __m256i x, __m256i y) {
    v[a] = _mm256_add_epi64(_mm256_add_epi64(v[a], v[b]), x);
    v[d] = rotr_v(_mm256_xor_si256(v[d], v[a]), 32);
    v[c] = _mm256_add_epi64(v[c], v[d]);
    v[b] = rotr_v(_mm256_xor_si256(v[b], v[c]), 24);
    v[a] = _mm256_add_epi64(_mm256_add_epi64(v[a], v[b]), y);
    v[d] = rotr_v(_mm256_xor_si256(v[d], v[a]), 16);
    v[c] = _mm256_add_epi64(v[c], v[d]);
    v[b] = rotr_v(_mm256_xor_si256(v[b], v[c]), 63);
}

// h: 8 vectors (word i of the four states); blocks: one per lane; counter and last
// flag per lane; active: all-ones in the lanes whose state takes the result.
__attribute__((target("avx2"))) void compress4(__m256i* h, const std::uint8_t* const* blocks, __m256i counter,
                                               __m256i last, __m256i active) {
    __m256i m[16];
    // Word w of the four blocks into one vector: 4x4 transposes of 32-byte loads.
    for (int w = 0; w < 16; w += 4) {
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks[0] + 8 * w));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks[1] + 8 * w));
        const __m256i r2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks[2] + 8 * w));
        const __m256i r3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks[3] + 8 * w));
        const __m256i lo01 = _mm256_unpacklo_epi64(r0, r1), hi01 = _mm256_unpackhi_epi64(r0, r1);
        const __m256i lo23 = _mm256_unpacklo_epi64(r2, r3), hi23 = _mm256_unpackhi_epi64(r2, r3);
        m[w + 0] = _mm256_permute2x128_si256(lo01, lo23, 0x20);
        m[w + 1] = _mm256_permute2x128_si256(hi01, hi23, 0x20);
        m[w + 2] = _mm256_permute2x128_si256(lo01, lo23, 0x31);
        m[w + 3] = _mm256_permute2x128_si256(hi01, hi23, 0x31);
    }
    __m256i v[16];
    for (int i = 0; i < 8; ++i) {
        v[i] = h[i];
        v[i + 8] = _mm256_set1_epi64x(static_cast<long long>(kIv[i]));
    }
    v[12] = _mm256_xor_si256(v[12], counter);
    v[14] = _mm256_xor_si256(v[14], last);
#pragma GCC unroll 12
    for (const auto& s : kSigma) {
        mix_v(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
        mix_v(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
        mix_v(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
        mix_v(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
        mix_v(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
        mix_v(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
        mix_v(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
        mix_v(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; ++i) {
        const __m256i next = _mm256_xor_si256(h[i], _mm256_xor_si256(v[i], v[i + 8]));
        h[i] = _mm256_blendv_epi8(h[i], next, active);
    }
}

// Jobs `order[0..4)` (fewer: the last one repeats, its extra results unused).
__attribute__((target("avx2"))) void finish_four(const std::uint8_t* buffer, const Blake2bJob* jobs,
                                                 const std::uint32_t* order, std::size_t count, Digest128* out) {
    const Blake2bJob* lane[4];
    for (std::size_t k = 0; k < 4; ++k) lane[k] = &jobs[order[k < count ? k : count - 1]];
    alignas(32) std::uint64_t words[8][4];
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 4; ++k) words[i][k] = lane[k]->h[i];
    __m256i h[8];
    for (int i = 0; i < 8; ++i) h[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(words[i]));
    std::size_t blocks[4], steps = 0;
    std::uint64_t counter[4];
    for (int k = 0; k < 4; ++k) {
        blocks[k] = n_blocks(*lane[k]);
        steps = std::max(steps, blocks[k]);
        counter[k] = lane[k]->counter;
    }
    alignas(32) std::uint8_t last_block[4][128];
    for (std::size_t step = 0; step < steps; ++step) {
        const std::uint8_t* at[4];
        alignas(32) std::uint64_t ctr[4], fin[4], act[4];
        for (int k = 0; k < 4; ++k) {
            const Blake2bJob& j = *lane[k];
            if (step + 1 < blocks[k]) {  // a full block, more to come
                counter[k] += 128;
                at[k] = buffer + j.offset + 128 * step;
                fin[k] = 0;
                act[k] = ~0ull;
            } else if (step + 1 == blocks[k]) {  // the last block, zero-padded
                const std::size_t left = j.size - 128 * step;
                std::memset(last_block[k], 0, 128);
                if (left) std::memcpy(last_block[k], buffer + j.offset + 128 * step, left);
                counter[k] += left;
                at[k] = last_block[k];
                fin[k] = ~0ull;
                act[k] = ~0ull;
            } else {  // done: any block, result discarded
                at[k] = last_block[k];
                fin[k] = 0;
                act[k] = 0;
            }
            ctr[k] = counter[k];
        }
        compress4(h, at, _mm256_load_si256(reinterpret_cast<const __m256i*>(ctr)),
                  _mm256_load_si256(reinterpret_cast<const __m256i*>(fin)),
                  _mm256_load_si256(reinterpret_cast<const __m256i*>(act)));
    }
    for (int i = 0; i < 8; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(words[i]), h[i]);
    for (std::size_t k = 0; k < count; ++k) {
        std::uint64_t hk[8];
        for (int i = 0; i < 8; ++i) hk[i] = words[i][k];
        out[order[k]] = digest_of(hk);
    }
}

bool have_avx2() {
    static const bool yes = __builtin_cpu_supports("avx2");
    return yes;
}
#endif

}  // namespace

Blake2b128::Blake2b128() {
    for (int i = 0; i < 8; ++i) h_[i] = kIv[i];
    // Parameter block: digest length 16, key length 0, fanout 1, depth 1.
    h_[0] ^= 0x01010000ULL ^ kOutBytes;
}

Blake2bJob Blake2b128::job_at(std::size_t offset) const {
    Blake2bJob j;
    std::memcpy(j.h, h_, sizeof j.h);
    j.counter = counter_;
    j.offset = offset;
    j.size = buffered_;
    return j;
}

void blake2b128_jobs(const std::uint8_t* buffer, const Blake2bJob* jobs, std::size_t n, Digest128* out) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (n >= 2 && have_avx2()) {
        // Jobs of equal block counts side by side, so that few lanes idle.
        std::vector<std::uint32_t> order(n);
        for (std::size_t i = 0; i < n; ++i) order[i] = static_cast<std::uint32_t>(i);
        std::stable_sort(order.begin(), order.end(),
                         [&](std::uint32_t a, std::uint32_t b) { return n_blocks(jobs[a]) < n_blocks(jobs[b]); });
        for (std::size_t i = 0; i < n; i += 4) finish_four(buffer, jobs, order.data() + i, std::min<std::size_t>(4, n - i), out);
        return;
    }
#endif
    for (std::size_t i = 0; i < n; ++i) finish_job(buffer, jobs[i], out[i]);
}

void Blake2b128::update(const void* data, std::size_t size) {
    const auto* p = static_cast<const std::uint8_t*>(data);
    while (size > 0) {
        // The last block must be compressed with the final flag, so a full buffer is
        // only compressed once more input arrives.
        if (buffered_ == sizeof buffer_) {
            counter_ += sizeof buffer_;
            compress_block(h_, buffer_, counter_, false);
            buffered_ = 0;
        }
        std::size_t take = sizeof buffer_ - buffered_;
        if (take > size) take = size;
        std::memcpy(buffer_ + buffered_, p, take);
        buffered_ += take;
        p += take;
        size -= take;
    }
}

void Blake2b128::update_u32(std::uint32_t value) {
    std::uint8_t b[4];
    for (int i = 0; i < 4; ++i) b[i] = static_cast<std::uint8_t>(value >> (8 * i));
    update(b, 4);
}

void Blake2b128::update_u64(std::uint64_t value) {
    std::uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<std::uint8_t>(value >> (8 * i));
    update(b, 8);
}

Digest128 Blake2b128::finish() { return finish_message(h_, counter_, buffer_, buffered_); }

Digest128 digest128(const void* data, std::size_t size) {
    Blake2b128 h;
    h.update(data, size);
    return h.finish();
}

std::string to_hex(const Digest128& digest) {
    static const char* kHex = "0123456789abcdef";
    std::string s(32, '0');
    for (std::size_t i = 0; i < 16; ++i) {
        s[2 * i] = kHex[digest.bytes[i] >> 4];
        s[2 * i + 1] = kHex[digest.bytes[i] & 15];
    }
    return s;
}

}  // namespace dlbricks
