// The small per-token operations of the fast mode, each one call instead of several torch ops.
//
// All math is float32 and follows the reference functions in model/layers.py operation for operation;
// only the order of float additions differs (vector partial sums):
//   rms_norm(x, w?, eps, residual?)       x * (mean(x^2) + eps)^-1/2 [* w] over the last dim [+ residual]
//   rms_norm_rope(x, w, eps, cos, sin)    rms_norm, then NeoX RoPE (pair i, i + d/2) -- q/k norm + rope
//   attend(q, k_store, v_store, key_rows, q_seq, q_lo, q_hi, k_scale?, v_scale?)   softmax(q k^T) v for a few
//                                         query rows of several sequences against the KV storage as stored
//                                         (bf16, fp8_e4m3, or int8 with a float32 scale per row)
//   gelu_mul(a, b)                        gelu_tanh(a) * b
//   softcap(x, cap)                       cap * tanh(x / cap)
// The decode step calls these ~100 times; as torch ops they were ~1,000 small ops per step.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
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

void check_rows(const at::Tensor& x, const char* what) {
    TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() >= 1 && x.size(-1) > 0,
                what, " must be contiguous float32 with a non-empty last dim");
}

// rms_norm(x) [* w] [+ residual]: the residual add after a block's output norm, in the same pass.
at::Tensor rms_norm(at::Tensor x, std::optional<at::Tensor> w, double eps, std::optional<at::Tensor> residual) {
    check_rows(x, "x");
    const int64_t D = x.size(-1), rows = x.numel() / D;
    const float *wp = nullptr, *rp = nullptr;
    if (w) {
        TORCH_CHECK(w->dtype() == at::kFloat && w->is_contiguous() && w->numel() == D, "w must be float32 [D]");
        wp = w->data_ptr<float>();
    }
    if (residual) {
        TORCH_CHECK(residual->dtype() == at::kFloat && residual->is_contiguous() && residual->sizes() == x.sizes(),
                    "residual must be contiguous float32 of x's shape");
        rp = residual->data_ptr<float>();
    }
    auto out = at::empty_like(x);
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
at::Tensor rms_norm_rope(at::Tensor x, at::Tensor w, double eps, at::Tensor cos, at::Tensor sin) {
    check_rows(x, "x");
    TORCH_CHECK(x.dim() == 3, "x must be [T, heads, d]");
    const int64_t T = x.size(0), H = x.size(1), d = x.size(2), half = d / 2;
    TORCH_CHECK(d % 2 == 0, "head_dim must be even");
    TORCH_CHECK(w.dtype() == at::kFloat && w.is_contiguous() && w.numel() == d, "w must be float32 [d]");
    for (const auto& t : {cos, sin})
        TORCH_CHECK(t.dtype() == at::kFloat && t.is_contiguous() && t.numel() == T * d, "cos/sin must be float32 [T, d]");
    auto out = at::empty_like(x);
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

at::Tensor gelu_mul(at::Tensor a, at::Tensor b) {
    TORCH_CHECK(a.dtype() == at::kFloat && b.dtype() == at::kFloat && a.is_contiguous() && b.is_contiguous()
                && a.sizes() == b.sizes(), "a, b must be contiguous float32 of one shape");
    auto out = at::empty_like(a);
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

at::Tensor softcap(at::Tensor x, double cap) {
    TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous(), "x must be contiguous float32");
    TORCH_CHECK(cap > 0, "cap must be positive");
    auto out = at::empty_like(x);
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

// The KV storage's dtypes (KvKind, ops.h), read 16 values at a time as float32 by load_kv:
//   KV_BF16  exact
//   KV_INT8  value = q * scale[row]: load_kv gives q; the scale multiplies the row's score (K) and its
//            probability (V), once per row
//   KV_FP8   load_kv gives value * 2^-8, exactly (e4m3 bits moved into a half float, whose exponent bias is 8
//            more; subnormals included), and 2^8 (FP8_UNIT) takes the scale's place
constexpr float FP8_UNIT = 256.0f;

template <int KIND>
inline __m512 load_kv(const uint8_t* row, int64_t c) {
    if constexpr (KIND == KV_BF16) {
        return load_bf16(reinterpret_cast<const uint16_t*>(row) + c);
    } else if constexpr (KIND == KV_INT8) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c))));
    } else {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
        const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
        const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
        return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
    }
}

