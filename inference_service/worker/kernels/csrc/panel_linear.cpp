// y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias[N]), fp32, CPU, as a GEMM over panels: 32 output columns
// stored k-major, [K][32], so each k reads one line of outputs.
//
// Tiles of kMR rows x 2 vectors of outputs (12 x 32 with AVX-512, 14 x 32 for prompts over weights
// stored in panels, 6 x 16 with AVX2) keep their accumulators in registers, with one broadcast of x
// and two panel loads per k. The panels come from three places:
// - weights stored in panels at load (kernels/panels.py): fp32 (panel_weights_linear_f32) or 8-bit
//   codes, widened to fp32 inside the tiles (panel_codes_linear_f32). Nothing is packed per call,
//   so these serve every row count, decode steps included: each panel streams once per step.
// - weights kept in rows, fp32 or packed 4/8-bit codes (kernels/packed.py): each task packs its rows
//   into a panel once (transposed 8x8 at a time; codes widened on the way, the same floats
//   dequantize gives) and runs every block of rows over it from L2 (panel_linear_f32,
//   panel_quant_linear_f32). The packing pays off from about 8-32 rows; fewer rows go to
//   small_batch_linear.cpp and quant_linear.cpp, which stream W once.
// Measured on the demo model's projections (2 threads): 180-190 GFLOP/s from 64 rows up, where
// torch's fp32 GEMM gives 130-175; prepacked fp32, a 16-row step's matmuls 35.5 -> 25.5 ms.
//
// Prompt-sized calls on weights stored in panels pack x first, in blocks of rows that stay in L2,
// each tile of 12 rows k-major, so a tile reads x as one stream (measured on this Xeon, 1 thread,
// 2,048 rows, k = 576: 123-130 -> 140 GFLOP/s, torch's 145-160).
//
// While a task computes, it prefetches the next task's rows, spread over its tiles.
// Threads split the tasks (torch's OpenMP runtime, as in the other kernels).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dequant_row.h"
#include "panel_prefetch.h"
#include "parallel_threshold.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
constexpr int kLanes = 16, kMR = 12;  // 32 registers: 24 accumulators, 2 panel vectors, a broadcast
// Prompt-sized calls on weights stored in panels: 28 accumulators, 2 panel vectors, the broadcast
// from memory. Measured on this Xeon (2 threads, 2,048 rows): the ~1.5B shape's projections 5-10%
// more GFLOP/s than 12 rows, the demo model's -2 to +6%; 15 or 16 rows: no better. Decode-sized
// calls keep 12 (16 rows as 14 + 2: 3% slower than 12 + 4). Each output's sum runs over k in the
// same order at any tile height, so the results are the same bits.
constexpr int kPromptMR = 14;
#else
typedef float vf __attribute__((vector_size(32)));
constexpr int kLanes = 8, kMR = 6, kPromptMR = 6;  // 16 registers: 12 accumulators, 2 panel vectors, a broadcast
#endif
constexpr int kNR = 2 * kLanes;  // output columns per task (panel width)

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8idx __attribute__((vector_size(32)));

inline vf loadv(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

// The 8x8 block at src (row stride ld) transposed to dst (row stride ldd): dst[j][i] = src[i][j].
inline void transpose8(const float* src, int64_t ld, float* dst, int64_t ldd) {
    f8 a[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) std::memcpy(&a[i], src + i * ld, sizeof(f8));
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shuffle(a[i], a[i + 1], i8idx{0, 8, 1, 9, 4, 12, 5, 13});
        t[i + 1] = __builtin_shuffle(a[i], a[i + 1], i8idx{2, 10, 3, 11, 6, 14, 7, 15});
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = __builtin_shuffle(t[i], t[i + 2], i8idx{0, 1, 8, 9, 4, 5, 12, 13});
        u[i + 1] = __builtin_shuffle(t[i], t[i + 2], i8idx{2, 3, 10, 11, 6, 7, 14, 15});
        u[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], i8idx{0, 1, 8, 9, 4, 5, 12, 13});
        u[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], i8idx{2, 3, 10, 11, 6, 7, 14, 15});
    }
    for (int i = 0; i < 4; ++i) {  // u[i] holds columns i and i + 4 of rows 0-3 and 4-7 in its halves
        const f8 low = __builtin_shuffle(u[i], u[i + 4], i8idx{0, 1, 2, 3, 8, 9, 10, 11});
        const f8 high = __builtin_shuffle(u[i], u[i + 4], i8idx{4, 5, 6, 7, 12, 13, 14, 15});
        std::memcpy(dst + i * ldd, &low, sizeof(f8));
        std::memcpy(dst + (i + 4) * ldd, &high, sizeof(f8));
    }
}

