// Decode products with bf16 weights (BF16 / F16 GGUF files and HF checkpoints in fast mode).
//
//   gemv_bf16(x, w)    x [M, K] float32 (M: a few rows), w [N, K] bf16 row-major -> x @ w.T [M, N] float32
//
// Each row of x enters as two bf16 terms (hi = bf16(x), lo = bf16(x - hi): ~16 bits of x, against the 8
// of one bf16), multiplied with the weight row by vdpbf16ps, pairs of weights per 32-bit lane as they
// are stored, float32 sums. The weights need no load-time layout; rows of W are split across torch's
// intra-op threads, each thread a contiguous range, read once per call for up to 4 rows of x at a time.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "tile_gemm.h"

namespace {

constexpr int MAX_M = 4;               // rows of x per pass over a row of W
constexpr int64_t CHUNK = 32;          // bf16 per 64-byte vector
constexpr int64_t PREFETCH = 2048;     // software prefetch distance in the weight stream (bytes)
constexpr int64_t GRAIN = 16;          // rows of W per task

// x [M, K] float32 -> hi, lo bf16 [M, Kp] (Kp = K rounded up to 32, zero padded).
void split_rows(const float* x, int64_t M, int64_t K, int64_t Kp, std::vector<uint16_t>& hi, std::vector<uint16_t>& lo) {
    hi.assign(M * Kp, 0);
    lo.assign(M * Kp, 0);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; k += 16) {
            const __mmask16 in = gem4_simd::live(k, K);
            __m256i h, l;
            gem4_simd::split_bf16(_mm512_maskz_loadu_ps(in, x + m * K + k), h, l);
            _mm256_mask_storeu_epi16(hi.data() + m * Kp + k, in, h);
            _mm256_mask_storeu_epi16(lo.data() + m * Kp + k, in, l);
        }
}

// y[i * N + n] for rows n in [n0, n1) of w and MC rows of x (hi / lo of row i at i * Kp).
template <int MC>
void rows_bf16(const uint16_t* hi, const uint16_t* lo, int64_t Kp, const uint16_t* w, int64_t K, float* y, int64_t N,
               int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
        const uint16_t* row = w + n * K;
        __m512 acc[MC][2];
        for (int i = 0; i < MC; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += CHUNK) {
            _mm_prefetch(reinterpret_cast<const char*>(row + k) + PREFETCH, _MM_HINT_T0);
            const __mmask32 live = K - k >= CHUNK ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(live, row + k);
            for (int i = 0; i < MC; ++i) {
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], (__m512bh)_mm512_loadu_si512(hi + i * Kp + k), wv);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], (__m512bh)_mm512_loadu_si512(lo + i * Kp + k), wv);
            }
        }
        for (int i = 0; i < MC; ++i) y[i * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
    }
}

}  // namespace

namespace gem4_ops {

at::Tensor gemv_bf16(at::Tensor x, at::Tensor w) {
    TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x must be contiguous float32 [M, K]");
    TORCH_CHECK(w.dtype() == at::kBFloat16 && w.is_contiguous() && w.dim() == 2 && w.size(1) == x.size(1),
                "w must be contiguous bf16 [N, K] with x's K");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0), Kp = (K + CHUNK - 1) / CHUNK * CHUNK;
    std::vector<uint16_t> hi, lo;
    split_rows(x.data_ptr<float>(), M, K, Kp, hi, lo);
    auto y = at::empty({M, N}, x.options());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, N, GRAIN, [&](int64_t n0, int64_t n1) {
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            const uint16_t *h = hi.data() + m0 * Kp, *l = lo.data() + m0 * Kp;
            float* ym = yp + m0 * N;
            switch (std::min<int64_t>(MAX_M, M - m0)) {
                case 1: rows_bf16<1>(h, l, Kp, wp, K, ym, N, n0, n1); break;
                case 2: rows_bf16<2>(h, l, Kp, wp, K, ym, N, n0, n1); break;
                case 3: rows_bf16<3>(h, l, Kp, wp, K, ym, N, n0, n1); break;
                default: rows_bf16<4>(h, l, Kp, wp, K, ym, N, n0, n1); break;
            }
        }
    });
    return y;
}

// x [T, K] bf16 @ w.T -> [T, N] float32 for prefill chunks, row-invariant (tile_gemm.h): w's rows copied 32 at a
// time into A tiles.
at::Tensor linear_bf16(at::Tensor x, at::Tensor w) {
    TORCH_CHECK(w.dtype() == at::kBFloat16 && w.is_contiguous() && w.dim() == 2 && x.dim() == 2
                && w.size(1) == x.size(1), "w must be contiguous bf16 [N, K] with x's K");
    const int64_t N = w.size(0), K = w.size(1);
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    auto rows = [&](int64_t n0, int64_t n1, uint16_t* buf) {    // as A tiles (tile_gemm.h)
        using gem4_tiles::NR, gem4_tiles::QK;
        for (int64_t n = n0; n < n1; ++n)
            for (int64_t k = 0; k < K; k += QK)
                std::copy(wp + n * K + k, wp + n * K + k + QK, buf + k * NR + (n - n0) * QK);
    };
    return gem4_tiles::linear_rows(x, N, rows);
}

}  // namespace gem4_ops

TORCH_LIBRARY_FRAGMENT(gem4_kernels, m) {
    m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor", &gem4_ops::gemv_bf16);
    m.def("linear_bf16(Tensor x, Tensor w) -> Tensor", &gem4_ops::linear_bf16);
}
