"""Fast path: packed GGML kernels against dequantize + float matmul, and the fast mode against float32."""
from __future__ import annotations

import pytest
import torch

import gem4
from gem4.model import cpu, kernels
from gem4.model.cpu import DECODE_ROWS, DECODE_ROWS_BF16, KernelExperts, PackedLinear
from gem4.model.kernels import build
from gem4.model.layers import QuantLinear
from gem4.ggml import GGMLType, dequantize, quantize
from model_fixtures import VARIANTS

PACKED = [GGMLType.Q8_0, GGMLType.Q4_0]


def test_kernels_build_on_this_machine():
    # CI machines have AVX-512: the fast path must be the one under test, not a silent fallback
    assert kernels.available()


def test_kernels_know_the_ggml_types_as_python_does():
    """ggml_types.h (the type ids and blocks every kernel source uses) against gem4.ggml: a change on one side
    fails here. Every type the kernels read is in it."""
    from gem4.ggml import BLOCK_INFO
    known = kernels.ggml_types()
    assert {GGMLType[name] for name in known} >= set(kernels.PACKED_TYPES) | {GGMLType.BF16}
    for name, (type_id, block_size, type_size) in known.items():
        assert GGMLType[name] == type_id, name
        assert (BLOCK_INFO[GGMLType[name]].block_size, BLOCK_INFO[GGMLType[name]].type_size) == (block_size, type_size), name


def packed_linear(weight: torch.Tensor, ggml_type: GGMLType) -> tuple[PackedLinear, torch.Tensor]:
    out_f, in_f = weight.shape
    raw = quantize(weight, ggml_type)
    layer = PackedLinear(in_f, out_f)
    layer.pack(raw, ggml_type)
    return layer, dequantize(raw, ggml_type, (out_f, in_f))


def panel_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] as the Q8_0 / Q4_0 GEMV takes it, emulated in float32 as the kernel computes it: per 32-block
    scale = amax / 127, q = round-half-even(x * (1 / scale)) -> (q * scale, scale / 2 per element: the most
    a value moves)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inv)
    assert q.abs().max() <= 127
    return (q * scale).reshape(x.shape), (scale / 2).expand_as(blocks).reshape(x.shape)


def assert_panel_product(out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor):
    """out = the panel GEMV of x [M, K] by W = dense [N, K]: the product of x's int8 blocks (panel_activations)
    up to float32 sums, and so within the rounding of x's blocks of x @ W.T."""
    xq, half_step = panel_activations(x)
    ref = xq.double() @ dense.double().T
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    bound = half_step.double() @ dense.double().abs().T          # sum_k |w_k| * (x_k's most rounding)
    assert ((out.double() - x.double() @ dense.double().T).abs() <= bound * 1.001 + 1e-5 * ref.abs().max()).all()


@pytest.mark.parametrize("ggml_type", PACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_gemv_equals_dequantize_then_matmul(ggml_type, rows):
    g = torch.Generator().manual_seed(rows)
    layer, dense = packed_linear(torch.randn(200, 96, generator=g), ggml_type)
    x = torch.randn(rows, 96, generator=g)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 200)
    assert_panel_product(out, x, dense)          # activations quantized per 32-block to int8, as GGML's Q8_0


@pytest.mark.parametrize("ggml_type", PACKED, ids=lambda t: t.name)
def test_long_inputs_take_one_bf16_gemm(ggml_type):
    g = torch.Generator().manual_seed(3)
    layer, dense = packed_linear(torch.randn(64, 128, generator=g), ggml_type)
    x = torch.randn(2, 20, 128, generator=g)                              # 40 rows > DECODE_ROWS, batched shape
    ref = torch.nn.functional.linear(x.bfloat16(), dense.bfloat16()).float()
    torch.testing.assert_close(layer(x), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(layer(x), x @ dense.T, rtol=0.05, atol=0.05 * ref.abs().max().item())


@pytest.mark.parametrize("ggml_type", PACKED, ids=lambda t: t.name)
def test_prefill_gemm_over_several_weight_tiles(ggml_type):
    # prefill turns W into bf16 32 rows at a time, ~1 MB per thread at a time: with 65536 inputs one block of 32
    # rows, so these 80 rows take three blocks, the last one partial
    g = torch.Generator().manual_seed(12)
    layer, dense = packed_linear(torch.randn(80, 65536, generator=g), ggml_type)
    x = torch.randn(DECODE_ROWS + 1, 65536, generator=g)                  # just past the GEMV's rows
    ref = torch.nn.functional.linear(x.bfloat16(), dense.bfloat16()).float()
    torch.testing.assert_close(layer(x), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.BF16], ids=lambda t: t.name)
