// y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias) for a few rows of x, W 8-bit codes in the panel layout
// (kernels/panels.py: codes [N/32][K][32], scales and offsets [N/32][G][32]): the LM head of a GGUF
// model whose tied embedding is Q8_0, the largest matrix a decode step of a small model reads.
//
// panel_linear.cpp's code tiles dequantize each code (code * scale + offset, one FMA) before the
// FMA into each row, which at one row is 3 vector ops per 8 weights besides the load and widening.
// Here the scale and offset leave the inner loop: per group, sum(x * w) = scale * sum(x * code) +
// offset * sum(x), so the loop is widen, convert, one FMA per row; the group's sum(x) is taken
// once per call. The rounding differs from dequantize-then-multiply (products and sums of fp32,
// each rounded once) by about as much as another summation order does.
//
// A decode step of one stream is bound by the bytes it reads, and fp32 scales and offsets are a
// fifth of a Q8_0 head's: the binding passes fp16 copies where every value survives the round trip
// (GGUF's scales are fp16), and no offsets where each is -128 * its scale (Q8_0: codes q + 128).
// The codes are prefetched 4 KiB ahead: the hardware prefetcher alone kept too few lines in flight.
// Measured on the demo model's Q8_0 head (49152 x 576, out of cache), against panel_linear.cpp's
// tiles, median of interleaved pairs: 1 thread 0.54x at 1 row, 0.52x at 2, 0.51x at 4, 0.84x at 8,
// 1.0x at 16; 2 threads 0.53x at 1 row (0.97 -> 0.55 ms), 0.81x at 8.
//
// Rows go 4 at a time over each panel (their accumulators in registers; later passes read the
// panel from L1). Threads split the panels (torch's OpenMP runtime, as in the other kernels).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dequant_row.h"
#include "parallel_threshold.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Vectors of 16 lanes with AVX-512 (a panel line is 2 of them), else 8 (vec8.h).
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
constexpr int kLanes = 16;

