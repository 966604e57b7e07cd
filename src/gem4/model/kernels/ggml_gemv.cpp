// Products with Q8_0 / Q4_0 weights (AVX-512 + VNNI), in a load-time layout made for them.
//
// GGML block (32 weights):  Q8_0: fp16 d | int8 q[32]                           w = d * q
//                           Q4_0: fp16 d | u8 qs[16] (lo nibble: j, hi: j + 16)   w = d * (q - 8)
//
// The "x16" layout (repack_x16, once at load): each row's blocks in groups of 16, the last group padded
// with zero blocks. A row is [the groups' fp16 scales, 16 per group, padded to 64 bytes | the groups'
// quant bytes], so that every 64-byte load is cache-line aligned (unaligned loads cost a fifth of the
// Q4_0 speed) and a row is read front to back. A group's quant bytes are Q/4 vectors of 64 bytes
// (Q = 32 for Q8_0, 16 for Q4_0): vector v holds bytes 4v..4v+3 of each of the 16 blocks, block b at
// bytes 4b..4b+3. So a 32-bit lane of any vector belongs to one block, and so does that lane of the
// integer accumulator: a group needs one float conversion and one scale multiply, not 16. The buffer
// asks for transparent huge pages: it is streamed once per decoded token.
//
// gemv_x16: y[m, n] = sum_k x[m, k] W[n, k]. Activations are quantized per 32-block to int16 (relative
// error <= 2^-16 of the block's largest value, far below bf16's 2^-9) and laid out in the order the
// kernel reads them; each 16-bit half of a weight lane is one weight, so one vpdpwssd takes two weights
// of every block of the group, with exact integer products and sums. Q4_0's "- 8" is applied once per
// block as -8 * sum(activation block). The weights are read once per call for up to 4 rows of x at a
// time; rows of W are split across torch's intra-op threads. gemv_x16_multi (several weights, one x)
// and gemv_x16_glu (gelu(x Gate^T) * x Up^T) share one preparation of x and one parallel pass.
// dequant_x16 turns (rows of) a weight back into float32 or bf16 (token tables are looked up by rows);
// linear_x16 is prefill's GEMM: bf16 tiles of a few MB of weight rows, each multiplied while in cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <sys/mman.h>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace gem4_ops {

constexpr int QK = 32;                 // weights per GGML block
constexpr int GROUP = 16;              // blocks per x16 group
constexpr int64_t GROUP_ELEMS = GROUP * QK;
constexpr int MAX_M = 4;               // rows of x handled per pass over a row of W
constexpr int64_t PREFETCH = 2048;     // software prefetch distance in the weight stream (faster in most runs)
constexpr int64_t Q8_0_TYPE = 8, Q4_0_TYPE = 2;   // GGML type ids

int64_t groups_of(int64_t k_in) { return (k_in / QK + GROUP - 1) / GROUP; }

struct Format {
    int64_t block_bytes;   // GGML block
    int64_t quant_bytes;   // quant bytes per block
    int64_t groups;        // x16 groups per row
    int64_t quants_at;     // offset of the first group's quants in an x16 row (the scales come first)
    int64_t row_bytes;     // x16 row
};

Format format_of(int64_t ggml_type, int64_t k_in) {
    TORCH_CHECK(ggml_type == Q8_0_TYPE || ggml_type == Q4_0_TYPE, "only Q8_0 (8) and Q4_0 (2) have kernels");
    TORCH_CHECK(k_in > 0 && k_in % QK == 0, "k_in must be a positive multiple of 32");
    const int64_t q = ggml_type == Q8_0_TYPE ? 32 : 16, G = groups_of(k_in);
    const int64_t quants_at = (G * GROUP * 2 + 63) / 64 * 64;
    return {2 + q, q, G, quants_at, quants_at + G * GROUP * q};
}

