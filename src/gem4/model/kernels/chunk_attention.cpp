// Attention of a prefill chunk against the KV cache, on the CPU's bf16 dot-product instruction.
//
//   attend_chunk(q, k, v, mask, k_scale?, v_scale?)    q [T, nh, d] float32, k / v [S, nkv, d] bf16, fp8_e4m3 or
//                                  int8 with k_scale / v_scale [S, nkv] float32, mask [T, S] bool -> [T, nh * d]
//
// 8-bit K/V cost no precision here beyond the bf16 cache's: their values are exact in bf16 (int8: integers of
// at most 7 bits; e4m3: 3 mantissa bits), so they are paired as bf16 like a bf16 cache's, and an int8 row's
// scale multiplies its column of scores (K) and its probabilities before they are rounded to bf16 (V).
//
// The same function as layers.attention (scale 1.0, GQA by query-head groups, a row that sees no key gets
// zeros), computed per (KV head, block of query tokens):
//   scores [rows, span] = q . k^T        q as two bf16 terms (q_hi + q_lo, ~16 bits); bf16 products,
//                                        float32 sums (vdpbf16ps)
//   p = softmax over the visible keys    float32, then rounded to bf16
//   out [rows, d] = p . v                bf16 products, float32 sums
// `span` is the range of key rows some query of the block may see, so the part of a causal chunk above
// the diagonal is never computed. Both products run one register-tiled kernel, C[8 rows, 32 cols] +=
// A . B, with B laid out in pairs along the summed dimension (what vdpbf16ps multiplies): k and v are
// rearranged once per call, each pair of k twice, against q_hi's and q_lo's pair. Rounding q to one bf16
// would cost 4e-5 NMSE of the output (normalised q and k of head dim 256), p's rounding costs 1e-6. (torch's bf16 matmul rounds its output to bf16, and the float32-output bf16
// GEMM torch links, MKL's, converts to float32 on this CPU, no faster than float32 matmuls.)
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace gem4_simd;
using gem4_ops::KV_BF16, gem4_ops::KV_INT8, gem4_ops::KV_FP8;

constexpr int64_t BLOCK_ROWS = 256;    // query rows (tokens x heads of a group) per task: the scores stay in L2
constexpr int TILE_ROWS = 8;           // C tile: 8 rows x 32 columns, 16 accumulators

// float32 -> bf16 bits, round to nearest even (the rounding torch's .to(bfloat16) does).
inline void to_bf16(const float* src, uint16_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = live(i, n);
        _mm256_mask_storeu_epi16(dst + i, k, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, src + i)));
    }
}

// float32 x -> bf16 bits of hi = bf16(x), lo = bf16(x - hi), pair by pair: hi(2p), hi(2p+1), lo(2p), lo(2p+1).
// n: a multiple of 16; dst holds 2n values.
inline void to_bf16_split(const float* src, uint16_t* dst, int64_t n) {
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    for (int64_t i = 0; i < n; i += 16) {
        __m256i hi, lo;
        split_bf16(_mm512_loadu_ps(src + i), hi, lo);
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(hi), lo, 1);   // 8 hi pairs, 8 lo pairs
        _mm512_storeu_si512(dst + 2 * i, _mm512_permutexvar_epi32(order, both));
    }
}

// C[r, j] = sum_p A[r, 2p] B[2p, j] + A[r, 2p+1] B[2p+1, j] for R rows and n <= 32 columns.
// A: bf16 rows (stride lda), the summed dim contiguous; B: pairs [k2][ldb] (uint32 = bf16 of rows 2p, 2p+1).
template <int R>
void tile(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t k2, float* c, int64_t ldc, int64_t n) {
    const __mmask16 m0 = live(0, n), m1 = live(16, n);
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k2; ++p) {
        const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, b + p * ldb);
        const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, b + p * ldb + 16);
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
            const __m512bh ar = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm512_mask_storeu_ps(c + r * ldc, m0, acc[r][0]);
        _mm512_mask_storeu_ps(c + r * ldc + 16, m1, acc[r][1]);
    }
}

// C [rows, n] = A [rows, 2 k2] . B, B as pairs [k2][ldb] (see tile).
void matmul_pairs(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t k2, float* c, int64_t ldc,
                  int64_t rows, int64_t n) {
    for (int64_t j = 0; j < n; j += 32) {
        const int64_t nj = std::min<int64_t>(32, n - j);
        int64_t r = 0;
        for (; r + TILE_ROWS <= rows; r += TILE_ROWS)
            tile<TILE_ROWS>(a + r * lda, lda, b + j, ldb, k2, c + r * ldc + j, ldc, nj);
        for (; r < rows; ++r)
            tile<1>(a + r * lda, lda, b + j, ldb, k2, c + r * ldc + j, ldc, nj);
    }
}

