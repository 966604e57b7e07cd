// Prefill's GEMM, y [M, N] float32 = x [M, K] bf16 . W^T, W given as bf16 rows (a weight as stored, or rows
// dequantized into a buffer by the caller), computed so that every element of y is the same float whatever
// M is and wherever its row sits among the others (row-invariant): a prompt token's activations do not
// depend on how its prompt was cut into chunks, nor on the rows of other requests in the step (a prefix
// cache hit computes the rest of a prompt in other chunks than a cold run; batch invariance).
//
// Each y[m, n] is one sum over k in a fixed order: blocks of 32 inputs in ascending order, each block's
// bf16 products summed into a float32 accumulator by the same instruction, whatever M is. Rows of x past M
// (padding to 16) are zeros and never change another row's sums. Two kernels, chosen once per process:
// - AMX (where the CPU reports AMX-BF16 and Linux grants the tile state, ops.h): C^T = W . x^T on tiles,
//   A = 16 rows of W (32 inputs a row, from a buffer of 32 rows laid out as tiles), B = 16 rows of x as pairs
//   along k (laid out once per call, each tile's 1 KB in one piece), C = [16 rows of W, 16 rows of x] float32,
//   2 x 2 C tiles per step. C is transposed into y once per 32 x 32 block, after all of k.
// - AVX-512 BF16 (vdpbf16ps): y's rows 8 at a time, 32 rows of W in the lanes of two vectors (pairs along k),
//   each of x's pairs broadcast; no padding of M, x and C not transposed (the caller makes W's bf16 in lanes).
// The two round differently (the tile product's internal order is the hardware's), each is row-invariant.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ops.h"
#include "simd.h"
#include "tile_gemm.h"

namespace gem4_tiles {

constexpr int64_t MR = 32;           // rows of x per block (two B tiles)

// AMX-BF16 reported and the tile state granted (ops.h).
inline bool amx_bf16_granted() {
    static const bool granted = ((gem4_ops::cpuid7_edx() >> 22) & 1) && gem4_ops::amx_granted();
    return granted;
}

struct alignas(64) GemmTiles {       // C 0-3 (W rows 0-15 / 16-31 x x rows 0-15 / 16-31), A 4-5, B 6-7
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    GemmTiles() {
        for (int t = 0; t < 8; ++t) rows[t] = 16, colsb[t] = 64;
    }
};

// The tile configuration (as panels.h: the whole struct as the asm operand) and its release.
__attribute__((target("amx-tile")))
inline void load_tiles(const GemmTiles& cfg) { __asm__ volatile("ldtilecfg %0" : : "m"(cfg)); }

__attribute__((target("amx-tile")))
inline void release_tiles() { _tile_release(); }

constexpr int64_t KB = 512;          // inputs per pass (AMX): a block of W's slice (32 KB) stays in L1, x's pairs
                                     // of the pass (Mp x KB x 2 bytes) in L2
constexpr int64_t SUPER = 1 << 20;   // bytes of bf16 W a thread takes at a time (L2)

// r[0..15] (16 x 16 32-bit values) transposed in place: r[j] <- column j.
inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; ++i) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

// x [M, K] bf16 (row stride K) -> B tiles: pairs [Mp / 16][K / 2][16] uint32, element (m, p) = bf16 of inputs 2p,
// 2p + 1 of row m, rows [M, Mp) zero (Mp: M rounded up to 16). The tile of rows 16 i.. and pairs p.. p + 15 is
// 1 KB in one piece.
inline void pair_columns(const uint16_t* x, int64_t M, int64_t K, uint32_t* pairs, int64_t Mp) {
    const float* rows = reinterpret_cast<const float*>(x);      // a pair's 32 bits, moved as they are
    at::parallel_for(0, Mp / 16, 1, [&](int64_t i0, int64_t i1) {
        __m512 r[16];
        for (int64_t i = i0; i < i1; ++i)
            for (int64_t p = 0; p < K / 2; p += 16) {
                for (int64_t j = 0; j < 16; ++j)
                    r[j] = 16 * i + j < M ? _mm512_loadu_ps(rows + (16 * i + j) * (K / 2) + p) : _mm512_setzero_ps();
                transpose16(r);
                float* dst = reinterpret_cast<float*>(pairs + (i * (K / 2) + p) * 16);
                for (int j = 0; j < 16; ++j) _mm512_store_ps(dst + 16 * j, r[j]);
            }
    });
}

// A 16 x 16 float32 tile c (row stride 16) transposed: row j of the result (column j of c), columns [0, nr) of it,
// stored at y + j ldy for j < mr.
inline void store_transposed16(const float* c, int64_t nr, int64_t mr, float* y, int64_t ldy) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + 16 * i);
    transpose16(r);
    const __mmask16 cols = gem4_simd::live(0, nr);
    for (int64_t j = 0; j < mr; ++j) _mm512_mask_storeu_ps(y + j * ldy, cols, r[j]);
}

