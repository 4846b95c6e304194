// Decode attention over the paged KV cache, fp32, CPU: one new token per sequence attends over
// its own blocks, read in place. The torch path gathers every sequence's blocks into a padded
// copy first, which reads and writes K/V once more and pads every sequence to the longest;
// reading each cache row once, in block order, is what this kernel is for.
//
// Layouts (all contiguous): q [S, H, D]; caches [num_slots, KVH, D] (V: Dv), slot = block *
// block_size + offset; block_table [S, max_blocks] int64; context_lens [S] int64 (new token
// included); out [S, H, Dv]. D and Dv are multiples of 8; H = G * KVH with G in 1..8.
// window <= 0 and softcap <= 0 mean none.
//
// Built with -fopenmp: the `omp parallel` below runs on the OpenMP runtime torch already loaded
// (same soname), so it shares torch's threads and honours torch.set_num_threads.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec8.h"

namespace {

constexpr int64_t kMinParallelRows = 4096;  // (position, KV head) pairs

struct Problem {
    const float* q;
    const float* k_cache;
    const float* v_cache;
    const int64_t* block_table;
    const int64_t* context_lens;
    float* out;
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, head_dim_v, block_size, max_blocks, window;
    float scale, softcap;
};

// One work item: the KV heads [kvh_begin, kvh_end) of one sequence.
struct Item {
    int64_t seq, kvh_begin, kvh_end;
};

// Calls visit(t, row) for each position t in [start, len) of a sequence, `row` pointing at the
// cache row of its slot (all KV heads). Block by block: divisions stay out of the inner loop.
template <typename Visit>
inline void for_each_row(const Problem& p, const float* cache, int64_t row_size, const int64_t* table,
                         int64_t start, int64_t len, Visit visit) {
    for (int64_t b = start / p.block_size; b * p.block_size < len; ++b) {
        const int64_t first = std::max(start, b * p.block_size), last = std::min(len, (b + 1) * p.block_size);
        const float* row = cache + (table[b] * p.block_size + (first - b * p.block_size)) * row_size;
        // Blocks are scattered: fetch the same row of the next block while this one is computed.
        const bool has_next = (b + 1) * p.block_size < len;
        const float* ahead = has_next ? cache + (table[b + 1] * p.block_size + (first - b * p.block_size)) * row_size
                                      : nullptr;
        for (int64_t t = first; t < last; ++t, row += row_size) {
            if (has_next) {
                for (int64_t f = 0; f < row_size; f += 16) __builtin_prefetch(ahead + f);
                ahead += row_size;
            }
            visit(t, row);
        }
    }
}

// Turns n scores into exp(s - max) in place and returns their sum (softcap applied first).
float exponentiate(float* s, int64_t n, float softcap) {
    if (softcap > 0) {
        for (int64_t i = 0; i < n; ++i) s[i] = std::tanh(s[i] / softcap) * softcap;
    }
    float m = s[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
        s[i] = std::exp(s[i] - m);
        sum += s[i];
    }
    return sum;
}

// Scratch, per thread: weights [heads of the item][n], totals [heads], acc [heads][Dv].
template <int G>
void attend(const Problem& p, const Item& item, float* weights, float* totals, float* acc) {
    const int64_t len = p.context_lens[item.seq];
    const int64_t start = (p.window > 0 && len > p.window) ? len - p.window : 0;
    const int64_t n = len - start;
    const int64_t* table = p.block_table + item.seq * p.max_blocks;
    const int64_t first_head = item.kvh_begin * G, num_heads = (item.kvh_end - item.kvh_begin) * G;
    const float* q = p.q + (item.seq * p.num_heads + first_head) * p.head_dim;
    const int64_t d_chunks = p.head_dim / 8, dv_chunks = p.head_dim_v / 8;

    // Scores: each key row is read once for the G query heads that share it.
    for_each_row(p, p.k_cache, p.num_kv_heads * p.head_dim, table, start, len, [&](int64_t t, const float* row) {
        for (int64_t kvh = item.kvh_begin; kvh < item.kvh_end; ++kvh) {
            const float* k = row + kvh * p.head_dim;
            const int64_t h0 = (kvh - item.kvh_begin) * G;
            v8 sum[G] = {};
            for (int64_t c = 0; c < d_chunks; ++c) {
                const v8 kc = load8(k + 8 * c);
                for (int g = 0; g < G; ++g) sum[g] += load8(q + (h0 + g) * p.head_dim + 8 * c) * kc;
            }
            for (int g = 0; g < G; ++g) weights[(h0 + g) * n + (t - start)] = hsum(sum[g]) * p.scale;
        }
    });
    for (int64_t h = 0; h < num_heads; ++h) totals[h] = exponentiate(weights + h * n, n, p.softcap);

    // Weighted values: each value row is read once, accumulated into every head's output.
    std::fill(acc, acc + num_heads * p.head_dim_v, 0.f);
    for_each_row(p, p.v_cache, p.num_kv_heads * p.head_dim_v, table, start, len, [&](int64_t t, const float* row) {
        for (int64_t kvh = item.kvh_begin; kvh < item.kvh_end; ++kvh) {
            const float* v = row + kvh * p.head_dim_v;
            const int64_t h0 = (kvh - item.kvh_begin) * G;
            float w[G];
            for (int g = 0; g < G; ++g) w[g] = weights[(h0 + g) * n + (t - start)];
            for (int64_t c = 0; c < dv_chunks; ++c) {
                const v8 vc = load8(v + 8 * c);
                for (int g = 0; g < G; ++g) {
                    float* a = acc + (h0 + g) * p.head_dim_v + 8 * c;
                    store8(a, load8(a) + w[g] * vc);
                }
            }
        }
    });
    float* out = p.out + (item.seq * p.num_heads + first_head) * p.head_dim_v;
    for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = 1.f / totals[h];
        for (int64_t d = 0; d < p.head_dim_v; ++d) out[h * p.head_dim_v + d] = acc[h * p.head_dim_v + d] * inv;
    }
}

