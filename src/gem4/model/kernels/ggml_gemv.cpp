// Products with Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K weights (AVX-512 + VNNI, AMX where the CPU
// grants it), in a load-time layout made for them: Q8_0 / Q4_0 in panels of 16 rows (panels.h: a VNNI and an
// AMX kernel that agree bit for bit), the others in the "x16" layout below.
//
// GGML block (32 weights):  Q8_0: fp16 d | int8 q[32]                           w = d * q
//                           Q4_0: fp16 d | u8 qs[16] (lo nibble: j, hi: j + 16)   w = d * (q - 8)
//                           Q4_1 / Q5_0 / Q5_1: Q4_0's nibbles (+ qh: bit j = bit 4 of weight j; + fp16 m)
//                           w = d q + m / d (q - 16) / d q + m
//                           MLX_A4 / MLX_A8 (gem4's blocks of MLX affine checkpoints): Q4_1 with bf16 s, b; A8 u8 q
// K-quants (super-blocks of 256 weights): kquants.h. Their x16 rows use Q4_0's 32-weight blocks, groups and
// nibble order for the low 4 bits of q, plus high-bit vectors and unpacked sub-block scales per group
// (lossless: dequant gives quants.py's reference values bit for bit); gemv_rows_k is their GEMV.
//
// The "x16" layout (repack, once at load; every type but Q8_0 / Q4_0): each row's blocks in groups of 16, the
// last 1..15 a tail group when the row's blocks are not a multiple of 16, stored unpadded, so that a packed
// weight is the file's size (26B-A4B's 2816 inputs: 88 blocks, 5 groups and a tail of 8; 704: 1 and 6). A packed
// weight is two parts (X16): its rows' whole groups' quant bytes, main_bytes a row, contiguous, so that every
// 64-byte load is cache-line aligned (unaligned loads cost a fifth of the Q4_0 speed) and the rows are read front
// to back; then a side record per row: every group's scales (fp16, 16 per group, and m), then the tail group's
// quants (TailGroup). The kernels read a tail group through a 64-byte aligned copy of it padded with zero
// blocks (d = 0), with the code and arithmetic of a whole group: the results are those of the padded rows, bit
// for bit. The rows of a packed weight are not separable: a stack of weights (experts) is packed in units,
// each its rows' main parts then their side records (repack's `units`). A group's quant bytes are Q/4 vectors of 64 bytes
// (Q = 16 for the nibbles, more with high bits): vector v holds bytes 4v..4v+3 of each of the 16 blocks, block b
// at bytes 4b..4b+3. So a 32-bit lane of any vector belongs to one block, and so does that lane of the
// integer accumulator: a group needs one float conversion and one scale multiply, not 16. The buffer
// asks for transparent huge pages: it is streamed once per decoded token.
//
// gemv: y[m, n] = sum_k x[m, k] W[n, k] (Q8_0 / Q4_0: panels.h, x in int8). For the x16 types activations
// are quantized per 32-block to int16 (relative error <= 2^-16 of the block's largest value, far below bf16's
// 2^-9) and laid out in the order the kernel reads them; each 16-bit half of a weight lane is one weight, so
// one vpdpwssd takes two weights of every block of the group, with exact integer products and sums. An
// offset of the quants (Q5_0's "- 16", Q6_K's "- 32") is applied once per block as a multiple of the
// activation block's sum. The weights are read once per call for up to 8 rows of x at a
// time; rows of W are split across torch's intra-op threads. gemv_multi (several weights, one x)
// and gemv_glu (gelu(x Gate^T) * x Up^T) share one preparation of x and one parallel pass.
// dequant turns (rows of) a weight back into float32 or bf16 (token tables are looked up by rows);
// linear_packed is prefill's GEMM (tile_gemm.h): 32 rows of W at a time turned into bf16, row-invariant.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstdint>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ggml_types.h"
#include "kquants.h"
#include "ops.h"
#include "panels.h"
#include "simd.h"
#include "tile_gemm.h"

namespace gem4_ops {

using gem4_ggml::QK, gem4_ggml::Q8_0, gem4_ggml::Q4_0, gem4_ggml::Q4_1, gem4_ggml::Q5_0, gem4_ggml::Q5_1;
using gem4_ggml::MLX_A4, gem4_ggml::MLX_A8;
constexpr int GROUP = 16;              // blocks per x16 group
constexpr int64_t GROUP_ELEMS = GROUP * QK;
constexpr int MAX_M = 8;               // rows of x handled per pass over a row of W
constexpr int64_t PREFETCH = 2048;     // software prefetch distance in the weight stream (faster in most runs)
// Q4_1 / Q5_0 / Q5_1 (32-weight blocks): Q4_0's nibbles; Q5_0 / Q5_1 add one high-bit vector per group (bit i
// of the block's qh placed as for Q5_K, kquants.h); Q4_1 / Q5_1 keep their fp16 m beside d (64 scale bytes a group).
constexpr bool legacy_high(int64_t t) { return t == Q5_0 || t == Q5_1; }
// MLX_A4 / MLX_A8 (MLX's affine checkpoints, ggml_types.h): Q4_1's arithmetic with bf16 s and b in place of
// fp16 d and m (bf16 -> float32 is exact), MLX_A4 in Q4_1's nibbles; MLX_A8's unsigned bytes take 8 vectors of
// 64 bytes a group, vector u holding bytes 16 (u % 2) + 4 (u / 2) + 0..3 of each block (affine8_elem), so that its
// low and high bytes are the activation stream's steps 2u and 2u + 1 (stream_pos).
constexpr bool affine(int64_t t) { return t == MLX_A4 || t == MLX_A8; }
constexpr bool legacy_min(int64_t t) { return t == Q4_1 || t == Q5_1 || affine(t); }
constexpr int64_t affine8_elem(int64_t u, int64_t r) { return 16 * (u % 2) + 4 * (u / 2) + r; }
// a group's 16 scales (or biases) to float32: bf16 for MLX_A4 / MLX_A8, fp16 for the GGML types
inline __m512 group_scales(const uint8_t* p, bool bf16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)) : _mm512_cvtph_ps(bits);
}
inline float scale_at(const uint8_t* p, bool bf16) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    if (!bf16) return _cvtsh_ss(bits);
    const uint32_t wide = uint32_t{bits} << 16;
    float f;
    std::memcpy(&f, &wide, 4);
    return f;
}

struct Format {
    int64_t type;          // GGML type id
    int64_t block_bytes;   // GGML block (32 weights; K-quants: super-block of 256)
    int64_t block_elems;   // weights per GGML block
    int64_t quant_bytes;   // x16 quant bytes per 32-weight block (nibbles / int8, then K-quant high bits)
    int64_t meta_bytes;    // scales per x16 group (Q4_1 / Q5_x: 16 fp16 d (and m); K-quants: kquants.h)
    int64_t groups;        // x16 groups per row, the tail group included
    int64_t full;          // of those, whole groups of 16 blocks
    int64_t tail;          // blocks in the row's tail group (0..15; K-quants 0 or 8)
    int64_t tail_meta;     // the tail group's scales, unpadded (tail_meta_bytes)
    int64_t main_bytes;    // a row's whole groups' quants in the main part of the tensor
    int64_t side_bytes;    // a row's side record: every group's scales, then the tail group's quants
    int64_t row_bytes;     // main_bytes + side_bytes (panel types: a 16th of a panel)
    bool panel;            // Q8_0 / Q4_0: the panel layout (panels.h); the fields above but row_bytes unused
};

// Rows of the packed tensor of an [n_out, k_in] weight: panels hold whole multiples of 16.
int64_t packed_rows(const Format& f, int64_t n_out) { return f.panel ? (n_out + 15) / 16 * 16 : n_out; }

Format format_of(int64_t ggml_type, int64_t k_in) {
    const bool k = gem4_kq::is_k(ggml_type);
    TORCH_CHECK(ggml_type == Q8_0 || ggml_type == Q4_0 || ggml_type == Q4_1 || legacy_high(ggml_type) || k || affine(ggml_type),
                "GGML type ", ggml_type, " has no kernels (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MLX_A4 and MLX_A8 "
                "have: ggml_types.h)");
    const int64_t block = k ? gem4_kq::QK_K : QK;
    TORCH_CHECK(k_in > 0 && k_in % block == 0, "k_in must be a positive multiple of ", block, " for this type");
    if (gem4_panels::is_panel_type(ggml_type)) {
        const gem4_panels::Panels P = gem4_panels::panels_of(ggml_type, 1, k_in);
        const int64_t row = P.panel_bytes / gem4_panels::PANEL;
        return {ggml_type, gem4_ggml::type_size(ggml_type), QK, P.qb, 0, 0, 0, 0, 0, row, 0, row, true};
    }
    const int64_t q = ggml_type == MLX_A8 ? 32 : 16 + 4 * (k ? gem4_kq::high_vectors(ggml_type) : legacy_high(ggml_type));
    const int64_t F = k_in / QK / GROUP, T = k_in / QK % GROUP;
    const int64_t meta = k ? gem4_kq::meta_bytes(ggml_type) : GROUP * 2 * (legacy_min(ggml_type) ? 2 : 1);
    const int64_t tail_meta = T == 0 ? 0 : k ? gem4_kq::tail_meta_bytes(ggml_type) : 2 * T * (legacy_min(ggml_type) ? 2 : 1);
    const int64_t main = F * GROUP * q, side = F * meta + tail_meta + T * q;
    return {ggml_type, gem4_ggml::type_size(ggml_type), block, q, meta, F + (T > 0), F, T, tail_meta, main, side, main + side, false};
}

