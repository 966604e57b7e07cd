// One decoder layer of a decode step in one call: the kernels DecoderLayer.forward runs in fast mode, in
// the same order on the same values (so the result is bit-identical), without a trip through Python and
// the dispatcher for each of its ~20 operations.
//
//   decode_layer(x, ple, cos, sin, k_store, v_store, rows, key_rows, q_seq, q_lo, q_hi, weights, dims, eps,
//                k_scale?, v_scale?) -> x'
//
// x [T, H] float32 (T <= a few rows, of one or several sequences); ple [T, P] (E2B/E4B per-layer input) or
// None; cos / sin [T, 1, d]. k_store / v_store [R, nkv, d] are the layer's KV storage (bf16, fp8_e4m3, or int8
// with k_scale / v_scale [R, nkv]: kv_cache.LayerKV): a KV-owning layer first writes its k / v to `rows` [T]
// (int64; quantized as kv_cache.quantize does, `write_kv`), a KV-shared layer (rows None) reads what its donor
// wrote; then query row t attends to key_rows[q_seq[t], q_lo[t] : q_hi[t]] (kv_cache.Attend, see attend).
// weights and dims, in the order of the lists below (NORMS, LINEARS; DIMS, then LINEAR_DIMS of each linear), each
// named as the Python layer names it (model/cpu.py's DecodePlan gives them in its own order, checked against
// decode_layer_schema() when a model is loaded); an empty tensor where a variant has none:
//   norms:    input, q, k, post-attention, pre-feedforward, post-feedforward, post-per-layer-input, layer scalar
//   linears:  q, k, v, o, gate, up, down, per-layer-input gate, per-layer projection
//   dims:     n_heads, n_kv_heads, head_dim, owns_kv, k_eq_v, then (n_out, k_in, type) of each linear
// A linear is packed (its GGML type: Q8_0 / Q4_0 panels, the other types x16 rows; ggml_gemv.cpp) or bf16
// [n_out, k_in] as stored (GGML's BF16 id); Q/K/V and gate/up take one fused pass when they are packed of one
// type, one call each otherwise (as in Python).
// 26B-A4B layers append to weights (MOE_WEIGHTS): the norms pre-feedforward-2, post-feedforward-1,
// post-feedforward-2, the router's scale, projection [E, H] (float32) and per-expert scale, the experts' gate_up
// and down; and to dims (MOE_DIMS): E, top_k, then each expert weight's type (packed as [E * rows, ...], E units of
// rows that are each a packed weight (repack's units); 0: dense [E, rows, k]).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ggml_types.h"
#include "ops.h"

namespace {

using namespace gem4_ops;

// The argument lists, declared once: X(enum constant, name) in order. The names are the Python layer's
// (cpu.py: DECODE_LAYER_NORMS + layer_scalar, DECODE_LAYER_LINEARS, DECODE_LAYER_DIMS, DECODE_LAYER_LINEAR_DIMS,
// DECODE_LAYER_MOE, DECODE_LAYER_MOE_DIMS).
#define NORMS(X) X(IN_NORM, "input_layernorm") X(Q_NORM, "self_attn.q_norm") X(K_NORM, "self_attn.k_norm") \
    X(POST_ATTN, "post_attention_layernorm") X(PRE_FFN, "pre_feedforward_layernorm") \
    X(POST_FFN, "post_feedforward_layernorm") X(POST_PLE, "post_per_layer_input_norm") X(SCALAR, "layer_scalar")
#define LINEARS(X) X(Q, "self_attn.q_proj") X(K, "self_attn.k_proj") X(V, "self_attn.v_proj") X(O, "self_attn.o_proj") \
    X(GATE, "mlp.gate_proj") X(UP, "mlp.up_proj") X(DOWN, "mlp.down_proj") X(PLE_GATE, "per_layer_input_gate") \
    X(PLE_PROJ, "per_layer_projection")
#define DIMS(X) X(N_HEADS, "n_heads") X(N_KV_HEADS, "n_kv_heads") X(HEAD_DIM, "head_dim") X(OWNS_KV, "owns_kv") \
    X(K_EQ_V, "k_eq_v")
#define LINEAR_DIMS(X) X(N_OUT, "out_features") X(K_IN, "in_features") X(TYPE, "gemv_type")   // of each linear
#define MOE_WEIGHTS(X) X(PRE_FFN_2, "pre_feedforward_layernorm_2.weight") \
    X(POST_FFN_1, "post_feedforward_layernorm_1.weight") X(POST_FFN_2, "post_feedforward_layernorm_2.weight") \
    X(ROUTER_SCALE, "router.scale") X(ROUTER_PROJ, "router.proj.weight") X(EXPERT_SCALE, "router.per_expert_scale") \
    X(EXPERTS_GATE_UP, "experts.gate_up_proj") X(EXPERTS_DOWN, "experts.down_proj")
#define MOE_DIMS(X) X(N_EXPERTS, "experts.num_experts") X(TOP_K, "router.top_k") \
    X(GATE_UP_TYPE, "experts.gate_up_proj.type") X(DOWN_TYPE, "experts.down_proj.type")
#define AS_ENUM(c, name) c,
#define AS_NAME(c, name) name,

enum Norm { NORMS(AS_ENUM) N_NORMS };
enum Linear { LINEARS(AS_ENUM) N_LINEARS };
enum Dim { DIMS(AS_ENUM) N_DIMS };
enum LinearDim { LINEAR_DIMS(AS_ENUM) N_LINEAR_DIMS };
enum MoeWeight { MOE_WEIGHTS(AS_ENUM) N_MOE_WEIGHTS };
enum MoeDim { MOE_DIMS(AS_ENUM) N_MOE_DIMS };
constexpr size_t DENSE_WEIGHTS = N_NORMS + N_LINEARS, DENSE_DIMS = N_DIMS + N_LINEAR_DIMS * N_LINEARS;
using gem4_ggml::BF16;

struct Layer {
    const std::vector<at::Tensor>& w;
    const std::vector<int64_t>& dims;

