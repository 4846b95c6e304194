// The KV cache's element types, widened eight at a time to the fp32 lanes of vec8.h, and narrowed
// back when a row is written. The cache stores one of:
//   fp32; fp16 (IEEE half); bf16 (the top half of an fp32); int8 (one fp32 scale per token and KV
//   head: absmax / 127, so every row of every head uses its own full range, and a block's earlier
//   rows never need requantizing when a later token holds a larger value).
// The attention kernel reads these in place: no fp32 copy of the cache is ever made.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec8.h"

enum KVDtype : int64_t { kKVF32 = 0, kKVF16 = 1, kKVBF16 = 2, kKVI8 = 3 };

struct Half {
    uint16_t bits;
};
struct BFloat16 {
    uint16_t bits;
};

typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

// Scalar half <-> float, for machines without F16C (IEEE rounding to nearest even).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  // zero or subnormal: mantissa * 2^-24, exact in fp32
        float value = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
        std::memcpy(&bits, &value, 4);
        bits |= sign;
    }
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

inline uint16_t float_to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0));
    if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
    if (x < 0x38800000u) {  // subnormal half (or zero): round x * 2^24 to an integer
        float a;
        std::memcpy(&a, &x, 4);
        return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.f)));
    }
    const uint32_t rounded = x + 0xfffu + ((x >> 13) & 1u);  // to nearest even on the 13 dropped bits
    return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline v8 widen8(const float* p) { return load8(p); }

inline v8 widen8(const Half* p) {
#if defined(__F16C__)
    const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    v8 out;
    std::memcpy(&out, &wide, sizeof(out));
    return out;
#else
    v8 out;
    for (int i = 0; i < 8; ++i) out[i] = half_to_float(p[i].bits);
    return out;
#endif
}

inline v8 widen8(const BFloat16* p) {
    u16x8 half;
    std::memcpy(&half, p, sizeof(half));
    const u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
    v8 out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

// GCC scalarizes __builtin_convertvector from bytes (eight shifts and scalar converts: the int8 cache
// read slower than fp32's at long contexts), so on x86 it is one vpmovsxbd and one vcvtdq2ps.
inline v8 widen8(const int8_t* p) {
#if defined(__AVX2__)
    const __m256 wide =
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    v8 out;
    std::memcpy(&out, &wide, sizeof(out));
    return out;
#else
    i8x8 codes;
    std::memcpy(&codes, p, sizeof(codes));
    return __builtin_convertvector(codes, v8);
#endif
}
