// y[M, N] = x[M, K] · dequant(W)ᵀ (+ bias[N]) over the canonical packed layout (kernels/packed.py):
// w[n, k] = scales[n, k / gs] * code[n, k] + offsets[n, k / gs], codes uint8, 4-bit ones two per
// byte (even k low nibble, odd k high nibble). Decode is bound by reading W: 4-bit codes are 1/8
// of fp32's bytes, 8-bit ones 1/4, so this streams the codes once, widening a chunk of them to fp32
// in registers (w = code * scale + offset, one FMA shared by all rows of x) and FMAs it into up to
// 8 rows' accumulators, several W rows per pass as small_batch_linear.cpp does.
//
// No repack of W: the nibble order is absorbed by permuting x once per call instead. For 4-bit a
// chunk of CH codes is CH/2 bytes; their low nibbles are the even k and the high ones the odd k, so
// x is copied to xp with each CH-block reordered as [even k..., odd k...] (the dot product does not
// care about order). K is padded to a whole chunk with zero x; the last partial chunk of a row is
// read through a zeroed buffer so no load passes the end of the codes.
//
// Chunks never straddle groups: gs % CH == 0, or one group covers all of K. 4-bit uses CH = 16
// (8 bytes → two vectors, fewer conversions per weight) where gs allows, else CH = 8.
// Threads split N (torch's OpenMP runtime, as in the other kernels; row_blocks.h).
//
// Rows of packed codes are short (a 576-wide 4-bit row is 288 bytes, under 5 cache lines) and RN
// of them are read side by side, which the hardware prefetcher does not follow well: codes came
// from memory at about 6 GB/s per core. So each new cache line of a row also prefetches the same
// line of the next block of RN rows (measured on the demo model's decode step: 13.6 → 11.4 ms).
//
// With AVX-512, 4-bit codes in groups of a multiple of 32 (GGUF's Q4_0/Q4_1 blocks, GPTQ/AWQ's 32
// and 128) take a 16-lane path with the scale and offset factored out of the group's sum:
// sum_k (s q_k + o) x_k = s sum_k q_k x_k + o sum_k x_k. A chunk is 32 codes, one 16-byte load that
// widens to one vector of 16 bytes, whose low nibbles are the 16 even k and high nibbles the odd k;
// the codes go into the group's accumulator as they are (convert, FMA with x), the scale multiplies
// it once per group and the offset multiplies the group's sum of x (computed once per call, shared
// by every W row). Per 32 codes that is 7 vector ops instead of 22: the 8-lane path computes
// code * scale + offset for every weight, which made the kernel compute-bound at ~9 GB/s per core,
// under what one core streams.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dequant_row.h"
#include "row_blocks.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "vec8.h"

