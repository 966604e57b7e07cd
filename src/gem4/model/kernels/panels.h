// The "n16" panel layout of Q8_0 / Q4_0 weights and its two GEMV kernels, VNNI and AMX, which compute the
// same floats in the same order (bit-identical, whatever the number of rows of x).
//
// Layout (repack_panel, once at load): W's rows in panels of 16 (the last one padded with zero rows). A
// panel is [scales | quants]: scales = fp16 d of (block b, row j) at 32 b + 2 j, padded to 64 bytes; quants
// = for each block b, QB / 4 vectors of 64 bytes (QB = 32 quant bytes a block for Q8_0, 16 for Q4_0), where
// vector r holds bytes 4r..4r+3 of block b of each of the 16 rows, row j at bytes 4j..4j+3. So a vector's
// 32-bit lane is one row of W (Q8_0: weights 4r..4r+3; Q4_0: low nibbles weights 4r..4r+3, high nibbles
// 16+4r..16+4r+3), and a block's vectors are, as they lie, the rows of an AMX B tile (Q8_0), or become one
// after a nibble split (Q4_0). Nothing is padded along k (any multiple of 32 inputs).
//
// Arithmetic (both kernels): x is quantized per 32-block to int8 q (scale dx = amax / 127, round to nearest:
// GGML's Q8_0 activations); for each block, dot[m][n] = sum q * w (w = Q8_0's int8, or Q4_0's nibble - 8) is an
// exact int32, then acc[m][n] = fma(float(dot), d[n] * dx[m], acc[m][n]), block after block. VNNI: lanes over
// 16 rows of W as unsigned bytes (Q8_0's w + 128, Q4_0's nibble w + 8; the offset's products, -128 or -8
// sum(q), start the block's sum), each 4 bytes of x broadcast (vpdpbusd). AMX: per pair of blocks, one int8
// tile product whose A rows are (row of x, hi / lo, block of the pair) -- the other block's half of the row
// zero; hi rows are zero since x became int8 (they held q's high byte when q was int16) -- against B = the two
// blocks' weights (16 x 64 bytes), then the same float steps.
//
// Part of ggml_gemv.cpp, the one source that includes it (its kernels are templates instantiated there; the AMX
// grant and switch are in ops.h).
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ggml_types.h"
#include "simd.h"

