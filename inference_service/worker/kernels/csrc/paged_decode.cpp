// Decode attention over the paged KV cache, CPU: one new token per sequence attends over its own
// blocks, read in place in the cache's own element type (kv_types.h). The torch path gathers every
// sequence's blocks into a padded fp32 copy first; at long contexts that copy is most of a step.
//
// How the cache is read (flash-decoding on a CPU):
// - each KV row is read once per step for all G query heads that share it (grouped-query);
// - online softmax: block by block, the scores of the block's rows, a running max and sum per
//   head, and the weighted values accumulated with one rescale per block, so keys and values are
//   read in one pass, without a scores buffer as long as the context;
// - split along the context: each (sequence, KV head) runs as parts of at most kSplitRows
//   positions, computed in parallel and merged at the end (max, rescaled sums). The split does not
//   depend on the number of threads, so neither do the results; a single long stream uses every
//   thread, and a batch of ragged lengths balances;
// - eight fp32 lanes (vec8.h: AVX2 or AVX-512VL with -march=native); keys and values widened from
//   fp16/bf16/int8 eight at a time as they are read, int8 scales folded into the score and the
//   weight of each row.
//
// Layouts (all contiguous): q [S, H, D] fp32; caches [num_slots, KVH, D] (V: Dv), slot = block *
// block_size + offset; scales [num_slots, KVH] fp32 (int8 only); block_table [S, max_blocks]
// int64; context_lens [S] int64 (new token included); out [S, H, Dv] fp32. D and Dv are
// multiples of 8; H = G * KVH with G in 1..8. window <= 0 and softcap <= 0 mean none.
//
// Built with -fopenmp: the `omp parallel` below runs on the OpenMP runtime torch already loaded
// (same soname), so it shares torch's threads and honours torch.set_num_threads.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kv_types.h"
#include "vec8.h"

namespace {

constexpr int64_t kMinParallelRows = 4096;  // (position, KV head) pairs: below, one thread is faster
constexpr int64_t kSplitRows = 256;         // positions per part of a split context

struct Problem {
    const float* q;
    const void* k_cache;
    const void* v_cache;
    const float* k_scales;
    const float* v_scales;
    const int64_t* block_table;
    const int64_t* context_lens;
    float* out;
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, head_dim_v, block_size, max_blocks, window;
    float scale, softcap;
};

// Positions [begin, end) of one sequence for one KV head; its partial result goes to slot `index`.
struct Part {
    int64_t seq, kvh, begin, end;
};

// Partial softmax state of one part's G heads: running max, sum of weights, weighted values [G][Dv].
struct State {
    float* max;
    float* sum;
    float* acc;
};

inline int64_t window_start(const Problem& p, int64_t len) {
    return (p.window > 0 && len > p.window) ? len - p.window : 0;
}

template <typename KV>
inline void prefetch_row(const KV* row, int64_t count) {
    for (int64_t f = 0; f < count * static_cast<int64_t>(sizeof(KV)); f += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(row) + f);
    }
}

