// y[M, N] = x[M, K] · dequant(W)ᵀ (+ bias[N]) for 4-bit codes, with x quantized to int8: an opt-in
// path (kernels/int8_activations.py) because it changes the numerics slightly. llama.cpp computes its
// Q4_0/Q4_1 decode this way (q4_1 × q8_1): the codes and x meet in integer dot products, 64 of them per
// instruction with AVX-512 VNNI (vpdpbusd: unsigned 8-bit × signed 8-bit, summed in fours into int32),
// where the fp32 path (quant_linear.cpp) widens every code to fp32 and FMAs it, several vector ops per
// 32 codes that made it compute-bound before it was memory-bound.
//
// Math, for W in the canonical layout (kernels/packed.py: w = s[n, g] q[n, k] + o[n, g], 4-bit q):
//   x is cut into blocks of 32 (as llama.cpp's q8_1), each quantized to int8 with its own scale
//   d = max|x| / 127, x ≈ x' = d qx (round to nearest). Then y = W x' exactly (up to fp32 sums):
//   y[m, n] = sum_blocks s[n, g(b)] d[m, b] sum_{k in b} q[n, k] qx[m, k] + sum_g o[n, g] sum_{k in g} x'[m, k]
//   The offsets' term takes the sums of the rounded x' as llama.cpp does: the error is then W (x - x'),
//   |error| ≤ sum_k |w_k| d/2. (With the exact sums of x there, the error would be (s q)(x - x'), and
//   s q, 0 .. 15 s, is larger than the centred w: measured 1.5% against 0.4% rms on random weights.)
//
// Layout: two blocks A, B (64 codes) are 32 bytes of a W row: A's 16 bytes then B's, each byte's low
// nibble an even k and its high nibble the odd k after it. They widen to one 512-bit vector
// [A low | B low | A high | B high] (and + shift, no per-code conversion), and x's int8 is stored in
// the same order per pair of blocks ([A even, B even, A odd, B odd]), so one vpdpbusd gives 16 int32
// sums: lanes 0-3 and 8-11 are A's, 4-7 and 12-15 B's. Those are converted once and multiplied by a
// vector holding s·d for each lane's block. K must be a multiple of 32 (an odd count of blocks ends
// with a B of zeros) and groups a multiple of 32 or one over all of K.
//
// Threads split N as in quant_linear.cpp (row_blocks.h), with its prefetch of the next block of rows' cache lines.
//
// Scales and offsets come as fp32 or, in quant_linear_q8_f16 (kernels/int8_activations.py), as fp16 where
// every value is exactly an fp16 (GGUF stores them so): one step streams the codes and their factors
// from memory, and at 32 codes a group fp32 factors are a third of the bytes (16 bytes of codes, 8 of
// factors), fp16 ones a fifth, as in the GGUF file. A core streams memory at about 7 GB/s here, so
// bytes are time: the demo model's 4-bit layers read 80 MB a token with fp32 factors, 66 MB with fp16.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "row_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QUANT_LINEAR_Q8 1
#else
#define QUANT_LINEAR_Q8 0
#endif

namespace {

bool shape_ok(int64_t bits, int64_t group_size, int64_t k) {
    return bits == 4 && k > 0 && k % 32 == 0 && group_size > 0 && (group_size % 32 == 0 || group_size >= k);
}

#if QUANT_LINEAR_Q8
// The factors' storage: fp32, or fp16 (uint16_t bits) widened as they are read.
inline float factor(const float* p, int64_t i) { return p[i]; }
inline float factor(const uint16_t* p, int64_t i) { return _cvtsh_ss(p[i]); }

// Two adjacent factors p[i], p[i + 1] in lanes 0 and 1.
inline __m128 two_factors(const float* p, int64_t i) {
    return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p + i)));
}
inline __m128 two_factors(const uint16_t* p, int64_t i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
}