// A packed x16 tensor of `rows` rows (one unit of repack): the rows' whole groups, main_bytes a row from `main` (64-byte
// aligned when the tensor is), then their side records, side_bytes a row from `side`. Panel types: main only.
struct X16 {
    const uint8_t* main;
    const uint8_t* side;
};
X16 x16_of(const uint8_t* w, int64_t rows, const Format& f) { return {w, f.panel ? nullptr : w + rows * f.main_bytes}; }

// A row's tail group as a whole group, in 64-byte aligned buffers: its T blocks' quants and scales where a group keeps
// a block's, the other lanes zero (the blocks that padded a row before tail groups: d = 0, q = 0), so the kernels
// read it with the code and arithmetic of a whole group. Unpadded in the side record (after the row's scales):
//   Q4_1 / Q5_x / MLX: d[T] (fp16 / bf16), then m[T] where the type has one | vector v's lanes 0..T-1 (4T bytes) ...
//   Q4_K / Q5_K: sc[8], min[8], d, dmin (fp16); Q6_K: sc[8] (first 16 weights), sc[8] (last 16), d | vectors as above
struct TailGroup {
    alignas(64) uint8_t q[GROUP * 32];     // Q / 4 vectors of 64 bytes (MLX_A8's 8 at most)
    alignas(64) uint8_t meta[64];          // as a group's scales (meta_bytes, at most 64)

    // the side record's tail (at side_row + full * meta_bytes) -> the buffers
    // (masked loads: one per 64-byte vector, the lanes past the tail zero; a decode step expands every tail it reads)
    void expand(const Format& f, const uint8_t* side_row) {
        const uint8_t* tm = side_row + f.full * f.meta_bytes;
        const uint8_t* tq = tm + f.tail_meta;
        const int64_t T = f.tail;
        const __mmask16 lanes = static_cast<__mmask16>((1u << T) - 1);
        for (int64_t v = 0; v < f.quant_bytes / 4; ++v)
            _mm512_store_si512(q + 64 * v, _mm512_maskz_loadu_epi32(lanes, tq + 4 * T * v));
        if (gem4_kq::is_k(f.type)) {
            _mm512_store_si512(meta, _mm512_setzero_si512());
            std::memcpy(meta, tm, 8);
            std::memcpy(meta + 16, tm + 8, 8);
            std::memcpy(meta + 32, tm + 16, 2);                        // d of the first super-block (the second's 0)
            if (f.type != gem4_kq::Q6_K) std::memcpy(meta + 36, tm + 18, 2);
            return;
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(meta), _mm256_maskz_loadu_epi16(lanes, tm));
        _mm256_store_si256(reinterpret_cast<__m256i*>(meta + 32),
                           legacy_min(f.type) ? _mm256_maskz_loadu_epi16(lanes, tm + 2 * T) : _mm256_setzero_si256());
    }
    // the buffers (lanes >= T unused) -> the side record's tail
    void compact(const Format& f, uint8_t* side_row) const {
        uint8_t* tm = side_row + f.full * f.meta_bytes;
        uint8_t* tq = tm + f.tail_meta;
        const int64_t T = f.tail, lanes = 4 * T;
        for (int64_t v = 0; v < f.quant_bytes / 4; ++v) std::memcpy(tq + lanes * v, q + 64 * v, lanes);
        if (gem4_kq::is_k(f.type)) {
            std::memcpy(tm, meta, 8);
            std::memcpy(tm + 8, meta + 16, 8);
            std::memcpy(tm + 16, meta + 32, 2);
            if (f.type != gem4_kq::Q6_K) std::memcpy(tm + 18, meta + 36, 2);
            return;
        }
        std::memcpy(tm, meta, 2 * T);
        if (legacy_min(f.type)) std::memcpy(tm + 2 * T, meta + 32, 2 * T);
    }
};

// GGML [N, K / block weights] -> the packed layout: panels (Q8_0 / Q4_0, panels.h), else x16 [N, row_bytes] in `units`
// units of N / units rows, each self-contained (X16: its rows' main parts, then their side records), so that rows
// [u N / units, (u + 1) N / units) of the result are a packed weight of their own (an expert of a stack)
at::Tensor repack(at::Tensor w, int64_t n_out, int64_t k_in, int64_t ggml_type, int64_t units) {
    const Format f = format_of(ggml_type, k_in);
    const int64_t nb = k_in / f.block_elems;               // GGML blocks per row
    TORCH_CHECK(w.dtype() == at::kByte && w.is_contiguous() && w.numel() == n_out * nb * f.block_bytes,
                "w must be the contiguous GGML bytes of an [n_out, k_in] weight");
    TORCH_CHECK(units > 0 && n_out % units == 0, "units must divide n_out (", n_out, " rows in ", units, " units)");
    auto out = at::empty({packed_rows(f, n_out), f.row_bytes}, w.options());
    uint8_t* dst = out.data_ptr<uint8_t>();
    // Huge pages for the weight stream (asked before the first touch): on 4 KiB pages every decoded token
    // takes ~300k TLB misses and a prefetcher restart per page (E2B Q4_0 decode step 47-50 -> 41-45 ms).
    const uintptr_t huge = uintptr_t{2} << 20, begin = (reinterpret_cast<uintptr_t>(dst) + huge - 1) / huge * huge,
                    end = (reinterpret_cast<uintptr_t>(dst) + out.nbytes()) / huge * huge;
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
    const uint8_t* src = w.data_ptr<uint8_t>();
    if (f.panel) {
        const gem4_panels::Panels P = gem4_panels::panels_of(ggml_type, n_out, k_in);
        at::parallel_for(0, P.panels, 4, [&](int64_t p0, int64_t p1) {
            for (int64_t p = p0; p < p1; ++p) gem4_panels::repack_panel(src, P, p, dst + p * P.panel_bytes);
        });
        return out;
    }
    const int64_t group_bytes = GROUP * f.quant_bytes, per_unit = n_out / units;
    at::parallel_for(0, n_out, 64, [&](int64_t n0, int64_t n1) {
        gem4_kq::Super sb;
        TailGroup tail;
        const gem4_kq::HighBits hb = gem4_kq::high_bits(legacy_high(f.type) ? gem4_kq::Q5_K : f.type);
        for (int64_t n = n0; n < n1; ++n) {
            const int64_t u = n / per_unit, r = n % per_unit;
            uint8_t* main = dst + u * per_unit * f.row_bytes + r * f.main_bytes;
            uint8_t* side = dst + u * per_unit * f.row_bytes + per_unit * f.main_bytes + r * f.side_bytes;
            std::memset(main, 0, f.main_bytes);
            std::memset(side, 0, f.side_bytes);
            std::memset(tail.q, 0, sizeof tail.q);
            std::memset(tail.meta, 0, sizeof tail.meta);
            // group g's quants and scales: in place, or the tail group's buffers (unpadded into the side record below)
            auto quants = [&](int64_t g) { return g < f.full ? main + g * group_bytes : tail.q; };
            auto scales = [&](int64_t g) { return g < f.full ? side + g * f.meta_bytes : tail.meta; };
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = src + (n * nb + b) * f.block_bytes;
                if (f.block_elems == gem4_kq::QK_K) {                            // super-block b: half b % 2 of group b / 2
                    gem4_kq::decode(f.type, blk, sb);
                    gem4_kq::place_super(f.type, sb, static_cast<int>(b % 2), hb, quants(b / 2), scales(b / 2));
                    continue;
                }
                uint8_t* grp = quants(b / GROUP);
                uint8_t* meta = scales(b / GROUP);
                const int64_t lane = b % GROUP;
                std::memcpy(meta + 2 * lane, blk, 2);                                               // d
                if (legacy_min(f.type)) std::memcpy(meta + 32 + 2 * lane, blk + 2, 2);              // m
                const int64_t qh_at = 2 + 2 * legacy_min(f.type), qs_at = qh_at + 4 * legacy_high(f.type);
                if (f.type == MLX_A8) {
                    for (int64_t u = 0; u < 8; ++u)
                        std::memcpy(grp + u * 64 + 4 * lane, blk + qs_at + affine8_elem(u, 0), 4);
                    continue;
                }
                for (int64_t v = 0; v < 4; ++v)
                    std::memcpy(grp + v * 64 + 4 * lane, blk + qs_at + 4 * v, 4);
                if (legacy_high(f.type)) {                                                          // bit e of qh: weight e
                    uint32_t qh, word = 0;
                    std::memcpy(&qh, blk + qh_at, 4);
                    for (int e = 0; e < 32; ++e) word |= ((qh >> e) & 1u) << hb.shift[e];
                    std::memcpy(grp + 256 + 4 * lane, &word, 4);
                }
            }
            if (f.tail) tail.compact(f, side);
        }
    });
    return out;
}

