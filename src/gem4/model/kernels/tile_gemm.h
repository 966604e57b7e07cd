// Prefill's GEMM, y [M, N] float32 = x [M, K] bf16 . W^T, row-invariant: every element of y is the same float
// whatever M is and wherever its row sits among the others. tile_gemm.cpp has the kernels (AMX tiles where
// granted, vdpbf16ps otherwise) and how they sum; its callers give W as bf16 rows: a bf16 weight as stored
// (linear_bf16, bf16_gemv.cpp), rows dequantized from a packed weight (linear_packed, ggml_gemv.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>
#include <cstdint>

#include "ggml_types.h"

namespace gem4_tiles {

constexpr int64_t QK = gem4_ggml::QK;   // inputs per step: one tile row of bf16, a GGML block (the callers'
                                        // dequant writes W a block at a time)
constexpr int64_t NR = 32;              // rows of W per block (two A tiles)

// rows(n0, n1, buf): rows [n0, n1) of W (n1 - n0 <= NR) as bf16 A tiles into buf: [K / QK][NR rows][QK], row
// n's inputs k..k + QK - 1 at buf + k NR + (n - n0) QK (the GEMM zeroes the rest of the NR rows).
using Rows = c10::function_ref<void(int64_t n0, int64_t n1, uint16_t* buf)>;
// lanes(n0, buf): where W can be made in lanes straight away, the whole block of NR rows from n0 (rows past N zero)
// as pairs along k in lanes (each 16 x QK piece, step kb and rows 16 h.., at buf + (2 kb + h) 512 as [16 pairs]
// [16 rows] 32-bit), and true; false otherwise (the vdpbf16ps kernel then turns rows' A tiles into lanes itself).
using Lanes = c10::function_ref<bool(int64_t n0, uint16_t* buf)>;

// y [M, N] float32 = x [M, K] bf16 (contiguous, K a multiple of QK) . W^T, W given by rows (and lanes).
at::Tensor linear_rows(const at::Tensor& x, int64_t N, Rows rows, Lanes lanes);
at::Tensor linear_rows(const at::Tensor& x, int64_t N, Rows rows);   // W has no way into lanes of its own

}  // namespace gem4_tiles