// Rows [0, nr) of w (row stride ld, k columns) into panel [k][kNR]; columns past nr are zero.
void pack(const float* w, int64_t ld, int64_t k, int nr, float* panel) {
    int64_t c = 0;
    if (nr == kNR) {
        for (; c + 8 <= k; c += 8) {
            for (int r = 0; r < kNR; r += 8) transpose8(w + r * ld + c, ld, panel + c * kNR + r, kNR);
        }
    }
    for (; c < k; ++c) {
        for (int r = 0; r < kNR; ++r) panel[c * kNR + r] = r < nr ? w[r * ld + c] : 0.f;
    }
}

// Where the next task's W rows are, to prefetch while this one computes.
struct Ahead {
    const char* base = nullptr;  // null: no next task
    int64_t row_bytes = 0;
    int rows = 0;
};

// Prefetch line `line` of the next task's rows (rows interleaved, so each tile's share covers all).
inline void prefetch_line(const Ahead& ahead, int64_t line) {
    const int64_t row = line % ahead.rows, offset = (line / ahead.rows) * 64;
    if (offset < ahead.row_bytes) __builtin_prefetch(ahead.base + row * ahead.row_bytes + offset);
}

// One row of a tile's accumulators (+ bias) into y: its first nr columns.
inline void store_row(const vf (&acc)[2], float* y, int nr, const float* bias) {
    if (nr == 2 * kLanes) {  // a whole tile: two vector stores
        const vf y0 = bias ? acc[0] + loadv(bias) : acc[0], y1 = bias ? acc[1] + loadv(bias + kLanes) : acc[1];
        std::memcpy(y, &y0, sizeof(vf));
        std::memcpy(y + kLanes, &y1, sizeof(vf));
        return;
    }
    float out[2 * kLanes];
    std::memcpy(out, &acc[0], sizeof(vf));
    std::memcpy(out + kLanes, &acc[1], sizeof(vf));
    for (int j = 0; j < nr; ++j) y[j] = out[j] + (bias ? bias[j] : 0.f);
}

// Calls tile(rows, m0, index) for m rows in blocks of MR, then the rows left over; rows is a
// std::integral_constant, so each block size is its own instantiation.
template <int MR, class Tile>
void over_row_blocks(int64_t m, Tile tile) {
    int64_t m0 = 0, index = 0;
    for (; m0 + MR <= m; m0 += MR, ++index) tile(std::integral_constant<int, MR>{}, m0, index);
    switch (m - m0) {
#define TAIL(R) case R: if constexpr (R < MR) tile(std::integral_constant<int, R>{}, m0, index); break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11) TAIL(12) TAIL(13)
#undef TAIL
        default: break;
    }
}