namespace gem4_panels {

using gem4_ggml::QK, gem4_ggml::Q8_0, gem4_ggml::Q4_0;
constexpr int64_t PANEL = 16;       // rows of W per panel
constexpr int64_t PREFETCH = 2048;  // software prefetch distance in the weight stream (AMX, the prefill dequants)
// The VNNI kernel's: 8 KB, a few blocks' worth of time ahead when 8 rows of x make each block slow (one
// 65536 x 1536 Q4_0 weight out of cache, 2 threads, 8 rows: 2 KB 1.78-1.84 ms, 4 KB 1.44, 8 KB 1.32-1.39,
// 16 KB 1.49-1.55; one row no slower); passes of 4+ rows also ask for 32 KB ahead into L2 (8 rows 1.38-1.40
// -> 1.27-1.30 ms; E2B's 8-row forward 51.7-55.4 -> 46.2-48.3 ms; for one row it measured no better)
constexpr int64_t VNNI_PREFETCH = 8192;
constexpr float Q_MAX = 127.0f;     // largest |q| of x

struct Panels {
    int64_t type, n_out, k_in;
    int64_t nb;            // blocks per row
    int64_t qb;            // quant bytes per block and row
    int64_t scales;        // scale bytes per panel (padded to 64)
    int64_t panel_bytes;
    int64_t panels;        // ceil(n_out / 16)
};

inline bool is_panel_type(int64_t type) { return type == Q8_0 || type == Q4_0; }

inline Panels panels_of(int64_t type, int64_t n_out, int64_t k_in) {
    const int64_t nb = k_in / QK, qb = type == Q8_0 ? 32 : 16, scales = (nb * 32 + 63) / 64 * 64;
    return {type, n_out, k_in, nb, qb, scales, scales + nb * PANEL * qb, (n_out + PANEL - 1) / PANEL};
}

// GGML blocks [n_out, nb] (Q8_0: fp16 d | int8 q[32]; Q4_0: fp16 d | u8 qs[16]) -> panel p (rows past n_out zero).
inline void repack_panel(const uint8_t* src, const Panels& P, int64_t p, uint8_t* panel) {
    const int64_t bb = gem4_ggml::type_size(P.type);
    std::memset(panel, 0, P.panel_bytes);
    for (int64_t j = 0; j < PANEL && p * PANEL + j < P.n_out; ++j)
        for (int64_t b = 0; b < P.nb; ++b) {
            const uint8_t* blk = src + ((p * PANEL + j) * P.nb + b) * bb;
            std::memcpy(panel + 32 * b + 2 * j, blk, 2);
            uint8_t* q = panel + P.scales + b * PANEL * P.qb;
            for (int64_t r = 0; r < P.qb / 4; ++r) std::memcpy(q + r * 64 + 4 * j, blk + 2 + 4 * r, 4);
        }
}

inline int32_t load32(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Row n's block b: its fp16 d, and its quant bytes in GGML order (qb of them) into q (16-byte aligned),
// gathered in registers and stored 16 bytes at a time (4-byte stores that a 16-byte load reads back stall
// store forwarding: prefill's dequant ran 16% slower that way).
inline uint16_t block_of(const uint8_t* w, const Panels& P, int64_t n, int64_t b, uint8_t* q) {
    const uint8_t* panel = w + (n / PANEL) * P.panel_bytes;
    const int64_t j = n % PANEL;
    const uint8_t* src = panel + P.scales + b * PANEL * P.qb + 4 * j;
    for (int64_t h = 0; h < P.qb / 16; ++h, src += 256)
        _mm_store_si128(reinterpret_cast<__m128i*>(q + 16 * h),
                        _mm_set_epi32(load32(src + 192), load32(src + 128), load32(src + 64), load32(src)));
    uint16_t d;
    std::memcpy(&d, panel + 32 * b + 2 * j, 2);
    return d;
}

// One block of 32 floats -> int8 q (in order), its scale and sum. A block with a NaN gets scale NaN (q 0), so
// that every product it enters is NaN, as in float (max would drop it, and a NaN converts to an integer).
inline __m256i quantize_block(const float* x, float& scale, int32_t& sum) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    scale = gem4_simd::has_nan(v0, v1) ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))) / Q_MAX;
    const __m512 inv = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtsepi32_epi8(q0)), _mm512_cvtsepi32_epi8(q1), 1);
}

// Rows [m_begin, m_end) of x [M, K] prepared for the panel kernels, in the chunks of up to 8 rows that their
// passes take (chunk c = rows 8c.., mc rows): per (row i of a chunk, block b), dx at c 8 nb + b mc + i and the
// offset's correction (Q8_0: -128 sum(q), Q4_0: -8 sum(q)) at the same index; the int8 q (if quads) as 32-bit
// words (4 inputs each), word w of (i, b) at quads + c 8 K + ((8 b + w) mc + i) 4, so that a pass reads each
// step's words of all its rows from one place; for AMX (planes != nullptr, zeroed) the int8 A rows: block pair
// j, row m at planes + (j M + m) 256: rows (hi, block 2j), (hi, 2j + 1), (lo, 2j), (lo, 2j + 1) of 64 bytes,
// the block's 32 bytes in its half of the row; the hi rows stay zero.
inline void prepare_panel_rows(const float* x, int64_t M, const Panels& P, int8_t* quads, float* dx, int32_t* corr,
                               int8_t* planes, int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m) {
        const int64_t c0 = m / 8 * 8, mc = std::min<int64_t>(8, M - c0), i = m - c0;
        for (int64_t b = 0; b < P.nb; ++b) {
            float scale;
            int32_t sum;
            alignas(32) int32_t q[8];
            _mm256_store_si256(reinterpret_cast<__m256i*>(q), quantize_block(x + m * P.k_in + b * QK, scale, sum));
            const int64_t at = c0 * P.nb + b * mc + i;
            dx[at] = scale;
            corr[at] = (P.type == Q4_0 ? -8 : -128) * sum;
            if (quads)
                for (int64_t w = 0; w < 8; ++w) std::memcpy(quads + c0 * P.k_in + ((8 * b + w) * mc + i) * 4, q + w, 4);
            if (planes) {
                int8_t* row = planes + ((b / 2) * M + m) * 256 + (b % 2) * 96;          // row b % 2, half b % 2
                std::memcpy(row + 128, q, 32);
            }
        }
    }
}

