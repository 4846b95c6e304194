// LoRA updates of a step's rows, grouped by adapter, for one projection (plain or fused), fp32, CPU:
// y[row, col + o] += scale · Σ_j (x[row] · A[j]) · B[j, o] for every row of every group and every part
// of the projection (q|k|v or gate|up: one part per site), in one call. Punica's SGMV (segments of
// rows sharing an adapter) with its BGMV case (a single row) fused into one pass.
//
// Why native: in torch each group costs a gather, two matmuls and a scatter-add per projection, and
// the demo model's decode step has 7 projections × 30 layers of them: thousands of small ops whose
// dispatch costs more than their arithmetic (a rank-16 update of one row is ~35k FMAs).
//
// Layouts (as worker/lora/weights.py keeps them): A [rank, in] row-major (PEFT's lora_A), B [rank, out]
// row-major (scale · lora_Bᵀ). An adapter's table holds one entry per site (layer · 7 + target);
// an entry with a null A means the adapter leaves that site alone. `in` is a multiple of 8.
//
// Threads (torch's OpenMP runtime) take (tile of rows, part) tasks once the call's work is large
// enough to repay waking them, and for any call of several rows (team_for); a single row's parts run
// inline. A one-stream decode step's projections take lora_panel_row_f32 instead: the base's product
// over panelled weights and the update in one call, the update split over the threads with the base.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "panel_prefetch.h"
#include "parallel_threshold.h"
#include "vec8.h"

