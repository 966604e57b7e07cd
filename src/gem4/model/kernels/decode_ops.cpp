// The small per-token operations of the fast mode, each one call instead of several torch ops.
//
// All math is float32 and follows the reference functions in model/layers.py operation for operation;
// only the order of float additions differs (vector partial sums):
//   rms_norm(x, w?, eps, residual?)       x * (mean(x^2) + eps)^-1/2 [* w] over the last dim [+ residual]
//   rms_norm_rope(x, w, eps, cos, sin)    rms_norm, then NeoX RoPE (pair i, i + d/2) -- q/k norm + rope
//   attend(q, k, v, mask)                 softmax(q k^T) v for a few query rows against a bf16 KV cache
//   gelu_mul(a, b)                        gelu_tanh(a) * b
//   softcap(x, cap)                       cap * tanh(x / cap)
// The decode step calls these ~100 times; as torch ops they were ~1,000 small ops per step.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace gem4_ops {

using namespace gem4_simd;

// 1 / sqrt(mean(x^2) + eps) of one row of D floats.
inline float inv_rms(const float* x, int64_t D, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(live(i, D), x + i);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    return 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(D) + eps);
}

void check_rows(const torch::Tensor& x, const char* what) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() >= 1 && x.size(-1) > 0,
                what, " must be contiguous float32 with a non-empty last dim");
}

// rms_norm(x) [* w] [+ residual]: the residual add after a block's output norm, in the same pass.
torch::Tensor rms_norm(torch::Tensor x, std::optional<torch::Tensor> w, double eps, std::optional<torch::Tensor> residual) {
    check_rows(x, "x");
    const int64_t D = x.size(-1), rows = x.numel() / D;
    const float *wp = nullptr, *rp = nullptr;
    if (w) {
        TORCH_CHECK(w->dtype() == torch::kFloat32 && w->is_contiguous() && w->numel() == D, "w must be float32 [D]");
        wp = w->data_ptr<float>();
    }
    if (residual) {
        TORCH_CHECK(residual->dtype() == torch::kFloat32 && residual->is_contiguous() && residual->sizes() == x.sizes(),
                    "residual must be contiguous float32 of x's shape");
        rp = residual->data_ptr<float>();
    }
    auto out = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / D), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float* xr = xp + r * D;
            float* orow = op + r * D;
            const __m512 s = _mm512_set1_ps(inv_rms(xr, D, static_cast<float>(eps)));
            for (int64_t i = 0; i < D; i += 16) {
                const __mmask16 k = live(i, D);
                __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, xr + i), s);
                if (wp) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(k, wp + i));
                if (rp) v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, rp + r * D + i), v);
                _mm512_mask_storeu_ps(orow + i, k, v);
            }
        }
    });
    return out;
}

// x [T, H, d] -> rms_norm over d with weight w [d], then RoPE with cos/sin [T, d] (both halves filled).
torch::Tensor rms_norm_rope(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor cos, torch::Tensor sin) {
    check_rows(x, "x");
    TORCH_CHECK(x.dim() == 3, "x must be [T, heads, d]");
    const int64_t T = x.size(0), H = x.size(1), d = x.size(2), half = d / 2;
    TORCH_CHECK(d % 2 == 0, "head_dim must be even");
    TORCH_CHECK(w.dtype() == torch::kFloat32 && w.is_contiguous() && w.numel() == d, "w must be float32 [d]");
    for (const auto& t : {cos, sin})
        TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous() && t.numel() == T * d, "cos/sin must be float32 [T, d]");
    auto out = torch::empty_like(x);
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T * H, std::max<int64_t>(1, 65536 / d), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float* xr = xp + r * d;
            const float *c = cp + (r / H) * d, *s = sp + (r / H) * d;
            float* orow = op + r * d;
            const __m512 scale = _mm512_set1_ps(inv_rms(xr, d, static_cast<float>(eps)));
            for (int64_t i = 0; i < half; i += 16) {
                const __mmask16 k = live(i, half);
                auto ld = [k](const float* ptr) { return _mm512_maskz_loadu_ps(k, ptr); };
                const __m512 a = _mm512_mul_ps(_mm512_mul_ps(ld(xr + i), scale), ld(wp + i));
                const __m512 b = _mm512_mul_ps(_mm512_mul_ps(ld(xr + half + i), scale), ld(wp + half + i));
                // out[i] = a cos[i] - b sin[i];  out[i + half] = b cos[i + half] + a sin[i + half]
                _mm512_mask_storeu_ps(orow + i, k, _mm512_sub_ps(_mm512_mul_ps(a, ld(c + i)), _mm512_mul_ps(b, ld(s + i))));
                _mm512_mask_storeu_ps(orow + half + i, k, _mm512_add_ps(_mm512_mul_ps(b, ld(c + half + i)), _mm512_mul_ps(a, ld(s + half + i))));
            }
        }
    });
    return out;
}

