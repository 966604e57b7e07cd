"""MLX affine checkpoints (weights/mlx.py): the format's definition on hand-made tensors, the kernels on its
blocks, and the tiny fixtures quantized by mlx itself against transformers on the values mlx dequantizes."""
from __future__ import annotations

import json

import mlx.core as mx            # a test extra (pyproject): mlx writes the checkpoints these tests read
import numpy as np
import pytest
import torch

import gem4
from gem4.ggml import GGMLType, dequantize
from gem4.model import kernels
from gem4.model.cpu import PackedLinear
from gem4.weights.checkpoint import CheckpointError, open_checkpoint
from gem4.weights.mlx import AffineTensor
from mlx_fixtures import hf_state, write_mlx
from model_fixtures import VARIANTS, build_hf, prompt_ids

FORMATS = [(4, 32), (4, 64), (8, 32), (8, 64)]


def mlx_tensor(w: torch.Tensor, bits: int, group: int, scale_dtype=None) -> tuple[AffineTensor, torch.Tensor]:
    """w quantized by mlx -> (the AffineTensor gem4 reads, mlx's own dequantization in float32)."""
    q, s, b = mx.quantize(mx.array(w.numpy()).astype(scale_dtype or mx.bfloat16), group_size=group, bits=bits)
    as_torch = lambda a: torch.from_numpy(np.array(a.astype(mx.float32))).to(  # noqa: E731
        {mx.bfloat16: torch.bfloat16, mx.float16: torch.float16}[s.dtype])
    t = AffineTensor("w", lambda: torch.from_numpy(np.array(q)), lambda: as_torch(s), lambda: as_torch(b), group, bits)
    t.shape = tuple(w.shape)
    ref = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits)
    return t, torch.from_numpy(np.array(ref))


def test_the_format_on_a_hand_made_tensor():
    """Two rows of 64 weights, 4-bit in groups of 32: word j of a row holds weights 8j..8j+7, weight 8j + i in bits
    4i..4i+3; w = scale * q + bias per group. Words written by hand give the values mlx.dequantize gives."""
    q = torch.arange(128, dtype=torch.int64).reshape(2, 64) % 16
    scales = torch.tensor([[0.5, 0.25], [2.0, -1.0]], dtype=torch.bfloat16)
    biases = torch.tensor([[-4.0, 1.0], [0.0, 3.0]], dtype=torch.bfloat16)
    words = torch.zeros(2, 8, dtype=torch.int64)
    for i in range(8):
        words |= q[:, i::8] << (4 * i)
    packed = words.to(torch.int32)                           # the uint32 bits, as safetensors' U32 holds them
    t = AffineTensor("hand", lambda: packed, lambda: scales, lambda: biases, 32, 4)
    t.shape = (2, 64)
    want = (scales.float().repeat_interleave(32, 1) * q.float()) + biases.float().repeat_interleave(32, 1)
    assert torch.equal(t.dense(), want)
    # mlx reads the hand-made words, scales and biases as the same values
    theirs = mx.dequantize(mx.array(packed.numpy().view(np.uint32)), mx.array(scales.float().numpy()),
                           mx.array(biases.float().numpy()), group_size=32, bits=4)
    assert np.array_equal(np.array(theirs), want.numpy())
    assert torch.equal(dequantize(t.blocks()[0].reshape(-1), GGMLType.MLX_A4, (2, 64)), want)


