// GGML K-quant super-blocks (256 weights) and where their parts go in the x16 layout (ggml_gemv.cpp).
//
// GGML (quants.py has the reference dequantization and the byte maps):
//   Q4_K 144 B: d, dmin fp16 | scales[12] (8 x 6-bit sc and min) | qs[128]          w = (d sc_j) q - (dmin min_j)
//   Q5_K 176 B: d, dmin fp16 | scales[12] | qh[32] (bit 4 of q) | qs[128]           sub-blocks j of 32, q 0..15 / 0..31
//   Q6_K 210 B: ql[128] | qh[64] (bits 4-5 of q) | int8 sc[16] | d fp16              w = (d sc_j) (q - 32), sub-blocks of 16
//
// In the x16 layout a K-quant row is cut into the same 32-weight blocks and groups of 16 blocks (two
// super-blocks) as Q4_0, and the low 4 bits of each q sit exactly where Q4_0 keeps its nibbles, so the GEMV
// reads them with Q4_0's instructions and activation order. What K-quants add, per group:
//   - high bits (Q5_K: 1, Q6_K: 2 per weight) in 1 / 2 more 64-byte vectors after the 4 nibble vectors,
//     32-bit lane b for block b, placed so that the kernel's step k (0..15, the order in which it takes
//     the nibble pairs) finds the bits of its two weights (half t = 0 / 1 of the 32-bit lane) by one
//     rotate: Q5_K bit 16t + k of the lane; Q6_K bits 16t + 2(k % 8) of vector k / 8;
//   - the scales, unpacked from their 6-bit fields (lossless), in front of the row as for Q4_0:
//     Q4_K / Q5_K 40 bytes: sc[16] (block b = sub-block b % 8 of super-block b / 8), min[16], d[2], dmin[2];
//     Q6_K 36 bytes: sc of the first 16 weights of each block [16], of the last 16 [16], d[2].
//   A row's last super-block when their count is odd is half a group, the row's tail group (ggml_gemv.cpp's
//   TailGroup): its scales unpadded, Q4_K / Q5_K sc[8], min[8], d, dmin (20 bytes); Q6_K sc[8], sc[8], d (18).
//   Sizes: Q6_K as GGML; Q4_K / Q5_K 4 bytes more per super-block, +2.8 % / +2.3 % (unpacked scales).
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "ggml_types.h"

namespace gem4_kq {

using gem4_ggml::Q4_K, gem4_ggml::Q5_K, gem4_ggml::Q6_K, gem4_ggml::QK_K;

inline bool is_k(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }
inline int64_t high_vectors(int64_t type) { return type == Q5_K ? 1 : type == Q6_K ? 2 : 0; }
inline int64_t meta_bytes(int64_t type) { return type == Q6_K ? 36 : 40; }
inline int64_t tail_meta_bytes(int64_t type) { return type == Q6_K ? 18 : 20; }   // a tail group's: one super-block

// One super-block decoded: q[256] (the full quant, 0..15 / 0..31 / 0..63) and its scales.
struct Super {
    uint8_t q[QK_K];
    uint8_t sc[16], mn[8];    // Q4_K / Q5_K: sc[0..8), mn[0..8) (6-bit); Q6_K: sc[0..16) (int8 bits)
    uint16_t d, dmin;         // fp16 bits (Q6_K: dmin unused)
};

inline void decode(int64_t type, const uint8_t* b, Super& s) {
    if (type == Q6_K) {
        // weight e = 128 h + r: low 4 bits from ql[64 h + r % 64] (low nibble for r < 64, high for r >= 64),
        // bits 4-5 from qh[32 h + r % 32] >> 2 (r / 32); in 64-byte vectors, 64 weights at a time
        const uint8_t *ql = b, *qh = b + 128;
        const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
        const __mmask64 upper = 0xFFFFFFFF00000000ull;         // r % 64 >= 32: the next pair of qh bits
        for (int h = 0; h < 2; ++h) {
            const __m512i l = _mm512_loadu_si512(ql + 64 * h);
            const __m512i q2 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h)));
            for (int half = 0; half < 2; ++half) {             // r in [64 half, 64 half + 64)
                const __m512i lo = _mm512_and_si512(half ? _mm512_srli_epi16(l, 4) : l, m4);
                const __m512i hi = _mm512_and_si512(_mm512_mask_blend_epi8(upper, _mm512_srli_epi16(q2, 4 * half),
                                                                           _mm512_srli_epi16(q2, 4 * half + 2)), m2);
                _mm512_storeu_si512(s.q + 128 * h + 64 * half, _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)));
            }
        }
        std::memcpy(s.sc, b + 192, 16);
        std::memcpy(&s.d, b + 208, 2);
        s.dmin = 0;
        return;
    }
    std::memcpy(&s.d, b, 2);
    std::memcpy(&s.dmin, b + 2, 2);
    const uint8_t* k = b + 4;                                   // the 12 scale bytes
    for (int j = 0; j < 8; ++j) {
        if (j < 4) {
            s.sc[j] = k[j] & 63;
            s.mn[j] = k[j + 4] & 63;
        } else {
            s.sc[j] = (k[j + 4] & 0xF) | ((k[j - 4] >> 6) << 4);
            s.mn[j] = (k[j + 4] >> 4) | ((k[j] >> 6) << 4);
        }
    }
    // weight e = 32 j + l: the low (j even) or high (j odd) nibble of qs[32 (j / 2) + l]; Q5_K: bit 4 is bit j
    // of qh[l]. 64 weights (sub-blocks 2p, 2p + 1) per vector: the 32 qs bytes in both halves of a register.
    const uint8_t* qs = b + (type == Q5_K ? 48 : 16);
    const uint8_t* qh = b + 16;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m1 = _mm512_set1_epi8(0x01);
    const __mmask64 upper = 0xFFFFFFFF00000000ull;             // sub-block 2p + 1
    const __m512i h = type == Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)))
                                   : _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
        const __m512i q2 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p)));
        __m512i q = _mm512_and_si512(_mm512_mask_blend_epi8(upper, q2, _mm512_srli_epi16(q2, 4)), m4);
        if (type == Q5_K) {
            const __m512i bit = _mm512_and_si512(_mm512_mask_blend_epi8(upper, _mm512_srli_epi16(h, 2 * p),
                                                                        _mm512_srli_epi16(h, 2 * p + 1)), m1);
            q = _mm512_or_si512(q, _mm512_slli_epi16(bit, 4));
        }
        _mm512_storeu_si512(s.q + 64 * p, q);
    }
}

