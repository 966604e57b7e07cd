// AVX-512 float32 helpers shared by the kernels (header-only, inlined).
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <type_traits>

namespace gem4_simd {

// A count n (1..8; more: 8) as a compile-time constant, so that arrays of n accumulators stay in registers:
// fn(std::integral_constant<int, n>).
template <typename Fn>
void with_count(int64_t n, Fn&& fn) {
    switch (n) {
        case 1: fn(std::integral_constant<int, 1>{}); break;
        case 2: fn(std::integral_constant<int, 2>{}); break;
        case 3: fn(std::integral_constant<int, 3>{}); break;
        case 4: fn(std::integral_constant<int, 4>{}); break;
        case 5: fn(std::integral_constant<int, 5>{}); break;
        case 6: fn(std::integral_constant<int, 6>{}); break;
        case 7: fn(std::integral_constant<int, 7>{}); break;
        default: fn(std::integral_constant<int, 8>{}); break;
    }
}

// 16 bf16 values -> float32 (a bf16 is the top half of a float32).
inline __m512 load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Whether a or b holds a NaN.
inline bool has_nan(__m512 a, __m512 b) {
    return (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)) != 0;
}

// Lanes of the 16-float chunk at i that lie inside [0, n) (none when i >= n).
inline __mmask16 live(int64_t i, int64_t n) {
    return n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= i ? 0 : static_cast<__mmask16>((1u << (n - i)) - 1);
}

// 16 floats x -> bf16 bits of hi = bf16(x) and lo = bf16(x - hi), round to nearest even (torch's
// .to(bfloat16)): x to ~16 bits as two bf16 terms, for products on the bf16 dot-product instruction.
inline void split_bf16(__m512 x, __m256i& hi, __m256i& lo) {
    hi = (__m256i)_mm512_cvtneps_pbh(x);
    const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
    lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, hi_f));
}

// e^x: x = n ln2 + r with |r| <= ln2/2, e^r by its degree-7 Taylor polynomial (relative error < 3e-9
// before rounding), then scaled by 2^n. Lanes below -104 give 0 and above 88.7 a large finite value.
inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);       // ln2 split in two (Cody-Waite)
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_scalef_ps(p, n);
}

// tanh(z) = 1 - 2 / (e^2z + 1): absolute error ~1e-7 (saturates to +-1 for large |z|).
inline __m512 tanh_ps(__m512 z) {
    const __m512 e = exp_ps(_mm512_add_ps(z, z));
    return _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
}

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline __m512 gelu_tanh_ps(__m512 x) {
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.0f), tanh_ps(z)));
}

}  // namespace gem4_simd
