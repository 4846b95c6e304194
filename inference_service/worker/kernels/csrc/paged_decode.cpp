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
// - whole rows when there are 2 or more parts per thread: a part takes every KV head of its
//   positions, so a cache block is read as whole rows, and the next block's rows (or the next
//   part's first block) are prefetched whole, spread over the rows of the block being computed:
//   from a cold cache, faster than head by head over strided row slices, which the hardware
//   prefetcher does not follow (benchmarks/paged_decode_bench.py; at 4k-16k tokens of context 1.1x
//   to 1.3x). Each head's arithmetic is the same either way, and so are the results;
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

// Positions [begin, end) of one sequence for the KV heads [kvh_begin, kvh_end); the partial result
// of head kvh goes to slot `slot + (kvh - kvh_begin) * slot_stride`.
struct Part {
    int64_t seq, kvh_begin, kvh_end, begin, end, slot, slot_stride;
};

// Partial softmax state of one head's G query heads: running max, sum of weights, values [G][Dv].
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

// Bytes to prefetch while a block is computed, spread over its rows (row i of n fetches the i-th
// n-th of each range), so the loads of the block are not held up behind a burst of misses.
struct Ahead {
    const char* k;
    int64_t k_bytes;
    const char* v;
    int64_t v_bytes;
};

inline void prefetch_share(const char* base, int64_t bytes, int64_t i, int64_t n) {
    const int64_t lo = bytes * i / n & ~int64_t{63}, hi = bytes * (i + 1) / n;
    for (int64_t f = lo; f < hi; f += 64) __builtin_prefetch(base + f);
}

// The n rows of one block (slots slot0..), for one KV head: G heads' scores, the online
// softmax update, the weighted values. With `slices`, the head's slice of the next block's key rows
// (slot next0..) and of this block's value rows are prefetched row by row (a part of one head
// reads nothing else); otherwise `ahead`, a share of the whole rows read next.
template <typename KV, int G>
void attend_block(const Problem& p, int64_t kvh, int64_t slot0, int64_t n, bool slices, const int64_t* next0,
                  const Ahead& ahead, const float* q_scaled, State state, float* scores) {
    constexpr bool kScaled = std::is_same<KV, int8_t>::value;
    const KV* k_cache = static_cast<const KV*>(p.k_cache);
    const KV* v_cache = static_cast<const KV*>(p.v_cache);
    const int64_t D = p.head_dim, Dv = p.head_dim_v, bs = p.block_size;
    const int64_t k_row = p.num_kv_heads * D, v_row = p.num_kv_heads * Dv;

    // Scores of this block's rows: each key row read once for the G heads.
    for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = slot0 + i;
        const KV* k = k_cache + slot * k_row + kvh * D;
        if (slices) {
            if (next0) prefetch_row(k_cache + (*next0 + i) * k_row + kvh * D, D);  // blocks scatter
            prefetch_row(v_cache + slot * v_row + kvh * Dv, Dv);
        } else {
            prefetch_share(ahead.k, ahead.k_bytes, i, n);
            prefetch_share(ahead.v, ahead.v_bytes, i, n);
        }
        v8 sum[G] = {};
        for (int64_t c = 0; c < D; c += 8) {
            const v8 kc = widen8(k + c);
            for (int g = 0; g < G; ++g) sum[g] += load8(q_scaled + g * D + c) * kc;
        }
        const float k_scale = kScaled ? p.k_scales[slot * p.num_kv_heads + kvh] : 1.f;
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
            for (int64_t i = 0; i < n; ++i) s[i] *= p.v_scales[(slot0 + i) * p.num_kv_heads + kvh];
        }
    }

    // Weighted values: eight lanes of every head's accumulator stay in registers over the block.
    for (int64_t c = 0; c < Dv; c += 8) {
        v8 acc[G];
        for (int g = 0; g < G; ++g) acc[g] = load8(state.acc + g * Dv + c);
        const KV* v = v_cache + slot0 * v_row + kvh * Dv + c;
        for (int64_t i = 0; i < n; ++i, v += v_row) {
            const v8 vc = widen8(v);
            for (int g = 0; g < G; ++g) acc[g] += scores[g * bs + i] * vc;
        }
        for (int g = 0; g < G; ++g) store8(state.acc + g * Dv + c, acc[g]);
    }
}