// GGML [N, K/32 blocks] -> x16 [N, groups * group_bytes]
torch::Tensor repack_x16(torch::Tensor w, int64_t n_out, int64_t k_in, int64_t ggml_type) {
    const Format f = format_of(ggml_type, k_in);
    const int64_t nb = k_in / QK;
    TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous() && w.numel() == n_out * nb * f.block_bytes,
                "w must be the contiguous GGML bytes of an [n_out, k_in] weight");
    auto out = torch::empty({n_out, f.row_bytes}, w.options());
    uint8_t* dst = out.data_ptr<uint8_t>();
    // Huge pages for the weight stream (asked before the first touch): on 4 KiB pages every decoded token
    // takes ~300k TLB misses and a prefetcher restart per page (E2B Q4_0 decode step 47-50 -> 41-45 ms).
    const uintptr_t huge = uintptr_t{2} << 20, begin = (reinterpret_cast<uintptr_t>(dst) + huge - 1) / huge * huge,
                    end = (reinterpret_cast<uintptr_t>(dst) + out.nbytes()) / huge * huge;
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
    const uint8_t* src = w.data_ptr<uint8_t>();
    at::parallel_for(0, n_out, 64, [&](int64_t n0, int64_t n1) {
        std::memset(dst + n0 * f.row_bytes, 0, (n1 - n0) * f.row_bytes);      // padding blocks: d = 0
        for (int64_t n = n0; n < n1; ++n)
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = src + (n * nb + b) * f.block_bytes;
                uint8_t* row = dst + n * f.row_bytes;
                uint8_t* grp = row + f.quants_at + (b / GROUP) * GROUP * f.quant_bytes;
                const int64_t lane = b % GROUP;
                std::memcpy(row + 2 * b, blk, 2);                                                   // d
                for (int64_t v = 0; v < f.quant_bytes / 4; ++v)
                    std::memcpy(grp + v * 64 + 4 * lane, blk + 2 + 4 * v, 4);
            }
    });
    return out;
}

// Where activation element `e` of block `lane` sits in a group's stream of 512 int16 (the order in
// which gemv_x16 multiplies them). A 32-bit weight lane holds bytes (4v, 4v+1 | 4v+2, 4v+3) of its
// block; the kernel splits it into int16 weights in these steps e:
//   Q8_0 (v = 0..7):  e0: bytes 0, 2 (sign-extended)   e1: bytes 1, 3
//   Q4_0 (v = 0..3):  e0: lo nibbles of bytes 0, 2    e1: of bytes 1, 3    e2, e3: the same for hi nibbles
// Byte r of vector v is weight 4v + r (Q8_0); its lo nibble weight 4v + r, its hi nibble 16 + 4v + r (Q4_0).
inline int64_t stream_pos(int64_t ggml_type, int64_t lane, int64_t elem) {
    if (ggml_type == Q8_0_TYPE) {
        const int64_t v = elem / 4, r = elem % 4;                         // r = e + 2t
        return (v * 2 + r % 2) * 32 + 2 * lane + r / 2;
    }
    const int64_t hi = elem / 16, v = (elem % 16) / 4, r = elem % 4;
    return (v * 4 + hi * 2 + r % 2) * 32 + 2 * lane + r / 2;
}

// One row of x -> the kernel's activation stream, per-block scales, and Q4_0's -8 * block sums.
// Each block is quantized in one register, its 32 values reordered so that 32-bit word k holds the pair
// that step k multiplies, and the 16 words scattered to lane `lane` of the group's 16 steps.
void prepare_row(const float* x, int64_t K, int64_t ggml_type, int16_t* stream, float* dx, int32_t* corr) {
    const int64_t nb = K / QK, G = groups_of(K);
    std::memset(stream, 0, G * GROUP_ELEMS * sizeof(int16_t));
    std::memset(dx, 0, G * GROUP * sizeof(float));
    std::memset(corr, 0, G * GROUP * sizeof(int32_t));
    alignas(64) int16_t order[QK];                            // order[2k + t] = element in half t of step k
    for (int64_t e = 0; e < QK; ++e) {
        const int64_t pos = stream_pos(ggml_type, 0, e);      // step * 32 + half, for lane 0
        order[pos / 32 * 2 + pos % 32] = static_cast<int16_t>(e);
    }
    const __m512i perm = _mm512_load_si512(order);
    const __m512i steps = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(GROUP));
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(v0)), _mm512_reduce_max_ps(_mm512_abs_ps(v1)));
        const float scale = amax / 32767.0f;
        const __m512 inv = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtsepi32_epi16(q0)), _mm512_cvtsepi32_epi16(q1), 1);
        const int64_t g = b / GROUP, lane = b % GROUP;
        // step k of the group lives at int32 index k * GROUP + lane of its stream
        _mm512_i32scatter_epi32(stream + g * GROUP_ELEMS, _mm512_add_epi32(steps, _mm512_set1_epi32(static_cast<int>(lane))),
                                _mm512_permutexvar_epi16(perm, q), 4);
        dx[g * GROUP + lane] = scale;
        corr[g * GROUP + lane] = -8 * (_mm512_reduce_add_epi32(q0) + _mm512_reduce_add_epi32(q1));
    }
}