inline int64_t c_rows(int64_t Mp) { return (Mp + MR - 1) / MR * MR; }   // rows of x in a block of C^T

// C^T blocks [c_rows(Mp) / 32][4][16][16] (tile 2 a + b: W rows 16 a.., x rows 16 b..) -> y[m, r] for r < nr, m < M.
inline void store_blocks(const float* ct, int64_t nr, int64_t M, int64_t Mp, float* y, int64_t ldy) {
    for (int64_t m0 = 0; m0 < Mp; m0 += MR)
        for (int t = 0; t < 4; ++t) {
            const int64_t r0 = 16 * (t / 2), j0 = m0 + 16 * (t % 2);
            if (r0 < nr && j0 < M)
                store_transposed16(ct + (m0 / MR * 4 + t) * 256, std::min<int64_t>(16, nr - r0),
                                   std::min<int64_t>(16, M - j0), y + j0 * ldy + r0, ldy);
        }
}

// Blocks of 32 rows of W as A tiles (w: block s at s NR K, [K / 32][32 rows][32] bf16, so the rows of both tiles
// of a step lie in one piece; rows past the N-th zero; nr: the last block's rows) against all rows of x (pairs:
// B tiles, pair_columns) -> C^T blocks (block s at ct + s c_rows(Mp) NR, store_blocks). Per pass over KB inputs (whose
// pairs stay in L2 for all the blocks), each block's KB-slice (in L1) meets every 32 rows of x; a 32 x 32 block
// of C^T is four tiles, put aside between passes (float32 as it is: the sums go on in the same order).
// Tiles configured as GemmTiles.
__attribute__((target("amx-tile,amx-bf16")))
inline void amx_blocks(const uint16_t* w, int64_t blocks, int64_t nr, const uint32_t* pairs, int64_t Mp, int64_t K,
                       float* ct) {
    for (int64_t k0 = 0; k0 < K; k0 += KB)
        for (int64_t s = 0; s < blocks; ++s) {
            const uint16_t* ws = w + s * NR * K;
            const bool two = s + 1 < blocks || nr > 16;
            for (int64_t m0 = 0; m0 < Mp; m0 += MR) {
                const bool wide = Mp - m0 > 16;                 // two B tiles (else rows 16-31 of the C tiles stay 0)
                float* c = ct + s * c_rows(Mp) * NR + m0 * NR;
                if (k0 == 0) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                } else {
                    _tile_loadd(0, c, 64);
                    _tile_loadd(1, c + 256, 64);
                    _tile_loadd(2, c + 512, 64);
                    _tile_loadd(3, c + 768, 64);
                }
                const uint32_t* b0 = pairs + m0 / 16 * (K / 2) * 16;
                const uint32_t* b1 = b0 + (K / 2) * 16;
                for (int64_t k = k0; k < std::min(K, k0 + KB); k += QK) {
                    _tile_loadd(6, b0 + k / 2 * 16, 64);
                    _tile_loadd(4, ws + k * NR, 2 * QK);
                    if (wide) _tile_loadd(7, b1 + k / 2 * 16, 64);
                    if (two) _tile_loadd(5, ws + k * NR + 16 * QK, 2 * QK);
                    _tile_dpbf16ps(0, 4, 6);
                    if (wide) _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        _tile_dpbf16ps(2, 5, 6);
                        if (wide) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c, 64);
                _tile_stored(1, c + 256, 64);
                _tile_stored(2, c + 512, 64);
                _tile_stored(3, c + 768, 64);
            }
        }
}

// A block of 32 rows of W as amx_blocks reads it ([K / 32][32 rows][32] bf16) turned, in place, into pairs along k
// in lanes: each 16 x 32 piece (step kb, rows 16 h..) becomes [16 pairs][16 rows] 32-bit, row j's inputs 2q, 2q + 1
// in lane j of vector q.
inline void pairs_in_lanes(uint16_t* w, int64_t K) {
    float* f = reinterpret_cast<float*>(w);                      // a pair's 32 bits, moved as they are
    for (int64_t t = 0; t < K / QK * 2; ++t, f += 256) {
        __m512 r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_load_ps(f + 16 * j);
        transpose16(r);
        for (int j = 0; j < 16; ++j) _mm512_store_ps(f + 16 * j, r[j]);
    }
}