// y[MR, nr] = x[MR, k] · panel (+ bias), x rows ldx apart, y rows ldy apart. Prefetches two lines of
// the next task per 8 k, from line `first_line` on.
// Without a next task to prefetch (weights stored in panels), a tile prefetches its own panel ahead
// (panel_prefetch.h).
template <int MR>
void tile(const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t k, float* y, int64_t ldy, int nr,
          const float* bias, const Ahead& ahead, int64_t first_line) {
    vf acc[MR][2] = {};
    auto step = [&](int64_t c) {
        const vf b0 = loadv(panel + c * ldp), b1 = loadv(panel + c * ldp + kLanes);
        for (int m = 0; m < MR; ++m) {
            const vf a = vf{} + x[m * ldx + c];
            acc[m][0] += a * b0;
            acc[m][1] += a * b1;
        }
    };
    if (ahead.base) {
        for (int64_t c = 0; c < k; ++c) {
            if (c % 8 == 0) {
                prefetch_line(ahead, first_line + c / 4);
                prefetch_line(ahead, first_line + c / 4 + 1);
            }
            step(c);
        }
    } else {
        for (int64_t c = 0; c < k; ++c) {
            prefetch_panel_ahead(panel, c, ldp);
            step(c);
        }
    }
    for (int m = 0; m < MR; ++m) store_row(acc[m], y + m * ldy, nr, bias);
}

template <int MR>
void tiles_of(const float* x, int64_t m, int64_t k, const float* panel, int64_t ldp, float* y, int64_t n, int nr,
              const float* bias, const Ahead& ahead) {
    const int64_t lines_per_tile = 2 * ((k + 7) / 8);  // what tile() prefetches
    over_row_blocks<MR>(m, [&](auto rows, int64_t m0, int64_t index) {
        tile<decltype(rows)::value>(x + m0 * k, k, panel, ldp, k, y + m0 * n, n, nr, bias, ahead,
                                    index * lines_per_tile);
    });
}

// Packs task t's panel: `fill(n0, nr, panel, scratch)`.
template <class Fill>
void run(const float* x, const float* bias, float* y, int64_t m, int64_t n, int64_t k, Fill fill,
         const char* w_base, int64_t w_row_bytes) {
    const int64_t tasks = (n + kNR - 1) / kNR;
#pragma omp parallel
    {
        std::vector<float> panel(k * kNR), scratch;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t n0 = t * kNR;
            const int nr = static_cast<int>(std::min<int64_t>(kNR, n - n0));
            fill(n0, nr, panel.data(), scratch);
            Ahead ahead;
            if (n0 + 2 * kNR <= n) ahead = {w_base + (n0 + kNR) * w_row_bytes, w_row_bytes, kNR};
            tiles_of<kMR>(x, m, k, panel.data(), kNR, y + n0, n, nr, bias ? bias + n0 : nullptr, ahead);
        }
    }
}

// Prepacked 8-bit codes (kernels/panels.py): panels of kCodePanel output columns, codes [K][kCodePanel]
// and scales/offsets [G][kCodePanel] per panel, so each k reads one contiguous line of codes and
// nothing is packed per call. Each tile widens 2 vectors of codes, applies the group's scale and
// offset (the floats dequantize gives) and FMAs them into all its rows, at any row count: a decode
// step streams the codes once, a prefill reuses each panel from L2.
constexpr int kCodePanel = 32;

// kLanes codes → floats.
inline vf widen_codes(const uint8_t* p) {
#if defined(__AVX512F__)
    return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(p)))));
#else
    return to_f32(widen(p));
#endif
}

// y[MR, 2 kLanes] = x[MR, k] · the panel's columns from `codes` on (+ bias). The codes are prefetched
// kCodeAheadK k ahead (6 KiB, as fp32 panels are: panel_prefetch.h), for the same reason: measured
// over 120 layers of 576x576, 1536x576, 576x1536 codes, one thread, 9 rows 56.2 -> 43.5 ms, 16 rows
// 73.7 -> 59.8, 48 rows 208 -> 195 (64, 128 or 256 k ahead: no better).
constexpr int64_t kCodeAheadK = 192;
template <int MR>
void code_tile(const float* x, int64_t ldx, const uint8_t* codes, const float* scales, const float* offsets,
               int64_t k, int64_t gs, float* y, int64_t ldy, const float* bias) {
    vf acc[MR][2] = {};
    for (int64_t c0 = 0, g = 0; c0 < k; c0 += gs, ++g) {
        const vf s0 = loadv(scales + g * kCodePanel), s1 = loadv(scales + g * kCodePanel + kLanes);
        const vf o0 = loadv(offsets + g * kCodePanel), o1 = loadv(offsets + g * kCodePanel + kLanes);
        const int64_t c1 = std::min(k, c0 + gs);
        for (int64_t c = c0; c < c1; ++c) {
            if (c % 2 == 0) __builtin_prefetch(codes + (c + kCodeAheadK) * kCodePanel);  // one line per 2 k
            const vf b0 = widen_codes(codes + c * kCodePanel) * s0 + o0;
            const vf b1 = widen_codes(codes + c * kCodePanel + kLanes) * s1 + o1;
            for (int m = 0; m < MR; ++m) {
                const vf a = vf{} + x[m * ldx + c];
                acc[m][0] += a * b0;
                acc[m][1] += a * b1;
            }
        }
    }
    for (int m = 0; m < MR; ++m) store_row(acc[m], y + m * ldy, 2 * kLanes, bias);
}