// The kind of a KV storage pair, checked: k and v of one dtype, int8 with float32 scales [rows, nkv] (and only int8).
int kv_kind(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& k_scale,
            const std::optional<at::Tensor>& v_scale) {
    const auto t = k.scalar_type();
    TORCH_CHECK(v.scalar_type() == t && (t == at::kBFloat16 || t == at::kChar || t == at::kFloat8_e4m3fn),
                "k and v must both be bf16, int8 or float8_e4m3fn, got ", k.scalar_type(), " and ", v.scalar_type());
    const bool scaled = t == at::kChar;
    TORCH_CHECK(k_scale.has_value() == scaled && v_scale.has_value() == scaled,
                scaled ? "an int8 KV storage needs k_scale and v_scale" : "only an int8 KV storage has scales");
    if (scaled)
        for (const at::Tensor* s : {&*k_scale, &*v_scale})
            TORCH_CHECK(s->dtype() == at::kFloat && s->is_contiguous() && s->dim() == 2 && s->size(0) == k.size(0)
                        && s->size(1) == k.size(1), "k_scale, v_scale must be contiguous float32 [rows, kv_heads]");
    return scaled ? KV_INT8 : t == at::kBFloat16 ? KV_BF16 : KV_FP8;
}

constexpr int HB = 8;              // query heads handled together: each K / V row is converted once per HB heads
static_assert(HB == 8, "with_count dispatches the head counts 1..8");
constexpr int64_t MIN_SPLIT = 64;  // fewest key rows per task when the keys are split across threads

// HBN (a compile-time count, so that the per-head accumulators stay in registers: with a run-time count
// GCC kept them on the stack, reloaded around every multiply) consecutive query heads qh [HBN, d] over the n
// key rows `rows` of KV head kvh: max score m, sum of exponentials l, sum_s p_s v_s per head. p: HBN * n floats.
// k / v: the storage's bytes (elements of KIND); ks / vs: int8's scales [R, nkv] (else null).
template <int HBN, int KIND>
void attend_heads(const float* qh, const uint8_t* k, const uint8_t* v, const float* ks, const float* vs,
                  const int64_t* rows, int64_t n, int64_t kvh, int64_t nkv, int64_t d, float* p, float* m_out,
                  float* l_out, float* acc_out) {
    constexpr int64_t bytes = KIND == KV_BF16 ? 2 : 1;
    // scores p[j][i] = q_j . k_{rows[i]}
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t* kr = k + (rows[i] * nkv + kvh) * d * bytes;
        __m512 dot[HBN];
        for (int j = 0; j < HBN; ++j) dot[j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; c += 16) {
            const __m512 kv = load_kv<KIND>(kr, c);
            for (int j = 0; j < HBN; ++j) dot[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + j * d + c), kv, dot[j]);
        }
        if constexpr (KIND == KV_BF16) {
            for (int j = 0; j < HBN; ++j) p[j * n + i] = _mm512_reduce_add_ps(dot[j]);
        } else {
            const float scale = KIND == KV_INT8 ? ks[rows[i] * nkv + kvh] : FP8_UNIT;
            for (int j = 0; j < HBN; ++j) p[j * n + i] = _mm512_reduce_add_ps(dot[j]) * scale;
        }
    }
    // p <- exp(p - max), l = sum p
    for (int j = 0; j < HBN; ++j) {
        float* pj = p + j * n;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, pj[i]);
        __m512 lv = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 km = live(i, n);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(km, pj + i), _mm512_set1_ps(mx)));
            _mm512_mask_storeu_ps(pj + i, km, e);
            lv = _mm512_add_ps(lv, _mm512_maskz_mov_ps(km, e));
        }
        m_out[j] = mx;
        l_out[j] = _mm512_reduce_add_ps(lv);
    }
    if constexpr (KIND != KV_BF16)                       // 8-bit V: each row's scale into its probabilities
        for (int64_t i = 0; i < n; ++i) {
            const float scale = KIND == KV_INT8 ? vs[rows[i] * nkv + kvh] : FP8_UNIT;
            for (int j = 0; j < HBN; ++j) p[j * n + i] *= scale;
        }
    // acc_j = sum_i p[j][i] v_{rows[i]}
    for (int64_t c = 0; c < d; c += 16) {
        __m512 acc[HBN];
        for (int j = 0; j < HBN; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; ++i) {
            const __m512 vv = load_kv<KIND>(v + (rows[i] * nkv + kvh) * d * bytes, c);
            for (int j = 0; j < HBN; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * n + i]), vv, acc[j]);
        }
        for (int j = 0; j < HBN; ++j) _mm512_storeu_ps(acc_out + j * d + c, acc[j]);
    }
}

