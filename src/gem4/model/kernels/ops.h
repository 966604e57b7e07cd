// What one kernel source uses of another: the kernels decode_layer.cpp combines (each is also a torch op
// of its own), the AMX switch and grant the prefill GEMM shares with the panel GEMV.
//
// The library's ops are registered under torch.ops.gem4_kernels, each in the file that implements it. Only
// ggml_gemv.cpp opens the library with TORCH_LIBRARY(gem4_kernels, m); every other source registers its ops
// with TORCH_LIBRARY_FRAGMENT(gem4_kernels, m) (a second TORCH_LIBRARY fails when the library loads). A new
// source does the same, and is added to SOURCES in build.py (a new header to HEADERS: both are in the build key).
#pragma once
#include <ATen/core/Tensor.h>
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <optional>
#include <vector>

namespace gem4_ops {

// A 64-byte aligned array, not initialised: the kernels load 64 bytes at a time (AMX tiles whole), and a load
// that straddles two cache lines costs two (with malloc's 16-byte alignment Q4_0 ran at 27 or 44 GB/s
// depending on the address).
template <typename T>
struct Aligned {
    T* data = nullptr;
    explicit Aligned(int64_t n) : data(static_cast<T*>(std::aligned_alloc(64, std::max<int64_t>(64, (n * sizeof(T) + 63) / 64 * 64)))) {
        TORCH_CHECK(data != nullptr, "out of memory");
    }
    ~Aligned() { std::free(data); }
    Aligned(const Aligned&) = delete;
    Aligned& operator=(const Aligned&) = delete;
};

// ggml_gemv.cpp
unsigned cpuid7_edx();                // CPUID leaf 7's EDX: bit 22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8
bool amx_granted();                   // AMX-TILE and AMX-INT8 reported and the tile state granted (asked once)
std::atomic<bool>& amx_on();          // AMX kernels in use where granted (set_amx)
at::Tensor gemv(at::Tensor x, at::Tensor w, int64_t n_out, int64_t k_in, int64_t ggml_type);
std::vector<at::Tensor> gemv_multi(at::Tensor x, std::vector<at::Tensor> ws, std::vector<int64_t> n_outs,
                                   int64_t k_in, int64_t ggml_type);
at::Tensor gemv_glu(at::Tensor x, at::Tensor gate, at::Tensor up, int64_t n_out, int64_t k_in, int64_t ggml_type);

// bf16_gemv.cpp
at::Tensor gemv_bf16(at::Tensor x, at::Tensor w);

// decode_ops.cpp
at::Tensor rms_norm(at::Tensor x, std::optional<at::Tensor> w, double eps, std::optional<at::Tensor> residual);
at::Tensor rms_norm_rope(at::Tensor x, at::Tensor w, double eps, at::Tensor cos, at::Tensor sin);
at::Tensor attend(at::Tensor q, at::Tensor k_store, at::Tensor v_store, at::Tensor key_rows,
                  at::Tensor q_seq, at::Tensor q_lo, at::Tensor q_hi, std::optional<at::Tensor> k_scale,
                  std::optional<at::Tensor> v_scale);
// The dtypes a KV storage holds (kv_cache/pool.py): bf16; int8 with a float32 scale per row of head_dim values
// (k_scale / v_scale [rows, kv_heads]); float8_e4m3fn, plain. kv_kind checks a storage pair and names its kind.
enum KvKind { KV_BF16, KV_INT8, KV_FP8 };
int kv_kind(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& k_scale,
            const std::optional<at::Tensor>& v_scale);
at::Tensor gelu_mul(at::Tensor a, at::Tensor b);

}  // namespace gem4_ops