// y[i, n] for rows n in [n0, n1) of W and MC rows of x.
template <int MC, int64_t TYPE>
void gemv_rows(const int16_t* stream, const float* dx, const int32_t* corr, const Format& f, const uint8_t* w,
               float* y, int64_t N, int64_t n0, int64_t n1) {
    constexpr int64_t QB = TYPE == Q8_0_TYPE ? 32 : 16, GB = GROUP * QB;
    constexpr int steps = TYPE == Q8_0_TYPE ? 2 : 4;          // int16 weight vectors per 64 quant bytes
    const int64_t G = f.groups, stride = G * GROUP_ELEMS;   // stride: the stream of one row of x
    const __m512i low4 = _mm512_set1_epi16(0x000F);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = w + n * f.row_bytes;
        __m512 acc[MC];
        for (int i = 0; i < MC; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
            const uint8_t* grp = row + f.quants_at + g * GB;
            const int16_t* xs = stream + g * GROUP_ELEMS;
            __m512i dot[MC];
            for (int i = 0; i < MC; ++i) dot[i] = TYPE == Q4_0_TYPE ? _mm512_loadu_si512(corr + i * G * GROUP + g * GROUP)
                                                                  : _mm512_setzero_si512();
            for (int64_t v = 0; v < QB / 4; ++v) {
                _mm_prefetch(reinterpret_cast<const char*>(grp + PREFETCH + v * 64), _MM_HINT_T0);
                const __m512i raw = _mm512_loadu_si512(grp + v * 64);
                __m512i e[4];
                if constexpr (TYPE == Q8_0_TYPE) {
                    e[0] = _mm512_srai_epi16(_mm512_slli_epi16(raw, 8), 8);          // bytes 0, 2 of each lane
                    e[1] = _mm512_srai_epi16(raw, 8);                                 // bytes 1, 3
                } else {
                    e[0] = _mm512_and_si512(raw, low4);                               // lo nibbles of bytes 0, 2
                    e[1] = _mm512_and_si512(_mm512_srli_epi16(raw, 8), low4);         // lo nibbles of bytes 1, 3
                    e[2] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);         // hi nibbles of bytes 0, 2
                    e[3] = _mm512_srli_epi16(raw, 12);                                // hi nibbles of bytes 1, 3
                }
                for (int s = 0; s < steps; ++s)
                    for (int i = 0; i < MC; ++i)
                        dot[i] = _mm512_dpwssd_epi32(dot[i], e[s], _mm512_loadu_si512(xs + i * stride + (v * steps + s) * 32));
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * GROUP * 2)));
            for (int i = 0; i < MC; ++i)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(d, _mm512_loadu_ps(dx + i * G * GROUP + g * GROUP)), acc[i]);
        }
        for (int i = 0; i < MC; ++i) y[i * N + n] = _mm512_reduce_add_ps(acc[i]);
    }
}

