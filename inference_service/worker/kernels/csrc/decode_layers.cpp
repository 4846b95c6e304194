// All decoder layers of an fp32 Llama-style model's decode step in one call (runner/fused_layers.py),
// LoRA updates included.
//
// Op by op from Python, each layer is four projections, three glue calls, the K/V conversion and the
// attention, each reached through an nn.Module call, ctypes and fresh tensors: ~2.7 ms of a one-stream
// demo-model token on this CPU, none of it split over threads. Here the same C entry points run in
// the same order on the same floats, so the result is bitwise the op-by-op plan's; only the calls
// between them are gone.
//
// A projection is one of (Kind): fp32 weights in panels (panel_linear.cpp's panel_weights_linear_f32,
// as linears/panelled.py calls it), packed 4/8-bit codes (the few-rows kernel the QuantLinear bound,
// quant_linear.cpp's or the int8-activation one, passed as a function pointer; more rows go to
// panel_quant_linear_f32 as QuantLinear sends them), or 8-bit codes in panels (panel_codes_linear_f32).
// With `lora` (the step's native plan, lora/native.py), each projection's update is added right after
// it by lora_sgmv.cpp's kernels, as lora/decode.py's StepAdder adds it (function pointers: that
// kernel is its own library).
//
// `table` holds each layer's Layer (pointers, 0 for none); `hidden` [rows, dim] is updated in place
// and ends with the last layer's MLP output added. The KV cache is fp32 (written by the rotary pass)
// or another kv_types.h dtype (written by kv_write, int8 with its scales).

#include <cstdint>
#include <cstdlib>
#include <cstring>

extern "C" int add_rms_norm_f32(float* hidden, const float* delta, const float* weight, float* out, int64_t rows,
                                int64_t dim, float eps);
extern "C" int rope_kv_write_f32(float* qkv, const float* cos, const float* sin, const float* q_norm,
                                 const float* k_norm, float eps, float* key_cache, float* value_cache,
                                 const int64_t* slots, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim);
extern "C" int silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t width);
extern "C" int kv_write(const float* k, int64_t k_stride, const float* v, int64_t v_stride, void* k_cache,
                        void* v_cache, float* k_scales, float* v_scales, const int64_t* slots, int64_t rows,
                        int64_t kv_heads, int64_t head_dim, int64_t head_dim_v, int64_t kv_dtype);
extern "C" int paged_decode(const float* q, const void* k_cache, const void* v_cache, const float* k_scales,
                            const float* v_scales, const int64_t* block_table, const int64_t* context_lens,
                            float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t head_dim_v, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                            float softcap, int64_t kv_dtype);
extern "C" int panel_weights_linear_f32(const float* x, const float* panels, const float* bias, float* y, int64_t m,
                                        int64_t n, int64_t k);
extern "C" int panel_quant_linear_f32(const float* x, const uint8_t* codes, const float* scales,
                                      const float* offsets, const float* bias, float* y, int64_t m, int64_t n,
                                      int64_t k, int64_t bits, int64_t group_size);
extern "C" int panel_codes_linear_f32(const float* x, const uint8_t* codes, const float* scales,
                                      const float* offsets, const float* bias, float* y, int64_t m, int64_t n,
                                      int64_t k, int64_t group_size);