// Where activation element `e` of block `lane` sits in a group's stream of 512 int16 (the order in
// which gemv multiplies them). A 32-bit weight lane holds bytes (4v, 4v+1 | 4v+2, 4v+3) of its
// block; the kernel splits it into int16 weights in these steps e (v = 0..3):
//   e0: lo nibbles of bytes 0, 2    e1: of bytes 1, 3    e2, e3: the same for hi nibbles
// The lo nibble of byte r of vector v is weight 4v + r, its hi nibble 16 + 4v + r (high bits: kquants.h).
inline int64_t stream_pos(int64_t lane, int64_t elem) {
    const int64_t hi = elem / 16, v = (elem % 16) / 4, r = elem % 4;
    return (v * 4 + hi * 2 + r % 2) * 32 + 2 * lane + r / 2;
}

// Row i of a chunk of mc rows of x -> the kernel's activation stream, per-block scales, and the block sums the
// weights' offsets need: Q4_0 -8 * sum (corr); Q6_K -32 * the sums of the block's first and last 16 (corr,
// corr2); Q4_K / Q5_K scale * sum (xsum, for the sub-block mins). K-quants take Q4_0's stream order (kquants.h).
// The chunk's rows are interleaved (the kernels then address every row's operands from one pointer with
// constant offsets; with a pointer per row, the compiler ran out of registers and reloaded addresses from
// the stack before every multiply): the 64-byte stream vector of (group g, step k, row i) is vector
// (g * STEPS + k) * mc + i, and the per-block values of (g, i) are at (g * mc + i) * GROUP. The arrays come
// zeroed (a tail group's missing blocks stay 0).
// Each block is quantized in one register, its 32 values reordered so that 32-bit word k holds the pair
// that step k multiplies, and the 16 words scattered to lane `lane` of the group's 16 steps.
constexpr int64_t STEPS = GROUP_ELEMS / 32;   // 64-byte stream vectors per group and row
void prepare_row(const float* x, int64_t K, int64_t ggml_type, int64_t mc, int64_t i, int16_t* stream, float* dx,
                 int32_t* corr, int32_t* corr2, float* xsum) {
    const int64_t nb = K / QK;
    alignas(64) int16_t order[QK];                            // order[2k + t] = element in half t of step k
    for (int64_t e = 0; e < QK; ++e) {
        const int64_t pos = stream_pos(0, e);                 // step * 32 + half, for lane 0
        order[pos / 32 * 2 + pos % 32] = static_cast<int16_t>(e);
    }
    const __m512i perm = _mm512_load_si512(order);
    const __m512i steps = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(mc * 16)));   // int32 units
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(v0)), _mm512_reduce_max_ps(_mm512_abs_ps(v1)));
        const float scale = gem4_simd::has_nan(v0, v1) ? NAN : amax / 32767.0f;      // as panels.h's quantize_block
        const __m512 inv = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtsepi32_epi16(q0)), _mm512_cvtsepi32_epi16(q1), 1);
        const int64_t g = b / GROUP, lane = b % GROUP, at = (g * mc + i) * GROUP + lane;
        // step k of the group: 32-bit word `lane` of stream vector (g * STEPS + k) * mc + i
        _mm512_i32scatter_epi32(stream + (g * STEPS * mc + i) * 32, _mm512_add_epi32(steps, _mm512_set1_epi32(static_cast<int>(lane))),
                                _mm512_permutexvar_epi16(perm, q), 4);
        dx[at] = scale;
        const int32_t lo = _mm512_reduce_add_epi32(q0), hi = _mm512_reduce_add_epi32(q1);
        if (ggml_type == Q5_0) {
            corr[at] = -16 * (lo + hi);
        } else if (ggml_type == gem4_kq::Q6_K) {
            corr[at] = -32 * lo;
            corr2[at] = -32 * hi;
        } else if (gem4_kq::is_k(ggml_type) || legacy_min(ggml_type)) {
            xsum[at] = scale * static_cast<float>(lo + hi);
        }
    }
}

// A chunk of rows of x as prepare_row lays them out.
struct XChunk {
    const int16_t* stream;
    const float* dx;
    const int32_t* corr;
    const int32_t* corr2;
    const float* xsum;
};

// The groups [g0, g1) of a pass: a row's 16-lane sums carry over in `part` (MC vectors per row of W, from row
// n0 on) when g1 < groups, and go to y when g1 = groups. Splitting the groups keeps the chunk's activations in
// L1 (8 rows of x over 6144 inputs are 96 KB) and leaves each sum's order as it is: group after group.
struct Span {
    int64_t g0, g1;
    float* part;

    // row r (from n0) of W: its MC sums at the span's start, and where they go at its end (y[i * N] at the last)
    template <int MC>
    void begin(int64_t r, __m512 (&acc)[MC]) const {
        for (int i = 0; i < MC; ++i) acc[i] = g0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(part + (r * MC + i) * 16);
    }
    template <int MC>
    void end(int64_t r, const __m512 (&acc)[MC], bool last, float* y, int64_t N) const {
        for (int i = 0; i < MC; ++i) {
            if (last) y[i * N] = _mm512_reduce_add_ps(acc[i]);
            else _mm512_store_ps(part + (r * MC + i) * 16, acc[i]);
        }
    }
};

// y[i, n] for rows n in [n0, n1) of W and MC rows of x.
// Q4_1 / Q5_0 / Q5_1: y += dot_b (d_b dx_b) [+ m_b xsum_b], dot_b from Q5_0's -16 * sum (corr) or 0; Q5_0 / Q5_1
// merge their high bits as Q5_K does (gemv_rows_k).
// Each row of x takes the same operations in the same order whatever MC is (batch invariance).
template <int MC, int64_t TYPE>
void gemv_rows(const XChunk& x, const Format& f, const X16& w, float* y, int64_t N, int64_t n0, int64_t n1, const Span& sp) {
    const int16_t* stream = x.stream;
    const float *dx = x.dx, *xsum = x.xsum;
    const int32_t* corr = x.corr;
    constexpr bool H5 = legacy_high(TYPE), M = legacy_min(TYPE), A8 = TYPE == MLX_A8, BF = affine(TYPE);
    constexpr int64_t QB = H5 ? 20 : A8 ? 32 : 16, GB = GROUP * QB;
    constexpr int NV = A8 ? 8 : 4, steps = A8 ? 2 : 4;   // 64-byte vectors of nibbles (bytes); int16 weight vectors per vector
    const __m512i low8 = _mm512_set1_epi16(0x00FF);
    const int64_t G = f.groups;
    const __m512i low4 = _mm512_set1_epi16(0x000F), hmask = _mm512_set1_epi32(0x00100010);
    TailGroup tail;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w.main + n * f.main_bytes, *side = w.side + n * f.side_bytes;
        if (f.tail && sp.g1 == G) tail.expand(f, side);
        __m512 acc[MC];
        sp.begin<MC>(n - n0, acc);
        for (int64_t g = sp.g0; g < sp.g1; ++g) {
            const bool whole = g < f.full;                          // else the tail group, from its buffers
            const uint8_t* grp = whole ? row + g * GB : tail.q;
            const uint8_t* meta = whole ? side + g * f.meta_bytes : tail.meta;
            const int16_t* xs = stream + g * GROUP_ELEMS * MC;      // vector (k, i) at xs + (k * MC + i) * 32
            const int64_t at = g * MC * GROUP;                      // row i's per-block values at at + i * GROUP
            __m512i dot[MC];
            for (int i = 0; i < MC; ++i)
                dot[i] = TYPE == Q5_0 ? _mm512_load_si512(corr + at + i * GROUP) : _mm512_setzero_si512();
            __m512i h0 = _mm512_setzero_si512();
            if constexpr (H5) {
                _mm_prefetch(reinterpret_cast<const char*>(grp + PREFETCH + 256), _MM_HINT_T0);
                h0 = _mm512_loadu_si512(grp + 256);
            }
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) {
                _mm_prefetch(reinterpret_cast<const char*>(grp + PREFETCH + v * 64), _MM_HINT_T0);
                const __m512i raw = _mm512_loadu_si512(grp + v * 64);
                __m512i e[4];
                if constexpr (A8) {
                    e[0] = _mm512_and_si512(raw, low8);                               // bytes 0, 2
                    e[1] = _mm512_srli_epi16(raw, 8);                                 // bytes 1, 3
                } else {
                    e[0] = _mm512_and_si512(raw, low4);                               // lo nibbles of bytes 0, 2
                    e[1] = _mm512_and_si512(_mm512_srli_epi16(raw, 8), low4);         // lo nibbles of bytes 1, 3
                    e[2] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);         // hi nibbles of bytes 0, 2
                    e[3] = _mm512_srli_epi16(raw, 12);                                // hi nibbles of bytes 1, 3
                }
#pragma GCC unroll 4
                for (int s = 0; s < steps; ++s) {
                    if constexpr (H5)
                        e[s] = _mm512_ternarylogic_epi32(e[s], _mm512_rolv_epi32(h0, _mm512_set1_epi32((4 - (4 * v + s)) & 31)), hmask, 0xF8);
                    for (int i = 0; i < MC; ++i)
                        dot[i] = _mm512_dpwssd_epi32(dot[i], e[s], _mm512_load_si512(xs + ((v * steps + s) * MC + i) * 32));
                }
            }
            const __m512 d = group_scales(meta, BF);
            for (int i = 0; i < MC; ++i)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(d, _mm512_load_ps(dx + at + i * GROUP)), acc[i]);
            if constexpr (M) {
                const __m512 m = group_scales(meta + 32, BF);
                for (int i = 0; i < MC; ++i) acc[i] = _mm512_fmadd_ps(m, _mm512_load_ps(xsum + at + i * GROUP), acc[i]);
            }
        }
        sp.end<MC>(n - n0, acc, sp.g1 == G, y + n, N);
    }
}


