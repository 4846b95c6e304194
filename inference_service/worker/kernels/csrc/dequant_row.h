// One row of the canonical packed layout (kernels/packed.py) widened to fp32: out[i] = code * scale +
// offset of its group. Shared by quant_linear.cpp (dequantize for torch's GEMM) and
// panel_linear.cpp (the rows of a panel), so both produce the same fp32 weights.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec8.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// 8 bytes → 8 int32. GCC scalarizes __builtin_convertvector from bytes (eight inserts: 3x slower
// overall), so on x86 it is the one vpmovzxbd it should be.
inline i32x8 widen(const uint8_t* p) {
#if defined(__AVX2__)
    return reinterpret_cast<i32x8>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    u8x8 b;
    std::memcpy(&b, p, 8);
    return __builtin_convertvector(b, i32x8);
#endif
}

inline v8 to_f32(i32x8 v) { return __builtin_convertvector(v, v8); }

// Codes [k0, k1) of one group: 8 (8-bit) or 16 (4-bit, from an even k) at a time through vectors,
// the rest one by one. Each value is code * s + o in fp32, as the scalar formula gives.
inline void dequantize_group(const uint8_t* c, float s, float o, float* out, int64_t k0, int64_t k1, int64_t bits) {
    const v8 sv = v8{} + s, ov = v8{} + o;
    int64_t i = k0;
    if (bits == 8) {
        for (; i + 8 <= k1; i += 8) store8(out + i, to_f32(widen(c + i)) * sv + ov);
        for (; i < k1; ++i) out[i] = static_cast<float>(c[i]) * s + o;
        return;
    }
    if (i % 2 && i < k1) { out[i] = static_cast<float>(c[i / 2] >> 4) * s + o; ++i; }
    for (; i + 16 <= k1; i += 16) {  // 8 bytes: low nibbles are the even k, high ones the odd k
        const i32x8 b = widen(c + i / 2);
        const v8 low = to_f32(b & 15) * sv + ov, high = to_f32(b >> 4) * sv + ov;
        store8(out + i, __builtin_shuffle(low, high, i32x8{0, 8, 1, 9, 2, 10, 3, 11}));
        store8(out + i + 8, __builtin_shuffle(low, high, i32x8{4, 12, 5, 13, 6, 14, 7, 15}));
    }
    for (; i + 1 < k1; i += 2) {  // one byte: two codes
        const uint8_t b = c[i / 2];
        out[i] = static_cast<float>(b & 15) * s + o;
        out[i + 1] = static_cast<float>(b >> 4) * s + o;
    }
    if (i < k1) out[i] = static_cast<float>(c[i / 2] & 15) * s + o;
}

inline void dequantize_row(const uint8_t* c, const float* scales, const float* offsets, float* out, int64_t k,
                           int64_t bits, int64_t group_size) {
    const int64_t groups = (k + group_size - 1) / group_size;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t k0 = g * group_size;
        dequantize_group(c, scales[g], offsets[g], out, k0, std::min(k, k0 + group_size), bits);
    }
}
