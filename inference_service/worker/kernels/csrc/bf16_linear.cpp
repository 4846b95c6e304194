// y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias[N]) for a few rows of x, all bfloat16, fp32 accumulation,
// CPU: the decode-step shape of every projection of a bf16 model. Like small_batch_linear.cpp it is
// bound by reading W, and bf16 halves the bytes read per token. torch's bf16 GEMV on CPU is slow at
// these shapes (measured on an AVX512-BF16 EPYC, 2 threads: 2.8 ms for a 1536x576 projection of one
// row, against 73 us in fp32), so a bf16 model's decode steps come here.
//
// With AVX512-BF16 (`vdpbf16ps`, compiled in where -march=native has it) each instruction multiplies
// 32 bf16 pairs and adds them into 16 fp32 lanes; elsewhere a portable path widens bf16 to fp32
// (exact: a bf16 is an fp32 with its low 16 bits zero) and uses fp32 FMAs over 8 lanes. Either way
// the products are exact and the sums fp32, rounded to bf16 (nearest, ties to even) once at the end,
// as torch's bf16 matmul does.
//
// All arrays contiguous; K a multiple of 8. Threads split N (torch's OpenMP runtime).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "parallel_threshold.h"

// BF16_PORTABLE forces the portable path (its tests build it so on CPUs with the dot product too).
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(BF16_PORTABLE)
#include <immintrin.h>
#define BF16_DOT 1
#else
#include "vec8.h"
#define BF16_DOT 0
#endif

namespace {

constexpr int64_t kRowsPerTask = 32;               // W rows per scheduling unit
// kAheadRows: the blocked paths read R rows side by side, R short streams the hardware prefetcher hardly
// follows, so each line of them also prefetches the same line of the next R rows. Measured on this Xeon,
// one thread, 30 layers of 576x576, 1536x576, 576x1536 bf16 weights: 2 rows 14.0 -> 9.3 ms, 4 rows
// 21.0 -> 12.1, 8 rows 30.7 -> 16.9, 16 rows 44.9 -> 31.3 (two or four groups ahead: no better);
// the portable path 1 row 20.7 -> 10.8, 2 rows 24.3 -> 13.4.

inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
    return static_cast<uint16_t>(bits >> 16);
}

#if BF16_DOT

constexpr int64_t kLanes = 32;  // bf16 values per 512-bit load
// How far ahead of its reads the one-row path prefetches W (measured on the head: 512 B and 4 KiB
// slower than 2 KiB).
constexpr int64_t kPrefetchBytes = 2048;

inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// Output rows [n0, n1), RN weight rows at a time: RN * M accumulators stay in (32) registers.
template <int M, int RN>
void rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t n0, int64_t n1,
          int64_t n, int64_t k) {
    const int64_t full = k / kLanes * kLanes;
    const __mmask32 tail = static_cast<__mmask32>((1ull << (k - full)) - 1);
    int64_t j = n0;
    auto block = [&](auto rn_tag) {
        constexpr int R = decltype(rn_tag)::value;
        __m512 acc[R][M];
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
        for (int64_t c = 0; c < k; c += kLanes) {
            const __mmask32 mask = c < full ? static_cast<__mmask32>(~0u) : tail;
            __m512bh xs[M];
            for (int m = 0; m < M; ++m) xs[m] = load_bf16(x + m * k + c, mask);
            if (j + 2 * R <= n) {  // the next R rows' line now (kAheadRows)
                for (int r = 0; r < R; ++r) __builtin_prefetch(w + (j + R + r) * k + c);
            }
            for (int r = 0; r < R; ++r) {
                const __m512bh wv = load_bf16(w + (j + r) * k + c, mask);
                for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xs[m]);
            }
        }
        for (int r = 0; r < R; ++r) {
            const float b = bias ? bf16_to_float(bias[j + r]) : 0.f;
            for (int m = 0; m < M; ++m) y[m * n + j + r] = float_to_bf16(_mm512_reduce_add_ps(acc[r][m]) + b);
        }
    };
    for (; j + RN <= n1; j += RN) block(std::integral_constant<int, RN>{});
    for (; j < n1; ++j) block(std::integral_constant<int, 1>{});
}