// The K-quant GEMV (kquants.h has the layout): Q4_0's nibble steps, each weight's high bits or'ed in by a
// rotate and a ternary-logic merge, and the sub-block scales applied per group, for MC rows of x:
//   Q4_K / Q5_K  y += dot_b (d sc_b dx_b) - (dmin min_b) xsum_b                     (one sub-block per lane)
//   Q6_K         y += (dotA_b (d scA_b) + dotB_b (d scB_b)) dx_b, dotA / dotB from -32 * sum (corr / corr2)
// Every row of x takes the same operations in the same order whatever MC is (batch invariance).
template <int MC, int64_t TYPE>
void gemv_rows_k(const XChunk& x, const Format& f, const X16& w, float* y, int64_t N, int64_t n0, int64_t n1, const Span& sp) {
    const int16_t* stream = x.stream;
    const float *dx = x.dx, *xsum = x.xsum;
    const int32_t *corr = x.corr, *corr2 = x.corr2;
    constexpr bool Q6 = TYPE == gem4_kq::Q6_K, Q5 = TYPE == gem4_kq::Q5_K;
    constexpr int64_t GB = GROUP * (16 + 4 * (Q6 ? 2 : Q5 ? 1 : 0));
    const int64_t G = f.groups;
    const __m512i low4 = _mm512_set1_epi16(0x000F);
    const __m512i hmask = _mm512_set1_epi32(Q6 ? 0x00300030 : 0x00100010);     // bits 4(-5) of both halves
    const __m512i two_d = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);   // lanes 8..15: super 1
    TailGroup tail;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w.main + n * f.main_bytes, *side = w.side + n * f.side_bytes;
        if (f.tail && sp.g1 == G) tail.expand(f, side);
        __m512 acc[MC];
        sp.begin<MC>(n - n0, acc);
        for (int64_t g = sp.g0; g < sp.g1; ++g) {
            const bool whole = g < f.full;                          // else the tail group, from its buffers
            const uint8_t* grp = whole ? row + g * GB : tail.q;
            const uint8_t* meta = whole ? side + g * f.meta_bytes : tail.meta;
            const int16_t* xs = stream + g * GROUP_ELEMS * MC;      // interleaved rows, as in gemv_rows
            const int64_t at = g * MC * GROUP;
            __m512i dot[MC], dot2[MC];                 // Q6_K: dot for weights 0..15 of each block, dot2 16..31
            for (int i = 0; i < MC; ++i) {
                dot[i] = Q6 ? _mm512_load_si512(corr + at + i * GROUP) : _mm512_setzero_si512();
                dot2[i] = Q6 ? _mm512_load_si512(corr2 + at + i * GROUP) : _mm512_setzero_si512();
            }
            __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
            if constexpr (Q5 || Q6) {
                _mm_prefetch(reinterpret_cast<const char*>(grp + PREFETCH + 256), _MM_HINT_T0);
                h0 = _mm512_loadu_si512(grp + 256);
            }
            if constexpr (Q6) {
                _mm_prefetch(reinterpret_cast<const char*>(grp + PREFETCH + 320), _MM_HINT_T0);
                h1 = _mm512_loadu_si512(grp + 320);
            }
#pragma GCC unroll 4
            for (int v = 0; v < 4; ++v) {
                _mm_prefetch(reinterpret_cast<const char*>(grp + PREFETCH + v * 64), _MM_HINT_T0);
                const __m512i raw = _mm512_loadu_si512(grp + v * 64);
                __m512i e[4];
                e[0] = _mm512_and_si512(raw, low4);
                e[1] = _mm512_and_si512(_mm512_srli_epi16(raw, 8), low4);
                e[2] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                e[3] = _mm512_srli_epi16(raw, 12);
#pragma GCC unroll 4
                for (int s = 0; s < 4; ++s) {
                    const int k = 4 * v + s;                       // the step: kquants.h places its high bits
                    if constexpr (Q5)
                        e[s] = _mm512_ternarylogic_epi32(e[s], _mm512_rolv_epi32(h0, _mm512_set1_epi32((4 - k) & 31)), hmask, 0xF8);
                    if constexpr (Q6)
                        e[s] = _mm512_ternarylogic_epi32(e[s], _mm512_rolv_epi32(k < 8 ? h0 : h1, _mm512_set1_epi32((4 - 2 * (k % 8)) & 31)),
                                                         hmask, 0xF8);
                    for (int i = 0; i < MC; ++i) {
                        const __m512i xv = _mm512_load_si512(xs + (k * MC + i) * 32);
                        if (Q6 && s >= 2) dot2[i] = _mm512_dpwssd_epi32(dot2[i], e[s], xv);   // weights 16..31: scB
                        else dot[i] = _mm512_dpwssd_epi32(dot[i], e[s], xv);
                    }
                }
            }
            int64_t dword = 0;                                                                   // d0, d1 (, dmin0, dmin1)
            std::memcpy(&dword, meta + 32, Q6 ? 4 : 8);
            const __m128i dbits = _mm_cvtsi64_si128(dword);
            const __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(dbits));                      // d0, d1, dmin0, dmin1
            const __m512 d = _mm512_permutexvar_ps(two_d, dd);
            if constexpr (Q6) {
                const __m512 a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta)))));
                const __m512 a2 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16)))));
                for (int i = 0; i < MC; ++i) {
                    const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), a, _mm512_mul_ps(_mm512_cvtepi32_ps(dot2[i]), a2));
                    acc[i] = _mm512_fmadd_ps(t, _mm512_load_ps(dx + at + i * GROUP), acc[i]);
                }
            } else {
                const __m512 m = _mm512_permutexvar_ps(_mm512_add_epi32(two_d, _mm512_set1_epi32(2)), dd);
                const __m512 a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta)))));
                const __m512 b = _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16)))));
                for (int i = 0; i < MC; ++i) {
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(a, _mm512_load_ps(dx + at + i * GROUP)), acc[i]);
                    acc[i] = _mm512_fnmadd_ps(b, _mm512_load_ps(xsum + at + i * GROUP), acc[i]);
                }
            }
        }
        sp.end<MC>(n - n0, acc, sp.g1 == G, y + n, N);
    }
}


void check_packed(const at::Tensor& w, int64_t n_out, const Format& f) {
    TORCH_CHECK(w.dtype() == at::kByte && w.is_contiguous() && w.dim() == 2 && w.size(0) == packed_rows(f, n_out)
                && w.size(1) == f.row_bytes, "w must be the packed layout of an [n_out, k_in] weight");
}