// q_scaled [KVH][G][D]: the query heads times the softmax scale (the part's heads filled).
// partial: per slot, max [G], sum [G], acc [G][Dv]. scores: scratch [G][block_size].
template <typename KV, int G>
void attend_part(const Problem& p, const Part& part, const Part* following, const float* q_scaled, float* partial,
                 float* scores) {
    const KV* k_cache = static_cast<const KV*>(p.k_cache);
    const KV* v_cache = static_cast<const KV*>(p.v_cache);
    const int64_t D = p.head_dim, Dv = p.head_dim_v, bs = p.block_size, stride = G * (Dv + 2);
    const int64_t k_row = p.num_kv_heads * D, v_row = p.num_kv_heads * Dv;
    const int64_t* table = p.block_table + part.seq * p.max_blocks;
    // A part of every KV head reads whole cache rows: the next block's rows are prefetched whole.
    const bool whole = part.kvh_end - part.kvh_begin == p.num_kv_heads;
    for (int64_t kvh = part.kvh_begin; kvh < part.kvh_end; ++kvh) {
        float* slot = partial + (part.slot + (kvh - part.kvh_begin) * part.slot_stride) * stride;
        for (int g = 0; g < G; ++g) slot[g] = -INFINITY, slot[G + g] = 0.f;
        std::fill(slot + 2 * G, slot + stride, 0.f);
    }

    for (int64_t b = part.begin / bs; b * bs < part.end; ++b) {
        const int64_t first = std::max(part.begin, b * bs), last = std::min(part.end, (b + 1) * bs);
        const int64_t n = last - first, slot0 = table[b] * bs + (first - b * bs);
        const bool has_next = (b + 1) * bs < part.end;
        const int64_t next0 = has_next ? table[b + 1] * bs + (first - b * bs) : 0;
        // Whole rows of the block read next (this part's next, or the following part's first), each
        // head's pass over this block fetching its share.
        int64_t next_slot = 0, next_n = 0;
        if (has_next) {
            next_slot = table[b + 1] * bs, next_n = std::min(part.end, (b + 2) * bs) - (b + 1) * bs;
        } else if (following && following->end > following->begin) {
            const int64_t fb = following->begin / bs;
            next_slot = p.block_table[following->seq * p.max_blocks + fb] * bs + following->begin - fb * bs;
            next_n = std::min(following->end, (fb + 1) * bs) - following->begin;
        }
        const char* k_next = reinterpret_cast<const char*>(k_cache + next_slot * k_row);
        const char* v_next = reinterpret_cast<const char*>(v_cache + next_slot * v_row);
        const int64_t k_bytes = next_n * k_row * static_cast<int64_t>(sizeof(KV)) / p.num_kv_heads;
        const int64_t v_bytes = next_n * v_row * static_cast<int64_t>(sizeof(KV)) / p.num_kv_heads;
        for (int64_t kvh = part.kvh_begin; kvh < part.kvh_end; ++kvh) {
            float* slot = partial + (part.slot + (kvh - part.kvh_begin) * part.slot_stride) * stride;
            const Ahead ahead{k_next + kvh * k_bytes, whole ? k_bytes : 0, v_next + kvh * v_bytes, whole ? v_bytes : 0};
            attend_block<KV, G>(p, kvh, slot0, n, !whole, has_next ? &next0 : nullptr, ahead, q_scaled + kvh * G * D,
                                State{slot, slot + G, slot + 2 * G}, scores);
        }
    }
}