struct PanelX {
    const int8_t* quads;    // the pass's chunk of rows (prepare_panel_rows)
    const float* dx;        // the same chunk's
    const int32_t* corr;
    const int8_t* planes;   // the whole prepared x (AMX)
    int64_t M, m0;          // rows of x in all; the pass's first
};

inline void store_rows(const __m512* acc, int mc, const Panels& P, int64_t p, float* y, int64_t ldy) {
    const int64_t n = p * PANEL, left = P.n_out - n;
    const __mmask16 k = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    for (int i = 0; i < mc; ++i) _mm512_mask_storeu_ps(y + i * ldy + n, k, acc[i]);
}

// y[i, n] (i < MC rows of the pass, n in panels [p0, p1)), VNNI.
template <int MC, int64_t TYPE>
void vnni_panels(const PanelX& x, const Panels& P, const uint8_t* w, float* y, int64_t ldy, int64_t p0, int64_t p1) {
    const int64_t nb = P.nb;
    const int32_t* xq = reinterpret_cast<const int32_t*>(x.quads);   // block b's words at xq + 8 b MC: word w of
                                                                     // row i at w MC + i
    const __m512i low4 = _mm512_set1_epi8(0x0F), sign = _mm512_set1_epi8(static_cast<char>(0x80));
    constexpr int NV = TYPE == Q8_0 ? 8 : 4;
    for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* panel = w + p * P.panel_bytes;
        __m512 acc[MC];
        for (int i = 0; i < MC; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* q = panel + P.scales + b * PANEL * P.qb;
            const int32_t* xb = xq + 8 * b * MC;
            __m512i dot[MC];
            for (int i = 0; i < MC; ++i) dot[i] = _mm512_set1_epi32(x.corr[b * MC + i]);
#pragma GCC unroll 8
            for (int r = 0; r < NV; ++r) {
                _mm_prefetch(reinterpret_cast<const char*>(q + VNNI_PREFETCH + r * 64), _MM_HINT_T0);
                if constexpr (MC >= 4) _mm_prefetch(reinterpret_cast<const char*>(q + 4 * VNNI_PREFETCH + r * 64), _MM_HINT_T1);
                const __m512i raw = _mm512_load_si512(q + r * 64);
                if constexpr (TYPE == Q8_0) {
                    const __m512i u = _mm512_xor_si512(raw, sign);                    // weights 4r..4r+3, + 128
                    for (int i = 0; i < MC; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], u, _mm512_set1_epi32(xb[r * MC + i]));
                } else {
                    const __m512i lo = _mm512_and_si512(raw, low4);                           // weights 4r..4r+3, + 8
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);     // 16+4r..16+4r+3, + 8
                    for (int i = 0; i < MC; ++i) {
                        dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(xb[r * MC + i]));
                        dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(xb[(4 + r) * MC + i]));
                    }
                }
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(panel + 32 * b)));
            for (int i = 0; i < MC; ++i)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(d, _mm512_set1_ps(x.dx[b * MC + i])), acc[i]);
        }
        store_rows(acc, MC, P, p, y, ldy);
    }
}

// Q4_0 blocks [b0, b1) of a panel as AMX B rows: each block's nibbles split and centred (w - 8), low nibbles
// (weights 4r..4r+3 of each row) in rows 0-3, high nibbles in rows 4-7; a block past nb zero.
inline void unpack_q4_0(const Panels& P, const uint8_t* quants, int64_t b0, int64_t b1, int8_t* dst) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t b = b0; b < b1; ++b, dst += 512) {
        if (b >= P.nb) {
            std::memset(dst, 0, 512);
            continue;
        }
        const uint8_t* q = quants + b * 256;
        for (int r = 0; r < 4; ++r) {
            _mm_prefetch(reinterpret_cast<const char*>(q + PREFETCH + r * 64), _MM_HINT_T0);
            const __m512i raw = _mm512_load_si512(q + r * 64);
            _mm512_store_si512(dst + r * 64, _mm512_sub_epi8(_mm512_and_si512(raw, low4), eight));
            _mm512_store_si512(dst + 256 + r * 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4), eight));
        }
    }
}