def test_prefill_gemm_rows_do_not_depend_on_their_batch_mates(ggml_type):
    """kernels.linear / linear_bf16 (a prefill pass's products) are row-invariant: a row's result is the same
    float whatever the number of rows beside it and its place among them -- on AMX tiles and on vdpbf16ps (each
    kernel with itself) -- and equals the bf16 product. 2100 rows of W: several of the ~1 MB groups a thread
    takes at a time, a last block of 20 rows (Q4_0: of 16, a block of 32 rows with one panel of 16)."""
    g = torch.Generator().manual_seed(21)
    n, k = 2100 if ggml_type != GGMLType.Q4_0 else 2096, 256
    weight = torch.randn(n, k, generator=g)
    if ggml_type == GGMLType.BF16:
        w = weight.bfloat16()
        product, dense = (lambda x: kernels.linear_bf16(x, w)), w.float()
    else:
        layer, dense = packed_linear(weight, ggml_type)
        product = lambda x: kernels.linear(x, layer.packed, n, k, ggml_type)   # noqa: E731
    x = torch.randn(40, k, generator=g)
    was = kernels.set_amx()
    try:
        for amx in (False, True):
            kernels.set_amx(amx)
            together = product(x)
            ref = x.bfloat16().float() @ dense.bfloat16().float().T
            torch.testing.assert_close(together, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            for m in (1, 7, 16, 17, 33):
                for start in (0, 40 - m):
                    assert torch.equal(product(x[start:start + m]), together[start:start + m]), (amx, m, start)
    finally:
        kernels.set_amx(was)


def test_rows_of_a_packed_table_are_exact():
    g = torch.Generator().manual_seed(4)
    layer, dense = packed_linear(torch.randn(50, 64, generator=g), GGMLType.Q4_0)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(layer.rows(ids), dense[ids])


def test_a_table_kept_in_blocks_is_read_by_rows_only():
    g = torch.Generator().manual_seed(9)
    raw = quantize(torch.randn(30, 64, generator=g), GGMLType.Q4_0)
    table = QuantLinear(64, 30)
    table.keep_blocks(raw, GGMLType.Q4_0)
    ids = torch.tensor([29, 0, 7])
    assert table.layout == "blocks"
    assert torch.equal(table.rows(ids), dequantize(raw, GGMLType.Q4_0, (30, 64))[ids])
    with pytest.raises(RuntimeError, match="lookup table"):
        table(torch.randn(1, 64))


@pytest.mark.parametrize("ggml_type", PACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("k_in", [32, 512, 544, 1536])
def test_repacked_layout_round_trips_every_row_length(ggml_type, k_in):
    # 1, 16, 17 and 48 blocks per row: a partial last group, exactly one group, one block over, several
    g = torch.Generator().manual_seed(k_in)
    layer, dense = packed_linear(torch.randn(24, k_in, generator=g), ggml_type)
    assert layer.layout == "packed"
    if ggml_type in kernels.PANEL_TYPES:   # 16-row panels, cache-line aligned; the last one padded with zero rows
        assert layer.packed.shape[0] == 32 and layer.packed.shape[1] * 16 % 64 == 0
    else:                                  # cache-line aligned rows
        assert layer.packed.shape[0] == 24 and layer.packed.shape[1] % 64 == 0
    rows = kernels.dequant(layer.packed, k_in, ggml_type, torch.float32)
    assert torch.equal(rows[:24], dense) and not rows[24:].any()
    assert torch.equal(kernels.dequant(layer.packed, k_in, ggml_type, torch.bfloat16)[:24], dense.bfloat16())
    ids = torch.tensor([23, 0, 17, 5, 17])
    assert torch.equal(kernels.dequant(layer.packed, k_in, ggml_type, torch.float32, rows=ids), dense[ids])
    x = torch.randn(3, k_in, generator=g)
    assert_panel_product(layer(x), x, dense)


def nmse(out, ref):
    return float(((out - ref) ** 2).mean() / (ref ** 2).mean())


def decode_logits(model, ids, n_prompt):
    """Logits for ids[n_prompt:] fed one token at a time after a prefill of ids[:n_prompt] (the decode path)."""
    cache = model.new_cache()
    model.extend(torch.tensor(ids[:n_prompt]), cache)
    return torch.cat([model.extend(torch.tensor([t]), cache) for t in ids[n_prompt:]])


def greedy(model, ids, n):
    cache = model.new_cache()
    logits = model.extend(torch.tensor(ids), cache)
    out = []
    for _ in range(n):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        logits = model.extend(torch.tensor([nxt]), cache)
    return out


NEAR_TIE = 0.05          # top-2 logit margin (logit std ~0.5-1 on these models) under which a greedy flip is rounding


def first_difference_is_a_near_tie(ref_model, ids, fast: list[int], ref: list[int], margin: float = NEAR_TIE) -> bool:
    """Greedy tokens of the fast mode vs the float32 path after the prompt ids: equal, or where they first part,
    the token the fast mode chose is within `margin` of the float32 path's best logit there."""
    i = next((i for i, (a, b) in enumerate(zip(fast, ref)) if a != b), None)
    if i is None:
        return True
    logits = ref_model.logits(list(ids) + ref[:i])[-1]
    return float(logits[ref[i]] - logits[fast[i]]) <= margin


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "bf16"])
def test_fast_mode_tracks_the_float32_path(variants, qtype):
    # The same GGUF: float32 reference (dequantized, float32 activations) vs the fast mode (packed
    # kernels; bf16 KV cache and bf16 prefill GEMM). NMSE is asserted per variant, for prefill and decode:
    # 1e-3, but 4e-3 for Q8_0 / Q4_0 decode, whose GEMV quantizes x per 32-block to int8 (GGML's Q8_0
    # activations; measured 0.7-1.9e-3 here, 4-9e-5 when x was int16; MoE's median position 3.3-3.9e-3,
    # bound 8e-3); a wrong product costs ~1.
    # Greedy output over 32 tokens: these random models have flat logits (top-2 margins ~0.01), so the bf16 KV
    # cache and the prompt's bf16 activations flip near-ties: on every variant the two must agree up to a
    # near-tie (the fast mode's token within 0.05 of the float32 path's best logit where they first part), and
    # along the float32 path every decisive token must be the fast mode's too. (How many whole runs agree depends
    # on the host: the AMX and vdpbf16ps prefill GEMMs round differently; it is printed, not asserted.)
    same_greedy = {}
    for name in VARIANTS:
        path = variants[name].gguf[qtype] if qtype != "bf16" else variants[name].hf_causal   # bf16: as stored
        ref_model, fast_model = gem4.load(path, dtype="float32"), gem4.load(path, dtype="bfloat16")
        assert fast_model.layers[0].mlp.up_proj.gemv_type == GGMLType[qtype.upper()]      # what the GEMV reads
        if name == "moe" and qtype != "bf16":                                              # experts packed too
            assert set(fast_model.layers[0].experts.packed_types.values()) == {GGMLType[qtype.upper()]}
        ids = variants[name].ids
        ref_logits = ref_model.logits(ids)
        drift = nmse(fast_model.logits(ids), ref_logits)       # a prefill pass: the bf16 GEMM, chunk attention
        # the decode path (GEMV kernels, fused Q/K/V and gate/up, decode attention) on the same positions
        decoded = decode_logits(fast_model, ids, 30)
        decode_drift = nmse(decoded, ref_logits[30:])
        per_position = sorted(nmse(d, r) for d, r in zip(decoded, ref_logits[30:]))
        fast_tokens, ref_tokens = greedy(fast_model, ids[:20], 32), greedy(ref_model, ids[:20], 32)
        same_greedy[name] = fast_tokens == ref_tokens
        assert first_difference_is_a_near_tie(ref_model, ids[:20], fast_tokens, ref_tokens), (name, fast_tokens, ref_tokens)
        # along the float32 path's greedy tokens, the fast mode picks the same token wherever that choice is
        # decisive (top two logits NEAR_TIE apart or more): host-independent, unlike whole greedy runs
        path = ids[:20] + ref_tokens
        ref_steps, fast_steps = decode_logits(ref_model, path, 19)[:32], decode_logits(fast_model, path, 19)[:32]
        top2 = ref_steps.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) >= NEAR_TIE
        assert torch.equal(ref_steps.argmax(-1), torch.tensor(ref_tokens))
        assert (fast_steps.argmax(-1) == torch.tensor(ref_tokens))[decisive].all(), name
        print(f"{qtype} {name}: fast-mode NMSE vs float32 = {drift:.2e} (prefill), {decode_drift:.2e} (decode), "
              f"greedy 32 equal: {same_greedy[name]}")
        if name == "moe":
            # top-2 routing flips on near-tied experts make MoE drift heavy-tailed (test_model.test_bfloat16_mode_drift):
            # a flip costs one position ~1e-2 (the dense bf16 path shows the same), a bug would cost every position
            assert drift <= 5e-3 and per_position[len(per_position) // 2] <= (1e-3 if qtype == "bf16" else 8e-3)
        else:
            assert drift <= 1e-3 and decode_drift <= (1e-3 if qtype == "bf16" else 4e-3)
    print(f"{qtype}: greedy 32 tokens equal on {sum(same_greedy.values())}/4 variants")


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", VARIANTS)
def test_a_prompt_gives_the_same_logits_however_it_is_chunked(variants, name, qtype):
    """Fast mode: a prompt's K/V and logits do not depend on how it is cut into prefill chunks (row-invariant
    GEMMs and chunk attention, model/cpu.py): 40 tokens in one pass and in chunks of 1, 5, 13, 8 and 13
    tokens (across the fixtures' sliding window of 8), then three decoded tokens: the same logits, bit for bit --
    without the AMX kernels, and with them where the CPU grants them."""
    model = gem4.load(variants[name].gguf[qtype], dtype="bfloat16")
    ids = torch.tensor(variants[name].ids[:40])

    def run(sizes: list[int]) -> torch.Tensor:
        cache, start = model.new_cache(), 0
        for n in sizes:
            logits = model.extend(ids[start:start + n], cache, prefill=True)
            start += n
        out = [logits]
        for _ in range(3):
            out.append(model.extend(torch.tensor([int(out[-1][-1].argmax())]), cache))
        return torch.cat(out)

    was = kernels.set_amx()
    try:
        for amx in (False, True):
            if kernels.set_amx(amx) == amx:                      # True only where granted
                assert torch.equal(run([40]), run([1, 5, 13, 8, 13])), amx
    finally:
        kernels.set_amx(was)


def test_q8_0_activation_blocks_of_zeros_and_extremes():
    g = torch.Generator().manual_seed(5)
    layer, dense = packed_linear(torch.randn(40, 128, generator=g), GGMLType.Q8_0)
    x = torch.randn(2, 128, generator=g)
    x[0, :32] = 0.0                                   # a zero block: scale 0, no division by zero
    x[1, 32:64] *= 1e30                               # a huge block next to ordinary ones
    x[1, 64:96] *= 1e-30                              # and a tiny one
    out = layer(x)
    assert torch.isfinite(out).all()
    for r in range(2):
        assert_panel_product(out[r:r + 1], x[r:r + 1], dense)


@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_a_nan_in_x_makes_its_row_nan(ggml_type):
    """A NaN activation makes every output of its row NaN, as a float product would (the quantization of x
    would otherwise turn it into a finite integer and drop it from the block's maximum), so the runner's
    finite check sees it; the other rows are what they are alone."""
    g = torch.Generator().manual_seed(8)
    layer, _ = packed_linear(torch.randn(40, 512, generator=g), ggml_type)
    x = torch.randn(3, 512, generator=g)
    x[1, 300] = float("nan")
    out = layer(x)
    assert torch.isnan(out[1]).all()
    for r in (0, 2):
        assert torch.equal(out[r], layer(x[r:r + 1])[0]) and torch.isfinite(out[r]).all()


# ---- the decode step's fused operations against the reference functions of model/layers.py ----

@pytest.mark.parametrize("D", [96, 10])
def test_rms_norm_kernel_equals_reference(D):
    from gem4.model.layers import rms_norm
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(5, 3, D, generator=g) * 7, torch.randn(D, generator=g)
    for weight in (w, None):
        out = kernels.rms_norm(x, weight, 1e-6)
        assert out.shape == x.shape and out.dtype == torch.float32
        torch.testing.assert_close(out, rms_norm(x, weight, 1e-6), rtol=1e-6, atol=1e-6)
    residual = torch.randn(5, 3, D, generator=g)                  # a block's output norm plus the residual add
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6, residual), residual + rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("d", [64, 16])
def test_rms_norm_rope_kernel_equals_norm_then_rope(d):
    from gem4.model.layers import apply_rope, rms_norm, rope_cos_sin
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(4, 3, d, generator=g), torch.randn(d, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    cos, sin = rope_cos_sin(torch.tensor([0, 9, 100, 4000]), inv_freq)
    ref = apply_rope(rms_norm(x, w, 1e-6), cos, sin)
    torch.testing.assert_close(kernels.rms_norm_rope(x, w, 1e-6, cos, sin), ref, rtol=1e-5, atol=1e-5)


def scattered_attend(T: int, S: int, B: int, g: torch.Generator):
    """A step of T query rows over B sequences whose S keys each sit at scattered rows of a shared storage
    (as in the paged pool): kv_cache.Attend, with ranges of every width (some rows see nothing)."""
    from gem4.kv_cache import Attend
    rows = torch.randperm(B * S + 7, generator=g)[:B * S].view(B, S)          # storage has spare rows
    q_seq = torch.sort(torch.randint(0, B, (T,), generator=g)).values
    lo = torch.randint(0, S, (T,), generator=g)
    hi = torch.minimum(lo + torch.randint(0, S + 1, (T,), generator=g), torch.tensor(S))
    if T > 1:
        hi[0] = lo[0]                                                          # one row sees nothing
    return Attend(rows, q_seq, lo, hi), B * S + 7


@pytest.mark.parametrize("T,S,B,nh,nkv,d", [(1, 1024, 1, 8, 1, 256), (1, 3, 1, 8, 1, 512), (3, 37, 2, 8, 2, 64),
                                            (8, 600, 3, 4, 4, 32), (5, 130, 4, 12, 3, 128)])
def test_attend_kernel_equals_reference_attention(T, S, B, nh, nkv, d):
    from gem4.model.layers import attention
    g = torch.Generator().manual_seed(T * S)
    a, R = scattered_attend(T, S, B, g)
    q = torch.randn(T, nh, d, generator=g)
    k_store, v_store = (torch.randn(R, nkv, d, generator=g).bfloat16() for _ in range(2))
    out = kernels.attend(q, k_store, v_store, a)
    assert out.shape == (T, nh * d) and out.dtype == torch.float32
    for t in range(T):
        keys = a.key_rows[a.q_seq[t], a.q_lo[t]:a.q_hi[t]]
        if keys.numel() == 0:
            assert torch.equal(out[t], torch.zeros(nh * d))             # a row that sees nothing
            continue
        ref = attention(q[t:t + 1], k_store[keys], v_store[keys], torch.ones(1, keys.numel(), dtype=torch.bool))
        torch.testing.assert_close(out[t:t + 1], ref, rtol=1e-5, atol=1e-5)
        # batch invariance: a row's result does not depend on the other rows of the call
        assert torch.equal(out[t], kernels.attend(q[t:t + 1], k_store, v_store, a.select(torch.tensor([t])))[0])


def _chunk_masks(kind: str, T: int, S: int, g: torch.Generator) -> torch.Tensor:
    if kind == "causal":                                        # a chunk after S - T cached tokens
        return torch.ones(T, S, dtype=torch.bool).tril(S - T)
    mask = torch.rand(T, S, generator=g) < 0.4                  # scattered visible rows, as in a wrapped sliding ring
    mask[1] = False                                             # a row that sees nothing
    return mask


@pytest.mark.parametrize("T,S,nh,nkv,d,kind", [(512, 512, 8, 1, 256, "causal"), (40, 75, 8, 1, 512, "causal"),
                                               (33, 101, 8, 2, 64, "scattered"), (70, 70, 4, 4, 32, "causal"),
                                               (9, 300, 12, 3, 128, "scattered")])
def test_attend_chunk_kernel_equals_attention_with_bf16_q_and_probabilities(T, S, nh, nkv, d, kind):
    """attend_chunk takes q as two bf16 terms, rounds the probabilities to bf16 and sums in float32: equal to
    that computed in float64 up to float32 sums, and within 1e-5 NMSE of the float32 reference (normalised
    q, k as in the model). A row that sees no key gets zeros."""
    from gem4.model.layers import attention, rms_norm
    g = torch.Generator().manual_seed(T * S + d)
    q = rms_norm(torch.randn(T, nh, d, generator=g), None, 1e-6)
    k = rms_norm(torch.randn(S, nkv, d, generator=g), None, 1e-6).bfloat16()
    v = torch.randn(S, nkv, d, generator=g).bfloat16()
    mask = _chunk_masks(kind, T, S, g)
    out = kernels.attend_chunk(q, k, v, mask)
    assert out.shape == (T, nh * d) and out.dtype == torch.float32
    # the same rounding, in float64
    grp = nh // nkv
    q_hi = q.bfloat16().float()
    qh = (q_hi.double() + (q - q_hi).bfloat16().double()).view(T, nkv, grp, d)        # q as two bf16 terms
    scores = torch.einsum("tkgd,skd->tkgs", qh, k.double()).masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).float().bfloat16().double()
    emulated = torch.einsum("tkgs,skd->tkgd", probs, v.double()).reshape(T, nh * d).float()
    # float32 vs float64 sums can round a probability to the neighbouring bf16 (2^-8 relative), so not
    # elementwise; a wrong product or mask would be off by > 1e-4
    assert ((out - emulated) ** 2).mean() / (emulated ** 2).mean() < 1e-7
    seen = mask.any(dim=1)
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))
    ref = attention(q, k, v, mask)[seen]
    assert ((out[seen] - ref) ** 2).mean() / (ref ** 2).mean() < 1e-5