    const at::Tensor& norm(Norm n) const { return w[n]; }
    const at::Tensor& packed(Linear l) const { return w[N_NORMS + l]; }
    int64_t linear_dim(Linear l, LinearDim d) const { return dims[N_DIMS + N_LINEAR_DIMS * l + d]; }
    int64_t n_out(Linear l) const { return linear_dim(l, N_OUT); }
    int64_t k_in(Linear l) const { return linear_dim(l, K_IN); }
    int64_t type(Linear l) const { return linear_dim(l, TYPE); }
    at::Tensor apply(Linear l, const at::Tensor& x) const {
        return type(l) == BF16 ? gemv_bf16(x, packed(l)) : gemv(x, packed(l), n_out(l), k_in(l), type(l));
    }
    // layers.project: x through several linears, one pass when all are packed of one type
    std::vector<at::Tensor> project(const at::Tensor& x, const std::vector<Linear>& ls) const {
        bool one_pass = ls.size() > 1 && type(ls[0]) != BF16;
        for (Linear l : ls) one_pass = one_pass && type(l) == type(ls[0]);
        std::vector<at::Tensor> out;
        if (!one_pass) {
            for (Linear l : ls) out.push_back(apply(l, x));
            return out;
        }
        std::vector<at::Tensor> ws;
        std::vector<int64_t> n_outs;
        for (Linear l : ls) ws.push_back(packed(l)), n_outs.push_back(n_out(l));
        return gemv_multi(x, ws, n_outs, k_in(ls[0]), type(ls[0]));
    }
    // layers.glu: gelu_tanh(gate(x)) * up(x)
    at::Tensor glu(const at::Tensor& x) const {
        if (type(GATE) != BF16 && type(GATE) == type(UP))
            return gemv_glu(x, packed(GATE), packed(UP), n_out(GATE), k_in(GATE), type(GATE));
        return gelu_mul(apply(GATE, x), apply(UP, x));
    }

    // 26B-A4B
    bool moe() const { return w.size() > DENSE_WEIGHTS; }
    const at::Tensor& moe_weight(MoeWeight m) const { return w[DENSE_WEIGHTS + m]; }
    int64_t moe_dim(MoeDim m) const { return dims[DENSE_DIMS + m]; }

    // Router.forward: r [T, H] (the un-normed residual) -> expert ids [T, K], weights [T, K]
    std::pair<at::Tensor, at::Tensor> route(const at::Tensor& r, double eps) const {
        const at::Tensor t = at::rms_norm(r, {r.size(-1)}, std::nullopt, eps) * moe_weight(ROUTER_SCALE)
                                * std::pow(static_cast<double>(r.size(-1)), -0.5);
        // one row at a time, as Router.forward: a float32 GEMM's rows depend on how many there are
        std::vector<at::Tensor> rows;
        for (int64_t i = 0; i < t.size(0); ++i) rows.push_back(at::linear(t.narrow(0, i, 1), moe_weight(ROUTER_PROJ)));
        const at::Tensor probs = at::softmax(at::cat(rows), -1);                            // over all experts first
        auto [top, idx] = at::topk(probs, moe_dim(TOP_K), -1);
        top = top / top.sum(-1, true);                                                      // renormalise the top-K
        return {idx, top * moe_weight(EXPERT_SCALE).index({idx})};
    }