template <int64_t TYPE>
void gemv_chunk(int mc, const int16_t* stream, const float* dx, const int32_t* corr, const Format& f, const uint8_t* w,
                float* y, int64_t N, int64_t n0, int64_t n1) {
    switch (mc) {
        case 1: gemv_rows<1, TYPE>(stream, dx, corr, f, w, y, N, n0, n1); break;
        case 2: gemv_rows<2, TYPE>(stream, dx, corr, f, w, y, N, n0, n1); break;
        case 3: gemv_rows<3, TYPE>(stream, dx, corr, f, w, y, N, n0, n1); break;
        default: gemv_rows<4, TYPE>(stream, dx, corr, f, w, y, N, n0, n1); break;
    }
}

void check_x16(const torch::Tensor& w, int64_t n_out, const Format& f) {
    TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2 && w.size(0) == n_out
                && w.size(1) == f.row_bytes, "w must be the x16 layout of an [n_out, k_in] weight");
}

// x [M, k_in] prepared once (activation stream, scales, Q4_0 corrections) for any number of weights of
// one type that share it as input.
// A 64-byte aligned array: the kernels load 64 bytes at a time, and a load that straddles two cache
// lines costs two (with malloc's 16-byte alignment Q4_0 ran at 27 or 44 GB/s depending on the address).
template <typename T>
struct Aligned {
    T* data = nullptr;
    explicit Aligned(int64_t n) : data(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))) {
        TORCH_CHECK(data != nullptr, "out of memory");
    }
    ~Aligned() { std::free(data); }
    Aligned(const Aligned&) = delete;
    Aligned& operator=(const Aligned&) = delete;
};

int64_t rows_of(const torch::Tensor& x, int64_t k_in) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 && x.size(1) == k_in,
                "x must be contiguous float32 [M, k_in]");
    return x.size(0);
}

struct Prepared {
    Format f;
    int64_t type, M, per_row;             // per_row: stream elements of one row of x
    Aligned<int16_t> stream;
    Aligned<float> dx;
    Aligned<int32_t> corr;

    Prepared(const torch::Tensor& x, int64_t k_in, int64_t ggml_type)
        : f(format_of(ggml_type, k_in)), type(ggml_type), M(rows_of(x, k_in)), per_row(f.groups * GROUP_ELEMS),
          stream(M * per_row), dx(M * f.groups * GROUP), corr(M * f.groups * GROUP) {
        for (int64_t m = 0; m < M; ++m)
            prepare_row(x.data_ptr<float>() + m * k_in, k_in, type, stream.data + m * per_row,
                        dx.data + m * f.groups * GROUP, corr.data + m * f.groups * GROUP);
    }

    // y[m * ldy + n] for rows n in [n0, n1) of the x16 weight w, every row m of x
    void rows(const uint8_t* w, float* y, int64_t ldy, int64_t n0, int64_t n1) const {
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            const int mc = static_cast<int>(std::min<int64_t>(MAX_M, M - m0));
            const int16_t* s = stream.data + m0 * per_row;
            const float* sx = dx.data + m0 * f.groups * GROUP;
            const int32_t* c = corr.data + m0 * f.groups * GROUP;
            if (type == Q8_0_TYPE) gemv_chunk<Q8_0_TYPE>(mc, s, sx, c, f, w, y + m0 * ldy, ldy, n0, n1);
            else gemv_chunk<Q4_0_TYPE>(mc, s, sx, c, f, w, y + m0 * ldy, ldy, n0, n1);
        }
    }
};

constexpr int64_t GRAIN = 16;   // rows of W per task

torch::Tensor gemv_x16(torch::Tensor x, torch::Tensor w, int64_t n_out, int64_t k_in, int64_t ggml_type) {
    // x: [M, k_in] float32; w: x16 [n_out, row_bytes] -> y: [M, n_out] float32
    const Prepared p(x, k_in, ggml_type);
    check_x16(w, n_out, p.f);
    auto y = torch::empty({p.M, n_out}, x.options());
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, n_out, GRAIN, [&](int64_t n0, int64_t n1) { p.rows(wp, yp, n_out, n0, n1); });
    return y;
}