def test_attend_chunk_rows_do_not_depend_on_the_other_rows_of_their_block():
    """attend_chunk is row-invariant: a row's output is the same float alone and among rows that see other keys
    (sliding windows of 40 keys starting at every offset mod 16, so the block's first seen key moves), as long as
    the key list starts at a position = 0 (mod 16) (cpu.attend_chunk pads it so)."""
    g = torch.Generator().manual_seed(8)
    T, S, nh, d, window = 48, 96, 4, 64, 40
    q = torch.randn(T, nh, d, generator=g)
    k, v = (torch.randn(S, 1, d, generator=g).bfloat16() for _ in range(2))
    pos = torch.arange(S - T, S)[:, None]                       # the chunk's rows are the last T positions
    keys = torch.arange(S)[None, :]
    mask = (keys <= pos) & (keys > pos - window)                # [T, S]
    together = kernels.attend_chunk(q, k, v, mask)
    for t in range(T):
        assert torch.equal(kernels.attend_chunk(q[t:t + 1], k, v, mask[t:t + 1]), together[t:t + 1]), t
    for a in range(0, T, 13):                                   # and in chunks of other sizes
        assert torch.equal(kernels.attend_chunk(q[a:a + 13], k, v, mask[a:a + 13]), together[a:a + 13]), a