torch::Tensor gelu_mul(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.dtype() == torch::kFloat32 && b.dtype() == torch::kFloat32 && a.is_contiguous() && b.is_contiguous()
                && a.sizes() == b.sizes(), "a, b must be contiguous float32 of one shape");
    auto out = torch::empty_like(a);
    const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t n = a.numel();
    at::parallel_for(0, (n + 15) / 16, 4096, [&](int64_t c0, int64_t c1) {
        for (int64_t i = c0 * 16; i < std::min(n, c1 * 16); i += 16) {
            const __mmask16 k = live(i, n);
            _mm512_mask_storeu_ps(op + i, k, _mm512_mul_ps(gelu_tanh_ps(_mm512_maskz_loadu_ps(k, ap + i)), _mm512_maskz_loadu_ps(k, bp + i)));
        }
    });
    return out;
}

torch::Tensor softcap(torch::Tensor x, double cap) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous(), "x must be contiguous float32");
    TORCH_CHECK(cap > 0, "cap must be positive");
    auto out = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t n = x.numel();
    const __m512 c = _mm512_set1_ps(static_cast<float>(cap));
    at::parallel_for(0, (n + 15) / 16, 4096, [&](int64_t c0, int64_t c1) {
        for (int64_t i = c0 * 16; i < std::min(n, c1 * 16); i += 16) {
            const __mmask16 k = live(i, n);
            _mm512_mask_storeu_ps(op + i, k, _mm512_mul_ps(c, tanh_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(k, xp + i), c))));
        }
    });
    return out;
}

// The inputs of attend / attend_chunk: q [T, nh, d] float32, k / v [S, nkv, d] bf16, mask [T, S] bool.
void check_attention_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& mask) {
    TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3, "q must be contiguous float32 [T, heads, d]");
    TORCH_CHECK(k.dtype() == torch::kBFloat16 && v.dtype() == torch::kBFloat16 && k.is_contiguous() && v.is_contiguous()
                && k.dim() == 3 && k.sizes() == v.sizes(), "k, v must be contiguous bf16 [S, kv_heads, d] of one shape");
    const int64_t T = q.size(0), nh = q.size(1), d = q.size(2), S = k.size(0), nkv = k.size(1);
    TORCH_CHECK(k.size(2) == d && d % 16 == 0 && nkv > 0 && nh % nkv == 0, "head shapes do not match");
    TORCH_CHECK(mask.dtype() == torch::kBool && mask.is_contiguous() && mask.dim() == 2 && mask.size(0) == T && mask.size(1) == S,
                "mask must be contiguous bool [T, S]");
}

constexpr int HB = 8;              // query heads handled together: each K / V row is converted once per HB heads
constexpr int64_t MIN_SPLIT = 64;  // fewest key rows per task when the keys are split across threads

// One task of attend(): query row t, KV head kvh, the n visible key rows `rows`. Writes the unnormalised
// partial result for each of the g query heads of kvh: max score m, sum of exponentials l, sum_s p_s v_s.
void attend_part(const float* q, const uint16_t* k, const uint16_t* v, const int64_t* rows, int64_t n, int64_t t,
                 int64_t kvh, int64_t nh, int64_t nkv, int64_t d, float* m_out, float* l_out, float* acc_out) {
    const int64_t g = nh / nkv;
    std::vector<float> p(static_cast<size_t>(HB * std::max<int64_t>(n, 1)));
    for (int64_t h0 = 0; h0 < g; h0 += HB) {
        const int hb = static_cast<int>(std::min<int64_t>(HB, g - h0));
        const float* qh = q + (t * nh + kvh * g + h0) * d;          // hb consecutive query heads
        // scores p[j][i] = q_j . k_{rows[i]}
        for (int64_t i = 0; i < n; ++i) {
            const uint16_t* kr = k + (rows[i] * nkv + kvh) * d;
            __m512 dot[HB];
            for (int j = 0; j < hb; ++j) dot[j] = _mm512_setzero_ps();
            for (int64_t c = 0; c < d; c += 16) {
                const __m512 kv = load_bf16(kr + c);
                for (int j = 0; j < hb; ++j) dot[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + j * d + c), kv, dot[j]);
            }
            for (int j = 0; j < hb; ++j) p[j * n + i] = _mm512_reduce_add_ps(dot[j]);
        }
        // p <- exp(p - max), l = sum p
        for (int j = 0; j < hb; ++j) {
            float* pj = p.data() + j * n;
            float mx = -INFINITY;
            for (int64_t i = 0; i < n; ++i) mx = std::max(mx, pj[i]);
            __m512 lv = _mm512_setzero_ps();
            for (int64_t i = 0; i < n; i += 16) {
                const __mmask16 k = live(i, n);
                const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, pj + i), _mm512_set1_ps(mx)));
                _mm512_mask_storeu_ps(pj + i, k, e);
                lv = _mm512_add_ps(lv, _mm512_maskz_mov_ps(k, e));
            }
            m_out[h0 + j] = mx;
            l_out[h0 + j] = _mm512_reduce_add_ps(lv);
        }
        // acc_j = sum_i p[j][i] v_{rows[i]}
        for (int64_t c = 0; c < d; c += 16) {
            __m512 acc[HB];
            for (int j = 0; j < hb; ++j) acc[j] = _mm512_setzero_ps();
            for (int64_t i = 0; i < n; ++i) {
                const __m512 vv = load_bf16(v + (rows[i] * nkv + kvh) * d + c);
                for (int j = 0; j < hb; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * n + i]), vv, acc[j]);
            }
            for (int j = 0; j < hb; ++j) _mm512_storeu_ps(acc_out + (h0 + j) * d + c, acc[j]);
        }
    }
}