template <int MR>
void code_tiles_of(const float* x, int64_t m, int64_t k, const uint8_t* codes, const float* scales,
                   const float* offsets, int64_t gs, float* y, int64_t n, const float* bias) {
    over_row_blocks<MR>(m, [&](auto rows, int64_t m0, int64_t) {
        code_tile<decltype(rows)::value>(x + m0 * k, k, codes, scales, offsets, k, gs, y + m0 * n, n, bias);
    });
}

// A code panel [k][kCodePanel] widened to fp32 `out` [k][kCodePanel]: code * scale + offset.
void widen_panel(const uint8_t* codes, const float* scales, const float* offsets, int64_t k, int64_t gs,
                 float* out) {
    for (int64_t c0 = 0, g = 0; c0 < k; c0 += gs, ++g) {
        const int64_t c1 = std::min(k, c0 + gs);
        for (int j = 0; j < kCodePanel; j += kLanes) {
            const vf s = loadv(scales + g * kCodePanel + j), o = loadv(offsets + g * kCodePanel + j);
            for (int64_t c = c0; c < c1; ++c) {
                const vf w = widen_codes(codes + c * kCodePanel + j) * s + o;
                std::memcpy(out + c * kCodePanel + j, &w, sizeof(vf));
            }
        }
    }
}

// Rows of x per block: a block (~1 MiB) stays in L2 while every panel runs over it, instead of all
// of a prefill's rows streaming from memory once per panel.
inline int64_t rows_per_block(int64_t k) {
    constexpr int64_t kBlockBytes = 1 << 20;
    return std::max<int64_t>(1, kBlockBytes / (k * static_cast<int64_t>(sizeof(float))) / kPromptMR) * kPromptMR;
}

// Tile `index` of a block of rows (row stride k) packed k-major: its R rows (kPromptMR, or fewer for
// the last) at xp + index * kPromptMR * k, element (row r, column c) at c * R + r. A tile then reads
// its x as one sequential stream through one pointer, instead of R rows a row apart.
void pack_tile(const float* x, int64_t rows, int64_t k, int64_t index, float* xp) {
    const int64_t r0 = index * kPromptMR, count = std::min<int64_t>(kPromptMR, rows - r0);
    float* out = xp + r0 * k;
    for (int64_t r = 0; r < count; ++r) {
        const float* row = x + (r0 + r) * k;
        for (int64_t c = 0; c < k; ++c) out[c * count + r] = row[c];
    }
}

// From this many rows of x on, blocks of x are packed (prompt steps); below, a call is a decode
// step's, bound by streaming the weights, and packing would only add a barrier. Only up to
// kPackMaxK columns, while a packed tile fits L1 (48 KiB at 1,024): measured on the demo model's
// shapes (1 thread, 2,048 rows, against reading x in place), k = 576 gained 11-19% (a 27 KiB tile),
// k = 1,536 lost 14% (72 KiB); k in between is not measured.
constexpr int64_t kPackRows = 48, kPackMaxK = 1024;

