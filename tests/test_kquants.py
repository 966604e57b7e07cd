"""K-quants (Q4_K, Q5_K, Q6_K) and Q4_1 / Q5_0 / Q5_1 on the fast path: the lossless x16 repack, the decode
GEMV, prefill and table rows against dequantize + float matmul; gem4's quantizers read back by gguf-py; llama.cpp's _M mixes;
the fast mode of tiny models stored in these types against the float32 path."""
from __future__ import annotations

import pytest
import torch

import gem4
from gem4.model import kernels
from gem4.model.cpu import DECODE_ROWS, KernelExperts, PackedLinear
from gem4.model.layers import QuantLinear
from gem4.ggml import BLOCK_INFO, GGMLType, dequantize, quantize, tensor_nbytes
from test_kernels import NEAR_TIE, decode_logits, greedy

K_TYPES = [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
# the 32-weight formats llama.cpp falls back to for rows that are not whole 256-blocks (Q5_0 / Q5_1), and Q4_1
LEGACY = [GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1]
# fp16 bit patterns of block scales: largest finite, smallest subnormal, smallest normal, zero, 1.0, ordinary
EXTREME_D = [0x7BFF, 0x0001, 0x0400, 0x0000, 0x3C00, 0x1A00]


def random_blocks(t: GGMLType, rows: int, k: int, g: torch.Generator, d_bits=None) -> torch.Tensor:
    """GGML bytes of an [rows, k] weight: every quant and sub-block scale byte random, the fp16 scales (d, and
    dmin / m where the type has one) from `d_bits` (one per row, else random ordinary values of both signs)."""
    info = BLOCK_INFO[t]
    n = rows * k // info.block_size
    raw = torch.randint(0, 256, (n, info.type_size), generator=g, dtype=torch.uint8)
    if d_bits is None:
        d = ((torch.rand(n, 2, generator=g) - 0.5) * 2e-3).half().view(torch.int16)
    else:
        per_row = torch.tensor(d_bits, dtype=torch.int32).repeat_interleave(k // info.block_size)   # [n]
        d = torch.stack([per_row, per_row.flip(0)], dim=1).to(torch.int16)
    d = d.view(torch.uint8).reshape(n, 4)
    if t == GGMLType.Q6_K:
        raw[:, 208:210] = d[:, :2]
    elif t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q4_1, GGMLType.Q5_1):      # d, dmin / d, m
        raw[:, 0:4] = d
    else:                                                                         # Q5_0: d only
        raw[:, 0:2] = d[:, :2]
    return raw.reshape(-1)


def packed_row_bytes(t: GGMLType, k: int) -> int:
    """Bytes of a [1, k] weight of type t in the x16 layout: the file's (tail groups unpadded), plus for Q4_K / Q5_K
    4 per 256-weight super-block (their 12 bytes of 6-bit scales and mins kept as 16 bytes)."""
    extra = 4 * (k // 256) if t in (GGMLType.Q4_K, GGMLType.Q5_K) else 0
    return tensor_nbytes(t, k) + extra


def packed(raw: torch.Tensor, t: GGMLType, rows: int, k: int) -> PackedLinear:
    layer = PackedLinear(k, rows)
    layer.pack(raw, t)
    return layer


@pytest.mark.parametrize("t", K_TYPES + LEGACY, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [256, 512, 768, 2560])
def test_repack_is_lossless_with_extreme_scales(t, k):
    # K-quants: 1, 2, 3 and 10 super-blocks per row: half a group, one group, one and a half, several
    # (32-weight formats: 8, 16, 24 and 80 blocks)
    g = torch.Generator().manual_seed(k + int(t))
    rows = 3 * len(EXTREME_D)
    raw = random_blocks(t, rows, k, g, EXTREME_D * 3)
    dense = dequantize(raw, t, (rows, k))
    layer = packed(raw, t, rows, k)
    assert layer.layout == "packed" and layer.packed.numel() == rows * packed_row_bytes(t, k)
    assert torch.equal(kernels.dequant(layer.packed, k, t, torch.float32), dense)            # bit for bit
    assert torch.equal(kernels.dequant(layer.packed, k, t, torch.bfloat16), dense.bfloat16())
    ids = torch.tensor([rows - 1, 0, 5, 5])
    assert torch.equal(layer.rows(ids), dense[ids])                                          # token-table rows


def error_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """|y - x W^T| bound of the GEMV [M, N]: activations quantized per 32-block to int16 (error <= half a step,
    block max / 32767 / 2, per element), plus float32 rounding of the sums."""
    block_max = x.abs().reshape(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1)   # [M, K]
    return block_max @ dense.abs().T / 32767 + 1e-5 * (x.abs() @ dense.abs().T)


@pytest.mark.parametrize("t", K_TYPES + LEGACY, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_gemv_equals_dequantize_then_matmul(t, rows):
    g = torch.Generator().manual_seed(rows * 100 + int(t))
    n, k = 2 * len(EXTREME_D) + 5, 2560          # 5 groups of 16 blocks: passes of 5-8 rows split them into spans
    raw = random_blocks(t, n, k, g, EXTREME_D * 2 + [0x2000, 0x2400, 0x2800, 0x1C00, 0x3000])
    dense = dequantize(raw, t, (n, k)).double()
    layer = packed(raw, t, n, k)
    x = torch.randn(rows, k, generator=g)
    x[0, :32] = 0.0                                       # a zero activation block
    if rows > 1:
        x[1, 32:64] *= 1e4                                # a large one beside ordinary ones
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, n) and torch.isfinite(y).all()
    ref = x.double() @ dense.T
    assert ((y.double() - ref).abs() <= error_bound(x.double(), dense)).all()


@pytest.mark.parametrize("t", K_TYPES + LEGACY, ids=lambda t: t.name)
def test_gemv_rows_do_not_depend_on_their_batch_mates(t):
    """Batch invariance: a row's result is the same bit for bit whatever the call's size (1..DECODE_ROWS) and
    its position in it (the kernel takes rows in passes of up to 8; with 4096 inputs a pass of 4 or more rows
    goes over W in tiles of 16 rows and spans of groups, 40 rows leaving a partial tile)."""
    g = torch.Generator().manual_seed(int(t))
    for n, k in ((40, 768), (40, 4096)):
        layer = packed(random_blocks(t, n, k, g), t, n, k)
        x = torch.randn(DECODE_ROWS, k, generator=g)
        alone = [layer(x[i:i + 1])[0] for i in range(DECODE_ROWS)]
        for m in range(1, DECODE_ROWS + 1):
            for start in (0, DECODE_ROWS - m):
                together = layer(x[start:start + m])
                assert all(torch.equal(together[i], alone[start + i]) for i in range(m)), (m, start, k)


@pytest.mark.parametrize("t", K_TYPES + LEGACY, ids=lambda t: t.name)
def test_prefill_takes_bf16_tiles_of_the_weight(t):
    # DECODE_ROWS + 4 rows: kernels.linear, W in bf16 a tile at a time; k = 65536 makes 32 rows a tile, so the
    # 80 rows take three tiles, the last one partial
    g = torch.Generator().manual_seed(30 + int(t))
    n, k = 80, 65536
    raw = random_blocks(t, n, k, g)
    dense = dequantize(raw, t, (n, k))
    layer = packed(raw, t, n, k)
    x = torch.randn(DECODE_ROWS + 4, k, generator=g)
    ref = torch.nn.functional.linear(x.bfloat16(), dense.bfloat16()).float()
    torch.testing.assert_close(layer(x), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("t", K_TYPES, ids=lambda t: t.name)
def test_packed_experts_read_their_own_rows(t):
    """26B-A4B experts in a K-quant: packed as [E * rows, k], expert e's product equals its dequantized weight's."""
    from gem4.config import MoEConfig
    from gem4.model.gemma4 import Experts
    from types import SimpleNamespace
    E, H, Im, K = 4, 256, 256, 2
    config = SimpleNamespace(hidden_size=H, moe=MoEConfig(num_experts=E, top_k=K, intermediate_size=Im))
    g = torch.Generator().manual_seed(40 + int(t))
    dense, fast = Experts(config), KernelExperts(config)
    for name, (rows, k) in dense.dims.items():
        raw = quantize(torch.randn(E, rows, k, generator=g) * 0.1, t)
        setattr(dense, name, torch.nn.Parameter(dequantize(raw, t, (E, rows, k)), requires_grad=False))
        fast.pack(name, raw, t)
    assert set(fast.packed_types.values()) == {t}
    for T in (1, 3, 20):
        x = torch.randn(T, H, generator=g)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=g)
        ref, out = dense(x, idx, w), fast(x, idx, w)
        assert ((out - ref) ** 2).mean() / (ref ** 2).mean() < 1e-4


# ---- gem4's K-quant quantizers ----

@pytest.mark.parametrize("t,nmse_max", [(GGMLType.Q4_K, 1e-2), (GGMLType.Q5_K, 3e-3), (GGMLType.Q6_K, 1e-3)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_quantizers_read_back_by_gguf_py(t, nmse_max):
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(int(t))
    x = torch.randn(16, 512, generator=g)
    x[1] *= 1e-3                                          # a small row (d ~ 1e-5: an fp16 subnormal), a zero
    x[2, :256] = 0.0                                      # super-block, a shifted row, one whose largest value is negative
    x[3] += 3.0
    x[4] = x[4].abs()
    x[4, 7] = -10.0
    raw = quantize(x, t)
    assert raw.numel() == 16 * 512 // 256 * BLOCK_INFO[t].type_size
    ours = dequantize(raw, t, x.shape)
    theirs = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(int(t))).reshape(x.shape)
    assert torch.equal(ours, torch.from_numpy(theirs))
    per_row = ((ours - x) ** 2).mean(-1) / (x ** 2).mean(-1).clamp_min(1e-30)
    assert torch.isfinite(ours).all() and (ours[2, :256] == 0).all()
    assert per_row.max() < nmse_max, per_row


def test_q4_k_m_mix_follows_llama_cpp():
    """Token tables Q6_K; attn_v Q6_K by its rank among the layers that have one, ffn_down by layer index
    (use_more_bits: first and last eighth, every third between); rows that are not 256-blocks fall back; the
    per-layer model projection is not quantized. (On llama.cpp's own Q4_K_M E2B file all 540 tensors agree.)"""
    from gem4.weights.gguf_model import mix_type
    Q4K, Q6K = GGMLType.Q4_K, GGMLType.Q6_K
    n_layers, v_layers = 16, list(range(10))              # layers 10-15 share KV: no attn_v
    assert mix_type("embed_tokens.weight", (512, 1536), Q4K, n_layers, v_layers) == Q6K
    assert mix_type("embed_tokens_per_layer.weight", (512, 4096), Q4K, n_layers, v_layers) == Q6K
    v = [mix_type(f"layers.{i}.self_attn.v_proj.weight", (256, 1536), Q4K, n_layers, v_layers) for i in v_layers]
    assert [i for i, t in enumerate(v) if t == Q6K] == [0, 3, 6, 8, 9]   # n = 10: i < 1, i >= 8, (i - 1) % 3 == 2
    down = [mix_type(f"layers.{i}.mlp.down_proj.weight", (1536, 6144), Q4K, n_layers, v_layers) for i in range(n_layers)]
    assert [i for i, t in enumerate(down) if t == Q6K] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert mix_type("layers.3.experts.down_proj", (8, 256, 512), Q4K, n_layers, v_layers) == Q4K
    assert mix_type("layers.4.experts.down_proj", (8, 256, 512), Q4K, n_layers, v_layers) == Q6K
    assert mix_type("layers.5.mlp.up_proj.weight", (6144, 1536), Q4K, n_layers, v_layers) == Q4K
    assert mix_type("layers.5.mlp.up_proj.weight", (6144, 96), Q4K, n_layers, v_layers) == GGMLType.Q5_0
    assert mix_type("layers.4.experts.down_proj", (8, 256, 704), Q4K, n_layers, v_layers) == GGMLType.Q8_0   # Q6_K's
    assert mix_type("layers.3.experts.down_proj", (8, 256, 704), GGMLType.Q5_K, n_layers, v_layers) == GGMLType.Q5_1
    assert mix_type("layers.5.mlp.up_proj.weight", (6144, 8), Q4K, n_layers, v_layers) == GGMLType.F16
    assert mix_type("layers.5.input_layernorm.weight", (1536,), Q4K, n_layers, v_layers) == GGMLType.F32
    assert mix_type("per_layer_model_projection.weight", (4096, 1536), Q4K, n_layers, v_layers) == GGMLType.BF16


# ---- tiny models stored in K-quants: the fast mode against the float32 path ----

# every matrix a whole number of 256-blocks per row, so that each one is a K-quant (PLE width 256 too)
WIDE = dict(hidden_size=256, intermediate_size=256, head_dim=64, global_head_dim=64)
VARIANT_OVERRIDES = {"ple_kvshare": dict(WIDE, hidden_size_per_layer_input=256), "dense_keqv": WIDE,
                     "moe": dict(WIDE, moe_intermediate_size=256)}


@pytest.fixture(scope="module")
def k_models(tmp_path_factory):
    from model_fixtures import build_hf, prompt_ids
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf

    root = tmp_path_factory.mktemp("kquant-models")
    out = {}
    for name, overrides in VARIANT_OVERRIDES.items():
        causal, _ = build_hf(name, **overrides)
        causal.save_pretrained(root / name)
        ckpt = open_checkpoint(root / name)
        for qtype in ("q4_k_m", "q5_k", "q6_k"):
            path = root / f"{name}-{qtype}.gguf"
            write_gguf(ckpt, path, qtype)
            out[name, qtype] = path
    return out, prompt_ids()


def test_a_bf16_matrix_outside_the_layers_keeps_the_gemv_rows(k_models):
    """The Q4_K_M mix keeps the per-layer model projection in BF16 (as llama.cpp's files do); it is outside the
    decoder layers, so the model keeps DECODE_ROWS (CpuBackend.finish)."""
    paths, _ = k_models
    model = gem4.load(paths["ple_kvshare", "q4_k_m"], dtype="bfloat16")
    assert model.per_layer_model_projection.gemv_type == GGMLType.BF16
    assert model.decode_rows == DECODE_ROWS




@pytest.mark.parametrize("qtype", ["q4_k_m", "q5_k", "q6_k"])
def test_fast_mode_tracks_the_float32_path(k_models, qtype):
    """The same K-quant GGUF in float32 (dequantized) and in the fast mode (every matrix packed, the tied head
    too; each decoder layer one decode_layer call). Per variant: the per-position NMSE of prefill logits (median;
    MoE routing flips make its tail heavy, test_kernels), and along the float32 path's 32 greedy tokens the fast
    mode's decode picks the same token wherever the float32 path's top two logits are NEAR_TIE apart or more.
    Whole greedy runs are compared too: equal on at least 2 of the 3 variants (random models have near-ties;
    the bf16 KV cache and activations flip one in about one variant per type, as for Q8_0 / Q4_0)."""
    paths, ids = k_models
    expect = {"q4_k_m": {GGMLType.Q4_K, GGMLType.Q6_K}, "q5_k": {GGMLType.Q5_K}, "q6_k": {GGMLType.Q6_K}}[qtype]
    same_greedy = {}
    for name in VARIANT_OVERRIDES:
        ref, fast = gem4.load(paths[name, qtype], dtype="float32"), gem4.load(paths[name, qtype], dtype="bfloat16")
        linears = [m for m in fast.modules() if isinstance(m, QuantLinear)]
        assert {m.ggml_type for m in linears if m.layout == "packed"} == expect, name
        assert fast.embed_tokens.layout == "packed" and all(layer.plan is not None for layer in fast.layers), name
        if name == "moe":
            assert set(fast.layers[0].experts.packed_types.values()) <= expect
        ref_logits = ref.logits(ids)
        per_position = sorted(float(((f - r) ** 2).mean() / (r ** 2).mean()) for f, r in zip(fast.logits(ids), ref_logits))
        assert per_position[len(per_position) // 2] <= 1e-3, (name, per_position)
        if name != "moe":
            assert per_position[-1] <= 1e-3, (name, per_position)
        tokens = greedy(ref, ids[:20], 32)
        path = ids[:20] + tokens
        ref_steps, fast_steps = decode_logits(ref, path, 19)[:32], decode_logits(fast, path, 19)[:32]   # -> tokens
        top2 = ref_steps.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) >= NEAR_TIE
        assert torch.equal(ref_steps.argmax(-1), torch.tensor(tokens))
        assert (fast_steps.argmax(-1) == torch.tensor(tokens))[decisive].all(), name
        same_greedy[name] = greedy(fast, ids[:20], 32) == tokens
    print(f"{qtype}: greedy 32 tokens equal to the float32 path's: {same_greedy}")
    assert sum(same_greedy.values()) >= 2, same_greedy


def test_decode_layer_is_the_layer_it_replaces_in_a_mix(k_models):
    """Q4_K_M mixes Q4_K and Q6_K inside a layer (attn_v, ffn_down): decode_layer falls back per matrix as the
    Python layer does (one call each where Q/K/V differ in type), bit-identical logits over a prefill and
    one-token steps."""
    paths, ids = k_models
    for name in VARIANT_OVERRIDES:
        model = gem4.load(paths[name, "q4_k_m"], dtype="bfloat16")
        one_call = decode_logits(model, ids, 20)
        plans = [layer.plan for layer in model.layers]
        assert all(p is not None for p in plans), name
        for layer in model.layers:
            layer.plan = None
        assert torch.equal(one_call, decode_logits(model, ids, 20)), name


def test_fallback_rows_are_packed_in_their_own_types(tmp_path):
    """26B-A4B-like experts whose rows are not whole 256-blocks (Im = 96 here, 704 in the real model): a Q4_K_M
    file keeps them in llama.cpp's fallbacks (Q5_0, Q8_0 where Q6_K was due), and the fast mode packs those too
    (no bf16 copy) and tracks the float32 path."""
    from model_fixtures import build_hf, prompt_ids
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf

    causal, _ = build_hf("moe", **dict(WIDE, moe_intermediate_size=96))
    causal.save_pretrained(tmp_path / "hf")
    write_gguf(open_checkpoint(tmp_path / "hf"), tmp_path / "m.gguf", "q4_k_m")
    ref, fast = gem4.load(tmp_path / "m.gguf", dtype="float32"), gem4.load(tmp_path / "m.gguf", dtype="bfloat16")
    down = {layer.experts.packed_types["down_proj"] for layer in fast.layers}
    assert down == {GGMLType.Q5_0, GGMLType.Q8_0}                  # of 6 layers, 2 and 5 get "more bits" (Q6_K -> Q8_0)
    assert {layer.experts.packed_types["gate_up_proj"] for layer in fast.layers} == {GGMLType.Q4_K}
    ids = prompt_ids()
    a, b = fast.logits(ids), ref.logits(ids)
    per_position = sorted(float(((x - y) ** 2).mean() / (y ** 2).mean()) for x, y in zip(a, b))
    assert per_position[len(per_position) // 2] <= 1e-3, per_position