// Whole sequences when there are enough to keep every thread busy; otherwise one item per KV
// head, so a single long stream still uses all threads.
std::vector<Item> plan_items(const Problem& p) {
    std::vector<Item> items;
    const bool split = p.num_seqs < 4 * omp_get_max_threads();
    for (int64_t s = 0; s < p.num_seqs; ++s) {
        if (split) {
            for (int64_t kvh = 0; kvh < p.num_kv_heads; ++kvh) items.push_back({s, kvh, kvh + 1});
        } else {
            items.push_back({s, 0, p.num_kv_heads});
        }
    }
    return items;
}

template <int G>
void run(const Problem& p) {
    const std::vector<Item> items = plan_items(p);
    int64_t longest = 1, rows = 0;
    for (int64_t s = 0; s < p.num_seqs; ++s) {
        longest = std::max(longest, p.context_lens[s]);
        rows += p.window > 0 ? std::min(p.context_lens[s], p.window) : p.context_lens[s];
    }
    // Waking the other threads costs more than a few thousand cache rows take on one.
    const bool parallel = rows * p.num_kv_heads >= kMinParallelRows;
#pragma omp parallel if (parallel)
    {
        std::vector<float> weights(p.num_heads * longest), totals(p.num_heads), acc(p.num_heads * p.head_dim_v);
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < items.size(); ++i) attend<G>(p, items[i], weights.data(), totals.data(), acc.data());
    }
}

}  // namespace

extern "C" int paged_decode_f32(const float* q, const float* k_cache, const float* v_cache,
                                const int64_t* block_table, const int64_t* context_lens, float* out,
                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t head_dim_v, int64_t block_size, int64_t max_blocks, float scale,
                                int64_t window, float softcap) {
    const Problem p{q, k_cache, v_cache, block_table, context_lens, out, num_seqs, num_heads, num_kv_heads,
                    head_dim, head_dim_v, block_size, max_blocks, window, scale, softcap};
    switch (num_heads / num_kv_heads) {
        case 1: run<1>(p); return 0;
        case 2: run<2>(p); return 0;
        case 3: run<3>(p); return 0;
        case 4: run<4>(p); return 0;
        case 5: run<5>(p); return 0;
        case 6: run<6>(p); return 0;
        case 7: run<7>(p); return 0;
        case 8: run<8>(p); return 0;
        default: return 1;  // the caller falls back to the torch path
    }
}