@pytest.mark.parametrize("attend", ["attend", "attend_chunk"])
def test_attend_kernels_refuse_wrong_inputs(attend):
    from gem4.kv_cache import Attend
    q, k = torch.randn(1, 8, 64), torch.randn(10, 1, 64).bfloat16()
    if attend == "attend":
        def call(q, k, v, span):                                        # one sequence, rows [0, span)
            a = Attend(torch.arange(span)[None], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                       torch.full((1,), span))
            return kernels.attend(q, k, v, a)
        bad_span = ("outside the storage", 11)
    else:
        def call(q, k, v, span):
            return kernels.attend_chunk(q, k, v, torch.ones(1, span, dtype=torch.bool))
        bad_span = ("mask", 9)
    with pytest.raises(RuntimeError, match="bf16"):
        call(q, k.float(), k.float(), 10)
    with pytest.raises(RuntimeError, match=bad_span[0]):
        call(q, k, k, bad_span[1])
    with pytest.raises(RuntimeError, match="head shapes"):
        call(torch.randn(1, 3, 64), k.expand(10, 2, 64).contiguous(), k.expand(10, 2, 64).contiguous(), 10)


def test_fused_projections_equal_separate_calls():
    from gem4.model.layers import gelu_tanh
    g = torch.Generator().manual_seed(10)
    for ggml_type in PACKED:
        layers = [packed_linear(torch.randn(n, 160, generator=g), ggml_type)[0] for n in (96, 32, 32)]
        x = torch.randn(3, 160, generator=g)
        for prefill in (False, None):                                # a decode pass, a layer called alone
            fused = cpu.project(x, layers, prefill)
            for lin, out in zip(layers, fused):
                assert torch.equal(out, lin(x, prefill))             # same kernel, same rows: bit-identical
        gate, up = layers[1], layers[2]
        ref = gelu_tanh(gate(x)) * up(x)
        torch.testing.assert_close(cpu.glu(x, gate, up, False), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
        assert torch.equal(cpu.project(x, layers, True)[0], layers[0](x, True))   # a prefill pass: the GEMM each
    # mixed types or too many rows: one call each, same results
    mixed = [packed_linear(torch.randn(32, 64, generator=g), t)[0] for t in PACKED]
    x = torch.randn(2, 64, generator=g)
    assert all(torch.equal(a, lin(x)) for a, lin in zip(cpu.project(x, mixed, None), mixed))
    x = torch.randn(DECODE_ROWS + 4, 64, generator=g)
    assert all(torch.equal(a, lin(x)) for a, lin in zip(cpu.project(x, mixed, None), mixed))


def test_gelu_mul_and_softcap_kernels_equal_reference():
    from gem4.model.layers import gelu_tanh, softcap
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(3, 1000, generator=g) * 4, torch.randn(3, 1000, generator=g)
    a[0, :4] = torch.tensor([0.0, -30.0, 30.0, 1e-6])
    torch.testing.assert_close(kernels.gelu_mul(a, b), gelu_tanh(a) * b, rtol=1e-5, atol=1e-6)
    logits = torch.randn(2, 777, generator=g) * 50
    torch.testing.assert_close(kernels.softcap(logits, 30.0), softcap(logits, 30.0), rtol=1e-5, atol=1e-5)


def test_keep_heap_serves_large_blocks_from_the_heap(tmp_path):
    """After keep_heap() a 24 MiB tensor lies in the [heap] mapping; by default glibc maps it fresh
    (and prefill faults such blocks in again on every call), and so after keep_heap(False). Each case in its
    own process."""
    import subprocess
    import sys
    script = tmp_path / "where.py"
    script.write_text(
        "import sys, torch\n"
        "from gem4.model import kernels\n"
        "if sys.argv[1] in ('keep', 'give'):\n"
        "    assert kernels.keep_heap()\n"
        "if sys.argv[1] == 'give':\n"
        "    big = torch.empty(24 << 20, dtype=torch.uint8)\n"
        "    del big\n"
        "    assert kernels.keep_heap(False)\n"
        "block = torch.empty(24 << 20, dtype=torch.uint8)\n"
        "ptr = block.data_ptr()\n"
        "for line in open('/proc/self/maps'):\n"
        "    lo, hi = (int(a, 16) for a in line.split()[0].split('-'))\n"
        "    if lo <= ptr < hi:\n"
        "        print('heap' if line.rstrip().endswith('[heap]') else 'mapping')\n")
    where = {case: subprocess.run([sys.executable, str(script), case], capture_output=True, text=True, check=True).stdout.strip()
             for case in ("default", "keep", "give")}
    assert where == {"default": "mapping", "keep": "heap", "give": "mapping"}


def test_decode_plan_gives_decode_layer_its_arguments_in_its_order(monkeypatch, variants):
    """decode_layer.cpp declares its weights and dims by name (decode_layer_schema); cpu.py's DecodePlan gives them in
    the same order, and a reordering on either side fails when a model is loaded, naming the first difference."""
    assert cpu.decode_layer_schema() == kernels.decode_layer_schema()
    cpu.check_decode_layer_schema()
    weights, dims, moe, moe_dims = kernels.decode_layer_schema()
    with pytest.raises(RuntimeError, match=r"MoE dims at position 2: decode_layer.cpp expects "
                                           r"'experts.down_proj.type', DecodePlan gives 'experts.gate_up_proj.type'"):
        cpu.check_decode_layer_schema((weights, dims, moe, (*moe_dims[:2], moe_dims[3], moe_dims[2])))
    q, k, *rest = cpu.DECODE_LAYER_LINEARS
    monkeypatch.setattr(cpu, "DECODE_LAYER_LINEARS", (k, q, *rest))
    cpu._check_decode_layer_schema_once.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"weights at position 8: decode_layer.cpp expects 'self_attn.q_proj', "
                                               r"DecodePlan gives 'self_attn.k_proj'"):
            gem4.load(variants["dense_plain"].gguf["q4_0"], dtype="bfloat16")
    finally:
        monkeypatch.undo()
        cpu._check_decode_layer_schema_once.cache_clear()


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "bf16"])
def test_decode_layer_is_the_layer_it_replaces(tmp_path, qtype):
    """kernels.decode_layer runs a decode step's layer in one call: bit-identical logits to the Python layer
    over prefill, one-token and three-token steps, on the E2B-like (PLE + KV sharing; PLE width 32 so its
    projections are packed too), k_eq_v, plain dense and MoE variants; Q8_0 / Q4_0 packed or bf16 as stored."""
    from model_fixtures import build_hf
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf

    def steps(model):
        cache = model.new_cache()
        out = [model.extend(torch.arange(3, 23), cache)]
        out += [model.extend(torch.tensor([t]), cache) for t in (5, 9, 100, 7, 3, 11, 40, 41, 42)]
        out.append(model.extend(torch.tensor([1, 2, 3]), cache, logits=3))
        return torch.cat(out)

    for name, overrides in [("ple_kvshare", dict(hidden_size_per_layer_input=32)), ("dense_keqv", {}),
                            ("dense_plain", {}), ("moe", {})]:
        causal, _ = build_hf(name, **overrides)
        causal.save_pretrained(tmp_path / name)
        write_gguf(open_checkpoint(tmp_path / name), tmp_path / f"{name}.gguf", qtype)
        model = gem4.load(tmp_path / f"{name}.gguf", dtype="bfloat16")
        planned = [layer.plan is not None for layer in model.layers]
        assert all(planned), (name, planned)
        one_call = steps(model)
        for layer in model.layers:
            layer.plan = None
        assert torch.equal(one_call, steps(model)), name


