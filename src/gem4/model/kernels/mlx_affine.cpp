// MLX affine checkpoints (gem4/weights/mlx.py) -> gem4's 32-weight blocks MLX_A4 / MLX_A8 (ggml_types.h), once at
// load: what weights/mlx.py's AffineTensor.blocks computes with torch ops, in one pass over the bytes (the E2B-shaped
// checkpoint: ~15 s of torch ops on 2 cores). Lossless: the quants move, the bf16 scales and biases are copied.
//
// In:  q       int32 [R, k_in * bits / 32]   weight j of a row at bits (j * bits) % 32 of word j * bits / 32 (LE)
//      scales  bf16  [R, k_in / group]       biases the same
// Out: uint8 [R, k_in / 32 * block bytes]    per 32 weights: s | b | quants (A4: Q4_1's nibbles, byte j = weights j
//                                            and j + 16; A8: one byte per weight); a group's s, b in each of its blocks
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <cstdint>
#include <cstring>

#include "ggml_types.h"

namespace gem4_affine {

at::Tensor affine_blocks(at::Tensor q, at::Tensor scales, at::Tensor biases, int64_t bits, int64_t group) {
    TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
    TORCH_CHECK(group == 32 || group == 64 || group == 128, "group must be 32, 64 or 128");
    TORCH_CHECK(q.dtype() == at::kInt && q.is_contiguous() && q.dim() == 2, "q must be contiguous int32 [R, words]");
    const int64_t R = q.size(0), k_in = q.size(1) * 32 / bits, G = k_in / group;
    for (const at::Tensor* t : {&scales, &biases})
        TORCH_CHECK(t->dtype() == at::kBFloat16 && t->is_contiguous() && t->dim() == 2 && t->size(0) == R && t->size(1) == G
                    && k_in % group == 0, "scales and biases must be contiguous bf16 [R, k_in / group]");
    const int64_t nb = k_in / 32, qbytes = 32 * bits / 8, bb = 4 + qbytes, row_in = k_in * bits / 8;
    auto out = at::empty({R, nb * bb}, q.options().dtype(at::kByte));
    const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr<int32_t>());
    const uint8_t* sp = reinterpret_cast<const uint8_t*>(scales.data_ptr());
    const uint8_t* bp = reinterpret_cast<const uint8_t*>(biases.data_ptr());
    uint8_t* op = out.data_ptr<uint8_t>();
    at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
            for (int64_t b = 0; b < nb; ++b) {
                uint8_t* blk = op + (r * nb + b) * bb;
                const int64_t g = r * G + b * 32 / group;
                std::memcpy(blk, sp + 2 * g, 2);
                std::memcpy(blk + 2, bp + 2 * g, 2);
                const uint8_t* src = qp + r * row_in + b * qbytes;      // byte k: weights 2k (low), 2k + 1 (high)
                if (bits == 8) {
                    std::memcpy(blk + 4, src, 32);
                    continue;
                }
                for (int j = 0; j < 16; ++j) {
                    const uint8_t lo = (src[j / 2] >> (4 * (j % 2))) & 0x0F, hi = (src[(j + 16) / 2] >> (4 * (j % 2))) & 0x0F;
                    blk[4 + j] = static_cast<uint8_t>(lo | (hi << 4));
                }
            }
    });
    return out;
}

}  // namespace gem4_affine

TORCH_LIBRARY_FRAGMENT(gem4_kernels, m) {
    m.def("affine_blocks(Tensor q, Tensor scales, Tensor biases, int bits, int group) -> Tensor", &gem4_affine::affine_blocks);
}