// y[MR, 2 kLanes] (+ bias) = a packed tile [k][MR] · panel [k][ldp].
template <int MR>
void packed_tile(const float* xp, const float* panel, int64_t ldp, int64_t k, float* y, int64_t ldy,
                 const float* bias) {
    vf acc[MR][2] = {};
    for (int64_t c = 0; c < k; ++c) {
        const vf b0 = loadv(panel + c * ldp), b1 = loadv(panel + c * ldp + kLanes);
        for (int m = 0; m < MR; ++m) {
            const vf a = vf{} + xp[c * MR + m];
            acc[m][0] += a * b0;
            acc[m][1] += a * b1;
        }
    }
    for (int m = 0; m < MR; ++m) store_row(acc[m], y + m * ldy, 2 * kLanes, bias);
}

}  // namespace

// x [m, k], w [n, k], bias [n] or null, y [m, n]; all contiguous fp32.
extern "C" int panel_linear_f32(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
                                int64_t k) {
    if (m < 1 || n < 1 || k < 1) return 1;
    auto fill = [&](int64_t n0, int nr, float* panel, std::vector<float>&) { pack(w + n0 * k, k, k, nr, panel); };
    run(x, bias, y, m, n, k, fill, reinterpret_cast<const char*>(w), k * static_cast<int64_t>(sizeof(float)));
    return 0;
}

// The same over packed codes (kernels/packed.py): codes uint8 [n, k] (bits 8) or [n, ceil(k / 2)]
// (bits 4), scales/offsets [n, ceil(k / group_size)]. Each task's rows are dequantized into a
// scratch [kNR, k] and packed from there.
extern "C" int panel_quant_linear_f32(const float* x, const uint8_t* codes, const float* scales,
                                      const float* offsets, const float* bias, float* y, int64_t m, int64_t n,
                                      int64_t k, int64_t bits, int64_t group_size) {
    if (m < 1 || n < 1 || k < 1 || (bits != 4 && bits != 8) || group_size < 1) return 1;
    const int64_t groups = (k + group_size - 1) / group_size, row_bytes = bits == 8 ? k : (k + 1) / 2;
    auto fill = [&](int64_t n0, int nr, float* panel, std::vector<float>& scratch) {
        scratch.resize(kNR * k);
        for (int r = 0; r < nr; ++r) {
            const int64_t row = n0 + r;
            dequantize_row(codes + row * row_bytes, scales + row * groups, offsets + row * groups,
                           scratch.data() + r * k, k, bits, group_size);
        }
        pack(scratch.data(), k, k, nr, panel);
    };
    run(x, bias, y, m, n, k, fill, reinterpret_cast<const char*>(codes), row_bytes);
    return 0;
}

// x [m, k]; codes uint8 [n / 32, k, 32], scales/offsets fp32 [n / 32, ceil(k / group_size), 32] (the
// panel layout of 8-bit codes, kernels/panels.py); bias [n] or null; y [m, n]. n a multiple of 32.
// Up to kWidenOnceRows rows of x, tiles widen the codes as they go (decode: the codes are read
// once); above, each panel is widened once into fp32 and the fp32 tiles run over it (prefill: a
// tile per 12 rows would widen every code again).
extern "C" int panel_codes_linear_f32(const float* x, const uint8_t* codes, const float* scales,
                                      const float* offsets, const float* bias, float* y, int64_t m, int64_t n,
                                      int64_t k, int64_t group_size) {
    if (m < 1 || n < 1 || k < 1 || group_size < 1 || n % kCodePanel) return 1;
    constexpr int64_t kWidenOnceRows = 64;  // measured: tiles widening as they go win up to here
    const int64_t panels = n / kCodePanel, groups = (k + group_size - 1) / group_size;
    const bool widen_once = m > kWidenOnceRows;
#pragma omp parallel if (n * k >= kMinParallelElements)
    {
        std::vector<float> wide(widen_once ? k * kCodePanel : 0);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const uint8_t* pc = codes + p * k * kCodePanel;
            const float *ps = scales + p * groups * kCodePanel, *po = offsets + p * groups * kCodePanel;
            if (widen_once) widen_panel(pc, ps, po, k, group_size, wide.data());
            for (int col = 0; col < kCodePanel; col += 2 * kLanes) {  // one tile wide with AVX-512, two with AVX2
                const int64_t n0 = p * kCodePanel + col;
                const float* b = bias ? bias + n0 : nullptr;
                if (widen_once) {
                    Ahead ahead;  // the next panel's codes, while this one computes
                    if (p + 1 < panels) ahead = {reinterpret_cast<const char*>(pc + k * kCodePanel), k * kCodePanel, 1};
                    tiles_of<kMR>(x, m, k, wide.data() + col, kCodePanel, y + n0, n, 2 * kLanes, b, ahead);
                } else {
                    code_tiles_of<kMR>(x, m, k, pc + col, ps + col, po + col, group_size, y + n0, n, b);
                }
            }
        }
    }
    return 0;
}

