// What one kernel source uses of another: the kernels decode_layer.cpp combines (each is also a torch op
// of its own).
#pragma once
#include <torch/extension.h>
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
torch::Tensor gemv_x16(torch::Tensor x, torch::Tensor w, int64_t n_out, int64_t k_in, int64_t ggml_type);
std::vector<torch::Tensor> gemv_x16_multi(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> n_outs,
                                          int64_t k_in, int64_t ggml_type);
std::atomic<bool>& amx_on();          // AMX kernels in use where granted (set_amx)
torch::Tensor gemv_x16_glu(torch::Tensor x, torch::Tensor gate, torch::Tensor up, int64_t n_out, int64_t k_in, int64_t ggml_type);

// bf16_gemv.cpp
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w);

// decode_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, std::optional<torch::Tensor> w, double eps, std::optional<torch::Tensor> residual);
torch::Tensor rms_norm_rope(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor cos, torch::Tensor sin);
torch::Tensor attend(torch::Tensor q, torch::Tensor k_store, torch::Tensor v_store, torch::Tensor key_rows,
                     torch::Tensor q_seq, torch::Tensor q_lo, torch::Tensor q_hi);
torch::Tensor gelu_mul(torch::Tensor a, torch::Tensor b);

}  // namespace gem4_ops