// Where weight `e` (0..31) of a block sits: byte `byte` (0..15) of its Q4_0-style nibbles, the high nibble
// when e >= 16, and the kernel's step k / half t for it.
struct Place {
    int byte, k, t;
};
inline Place place(int e) {
    const int j = e % 16, r = j % 4;
    return {j, 4 * (j / 4) + 2 * (e / 16) + r % 2, r / 2};
}

// Where each weight e (0..31) of a block keeps its high bits: the high-bit vector (Q6_K: k / 8) and the bit.
struct HighBits {
    uint8_t vector[32], shift[32];
};
inline HighBits high_bits(int64_t type) {
    HighBits h{};
    for (int e = 0; e < 32; ++e) {
        const Place p = place(e);
        h.vector[e] = static_cast<uint8_t>(type == Q6_K ? p.k / 8 : 0);
        h.shift[e] = static_cast<uint8_t>(type == Q6_K ? 16 * p.t + 2 * (p.k % 8) : 16 * p.t + p.k);
    }
    return h;
}

// Super-block `s` -> half `half` (blocks 8 half .. 8 half + 7) of an x16 group: its quant bytes at `grp`
// (4 nibble vectors, then the high-bit vectors), its scales at `meta`.
inline void place_super(int64_t type, const Super& s, int half, const HighBits& hb, uint8_t* grp, uint8_t* meta) {
    for (int b = 0; b < 8; ++b) {
        const int lane = 8 * half + b;
        const uint8_t* q = s.q + 32 * b;
        uint8_t nibbles[16];                                   // Q4_0's order: byte j = weight j | weight j + 16
        for (int j = 0; j < 16; ++j) nibbles[j] = static_cast<uint8_t>((q[j] & 0xF) | (q[j + 16] & 0xF) << 4);
        for (int v = 0; v < 4; ++v) std::memcpy(grp + v * 64 + 4 * lane, nibbles + 4 * v, 4);
        if (type != Q4_K) {                                    // each weight's high bits shifted into place, or'ed
            uint32_t words[2];
            for (int v = 0; v < 2; ++v) {
                __m512i w = _mm512_setzero_si512();
                for (int part = 0; part < 2; ++part) {             // weights 16 part .. 16 part + 15
                    const __m512i hi = _mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * part))), 4);
                    const __m512i shift = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hb.shift + 16 * part)));
                    const __mmask16 mine = _mm512_cmpeq_epi32_mask(
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hb.vector + 16 * part))), _mm512_set1_epi32(v));
                    w = _mm512_or_si512(w, _mm512_maskz_sllv_epi32(mine, hi, shift));
                }
                words[v] = static_cast<uint32_t>(_mm512_reduce_or_epi32(w));
            }
            for (int v = 0; v < high_vectors(type); ++v) std::memcpy(grp + 256 + 64 * v + 4 * lane, words + v, 4);
        }
        if (type == Q6_K) {
            meta[lane] = s.sc[2 * b];               // weights 0..15 of the block
            meta[16 + lane] = s.sc[2 * b + 1];      // weights 16..31
        } else {
            meta[lane] = s.sc[b];
            meta[16 + lane] = s.mn[b];
        }
    }
    std::memcpy(meta + 32 + 2 * half, &s.d, 2);
    if (type != Q6_K) std::memcpy(meta + 36 + 2 * half, &s.dmin, 2);
}

}  // namespace gem4_kq
