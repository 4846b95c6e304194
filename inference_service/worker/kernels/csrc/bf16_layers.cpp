// All decoder layers of a bfloat16 Llama-style model's decode step in one call (runner/bf16_layers.py).
//
// Run op by op from Python, a layer is four projections, four glue calls and the attention kernel,
// each reached through ctypes, an nn.Module call and a few tensor allocations, plus the attention's
// q widened to fp32 and its output narrowed back by two torch ops: ~1/3 of a one-stream step of the
// demo model once its bf16 weights stream at memory speed. Here the same kernels run in the same
// order on the same bf16 values (bf16_linear.cpp, bf16_glue.cpp, paged_decode.cpp), so the result is
// bitwise the op-by-op plan's; only the calls between them are gone.
//
// `table` holds each layer's pointers (kField entries per layer, 0 for none; see the enum) and its
// sliding window. The residual stream `hidden` [rows, dim] is updated in place and ends with the last
// layer's MLP output added. The KV cache is bf16.

#include <cstdint>
#include <cstring>
#include <vector>

extern "C" int small_batch_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                                       int64_t m, int64_t n, int64_t k);
extern "C" int add_rms_norm_bf16(uint16_t* hidden, const uint16_t* delta, const uint16_t* weight, uint16_t* out,
                                 int64_t rows, int64_t dim, float eps);
extern "C" int rope_kv_write_bf16(uint16_t* qkv, const uint16_t* cos, const uint16_t* sin, const uint16_t* q_norm,
                                  const uint16_t* k_norm, float eps, uint16_t* key_cache, uint16_t* value_cache,
                                  const int64_t* slots, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim);
extern "C" int silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t width);
extern "C" int paged_decode(const float* q, const void* k_cache, const void* v_cache, const float* k_scales,
                            const float* v_scales, const int64_t* block_table, const int64_t* context_lens,
                            float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t head_dim_v, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                            float softcap, int64_t kv_dtype);

namespace {

// A layer's entries in `table` (runner/bf16_layers.py writes them in this order).
enum Field : int64_t {
    kInputNorm,
    kPostNorm,
    kQkv,
    kQkvBias,
    kO,
    kOBias,
    kGateUp,
    kGateUpBias,
    kDown,
    kDownBias,
    kQNorm,
    kKNorm,
    kKeyCache,
    kValueCache,
    kWindow,
    kField,  // entries per layer
};

constexpr int64_t kBF16Cache = 2;  // kv_types.h's KVDtype for bf16

template <typename T>
T* at(const int64_t* layer, Field field) {
    return reinterpret_cast<T*>(layer[field]);
}

inline float widen(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

inline uint16_t narrow(float f) {  // nearest, ties to even; NaN stays NaN (as torch's .to(bfloat16))
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

extern "C" int bf16_decode_layers(const int64_t* table, int64_t layers, uint16_t* hidden, const uint16_t* cos,
                                  const uint16_t* sin, const int64_t* slots, const int64_t* block_table,
                                  const int64_t* context_lens, int64_t rows, int64_t max_blocks, int64_t block_size,
                                  int64_t dim, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                  int64_t intermediate, float norm_eps, float qk_eps, float scale) {
    const int64_t q_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    std::vector<uint16_t> normed(rows * dim), qkv(rows * qkv_width), attended(rows * q_width);
    std::vector<uint16_t> projected(rows * dim), gate_up(rows * 2 * intermediate), act(rows * intermediate);
    std::vector<uint16_t> delta(rows * dim);
    std::vector<float> q(rows * q_width), attended_f32(rows * q_width);
    int status = 0;
    for (int64_t l = 0; l < layers && status == 0; ++l) {
        const int64_t* layer = table + l * kField;
        status |= add_rms_norm_bf16(hidden, l ? delta.data() : nullptr, at<uint16_t>(layer, kInputNorm),
                                    normed.data(), rows, dim, norm_eps);
        status |= small_batch_linear_bf16(normed.data(), at<uint16_t>(layer, kQkv), at<uint16_t>(layer, kQkvBias),
                                          qkv.data(), rows, qkv_width, dim);
        status |= rope_kv_write_bf16(qkv.data(), cos, sin, at<uint16_t>(layer, kQNorm), at<uint16_t>(layer, kKNorm),
                                     qk_eps, at<uint16_t>(layer, kKeyCache), at<uint16_t>(layer, kValueCache), slots,
                                     rows, heads, kv_heads, head_dim);
        for (int64_t r = 0; r < rows; ++r)  // the attention kernel takes q in fp32: exact
            for (int64_t i = 0; i < q_width; ++i) q[r * q_width + i] = widen(qkv[r * qkv_width + i]);
        status |= paged_decode(q.data(), at<void>(layer, kKeyCache), at<void>(layer, kValueCache), nullptr, nullptr,
                               block_table, context_lens, attended_f32.data(), rows, heads, kv_heads, head_dim,
                               head_dim, block_size, max_blocks, scale, layer[kWindow], 0.f, kBF16Cache);
        for (int64_t i = 0; i < rows * q_width; ++i) attended[i] = narrow(attended_f32[i]);
        status |= small_batch_linear_bf16(attended.data(), at<uint16_t>(layer, kO), at<uint16_t>(layer, kOBias),
                                          projected.data(), rows, dim, q_width);
        status |= add_rms_norm_bf16(hidden, projected.data(), at<uint16_t>(layer, kPostNorm), normed.data(), rows,
                                    dim, norm_eps);
        status |= small_batch_linear_bf16(normed.data(), at<uint16_t>(layer, kGateUp), at<uint16_t>(layer, kGateUpBias),
                                          gate_up.data(), rows, 2 * intermediate, dim);
        status |= silu_mul_bf16(gate_up.data(), act.data(), rows, intermediate);
        status |= small_batch_linear_bf16(act.data(), at<uint16_t>(layer, kDown), at<uint16_t>(layer, kDownBias),
                                          delta.data(), rows, dim, intermediate);
    }
    if (status == 0 && layers > 0)
        for (int64_t i = 0; i < rows * dim; ++i) hidden[i] = narrow(widen(hidden[i]) + widen(delta[i]));
    return status;
}