namespace {

// CH codes of one row starting at chunk byte p, as CH/8 fp32 vectors in xp's order.
template <int BITS, int CH>
struct Chunk {
    static constexpr int kVectors = CH / 8;
    static constexpr int kBytes = BITS == 8 ? CH : CH / 2;
    static void load(const uint8_t* p, v8 (&out)[kVectors]) {
        if constexpr (BITS == 8) {
            out[0] = to_f32(widen(p));
        } else if constexpr (CH == 16) {  // 8 bytes: low nibbles = even k, high = odd k
            const i32x8 b = widen(p);
            out[0] = to_f32(b & 15);
            out[1] = to_f32(b >> 4);
        } else {  // CH == 8: 4 bytes, repeated so one vector holds [low nibbles, high nibbles]
            uint8_t twice[8];
            std::memcpy(twice, p, 4);
            std::memcpy(twice + 4, p, 4);
            const i32x8 shift = {0, 0, 0, 0, 4, 4, 4, 4};
            out[0] = to_f32((widen(twice) >> shift) & 15);
        }
    }
};

struct Args {
    const float* xp;  // [M, kp] permuted, zero-padded
    const uint8_t* codes;
    const float* scales;
    const float* offsets;
    const float* bias;
    float* y;  // [M, N]
    int64_t n, k, kp, row_bytes, gs, groups;
};

// Output rows [n0, n1) for M rows of xp (and y) starting at row m0, RN W rows at a time.
template <int BITS, int CH, int M, int RN>
void rows(const Args& a, int64_t m0, int64_t n0, int64_t n1) {
    using C = Chunk<BITS, CH>;
    constexpr int V = C::kVectors;
    const float* xp = a.xp + m0 * a.kp;
    float* y = a.y + m0 * a.n;
    const int64_t full = a.k - a.k % CH;  // chunks below this are whole
    for (int64_t j = n0; j < n1; j += RN) {
        const int rn = static_cast<int>(std::min<int64_t>(RN, n1 - j));
        const bool ahead = j + 2 * RN <= a.n;  // a next block to prefetch
        v8 acc[RN][M] = {};
        for (int64_t g = 0; g < a.groups; ++g) {
            const int64_t c0 = g * a.gs, c1 = std::min(a.k, c0 + a.gs);
            v8 s[RN], o[RN];
            for (int r = 0; r < RN; ++r) {
                const int64_t row = j + std::min(r, rn - 1);  // a short block recomputes its last row
                s[r] = v8{} + a.scales[row * a.groups + g];
                o[r] = v8{} + a.offsets[row * a.groups + g];
            }
            auto step = [&](int64_t c, const uint8_t* const* ptrs) {
                for (int r = 0; r < RN; ++r) {
                    v8 w[V];
                    C::load(ptrs[r], w);
                    for (int v = 0; v < V; ++v) {
                        w[v] = w[v] * s[r] + o[r];
                        for (int m = 0; m < M; ++m) acc[r][m] += w[v] * load8(xp + m * a.kp + c + 8 * v);
                    }
                }
            };
            const uint8_t* base[RN];
            for (int r = 0; r < RN; ++r) base[r] = a.codes + (j + std::min(r, rn - 1)) * a.row_bytes;
            const int64_t stop = std::min(c1, full);
            int64_t c = c0;
            for (; c < stop; c += CH) {
                const uint8_t* ptrs[RN];
                const int64_t byte = BITS == 8 ? c : c / 2;
                for (int r = 0; r < RN; ++r) ptrs[r] = base[r] + byte;
                if (ahead && byte % 64 < C::kBytes) {  // a new cache line: the next block's line now
                    for (int r = 0; r < RN; ++r) __builtin_prefetch(ptrs[r] + RN * a.row_bytes);
                }
                step(c, ptrs);
            }
            if (c < c1) {  // the row's last, partial chunk: through a zeroed copy
                uint8_t tail[RN][16] = {};
                const uint8_t* ptrs[RN];
                const int64_t offset = BITS == 8 ? c : c / 2;
                for (int r = 0; r < RN; ++r) {
                    std::memcpy(tail[r], base[r] + offset, a.row_bytes - offset);
                    ptrs[r] = tail[r];
                }
                step(c, ptrs);
            }
        }
        for (int r = 0; r < rn; ++r) {
            const float b = a.bias ? a.bias[j + r] : 0.f;
            for (int m = 0; m < M; ++m) y[m * a.n + j + r] = hsum(acc[r][m]) + b;
        }
    }
}

template <int BITS, int CH, int M>
void rows_of(const Args& a, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int RN = M == 1 ? 4 : M <= 3 ? 2 : 1;  // RN * M accumulators + scales, offsets in registers
    rows<BITS, CH, M, RN>(a, m0, n0, n1);
}

template <int BITS, int CH>
struct FloatRows {
    template <int M>
    static void run(const Args& a, int64_t m0, int64_t n0, int64_t n1) {
        rows_of<BITS, CH, M>(a, m0, n0, n1);
    }
};

template <int BITS, int CH>
void run(const Args& a, int64_t m) {
    run_row_blocks<FloatRows<BITS, CH>>(a, m);
}

#if defined(__AVX512F__)
// The 16-lane path (see the top): 4-bit codes, groups a multiple of 32 or one group over all of K.
struct Args512 {
    const float* xp;    // [M, kp] permuted in blocks of 32, zero-padded
    const float* xsum;  // [M, groups]: each group's sum of x
    const uint8_t* codes;
    const float* scales;
    const float* offsets;
    const float* bias;
    float* y;  // [M, N]
    int64_t n, k, kp, row_bytes, gs, groups;
};

template <int M, int RN>
void rows512(const Args512& a, int64_t m0, int64_t n0, int64_t n1) {
    const float* xp = a.xp + m0 * a.kp;
    const float* xsum = a.xsum + m0 * a.groups;
    float* y = a.y + m0 * a.n;
    const int64_t full = a.k - a.k % 32;  // chunks below this are whole
    const __m512i low = _mm512_set1_epi32(15);
    for (int64_t j = n0; j < n1; j += RN) {
        const int rn = static_cast<int>(std::min<int64_t>(RN, n1 - j));
        const bool ahead = j + 2 * RN <= a.n;  // a next block to prefetch
        const uint8_t* base[RN];
        const float* scales[RN];
        uint8_t tail[RN][16] = {};  // the row's last, partial chunk, zero-padded
        for (int r = 0; r < RN; ++r) {
            const int64_t row = j + std::min(r, rn - 1);  // a short block recomputes its last row
            base[r] = a.codes + row * a.row_bytes;
            scales[r] = a.scales + row * a.groups;
            if (full < a.k) std::memcpy(tail[r], base[r] + full / 2, a.row_bytes - full / 2);
        }
        __m512 total[RN][M];
        for (int r = 0; r < RN; ++r)
            for (int m = 0; m < M; ++m) total[r][m] = _mm512_setzero_ps();
        for (int64_t g = 0; g < a.groups; ++g) {
            const int64_t c0 = g * a.gs, c1 = std::min(a.k, c0 + a.gs);
            __m512 acc[RN][M];
            for (int r = 0; r < RN; ++r)
                for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
            for (int64_t c = c0; c < c1; c += 32) {
                const int64_t byte = c / 2;
                if (ahead && byte % 64 == 0) {  // a new cache line: the next block's line now
                    for (int r = 0; r < RN; ++r) __builtin_prefetch(base[r] + byte + RN * a.row_bytes);
                }
                __m512 x0[M], x1[M];
                for (int m = 0; m < M; ++m) {
                    x0[m] = _mm512_loadu_ps(xp + m * a.kp + c);
                    x1[m] = _mm512_loadu_ps(xp + m * a.kp + c + 16);
                }
                for (int r = 0; r < RN; ++r) {
                    const uint8_t* p = c < full ? base[r] + byte : tail[r];
                    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
                    const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(b, low));
                    const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
                    for (int m = 0; m < M; ++m) {
                        acc[r][m] = _mm512_fmadd_ps(even, x0[m], acc[r][m]);
                        acc[r][m] = _mm512_fmadd_ps(odd, x1[m], acc[r][m]);
                    }
                }
            }
            for (int r = 0; r < RN; ++r) {
                const __m512 s = _mm512_set1_ps(scales[r][g]);
                for (int m = 0; m < M; ++m) total[r][m] = _mm512_fmadd_ps(s, acc[r][m], total[r][m]);
            }
        }
        for (int r = 0; r < rn; ++r) {
            const float* offsets = a.offsets + (j + r) * a.groups;
            const float b = a.bias ? a.bias[j + r] : 0.f;
            for (int m = 0; m < M; ++m) {
                float shift = 0.f;  // sum over groups of offset * sum of x
                for (int64_t g = 0; g < a.groups; ++g) shift += offsets[g] * xsum[m * a.groups + g];
                y[m * a.n + j + r] = _mm512_reduce_add_ps(total[r][m]) + shift + b;
            }
        }
    }
}