namespace {

struct Entry {  // one site of one adapter
    const float* a;  // [rank, in], or null: not targeted
    const float* b;  // [rank, out]
    int64_t rank;
    float scale;
    float pad_;
};

struct Group {  // one adapter's segment of the step's rows
    const Entry* table;
    int64_t table_len;
    int64_t start, end;  // into `rows` (or the step's rows themselves when rows is null)
};

struct Part {  // one site of the projection and its columns in y
    int64_t site, col, width;
};

static_assert(sizeof(Entry) == 32 && sizeof(Group) == 32 && sizeof(Part) == 24, "C ABI layout");

constexpr int64_t kTile = 4;                      // rows per task: their shrinks share each A load
// FMAs from which a call always splits over the team (prefills). Below it (a decode step's calls: 16
// rows of gate|up at rank 16 are ~1M FMAs, tens of µs) team_for decides.
constexpr int64_t kMinParallelWork = 1 << 22;
constexpr int64_t kMaxRank = 1024;

const Entry* entry_of(const Group& g, int64_t site) {
    if (site < 0 || site >= g.table_len) return nullptr;
    const Entry* e = g.table + site;
    return e->a != nullptr && e->rank > 0 ? e : nullptr;
}

// The shrink prefetches A kShrinkAhead rows ahead of the pair it reads (A [rank, in] is contiguous):
// a rank-16 A is 16 short rows, too short for the hardware prefetcher to ramp up on. Measured over
// 30 demo-model layers, 16 rows over 4 rank-16 adapters, 1 thread (CPU time, busy machine):
// 6.1-7.4 ms without, 5.1 ms with (4 or 8 rows ahead: about the same).
constexpr int64_t kShrinkAhead = 6;

// t[m][0..rank) = scale · xs[m] · Aᵀ for M gathered rows xs [M, k] (contiguous).
template <int M>
void shrink(const float* xs, const Entry& e, int64_t k, float* t, int64_t ldt) {
    const float* a = e.a;
    int64_t j = 0;
    for (; j + 2 <= e.rank; j += 2) {  // two A rows per pass over x: 2·M accumulators
        v8 acc0[M] = {}, acc1[M] = {};
        const float* a0 = a + j * k;
        const float* a1 = a0 + k;
        for (int64_t c = 0; c < k; c += 8) {
            if (c % 16 == 0) {  // one prefetch per line; past A's end: harmless
                __builtin_prefetch(a0 + kShrinkAhead * k + c);
                __builtin_prefetch(a1 + kShrinkAhead * k + c);
            }
            const v8 w0 = load8(a0 + c), w1 = load8(a1 + c);
            for (int m = 0; m < M; ++m) {
                const v8 xv = load8(xs + m * k + c);
                acc0[m] += w0 * xv;
                acc1[m] += w1 * xv;
            }
        }
        for (int m = 0; m < M; ++m) {
            t[m * ldt + j] = hsum(acc0[m]) * e.scale;
            t[m * ldt + j + 1] = hsum(acc1[m]) * e.scale;
        }
    }
    for (; j < e.rank; ++j) {
        v8 acc[M] = {};
        const float* a0 = a + j * k;
        for (int64_t c = 0; c < k; c += 8) {
            const v8 w0 = load8(a0 + c);
            for (int m = 0; m < M; ++m) acc[m] += w0 * load8(xs + m * k + c);
        }
        for (int m = 0; m < M; ++m) t[m * ldt + j] = hsum(acc[m]) * e.scale;
    }
}

void shrink_rows(const float* xs, int64_t m, const Entry& e, int64_t k, float* t, int64_t ldt) {
    switch (m) {
        case 1: shrink<1>(xs, e, k, t, ldt); break;
        case 2: shrink<2>(xs, e, k, t, ldt); break;
        case 3: shrink<3>(xs, e, k, t, ldt); break;
        default: shrink<4>(xs, e, k, t, ldt); break;
    }
}

// y[m][0, width) += t[m] · B for M rows (a tile sharing one adapter): each B line is loaded once for
// all M rows, and NV vectors of columns per row keep M·NV independent sums in flight (one row alone
// would wait on each FMA's latency). B [rank, width] row-major is read in `rank` parallel streams; for a
// tile they are prefetched a few lines ahead: a decode step's B comes from memory (the base's weights
// evict it). Measured on the busy machine (30 demo-model layers, rank 16, best of 20): 16 rows of one
// adapter in 0.51x the time of a row-by-row expand; over 4 adapters the prefetch took 0.81x the time
// without it (medians within noise), while one row ran 0.93x faster without it.
// B's rows are `ldb` floats apart: `b` may point at a column range of the part (lora_panel_row_f32).
template <int M, int NV>
void expand(const float* t, int64_t ldt, const float* b0, int64_t ldb, int64_t rank, int64_t width,
            float* const* y) {
    constexpr int64_t kCols = 8 * NV;
    constexpr int64_t kAhead = 128;  // floats ahead of the block being read (8 lines of each B row)
    int64_t o = 0;
    for (; o + kCols <= width; o += kCols) {
        v8 acc[M][NV];
        for (int m = 0; m < M; ++m)
            for (int v = 0; v < NV; ++v) acc[m][v] = load8(y[m] + o + 8 * v);
        const float* b = b0 + o;
        for (int64_t j = 0; j < rank; ++j) {
            const float* bj = b + j * ldb;
            if (M > 1)  // one per line (prefetches never fault); one row alone measured faster without
                for (int v = 0; v < NV; v += 2) __builtin_prefetch(bj + kAhead + 8 * v);
            v8 w[NV];
            for (int v = 0; v < NV; ++v) w[v] = load8(bj + 8 * v);
            for (int m = 0; m < M; ++m) {
                const v8 tj = v8{} + t[m * ldt + j];
                for (int v = 0; v < NV; ++v) acc[m][v] += tj * w[v];
            }
        }
        for (int m = 0; m < M; ++m)
            for (int v = 0; v < NV; ++v) store8(y[m] + o + 8 * v, acc[m][v]);
    }
    for (; o + 8 <= width; o += 8) {
        for (int m = 0; m < M; ++m) {
            v8 acc = load8(y[m] + o);
            for (int64_t j = 0; j < rank; ++j) acc += (v8{} + t[m * ldt + j]) * load8(b0 + j * ldb + o);
            store8(y[m] + o, acc);
        }
    }
    for (; o < width; ++o) {
        for (int m = 0; m < M; ++m) {
            float acc = 0.f;
            for (int64_t j = 0; j < rank; ++j) acc += t[m * ldt + j] * b0[j * ldb + o];
            y[m][o] += acc;
        }
    }
}

void expand_rows(const float* t, int64_t ldt, const Entry& e, int64_t width, float* const* y, int64_t m) {
    switch (m) {
        case 1: expand<1, 4>(t, ldt, e.b, width, e.rank, width, y); break;
        case 2: expand<2, 2>(t, ldt, e.b, width, e.rank, width, y); break;
        case 3: expand<3, 2>(t, ldt, e.b, width, e.rank, width, y); break;
        default: expand<4, 2>(t, ldt, e.b, width, e.rank, width, y); break;
    }
}

struct Tile {
    int64_t group, first, count;  // `count` rows from position `first` of the group's segment
};

int64_t row_at(const int64_t* rows, int64_t position) { return rows ? rows[position] : position; }

// How a decode-sized call (less work than kMinParallelWork, at least two tasks) runs. Measured on the
// quiet 2-core machine (lora_bench --thread-modes one,team, demo model, 2 rounds): 16 streams over 4
// adapters at 0.94x / 0.86x the base's tok/s with the team against 0.90x / 0.78x on one thread, and
// 0.75x / 0.77x when each call chose by timing its recent calls; one stream 1.16-1.23x the base's
// ms/token every way. So calls of several rows split over the team, as the base's linears do, and a
// single row's parts run inline (no wake-up to repay).
std::atomic<int> forced_threads{0};  // 0: that rule; 1: always one thread; 2: always the team

bool team_for(bool several_rows) {
    const int forced = forced_threads.load(std::memory_order_relaxed);
    return forced == 0 ? several_rows : forced == 2;
}

struct Call {
    const float* x;
    int64_t k;
    float* y;
    int64_t ldy;
    const int64_t* rows;
    const Group* groups;
    const Part* parts;
    int64_t num_parts, max_rank;
};

// One task: a tile's rows through one part, shrink then expand, so tasks never wait on each other
// (a barrier between the phases cost milliseconds when the machine's other work held a thread).
void run_task(const Call& c, const Tile& tile, const Part& part, float* xs, float* t) {
    const Entry* e = entry_of(c.groups[tile.group], part.site);
    if (e == nullptr) return;
    for (int64_t m = 0; m < tile.count; ++m)
        std::memcpy(xs + m * c.k, c.x + row_at(c.rows, tile.first + m) * c.k, sizeof(float) * c.k);
    shrink_rows(xs, tile.count, *e, c.k, t, c.max_rank);
    float* yr[kTile];
    for (int64_t m = 0; m < tile.count; ++m) yr[m] = c.y + row_at(c.rows, tile.first + m) * c.ldy + part.col;
    expand_rows(t, c.max_rank, *e, part.width, yr, tile.count);
}

void run_tasks(const Call& c, const std::vector<Tile>& tiles, bool team) {
    const int64_t num_tasks = static_cast<int64_t>(tiles.size()) * c.num_parts;
#pragma omp parallel if (team)
    {
        std::vector<float> xs(static_cast<size_t>(kTile * c.k));
        std::vector<float> t(static_cast<size_t>(kTile * c.max_rank));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; ++task)
            run_task(c, tiles[task / c.num_parts], c.parts[task % c.num_parts], xs.data(), t.data());
    }
}

}  // namespace

