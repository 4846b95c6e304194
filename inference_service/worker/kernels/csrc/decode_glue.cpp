// The small ops between a decode step's projections (runner/decode_step.py), one call each instead
// of the several torch ops each takes. At decode sizes every torch op costs a few microseconds
// of dispatch for almost no arithmetic; these run the same math in a single pass over a few rows.
//
// - add_rms_norm: hidden += delta (the residual), then out = weight * rmsnorm(hidden);
// - rope_kv_write: per-head RMSNorm of q and k (Qwen3, optional), the rotary embedding of q and k
//   in place (rotate-half convention: x * cos + rotate_half(x) * sin), and k and v copied into the
//   paged cache at their slots (an fp32 cache; for another dtype the caches are null and
//   kv_write.cpp converts the rows);
// - silu_mul: out = silu(gate) * up, from the fused gate|up projection.
//
// Arrays contiguous fp32. A decode step's few rows run on the calling thread; a prompt's many rows
// (the same calls prefill through) are split over threads by row: single-threaded, these and
// kv_write.cpp took ~10% of a 2,048-token prompt step of the demo model (profiled) while the other
// core waited; split, silu_mul at 2,048 x 1,536 takes 2.3 -> 1.3 ms, add_rms_norm at 2,048 x 576
// 0.87 -> 0.36 ms. Each row's math is unchanged, so the results are the same bits.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "parallel_threshold.h"
#include "vec8.h"

namespace {

// weight * x / sqrt(mean(x^2) + eps), over n floats (out may be x).
void rms_norm(const float* x, const float* weight, float eps, int64_t n, float* out) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

// exp of 8 floats, within 2 ulp of expf (the scalar call the compiler makes costs ~3 ns a value: a
// 16-row decode step of the demo model spent 2 ms in it). x = n ln2 + r with |r| <= ln2 / 2 (ln2
// split in two so n ln2 is exact), exp(r) by Cephes' expf polynomial, 2^n built in the exponent bits.
// Inputs are clamped: below so 2^n stays normal, above so a too-large x gives inf, as expf does
// (from 88.4 on, a little before expf).
inline v8 exp8(v8 x) {
    typedef int32_t i32x8 __attribute__((vector_size(32)));
    x = x < -87.3f ? v8{} - 87.3f : x;
    x = x > 88.7f ? v8{} + 88.7f : x;
    const v8 t = x * 1.44269504088896341f;
    const i32x8 n = __builtin_convertvector(t + (t < 0 ? v8{} - 0.5f : v8{} + 0.5f), i32x8);  // round
    const v8 nf = __builtin_convertvector(n, v8);
    const v8 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
    v8 p = v8{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    const i32x8 scale = (n + 127) << 23;
    v8 two_n;
    std::memcpy(&two_n, &scale, sizeof(two_n));
    return p * two_n;
}

// x (dim floats) rotated in place: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
void rotate(float* x, const float* cos, const float* sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

}  // namespace

extern "C" int add_rms_norm_f32(float* hidden, const float* delta, const float* weight, float* out, int64_t rows,
                                int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
        float* h = hidden + r * dim;
        if (delta) {
            const float* d = delta + r * dim;
            for (int64_t i = 0; i < dim; ++i) h[i] += d[i];
        }
        rms_norm(h, weight, eps, dim, out + r * dim);
    }
    return 0;
}

// qkv [rows, heads + 2 * kv_heads, dim]; cos, sin [rows, dim]; q_norm, k_norm [dim] or null;
// key_cache, value_cache [slots, kv_heads, dim]; slots [rows].
extern "C" int rope_kv_write_f32(float* qkv, const float* cos, const float* sin, const float* q_norm,
                                 const float* k_norm, float eps, float* key_cache, float* value_cache,
                                 const int64_t* slots, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim) {
    if (dim % 2) return 1;
    const int64_t row_width = (heads + 2 * kv_heads) * dim, kv_width = kv_heads * dim;
#pragma omp parallel for schedule(static) if (rows * row_width >= kMinParallelElements)  // rows write apart: a slot each
    for (int64_t r = 0; r < rows; ++r) {
        float* row = qkv + r * row_width;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
            float* x = row + h * dim;
            const float* norm = h < heads ? q_norm : k_norm;
            if (norm) rms_norm(x, norm, eps, dim, x);
            rotate(x, cos + r * dim, sin + r * dim, dim);
        }
        if (key_cache && value_cache) {
            std::memcpy(key_cache + slots[r] * kv_width, row + heads * dim, kv_width * sizeof(float));
            std::memcpy(value_cache + slots[r] * kv_width, row + (heads + kv_heads) * dim, kv_width * sizeof(float));
        }
    }
    return 0;
}

// gate_up [rows, 2 * width] (gate | up) → out [rows, width].
extern "C" int silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static) if (rows * width >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
        const float* gate = gate_up + r * 2 * width;
        const float* up = gate + width;
        float* o = out + r * width;
        int64_t i = 0;
        for (; i + 8 <= width; i += 8) {
            const v8 g = load8(gate + i);
            store8(o + i, g / (1.f + exp8(-g)) * load8(up + i));
        }
        for (; i < width; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
    return 0;
}
