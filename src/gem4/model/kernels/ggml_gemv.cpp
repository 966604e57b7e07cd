// Products straight from GGML Q8_0 / Q4_0 blocks (AVX-512; Q4_0 also AVX512-BF16).
//
// y[m, n] = sum_k x[m, k] * W[n, k] where row n of W is K/32 GGML blocks:
//   Q8_0: fp16 d | int8 q[32]                           w = d * q
//   Q4_0: fp16 d | u8 qs[16] (lo nibble: j, hi: j+16)   w = d * (q - 8)
// ggml_gemv reads the weights once per call whatever M is (up to MAX_M rows reuse each decoded block),
// so decode and small batches read exactly the GGML bytes. Rows of W are split across torch's intra-op
// threads. Accumulation is float32 throughout.
//   Q8_0: activations quantized per 32-block to int16 (relative error <= 2^-16 of the block's largest
//         value, far below bf16's 2^-9); int8 x int16 products and pair sums are exact (vpdpwssd).
//   Q4_0: activations rounded to bf16 (the fast mode's activation precision); the 4-bit weights are
//         exact in bf16, so each block is one table lookup and one vdpbf16ps -- about twice the
//         float32 path's speed, which is bound by int -> float conversion, not by memory.
// dequant_bf16 turns a whole weight into bf16 in one pass, for prefill chunks that run a bf16 GEMM.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace {

constexpr int QK = 32;
constexpr int MAX_M = 8;   // rows of x handled per pass over the weights
constexpr int64_t Q8_0_BYTES = 34, Q4_0_BYTES = 18;
constexpr int64_t Q8_0_TYPE = 8, Q4_0_TYPE = 2;   // GGML type ids

inline float fp16_to_f32(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// The 32 weights of one block, without d, as two float vectors (elements 0..15, 16..31).
inline void q8_0_block(const uint8_t* blk, __m512& w0, __m512& w1) {
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))));
}

inline void q4_0_block(const uint8_t* blk, __m512& w0, __m512& w1) {
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
    const __m512i mask = _mm512_set1_epi32(0x0F), eight = _mm512_set1_epi32(8);
    w0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(raw, mask), eight));
    w1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(raw, 4), eight));
}

// Q4_0 block -> 32 bf16 weights (q - 8, exact) in block order, by a 16-entry table lookup.
inline __m512bh q4_0_block_bf16(const uint8_t* blk, __m512i lut) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
    return (__m512bh)_mm512_permutexvar_epi16(idx, lut);
}

__m512i q4_0_table() {
    alignas(64) uint16_t table[32];
    for (int i = 0; i < 16; ++i) {
        const float f = static_cast<float>(i - 8);
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        table[i] = table[i + 16] = static_cast<uint16_t>(bits >> 16);
    }
    return _mm512_load_si512(table);
}

// Activations for the Q8_0 kernel: each 32-element block as int16 with its own scale,
// x ~= sx[b] * xq[b, :] with |xq| <= 32767 (relative error <= 2^-16 of the block's largest value).
void quantize_int16(const float* x, int64_t K, int16_t* xq, float* sx) {
    for (int64_t b = 0; b < K / QK; ++b) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(v0)), _mm512_reduce_max_ps(_mm512_abs_ps(v1)));
        const float scale = amax / 32767.0f;
        const __m512 inv = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));   // round to nearest
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * QK), _mm512_cvtsepi32_epi16(q0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * QK + 16), _mm512_cvtsepi32_epi16(q1));
        sx[b] = scale;
    }
}

// Q8_0: the block's 32 int8 weights widened to int16 and multiplied with the int16 activations by one
// vpdpwssd (exact integer products and pair sums), then scaled by d * sx in float32.
void q8_0_rows(const int16_t* xq, const float* sx, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
               float* y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t nb = K / QK;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
        const int mc = static_cast<int>(std::min<int64_t>(MAX_M, M - m0));
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* row = w + n * row_bytes;
            __m512 acc[MAX_M];
            for (int i = 0; i < mc; ++i) acc[i] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = row + b * Q8_0_BYTES;
                const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)));
                const float d = fp16_to_f32(blk);
                for (int i = 0; i < mc; ++i) {
                    const int64_t r = (m0 + i);
                    const __m512i xv = _mm512_loadu_si512(xq + r * K + b * QK);
                    const __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w16, xv);   // 16 pair sums
                    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(d * sx[r * nb + b]), _mm512_cvtepi32_ps(dot), acc[i]);
                }
            }
            for (int i = 0; i < mc; ++i) y[(m0 + i) * N + n] = _mm512_reduce_add_ps(acc[i]);
        }
    }
}

// x rearranged for pairs of Q4_0 blocks: for blocks (2p, 2p+1) the 64 activations are stored as
// [x0[0:16] x1[0:16] | x0[16:32] x1[16:32]], matching the low / high nibbles of both blocks' bytes.
void pair_layout(const uint16_t* x, uint16_t* out, int64_t K) {
    const int64_t pairs = K / (2 * QK);
    for (int64_t p = 0; p < pairs; ++p) {
        const uint16_t* src = x + p * 2 * QK;
        uint16_t* dst = out + p * 2 * QK;
        std::memcpy(dst, src, 32);            // x0[0:16]
        std::memcpy(dst + 16, src + 32, 32);  // x1[0:16]
        std::memcpy(dst + 32, src + 16, 32);  // x0[16:32]
        std::memcpy(dst + 48, src + 48, 32);  // x1[16:32]
    }
    std::memcpy(out + pairs * 2 * QK, x + pairs * 2 * QK, (K - pairs * 2 * QK) * 2);   // odd last block as is
}

