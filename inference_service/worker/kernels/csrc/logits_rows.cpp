// Per row of fp32 logits [rows, v]: the first index of its maximum, the maximum, and
// log(sum(exp(x - max))). That is all a greedy pick and its raw logprob need (logprob = x - max -
// log_sum, torch's log_softmax formula), where torch takes a max with indices (not vectorized on
// CPU: 0.7 ms for 16 rows of a 49k vocabulary) and a whole log_softmax row to gather one value.
//
// As torch.max: a NaN is the maximum (the first NaN's index); a row of -inf has its maximum at 0.
// A row with a NaN or +inf has a NaN log_sum, as log_softmax gives NaN there.
//
// The exponentials are Cephes' expf, 16 lanes at a time (AVX-512) or 8 (AVX2); elsewhere std::exp.
//
// Threads split the rows (torch's OpenMP runtime) when there are several.

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMinParallelElements = 1 << 17;  // below this, waking threads costs more than it saves

struct Max {
    float value;
    bool nan;  // a NaN somewhere in the row
};

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) for x <= 0, 8 at a time: Cephes' expf (n = round(x / ln 2), a degree-6 polynomial of the
// rest, 2^n through the exponent bits), within 2 ulp. Below -87.3 it gives ~1e-38, not 0, which
// a sum that holds exp(0) = 1 cannot see. The compiler does not vectorize std::exp in a reduction.
inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

inline float hmax(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    float best = lanes[0];
    for (int l = 1; l < 8; ++l) best = lanes[l] > best ? lanes[l] : best;
    return best;
}

Max row_max(const float* x, int64_t v) {
    const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 m[4] = {lowest, lowest, lowest, lowest}, nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= v; i += 32) {
        for (int j = 0; j < 4; ++j) {
            const __m256 a = _mm256_loadu_ps(x + i + 8 * j);
            m[j] = _mm256_max_ps(a, m[j]);  // a NaN a keeps m[j]: counted apart
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        }
    }
    Max best{hmax(_mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]))),
             _mm256_movemask_ps(nan) != 0};
    for (; i < v; ++i) {
        best.value = x[i] > best.value ? x[i] : best.value;
        best.nan |= std::isnan(x[i]);
    }
    return best;
}

int64_t first_index_of(const float* x, int64_t v, float value) {
    int64_t i = 0;
    const __m256 target = _mm256_set1_ps(value);
    for (; i + 8 <= v; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz(static_cast<unsigned>(mask));
    }
    for (; i < v; ++i) {
        if (x[i] == value) return i;
    }
    return 0;  // not reached: value is one of x
}

#if defined(__AVX512F__)
// The same 16 at a time: the exponentials are most of the pass's work.
inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}

float sum_exp(const float* x, int64_t v, float max) {
    const __m512 shift = _mm512_set1_ps(max);
    __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t i = 0;
    for (; i + 64 <= v; i += 64) {
        for (int j = 0; j < 4; ++j) {
            sums[j] = _mm512_add_ps(sums[j], exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16 * j), shift)));
        }
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3])));
    double sum = 0.0;
    for (int l = 0; l < 16; ++l) sum += lanes[l];
    for (; i < v; ++i) sum += std::exp(x[i] - max);
    return static_cast<float>(sum);
}
#else
float sum_exp(const float* x, int64_t v, float max) {
    const __m256 shift = _mm256_set1_ps(max);
    __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= v; i += 32) {
        for (int j = 0; j < 4; ++j) {
            sums[j] = _mm256_add_ps(sums[j], exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8 * j), shift)));
        }
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(sums[0], sums[1]), _mm256_add_ps(sums[2], sums[3])));
    double sum = 0.0;
    for (int l = 0; l < 8; ++l) sum += lanes[l];
    for (; i < v; ++i) sum += std::exp(x[i] - max);
    return static_cast<float>(sum);
}
#endif
#else
Max row_max(const float* x, int64_t v) {
    Max best{-std::numeric_limits<float>::infinity(), false};
    for (int64_t i = 0; i < v; ++i) {
        best.value = x[i] > best.value ? x[i] : best.value;
        best.nan |= std::isnan(x[i]);
    }
    return best;
}

int64_t first_index_of(const float* x, int64_t v, float value) {
    for (int64_t i = 0; i < v; ++i) {
        if (x[i] == value) return i;
    }
    return 0;  // not reached: value is one of x
}

float sum_exp(const float* x, int64_t v, float max) {
    double sum = 0.0;
    for (int64_t i = 0; i < v; ++i) sum += std::exp(x[i] - max);
    return static_cast<float>(sum);
}
#endif

void row_stats(const float* x, int64_t v, int64_t* index, float* max, float* log_sum) {
    const Max best = row_max(x, v);
    if (best.nan) {  // torch.max's answer: the first NaN
        int64_t i = 0;
        while (!std::isnan(x[i])) ++i;
        *index = i;
        *max = x[i];
        *log_sum = std::numeric_limits<float>::quiet_NaN();
        return;
    }
    *index = first_index_of(x, v, best.value);
    *max = best.value;
    // A row of -inf, or with +inf: log_softmax is NaN there, and so is this.
    *log_sum = std::isinf(best.value) ? std::numeric_limits<float>::quiet_NaN() : std::log(sum_exp(x, v, best.value));
}

}  // namespace

// x [rows, v] contiguous; index (int64), max and log_sum (fp32) [rows].
extern "C" int logits_row_stats_f32(const float* x, int64_t rows, int64_t v, int64_t* index, float* max,
                                    float* log_sum) {
    if (rows < 0 || v < 1) return 1;
#pragma omp parallel for schedule(static) if (rows > 1 && rows * v >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) row_stats(x + r * v, v, index + r, max + r, log_sum + r);
    return 0;
}