// Each sequence's context is split into parts of at most kSplitRows positions, so a single long
// stream uses every thread and a batch of ragged lengths balances. A part takes every KV head of its
// positions where there are enough parts to keep every thread busy (each cache row is then read
// whole, in order), else one KV head. Each head computes the same in both, so the results do not
// depend on which (nor on the number of threads). first_slot[seq * KVH + kvh]: the first of that
// head's partial slots, one per part of its context.
std::vector<Part> plan_parts(const Problem& p, std::vector<int64_t>& first_slot) {
    auto splits_of = [&](int64_t s) {
        const int64_t len = p.context_lens[s], start = window_start(p, len);
        return std::max<int64_t>(1, (len - start + kSplitRows - 1) / kSplitRows);
    };
    int64_t whole_parts = 0;
    for (int64_t s = 0; s < p.num_seqs; ++s) whole_parts += splits_of(s);
    const bool whole = whole_parts >= 2 * omp_get_max_threads();  // 4: 3-7% slower at 4-7 parts on 2 threads
    std::vector<Part> parts;
    int64_t slots = 0;
    for (int64_t s = 0; s < p.num_seqs; ++s) {
        const int64_t len = p.context_lens[s], start = window_start(p, len), splits = splits_of(s);
        for (int64_t j = 0; j < splits && whole; ++j) {  // head kvh's slot of part j: slots + kvh * splits + j
            parts.push_back({s, 0, p.num_kv_heads, start + (len - start) * j / splits,
                             start + (len - start) * (j + 1) / splits, slots + j, splits});
        }
        for (int64_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
            first_slot.push_back(slots);
            for (int64_t j = 0; j < splits && !whole; ++j) {
                parts.push_back({s, kvh, kvh + 1, start + (len - start) * j / splits,
                                 start + (len - start) * (j + 1) / splits, slots + j, 1});
            }
            slots += splits;
        }
    }
    first_slot.push_back(slots);
    return parts;
}

template <typename KV, int G>
void run(const Problem& p) {
    std::vector<int64_t> first_slot;
    const std::vector<Part> parts = plan_parts(p, first_slot);
    const int64_t D = p.head_dim, Dv = p.head_dim_v, stride = G * (Dv + 2);
    std::vector<float> partial(first_slot.back() * stride);  // per slot: max [G], sum [G], acc [G][Dv]
    int64_t rows = 0;
    for (const Part& part : parts) rows += (part.end - part.begin) * (part.kvh_end - part.kvh_begin);
    const bool parallel = rows >= kMinParallelRows;  // waking threads costs more than a few rows take
#pragma omp parallel if (parallel)
    {
        std::vector<float> q_scaled(p.num_kv_heads * G * D), scores(G * p.block_size);
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < parts.size(); ++i) {
            const Part& part = parts[i];
            const float* q = p.q + part.seq * p.num_heads * D;
            for (int64_t d = part.kvh_begin * G * D; d < part.kvh_end * G * D; ++d) q_scaled[d] = q[d] * p.scale;
            // The part this thread likely takes next (one team ahead; on one thread, surely): its first
            // block is fetched ahead too. From a cold cache, 3-7% less time at 4k-16k tokens of context.
            const size_t team = static_cast<size_t>(omp_get_num_threads());
            const Part* following = i + team < parts.size() ? &parts[i + team] : nullptr;
            attend_part<KV, G>(p, part, following, q_scaled.data(), partial.data(), scores.data());
        }
        // Merge the parts of each (sequence, KV head): rescale each to the largest max, then divide.
        // An empty context leaves its slot with no weight: its output is zeros.
#pragma omp for schedule(static)
        for (int64_t item = 0; item < p.num_seqs * p.num_kv_heads; ++item) {
            const int64_t seq = item / p.num_kv_heads, kvh = item % p.num_kv_heads;
            float* out = p.out + (seq * p.num_heads + kvh * G) * Dv;
            for (int g = 0; g < G; ++g) {
                float best = -INFINITY;
                for (int64_t j = first_slot[item]; j < first_slot[item + 1]; ++j) best = std::max(best, partial[j * stride + g]);
                float total = 0.f;
                std::fill(out + g * Dv, out + (g + 1) * Dv, 0.f);
                for (int64_t j = first_slot[item]; j < first_slot[item + 1]; ++j) {
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