template <int M>
void rows512_of(const Args512& a, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int RN = M == 1 ? 4 : M == 2 ? 3 : M <= 4 ? 2 : 1;  // 2 * RN * M accumulators + 2 M x
    rows512<M, RN>(a, m0, n0, n1);
}

struct Rows512 {
    template <int M>
    static void run(const Args512& a, int64_t m0, int64_t n0, int64_t n1) {
        rows512_of<M>(a, m0, n0, n1);
    }
};

void run512(const Args512& a, int64_t m) { run_row_blocks<Rows512>(a, m); }
#define QUANT_LINEAR_512 1
#else
#define QUANT_LINEAR_512 0
#endif

// x [m, k] copied to [m, kp] with each block of ch reordered as [even k..., odd k...] for 4-bit codes
// (the order a chunk's nibbles widen to), zero-padded to kp.
std::vector<float> permuted(const float* x, int64_t m, int64_t k, int64_t kp, int64_t ch, int64_t bits) {
    std::vector<float> xp(m * kp, 0.f);
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t c = 0; c < kp; ++c) {
            int64_t src = c;
            if (bits == 4) {
                const int64_t block = c - c % ch, p = c % ch, half = ch / 2;
                src = block + (p < half ? 2 * p : 2 * (p - half) + 1);
            }
            if (src < k) xp[r * kp + c] = x[r * k + src];
        }
    }
    return xp;
}