// Where a pass finds block pair j's B tile (16 x 64 bytes), two ways (measured, one thread, Q4_0 6144 x 1536):
// - PanelTiles, made once per panel and read by every pass (what several passes want: 32 rows 2.1 vs 2.4 ms):
//   Q4_0 unpacked into `scratch`, Q8_0 where it lies but an odd last block, copied beside a zero block.
//   scratch: (nb + 1) / 2 * 1024 bytes, 64-aligned.
// - AheadTiles (Q4_0, a single pass: 8 rows 0.57 vs 0.79 ms): AHEAD pairs unpacked at a time into an L1 buffer,
//   a few pairs before their products (a tile load right after the stores that wrote its bytes waits for them).
struct PanelTiles {
    const int8_t* base;    // pairs [0, full)
    int64_t full;
    const int8_t* tail;    // pairs from full on
    const int8_t* operator()(int64_t j) const { return (j < full ? base : tail) + j * 1024; }
};

template <int64_t TYPE>
PanelTiles panel_tiles(const Panels& P, const uint8_t* panel, int8_t* scratch) {
    const uint8_t* quants = panel + P.scales;
    if constexpr (TYPE == Q8_0) {
        const int64_t full = P.nb / 2;
        if (P.nb % 2) {
            std::memcpy(scratch + full * 1024, quants + full * 1024, 512);
            std::memset(scratch + full * 1024 + 512, 0, 512);
        }
        return {reinterpret_cast<const int8_t*>(quants), full, scratch};
    } else {
        unpack_q4_0(P, quants, 0, P.nb + P.nb % 2, scratch);
        return {scratch, (P.nb + 1) / 2, scratch};
    }
}

struct AheadTiles {
    static constexpr int64_t AHEAD = 4;
    const Panels& P;
    const uint8_t* quants;
    int8_t* buf;           // AHEAD * 1024 bytes, 64-aligned
    const int8_t* operator()(int64_t j) const {
        if (j % AHEAD == 0) unpack_q4_0(P, quants, 2 * j, 2 * (j + AHEAD), buf);
        return buf + (j % AHEAD) * 1024;
    }
};

// Tile shapes for a pass of MC <= 8 rows of x: two A tiles (rows 0-3, 4-7 of x; 4 tile rows each: hi / lo of
// the pair's two blocks), their C tiles, B = a pair of blocks.
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};

    explicit TileConfig(int mc) {
        const int r0 = 4 * std::min(mc, 4), r1 = 4 * std::max(mc - 4, 0);
        rows[0] = rows[2] = r0;                      // C0, A0
        colsb[0] = colsb[2] = 64;
        if (r1) {
            rows[1] = rows[3] = r1;                  // C1, A1
            colsb[1] = colsb[3] = 64;
        }
        rows[4] = 16;                                // B
        colsb[4] = 64;
    }
};