// x [M, k_in] prepared once (quantized activations, scales, the quants' offset corrections) for any number of
// weights of one type that share it as input.
int64_t rows_of(const at::Tensor& x, int64_t k_in) {
    TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == k_in,
                "x must be contiguous float32 [M, k_in]");
    return x.size(0);
}

static_assert(MAX_M == 8, "gem4_simd::with_count dispatches the row counts 1..8");
using gem4_simd::with_count;

// CPUID leaf 7 reports AMX-TILE and AMX-INT8, and Linux grants this process the tile state (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), asked once; false where either refuses.
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
unsigned cpuid7_edx() {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    return d;
}
bool amx_granted() {
    static const bool granted = [] {
        const unsigned d = cpuid7_edx();
        const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
        return tile && int8 && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return granted;
}

// Whether passes of 2..8 rows of x over Q8_0 / Q4_0 panels run on AMX tiles (set_amx; on where the CPU and
// kernel grant AMX; Python turns it off for GEM4_NO_AMX when it loads the library). Either way the results are
// the same, bit for bit.
std::atomic<bool>& amx_on() {
    static std::atomic<bool> on{amx_granted()};
    return on;
}

struct Prepared {
    Format f;
    int64_t type, M, per_row;             // per_row: stream elements of one row of x
    bool amx;                             // panel types: passes of >= 2 rows on AMX
    Aligned<int16_t> stream;              // x16: the interleaved int16 stream (prepare_row)
    Aligned<int8_t> quads;                // panels (VNNI): x's int8 blocks (gem4_panels::prepare_panel_rows)
    Aligned<float> dx;
    Aligned<int32_t> corr, corr2;
    Aligned<float> xsum;
    Aligned<int8_t> planes;               // panels on AMX: the A tile rows (gem4_panels::prepare_panel_rows)

    // per-block values of one row of x: x16 groups * 16 (a tail group's missing blocks 0), panels k_in / 32
    static int64_t blocks(const Format& f, int64_t k_in) { return f.panel ? k_in / QK : f.groups * GROUP; }

    Prepared(const at::Tensor& x, int64_t k_in, int64_t ggml_type)
        : f(format_of(ggml_type, k_in)), type(ggml_type), M(rows_of(x, k_in)),
          per_row(f.panel ? k_in : f.groups * GROUP_ELEMS), amx(f.panel && M >= 2 && amx_on().load()),
          stream(f.panel ? 0 : M * per_row), quads(f.panel && !amx ? M * per_row : 0), dx(M * blocks(f, k_in)), corr(M * blocks(f, k_in)),
          corr2(f.panel ? 0 : M * blocks(f, k_in)), xsum(f.panel ? 0 : M * blocks(f, k_in)),
          planes(amx ? (k_in / QK + 1) / 2 * M * 256 : 0) {
        const int64_t sg = blocks(f, k_in);
        if (f.panel) {                                     // rows in parallel (prefill prepares hundreds)
            if (amx) std::memset(planes.data, 0, (k_in / QK + 1) / 2 * M * 256);
            const gem4_panels::Panels P = gem4_panels::panels_of(type, 1, k_in);
            at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
                gem4_panels::prepare_panel_rows(x.data_ptr<float>(), M, P, amx ? nullptr : quads.data, dx.data, corr.data,
                                                amx ? planes.data : nullptr, m0, m1);
            });
            return;
        }
        std::memset(stream.data, 0, M * per_row * sizeof(int16_t));
        for (float* a : {dx.data, xsum.data}) std::memset(a, 0, M * sg * sizeof(float));
        for (int32_t* a : {corr.data, corr2.data}) std::memset(a, 0, M * sg * sizeof(int32_t));
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {        // chunks of rows as rows() takes them, interleaved
            const int64_t mc = std::min<int64_t>(MAX_M, M - m0);
            for (int64_t i = 0; i < mc; ++i)
                prepare_row(x.data_ptr<float>() + (m0 + i) * k_in, k_in, type, mc, i, stream.data + m0 * per_row,
                            dx.data + m0 * sg, corr.data + m0 * sg, corr2.data + m0 * sg, xsum.data + m0 * sg);
        }
    }

    // Panel types: rows [n0, n1) of W (n0 a multiple of 16, n1 <= n_out) for every row of x: on AMX in row
    // blocks (gem4_panels::amx_rows), else in VNNI passes of up to MAX_M rows, each over the panels once.
    void panel_rows(const uint8_t* w, float* y, int64_t ldy, int64_t n0, int64_t n1) const {
        using namespace gem4_panels;
        const Panels P = panels_of(type, n1, per_row);         // rows from n1 on are not written
        const int64_t p0 = n0 / PANEL, p1 = (n1 + PANEL - 1) / PANEL, nb = P.nb;
        if (amx) {
            const PanelX xp{nullptr, dx.data, nullptr, planes.data, M, 0};
            if (type == Q8_0) amx_rows<Q8_0>(xp, P, w, y, ldy, p0, p1);
            else amx_rows<Q4_0>(xp, P, w, y, ldy, p0, p1);
            return;
        }
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            const int mc = static_cast<int>(std::min<int64_t>(MAX_M, M - m0));
            const PanelX xp{quads.data + m0 * per_row, dx.data + m0 * nb, corr.data + m0 * nb, nullptr, M, m0};
            with_count(mc, [&](auto rows) {
                constexpr int MC = decltype(rows)::value;
                if (type == Q8_0) vnni_panels<MC, Q8_0>(xp, P, w, y + m0 * ldy, ldy, p0, p1);
                else vnni_panels<MC, Q4_0>(xp, P, w, y + m0 * ldy, ldy, p0, p1);
            });
        }
    }

    // y[m * ldy + n] for rows n in [n0, n1) of the x16 weight w, every row m of x: chunks of up to MAX_M rows
    // of x, each in one pass over W; when a chunk's activations would not stay in L1, W is taken TILE_N rows
    // at a time and each tile in spans of groups (Span).
    static constexpr int64_t TILE_N = 16;
    static constexpr int64_t X_L1 = 24 << 10;     // activation bytes per span (L1 is 32-48 KB)
    void rows(const X16& w, float* y, int64_t ldy, int64_t n0, int64_t n1) const {
        if (f.panel) return panel_rows(w.main, y, ldy, n0, n1);
        const int64_t sg = f.groups * GROUP;
        alignas(64) float part[TILE_N * MAX_M * 16];
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            const int mc = static_cast<int>(std::min<int64_t>(MAX_M, M - m0));
            const XChunk xc{stream.data + m0 * per_row, dx.data + m0 * sg, corr.data + m0 * sg, corr2.data + m0 * sg,
                            xsum.data + m0 * sg};
            const int64_t span = std::max<int64_t>(1, X_L1 / (mc * GROUP_ELEMS * static_cast<int64_t>(sizeof(int16_t))));
            float* yo = y + m0 * ldy;
            if (span >= f.groups) {
                chunk(mc, xc, w, yo, ldy, n0, n1, Span{0, f.groups, part});
                continue;
            }
            for (int64_t t0 = n0; t0 < n1; t0 += TILE_N)
                for (int64_t g0 = 0; g0 < f.groups; g0 += span)
                    chunk(mc, xc, w, yo, ldy, t0, std::min(n1, t0 + TILE_N), Span{g0, std::min(f.groups, g0 + span), part});
        }
    }

    void chunk(int mc, const XChunk& xc, const X16& w, float* y, int64_t ldy, int64_t n0, int64_t n1, const Span& sp) const {
        with_count(mc, [&](auto rows) {
            constexpr int MC = decltype(rows)::value;
            switch (type) {
                case Q4_1: gemv_rows<MC, Q4_1>(xc, f, w, y, ldy, n0, n1, sp); break;
                case Q5_0: gemv_rows<MC, Q5_0>(xc, f, w, y, ldy, n0, n1, sp); break;
                case Q5_1: gemv_rows<MC, Q5_1>(xc, f, w, y, ldy, n0, n1, sp); break;
                case MLX_A4: gemv_rows<MC, MLX_A4>(xc, f, w, y, ldy, n0, n1, sp); break;
                case MLX_A8: gemv_rows<MC, MLX_A8>(xc, f, w, y, ldy, n0, n1, sp); break;
                case gem4_kq::Q4_K: gemv_rows_k<MC, gem4_kq::Q4_K>(xc, f, w, y, ldy, n0, n1, sp); break;
                case gem4_kq::Q5_K: gemv_rows_k<MC, gem4_kq::Q5_K>(xc, f, w, y, ldy, n0, n1, sp); break;
                default: gemv_rows_k<MC, gem4_kq::Q6_K>(xc, f, w, y, ldy, n0, n1, sp); break;
            }
        });
    }
};