// The bf16 bits of each byte's value, exact: as an int8 (KV_INT8) or as a float8_e4m3fn (KV_FP8; NaN: 0x7FC0).
struct ByteToBf16 {
    uint16_t int8[256], fp8[256];
    ByteToBf16() {
        for (int b = 0; b < 256; ++b) {
            int8[b] = bf16_bits(static_cast<float>(static_cast<int8_t>(b)));
            const int e = (b >> 3) & 15, m = b & 7;
            const float mag = e == 15 && m == 7 ? NAN : e == 0 ? std::ldexp(static_cast<float>(m), -9)
                                                               : std::ldexp(1.0f + m / 8.0f, e - 7);
            fp8[b] = bf16_bits(b & 0x80 ? -mag : mag);
        }
    }
    static uint16_t bf16_bits(float f) {              // f has at most 8 significant bits: the top half is exact
        uint32_t u;
        std::memcpy(&u, &f, sizeof u);
        return static_cast<uint16_t>(u >> 16);
    }
};

// Element i of a storage of KIND as bf16 bits.
template <int KIND>
inline uint32_t bf16_at(const uint8_t* base, int64_t i) {
    static const ByteToBf16 table;
    if constexpr (KIND == KV_BF16) return reinterpret_cast<const uint16_t*>(base)[i];
    else if constexpr (KIND == KV_INT8) return table.int8[base[i]];
    else return table.fp8[base[i]];
}

// k [S, nkv, d] (elements of KIND) -> per KV head, pairs along d, each twice (for q_hi, q_lo): [nkv][d][S];
// v -> pairs along S: [nkv][ceil(S / 2)][d].
template <int KIND>
void pair_rows(const uint8_t* k, const uint8_t* v, int64_t S, int64_t nkv, int64_t d,
               std::vector<uint32_t>& kp, std::vector<uint32_t>& vp) {
    const int64_t S2 = (S + 1) / 2;
    kp.resize(nkv * d * S);
    vp.resize(nkv * S2 * d);
    at::parallel_for(0, nkv * S2, 16, [&](int64_t a, int64_t b) {
        for (int64_t task = a; task < b; ++task) {
            const int64_t h = task / S2, s2 = task % S2;
            for (int64_t s = 2 * s2; s < std::min(S, 2 * s2 + 2); ++s) {
                const int64_t kr = (s * nkv + h) * d;
                uint32_t* kh = kp.data() + h * d * S;
                for (int64_t p = 0; p < d / 2; ++p)
                    kh[2 * p * S + s] = kh[(2 * p + 1) * S + s] = bf16_at<KIND>(k, kr + 2 * p) | (bf16_at<KIND>(k, kr + 2 * p + 1) << 16);
            }
            const int64_t v0 = (2 * s2 * nkv + h) * d;
            const bool v1 = 2 * s2 + 1 < S;                                       // an odd S pairs its last row with 0
            uint32_t* vr = vp.data() + (h * S2 + s2) * d;
            for (int64_t c = 0; c < d; ++c) vr[c] = bf16_at<KIND>(v, v0 + c) | (v1 ? bf16_at<KIND>(v, v0 + nkv * d + c) << 16 : 0u);
        }
    });
}

// Row r of scores [span] -> softmax over the visible keys (mask row), rounded to bf16 into p [span_pad]; with an
// int8 V, each probability times its key's scale vs[s * nkv] first.
void softmax_row(float* sr, const bool* mrow, int64_t span, uint16_t* p, int64_t span_pad, const float* vs, int64_t nkv) {
    std::vector<__mmask16> seen((span + 15) / 16);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s < span; s += 16) {
        const __mmask16 k = live(s, span);
        seen[s / 16] = _mm_mask_test_epi8_mask(k, _mm_maskz_loadu_epi8(k, mrow + s), _mm_set1_epi8(1));
        mx = _mm512_mask_max_ps(mx, seen[s / 16], mx, _mm512_maskz_loadu_ps(k, sr + s));
    }
    const float m = _mm512_reduce_max_ps(mx);
    __m512 total = _mm512_setzero_ps();
    for (int64_t s = 0; s < span; s += 16) {
        const __m512 e = _mm512_maskz_mov_ps(seen[s / 16], exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live(s, span), sr + s),
                                                                                 _mm512_set1_ps(m))));
        _mm512_mask_storeu_ps(sr + s, live(s, span), e);
        total = _mm512_add_ps(total, e);
    }
    const float sum = _mm512_reduce_add_ps(total);
    const __m512 inv = _mm512_set1_ps(sum > 0 ? 1.0f / sum : 0.0f);                // no visible key: zeros
    for (int64_t s = 0; s < span; s += 16) {
        const __mmask16 k = live(s, span);
        _mm512_mask_storeu_ps(sr + s, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sr + s), inv));
    }
    if (vs)
        for (int64_t s = 0; s < span; ++s)
            if (mrow[s]) sr[s] *= vs[s * nkv];
    to_bf16(sr, p, span);
    if (span_pad > span) p[span] = 0;
}