@pytest.mark.parametrize("M,N,K", [(1, 300, 1536), (3, 77, 100), (5, 64, 8), (8, 40, 256)])
def test_gemv_bf16_takes_x_as_two_bf16_terms(M, N, K):
    """gemv_bf16 equals x_hi @ W.T + x_lo @ W.T in float64 (x_hi = bf16(x), x_lo = bf16(x - x_hi)) up to float32
    sums, and so the float64 product x @ W.T within ~1e-5 relative (bf16(x) alone: ~3e-3)."""
    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).bfloat16()
    out = kernels.gemv_bf16(x, w)
    assert out.shape == (M, N) and out.dtype == torch.float32
    hi = x.bfloat16().float()
    emulated = (hi.double() + (x - hi).bfloat16().double()) @ w.double().T
    torch.testing.assert_close(out.double(), emulated, rtol=1e-5, atol=1e-5)
    exact = x.double() @ w.double().T
    assert ((out.double() - exact) ** 2).mean() / (exact ** 2).mean() < 1e-9
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.gemv_bf16(x, w.float())


@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_0])
@pytest.mark.parametrize("T", [1, 3, DECODE_ROWS + 4])
def test_packed_experts_equal_their_dequantized_weights(ggml_type, T):
    """26B-A4B experts packed as [E * rows, k] (KernelExperts.pack): expert e's products read its own rows, through
    the GEMV (T <= DECODE_ROWS) and the tiled GEMM; equal to the dense dequantized experts within the
    kernels' rounding (int8 / bf16 activations)."""
    from gem4.config import MoEConfig
    from gem4.model.gemma4 import Experts
    from types import SimpleNamespace
    E, H, Im, K = 6, 64, 32, 2
    config = SimpleNamespace(hidden_size=H, moe=MoEConfig(num_experts=E, top_k=K, intermediate_size=Im))
    g = torch.Generator().manual_seed(T)
    dense, packed = Experts(config), KernelExperts(config)
    for name, (rows, k) in dense.dims.items():
        raw = quantize(torch.randn(E, rows, k, generator=g) * 0.1, ggml_type)
        setattr(dense, name, torch.nn.Parameter(dequantize(raw, ggml_type, (E, rows, k)), requires_grad=False))
        packed.pack(name, raw, ggml_type)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])             # [T, K] distinct experts
    w = torch.rand(T, K, generator=g)
    ref, out = dense(x, idx, w), packed(x, idx, w)
    assert ((out - ref) ** 2).mean() / (ref ** 2).mean() < 5e-4       # int8 x through two products: ~1.5e-4