// One task of attend(): query row t, KV head kvh, the n visible key rows `rows`. Writes the unnormalised
// partial result for each of the g query heads of kvh: max score m, sum of exponentials l, sum_s p_s v_s.
template <int KIND>
void attend_part(const float* q, const uint8_t* k, const uint8_t* v, const float* ks, const float* vs,
                 const int64_t* rows, int64_t n, int64_t t, int64_t kvh, int64_t nh, int64_t nkv, int64_t d,
                 float* m_out, float* l_out, float* acc_out) {
    const int64_t g = nh / nkv;
    std::vector<float> p(static_cast<size_t>(HB * std::max<int64_t>(n, 1)));
    for (int64_t h0 = 0; h0 < g; h0 += HB) {
        const float* qh = q + (t * nh + kvh * g + h0) * d;          // up to HB consecutive query heads
        const auto heads = [&](auto count) {
            attend_heads<decltype(count)::value, KIND>(qh, k, v, ks, vs, rows, n, kvh, nkv, d, p.data(), m_out + h0,
                                                       l_out + h0, acc_out + h0 * d);
        };
        with_count(std::min<int64_t>(HB, g - h0), heads);
    }
}

// q [T, nh, d] float32; k_store / v_store [R, nkv, d] bf16, fp8_e4m3 or int8 with k_scale / v_scale [R, nkv]
// float32 (a layer's KV storage: every sequence's rows, kv_cache.LayerKV; load_kv);
// key_rows [B, S] int64: sequence b's keys as storage rows, in position order; query row t belongs to
// sequence q_seq[t] and sees key_rows[q_seq[t], q_lo[t] : q_hi[t]] -> [T, nh * d] float32 (kv_cache.Attend).
// Scale 1.0 (Gemma 4 normalises q and k). A query row's keys are split into parts across threads, each part
// keeping its own max and sum, merged as one softmax would weigh them. The number of parts depends only on
// the row's own key count and the thread count, so a row's result never depends on the other rows of the
// step (batch invariance). A query row that sees no key gets zeros.
at::Tensor attend(at::Tensor q, at::Tensor k_store, at::Tensor v_store, at::Tensor key_rows,
                  at::Tensor q_seq, at::Tensor q_lo, at::Tensor q_hi, std::optional<at::Tensor> k_scale,
                  std::optional<at::Tensor> v_scale) {
    TORCH_CHECK(q.dtype() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q must be contiguous float32 [T, heads, d]");
    TORCH_CHECK(k_store.is_contiguous() && v_store.is_contiguous() && k_store.dim() == 3 && k_store.sizes() == v_store.sizes(),
                "k_store, v_store must be contiguous bf16 / int8 / fp8 [R, kv_heads, d] of one shape");
    const int kind = kv_kind(k_store, v_store, k_scale, v_scale);
    const int64_t T = q.size(0), nh = q.size(1), d = q.size(2), R = k_store.size(0), nkv = k_store.size(1);
    TORCH_CHECK(k_store.size(2) == d && d % 16 == 0 && nkv > 0 && nh % nkv == 0, "head shapes do not match");
    TORCH_CHECK(key_rows.dtype() == at::kLong && key_rows.is_contiguous() && key_rows.dim() == 2,
                "key_rows must be contiguous int64 [B, S]");
    for (const at::Tensor* t : {&q_seq, &q_lo, &q_hi})
        TORCH_CHECK(t->dtype() == at::kLong && t->is_contiguous() && t->dim() == 1 && t->size(0) == T,
                    "q_seq, q_lo, q_hi must be contiguous int64 [T]");
    const int64_t B = key_rows.size(0), S = key_rows.size(1), g = nh / nkv;
    const int64_t* kr = key_rows.data_ptr<int64_t>();
    const int64_t *seq = q_seq.data_ptr<int64_t>(), *lo = q_lo.data_ptr<int64_t>(), *hi = q_hi.data_ptr<int64_t>();
    const int64_t threads = at::get_num_threads();
    const int64_t max_parts = std::max<int64_t>(1, (2 * threads + nkv - 1) / nkv);
    // per query row: its first key (a pointer into key_rows), its count, its parts, its first task
    std::vector<int64_t> count(T), parts(T), first_task(T + 1, 0);
    for (int64_t t = 0; t < T; ++t) {
        TORCH_CHECK(0 <= seq[t] && seq[t] < B && 0 <= lo[t] && lo[t] <= hi[t] && hi[t] <= S,
                    "attend: query row ", t, " has keys [", lo[t], ", ", hi[t], ") of sequence ", seq[t], " outside key_rows");
        count[t] = hi[t] - lo[t];
        const int64_t* rows = kr + seq[t] * S + lo[t];
        for (int64_t i = 0; i < count[t]; ++i) TORCH_CHECK(0 <= rows[i] && rows[i] < R, "attend: key row outside the storage");
        parts[t] = std::max<int64_t>(1, std::min<int64_t>((count[t] + MIN_SPLIT - 1) / MIN_SPLIT, max_parts));
        first_task[t + 1] = first_task[t] + nkv * parts[t];
    }
    const int64_t tasks = first_task[T];
    // per task (t, kvh, part): g maxima, g sums, g x d partial outputs
    std::vector<float> m(tasks * g), l(tasks * g), acc(tasks * g * d);
    std::vector<int64_t> task_row(tasks);
    for (int64_t t = 0; t < T; ++t) std::fill(task_row.begin() + first_task[t], task_row.begin() + first_task[t + 1], t);
    const float* qp = q.data_ptr<float>();
    const uint8_t* kp = static_cast<const uint8_t*>(k_store.data_ptr());
    const uint8_t* vp = static_cast<const uint8_t*>(v_store.data_ptr());
    const float* ks = k_scale ? k_scale->data_ptr<float>() : nullptr;
    const float* vs = v_scale ? v_scale->data_ptr<float>() : nullptr;
    at::parallel_for(0, tasks, 1, [&](int64_t a, int64_t b) {
        for (int64_t task = a; task < b; ++task) {
            const int64_t t = task_row[task], local = task - first_task[t];
            const int64_t kvh = local / parts[t], part = local % parts[t];
            const int64_t span = (count[t] + parts[t] - 1) / parts[t];
            const int64_t i0 = std::min(count[t], part * span), i1 = std::min(count[t], i0 + span);
            const int64_t* rows = kr + seq[t] * S + lo[t] + i0;
            float *mt = m.data() + task * g, *lt = l.data() + task * g, *ot = acc.data() + task * g * d;
            if (kind == KV_BF16) attend_part<KV_BF16>(qp, kp, vp, ks, vs, rows, i1 - i0, t, kvh, nh, nkv, d, mt, lt, ot);
            else if (kind == KV_INT8) attend_part<KV_INT8>(qp, kp, vp, ks, vs, rows, i1 - i0, t, kvh, nh, nkv, d, mt, lt, ot);
            else attend_part<KV_FP8>(qp, kp, vp, ks, vs, rows, i1 - i0, t, kvh, nh, nkv, d, mt, lt, ot);
        }
    });
    auto out = at::empty({T, nh * d}, q.options());
    float* op = out.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
        for (int64_t kvh = 0; kvh < nkv; ++kvh)
            for (int64_t j = 0; j < g; ++j) {
                const int64_t first = first_task[t] + kvh * parts[t];
                float mx = -INFINITY;
                for (int64_t pt = 0; pt < parts[t]; ++pt)
                    if (l[(first + pt) * g + j] > 0) mx = std::max(mx, m[(first + pt) * g + j]);
                float* o = op + (t * nh + kvh * g + j) * d;
                std::fill(o, o + d, 0.0f);
                float total = 0.0f;
                for (int64_t pt = 0; pt < parts[t]; ++pt) {
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
    m.def("attend(Tensor q, Tensor k_store, Tensor v_store, Tensor key_rows, Tensor q_seq, Tensor q_lo, Tensor q_hi, "
          "Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor", &attend);
    m.def("gelu_mul(Tensor a, Tensor b) -> Tensor", &gelu_mul);
    m.def("softcap(Tensor x, float cap) -> Tensor", &softcap);
}