extern "C" int lora_sgmv_f32(const float* x, int64_t k, float* y, int64_t ldy, const int64_t* rows,
                             const Group* groups, int64_t num_groups, const Part* parts, int64_t num_parts,
                             int64_t max_rank) {
    if (k % 8 != 0 || k <= 0 || max_rank < 1 || max_rank > kMaxRank || num_groups < 0 || num_parts < 1) return 1;
    std::vector<Tile> tiles;
    int64_t work = 0, num_rows = 0;
    for (int64_t g = 0; g < num_groups; ++g) {
        const int64_t n = groups[g].end - groups[g].start;
        if (n < 0) return 1;
        num_rows += n;
        for (int64_t i = 0; i < n; i += kTile) tiles.push_back({g, groups[g].start + i, std::min(kTile, n - i)});
        for (int64_t p = 0; p < num_parts; ++p) {
            const Entry* e = entry_of(groups[g], parts[p].site);
            if (e != nullptr) {
                if (e->rank > max_rank) return 1;
                work += n * e->rank * (k + parts[p].width);
            }
        }
    }
    if (work == 0) return 0;
    const Call call{x, k, y, ldy, rows, groups, parts, num_parts, max_rank};
    const bool several_tasks = static_cast<int64_t>(tiles.size()) * num_parts >= 2;
    run_tasks(call, tiles, work >= kMinParallelWork || (several_tasks && team_for(num_rows > 1)));
    return 0;
}

// The single-row case (BGMV, a one-stream decode step): shrink and expand of each part inline, no
// scratch beyond the stack; a projection of several parts (q|k|v, gate|up) splits them over the team
// only where lora_force_threads(2) says so (team_for).
extern "C" int lora_bgmv_f32(const float* x, int64_t k, float* y, const Entry* table, int64_t table_len,
                             const Part* parts, int64_t num_parts) {
    if (k % 8 != 0 || k <= 0 || num_parts < 1) return 1;
    Group g{table, table_len, 0, 1};
    int64_t work = 0, max_rank = 1;
    for (int64_t p = 0; p < num_parts; ++p) {
        const Entry* e = entry_of(g, parts[p].site);
        if (e == nullptr) continue;
        if (e->rank > kMaxRank) return 1;
        work += e->rank * (k + parts[p].width);
        max_rank = std::max(max_rank, e->rank);
    }
    if (work == 0) return 0;
    if (num_parts >= 2 && team_for(false)) {
        run_tasks(Call{x, k, y, 0, nullptr, &g, parts, num_parts, max_rank}, {Tile{0, 0, 1}}, true);
    } else {
        float t[kMaxRank];
        for (int64_t p = 0; p < num_parts; ++p) {
            const Entry* e = entry_of(g, parts[p].site);
            if (e == nullptr) continue;
            shrink<1>(x, *e, k, t, 0);
            float* yr = y + parts[p].col;
            expand<1, 4>(t, 0, e->b, parts[p].width, e->rank, parts[p].width, &yr);
        }
    }
    return 0;
}