def test_gemv_rows_do_not_depend_on_their_batch_mates():
    """Batch invariance of the decode GEMVs: each row of an M-row call equals that row alone, bit for bit."""
    g = torch.Generator().manual_seed(11)
    for ggml_type in PACKED:
        for n, k in ((96, 320), (40, 4096)):        # 4096 inputs: tiles of W and spans of groups (ggml_gemv.cpp)
            layer, dense = packed_linear(torch.randn(n, k, generator=g), ggml_type)
            x = torch.randn(DECODE_ROWS, k, generator=g)
            together = layer(x)
            assert all(torch.equal(together[i], layer(x[i:i + 1])[0]) for i in range(DECODE_ROWS))
            assert_panel_product(together, x, dense)
    w = torch.randn(96, 320, generator=g).bfloat16()
    x = torch.randn(DECODE_ROWS, 320, generator=g)
    together = kernels.gemv_bf16(x, w)
    assert all(torch.equal(together[i], kernels.gemv_bf16(x[i:i + 1], w)[0]) for i in range(DECODE_ROWS))


@pytest.mark.parametrize("ggml_type", PACKED, ids=lambda t: t.name)
def test_panel_gemv_is_the_same_on_amx_and_vnni(ggml_type):
    """Q8_0 / Q4_0 panels: passes of 2..8 rows run on AMX tiles where the CPU grants them, on VNNI otherwise;
    both give the same floats bit for bit (odd block counts, a partial last panel, 1..20 rows)."""
    g = torch.Generator().manual_seed(12)
    was = kernels.set_amx()
    try:
        for n, k in ((40, 32), (24, 544), (48, 1536)):             # 1, 17 and 48 blocks a row; 40, 24 rows
            layer, dense = packed_linear(torch.randn(n, k, generator=g), ggml_type)
            x = torch.randn(20, k, generator=g)
            x[3, :32] = 0.0                                           # a zero block: scale 0
            for m in (1, 2, 3, 4, 5, 8, 9, 20):
                kernels.set_amx(False)
                vnni = kernels.gemv(x[:m].contiguous(), layer.packed, n, k, ggml_type)
                amx = kernels.set_amx(True)
                tiles = kernels.gemv(x[:m].contiguous(), layer.packed, n, k, ggml_type)
                assert torch.equal(tiles, vnni), (n, k, m, amx)
                assert_panel_product(tiles, x[:m], dense)
    finally:
        kernels.set_amx(was)
    cpu_has_amx = {"amx_tile", "amx_int8"} <= build.cpu_flags()
    assert kernels.set_amx() in ((False,) if not cpu_has_amx else (True, False))   # never on without the CPU's AMX