// x [m, k]; panels fp32 [n / 32, k, 32]: a weight [n, k] stored k-major in panels of 32 output rows
// (linears/panelled.py); bias [n] or null; y [m, n]. n a multiple of 32. Nothing to pack: the
// tiles read each panel where it lies, one 128-byte line per k, at any row count.
extern "C" int panel_weights_linear_f32(const float* x, const float* panels, const float* bias, float* y, int64_t m,
                                        int64_t n, int64_t k) {
    if (m < 1 || n < 1 || k < 1 || n % kCodePanel) return 1;
    const int64_t count = n / kCodePanel;
    if (m < kPackRows || k > kPackMaxK) {  // the tiles read x where it lies, in one parallel region
        const bool prompt = m >= kPackRows;
#pragma omp parallel for schedule(static) if (n * k >= kMinParallelElements)
        for (int64_t p = 0; p < count; ++p) {
            for (int col = 0; col < kCodePanel; col += 2 * kLanes) {
                const int64_t n0 = p * kCodePanel + col;
                const float *panel = panels + p * k * kCodePanel + col, *b = bias ? bias + n0 : nullptr;
                if (prompt) {
                    tiles_of<kPromptMR>(x, m, k, panel, kCodePanel, y + n0, n, 2 * kLanes, b, Ahead{});
                } else {
                    tiles_of<kMR>(x, m, k, panel, kCodePanel, y + n0, n, 2 * kLanes, b, Ahead{});
                }
            }
        }
        return 0;
    }
    // All rows packed first, block by block (tile t of a block at its start + t * kPromptMR * k), behind
    // one barrier; then each block's tiles run over every panel, blocks one after another without
    // a barrier between them (they write apart): two barriers a call (a decode-sized call has one;
    // on a busy machine each barrier waits for whichever thread was scheduled out).
    const int64_t block = std::min(m, rows_per_block(k)), tiles_per_block = (block + kPromptMR - 1) / kPromptMR;
    const int64_t blocks = (m + block - 1) / block;
    thread_local std::vector<float> packed;  // reused across calls (a prompt step's is megabytes); only grows
    packed.resize(m * k);
    float* xp = packed.data();
#pragma omp parallel if (n * k >= kMinParallelElements)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < blocks * tiles_per_block; ++t) {
            const int64_t m0 = (t / tiles_per_block) * block;
            if (m0 + (t % tiles_per_block) * kPromptMR < m) {
                pack_tile(x + m0 * k, std::min(block, m - m0), k, t % tiles_per_block, xp + m0 * k);
            }
        }
        for (int64_t m0 = 0; m0 < m; m0 += block) {
            const int64_t rows = std::min(block, m - m0);
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < count; ++p) {
                for (int col = 0; col < kCodePanel; col += 2 * kLanes) {  // one tile wide with AVX-512, two with AVX2
                    const int64_t n0 = p * kCodePanel + col;
                    const float* b = bias ? bias + n0 : nullptr;
                    over_row_blocks<kPromptMR>(rows, [&](auto tile_rows, int64_t r0, int64_t) {
                        packed_tile<decltype(tile_rows)::value>(xp + (m0 + r0) * k, panels + p * k * kCodePanel + col,
                                                                kCodePanel, k, y + (m0 + r0) * n + n0, n, b);
                    });
                }
            }
        }
    }
    return 0;
}