@pytest.mark.parametrize("bits,group", [*FORMATS, (4, 128), (8, 128)])
def test_the_compiled_regrouping_gives_the_same_bytes(monkeypatch, bits, group):
    """kernels.affine_blocks (mlx_affine.cpp) against weights/mlx.py's torch regrouping, over several row chunks."""
    from gem4.weights import mlx as mlx_module

    g = torch.Generator().manual_seed(bits + group)
    t, _ = mlx_tensor(torch.randn(3, 40, 256, generator=g), bits, group)     # experts' [E, rows, k]
    compiled = t.blocks()
    monkeypatch.setattr(mlx_module, "_kernels_available", lambda: False)
    monkeypatch.setattr(mlx_module, "BLOCK_ROWS_ELEMS", 256 * 7)
    assert torch.equal(t.blocks()[0], compiled[0]) and compiled[0].shape == (3, 40, 256 // 32 * (4 + 4 * bits))


@pytest.mark.parametrize("bits,group", [*FORMATS, (4, 128), (8, 128)])
def test_blocks_and_kernels_hold_mlx_values_exactly(bits, group):
    """The regrouped blocks (reference dequantization), the kernels' layout (kernels.dequant) and the float32 values
    all equal mlx's own dequantization bit for bit; the decode GEMV and the prefill GEMM are its products."""
    g = torch.Generator().manual_seed(bits * group)
    t, ref = mlx_tensor(torch.randn(48, 640, generator=g), bits, group)
    assert torch.equal(t.dense(), ref)
    raw, ggml_type = t.blocks()
    assert ggml_type == (GGMLType.MLX_A4 if bits == 4 else GGMLType.MLX_A8)
    assert torch.equal(dequantize(raw.reshape(-1), ggml_type, (48, 640)), ref)
    layer = PackedLinear(640, 48)
    layer.pack(raw.reshape(-1), ggml_type)
    assert torch.equal(kernels.dequant(layer.packed, 640, ggml_type, torch.float32), ref)
    assert torch.equal(kernels.dequant(layer.packed, 640, ggml_type, torch.bfloat16), ref.bfloat16())
    ids = torch.tensor([47, 0, 5, 5])
    assert torch.equal(layer.rows(ids), ref[ids])
    for rows in (1, 3, 8):                                   # decode: activations in int16 per 32-block
        x = torch.randn(rows, 640, generator=g)
        want = x.double() @ ref.double().T
        torch.testing.assert_close(layer(x, prefill=False).double(), want, rtol=0, atol=1e-4 * want.abs().max().item())
    x = torch.randn(40, 640, generator=g)                    # prefill: the bf16 GEMM of the bf16-rounded weights
    assert torch.equal(layer(x, prefill=True), kernels.linear_bf16(x, ref.bfloat16()))


def test_gemv_rows_do_not_depend_on_their_batch_mates():
    g = torch.Generator().manual_seed(5)
    for bits in (4, 8):
        t, _ = mlx_tensor(torch.randn(64, 1024, generator=g), bits, 64)
        layer = PackedLinear(1024, 64)
        layer.pack(*t.blocks())
        x = torch.randn(8, 1024, generator=g)
        together = layer(x, prefill=False)
        for i in range(8):
            assert torch.equal(layer(x[i:i + 1], prefill=False), together[i:i + 1])


def test_f16_scales_take_q4_1_itself_and_inexact_ones_are_refused():
    g = torch.Generator().manual_seed(2)
    t, ref = mlx_tensor(torch.randn(16, 128, generator=g), 4, 64, scale_dtype=mx.float16)
    raw, ggml_type = t.blocks()
    assert ggml_type == GGMLType.Q4_1 and torch.equal(dequantize(raw.reshape(-1), ggml_type, (16, 128)), ref)
    tiny = AffineTensor("layers.0.mlp.up_proj.weight", lambda: torch.zeros(1, 4, dtype=torch.int32),
                        lambda: torch.tensor([[1 + 2 ** -20]], dtype=torch.float32), lambda: torch.zeros(1, 1), 32, 4)
    with pytest.raises(CheckpointError, match="layers.0.mlp.up_proj.weight"):
        tiny.blocks()


# ---- whole checkpoints ----

def _write(tmp_path, name: str, bits: int, group: int):
    causal, _ = build_hf(name)
    config = causal.config.to_dict()
    values = write_mlx(tmp_path / f"{name}-{bits}-{group}", config, causal.state_dict(), bits, group)
    return causal, tmp_path / f"{name}-{bits}-{group}", values


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """Every variant at every format: (transformers on mlx's dequantized values -> logits, the MLX directory)."""
    root = tmp_path_factory.mktemp("mlx")
    ids = prompt_ids()
    out = {}
    for name in VARIANTS:
        for bits, group in FORMATS:
            causal, path, values = _write(root, name, bits, group)
            state = causal.state_dict()
            state.update(hf_state(values))
            state["lm_head.weight"] = state["model.embed_tokens.weight"]      # tied: one parameter, loaded last
            causal.load_state_dict(state)
            with torch.no_grad():
                ref = causal(torch.tensor([ids])).logits[0].float()
            out[name, bits, group] = (ref, path)
    return out


@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_on_the_dequantized_weights(quantized, name, bits, group):
    ref, path = quantized[name, bits, group]
    out = gem4.load(path, dtype="float32").logits(prompt_ids())
    err = float((out - ref).abs().max() / ref.abs().max())
    print(f"{name} {bits}-bit g{group}: max|diff|/max|ref| = {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_fast_mode_keeps_the_weights_packed_and_tracks_float32(quantized, name, bits, group):
    _, path = quantized[name, bits, group]
    model = gem4.load(path)
    if model.backend != "cpu":
        pytest.skip("the compiled kernels do not run on this CPU")
    own = GGMLType.MLX_A4 if bits == 4 else GGMLType.MLX_A8
    assert model.embed_tokens.ggml_type == own and model.embed_tokens.layout == "packed"   # the tied head too
    assert model.layers[0].self_attn.q_proj.ggml_type == own
    ids = prompt_ids()
    f32 = gem4.load(path, dtype="float32").logits(ids)
    fast = model.logits(ids)
    drift = float(((fast - f32) ** 2).mean() / (f32 ** 2).mean())
    print(f"{name} {bits}-bit g{group}: fast NMSE vs float32 = {drift:.2e}")
    assert drift < (1e-2 if name == "moe" else 2e-3)


def test_inspect_names_the_quantization(quantized):
    from gem4.weights.summary import format_summary, summarize

    _, path = quantized["moe", 4, 64]
    s = summarize(open_checkpoint(path))
    assert s["tensor_types"]["MLX_A4"]["tensors"] > 0 and s["tensor_types"]["MLX_A8"]["tensors"] == 6   # routers
    assert "MLX affine" in format_summary(s)


def _corrupt(quantized, tmp_path, edit) -> str:
    from safetensors.torch import load_file, save_file

    _, path = quantized["dense_plain", 4, 64]
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    out = tmp_path / "corrupt"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((path / "config.json").read_text())
    return str(out)


def test_a_missing_scales_tensor_is_refused_by_name(quantized, tmp_path):
    path = _corrupt(quantized, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.scales"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\.scales"):
        gem4.load(path, dtype="float32")


def test_scales_of_the_wrong_shape_are_refused_by_name(quantized, tmp_path):
    def cut(t):
        t["model.layers.2.self_attn.o_proj.scales"] = t["model.layers.2.self_attn.o_proj.scales"][:, :1].clone()
    path = _corrupt(quantized, tmp_path, cut)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.o_proj\.weight.*disagrees"):
        gem4.load(path, dtype="float32")


def test_config_bits_that_contradict_the_file_are_refused(quantized, tmp_path):
    path = _corrupt(quantized, tmp_path, lambda t: None)
    cfg = json.loads((tmp_path / "corrupt" / "config.json").read_text())
    cfg["quantization"]["bits"] = 8
    (tmp_path / "corrupt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="disagrees|shape"):
        gem4.load(path, dtype="float32")


def test_other_quantization_methods_are_refused(tmp_path, quantized):
    path = _corrupt(quantized, tmp_path, lambda t: None)
    cfg = json.loads((tmp_path / "corrupt" / "config.json").read_text())
    cfg["quantization"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "corrupt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gptq"):
        open_checkpoint(path)


def test_convert_writes_gguf_only_losslessly(quantized, tmp_path):
    from gem4.weights.gguf_model import write_gguf

    ref, path = quantized["dense_plain", 8, 32]
    with pytest.raises(CheckpointError, match="losslessly only with --type f32"):
        write_gguf(open_checkpoint(path), tmp_path / "x.gguf", "q4_0")
    write_gguf(open_checkpoint(path), tmp_path / "f32.gguf", "f32")
    ids = prompt_ids()
    assert torch.equal(gem4.load(tmp_path / "f32.gguf", dtype="float32").logits(ids),
                       gem4.load(path, dtype="float32").logits(ids))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_streamed_experts_give_the_resident_logits(quantized, tmp_path, monkeypatch, bits, group, dtype):
    """26B-A4B's experts read one at a time from the MLX file into slots (2 = top_k, and all 8): the logits of
    the resident experts, bit for bit (in groups of 64 the fixture's down_proj, 32 wide, stays float)."""
    from gem4.weights import expert_files

    monkeypatch.setattr(expert_files, "repack_root", lambda: tmp_path / "repacked")
    _, path = quantized["moe", bits, group]
    ids = prompt_ids()
    resident = gem4.load(path, dtype=dtype).logits(ids)
    for slots in (2, 8):
        model = gem4.load(path, dtype=dtype, expert_cache_slots=slots)
        assert model.expert_cache.slots == slots
        assert torch.equal(model.logits(ids), resident), slots
        assert model.expert_cache.stats.misses > 0


def test_a_table_read_by_rows_stays_as_the_file_has_it():
    """The per-layer embedding of an MLX checkpoint (QuantLinear.keep_affine): its rows are mlx's values, the table
    is never regrouped nor multiplied."""
    from gem4.model.layers import QuantLinear

    g = torch.Generator().manual_seed(8)
    t, ref = mlx_tensor(torch.randn(30, 128, generator=g), 4, 64)
    table = QuantLinear(128, 30)
    q, s, b = t.parts()
    table.keep_affine(q, s, b, 4, 64)
    ids = torch.tensor([29, 0, 7, 7])
    assert table.layout == "affine" and torch.equal(table.rows(ids), ref[ids])
    with pytest.raises(RuntimeError, match="lookup table"):
        table(torch.randn(1, 128))


def test_gem4s_own_block_types_never_enter_a_gguf(tmp_path):
    """MLX_A4 / MLX_A8 are gem4's load-time blocks: the GGUF writer refuses them, the reader refuses their ids."""
    import struct

    from gem4.gguf import GGUFReader, GGUFWriter

    w = GGUFWriter(tmp_path / "a.gguf")
    with pytest.raises(ValueError, match="gem4's own block type"):
        w.add_tensor("blk.0.x", np.zeros(20, dtype=np.uint8), (32,), GGMLType.MLX_A4)
    w = GGUFWriter(tmp_path / "b.gguf")
    w.add_tensor("blk.0.x", np.zeros(20, dtype=np.uint8), (32,), GGMLType.Q4_1)
    w.write()
    data = bytearray((tmp_path / "b.gguf").read_bytes())
    at = data.find(b"blk.0.x") + len("blk.0.x")                      # n_dims u32, dims u64 each, then the type u32
    n_dims = struct.unpack_from("<I", data, at)[0]
    assert struct.unpack_from("<I", data, at + 4 + 8 * n_dims)[0] == GGMLType.Q4_1
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, int(GGMLType.MLX_A4))
    (tmp_path / "c.gguf").write_bytes(bytes(data))
    with pytest.raises(Exception, match="unknown ggml type 1004"):
        GGUFReader(tmp_path / "c.gguf")


def test_a_module_the_config_calls_float_must_not_have_scales(quantized, tmp_path):
    path = _corrupt(quantized, tmp_path, lambda t: None)
    cfg = json.loads((tmp_path / "corrupt" / "config.json").read_text())
    cfg["quantization"]["model.layers.0.mlp.down_proj"] = False
    (tmp_path / "corrupt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj.*not quantized"):
        open_checkpoint(path)