// Up to 16 factors from p, the rest of the lanes zero.
inline __m512 load_factors(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load_factors(const uint16_t* p, __mmask16 mask) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

template <typename F>
struct Args {
    const int8_t* xq;    // [M, pairs * 64]: each pair of blocks as [A even, B even, A odd, B odd]
    const float* xd;     // [M, pairs * 16]: x's block scale for each int32 lane of the pair
    const float* xsum;   // [M, groups]: sums of the rounded x per weight group (the offsets' factor)
    const uint8_t* codes;
    const F* scales;   // [N, groups], fp32 or fp16
    const F* offsets;  // [N, groups]
    const float* bias;
    float* y;  // [M, N]
    int64_t n, k, row_bytes, gs, groups, pairs;
};

// sum_g a[g] b[g], 16 lanes at a time.
template <typename F>
float dot(const F* a, const float* b, int64_t count) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < count; g += 16) {
        const __mmask16 mask = count - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - g)) - 1);
        acc = _mm512_fmadd_ps(load_factors(a + g, mask), _mm512_maskz_loadu_ps(mask, b + g), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

// Output rows [n0, n1) for M rows of x starting at row m0, RN W rows at a time.
template <int M, int RN, bool GS32, typename F>
void rows(const Args<F>& a, int64_t m0, int64_t n0, int64_t n1) {
    const int64_t kp = a.pairs * 64;
    const int8_t* xq = a.xq + m0 * kp;
    const float* xd = a.xd + m0 * a.pairs * 16;
    const float* xsum = a.xsum + m0 * a.groups;
    float* y = a.y + m0 * a.n;
    const int64_t whole = a.row_bytes / 32;  // pairs whose 32 bytes lie inside the row
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);  // the high half's nibbles: >> 4
    const __m512i pair_lanes = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int64_t j = n0; j < n1; j += RN) {
        const int rn = static_cast<int>(std::min<int64_t>(RN, n1 - j));
        const bool ahead = j + 2 * RN <= a.n;  // a next block to prefetch
        const uint8_t* base[RN];
        const F* scales[RN];
        uint8_t tail[RN][32] = {};  // a last pair with block A only: B's bytes zero
        for (int r = 0; r < RN; ++r) {
            const int64_t row = j + std::min(r, rn - 1);  // a short block recomputes its last row
            base[r] = a.codes + row * a.row_bytes;
            scales[r] = a.scales + row * a.groups;
            if (whole < a.pairs) std::memcpy(tail[r], base[r] + whole * 32, a.row_bytes - whole * 32);
        }
        __m512 acc[RN][M];
        for (int r = 0; r < RN; ++r)
            for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
        for (int64_t p = 0; p < a.pairs; ++p) {
            const int64_t byte = p * 32;
            if (ahead && byte % 64 == 0) {  // a new cache line: the next block's line now
                for (int r = 0; r < RN; ++r) __builtin_prefetch(base[r] + byte + RN * a.row_bytes);
            }
            __m512i x[M];
            __m512 d[M];
            for (int m = 0; m < M; ++m) {
                x[m] = _mm512_loadu_si512(xq + m * kp + p * 64);
                d[m] = _mm512_loadu_ps(xd + (m * a.pairs + p) * 16);
            }
            const int64_t ga = (p * 64) / a.gs, gb = std::min(a.groups - 1, (p * 64 + 32) / a.gs);
            for (int r = 0; r < RN; ++r) {
                const uint8_t* src = p < whole ? base[r] + byte : tail[r];
                // The 32 bytes in both halves, the high half shifted by 4: [A low | B low | A high | B high].
                const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
                const __m512i w = _mm512_and_si512(_mm512_srlv_epi64(raw, shifts), low);
                __m512 s;
                if (GS32) {  // the two blocks' scales are adjacent: one 8-byte load, spread to their lanes
                    s = _mm512_permutexvar_ps(pair_lanes, _mm512_castps128_ps512(two_factors(scales[r], ga)));
                } else {
                    s = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(factor(scales[r], ga)),
                                             _mm512_set1_ps(factor(scales[r], gb)));
                }
                for (int m = 0; m < M; ++m) {
                    const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x[m]);
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(s, d[m]), acc[r][m]);
                }
            }
        }
        for (int r = 0; r < rn; ++r) {
            const F* offsets = a.offsets + (j + r) * a.groups;
            const float b = a.bias ? a.bias[j + r] : 0.f;
            for (int m = 0; m < M; ++m) {
                y[m * a.n + j + r] = _mm512_reduce_add_ps(acc[r][m]) + dot(offsets, xsum + m * a.groups, a.groups) + b;
            }
        }
    }
}

template <int M, typename F>
void rows_of(const Args<F>& a, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int RN = M == 1 ? 4 : M == 2 ? 3 : M <= 4 ? 2 : 1;  // RN * M accumulators + 2 M x vectors
    if (a.gs == 32 && a.groups % 2 == 0) rows<M, RN, true>(a, m0, n0, n1);  // GGUF's Q4_0/Q4_1 blocks
    else rows<M, RN, false>(a, m0, n0, n1);
}

struct Rows {
    template <int M, typename F>
    static void run(const Args<F>& a, int64_t m0, int64_t n0, int64_t n1) {
        rows_of<M>(a, m0, n0, n1);
    }
};
#endif

}  // namespace

extern "C" int quant_linear_q8_supported(int64_t bits, int64_t group_size, int64_t k) {
    return QUANT_LINEAR_Q8 && shape_ok(bits, group_size, k);
}