namespace {

using FewRows = int (*)(const float* x, const uint8_t* codes, const void* scales, const void* offsets,
                        const float* bias, float* y, int64_t m, int64_t n, int64_t k, int64_t bits,
                        int64_t group_size);
using Sgmv = int (*)(const float* x, int64_t k, float* y, int64_t ldy, const int64_t* rows, const void* groups,
                     int64_t num_groups, const void* parts, int64_t num_parts, int64_t max_rank);
using Bgmv = int (*)(const float* x, int64_t k, float* y, const void* table, int64_t table_len, const void* parts,
                     int64_t num_parts);
using PanelRow = int (*)(const float* x, int64_t k, const float* panels, const float* bias, float* y, int64_t n,
                         const void* table, int64_t table_len, const void* parts, int64_t num_parts);

enum Kind : int64_t { kPanels = 0, kPacked = 1, kCodePanels = 2 };

// One projection (runner/fused_layers.py writes these words in this order).
struct Projection {
    int64_t kind;
    int64_t few_rows;       // kPacked: the bound few-rows kernel (FewRows)
    int64_t weight;         // panels fp32, or codes uint8
    int64_t scales;         // kPacked: the few-rows kernel's (fp32 or fp16); kCodePanels: fp32
    int64_t offsets;
    int64_t wide_scales;    // kPacked: fp32 scales and offsets, for panel_quant_linear_f32
    int64_t wide_offsets;
    int64_t bias;           // fp32 or 0
    int64_t n, k, bits, group_size;
    int64_t max_rows;       // kPacked: the most rows the few-rows kernel takes
    int64_t lora_parts;     // lora/native.py's NativeParts: address and count
    int64_t lora_count;
};

// A layer (pointers, 0 for none).
struct Layer {
    int64_t input_norm, post_norm, q_norm, k_norm;
    int64_t key_cache, value_cache, key_scales, value_scales;
    int64_t window;
    Projection qkv, o, gate_up, down;
};

// The step's LoRA plan (lora/native.py's NativePlan, bound as lora/decode.py's StepAdder binds it).
struct Lora {
    int64_t single;  // 1: one row, one adapter (BGMV, and panel_row for panelled weights); 0: SGMV
    int64_t sgmv, bgmv, panel_row;
    int64_t table, table_len;                    // single: the adapter's table
    int64_t rows, groups, num_groups, max_rank;  // SGMV: the step's groups
};

template <typename T>
T* ptr(int64_t address) {
    return reinterpret_cast<T*>(address);
}

template <typename F>
F function(int64_t address) {
    return reinterpret_cast<F>(address);
}

int linear(const Projection& p, const float* x, float* y, int64_t rows) {
    const float* bias = ptr<const float>(p.bias);
    switch (p.kind) {
        case kPanels:
            return panel_weights_linear_f32(x, ptr<const float>(p.weight), bias, y, rows, p.n, p.k);
        case kPacked:
            if (rows <= p.max_rows)
                return function<FewRows>(p.few_rows)(x, ptr<const uint8_t>(p.weight),
                                                                      ptr<const void>(p.scales),
                                                                      ptr<const void>(p.offsets), bias, y, rows, p.n,
                                                                      p.k, p.bits, p.group_size);
            return panel_quant_linear_f32(x, ptr<const uint8_t>(p.weight), ptr<const float>(p.wide_scales),
                                          ptr<const float>(p.wide_offsets), bias, y, rows, p.n, p.k, p.bits,
                                          p.group_size);
        case kCodePanels:
            return panel_codes_linear_f32(x, ptr<const uint8_t>(p.weight), ptr<const float>(p.scales),
                                          ptr<const float>(p.offsets), bias, y, rows, p.n, p.k, p.group_size);
    }
    return 1;
}

// y [rows, n] = x [rows, k] projected, plus the step's LoRA updates (StepAdder.project's order).
int project(const Projection& p, const float* x, float* y, int64_t rows, const Lora* lora) {
    if (!lora) return linear(p, x, y, rows);
    const void* parts = ptr<const void>(p.lora_parts);
    const void* table = ptr<const void>(lora->table);
    if (lora->single && p.kind == kPanels)  // one row over panels: projection and update in one call
        return function<PanelRow>(lora->panel_row)(x, p.k, ptr<const float>(p.weight),
                                                                     ptr<const float>(p.bias), y, p.n, table,
                                                                     lora->table_len, parts, p.lora_count);
    int status = linear(p, x, y, rows);
    if (status) return status;
    if (lora->single)
        return function<Bgmv>(lora->bgmv)(x, p.k, y, table, lora->table_len, parts, p.lora_count);
    return function<Sgmv>(lora->sgmv)(x, p.k, y, p.n, ptr<const int64_t>(lora->rows),
                                                        ptr<const void>(lora->groups), lora->num_groups, parts,
                                                        p.lora_count, lora->max_rank);
}

// Activations aligned as torch's CPU allocator aligns the tensors the op-by-op plan passes (64 bytes),
// so the kernels' loads split cache lines no more often than there.
class Scratch {
   public:
    explicit Scratch(int64_t count)
        : data_(static_cast<float*>(std::aligned_alloc(64, ((count * sizeof(float) + 63) / 64) * 64))) {}
    ~Scratch() { std::free(data_); }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    float* data() const { return data_; }