// The inputs of attend_chunk: q [T, nh, d] float32, k / v [S, nkv, d] bf16 / int8 (+ scales) / fp8, mask [T, S] bool.
int check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
    TORCH_CHECK(q.dtype() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q must be contiguous float32 [T, heads, d]");
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.dim() == 3 && k.sizes() == v.sizes(),
                "k, v must be contiguous bf16 / int8 / fp8 [S, kv_heads, d] of one shape");
    const int kind = gem4_ops::kv_kind(k, v, k_scale, v_scale);
    const int64_t T = q.size(0), nh = q.size(1), d = q.size(2), S = k.size(0), nkv = k.size(1);
    TORCH_CHECK(k.size(2) == d && d % 16 == 0 && nkv > 0 && nh % nkv == 0, "head shapes do not match");
    TORCH_CHECK(mask.dtype() == at::kBool && mask.is_contiguous() && mask.dim() == 2 && mask.size(0) == T && mask.size(1) == S,
                "mask must be contiguous bool [T, S]");
    return kind;
}

at::Tensor attend_chunk(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor mask, std::optional<at::Tensor> k_scale,
                        std::optional<at::Tensor> v_scale) {
    const int kind = check_attention_inputs(q, k, v, mask, k_scale, v_scale);
    const int64_t T = q.size(0), nh = q.size(1), d = q.size(2), S = k.size(0), nkv = k.size(1);
    const int64_t g = nh / nkv, S2 = (S + 1) / 2;
    const int64_t tokens_per_block = std::max<int64_t>(1, BLOCK_ROWS / g);
    const int64_t blocks = (T + tokens_per_block - 1) / tokens_per_block, tasks = blocks * nkv;
    const bool* mp = mask.data_ptr<bool>();
    const float* qp = q.data_ptr<float>();
    std::vector<uint32_t> kpairs, vpairs;
    const uint8_t *kb = static_cast<const uint8_t*>(k.data_ptr()), *vb = static_cast<const uint8_t*>(v.data_ptr());
    if (kind == KV_BF16) pair_rows<KV_BF16>(kb, vb, S, nkv, d, kpairs, vpairs);
    else if (kind == KV_INT8) pair_rows<KV_INT8>(kb, vb, S, nkv, d, kpairs, vpairs);
    else pair_rows<KV_FP8>(kb, vb, S, nkv, d, kpairs, vpairs);
    const float* ks = k_scale ? k_scale->data_ptr<float>() : nullptr;     // int8: scores and probabilities scaled
    const float* vs = v_scale ? v_scale->data_ptr<float>() : nullptr;
    auto out = at::empty({T, nh * d}, q.options());
    float* op = out.data_ptr<float>();

    // task i goes to worker i % workers: a causal chunk's later blocks see more keys, so strided is balanced
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks);
    at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
        std::vector<uint16_t> qb, pb;
        std::vector<float> scores, o;
        for (int64_t w = w0; w < w1; ++w)
            for (int64_t task = w; task < tasks; task += workers) {
                const int64_t blk = task / nkv, kvh = task % nkv;
                const int64_t t0 = blk * tokens_per_block, nt = std::min(T, t0 + tokens_per_block) - t0, rows = nt * g;
                // key rows [lo, hi) some query of the block may see; lo a multiple of 16, so that a row's softmax
                // sums and v's row pairs fall in lanes and pairs fixed by the key index, whatever the block's other
                // rows see (row-invariant; layers.attend puts the keys of a position = 0 (mod 16) first)
                int64_t lo = S, hi = 0;
                for (int64_t t = t0; t < t0 + nt; ++t) {
                    const bool* mrow = mp + t * S;
                    int64_t first = 0, last = S;
                    while (first < S && !mrow[first]) ++first;
                    while (last > first && !mrow[last - 1]) --last;
                    if (first < last) lo = std::min(lo, first), hi = std::max(hi, last);
                }
                lo &= ~int64_t{15};
                const int64_t span = std::max<int64_t>(hi - lo, 0), span_pad = span + (span & 1);
                o.assign(rows * d, 0.0f);
                if (span > 0) {
                    qb.resize(rows * 2 * d);
                    for (int64_t t = 0; t < nt; ++t)                   // row r = (token t0 + r / g, head kvh * g + r % g)
                        to_bf16_split(qp + ((t0 + t) * nh + kvh * g) * d, qb.data() + t * g * 2 * d, g * d);
                    scores.resize(rows * span);
                    matmul_pairs(qb.data(), 2 * d, kpairs.data() + kvh * d * S + lo, S, d, scores.data(), span, rows, span);
                    if (ks)
                        for (int64_t r = 0; r < rows; ++r)
                            for (int64_t s = 0; s < span; ++s) scores[r * span + s] *= ks[(lo + s) * nkv + kvh];
                    pb.resize(rows * span_pad);
                    for (int64_t r = 0; r < rows; ++r)
                        softmax_row(scores.data() + r * span, mp + (t0 + r / g) * S + lo, span, pb.data() + r * span_pad, span_pad,
                                    vs ? vs + lo * nkv + kvh : nullptr, nkv);
                    matmul_pairs(pb.data(), span_pad, vpairs.data() + (kvh * S2 + lo / 2) * d, d, span_pad / 2, o.data(), d, rows, d);
                }
                for (int64_t t = 0; t < nt; ++t)
                    std::copy(o.data() + t * g * d, o.data() + (t + 1) * g * d, op + ((t0 + t) * nh + kvh * g) * d);
            }
    });
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gem4_kernels, m) {
    m.def("attend_chunk(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor",
          &attend_chunk);
}