    // expert e's xs @ W_e.T for an expert weight [E, rows, k] (dense) or its packed rows [E * rows, ...]
    at::Tensor expert(MoeWeight m, MoeDim type_dim, int64_t e, const at::Tensor& xs) const {
        const at::Tensor& w = moe_weight(m);
        const int64_t type = moe_dim(type_dim);
        if (type == 0) return at::linear(xs.to(w.scalar_type()), w[e]).to(xs.scalar_type());
        const int64_t rows = w.size(0) / moe_dim(N_EXPERTS), k = xs.size(1);
        return gemv(xs.contiguous(), w.narrow(0, e * rows, rows), rows, k, type);
    }

    // layers.experts_forward (fast mode): grouped by expert, in ascending expert order
    at::Tensor experts(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& weights) const {
        const int64_t K = idx.size(1);
        const at::Tensor flat = idx.reshape(-1);
        const at::Tensor order = at::argsort(flat, /*stable=*/true);
        const at::Tensor token_of = at::floor_divide(order, K);
        const at::Tensor weight_of = weights.reshape(-1).index({order});
        const at::Tensor counts = at::bincount(flat).contiguous();                              // int64 [max id + 1]
        const int64_t* count = counts.data_ptr<int64_t>();
        at::Tensor out = at::zeros_like(x);
        int64_t start = 0;
        for (int64_t e = 0; e < counts.size(0); ++e) {
            const int64_t n = count[e];
            if (n == 0) continue;
            const at::Tensor tokens = token_of.narrow(0, start, n);
            const at::Tensor gu = expert(EXPERTS_GATE_UP, GATE_UP_TYPE, e, x.index({tokens}));       // [n, 2 Im]
            const int64_t im = gu.size(1) / 2;
            const at::Tensor h = gelu_mul(gu.narrow(1, 0, im).contiguous(), gu.narrow(1, im, im).contiguous());
            const at::Tensor y = expert(EXPERTS_DOWN, DOWN_TYPE, e, h);                            // [n, H]
            out.index_add_(0, tokens, y * weight_of.narrow(0, start, n).unsqueeze(1).to(x.scalar_type()));
            start += n;
        }
        return out;
    }
};

// Float rows x [T, nkv, d] into the storage at `rows`, in its dtype: the ops of kv_cache.quantize, in its order, so
// that both store the same bits (int8: scale = amax / 127 per row, values round(x / scale); fp8: clamped, rounded).
void write_kv(at::Tensor& store, const std::optional<at::Tensor>& scales, const at::Tensor& rows, const at::Tensor& x) {
    if (store.scalar_type() == at::kChar) {
        const at::Tensor scale = x.abs().amax(-1) / 127;
        const at::Tensor q = at::round(x / scale.clamp_min(std::numeric_limits<float>::min()).unsqueeze(-1)).clamp(-127, 127);
        store.index_copy_(0, rows, q.to(at::kChar));
        scales->index_copy_(0, rows, scale);
    } else if (store.scalar_type() == at::kFloat8_e4m3fn) {
        // (index_copy_ has no float8 kernel: the bytes are copied)
        store.view(at::kByte).index_copy_(0, rows, x.clamp(-448, 448).to(store.scalar_type()).view(at::kByte));
    } else {
        store.index_copy_(0, rows, x.to(store.scalar_type()));
    }
}

at::Tensor decode_layer(at::Tensor x, std::optional<at::Tensor> ple, at::Tensor cos, at::Tensor sin,
                        at::Tensor k_store, at::Tensor v_store, std::optional<at::Tensor> rows,
                        at::Tensor key_rows, at::Tensor q_seq, at::Tensor q_lo, at::Tensor q_hi,
                        std::vector<at::Tensor> weights, std::vector<int64_t> dims, double eps,
                        std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale) {
    const bool described = (weights.size() == DENSE_WEIGHTS && dims.size() == DENSE_DIMS)
                           || (weights.size() == DENSE_WEIGHTS + N_MOE_WEIGHTS && dims.size() == DENSE_DIMS + N_MOE_DIMS);
    TORCH_CHECK(described, "decode_layer: weights / dims do not describe a decoder layer");
    const Layer L{weights, dims};
    const int64_t T = x.size(0), nh = dims[N_HEADS], nkv = dims[N_KV_HEADS], d = dims[HEAD_DIM];
    const bool owns_kv = dims[OWNS_KV] != 0, k_eq_v = dims[K_EQ_V] != 0;
    TORCH_CHECK(owns_kv == rows.has_value(), "decode_layer: rows are given exactly when the layer owns its KV");
    kv_kind(k_store, v_store, k_scale, v_scale);                 // checked before anything is written

    // attention block
    const at::Tensor h = rms_norm(x, L.norm(IN_NORM), eps, std::nullopt);
    // k_eq_v layers: V is the raw K projection
    const std::vector<at::Tensor> qkv = L.project(h, !owns_kv ? std::vector<Linear>{Q} : k_eq_v ? std::vector<Linear>{Q, K}
                                                                                                : std::vector<Linear>{Q, K, V});
    const at::Tensor q = rms_norm_rope(qkv[0].view({T, nh, d}), L.norm(Q_NORM), eps, cos, sin);      // [T, nh, d]
    if (owns_kv) {
        const at::Tensor k_raw = qkv[1].view({T, nkv, d});
        const at::Tensor v_raw = k_eq_v ? k_raw : qkv[2].view({T, nkv, d});
        const at::Tensor k = rms_norm_rope(k_raw, L.norm(K_NORM), eps, cos, sin);
        const at::Tensor v = rms_norm(v_raw, std::nullopt, eps, std::nullopt);        // v_norm: no weight, no rope
        write_kv(k_store, k_scale, *rows, k);
        write_kv(v_store, v_scale, *rows, v);
    }
    const at::Tensor attn = attend(q, k_store, v_store, key_rows, q_seq, q_lo, q_hi, k_scale, v_scale);   // [T, nh*d]
    x = rms_norm(L.apply(O, attn), L.norm(POST_ATTN), eps, x);
    // feed-forward block
    const at::Tensor f = rms_norm(x, L.norm(PRE_FFN), eps, std::nullopt);
    at::Tensor m = L.apply(DOWN, L.glu(f));
    if (L.moe()) {                                               // 26B-A4B: dense branch + routed experts
        const auto [idx, routing] = L.route(x, eps);
        const at::Tensor routed = L.experts(rms_norm(x, L.moe_weight(PRE_FFN_2), eps, std::nullopt), idx, routing);
        m = rms_norm(m, L.moe_weight(POST_FFN_1), eps, std::nullopt)
            + rms_norm(routed, L.moe_weight(POST_FFN_2), eps, std::nullopt);
    }
    x = rms_norm(m, L.norm(POST_FFN), eps, x);
    if (ple) {                                                   // E2B/E4B: per-layer input
        const at::Tensor p = gelu_mul(L.apply(PLE_GATE, x), ple->contiguous());
        x = rms_norm(L.apply(PLE_PROJ, p), L.norm(POST_PLE), eps, x);
    }
    return x * L.norm(SCALAR);
}

// The names of decode_layer's weights and dims in order: dense layers' (each linear's dims as "<linear>.<dim>"),
// then what 26B-A4B layers append.
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>, std::vector<std::string>>
decode_layer_schema() {
    std::vector<std::string> weights{NORMS(AS_NAME) LINEARS(AS_NAME)}, dims{DIMS(AS_NAME)};
    for (const char* linear : {LINEARS(AS_NAME)})
        for (const char* dim : {LINEAR_DIMS(AS_NAME)}) dims.push_back(std::string(linear) + "." + dim);
    return {weights, dims, {MOE_WEIGHTS(AS_NAME)}, {MOE_DIMS(AS_NAME)}};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gem4_kernels, m) {
    m.def("decode_layer(Tensor x, Tensor? ple, Tensor cos, Tensor sin, Tensor(a!) k_store, Tensor(b!) v_store, "
          "Tensor? rows, Tensor key_rows, Tensor q_seq, Tensor q_lo, Tensor q_hi, Tensor[] weights, int[] dims, "
          "float eps, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> Tensor", &decode_layer);
    m.def("decode_layer_schema() -> (str[] weights, str[] dims, str[] moe_weights, str[] moe_dims)",
          &decode_layer_schema);
}