constexpr int64_t GRAIN = 16;   // rows of W per task: a panel

// fn(n0, n1) over [0, n_out) split across torch's intra-op threads in whole tasks of GRAIN rows (a task of
// the panel types then starts on a panel).
template <typename Fn>
void for_row_tasks(int64_t n_out, Fn&& fn) {
    at::parallel_for(0, (n_out + GRAIN - 1) / GRAIN, 1, [&](int64_t t0, int64_t t1) { fn(t0 * GRAIN, std::min(n_out, t1 * GRAIN)); });
}

at::Tensor gemv(at::Tensor x, at::Tensor w, int64_t n_out, int64_t k_in, int64_t ggml_type) {
    // x: [M, k_in] float32; w: packed (repack) -> y: [M, n_out] float32
    const Prepared p(x, k_in, ggml_type);
    check_packed(w, n_out, p.f);
    auto y = at::empty({p.M, n_out}, x.options());
    const X16 wp = x16_of(w.data_ptr<uint8_t>(), w.size(0), p.f);
    float* yp = y.data_ptr<float>();
    for_row_tasks(n_out, [&](int64_t n0, int64_t n1) { p.rows(wp, yp, n_out, n0, n1); });
    return y;
}

// The same x through several weights of one type (Q, K, V): one pass over their rows, one preparation.
std::vector<at::Tensor> gemv_multi(at::Tensor x, std::vector<at::Tensor> ws, std::vector<int64_t> n_outs,
                                       int64_t k_in, int64_t ggml_type) {
    TORCH_CHECK(!ws.empty() && ws.size() == n_outs.size(), "one n_out per weight");
    const Prepared p(x, k_in, ggml_type);
    std::vector<at::Tensor> ys;
    std::vector<int64_t> start{0};                       // first task of each weight in the joint range of tasks
    for (size_t i = 0; i < ws.size(); ++i) {
        check_packed(ws[i], n_outs[i], p.f);
        ys.push_back(at::empty({p.M, n_outs[i]}, x.options()));
        start.push_back(start.back() + (n_outs[i] + GRAIN - 1) / GRAIN);
    }
    at::parallel_for(0, start.back(), 1, [&](int64_t a, int64_t b) {
        for (size_t i = 0; i < ws.size(); ++i) {
            const int64_t lo = std::max(a, start[i]) - start[i], hi = std::min(b, start[i + 1]) - start[i];
            if (lo < hi)
                p.rows(x16_of(ws[i].data_ptr<uint8_t>(), ws[i].size(0), p.f), ys[i].data_ptr<float>(), n_outs[i], lo * GRAIN, std::min(n_outs[i], hi * GRAIN));
        }
    });
    return ys;
}

// gelu_tanh(x @ gate.T) * (x @ up.T): the gated MLP's first half in one pass (row n of both weights
// in the same task, the activation applied as each task finishes).
at::Tensor gemv_glu(at::Tensor x, at::Tensor gate, at::Tensor up, int64_t n_out, int64_t k_in, int64_t ggml_type) {
    const Prepared p(x, k_in, ggml_type);
    check_packed(gate, n_out, p.f);
    check_packed(up, n_out, p.f);
    auto y = at::empty({p.M, n_out}, x.options());
    std::vector<float> g(p.M * n_out);
    const X16 gp = x16_of(gate.data_ptr<uint8_t>(), gate.size(0), p.f), up_ = x16_of(up.data_ptr<uint8_t>(), up.size(0), p.f);
    float* yp = y.data_ptr<float>();
    for_row_tasks(n_out, [&](int64_t n0, int64_t n1) {
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

// Four quant vectors of a group (32-bit lane b of vector v: bytes 4v..4v+3 of block b) -> out[16 b + 4 v + r]:
// each block's 16 bytes contiguous (a 4 x 16 transpose of 32-bit words, in registers; one 64-byte store per
// 4 blocks instead of 4-byte copies, whose narrow stores a 16-byte load cannot forward from).
inline void transpose_group(const uint8_t* grp, uint8_t* out) {
    const __m512i v0 = _mm512_loadu_si512(grp), v1 = _mm512_loadu_si512(grp + 64), v2 = _mm512_loadu_si512(grp + 128),
                  v3 = _mm512_loadu_si512(grp + 192);
    const __m512i t0 = _mm512_unpacklo_epi32(v0, v1), t1 = _mm512_unpackhi_epi32(v0, v1);   // 128-bit lane L: blocks 4L..
    const __m512i t2 = _mm512_unpacklo_epi32(v2, v3), t3 = _mm512_unpackhi_epi32(v2, v3);
    const __m512i u[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),      // u[j] lane L: block 4L + j
                          _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
    // block 4L + j goes to out + 16 (4L + j): gather lane L of each u[j] into one vector of 4 blocks
    const __m512i lo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    const __m512i a = _mm512_permutex2var_epi64(u[0], lo, u[1]);   // blocks 0, 1 | 4, 5 (lanes 0, 1 of u0, u1 interleaved)
    const __m512i b = _mm512_permutex2var_epi64(u[2], lo, u[3]);   // blocks 2, 3 | 6, 7
    const __m512i c = _mm512_permutex2var_epi64(u[0], hi, u[1]);   // blocks 8, 9 | 12, 13
    const __m512i d = _mm512_permutex2var_epi64(u[2], hi, u[3]);   // blocks 10, 11 | 14, 15
    const __m512i pick_lo = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0), pick_hi = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
    _mm512_store_si512(out, _mm512_permutex2var_epi64(a, pick_lo, b));          // blocks 0..3
    _mm512_store_si512(out + 64, _mm512_permutex2var_epi64(a, pick_hi, b));     // blocks 4..7
    _mm512_store_si512(out + 128, _mm512_permutex2var_epi64(c, pick_lo, d));    // blocks 8..11
    _mm512_store_si512(out + 192, _mm512_permutex2var_epi64(c, pick_hi, d));    // blocks 12..15
}

// A block's 32 dequantized weights (w0: 0..15, w1: 16..31) -> dst as bf16 or float32.
inline void store_block(uint8_t* dst, __m512 w0, __m512 w1, bool bf16) {
    if (bf16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(w0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), (__m256i)_mm512_cvtneps_pbh(w1));
    } else {
        _mm512_storeu_ps(reinterpret_cast<float*>(dst), w0);
        _mm512_storeu_ps(reinterpret_cast<float*>(dst) + 16, w1);
    }
}

// A panel block's 32 weights from its quant bytes in GGML order (q_lo: bytes 0..15; q_hi: Q8_0's 16..31) and its
// d: w = d q (Q8_0), d (q - 8) (Q4_0), as quants.py, exact in float32.
inline void panel_block(int64_t ggml_type, const uint8_t* q_lo, const uint8_t* q_hi, float d, __m512& w0, __m512& w1) {
    const __m512 dv = _mm512_set1_ps(d);
    if (ggml_type == Q8_0) {
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q_lo)))), dv);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q_hi)))), dv);
        return;
    }
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q_lo)));
    const __m512i eight = _mm512_set1_epi32(8);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(raw, _mm512_set1_epi32(0x0F)), eight)), dv);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(raw, 4), eight)), dv);
}

// A Q4_0 weight's 16 values q - 8, lane q.
inline __m512 q4_0_values() { return _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7); }

