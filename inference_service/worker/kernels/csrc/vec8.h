// Eight fp32 lanes through GCC/Clang vector extensions: AVX2 registers with -march=native on
// x86-64, pairs of NEON registers on arm64, no intrinsics to port. Loads and stores go through
// memcpy, so no alignment is assumed.
#pragma once

#include <cstring>

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
    v8 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