namespace {

constexpr int64_t kPanel = 32;  // output columns per panel (kernels/panels.py PANEL)
typedef float v16 __attribute__((vector_size(64)));

// y[0, 32) = x · the panel [k][32] (+ bias): panel_linear.cpp's one-row tile (two 16-float vectors,
// one FMA each per k, the panel prefetched as its tiles do: panel_prefetch.h), so the base's share
// of the output is bitwise what it computes, as fast.
void panel_row(const float* x, const float* panel, int64_t k, const float* bias, float* y) {
    v16 acc0 = {}, acc1 = {}, w0, w1;
    for (int64_t c = 0; c < k; ++c) {
        prefetch_panel_ahead(panel, c, kPanel);
        const v16 a = v16{} + x[c];
        std::memcpy(&w0, panel + c * kPanel, sizeof(v16));
        std::memcpy(&w1, panel + c * kPanel + 16, sizeof(v16));
        acc0 += a * w0;
        acc1 += a * w1;
    }
    if (bias) {
        v16 b0, b1;
        std::memcpy(&b0, bias, sizeof(v16));
        std::memcpy(&b1, bias + 16, sizeof(v16));
        acc0 += b0;
        acc1 += b1;
    }
    std::memcpy(y, &acc0, sizeof(v16));
    std::memcpy(y + 16, &acc1, sizeof(v16));
}

// Columns [c0, c1) of y += the adapter's update of x there: each part reaching into them is shrunk
// whole (all rank sums) and expanded over its columns in the range.
void lora_columns(const float* x, int64_t k, float* y, const Group& g, const Part* parts, int64_t num_parts,
                  int64_t c0, int64_t c1) {
    float t[kMaxRank];
    for (int64_t p = 0; p < num_parts; ++p) {
        const Entry* e = entry_of(g, parts[p].site);
        const int64_t lo = std::max(c0, parts[p].col), hi = std::min(c1, parts[p].col + parts[p].width);
        if (e == nullptr || lo >= hi) continue;
        shrink<1>(x, *e, k, t, 0);
        float* yr = y + lo;
        expand<1, 4>(t, 0, e->b + (lo - parts[p].col), parts[p].width, e->rank, hi - lo, &yr);
    }
}

}  // namespace

// One row's projection and its LoRA update in one call (a one-stream decode step): y [1, n] = x [1, k]
// · W (+ bias) + the adapter's update over `parts`, W stored in panels [n / 32, k, 32] (linears/
// panelled.py). Each thread takes a run of panels and then adds the update to those same columns, so
// the update is split over the team as the base is, with no call, fork or barrier of its own; the cost
// is that a part reaching into both threads' columns is shrunk by each (its A read twice, from cache).
// Why: lora_bgmv_f32 after the base's call ran every update on the calling thread, after the team's
// join. Measured on the busy 2-core machine (30 demo-model layers' projections at one row, rank 16,
// 7 rounds, the calling thread's CPU time with idle threads sleeping, the critical path on a quiet
// machine): base + bgmv 1.12x the base alone (median), this call 1.02x.
extern "C" int lora_panel_row_f32(const float* x, int64_t k, const float* panels, const float* bias, float* y,
                                  int64_t n, const Entry* table, int64_t table_len, const Part* parts,
                                  int64_t num_parts) {
    if (k % 8 != 0 || k <= 0 || n < 1 || n % kPanel != 0 || num_parts < 0) return 1;
    const Group g{table, table_len, 0, 1};
    for (int64_t p = 0; p < num_parts; ++p) {
        const Entry* e = entry_of(g, parts[p].site);
        if (e != nullptr && e->rank > kMaxRank) return 1;
        if (parts[p].col < 0 || parts[p].width < 0 || parts[p].col + parts[p].width > n) return 1;
    }
    const int64_t count = n / kPanel;
#pragma omp parallel if (n * k >= kMinParallelElements)  // panel_weights_linear_f32's rule
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = count * me / team, end = count * (me + 1) / team;
        for (int64_t p = first; p < end; ++p)
            panel_row(x, panels + p * k * kPanel, k, bias ? bias + p * kPanel : nullptr, y + p * kPanel);
        if (first < end) lora_columns(x, k, y, g, parts, num_parts, first * kPanel, end * kPanel);
    }
    return 0;
}

// 0: decode-sized calls of several rows on the team, one row inline (above); 1 or 2: always one thread
// or always the team (tests of both ways, benchmarks comparing them). Returns the previous setting.
extern "C" int lora_force_threads(int mode) {
    if (mode < 0 || mode > 2) return -1;
    return forced_threads.exchange(mode);
}