// The chunk width for these codes, or 0 when a chunk would straddle groups (not supported).
int64_t chunk_for(int64_t bits, int64_t gs, int64_t k) {
    const bool one_group = gs >= k;
    if (bits == 4 && (one_group || gs % 16 == 0)) return 16;
    if ((bits == 4 || bits == 8) && (one_group || gs % 8 == 0)) return 8;
    return 0;
}

}  // namespace

extern "C" int quant_linear_supported(int64_t bits, int64_t group_size, int64_t k) {
    return group_size > 0 && k > 0 && chunk_for(bits, group_size, k) != 0;
}

// x [m, k], codes uint8 [n, k] (bits 8) or [n, ceil(k / 2)] (bits 4), scales/offsets [n, ceil(k / gs)],
// bias [n] or null, y [m, n]; all contiguous. Returns nonzero for a shape it does not take.
extern "C" int quant_linear_f32(const float* x, const uint8_t* codes, const float* scales, const float* offsets,
                                const float* bias, float* y, int64_t m, int64_t n, int64_t k, int64_t bits,
                                int64_t group_size) {
    if (m < 1 || !quant_linear_supported(bits, group_size, k)) return 1;
    const int64_t groups = (k + group_size - 1) / group_size, row_bytes = bits == 8 ? k : (k + 1) / 2;
#if QUANT_LINEAR_512
    if (bits == 4 && (group_size >= k || group_size % 32 == 0)) {
        const int64_t kp = (k + 31) / 32 * 32;
        const std::vector<float> xp = permuted(x, m, k, kp, 32, bits);
        std::vector<float> xsum(m * groups, 0.f);  // each group's sum of x: the offsets' factor
        for (int64_t r = 0; r < m; ++r)
            for (int64_t c = 0; c < k; ++c) xsum[r * groups + c / group_size] += x[r * k + c];
        run512({xp.data(), xsum.data(), codes, scales, offsets, bias, y, n, k, kp, row_bytes, group_size, groups}, m);
        return 0;
    }
#endif
    const int64_t ch = chunk_for(bits, group_size, k);
    const int64_t kp = (k + ch - 1) / ch * ch;
    const std::vector<float> xp = permuted(x, m, k, kp, ch, bits);  // x in the codes' order, zero-padded
    const Args a{xp.data(), codes, scales, offsets, bias, y, n, k, kp, row_bytes, group_size, groups};
    if (bits == 8) run<8, 8>(a, m);
    else if (ch == 16) run<4, 16>(a, m);
    else run<4, 8>(a, m);
    return 0;
}

// w [n, k] fp32 = dequant(codes, scales, offsets): what QuantLinear multiplies by torch's GEMM for
// many rows of x (prefill), a slice of output rows at a time. Same math as PackedWeight.dequantize
// (code * scale + offset), at memory speed instead of torch's several passes over [N, K] temporaries.
extern "C" int quant_dequantize_f32(const uint8_t* codes, const float* scales, const float* offsets, float* w,
                                    int64_t n, int64_t k, int64_t bits, int64_t group_size) {
    if ((bits != 4 && bits != 8) || group_size < 1 || k < 1) return 1;
    const int64_t groups = (k + group_size - 1) / group_size, row_bytes = bits == 8 ? k : (k + 1) / 2;
#pragma omp parallel for schedule(static) if (n * k >= kMinParallelElements)
    for (int64_t r = 0; r < n; ++r) {
        dequantize_row(codes + r * row_bytes, scales + r * groups, offsets + r * groups, w + r * k, k, bits, group_size);
    }
    return 0;
}