inline vf codes_to_f32(const uint8_t* p) {
    return reinterpret_cast<vf>(
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}

inline vf load_factors(const float* p) { return reinterpret_cast<vf>(_mm512_loadu_ps(p)); }

inline vf load_factors(const uint16_t* p) {
    return reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

inline void store_vf(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
#else
typedef vf vf;
constexpr int kLanes = 8;

inline vf codes_to_f32(const uint8_t* p) { return to_f32(widen(p)); }

inline vf load_factors(const float* p) { return load8(p); }

inline vf load_factors(const uint16_t* p) {
#if defined(__F16C__)
    return reinterpret_cast<vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    vf out;
    for (int i = 0; i < 8; ++i) {  // normal and zero fp16 values only: the binding checks the round trip
        const uint32_t h = p[i], sign = (h & 0x8000u) << 16, magnitude = h & 0x7fffu;
        const uint32_t bits = magnitude ? sign | ((magnitude << 13) + (112u << 23)) : sign;
        std::memcpy(&out[i], &bits, sizeof(float));
    }
    return out;
#endif
}

inline void store_vf(float* p, vf v) { store8(p, v); }
#endif

constexpr int64_t kPanel = 32;                      // output columns per panel (panels.PANEL)
constexpr int kVectors = kPanel / kLanes;           // vectors per panel line
constexpr int64_t kPrefetchBytes = 4096;            // codes fetched this far ahead
constexpr int64_t kPrefetchGroups = 4;              // scales fetched this many groups ahead
constexpr int64_t kRowsPerPass = 4;                 // rows of x per pass over a panel (accumulators in registers)
constexpr int64_t kMaxRows = 8;                     // measured: from 8-12 rows, panel_linear.cpp's tiles are as fast

// One panel's 32 outputs for MR rows of x (rows ldx apart), y rows ldy apart. With one row the
// even and odd k accumulate apart, so 8 FMA chains hide the FMA latency.
// Offsets null: each is -128 * its scale.
template <int MR, typename Factor>
void panel_rows(const float* x, int64_t ldx, const float* xsums, int64_t groups, const uint8_t* codes,
                const Factor* scales, const Factor* offsets, int64_t k, int64_t gs, const float* bias, float* y,
                int64_t ldy) {
    constexpr int kSets = MR == 1 ? 2 : 1;
    vf acc[MR][kVectors] = {};
    for (int64_t g = 0, c0 = 0; c0 < k; ++g, c0 += gs) {
        const int64_t c1 = std::min(k, c0 + gs);
        __builtin_prefetch(scales + (g + kPrefetchGroups) * kPanel);  // the next panel's, near the end
        vf part[kSets][MR][kVectors] = {};
        int64_t c = c0;
        for (; c + kSets <= c1; c += kSets) {
            // One stream of codes, read at about 1 byte a cycle: the hardware prefetcher keeps too
            // few lines in flight for it, so fetch kPrefetchBytes ahead (past a panel's end: the next).
            if (c % 2 == 0) __builtin_prefetch(codes + c * kPanel + kPrefetchBytes);
            for (int s = 0; s < kSets; ++s) {
                vf w[kVectors];
                for (int j = 0; j < kVectors; ++j) w[j] = codes_to_f32(codes + (c + s) * kPanel + kLanes * j);
                for (int m = 0; m < MR; ++m) {
                    const vf xv = vf{} + x[m * ldx + c + s];
                    for (int j = 0; j < kVectors; ++j) part[s][m][j] += xv * w[j];
                }
            }
        }
        for (; c < c1; ++c) {  // an odd group's last k
            for (int j = 0; j < kVectors; ++j) {
                const vf w = codes_to_f32(codes + c * kPanel + kLanes * j);
                for (int m = 0; m < MR; ++m) part[0][m][j] += (vf{} + x[m * ldx + c]) * w;
            }
        }
        for (int j = 0; j < kVectors; ++j) {
            const vf scale = load_factors(scales + g * kPanel + kLanes * j);
            const vf offset = offsets ? load_factors(offsets + g * kPanel + kLanes * j) : vf{};
            for (int m = 0; m < MR; ++m) {
                vf sum = part[0][m][j];
                if constexpr (kSets == 2) sum += part[1][m][j];
                const float xsum = xsums[m * groups + g];
                acc[m][j] += offsets ? scale * sum + offset * xsum : scale * (sum - 128.f * xsum);
            }
        }
    }
    for (int m = 0; m < MR; ++m) {
        for (int j = 0; j < kVectors; ++j) store_vf(y + m * ldy + kLanes * j, bias ? acc[m][j] + load_factors(bias + kLanes * j) : acc[m][j]);
    }
}

template <typename Factor>
int run(const float* x, const uint8_t* codes, const Factor* scales, const Factor* offsets, const float* bias, float* y,
        int64_t m, int64_t n, int64_t k, int64_t group_size) {
    if (m < 1 || m > kMaxRows || n < 1 || k < 1 || group_size < 1 || n % kPanel) return 1;
    const int64_t panels = n / kPanel, groups = (k + group_size - 1) / group_size;
    std::vector<float> xsums(m * groups);  // sum(x) per row and group
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
            float sum = 0.f;
            for (int64_t c = g * group_size; c < std::min(k, (g + 1) * group_size); ++c) sum += x[r * k + c];
            xsums[r * groups + g] = sum;
        }
    }
#pragma omp parallel for schedule(static) if (n * k >= kMinParallelElements)
    for (int64_t p = 0; p < panels; ++p) {
        const uint8_t* pc = codes + p * k * kPanel;
        const Factor* ps = scales + p * groups * kPanel;
        const Factor* po = offsets ? offsets + p * groups * kPanel : nullptr;
        const float* b = bias ? bias + p * kPanel : nullptr;
        float* py = y + p * kPanel;
        for (int64_t m0 = 0; m0 < m; m0 += kRowsPerPass) {  // later passes read the panel from L1/L2
            const float* xs = x + m0 * k;
            const float* sums = xsums.data() + m0 * groups;
            float* ys = py + m0 * n;
            switch (std::min(kRowsPerPass, m - m0)) {
                case 1: panel_rows<1>(xs, k, sums, groups, pc, ps, po, k, group_size, b, ys, n); break;
                case 2: panel_rows<2>(xs, k, sums, groups, pc, ps, po, k, group_size, b, ys, n); break;
                case 3: panel_rows<3>(xs, k, sums, groups, pc, ps, po, k, group_size, b, ys, n); break;
                default: panel_rows<4>(xs, k, sums, groups, pc, ps, po, k, group_size, b, ys, n); break;
            }
        }
    }
    return 0;
}

}  // namespace

// x [m, k]; codes uint8 [n / 32, k, 32], scales and offsets [n / 32, ceil(k / group_size), 32] (fp32,
// or fp16 bits in the _f16 entry; offsets null: -128 * scale); bias [n] or null; y [m, n]. n a
// multiple of 32, m at most kMaxRows (bindings.MAX_FEW_PANEL_ROWS).
extern "C" int panel_codes_few_rows_f32(const float* x, const uint8_t* codes, const float* scales,
                                        const float* offsets, const float* bias, float* y, int64_t m, int64_t n,
                                        int64_t k, int64_t group_size) {
    return run(x, codes, scales, offsets, bias, y, m, n, k, group_size);
}

extern "C" int panel_codes_few_rows_f16(const float* x, const uint8_t* codes, const uint16_t* scales,
                                        const uint16_t* offsets, const float* bias, float* y, int64_t m, int64_t n,
                                        int64_t k, int64_t group_size) {
    return run(x, codes, scales, offsets, bias, y, m, n, k, group_size);
}
