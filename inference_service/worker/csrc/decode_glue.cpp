// The small ops between a decode step's projections (worker/decode_step.py), one call each instead
// of the several torch ops each takes. At decode sizes every torch op costs a few microseconds
// of dispatch for almost no arithmetic; these run the same math in a single pass over a few rows.
//
// - add_rms_norm: hidden += delta (the residual), then out = weight * rmsnorm(hidden);
// - rope_kv_write: per-head RMSNorm of q and k (Qwen3, optional), the rotary embedding of q and k
//   in place (rotate-half convention: x * cos + rotate_half(x) * sin), and k and v copied into the
//   paged cache at their slots;
// - silu_mul: out = silu(gate) * up, from the fused gate|up projection.
//
// Arrays contiguous fp32; rows are few, so no threads.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// weight * x / sqrt(mean(x^2) + eps), over n floats (out may be x).
void rms_norm(const float* x, const float* weight, float eps, int64_t n, float* out) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
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
    for (int64_t r = 0; r < rows; ++r) {
        float* row = qkv + r * row_width;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
            float* x = row + h * dim;
            const float* norm = h < heads ? q_norm : k_norm;
            if (norm) rms_norm(x, norm, eps, dim, x);
            rotate(x, cos + r * dim, sin + r * dim, dim);
        }
        std::memcpy(key_cache + slots[r] * kv_width, row + heads * dim, kv_width * sizeof(float));
        std::memcpy(value_cache + slots[r] * kv_width, row + (heads + kv_heads) * dim, kv_width * sizeof(float));
    }
    return 0;
}

// gate_up [rows, 2 * width] (gate | up) → out [rows, width].
extern "C" int silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* gate = gate_up + r * 2 * width;
        const float* up = gate + width;
        float* o = out + r * width;
        for (int64_t i = 0; i < width; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
    return 0;
}