// q [T, nh, d] float32, k / v [S, nkv, d] bf16, mask [T, S] bool (true = may attend) -> [T, nh * d] float32.
// Scale 1.0 (Gemma 4 normalises q and k). Each query row's visible keys are split into equal parts across
// threads; each part keeps its own max and sum, and the parts are merged as one softmax would weigh them.
// A query row that sees no key gets zeros.
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask) {
    check_attention_inputs(q, k, v, mask);
    const int64_t T = q.size(0), nh = q.size(1), d = q.size(2), S = k.size(0), nkv = k.size(1);
    const int64_t g = nh / nkv;
    // visible key rows of each query row
    const bool* mp = mask.data_ptr<bool>();
    std::vector<int64_t> rows(T * S), count(T, 0);
    int64_t most = 0;
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t s = 0; s < S; ++s)
            if (mp[t * S + s]) rows[t * S + count[t]++] = s;
        most = std::max(most, count[t]);
    }
    const int64_t threads = at::get_num_threads();
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>((most + MIN_SPLIT - 1) / MIN_SPLIT,
                                                                 (2 * threads + T * nkv - 1) / (T * nkv)));
    // per (t, kvh, part): g maxima, g sums, g x d partial outputs
    std::vector<float> m(T * nkv * parts * g), l(T * nkv * parts * g), acc(T * nkv * parts * g * d);
    const float* qp = q.data_ptr<float>();
    const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
    const uint16_t* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
    at::parallel_for(0, T * nkv * parts, 1, [&](int64_t a, int64_t b) {
        for (int64_t task = a; task < b; ++task) {
            const int64_t t = task / (nkv * parts), kvh = (task / parts) % nkv, part = task % parts;
            const int64_t span = (count[t] + parts - 1) / parts;
            const int64_t i0 = std::min(count[t], part * span), i1 = std::min(count[t], i0 + span);
            attend_part(qp, kp, vp, rows.data() + t * S + i0, i1 - i0, t, kvh, nh, nkv, d,
                        m.data() + task * g, l.data() + task * g, acc.data() + task * g * d);
        }
    });
    auto out = torch::empty({T, nh * d}, q.options());
    float* op = out.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
        for (int64_t kvh = 0; kvh < nkv; ++kvh)
            for (int64_t j = 0; j < g; ++j) {
                const int64_t first = (t * nkv + kvh) * parts;
                float mx = -INFINITY;
                for (int64_t pt = 0; pt < parts; ++pt)
                    if (l[(first + pt) * g + j] > 0) mx = std::max(mx, m[(first + pt) * g + j]);
                float* o = op + (t * nh + kvh * g + j) * d;
                std::fill(o, o + d, 0.0f);
                float total = 0.0f;
                for (int64_t pt = 0; pt < parts; ++pt) {
                    const int64_t at = (first + pt) * g + j;
                    if (l[at] == 0) continue;                                   // a part with no visible keys
                    const float w = std::exp(m[at] - mx);
                    total += w * l[at];
                    const float* src = acc.data() + at * d;
                    for (int64_t c = 0; c < d; ++c) o[c] += w * src[c];
                }
                const float inv = total > 0 ? 1.0f / total : 0.0f;
                for (int64_t c = 0; c < d; ++c) o[c] *= inv;
            }
    return out;
}

}  // namespace gem4_ops

using namespace gem4_ops;

TORCH_LIBRARY_FRAGMENT(gem4_kernels, m) {
    m.def("rms_norm(Tensor x, Tensor? w, float eps, Tensor? residual=None) -> Tensor", &rms_norm);
    m.def("rms_norm_rope(Tensor x, Tensor w, float eps, Tensor cos, Tensor sin) -> Tensor", &rms_norm_rope);
    m.def("attend(Tensor q, Tensor k, Tensor v, Tensor mask) -> Tensor", &attend);
    m.def("gelu_mul(Tensor a, Tensor b) -> Tensor", &gelu_mul);
    m.def("softcap(Tensor x, float cap) -> Tensor", &softcap);
}