   private:
    float* data_;
};

constexpr int64_t kF32Cache = 0;  // kv_types.h's KVDtype for fp32

}  // namespace

extern "C" int64_t fp32_decode_layer_words() { return sizeof(Layer) / sizeof(int64_t); }
extern "C" int64_t fp32_decode_lora_words() { return sizeof(Lora) / sizeof(int64_t); }

extern "C" int fp32_decode_layers(const int64_t* table, int64_t layers, float* hidden, const float* cos,
                                  const float* sin, const int64_t* slots, const int64_t* block_table,
                                  const int64_t* context_lens, int64_t rows, int64_t max_blocks, int64_t block_size,
                                  int64_t dim, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                  int64_t intermediate, int64_t kv_dtype, float norm_eps, float qk_eps, float scale,
                                  const int64_t* lora_words) {
    const Layer* all = reinterpret_cast<const Layer*>(table);
    const Lora* lora = reinterpret_cast<const Lora*>(lora_words);
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim, qkv_width = q_width + 2 * kv_width;
    Scratch normed(rows * dim), qkv(rows * qkv_width), q(rows * q_width), attended(rows * q_width);
    Scratch projected(rows * dim), gate_up(rows * 2 * intermediate), act(rows * intermediate), delta(rows * dim);
    const bool direct = kv_dtype == kF32Cache;
    int status = 0;
    for (int64_t l = 0; l < layers && status == 0; ++l) {
        const Layer& layer = all[l];
        status |= add_rms_norm_f32(hidden, l ? delta.data() : nullptr, ptr<const float>(layer.input_norm),
                                   normed.data(), rows, dim, norm_eps);
        status |= project(layer.qkv, normed.data(), qkv.data(), rows, lora);
        status |= rope_kv_write_f32(qkv.data(), cos, sin, ptr<const float>(layer.q_norm),
                                    ptr<const float>(layer.k_norm), qk_eps,
                                    direct ? ptr<float>(layer.key_cache) : nullptr,
                                    direct ? ptr<float>(layer.value_cache) : nullptr, slots, rows, heads, kv_heads,
                                    head_dim);
        if (!direct)
            status |= kv_write(qkv.data() + q_width, qkv_width, qkv.data() + q_width + kv_width, qkv_width,
                               ptr<void>(layer.key_cache), ptr<void>(layer.value_cache), ptr<float>(layer.key_scales),
                               ptr<float>(layer.value_scales), slots, rows, kv_heads, head_dim, head_dim, kv_dtype);
        for (int64_t r = 0; r < rows; ++r)  // the attention kernel takes q contiguous
            std::memcpy(q.data() + r * q_width, qkv.data() + r * qkv_width, q_width * sizeof(float));
        status |= paged_decode(q.data(), ptr<const void>(layer.key_cache), ptr<const void>(layer.value_cache),
                               ptr<const float>(layer.key_scales), ptr<const float>(layer.value_scales), block_table,
                               context_lens, attended.data(), rows, heads, kv_heads, head_dim, head_dim, block_size,
                               max_blocks, scale, layer.window, 0.f, kv_dtype);
        status |= project(layer.o, attended.data(), projected.data(), rows, lora);
        status |= add_rms_norm_f32(hidden, projected.data(), ptr<const float>(layer.post_norm), normed.data(), rows,
                                   dim, norm_eps);
        status |= project(layer.gate_up, normed.data(), gate_up.data(), rows, lora);
        status |= silu_mul_f32(gate_up.data(), act.data(), rows, intermediate);
        status |= project(layer.down, act.data(), delta.data(), rows, lora);
    }
    if (status == 0 && layers > 0)
        for (int64_t i = 0; i < rows * dim; ++i) hidden[i] += delta.data()[i];
    return status;
}
