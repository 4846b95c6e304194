// The work split the quantized linears share (quant_linear.cpp's fp32 and 16-lane paths,
// quant_linear_q8.cpp): threads take W's output rows in tasks of kRowsPerTask, and each task runs
// x's rows in blocks of up to 8, so the task's codes stay in L2 between row blocks. A block of M
// rows runs `Rows::template run<M>`, instantiated for every M in 1..8, so each block size keeps its
// accumulators in registers.
#pragma once

#include <algorithm>
#include <cstdint>

#include "parallel_threshold.h"

constexpr int64_t kRowsPerTask = 32;               // W rows per scheduling unit (2 threads split 576 evenly)

// y rows for x rows [0, m) and W rows [0, a.n): Rows::template run<M>(a, m0, n0, n1) per task and block.
template <typename Rows, typename Args>
void run_row_blocks(const Args& a, int64_t m) {
    const int64_t tasks = (a.n + kRowsPerTask - 1) / kRowsPerTask;
#pragma omp parallel for schedule(static) if (a.n * a.k >= kMinParallelElements)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t n0 = t * kRowsPerTask, n1 = std::min(a.n, n0 + kRowsPerTask);
        for (int64_t m0 = 0; m0 < m; m0 += 8) {
            switch (std::min<int64_t>(8, m - m0)) {
                case 1: Rows::template run<1>(a, m0, n0, n1); break;
                case 2: Rows::template run<2>(a, m0, n0, n1); break;
                case 3: Rows::template run<3>(a, m0, n0, n1); break;
                case 4: Rows::template run<4>(a, m0, n0, n1); break;
                case 5: Rows::template run<5>(a, m0, n0, n1); break;
                case 6: Rows::template run<6>(a, m0, n0, n1); break;
                case 7: Rows::template run<7>(a, m0, n0, n1); break;
                default: Rows::template run<8>(a, m0, n0, n1); break;
            }
        }
    }
}
