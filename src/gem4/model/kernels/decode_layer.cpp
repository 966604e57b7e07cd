// One decoder layer of a decode step in one call: the kernels DecoderLayer.forward runs in fast mode, in
// the same order on the same values (so the result is bit-identical), without a trip through Python and
// the dispatcher for each of its ~20 operations.
//
//   decode_layer(x, ple, cos, sin, mask, k_store, v_store, rows, span, weights, dims, eps) -> x'
//
// x [T, H] float32 (T <= a few rows); ple [T, P] (E2B/E4B per-layer input) or None; cos / sin [T, 1, d];
// mask [T, span] bool. k_store / v_store [R, nkv, d] bf16 are the cache rows this layer attends to: a
// KV-owning layer first writes its k / v to `rows` [T] (int64), a KV-shared layer (rows None) reads what
// its donor wrote; attention sees rows [0, span).
// weights, in this order (an undefined tensor where a variant has none):
//   norms:    input, q, k, post-attention, pre-feedforward, post-feedforward, post-per-layer-input, layer scalar
//   x16:      q, k, v, o, gate, up, down, per-layer-input gate, per-layer projection
// dims: n_heads, n_kv_heads, head_dim, owns_kv, k_eq_v, then (n_out, k_in, ggml_type) of each x16 weight.
// 26B-A4B's MoE layers are not covered (the Python layer runs them).
#include <torch/extension.h>

#include "ops.h"

namespace {

using namespace gem4_ops;

enum Norm { IN_NORM, Q_NORM, K_NORM, POST_ATTN, PRE_FFN, POST_FFN, POST_PLE, SCALAR, N_NORMS };
enum Linear { Q, K, V, O, GATE, UP, DOWN, PLE_GATE, PLE_PROJ, N_LINEARS };
enum Dim { N_HEADS, N_KV_HEADS, HEAD_DIM, OWNS_KV, K_EQ_V, LINEAR_DIMS };

struct Layer {
    const std::vector<torch::Tensor>& w;
    const std::vector<int64_t>& dims;

    const torch::Tensor& norm(Norm n) const { return w[n]; }
    const torch::Tensor& packed(Linear l) const { return w[N_NORMS + l]; }
    int64_t n_out(Linear l) const { return dims[LINEAR_DIMS + 3 * l]; }
    int64_t k_in(Linear l) const { return dims[LINEAR_DIMS + 3 * l + 1]; }
    int64_t type(Linear l) const { return dims[LINEAR_DIMS + 3 * l + 2]; }
    torch::Tensor apply(Linear l, const torch::Tensor& x) const { return gemv_x16(x, packed(l), n_out(l), k_in(l), type(l)); }
};

torch::Tensor decode_layer(torch::Tensor x, std::optional<torch::Tensor> ple, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor mask, torch::Tensor k_store, torch::Tensor v_store, std::optional<torch::Tensor> rows,
                           int64_t span, std::vector<torch::Tensor> weights, std::vector<int64_t> dims, double eps) {
    TORCH_CHECK(weights.size() == N_NORMS + N_LINEARS && dims.size() == LINEAR_DIMS + 3 * N_LINEARS,
                "decode_layer: weights / dims do not describe a decoder layer");
    const Layer L{weights, dims};
    const int64_t T = x.size(0), nh = dims[N_HEADS], nkv = dims[N_KV_HEADS], d = dims[HEAD_DIM];
    const bool owns_kv = dims[OWNS_KV] != 0, k_eq_v = dims[K_EQ_V] != 0;
    TORCH_CHECK(owns_kv == rows.has_value(), "decode_layer: rows are given exactly when the layer owns its KV");

    // attention block
    const torch::Tensor h = rms_norm(x, L.norm(IN_NORM), eps, std::nullopt);
    std::vector<torch::Tensor> qkv;
    if (!owns_kv) {
        qkv = {L.apply(Q, h)};
    } else if (k_eq_v) {                                         // V is the raw K projection
        qkv = gemv_x16_multi(h, {L.packed(Q), L.packed(K)}, {L.n_out(Q), L.n_out(K)}, L.k_in(Q), L.type(Q));
    } else {
        qkv = gemv_x16_multi(h, {L.packed(Q), L.packed(K), L.packed(V)}, {L.n_out(Q), L.n_out(K), L.n_out(V)},
                             L.k_in(Q), L.type(Q));
    }
    const torch::Tensor q = rms_norm_rope(qkv[0].view({T, nh, d}), L.norm(Q_NORM), eps, cos, sin);   // [T, nh, d]
    if (owns_kv) {
        const torch::Tensor k_raw = qkv[1].view({T, nkv, d});
        const torch::Tensor v_raw = k_eq_v ? k_raw : qkv[2].view({T, nkv, d});
        const torch::Tensor k = rms_norm_rope(k_raw, L.norm(K_NORM), eps, cos, sin);
        const torch::Tensor v = rms_norm(v_raw, std::nullopt, eps, std::nullopt);     // v_norm: no weight, no rope
        k_store.index_copy_(0, *rows, k.to(k_store.scalar_type()));
        v_store.index_copy_(0, *rows, v.to(v_store.scalar_type()));
    }
    const torch::Tensor attn = attend(q, k_store.narrow(0, 0, span), v_store.narrow(0, 0, span), mask);   // [T, nh*d]
    x = rms_norm(L.apply(O, attn), L.norm(POST_ATTN), eps, x);
    // feed-forward block
    const torch::Tensor f = rms_norm(x, L.norm(PRE_FFN), eps, std::nullopt);
    const torch::Tensor gated = gemv_x16_glu(f, L.packed(GATE), L.packed(UP), L.n_out(GATE), L.k_in(GATE), L.type(GATE));
    x = rms_norm(L.apply(DOWN, gated), L.norm(POST_FFN), eps, x);
    if (ple) {                                                   // E2B/E4B: per-layer input
        const torch::Tensor p = gelu_mul(L.apply(PLE_GATE, x), ple->contiguous());
        x = rms_norm(L.apply(PLE_PROJ, p), L.norm(POST_PLE), eps, x);
    }
    return x * L.norm(SCALAR);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gem4_kernels, m) {
    m.def("decode_layer(Tensor x, Tensor? ple, Tensor cos, Tensor sin, Tensor mask, Tensor(a!) k_store, Tensor(b!) v_store, "
          "Tensor? rows, int span, Tensor[] weights, int[] dims, float eps) -> Tensor", &decode_layer);
}