// Rows [n0, n1) of a Q8_0 / Q4_0 panel weight (rows ids[n0..n1) if ids) -> out (row i at i ld, its block b at b bs)
// as float32 or bf16: contiguous rows per panel and block, the 16 rows' quant bytes transposed in registers; rows
// by id gathered a block at a time.
void dequant_panels(const uint8_t* wp, int64_t k_in, int64_t ggml_type, bool bf16, int64_t n0, int64_t n1, uint8_t* op,
                    const int64_t* ids, int64_t ld, int64_t bs) {
    using gem4_panels::PANEL;
    const gem4_panels::Panels P = gem4_panels::panels_of(ggml_type, 1, k_in);
    const int64_t out_size = bf16 ? 2 : 4;
    __m512 w0, w1;
    if (ids) {
        alignas(32) uint8_t q[32];                       // a block's quant bytes in GGML order
        for (int64_t i = n0; i < n1; ++i)
            for (int64_t b = 0; b < P.nb; ++b) {
                const float d = _cvtsh_ss(gem4_panels::block_of(wp, P, ids[i], b, q));
                panel_block(ggml_type, q, q + 16, d, w0, w1);
                store_block(op + ((i - n0) * ld + b * bs) * out_size, w0, w1, bf16);
            }
        return;
    }
    alignas(64) uint8_t rows[2][PANEL * 16];             // a block's 16 rows' quant bytes, 16 (Q8_0: 32) a row
    alignas(64) float d[PANEL];
    // Q4_0 to bf16 (prefill's GEMM): each weight looked up in its block's 16 values d (q - 8), rounded once (the
    // same bf16 as panel_block's float, rounded)
    const __m512 centred = q4_0_values();
    const bool lookup = bf16 && ggml_type == Q4_0;
    for (int64_t p = n0 / PANEL; p * PANEL < n1; ++p) {
        const uint8_t* panel = wp + p * P.panel_bytes;
        const int64_t j0 = std::max(n0, p * PANEL) - p * PANEL, j1 = std::min(n1, (p + 1) * PANEL) - p * PANEL;
        for (int64_t b = 0; b < P.nb; ++b) {
            const uint8_t* q = panel + P.scales + b * PANEL * P.qb;
            for (int64_t c = 0; c < PANEL * P.qb; c += 64)
                _mm_prefetch(reinterpret_cast<const char*>(q + gem4_panels::PREFETCH + c), _MM_HINT_T0);
            for (int64_t h = 0; h < P.qb / 16; ++h) transpose_group(q + 256 * h, rows[h]);
            _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(panel + 32 * b))));
            for (int64_t j = j0; j < j1; ++j) {
                uint8_t* out = op + ((p * PANEL + j - n0) * ld + b * bs) * out_size;
                if (lookup) {
                    const __m256i values = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_set1_ps(d[j]), centred));
                    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(rows[0] + 16 * j)));
                    const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), hi = _mm256_srli_epi16(bytes, 4);
                    const __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);   // weights 0..15 | 16..31
                    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(nibbles, _mm512_castsi256_si512(values)));
                    continue;
                }
                panel_block(ggml_type, rows[0] + 16 * j, rows[1] + 16 * j, d[j], w0, w1);
                store_block(out, w0, w1, bf16);
            }
        }
    }
}

// Rows [n0, n0 + 32) of a Q8_0 / Q4_0 panel weight (n0 a multiple of 32; rows past n_out zero) -> bf16 pairs in
// lanes, as tile_gemm.h's Lanes lays them out (the piece of step b and panel half h at out + (2 b + h) 512:
// [16 pairs][16 rows] 32-bit), straight from the panels, whose 32-bit lanes are already rows: each weight's float
// d (q - 8) / d q (exact) rounded once to bf16, the same bf16 as dequant_panels'.
void lanes_panels(const uint8_t* wp, int64_t k_in, int64_t n_out, int64_t ggml_type, int64_t n0, uint16_t* out) {
    const gem4_panels::Panels P = gem4_panels::panels_of(ggml_type, n_out, k_in);
    const __m512 centred = q4_0_values();
    alignas(64) int16_t order[32];                               // words (even[j], odd[j]) -> lane j
    for (int j = 0; j < 16; ++j) order[2 * j] = static_cast<int16_t>(j), order[2 * j + 1] = static_cast<int16_t>(16 + j);
    const __m512i interleave = _mm512_load_si512(order);
    auto pair = [&](__m512 even, __m512 odd, uint16_t* dst) {    // bf16 pairs of 16 rows
        _mm512_store_si512(dst, _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even)));
    };
    for (int64_t h = 0; h < 2; ++h) {
        const int64_t p = n0 / gem4_panels::PANEL + h;
        if (p >= P.panels) {
            for (int64_t b = 0; b < P.nb; ++b) std::fill(out + (2 * b + h) * 512, out + (2 * b + h + 1) * 512, uint16_t{0});
            continue;
        }
        const uint8_t* panel = wp + p * P.panel_bytes;
        for (int64_t b = 0; b < P.nb; ++b) {
            const uint8_t* q = panel + P.scales + b * gem4_panels::PANEL * P.qb;
            for (int64_t c = 0; c < gem4_panels::PANEL * P.qb; c += 64) {   // this block's bytes into L1; the next
                _mm_prefetch(reinterpret_cast<const char*>(q + gem4_panels::PREFETCH + c), _MM_HINT_T0);   // 32 rows'
                _mm_prefetch(reinterpret_cast<const char*>(q + 2 * P.panel_bytes + c), _MM_HINT_T1);     // into L2
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(panel + 32 * b)));
            uint16_t* piece = out + (2 * b + h) * 512;            // pair k at piece + 32 k
            for (int64_t r = 0; r < P.qb / 4; ++r) {
                const __m512i raw = _mm512_load_si512(q + 64 * r);   // lane j: bytes 4r..4r+3 of row j's block
                __m512 w[8];                                         // Q4_0: 4 low nibbles, then 4 high; Q8_0: 4 bytes
                if (ggml_type == Q4_0) {
                    for (int t = 0; t < 8; ++t)                      // vpermps reads an index's low 4 bits only
                        w[t] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(raw, 8 * (t % 4) + 4 * (t / 4)), centred), d);
                    pair(w[0], w[1], piece + 32 * (2 * r));              // weights 4r, 4r + 1
                    pair(w[2], w[3], piece + 32 * (2 * r + 1));
                    pair(w[4], w[5], piece + 32 * (8 + 2 * r));          // weights 16 + 4r, ...
                    pair(w[6], w[7], piece + 32 * (9 + 2 * r));
                } else {
                    for (int t = 0; t < 4; ++t)
                        w[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(raw, 24 - 8 * t), 24)), d);
                    pair(w[0], w[1], piece + 32 * (2 * r));
                    pair(w[2], w[3], piece + 32 * (2 * r + 1));
                }
            }
        }
    }
}