// q_scaled [G][D]: the part's query heads times the softmax scale. scores: scratch [G][block_size].
template <typename KV, int G>
void attend_part(const Problem& p, const Part& part, const float* q_scaled, State state, float* scores) {
    constexpr bool kScaled = std::is_same<KV, int8_t>::value;
    const KV* k_cache = static_cast<const KV*>(p.k_cache);
    const KV* v_cache = static_cast<const KV*>(p.v_cache);
    const int64_t D = p.head_dim, Dv = p.head_dim_v, bs = p.block_size;
    const int64_t k_row = p.num_kv_heads * D, v_row = p.num_kv_heads * Dv;
    const int64_t* table = p.block_table + part.seq * p.max_blocks;
    for (int g = 0; g < G; ++g) state.max[g] = -INFINITY, state.sum[g] = 0.f;
    std::fill(state.acc, state.acc + G * Dv, 0.f);

    for (int64_t b = part.begin / bs; b * bs < part.end; ++b) {
        const int64_t first = std::max(part.begin, b * bs), last = std::min(part.end, (b + 1) * bs);
        const int64_t n = last - first, slot0 = table[b] * bs + (first - b * bs);
        const bool has_next = (b + 1) * bs < part.end;
        const int64_t next_slot0 = has_next ? table[b + 1] * bs + (first - b * bs) : 0;

        // Scores of this block's rows: each key row read once for the G heads.
        for (int64_t i = 0; i < n; ++i) {
            const int64_t slot = slot0 + i;
            const KV* k = k_cache + slot * k_row + part.kvh * D;
            if (has_next) prefetch_row(k_cache + (next_slot0 + i) * k_row + part.kvh * D, D);  // blocks scatter
            prefetch_row(v_cache + slot * v_row + part.kvh * Dv, Dv);
            v8 sum[G] = {};
            for (int64_t c = 0; c < D; c += 8) {
                const v8 kc = widen8(k + c);
                for (int g = 0; g < G; ++g) sum[g] += load8(q_scaled + g * D + c) * kc;
            }
            const float k_scale = kScaled ? p.k_scales[slot * p.num_kv_heads + part.kvh] : 1.f;
            for (int g = 0; g < G; ++g) scores[g * bs + i] = hsum(sum[g]) * k_scale;
        }

        // Online softmax: new running max, earlier sums rescaled once per block, weights of this block.
        for (int g = 0; g < G; ++g) {
            float* s = scores + g * bs;
            if (p.softcap > 0) {
                for (int64_t i = 0; i < n; ++i) s[i] = std::tanh(s[i] / p.softcap) * p.softcap;
            }
            float block_max = s[0];
            for (int64_t i = 1; i < n; ++i) block_max = std::max(block_max, s[i]);
            const float new_max = std::max(state.max[g], block_max);
            if (new_max > state.max[g] && state.sum[g] > 0.f) {
                const float correction = std::exp(state.max[g] - new_max);
                state.sum[g] *= correction;
                for (int64_t d = 0; d < Dv; ++d) state.acc[g * Dv + d] *= correction;
            }
            state.max[g] = new_max;
            float total = 0.f;
#pragma omp simd reduction(+ : total)
            for (int64_t i = 0; i < n; ++i) {
                s[i] = std::exp(s[i] - new_max);
                total += s[i];
            }
            state.sum[g] += total;
            if (kScaled) {
                for (int64_t i = 0; i < n; ++i) s[i] *= p.v_scales[(slot0 + i) * p.num_kv_heads + part.kvh];
            }
        }

        // Weighted values: eight lanes of every head's accumulator stay in registers over the block.
        for (int64_t c = 0; c < Dv; c += 8) {
            v8 acc[G];
            for (int g = 0; g < G; ++g) acc[g] = load8(state.acc + g * Dv + c);
            const KV* v = v_cache + slot0 * v_row + part.kvh * Dv + c;
            for (int64_t i = 0; i < n; ++i, v += v_row) {
                const v8 vc = widen8(v);
                for (int g = 0; g < G; ++g) acc[g] += scores[g * bs + i] * vc;
            }
            for (int g = 0; g < G; ++g) store8(state.acc + g * Dv + c, acc[g]);
        }
    }
}

// Parts of every (sequence, KV head), in that order, each at most kSplitRows positions long.
std::vector<Part> plan_parts(const Problem& p, std::vector<int64_t>& first_part) {
    std::vector<Part> parts;
    for (int64_t s = 0; s < p.num_seqs; ++s) {
        const int64_t len = p.context_lens[s], start = window_start(p, len);
        const int64_t splits = std::max<int64_t>(1, (len - start + kSplitRows - 1) / kSplitRows);
        for (int64_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
            first_part.push_back(static_cast<int64_t>(parts.size()));
            for (int64_t j = 0; j < splits; ++j) {
                parts.push_back({s, kvh, start + (len - start) * j / splits, start + (len - start) * (j + 1) / splits});
            }
        }
    }
    first_part.push_back(static_cast<int64_t>(parts.size()));
    return parts;
}