// MC rows of x (bf16, row stride K) against a block of 32 rows of W (pairs_in_lanes; rows past the N-th zero) ->
// y[i, r] for r < nr (y row stride ldy) on vdpbf16ps (hosts without AMX): per output one sum over k's pairs in
// ascending order, W's pair in a lane, x's broadcast, whatever MC is.
template <int MC>
inline void lane_rows(const uint16_t* w, int64_t nr, const uint16_t* x, int64_t K, float* y, int64_t ldy) {
    const float* wf = reinterpret_cast<const float*>(w);
    const int32_t* xp = reinterpret_cast<const int32_t*>(x);     // row i's pair q at xp + i K / 2 + q
    __m512 acc[2][MC];
    for (int i = 0; i < MC; ++i) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < K / QK; ++kb, wf += 512)
        for (int q = 0; q < 16; ++q) {
            const __m512bh a0 = (__m512bh)_mm512_load_ps(wf + 16 * q), a1 = (__m512bh)_mm512_load_ps(wf + 256 + 16 * q);
            for (int i = 0; i < MC; ++i) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32(xp[i * K / 2 + kb * 16 + q]);
                acc[0][i] = _mm512_dpbf16_ps(acc[0][i], a0, b);
                acc[1][i] = _mm512_dpbf16_ps(acc[1][i], a1, b);
            }
        }
    for (int i = 0; i < MC; ++i) {
        _mm512_mask_storeu_ps(y + i * ldy, gem4_simd::live(0, nr), acc[0][i]);
        _mm512_mask_storeu_ps(y + i * ldy + 16, gem4_simd::live(16, nr), acc[1][i]);
    }
}

// linear_rows (tile_gemm.h): tasks are blocks of 32 rows of W, split across torch's intra-op threads. AMX (where
// granted and on, set_amx): each thread takes SUPER bytes of bf16 at a time, x laid out once as B tiles. vdpbf16ps:
// a block at a time (rows' A tiles turned into lanes here where `lanes` declines), met by x's rows 8 at a time.
at::Tensor linear_rows(const at::Tensor& x, int64_t N, Rows rows, Lanes lanes) {
    using gem4_ops::Aligned;
    const bool amx = gem4_ops::amx_on().load() && amx_bf16_granted();
    TORCH_CHECK(x.dtype() == at::kBFloat16 && x.is_contiguous() && x.dim() == 2, "x must be contiguous bf16 [M, K]");
    const int64_t M = x.size(0), K = x.size(1), Mp = (M + 15) / 16 * 16;
    TORCH_CHECK(K % QK == 0, "the GEMM takes inputs in blocks of ", QK, ", not ", K);
    auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    Aligned<uint32_t> pairs(amx ? K / 2 * Mp : 0);
    if (amx) pair_columns(xb, M, K, pairs.data, Mp);
    float* yp = y.data_ptr<float>();
    const int64_t per = amx ? std::max<int64_t>(1, SUPER / (NR * K * 2)) : 1;     // blocks of W at a time
    auto fill = [&](int64_t n0, int64_t n1, uint16_t* block) {                   // one block as the kernel reads it
        if (!amx && lanes(n0, block)) return;
        if (n1 - n0 < NR) std::fill(block, block + NR * K, uint16_t{0});
        rows(n0, n1, block);
        if (!amx) pairs_in_lanes(block, K);
    };
    at::parallel_for(0, (N + NR - 1) / NR, 1, [&](int64_t g0, int64_t g1) {
        const int64_t most = std::min(per, g1 - g0);
        Aligned<uint16_t> buf(most * NR * K);
        Aligned<float> ct(amx ? most * c_rows(Mp) * NR : 0);
        if (amx) load_tiles(GemmTiles{});
        for (int64_t gs = g0; gs < g1; gs += per) {
            const int64_t blocks = std::min(per, g1 - gs), n0 = gs * NR, n1 = std::min(N, (gs + blocks) * NR);
            for (int64_t s = 0; s < blocks; ++s)
                fill(n0 + s * NR, std::min(n1, n0 + (s + 1) * NR), buf.data + s * NR * K);
            const int64_t nr = n1 - (n0 + (blocks - 1) * NR);
            if (!amx) {                                          // one block (per = 1)
                for (int64_t m0 = 0; m0 < M; m0 += 8)
                    gem4_simd::with_count(std::min<int64_t>(8, M - m0), [&](auto count) {
                        lane_rows<decltype(count)::value>(buf.data, nr, xb + m0 * K, K, yp + m0 * N + n0, N);
                    });
                continue;
            }
            amx_blocks(buf.data, blocks, nr, pairs.data, Mp, K, ct.data);
            for (int64_t s = 0; s < blocks; ++s)
                store_blocks(ct.data + s * c_rows(Mp) * NR, s + 1 < blocks ? NR : nr, M, Mp, yp + n0 + s * NR, N);
        }
        if (amx) release_tiles();
    });
    return y;
}

at::Tensor linear_rows(const at::Tensor& x, int64_t N, Rows rows) {
    return linear_rows(x, N, rows, [](int64_t, uint16_t*) { return false; });
}

}  // namespace gem4_tiles