// Rows [n0, n1) of a packed weight (rows ids[n0..n1) if ids) -> out (row i at i ld, ld = k_in if 0; its block
// b at b bs) as float32 or bf16 (w = d * (q - 16), (d q) + m, ...: as quants.py, exact in float32). Panels:
// dequant_panels.
void dequant_rows(const X16& wp, const Format& f, int64_t k_in, int64_t ggml_type, bool bf16, int64_t n0, int64_t n1,
                  uint8_t* op, const int64_t* ids = nullptr, int64_t ld = 0, int64_t bs = QK) {
    if (ld == 0) ld = k_in;
    if (f.panel) return dequant_panels(wp.main, k_in, ggml_type, bf16, n0, n1, op, ids, ld, bs);
    const int64_t nb = k_in / QK, out_size = bf16 ? 2 : 4;
    const bool kq = gem4_kq::is_k(ggml_type);
    // K-quants: where the high bits of weights 0..15 / 16..31 of a block sit in its 32-bit lane (kquants.h)
    alignas(64) int32_t at[32];
    for (int e = 0; e < 32; ++e) {
        const gem4_kq::Place p = gem4_kq::place(e);
        at[e] = ggml_type == gem4_kq::Q6_K ? 16 * p.t + 2 * (p.k % 8) : 16 * p.t + p.k;
    }
    const __m512i at_lo = _mm512_load_si512(at), at_hi = _mm512_load_si512(at + 16);
    const __m512i mask4 = _mm512_set1_epi32(0x0F), hbits = _mm512_set1_epi32(ggml_type == gem4_kq::Q6_K ? 3 : 1);
    alignas(64) uint8_t blocks[GROUP * 32];                 // a group's quant bytes back in block order (MLX_A8: by halves)
    TailGroup tail;
    const bool a8 = ggml_type == MLX_A8, bf = affine(ggml_type);
    // MLX_A8: a block's two transposed halves hold elements [0..3, 16..19, 4..7, 20..23] and [8..11, 24..27, 12..15,
    // 28..31] (affine8_elem); these indices pick elements 0..15 and 16..31 from the pair
    const __m512i a8_lo = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i a8_hi = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
    for (int64_t i = n0; i < n1; ++i) {
        const int64_t n = ids ? ids[i] : i;
        const uint8_t *row = wp.main + n * f.main_bytes, *side = wp.side + n * f.side_bytes;
        if (f.tail) tail.expand(f, side);                   // ahead of its use: its stores retired when it is read
        const uint8_t *grp = nullptr, *group_meta = nullptr;
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t lane = b % GROUP;
            if (lane == 0) {                                 // the group's 4 nibble vectors -> 16 bytes a block
                const bool whole = b / GROUP < f.full;       // else the tail group, from its buffers
                grp = whole ? row + (b / GROUP) * GROUP * f.quant_bytes : tail.q;
                group_meta = whole ? side + (b / GROUP) * f.meta_bytes : tail.meta;
                transpose_group(grp, blocks);
                if (a8) transpose_group(grp + 256, blocks + GROUP * 16);
            }
            const uint8_t* q = blocks + 16 * lane;           // the block's quant bytes in GGML order
            __m512 w0, w1;
            if (kq) {                                        // w = (d sc) q - (dmin min), or (d sc) (q - 32): as quants.py
                const __m512i raw = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q)));
                __m512i lo = _mm512_and_si512(raw, mask4), hi = _mm512_srli_epi32(raw, 4);
                const uint8_t* meta = group_meta;
                const int64_t half = lane / 8;
                uint16_t dbits, mbits = 0;
                std::memcpy(&dbits, meta + 32 + 2 * half, 2);
                const float d = _cvtsh_ss(dbits);
                if (ggml_type == gem4_kq::Q6_K) {
                    uint32_t h0, h1;
                    std::memcpy(&h0, grp + 256 + 4 * lane, 4);
                    std::memcpy(&h1, grp + 320 + 4 * lane, 4);
                    const __m512i h = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(static_cast<int>(h0)),
                                                              _mm512_set1_epi32(static_cast<int>(h1)));
                    lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, at_lo), hbits), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, at_hi), hbits), 4));
                    const __m512i off = _mm512_set1_epi32(32);
                    const float a = d * static_cast<float>(static_cast<int8_t>(meta[lane]));
                    const float a2 = d * static_cast<float>(static_cast<int8_t>(meta[16 + lane]));
                    w0 = _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, off)), _mm512_set1_ps(a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    w1 = _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, off)), _mm512_set1_ps(a2), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                } else {
                    if (ggml_type == gem4_kq::Q5_K) {
                        uint32_t h0;
                        std::memcpy(&h0, grp + 256 + 4 * lane, 4);
                        const __m512i h = _mm512_set1_epi32(static_cast<int>(h0));
                        lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, at_lo), hbits), 4));
                        hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, at_hi), hbits), 4));
                    }
                    std::memcpy(&mbits, meta + 36 + 2 * half, 2);
                    const __m512 a = _mm512_set1_ps(d * static_cast<float>(meta[lane]));
                    const __m512 m = _mm512_set1_ps(_cvtsh_ss(mbits) * static_cast<float>(meta[16 + lane]));
                    // two roundings, never fused into one FMA (the reference rounds the product, then the difference)
                    constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
                    w0 = _mm512_sub_round_ps(_mm512_mul_round_ps(_mm512_cvtepi32_ps(lo), a, R), m, R);
                    w1 = _mm512_sub_round_ps(_mm512_mul_round_ps(_mm512_cvtepi32_ps(hi), a, R), m, R);
                }
            } else {                                         // w = d (q - 16), (d q) + m: as quants.py
                const uint8_t* meta = group_meta;
                const __m512 d = _mm512_set1_ps(scale_at(meta + 2 * lane, bf));
                const __m512i raw = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q)));
                __m512i lo = _mm512_and_si512(raw, mask4), hi = _mm512_srli_epi32(raw, 4);
                if (a8) {                                    // bytes, from the block's two halves
                    const __m512i raw2 = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + GROUP * 16)));
                    lo = _mm512_permutex2var_epi32(raw, a8_lo, raw2);
                    hi = _mm512_permutex2var_epi32(raw, a8_hi, raw2);
                }
                if (legacy_high(ggml_type)) {
                    uint32_t h0;
                    std::memcpy(&h0, grp + 256 + 4 * lane, 4);
                    const __m512i h = _mm512_set1_epi32(static_cast<int>(h0));
                    lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, at_lo), hbits), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, at_hi), hbits), 4));
                }
                if (legacy_min(ggml_type)) {             // (d q) + m, two roundings (never one FMA)
                    const __m512 m = _mm512_set1_ps(scale_at(meta + 32 + 2 * lane, bf));
                    constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
                    w0 = _mm512_add_round_ps(_mm512_mul_round_ps(d, _mm512_cvtepi32_ps(lo), R), m, R);
                    w1 = _mm512_add_round_ps(_mm512_mul_round_ps(d, _mm512_cvtepi32_ps(hi), R), m, R);
                } else {
                    const __m512i off = _mm512_set1_epi32(16);                                  // Q5_0
                    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, off)), d);
                    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, off)), d);
                }
            }
            store_block(op + ((i - n0) * ld + b * bs) * out_size, w0, w1, bf16);
        }
    }
}

// x16 / panels [N, ...] -> [N, K] float32 or bf16 (N: the packed tensor's rows, a panel's padding included), or
// only the rows `ids` [R] -> [R, K] (token tables)
at::Tensor dequant(at::Tensor w, int64_t k_in, int64_t ggml_type, bool bf16, std::optional<at::Tensor> ids) {
    const Format f = format_of(ggml_type, k_in);
    check_packed(w, w.size(0), f);
    const int64_t* idp = nullptr;
    if (ids) {
        TORCH_CHECK(ids->dtype() == at::kLong && ids->dim() == 1 && ids->is_contiguous(), "ids must be contiguous int64 [R]");
        idp = ids->data_ptr<int64_t>();
        for (int64_t i = 0; i < ids->numel(); ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < w.size(0), "row ", idp[i], " out of range");
    }
    const int64_t R = ids ? ids->numel() : w.size(0);
    auto out = at::empty({R, k_in}, w.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
    const X16 wp = x16_of(w.data_ptr<uint8_t>(), w.size(0), f);
    uint8_t* op = static_cast<uint8_t*>(out.data_ptr());
    const int64_t row_out = k_in * (bf16 ? 2 : 4);
    at::parallel_for(0, R, 16, [&](int64_t n0, int64_t n1) { dequant_rows(wp, f, k_in, ggml_type, bf16, n0, n1, op + n0 * row_out, idp); });
    return out;
}

// want 0 / 1: panel passes of >= 2 rows on VNNI / on AMX (where granted); -1: only ask. -> whether AMX is on.
bool set_amx(int64_t want) {
    if (want >= 0) amx_on().store(want == 1 && amx_granted());
    return amx_on().load();
}

// x [T, k_in] bf16 @ W.T -> [T, n_out] float32, for prefill chunks, row-invariant (tile_gemm.h): each task turns a
// block of 32 rows of W into bf16 and multiplies it with every row of x while it is in cache.
at::Tensor linear_packed(at::Tensor x, at::Tensor w, int64_t n_out, int64_t k_in, int64_t ggml_type) {
    const Format f = format_of(ggml_type, k_in);
    check_packed(w, n_out, f);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == k_in, "x must be [T, k_in]");
    const X16 wp = x16_of(w.data_ptr<uint8_t>(), w.size(0), f);
    auto rows = [&](int64_t n0, int64_t n1, uint16_t* buf) {    // as A tiles (tile_gemm.h)
        dequant_rows(wp, f, k_in, ggml_type, true, n0, n1, reinterpret_cast<uint8_t*>(buf), nullptr, QK, gem4_tiles::NR * QK);
    };
    auto lanes = [&](int64_t n0, uint16_t* buf) {              // panels: straight into lanes
        if (f.panel) lanes_panels(wp.main, k_in, n_out, ggml_type, n0, buf);
        return f.panel;
    };
    return gem4_tiles::linear_rows(x, n_out, rows, lanes);
}

// ggml_types.h's table as (names, ids, weights per block, bytes per block): a test holds it to gem4.ggml's.
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>> ggml_types() {
    std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>> out;
    for (const gem4_ggml::TypeInfo& t : gem4_ggml::TYPES) {
        std::get<0>(out).emplace_back(t.name);
        std::get<1>(out).push_back(t.id);
        std::get<2>(out).push_back(t.block_size);
        std::get<3>(out).push_back(t.type_size);
    }
    return out;
}

}  // namespace gem4_ops

using namespace gem4_ops;

TORCH_LIBRARY(gem4_kernels, m) {
    m.def("repack(Tensor w, int n_out, int k_in, int ggml_type, int units=1) -> Tensor", &repack);
    m.def("gemv(Tensor x, Tensor w, int n_out, int k_in, int ggml_type) -> Tensor", &gemv);
    m.def("gemv_multi(Tensor x, Tensor[] ws, int[] n_outs, int k_in, int ggml_type) -> Tensor[]", &gemv_multi);
    m.def("gemv_glu(Tensor x, Tensor gate, Tensor up, int n_out, int k_in, int ggml_type) -> Tensor", &gemv_glu);
    m.def("dequant(Tensor w, int k_in, int ggml_type, bool bf16, Tensor? ids) -> Tensor", &dequant);
    m.def("set_amx(int want) -> bool", &set_amx);
    m.def("linear_packed(Tensor x, Tensor w, int n_out, int k_in, int ggml_type) -> Tensor", &linear_packed);
    m.def("ggml_types() -> (str[] names, int[] ids, int[] block_sizes, int[] type_sizes)", &ggml_types);
}