// The same x through several weights of one type (Q, K, V): one pass over their rows, one preparation.
std::vector<torch::Tensor> gemv_x16_multi(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> n_outs,
                                          int64_t k_in, int64_t ggml_type) {
    TORCH_CHECK(!ws.empty() && ws.size() == n_outs.size(), "one n_out per weight");
    const Prepared p(x, k_in, ggml_type);
    std::vector<torch::Tensor> ys;
    std::vector<int64_t> start{0};                       // first row of each weight in the joint row range
    for (size_t i = 0; i < ws.size(); ++i) {
        check_x16(ws[i], n_outs[i], p.f);
        ys.push_back(torch::empty({p.M, n_outs[i]}, x.options()));
        start.push_back(start.back() + n_outs[i]);
    }
    at::parallel_for(0, start.back(), GRAIN, [&](int64_t a, int64_t b) {
        for (size_t i = 0; i < ws.size(); ++i) {
            const int64_t lo = std::max(a, start[i]), hi = std::min(b, start[i + 1]);
            if (lo < hi) p.rows(ws[i].data_ptr<uint8_t>(), ys[i].data_ptr<float>(), n_outs[i], lo - start[i], hi - start[i]);
        }
    });
    return ys;
}

// gelu_tanh(x @ gate.T) * (x @ up.T): the gated MLP's first half in one pass (row n of both weights
// in the same task, the activation applied as each task finishes).
torch::Tensor gemv_x16_glu(torch::Tensor x, torch::Tensor gate, torch::Tensor up, int64_t n_out, int64_t k_in, int64_t ggml_type) {
    const Prepared p(x, k_in, ggml_type);
    check_x16(gate, n_out, p.f);
    check_x16(up, n_out, p.f);
    auto y = torch::empty({p.M, n_out}, x.options());
    std::vector<float> g(p.M * n_out);
    const uint8_t *gp = gate.data_ptr<uint8_t>(), *up_ = up.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, n_out, GRAIN, [&](int64_t n0, int64_t n1) {
        p.rows(gp, g.data(), n_out, n0, n1);
        p.rows(up_, yp, n_out, n0, n1);
        for (int64_t m = 0; m < p.M; ++m)
            for (int64_t n = n0; n < n1; n += 16) {
                const __mmask16 k = gem4_simd::live(n - n0, n1 - n0);
                float* yr = yp + m * n_out + n;
                const __m512 gv = _mm512_maskz_loadu_ps(k, g.data() + m * n_out + n);
                _mm512_mask_storeu_ps(yr, k, _mm512_mul_ps(gem4_simd::gelu_tanh_ps(gv), _mm512_maskz_loadu_ps(k, yr)));
            }
    });
    return y;
}

// Rows [n0, n1) of an x16 weight -> out (row-major, k_in per row) as float32 or bf16 (w = d * q, or
// d * (q - 8); exact in float32).
void dequant_rows(const uint8_t* wp, const Format& f, int64_t k_in, int64_t ggml_type, bool bf16, int64_t n0, int64_t n1,
                  uint8_t* op) {
    const int64_t nb = k_in / QK, out_size = bf16 ? 2 : 4;
    for (int64_t n = n0; n < n1; ++n)
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* row = wp + n * f.row_bytes;
            const uint8_t* grp = row + f.quants_at + (b / GROUP) * GROUP * f.quant_bytes;
            const int64_t lane = b % GROUP;
            alignas(32) uint8_t q[32];                       // the block's quant bytes in GGML order
            for (int64_t v = 0; v < f.quant_bytes / 4; ++v) std::memcpy(q + 4 * v, grp + v * 64 + 4 * lane, 4);
            uint16_t dbits;
            std::memcpy(&dbits, row + 2 * b, 2);
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(dbits));
            __m512 w0, w1;
            if (ggml_type == Q8_0_TYPE) {
                w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q))));
                w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16))));
            } else {
                const __m512i raw = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q)));
                const __m512i mask = _mm512_set1_epi32(0x0F), eight = _mm512_set1_epi32(8);
                w0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(raw, mask), eight));
                w1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(raw, 4), eight));
            }
            w0 = _mm512_mul_ps(w0, d);
            w1 = _mm512_mul_ps(w1, d);
            uint8_t* dst = op + ((n - n0) * k_in + b * QK) * out_size;
            if (bf16) {
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(w0));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), (__m256i)_mm512_cvtneps_pbh(w1));
            } else {
                _mm512_storeu_ps(reinterpret_cast<float*>(dst), w0);
                _mm512_storeu_ps(reinterpret_cast<float*>(dst) + 16, w1);
            }
        }
}