void q4_0_rows(const uint16_t* xb16, const uint16_t* xpair, int64_t M, int64_t K, const uint8_t* w,
               int64_t row_bytes, float* y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t nb = K / QK, pairs = nb / 2;
    const __m512i lut = q4_0_table();
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
        const int mc = static_cast<int>(std::min<int64_t>(MAX_M, M - m0));
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* row = w + n * row_bytes;
            __m512 acc[MAX_M];
            for (int i = 0; i < mc; ++i) acc[i] = _mm512_setzero_ps();
            for (int64_t p = 0; p < pairs; ++p) {
                // two blocks at once: nibbles of both in one 256-bit register, one table lookup per half
                const uint8_t* b0 = row + 2 * p * Q4_0_BYTES;
                const uint8_t* b1 = b0 + Q4_0_BYTES;
                const __m256i raw = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b1 + 2),
                                                        reinterpret_cast<const __m128i*>(b0 + 2));
                const __m256i lo = _mm256_and_si256(raw, mask);                       // elements 0..15 of b0 | b1
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask); // elements 16..31
                const __m512bh wlo = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(lo), lut);
                const __m512bh whi = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(hi), lut);
                // lanes 0..7 hold b0's pair sums, lanes 8..15 b1's
                const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(fp16_to_f32(b0)), _mm256_set1_ps(fp16_to_f32(b1)), 1);
                for (int i = 0; i < mc; ++i) {
                    const uint16_t* xp = xpair + (m0 + i) * K + p * 2 * QK;
                    __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), wlo, (__m512bh)_mm512_loadu_si512(xp));
                    dot = _mm512_dpbf16_ps(dot, whi, (__m512bh)_mm512_loadu_si512(xp + 32));
                    acc[i] = _mm512_fmadd_ps(d, dot, acc[i]);
                }
            }
            if (nb % 2) {                                                             // odd last block
                const uint8_t* blk = row + (nb - 1) * Q4_0_BYTES;
                const __m512bh wv = q4_0_block_bf16(blk, lut);
                const __m512 d = _mm512_set1_ps(fp16_to_f32(blk));
                for (int i = 0; i < mc; ++i) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb16 + (m0 + i) * K + (nb - 1) * QK);
                    acc[i] = _mm512_fmadd_ps(d, _mm512_dpbf16_ps(_mm512_setzero_ps(), wv, xv), acc[i]);
                }
            }
            for (int i = 0; i < mc; ++i) y[(m0 + i) * N + n] = _mm512_reduce_add_ps(acc[i]);
        }
    }
}

int64_t block_bytes(int64_t ggml_type) {
    TORCH_CHECK(ggml_type == Q8_0_TYPE || ggml_type == Q4_0_TYPE, "only Q8_0 (8) and Q4_0 (2) are packed");
    return ggml_type == Q8_0_TYPE ? Q8_0_BYTES : Q4_0_BYTES;
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor w, int64_t n_out, int64_t ggml_type) {
    // x: [M, K] float32; w: [N, K/32 * block_bytes] uint8 -> y: [M, N] float32
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x must be contiguous float32 [M, K]");
    TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2 && w.size(0) == n_out, "w must be uint8 [N, row_bytes]");
    const int64_t M = x.size(0), K = x.size(1), N = n_out;
    TORCH_CHECK(K % QK == 0 && w.size(1) == K / QK * block_bytes(ggml_type), "row bytes do not match K");
    auto y = torch::empty({M, N}, x.options());
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    const int64_t row_bytes = w.size(1);
    if (ggml_type == Q8_0_TYPE) {
        auto xq_t = torch::empty({M, K}, x.options().dtype(torch::kInt16));
        auto sx_t = torch::empty({M, K / QK}, x.options());
        int16_t* xq = xq_t.data_ptr<int16_t>();
        float* sx = sx_t.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m) quantize_int16(x.data_ptr<float>() + m * K, K, xq + m * K, sx + m * (K / QK));
        at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { q8_0_rows(xq, sx, M, K, wp, row_bytes, yp, N, n0, n1); });
    } else {
        const auto xb = x.to(torch::kBFloat16);
        auto xpair_t = torch::empty_like(xb);
        const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
        uint16_t* xpair = reinterpret_cast<uint16_t*>(xpair_t.data_ptr<at::BFloat16>());
        for (int64_t m = 0; m < M; ++m) pair_layout(xp + m * K, xpair + m * K, K);
        at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { q4_0_rows(xp, xpair, M, K, wp, row_bytes, yp, N, n0, n1); });
    }
    return y;
}

torch::Tensor dequant_bf16(torch::Tensor w, int64_t n_out, int64_t k_in, int64_t ggml_type) {
    const int64_t bb = block_bytes(ggml_type), nb = k_in / QK;
    TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2 && w.size(0) == n_out, "w must be uint8 [N, row_bytes]");
    TORCH_CHECK(k_in % QK == 0 && w.size(1) == nb * bb, "row bytes do not match K");
    auto out = torch::empty({n_out, k_in}, w.options().dtype(torch::kBFloat16));
    const uint8_t* wp = w.data_ptr<uint8_t>();
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    at::parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = wp + n * nb * bb + b * bb;
                __m512 w0, w1;
                if (ggml_type == Q8_0_TYPE) q8_0_block(blk, w0, w1); else q4_0_block(blk, w0, w1);
                const __m512 d = _mm512_set1_ps(fp16_to_f32(blk));
                uint16_t* dst = op + n * k_in + b * QK;
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(w0, d)));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(w1, d)));
            }
        }
    });
    return out;
}

}  // namespace

TORCH_LIBRARY(gem4_kernels, m) {
    m.def("ggml_gemv(Tensor x, Tensor w, int n_out, int ggml_type) -> Tensor", &gemv);
    m.def("dequant_bf16(Tensor w, int n_out, int k_in, int ggml_type) -> Tensor", &dequant_bf16);
}