@pytest.mark.parametrize("key, preset, expect", [("GOMP_SPINCOUNT", None, "1000"), ("GOMP_SPINCOUNT", "7", "7"),
                                                  ("OMP_WAIT_POLICY", None, "ACTIVE"),
                                                  ("OMP_WAIT_POLICY", "PASSIVE", "PASSIVE")])
def test_openmp_defaults_and_an_explicit_value_wins(key, preset, expect):
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != key}
    if preset is not None:
        env[key] = preset
    out = subprocess.run([sys.executable, "-c", f"import gem4, os; print(os.environ['{key}'])"],
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert out == expect


def test_a_model_switches_from_gemv_to_gemm_at_one_row_count(variants):
    """The CPU backend's decode_rows: packed weights take the GEMV in decode passes of up to DECODE_ROWS rows; a
    model whose decoder layers' weights gemv_bf16 reads packs decode passes of DECODE_ROWS_BF16 (the bf16 GEMM is
    faster beyond). The runner's passes and every layer's decode plan agree (engine/runner.py, batch
    invariance). One bf16 matrix outside the layers: test_kquants."""
    fx = variants["dense_plain"]
    for path, rows in ((fx.gguf["q4_0"], DECODE_ROWS), (fx.hf_causal, DECODE_ROWS_BF16)):
        model = gem4.load(path, dtype="bfloat16")
        assert model.backend == "cpu" and model.decode_rows == rows
        assert {layer.plan.max_rows for layer in model.layers} == {rows}

def test_gem4_no_amx_keeps_the_kernels_off_amx():
    """GEM4_NO_AMX (read by gem4.paths when the library loads) turns the AMX tiles off; without it they are on
    where the CPU grants them."""
    import os
    import subprocess
    import sys
    code = "import gem4; from gem4.model import kernels; assert kernels.available(); print(kernels.set_amx())"
    env = {k: v for k, v in os.environ.items() if k != "GEM4_NO_AMX"}
    default = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    off = subprocess.run([sys.executable, "-c", code], env={**env, "GEM4_NO_AMX": "1"}, capture_output=True,
                         text=True, timeout=600)
    was = kernels.set_amx()
    granted = kernels.set_amx(True)                     # True only where the CPU and the kernel grant AMX
    kernels.set_amx(was)
    assert off.stdout.strip() == "False", off.stderr
    assert default.stdout.strip() == str(granted), default.stderr
