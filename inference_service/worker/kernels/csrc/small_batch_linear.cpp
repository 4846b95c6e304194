// y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias[N]) for a few rows of x, fp32, CPU: the decode-step shape
// of every projection. It is bound by reading W, and torch's fp32 GEMV (MKL on this kind of CPU)
// streams W at about half the machine's bandwidth; this streams each W row once, computing up to
// 8 rows' dot products from it, with several W rows in flight to hide FMA latency. More rows of x
// go 8 at a time over the same L2-resident slice of W. The caller picks it for M <= 32, where it
// beats torch's GEMM (bindings.MAX_LINEAR_ROWS).
//
// All arrays contiguous; K a multiple of 8. Threads split N (torch's OpenMP runtime, as in
// paged_decode.cpp).

#include <algorithm>
#include <cstdint>

#include "parallel_threshold.h"
#include "vec8.h"

namespace {

constexpr int64_t kRowsPerTask = 32;                // W rows per scheduling unit (2 threads split 576 evenly)

// Output rows [n0, n1), RN weight rows at a time: RN * M accumulators stay in registers.
template <int M, int RN>
void rows(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1, int64_t n,
          int64_t k, bool prefetch) {
    int64_t j = n0;
    for (; j + RN <= n1; j += RN) {
        v8 acc[RN][M] = {};
        for (int64_t c = 0; c < k; c += 8) {
            if (prefetch && c % 16 == 0 && j + 2 * RN <= n) {  // the next RN rows' line now
                for (int r = 0; r < RN; ++r) __builtin_prefetch(w + (j + RN + r) * k + c);
            }
            for (int r = 0; r < RN; ++r) {
                const v8 wv = load8(w + (j + r) * k + c);
                for (int m = 0; m < M; ++m) acc[r][m] += wv * load8(x + m * k + c);
            }
        }
        for (int r = 0; r < RN; ++r) {
            const float b = bias ? bias[j + r] : 0.f;
            for (int m = 0; m < M; ++m) y[m * n + j + r] = hsum(acc[r][m]) + b;
        }
    }
    for (; j < n1; ++j) {
        v8 acc[M] = {};
        for (int64_t c = 0; c < k; c += 8) {
            const v8 wv = load8(w + j * k + c);
            for (int m = 0; m < M; ++m) acc[m] += wv * load8(x + m * k + c);
        }
        const float b = bias ? bias[j] : 0.f;
        for (int m = 0; m < M; ++m) y[m * n + j] = hsum(acc[m]) + b;
    }
}

// One row of x (a decode step of one stream): W's rows one after another with 4 accumulators, so W is
// read as one sequential stream, prefetched kPrefetchBytes ahead. RN rows side by side are RN short
// streams (a 576-wide row is 36 cache lines) that the hardware prefetcher hardly ramps up on; the
// same change made the bf16 kernel's one-row calls 2x faster (bf16_linear.cpp).
constexpr int64_t kPrefetchBytes = 6144;  // of 1, 2, 4, 6, 8, 12 KiB the least CPU time (2 KiB: 2-3% more)

void row_by_row(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1, int64_t k) {
    for (int64_t j = n0; j < n1; ++j) {
        const float* row = w + j * k;
        v8 acc[4] = {};
        int64_t c = 0;
        for (; c + 32 <= k; c += 32) {  // two cache lines
            const char* ahead = reinterpret_cast<const char*>(row + c) + kPrefetchBytes;
            __builtin_prefetch(ahead);  // past W's end: harmless
            __builtin_prefetch(ahead + 64);
            for (int i = 0; i < 4; ++i) acc[i] += load8(row + c + 8 * i) * load8(x + c + 8 * i);
        }
        for (; c < k; c += 8) acc[0] += load8(row + c) * load8(x + c);
        y[j] = hsum((acc[0] + acc[1]) + (acc[2] + acc[3])) + (bias ? bias[j] : 0.f);
    }
}

template <int M>
void rows_of(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1, int64_t n,
             int64_t k, bool prefetch) {
    if constexpr (M == 1) {
        row_by_row(x, w, bias, y, n0, n1, k);
        return;
    }
#if defined(__AVX512VL__)  // 32 vector registers: more W rows per load of x (16 rows of x: 7% faster)
    constexpr int RN = M == 1 ? 8 : M == 2 ? 8 : M <= 4 ? 5 : M <= 6 ? 4 : 3;
#else
    constexpr int RN = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1;  // RN * M + M + 1 vector registers
#endif
    rows<M, RN>(x, w, bias, y, n0, n1, n, k, prefetch);
}

// Input rows go 8 at a time over each task's W rows; the task's W slice (32 rows) stays in L2
// between them, so W still comes from memory once.
void run(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
    const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
#pragma omp parallel for schedule(static) if (n * k >= kMinParallelElements)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t n0 = t * kRowsPerTask, n1 = std::min(n, n0 + kRowsPerTask);
        // With several rows of x the kernel computes long enough per W line that memory sits idle
        // (and on the second pass over a task it reads only L2): fetch the next W lines meanwhile.
        // Measured in a decode step of the demo model: 6 rows 41 → 35 ms, 16 rows 64 → 56 ms
        // (then 32 rows ahead); one row (memory-bound) is unchanged, so it is left to the hardware.
        // The next RN rows (one group ahead, 7-18 KiB of 576-wide rows) rather than the next task's (32 rows, 74 KiB):
        // 2-8 rows 4-6% less CPU time, 16 rows 2-4% (576- and 1536-wide weights, one thread).
        const bool prefetch = m > 1;
        for (int64_t m0 = 0; m0 < m; m0 += 8) {
            const float* xs = x + m0 * k;
            float* ys = y + m0 * n;
            switch (std::min<int64_t>(8, m - m0)) {
                case 1: rows_of<1>(xs, w, bias, ys, n0, n1, n, k, prefetch); break;
                case 2: rows_of<2>(xs, w, bias, ys, n0, n1, n, k, prefetch); break;
                case 3: rows_of<3>(xs, w, bias, ys, n0, n1, n, k, prefetch); break;
                case 4: rows_of<4>(xs, w, bias, ys, n0, n1, n, k, prefetch); break;
                case 5: rows_of<5>(xs, w, bias, ys, n0, n1, n, k, prefetch); break;
                case 6: rows_of<6>(xs, w, bias, ys, n0, n1, n, k, prefetch); break;
                case 7: rows_of<7>(xs, w, bias, ys, n0, n1, n, k, prefetch); break;
                default: rows_of<8>(xs, w, bias, ys, n0, n1, n, k, prefetch); break;
            }
        }
    }
}

}  // namespace

extern "C" int small_batch_linear_f32(const float* x, const float* w, const float* bias, float* y, int64_t m,
                                      int64_t n, int64_t k) {
    if (k % 8 != 0 || m < 1) return 1;
    run(x, w, bias, y, m, n, k);
    return 0;
}
