// The GGML facts the kernels share with Python (gem4/ggml.py: GGMLType, BLOCK_INFO): the type ids of the formats
// they read and the formats' blocks. One owner on this side: every source and header includes this one, and the
// op ggml_types() (ggml_gemv.cpp) returns TYPES so that a test holds them to Python's.
#pragma once
#include <cstdint>

namespace gem4_ggml {

constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30;
// gem4's own 32-weight blocks for MLX's affine checkpoints (gem4/ggml.py; never in a GGUF file): Q4_1's arithmetic
// w = s q + b with bf16 s and b, 4-bit q in Q4_1's nibble order (A4) or unsigned bytes (A8)
constexpr int64_t MLX_A4 = 1004, MLX_A8 = 1008;
constexpr int64_t QK = 32;       // weights per block of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0
constexpr int64_t QK_K = 256;    // weights per K-quant super-block

struct TypeInfo {
    const char* name;
    int64_t id;
    int64_t block_size;    // weights per block
    int64_t type_size;     // bytes per block
};

constexpr TypeInfo TYPES[] = {
    {"Q4_0", Q4_0, QK, 2 + QK / 2},                                // d | 4-bit q
    {"Q4_1", Q4_1, QK, 2 + 2 + QK / 2},                            // d, m | 4-bit q
    {"Q5_0", Q5_0, QK, 2 + 4 + QK / 2},                            // d | qh | 4-bit q
    {"Q5_1", Q5_1, QK, 2 + 2 + 4 + QK / 2},                        // d, m | qh | 4-bit q
    {"Q8_0", Q8_0, QK, 2 + QK},                                    // d | int8 q
    {"Q4_K", Q4_K, QK_K, 2 + 2 + 12 + QK_K / 2},                   // d, dmin | scales | 4-bit q (kquants.h)
    {"Q5_K", Q5_K, QK_K, 2 + 2 + 12 + QK_K / 8 + QK_K / 2},        // d, dmin | scales | qh | 4-bit q
    {"Q6_K", Q6_K, QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2},     // ql | qh | int8 scales | d
    {"BF16", BF16, 1, 2},
    {"MLX_A4", MLX_A4, QK, 2 + 2 + QK / 2},                        // bf16 s, b | 4-bit q (Q4_1's nibbles)
    {"MLX_A8", MLX_A8, QK, 2 + 2 + QK},                            // bf16 s, b | uint8 q
};

// Bytes per block of a type of TYPES (0 for any other).
constexpr int64_t type_size(int64_t id) {
    for (const TypeInfo& t : TYPES)
        if (t.id == id) return t.type_size;
    return 0;
}

}  // namespace gem4_ggml