// y[i, n] for the MC rows of a pass and the 16 rows of one panel, as vnni_panels computes them, on AMX tiles:
// per pair of blocks one tile product per A tile, C copied out and scaled while the next pair multiplies.
// The tile configuration must be TileConfig(MC).
template <int MC, typename Tiles>
__attribute__((target("amx-tile,amx-int8")))
void amx_pass(const PanelX& x, const Panels& P, const uint8_t* panel, const Tiles& tiles, int64_t p, float* y,
              int64_t ldy) {
    static_assert(MC >= 1 && MC <= 8, "two A tiles of 4 rows of x");
    constexpr int R0 = 4 * std::min(MC, 4), R1 = 4 * std::max(MC - 4, 0);
    const int64_t nb = P.nb, pairs = (nb + 1) / 2;
    alignas(64) int32_t c[2][32 * 16];               // C of a pair (two slots): [C0 rows | C1 rows] x 16
    __m512 acc[MC];
    for (int i = 0; i < MC; ++i) acc[i] = _mm512_setzero_ps();
    auto scale = [&](int64_t j) {                    // the pair j's dots into acc: block 2j, then 2j + 1
        const int32_t* cj = c[j & 1];
        for (int h = 0; h < 2 && 2 * j + h < nb; ++h) {
            const int64_t b = 2 * j + h;
            const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(panel + 32 * b)));
            for (int i = 0; i < MC; ++i) {
                const int32_t* ci = cj + (i < 4 ? 4 * i : R0 + 4 * (i - 4)) * 16;
                const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ci + 16 * h), 8),
                                                     _mm512_load_si512(ci + 16 * (2 + h)));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x.dx[b * MC + i])), acc[i]);
            }
        }
    };
    for (int64_t j = 0; j < pairs; ++j) {
        const int8_t* bj = tiles(j);
        for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(bj + PREFETCH + r * 64), _MM_HINT_T0);
        _tile_loadd(4, bj, 64);
        const int8_t* a = x.planes + (j * x.M + x.m0) * 256;
        int32_t* cs = c[j & 1];
        _tile_loadd(2, a, 64);
        _tile_zero(0);
        _tile_dpbssd(0, 2, 4);
        _tile_stored(0, cs, 64);
        if constexpr (R1 > 0) {
            _tile_loadd(3, a + 4 * 256, 64);
            _tile_zero(1);
            _tile_dpbssd(1, 3, 4);
            _tile_stored(1, cs + R0 * 16, 64);
        }
        if (j > 0) scale(j - 1);
    }
    scale(pairs - 1);
    store_rows(acc, MC, P, p, y, ldy);
}

constexpr int64_t ROW_BLOCK = 64;   // rows of x whose A tiles (4 KB a row for 1536 inputs) a panel's B tiles meet
                                    // while both are in cache; W is read once per row block

// y[m, n] for all M rows of x (x.m0 = 0) and panels [p0, p1) on AMX: per row block, each panel's B tiles made
// once and met by every pass of up to 8 rows of the block (one pass: Q4_0's unpacked a few pairs ahead).
template <int64_t TYPE>
__attribute__((target("amx-tile,amx-int8")))
void amx_rows(const PanelX& x, const Panels& P, const uint8_t* w, float* y, int64_t ldy, int64_t p0, int64_t p1) {
    const int64_t M = x.M, nb = P.nb;
    int8_t* scratch = static_cast<int8_t*>(std::aligned_alloc(64, std::max<int64_t>((nb + 1) / 2, AheadTiles::AHEAD) * 1024));
    int configured = 0;
    for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK)
        for (int64_t p = p0; p < p1; ++p) {
            const uint8_t* panel = w + p * P.panel_bytes;
            const bool ahead = TYPE == Q4_0 && M <= 8;
            const PanelTiles tiles = ahead ? PanelTiles{} : panel_tiles<TYPE>(P, panel, scratch);
            const AheadTiles ahead_tiles{P, panel + P.scales, scratch};
            for (int64_t m0 = r0; m0 < std::min(M, r0 + ROW_BLOCK); m0 += 8) {
                const int mc = static_cast<int>(std::min<int64_t>(8, M - m0));
                if (mc != configured) {
                    const TileConfig cfg(mc);
                    // asm with the whole struct as its operand: through _tile_loadconfig GCC 12 dropped the stores of
                    // the rows and widths as dead (only the palette reached memory: SIGILL on the first tile load)
                    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
                    configured = mc;
                }
                const PanelX xp{nullptr, x.dx + m0 * nb, nullptr, x.planes, M, m0};
                gem4_simd::with_count(mc, [&](auto rows) {
                    constexpr int MC = decltype(rows)::value;
                    if constexpr (TYPE == Q4_0)
                        if (ahead) return amx_pass<MC>(xp, P, panel, ahead_tiles, p, y + m0 * ldy, ldy);
                    amx_pass<MC>(xp, P, panel, tiles, p, y + m0 * ldy, ldy);
                });
            }
        }
    _tile_release();
    std::free(scratch);
}

}  // namespace gem4_panels
