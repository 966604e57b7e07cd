// Matrix-vector products straight from GGML Q8_0 / Q4_0 blocks, float32 activations.
//
// y[m, n] = sum_k x[m, k] * W[n, k] where row n of W is K/32 GGML blocks:
//   Q8_0: fp16 d | int8 q[32]                    w = d * q
//   Q4_0: fp16 d | u8 qs[16] (lo nibble: j, hi: j+16)  w = d * (q - 8)
// Weights are read once per call whatever m is (the m rows reuse each decoded block), so decode and
// small batches read exactly the GGML bytes and nothing else. Rows are split across torch's
// intra-op threads. Products accumulate in float32 (the result equals dequantize + float matmul up to
// float32 summation order).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>

namespace {

constexpr int QK = 32;
constexpr int MAX_M = 8;   // rows of x handled per pass over the weights

inline float fp16_to_f32(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// The 32 weights of one block (without d) as two float vectors.
inline void q8_0_block(const uint8_t* blk, __m512& w0, __m512& w1) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1));
}

inline void q4_0_block(const uint8_t* blk, __m512& w0, __m512& w1) {
    // widen the 16 bytes once, then split nibbles in 32-bit lanes: fewer shuffle-port uops
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
    const __m512i mask = _mm512_set1_epi32(0x0F);
    const __m512i eight = _mm512_set1_epi32(8);
    w0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(raw, mask), eight));
    w1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(raw, 4), eight));
}

template <int BLOCK_BYTES, void (*DECODE)(const uint8_t*, __m512&, __m512&)>
void gemv_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
               float* y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t nb = K / QK;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
        const int mc = static_cast<int>(std::min<int64_t>(MAX_M, M - m0));
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* row = w + n * row_bytes;
            __m512 acc[MAX_M];
            for (int i = 0; i < mc; ++i) acc[i] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = row + b * BLOCK_BYTES;
                __m512 w0, w1;
                DECODE(blk, w0, w1);
                const __m512 d = _mm512_set1_ps(fp16_to_f32(blk));
                w0 = _mm512_mul_ps(w0, d);
                w1 = _mm512_mul_ps(w1, d);
                for (int i = 0; i < mc; ++i) {
                    const float* xb = x + (m0 + i) * K + b * QK;
                    acc[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[i]);
                    acc[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[i]);
                }
            }
            for (int i = 0; i < mc; ++i) y[(m0 + i) * N + n] = _mm512_reduce_add_ps(acc[i]);
        }
    }
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor w, int64_t n_out, int64_t ggml_type) {
    // x: [M, K] float32 contiguous; w: [N, K/32 * block_bytes] uint8 contiguous -> y: [M, N] float32
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x must be contiguous float32 [M, K]");
    TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2 && w.size(0) == n_out, "w must be uint8 [N, row_bytes]");
    const int64_t M = x.size(0), K = x.size(1), N = n_out;
    TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
    const int64_t block_bytes = ggml_type == 8 ? 34 : 18;     // GGML type ids: Q8_0 = 8, Q4_0 = 2
    TORCH_CHECK(ggml_type == 8 || ggml_type == 2, "only Q8_0 (8) and Q4_0 (2)");
    TORCH_CHECK(w.size(1) == K / QK * block_bytes, "row bytes do not match K");
    auto y = torch::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    const int64_t row_bytes = w.size(1);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        if (ggml_type == 8) gemv_rows<34, q8_0_block>(xp, M, K, wp, row_bytes, yp, N, n0, n1);
        else gemv_rows<18, q4_0_block>(xp, M, K, wp, row_bytes, yp, N, n0, n1);
    });
    return y;
}

}  // namespace

TORCH_LIBRARY(gem4_kernels, m) {
    m.def("ggml_gemv(Tensor x, Tensor w, int n_out, int ggml_type) -> Tensor", &gemv);
}
