// The small ops between a bfloat16 model's decode-step projections (runner/decode_step.py), one call
// each, as decode_glue.cpp does for fp32. In torch each is several bf16 ops, a few microseconds of
// dispatch apiece for almost no arithmetic: about 30 per layer, more than the layer's projections
// once those stream bf16 weights at memory speed.
//
// They round where transformers' bf16 modules round, so the step computes what its layers compute:
// every torch op on bf16 tensors computes in fp32 and rounds its result to bf16 (nearest, ties to
// even), so each op here rounds at the same points:
// - add_rms_norm: hidden = bf16(hidden + delta); out = bf16(weight * bf16(h * rsqrt(mean(h^2) + eps)))
//   with h = hidden in fp32 (LlamaRMSNorm);
// - rope_kv_write: x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)) for q and k (Qwen3's per-head
//   Q/K norm first, as RMSNorm above), and k and v copied into a bf16 paged cache at their slots
//   (caches null: another KV dtype, converted by the caller);
// - silu_mul: bf16(bf16(silu(gate)) * up).
//
// Arrays contiguous bf16 (uint16 bits). A prompt's many rows are split over threads by row, as in
// decode_glue.cpp; a decode step's few stay on the calling thread.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "parallel_threshold.h"

namespace {

inline float widen(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

inline uint16_t narrow(float f) {  // nearest, ties to even; NaN stays NaN
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

inline float round_bf16(float f) { return widen(narrow(f)); }

// out = bf16(weight * bf16(x * rsqrt(mean(x^2) + eps))) over n values (out may be x).
void rms_norm(const uint16_t* x, const uint16_t* weight, float eps, int64_t n, uint16_t* out) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += widen(x[i]) * widen(x[i]);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = narrow(widen(weight[i]) * round_bf16(widen(x[i]) * inv));
}

// x (dim values) rotated in place: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
void rotate(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = widen(x[i]), b = widen(x[i + half]);
        x[i] = narrow(round_bf16(a * widen(cos[i])) + round_bf16(-b * widen(sin[i])));
        x[i + half] = narrow(round_bf16(b * widen(cos[i + half])) + round_bf16(a * widen(sin[i + half])));
    }
}

}  // namespace

extern "C" int add_rms_norm_bf16(uint16_t* hidden, const uint16_t* delta, const uint16_t* weight, uint16_t* out,
                                 int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t* h = hidden + r * dim;
        if (delta) {
            const uint16_t* d = delta + r * dim;
            for (int64_t i = 0; i < dim; ++i) h[i] = narrow(widen(h[i]) + widen(d[i]));
        }
        rms_norm(h, weight, eps, dim, out + r * dim);
    }
    return 0;
}

// qkv [rows, heads + 2 * kv_heads, dim]; cos, sin [rows, dim]; q_norm, k_norm [dim] or null;
// key_cache, value_cache [slots, kv_heads, dim] bf16 or null; slots [rows].
extern "C" int rope_kv_write_bf16(uint16_t* qkv, const uint16_t* cos, const uint16_t* sin, const uint16_t* q_norm,
                                  const uint16_t* k_norm, float eps, uint16_t* key_cache, uint16_t* value_cache,
                                  const int64_t* slots, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim) {
    if (dim % 2) return 1;
    const int64_t row_width = (heads + 2 * kv_heads) * dim, kv_width = kv_heads * dim;
#pragma omp parallel for schedule(static) if (rows * row_width >= kMinParallelElements)  // rows write apart: a slot each
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t* row = qkv + r * row_width;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
            uint16_t* x = row + h * dim;
            const uint16_t* norm = h < heads ? q_norm : k_norm;
            if (norm) rms_norm(x, norm, eps, dim, x);
            rotate(x, cos + r * dim, sin + r * dim, dim);
        }
        if (key_cache && value_cache) {
            std::memcpy(key_cache + slots[r] * kv_width, row + heads * dim, kv_width * sizeof(uint16_t));
            std::memcpy(value_cache + slots[r] * kv_width, row + (heads + kv_heads) * dim, kv_width * sizeof(uint16_t));
        }
    }
    return 0;
}

// gate_up [rows, 2 * width] (gate | up) → out [rows, width].
extern "C" int silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static) if (rows * width >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* gate = gate_up + r * 2 * width;
        const uint16_t* up = gate + width;
        uint16_t* o = out + r * width;
        for (int64_t i = 0; i < width; ++i) {
            const float g = widen(gate[i]);
            o[i] = narrow(round_bf16(g / (1.f + std::exp(-g))) * widen(up[i]));
        }
    }
    return 0;
}
