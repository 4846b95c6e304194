// One row of the canonical packed layout (quant/packed.py) widened to fp32: out[i] = code * scale +
// offset of its group. Shared by quant_linear.cpp (dequantize for torch's GEMM) and
// panel_linear.cpp (the rows of a panel), so both produce the same fp32 weights.
#pragma once

#include <algorithm>
#include <cstdint>

inline void dequantize_row(const uint8_t* c, const float* scales, const float* offsets, float* out, int64_t k,
                           int64_t bits, int64_t group_size) {
    const int64_t groups = (k + group_size - 1) / group_size;
    for (int64_t g = 0; g < groups; ++g) {
        const float s = scales[g], o = offsets[g];
        const int64_t k0 = g * group_size, k1 = std::min(k, k0 + group_size);
        if (bits == 8) {
            for (int64_t i = k0; i < k1; ++i) out[i] = static_cast<float>(c[i]) * s + o;
        } else {
            int64_t i = k0;
            if (i % 2 && i < k1) { out[i] = static_cast<float>(c[i / 2] >> 4) * s + o; ++i; }
            for (; i + 1 < k1; i += 2) {  // one byte: two codes
                const uint8_t b = c[i / 2];
                out[i] = static_cast<float>(b & 15) * s + o;
                out[i + 1] = static_cast<float>(b >> 4) * s + o;
            }
            if (i < k1) out[i] = static_cast<float>(c[i / 2] & 15) * s + o;
        }
    }
}