template <typename KV, int G>
void run(const Problem& p) {
    std::vector<int64_t> first_part;
    const std::vector<Part> parts = plan_parts(p, first_part);
    const int64_t D = p.head_dim, Dv = p.head_dim_v, stride = G * (Dv + 2);
    std::vector<float> partial(parts.size() * stride);  // per part: max [G], sum [G], acc [G][Dv]
    int64_t rows = 0;
    for (const Part& part : parts) rows += part.end - part.begin;
    const bool parallel = rows >= kMinParallelRows;  // waking threads costs more than a few rows take
#pragma omp parallel if (parallel)
    {
        std::vector<float> q_scaled(G * D), scores(G * p.block_size);
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < parts.size(); ++i) {
            const Part& part = parts[i];
            const float* q = p.q + (part.seq * p.num_heads + part.kvh * G) * D;
            for (int64_t d = 0; d < G * D; ++d) q_scaled[d] = q[d] * p.scale;
            float* slot = partial.data() + i * stride;
            if (part.end > part.begin) {
                attend_part<KV, G>(p, part, q_scaled.data(), State{slot, slot + G, slot + 2 * G}, scores.data());
            } else {  // an empty context: no weight, no value
                std::fill(slot, slot + stride, 0.f);
                for (int g = 0; g < G; ++g) slot[g] = -INFINITY;
            }
        }
        // Merge the parts of each (sequence, KV head): rescale each to the largest max, then divide.
#pragma omp for schedule(static)
        for (int64_t item = 0; item < p.num_seqs * p.num_kv_heads; ++item) {
            const int64_t seq = item / p.num_kv_heads, kvh = item % p.num_kv_heads;
            float* out = p.out + (seq * p.num_heads + kvh * G) * Dv;
            for (int g = 0; g < G; ++g) {
                float best = -INFINITY;
                for (int64_t j = first_part[item]; j < first_part[item + 1]; ++j) best = std::max(best, partial[j * stride + g]);
                float total = 0.f;
                std::fill(out + g * Dv, out + (g + 1) * Dv, 0.f);
                for (int64_t j = first_part[item]; j < first_part[item + 1]; ++j) {
                    const float* slot = partial.data() + j * stride;
                    if (slot[G + g] == 0.f) continue;
                    const float weight = std::exp(slot[g] - best);
                    total += weight * slot[G + g];
                    const float* acc = slot + 2 * G + g * Dv;
                    for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] += weight * acc[d];
                }
                const float inv = total > 0.f ? 1.f / total : 0.f;
                for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] *= inv;
            }
        }
    }
}

template <typename KV>
int dispatch_groups(const Problem& p) {
    switch (p.num_heads / p.num_kv_heads) {
        case 1: run<KV, 1>(p); return 0;
        case 2: run<KV, 2>(p); return 0;
        case 3: run<KV, 3>(p); return 0;
        case 4: run<KV, 4>(p); return 0;
        case 5: run<KV, 5>(p); return 0;
        case 6: run<KV, 6>(p); return 0;
        case 7: run<KV, 7>(p); return 0;
        case 8: run<KV, 8>(p); return 0;
        default: return 1;  // the caller falls back to the torch path
    }
}

}  // namespace

extern "C" int paged_decode(const float* q, const void* k_cache, const void* v_cache, const float* k_scales,
                            const float* v_scales, const int64_t* block_table, const int64_t* context_lens,
                            float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t head_dim_v, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                            float softcap, int64_t kv_dtype) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim % 8 || head_dim_v % 8) return 1;
    const Problem p{q,          k_cache,      v_cache, k_scales, v_scales, block_table, context_lens,
                    out,        num_seqs,     num_heads, num_kv_heads, head_dim, head_dim_v, block_size,
                    max_blocks, window,       scale,   softcap};
    switch (kv_dtype) {
        case kKVF32: return dispatch_groups<float>(p);
        case kKVF16: return dispatch_groups<Half>(p);
        case kKVBF16: return dispatch_groups<BFloat16>(p);
        case kKVI8: return (k_scales && v_scales) ? dispatch_groups<int8_t>(p) : 1;
        default: return 1;
    }
}
