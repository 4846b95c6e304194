// Writes new K/V rows into the paged cache, converted to the cache's element type (kv_types.h):
// a decode step writes one row per sequence and layer, where torch's conversion ops would cost
// more in dispatch than the copy itself.
//
// k [rows, k_stride] and v [rows, v_stride] fp32, the first KVH * D (Dv) floats of each row being
// the row's heads; caches [num_slots, KVH, D] (V: Dv); scales [num_slots, KVH] (int8 only).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kv_types.h"
#include "parallel_threshold.h"

namespace {

void write_row(const float* x, void* cache, float* scales, int64_t slot, int64_t heads, int64_t dim,
               int64_t dtype) {
    const int64_t width = heads * dim, base = slot * width;
    switch (dtype) {
        case kKVF32:
            std::memcpy(static_cast<float*>(cache) + base, x, width * sizeof(float));
            break;
        case kKVF16: {
            uint16_t* out = static_cast<uint16_t*>(cache) + base;
            for (int64_t i = 0; i < width; ++i) out[i] = float_to_half(x[i]);
            break;
        }
        case kKVBF16: {
            uint16_t* out = static_cast<uint16_t*>(cache) + base;
            for (int64_t i = 0; i < width; ++i) out[i] = float_to_bf16(x[i]);
            break;
        }
        case kKVI8: {
            int8_t* out = static_cast<int8_t*>(cache) + base;
            for (int64_t h = 0; h < heads; ++h) {
                const float* head = x + h * dim;
                float amax = 0.f;
                for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(head[i]));
                const float scale = amax / 127.f;
                scales[slot * heads + h] = scale;
                for (int64_t i = 0; i < dim; ++i) {
                    const float code = scale > 0.f ? std::nearbyint(head[i] / scale) : 0.f;
                    out[h * dim + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
                }
            }
            break;
        }
    }
}

}  // namespace

extern "C" int kv_write(const float* k, int64_t k_stride, const float* v, int64_t v_stride, void* k_cache,
                        void* v_cache, float* k_scales, float* v_scales, const int64_t* slots, int64_t rows,
                        int64_t kv_heads, int64_t head_dim, int64_t head_dim_v, int64_t kv_dtype) {
    if (kv_dtype < kKVF32 || kv_dtype > kKVI8 || (kv_dtype == kKVI8 && !(k_scales && v_scales))) return 1;
    // A prompt's rows over threads (each its own slot, so they write apart); a decode step's few here.
#pragma omp parallel for schedule(static) if (rows * kv_heads * (head_dim + head_dim_v) >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
        write_row(k + r * k_stride, k_cache, k_scales, slots[r], kv_heads, head_dim, kv_dtype);
        write_row(v + r * v_stride, v_cache, v_scales, slots[r], kv_heads, head_dim_v, kv_dtype);
    }
    return 0;
}