// x16 [N, ...] -> [N, K] float32 or bf16
torch::Tensor dequant_x16(torch::Tensor w, int64_t n_out, int64_t k_in, int64_t ggml_type, bool bf16) {
    const Format f = format_of(ggml_type, k_in);
    check_x16(w, n_out, f);
    auto out = torch::empty({n_out, k_in}, w.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
    const uint8_t* wp = w.data_ptr<uint8_t>();
    uint8_t* op = static_cast<uint8_t*>(out.data_ptr());
    const int64_t row_out = k_in * (bf16 ? 2 : 4);
    at::parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) { dequant_rows(wp, f, k_in, ggml_type, bf16, n0, n1, op + n0 * row_out); });
    return out;
}

constexpr int64_t TILE_BYTES = 4 << 20;   // bf16 weight rows per prefill tile: a few MB, so they stay in L3

// x [T, k_in] bf16 @ W.T -> [T, n_out] bf16, for prefill chunks: W is turned into bf16 a tile of rows at a
// time and each tile is multiplied while it is still in cache (one bf16 GEMM per tile), instead of
// writing the whole bf16 weight to memory and reading it back.
torch::Tensor linear_x16(torch::Tensor x, torch::Tensor w, int64_t n_out, int64_t k_in, int64_t ggml_type) {
    const Format f = format_of(ggml_type, k_in);
    check_x16(w, n_out, f);
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2 && x.size(1) == k_in, "x must be bf16 [T, k_in]");
    const int64_t T = x.size(0), tile = std::max<int64_t>(16, TILE_BYTES / (2 * k_in)) / 16 * 16;
    auto y = torch::empty({T, n_out}, x.options());
    auto buf = torch::empty({std::min(tile, n_out), k_in}, x.options());
    const uint8_t* wp = w.data_ptr<uint8_t>();
    uint8_t* bp = static_cast<uint8_t*>(buf.data_ptr());
    for (int64_t t0 = 0; t0 < n_out; t0 += tile) {
        const int64_t rows = std::min(tile, n_out - t0);
        at::parallel_for(t0, t0 + rows, 16, [&](int64_t n0, int64_t n1) {
            dequant_rows(wp, f, k_in, ggml_type, true, n0, n1, bp + (n0 - t0) * k_in * 2);
        });
        auto out = y.narrow(1, t0, rows);                  // a column block: rows stride n_out (the GEMM's ldc)
        at::mm_out(out, x, buf.narrow(0, 0, rows).t());
    }
    return y;
}

}  // namespace gem4_ops

using namespace gem4_ops;

TORCH_LIBRARY(gem4_kernels, m) {
    m.def("repack_x16(Tensor w, int n_out, int k_in, int ggml_type) -> Tensor", &repack_x16);
    m.def("gemv_x16(Tensor x, Tensor w, int n_out, int k_in, int ggml_type) -> Tensor", &gemv_x16);
    m.def("gemv_x16_multi(Tensor x, Tensor[] ws, int[] n_outs, int k_in, int ggml_type) -> Tensor[]", &gemv_x16_multi);
    m.def("gemv_x16_glu(Tensor x, Tensor gate, Tensor up, int n_out, int k_in, int ggml_type) -> Tensor", &gemv_x16_glu);
    m.def("dequant_x16(Tensor w, int n_out, int k_in, int ggml_type, bool bf16) -> Tensor", &dequant_x16);
    m.def("linear_x16(Tensor x, Tensor w, int n_out, int k_in, int ggml_type) -> Tensor", &linear_x16);
}