// x [m, k] → x's int8 codes in the kernel's order, xq [m, pairs * 64], and the block scales d [m, k / 32]
// (exported so tests can check the quantization the kernel uses, against float64 math).
extern "C" void quant_linear_q8_quantize(const float* x, int8_t* xq, float* d, int64_t m, int64_t k) {
    const int64_t blocks = k / 32, pairs = (blocks + 1) / 2;
    std::memset(xq, 0, m * pairs * 64);
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
            const float* src = x + r * k + b * 32;
            float amax = 0.f;
            for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(src[i]));
            const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
            d[r * blocks + b] = scale;
            int8_t* dst = xq + r * pairs * 64 + (b / 2) * 64 + (b % 2) * 16;
            for (int i = 0; i < 16; ++i) {
                dst[i] = static_cast<int8_t>(std::nearbyint(src[2 * i] * inverse));           // even k
                dst[32 + i] = static_cast<int8_t>(std::nearbyint(src[2 * i + 1] * inverse));  // odd k
            }
        }
    }
}

#if QUANT_LINEAR_Q8
namespace {
// x [m, k] quantized (quant_linear_q8_quantize) with the per-lane scales and group sums the kernel
// takes, then the kernel over W's rows.
template <typename F>
void linear(const float* x, const uint8_t* codes, const F* scales, const F* offsets, const float* bias, float* y,
            int64_t m, int64_t n, int64_t k, int64_t group_size) {
    const int64_t groups = (k + group_size - 1) / group_size, blocks = k / 32, pairs = (blocks + 1) / 2;
    std::vector<int8_t> xq(m * pairs * 64);
    std::vector<float> d(m * blocks), xd(m * pairs * 16, 0.f), xsum(m * groups, 0.f);
    quant_linear_q8_quantize(x, xq.data(), d.data(), m, k);
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {  // lanes 0-3, 8-11: block A; 4-7, 12-15: block B
            float* lanes = xd.data() + (r * pairs + b / 2) * 16 + (b % 2) * 4;
            for (int i = 0; i < 4; ++i) lanes[i] = lanes[8 + i] = d[r * blocks + b];
        }
        for (int64_t b = 0; b < blocks; ++b) {  // a block lies in one group: gs is a multiple of 32 or all of K
            const int8_t* codes_b = xq.data() + r * pairs * 64 + (b / 2) * 64 + (b % 2) * 16;
            int32_t sum = 0;
            for (int i = 0; i < 16; ++i) sum += codes_b[i] + codes_b[32 + i];
            xsum[r * groups + b * 32 / group_size] += d[r * blocks + b] * static_cast<float>(sum);
        }
    }
    const Args<F> args{xq.data(), xd.data(), xsum.data(), codes,  scales, offsets, bias,
                       y,         n,         k,           k / 2, group_size, groups,  pairs};
    run_row_blocks<Rows>(args, m);
}
}  // namespace
#endif

namespace {
// Both entries: the shape check, then the kernel where it was built (scales and offsets as F).
template <typename F>
int checked_linear(const float* x, const uint8_t* codes, const F* scales, const F* offsets, const float* bias,
                   float* y, int64_t m, int64_t n, int64_t k, int64_t bits, int64_t group_size) {
    if (m < 1 || n < 1 || !quant_linear_q8_supported(bits, group_size, k)) return 1;
#if QUANT_LINEAR_Q8
    linear(x, codes, scales, offsets, bias, y, m, n, k, group_size);
    return 0;
#else
    (void)x, (void)codes, (void)scales, (void)offsets, (void)bias, (void)y;
    return 1;
#endif
}
}  // namespace

// x [m, k], codes uint8 [n, k / 2], scales/offsets [n, ceil(k / gs)], bias [n] or null, y [m, n]; all
// contiguous. Returns nonzero for a shape it does not take (or without AVX-512 VNNI).
extern "C" int quant_linear_q8_f32(const float* x, const uint8_t* codes, const float* scales, const float* offsets,
                                   const float* bias, float* y, int64_t m, int64_t n, int64_t k, int64_t bits,
                                   int64_t group_size) {
    return checked_linear(x, codes, scales, offsets, bias, y, m, n, k, bits, group_size);
}

// The same with scales and offsets stored as fp16 (their bits as uint16).
extern "C" int quant_linear_q8_f16(const float* x, const uint8_t* codes, const uint16_t* scales,
                                   const uint16_t* offsets, const float* bias, float* y, int64_t m, int64_t n,
                                   int64_t k, int64_t bits, int64_t group_size) {
    return checked_linear(x, codes, scales, offsets, bias, y, m, n, k, bits, group_size);
}