// One row of x (a decode step of one stream): W's rows one after another, each with 4 accumulators,
// so W is read as one sequential stream, prefetched kPrefetchBytes ahead. The blocked path above reads
// RN rows side by side: RN short streams (a 576-wide row is 18 cache lines) that the hardware
// prefetcher never ramps up on. Measured on this EPYC, one thread, W from memory: the head (49152 x
// 576) and gate|up (3072 x 576) at ~17 GB/s instead of ~8.
void rows_seq(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t n0, int64_t n1,
              int64_t k) {
    const int64_t full = k / kLanes * kLanes;
    const __mmask32 tail = static_cast<__mmask32>((1ull << (k - full)) - 1);
    for (int64_t j = n0; j < n1; ++j) {
        const uint16_t* row = w + j * k;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        int64_t c = 0;
        for (; c + 4 * kLanes <= full; c += 4 * kLanes) {  // 4 cache lines
            const char* ahead = reinterpret_cast<const char*>(row + c) + kPrefetchBytes;
            for (int i = 0; i < 4; ++i) __builtin_prefetch(ahead + 64 * i);  // past W's end: harmless
            for (int i = 0; i < 4; ++i) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + c + i * kLanes);
                acc[i] = _mm512_dpbf16_ps(acc[i], wv, (__m512bh)_mm512_loadu_si512(x + c + i * kLanes));
            }
        }
        for (; c < k; c += kLanes) {
            const __mmask32 mask = c < full ? static_cast<__mmask32>(~0u) : tail;
            __builtin_prefetch(reinterpret_cast<const char*>(row + c) + kPrefetchBytes);
            acc[0] = _mm512_dpbf16_ps(acc[0], load_bf16(row + c, mask), load_bf16(x + c, mask));
        }
        const float b = bias ? bf16_to_float(bias[j]) : 0.f;
        y[j] = float_to_bf16(_mm512_reduce_add_ps((acc[0] + acc[1]) + (acc[2] + acc[3])) + b);
    }
}

template <int M>
void rows_of(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t n0, int64_t n1,
             int64_t n, int64_t k) {
    if constexpr (M == 1) {
        rows_seq(x, w, bias, y, n0, n1, k);
        return;
    }
    constexpr int RN = M <= 2 ? 8 : M <= 4 ? 5 : M <= 6 ? 3 : 2;  // RN * M + M + 1 <= 32 registers
    rows<M, RN>(x, w, bias, y, n0, n1, n, k);
}

#else  // portable: widen to fp32, 8 lanes

inline v8 load_bf16x8(const uint16_t* p) {
    typedef uint16_t u16x8 __attribute__((vector_size(16)));
    typedef uint32_t u32x8 __attribute__((vector_size(32)));
    u16x8 half;
    std::memcpy(&half, p, sizeof(half));
    const u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
    v8 f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

template <int M>
void rows_of(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t n0, int64_t n1,
             int64_t n, int64_t k) {
    constexpr int RN = M == 1 ? 4 : M == 2 ? 2 : 1;  // RN * M + M + 1 vector registers (16 with AVX2)
    int64_t j = n0;
    auto block = [&](auto rn_tag) {
        constexpr int R = decltype(rn_tag)::value;
        v8 acc[R][M] = {};
        for (int64_t c = 0; c < k; c += 8) {
            v8 xs[M];
            for (int m = 0; m < M; ++m) xs[m] = load_bf16x8(x + m * k + c);
            if (c % 32 == 0 && j + 2 * R <= n) {  // the next R rows' line now, once per line (kAheadRows)
                for (int r = 0; r < R; ++r) __builtin_prefetch(w + (j + R + r) * k + c);
            }
            for (int r = 0; r < R; ++r) {
                const v8 wv = load_bf16x8(w + (j + r) * k + c);
                for (int m = 0; m < M; ++m) acc[r][m] += wv * xs[m];
            }
        }
        for (int r = 0; r < R; ++r) {
            const float b = bias ? bf16_to_float(bias[j + r]) : 0.f;
            for (int m = 0; m < M; ++m) y[m * n + j + r] = float_to_bf16(hsum(acc[r][m]) + b);
        }
    };
    for (; j + RN <= n1; j += RN) block(std::integral_constant<int, RN>{});
    for (; j < n1; ++j) block(std::integral_constant<int, 1>{});
}

#endif

// Input rows go 8 at a time over each task's W rows; the task's W slice stays in L2 between them.
void run(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t m, int64_t n,
         int64_t k) {
    const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
#pragma omp parallel for schedule(static) if (n * k >= kMinParallelElements)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t n0 = t * kRowsPerTask, n1 = std::min(n, n0 + kRowsPerTask);
        for (int64_t m0 = 0; m0 < m; m0 += 8) {
            const uint16_t* xs = x + m0 * k;
            uint16_t* ys = y + m0 * n;
            switch (std::min<int64_t>(8, m - m0)) {
                case 1: rows_of<1>(xs, w, bias, ys, n0, n1, n, k); break;
                case 2: rows_of<2>(xs, w, bias, ys, n0, n1, n, k); break;
                case 3: rows_of<3>(xs, w, bias, ys, n0, n1, n, k); break;
                case 4: rows_of<4>(xs, w, bias, ys, n0, n1, n, k); break;
                case 5: rows_of<5>(xs, w, bias, ys, n0, n1, n, k); break;
                case 6: rows_of<6>(xs, w, bias, ys, n0, n1, n, k); break;
                case 7: rows_of<7>(xs, w, bias, ys, n0, n1, n, k); break;
                default: rows_of<8>(xs, w, bias, ys, n0, n1, n, k); break;
            }
        }
    }
}

}  // namespace

// 1 where the build has the AVX512-BF16 dot product, 0 for the portable path (for the startup log).
extern "C" int bf16_linear_uses_dot_product() { return BF16_DOT; }

extern "C" int small_batch_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                                       int64_t m, int64_t n, int64_t k) {
    if (k % 8 != 0 || m < 1) return 1;
    run(x, w, bias, y, m, n, k);
    return 0;
}
