"""Checkpoint readers and the loader: config forms, layouts, strict manifest, convert round trip, CLI."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import gem4
from gem4.cli import main as cli_main
from gem4.weights.checkpoint import CheckpointError, open_checkpoint
from gem4.gguf import GGUFReader, GGUFValueType, GGUFWriter


def copy_hf(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(directory: Path, fn) -> None:
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg.get("text_config", cfg))
    path.write_text(json.dumps(cfg))


def edit_tensors(directory: Path, fn) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def logits(path, ids):
    return gem4.load(path, dtype="float32").logits(ids)


# ---- HF checkpoints ----

def test_hub_config_form_equals_per_layer_config_form(variants, tmp_path):
    # hub configs carry global_head_dim / num_global_key_value_heads; transformers re-saves per_layer_config
    fx = variants["dense_keqv"]
    hub = copy_hf(fx.hf_mm, tmp_path / "hub")

    def to_hub_form(cfg):
        assert cfg.pop("per_layer_config") == {"2": {"head_dim": 32, "num_key_value_heads": 1},
                                               "5": {"head_dim": 32, "num_key_value_heads": 1}}
        cfg["global_head_dim"] = 32
        cfg["num_global_key_value_heads"] = 1

    edit_config(hub, to_hub_form)
    assert torch.equal(logits(hub, fx.ids), logits(fx.hf_mm, fx.ids))


def test_per_layer_config_of_ten_or_more_layers(tmp_path):
    # transformers zero-pads per_layer_config keys once a model has 10+ layers ("05", "11"): the full
    # layers' head geometry must still be read (logits equal transformers' own)
    from model_fixtures import build_hf, prompt_ids
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    causal, _ = build_hf("dense_keqv", num_hidden_layers=12, layer_types=types)
    causal.save_pretrained(tmp_path / "l12")
    cfg = json.loads((tmp_path / "l12" / "config.json").read_text())
    assert set(cfg["per_layer_config"]) == {"05", "11"}
    ids = prompt_ids()
    with torch.no_grad():
        ref = causal(torch.tensor([ids])).logits[0].float()
    out = logits(tmp_path / "l12", ids)
    assert ((out - ref) ** 2).mean() / (ref ** 2).mean() < 1e-10
    edit_config(tmp_path / "l12", lambda c: c["per_layer_config"].update({"12": {"head_dim": 32}}))
    with pytest.raises(CheckpointError, match="outside 0..11"):
        gem4.load(tmp_path / "l12", dtype="float32")


def test_sharded_checkpoint_with_index(variants, tmp_path):
    fx = variants["moe"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(fx.hf_causal / "config.json", sharded / "config.json")
    tensors = load_file(fx.hf_causal / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / fname)
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(logits(sharded, fx.ids), logits(fx.hf_causal, fx.ids))
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors is missing"):
        gem4.load(sharded, dtype="float32")


def test_weights_lie_at_aligned_addresses(variants):
    # a weight the file holds in its dtype would be a view at the file's offset; float32 matmuls round by their
    # operands' alignment on some CPUs, so the loader copies such views to 64-byte aligned memory
    model = gem4.load(variants["moe"].hf_causal, dtype="float32")
    misaligned = [n for n, t in model.state_dict().items() if t.numel() and t.data_ptr() % 64]
    assert misaligned == []


def test_ple_decided_by_tensors_not_the_config_default(variants, tmp_path):
    # transformers would default an absent hidden_size_per_layer_input to 256 and enable PLE
    fx = variants["dense_plain"]
    absent = copy_hf(fx.hf_causal, tmp_path / "absent")
    edit_config(absent, lambda c: c.pop("hidden_size_per_layer_input"))
    assert gem4.load(absent, dtype="float32").config.ple_dim == 0
    assert torch.equal(logits(absent, fx.ids), logits(fx.hf_causal, fx.ids))

    claims = copy_hf(fx.hf_causal, tmp_path / "claims")
    edit_config(claims, lambda c: c.update(hidden_size_per_layer_input=256))
    with pytest.raises(CheckpointError, match="hidden_size_per_layer_input=256 but the checkpoint has no embed_tokens_per_layer"):
        gem4.load(claims, dtype="float32")

    ple = copy_hf(variants["ple_kvshare"].hf_causal, tmp_path / "ple")
    edit_config(ple, lambda c: c.update(hidden_size_per_layer_input=0))
    with pytest.raises(CheckpointError, match=r"hidden_size_per_layer_input=0 contradicts embed_tokens_per_layer.weight \(512, 48\)"):
        gem4.load(ple, dtype="float32")


def test_missing_tensor_is_refused_by_name(variants, tmp_path):
    d = copy_hf(variants["dense_plain"].hf_causal, tmp_path / "m")
    edit_tensors(d, lambda t: t.pop("model.layers.1.self_attn.q_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing required tensor 'layers.1.self_attn.q_proj.weight' \(expected shape \(64, 64\)\)"):
        gem4.load(d, dtype="float32")


def test_tensor_disagreeing_with_config_is_refused(variants, tmp_path):
    d = copy_hf(variants["dense_plain"].hf_causal, tmp_path / "s")
    edit_config(d, lambda c: c.update(num_key_value_heads=1))
    with pytest.raises(CheckpointError, match=r"tensor 'layers.0.self_attn.k_proj.weight' has shape \(32, 64\), the model's metadata needs \(16, 64\)"):
        gem4.load(d, dtype="float32")


def test_unexpected_tensor_is_refused(variants, tmp_path):
    d = copy_hf(variants["dense_plain"].hf_causal, tmp_path / "u")
    edit_tensors(d, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'layers.0.mlp.extra_proj.weight'"):
        gem4.load(d, dtype="float32")


def test_vestigial_kv_of_shared_layers_and_the_audio_tower_are_ignored(variants, tmp_path):
    fx = variants["ple_kvshare"]
    d = copy_hf(fx.hf_mm, tmp_path / "v")

    def add(t):
        t["model.language_model.layers.4.self_attn.k_proj.weight"] = torch.randn(16, 64)   # layer 4 reuses layer 1
        t["model.language_model.layers.4.self_attn.k_norm.weight"] = torch.randn(16)
        t["model.audio_tower.output_proj.weight"] = torch.randn(8, 8)

    edit_tensors(d, add)
    ckpt = open_checkpoint(d)
    assert set(ckpt.ignored) == {"model.language_model.layers.4.self_attn.k_proj.weight",
                                 "model.language_model.layers.4.self_attn.k_norm.weight",
                                 "model.audio_tower.output_proj.weight"}
    assert torch.equal(logits(d, fx.ids), logits(fx.hf_mm, fx.ids))


def test_vision_tensors_without_a_vision_config_are_refused(variants, tmp_path):
    d = copy_hf(variants["ple_kvshare"].hf_mm, tmp_path / "v")
    edit_tensors(d, lambda t: t.update({"model.vision_tower.encoder.weight": torch.randn(8, 8)}))
    with pytest.raises(CheckpointError, match="vision tower tensors .*'model.vision_tower.encoder.weight'.* no vision_config"):
        open_checkpoint(d)


def test_config_without_layer_types_is_refused(variants, tmp_path):
    d = copy_hf(variants["dense_plain"].hf_causal, tmp_path / "lt")
    edit_config(d, lambda c: c.pop("layer_types"))
    with pytest.raises(CheckpointError, match="config.json lacks 'layer_types'"):
        gem4.load(d, dtype="float32")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        gem4.load(tmp_path / "nothing", dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="is not a Gemma 4 text model"):
        gem4.load(tmp_path, dtype="float32")


def test_bad_dtype(variants):
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        gem4.load(variants["dense_plain"].hf_causal, dtype="float16")


# ---- GGUF: config from metadata, refusals ----

def test_gguf_config_equals_hf_config(variants):
    # GGUF stores eps as f32 and the full-layer RoPE as rope_freqs factors: equal up to float32 rounding
    for fx in variants.values():
        a, b = open_checkpoint(fx.gguf["f32"]).config, open_checkpoint(fx.hf_causal).config
        assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-7)
        assert dataclasses.replace(a, rope_inv_freq=(), rms_norm_eps=0.0) == dataclasses.replace(b, rope_inv_freq=(), rms_norm_eps=0.0)
        for (ta, fa), (tb, fb) in zip(a.rope_inv_freq, b.rope_inv_freq):
            assert ta == tb and np.allclose(fa, fb, rtol=1e-6, atol=1e-30)


def rewrite_gguf(src: Path, dst: Path, *, drop_keys=(), set_keys=None, drop_tensors=(), rename=None,
                 extra_tensors=None) -> Path:
    """Copy a GGUF with edits (test helper built on our own reader/writer)."""
    set_keys, rename = set_keys or {}, rename or {}
    r = GGUFReader(src)
    w = GGUFWriter(dst)
    for key, value in r.metadata.items():
        if key in drop_keys:
            continue
        if key in set_keys:
            w.add(key, *set_keys[key])
        elif r.metadata_types[key] == GGUFValueType.ARRAY:
            w.add(key, value, GGUFValueType.ARRAY, r.array_types[key])
        else:
            w.add(key, value, r.metadata_types[key])
    for name, info in r.tensors.items():
        if name not in drop_tensors:
            w.add_tensor(rename.get(name, name), r.tensor_data(name).copy(), info.shape, info.ggml_type)
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array, array.shape, 0)                 # float32
    w.write()
    r.close()
    return dst


def test_gguf_missing_tensor(variants, tmp_path):
    bad = rewrite_gguf(variants["dense_plain"].gguf["f32"], tmp_path / "m.gguf", drop_tensors={"blk.3.ffn_up.weight"})
    with pytest.raises(CheckpointError, match=r"m.gguf: missing required tensor 'layers.3.mlp.up_proj.weight'"):
        gem4.load(bad, dtype="float32")


def test_gguf_shape_mismatch_vs_metadata(variants, tmp_path):
    bad = rewrite_gguf(variants["dense_plain"].gguf["f32"], tmp_path / "s.gguf",
                       set_keys={"gemma4.feed_forward_length": (96, GGUFValueType.UINT32)})
    with pytest.raises(CheckpointError, match=r"tensor 'layers.0.mlp.gate_proj.weight' has shape \(128, 64\), the model's metadata needs \(96, 64\)"):
        gem4.load(bad, dtype="float32")


def test_gguf_missing_required_key(variants, tmp_path):
    bad = rewrite_gguf(variants["dense_plain"].gguf["f32"], tmp_path / "k.gguf",
                       drop_keys={"gemma4.attention.sliding_window"})
    with pytest.raises(CheckpointError, match="missing required metadata key 'gemma4.attention.sliding_window'"):
        gem4.load(bad, dtype="float32")


def test_gguf_wrong_architecture_and_unknown_tensor(variants, tmp_path):
    src = variants["dense_plain"].gguf["f32"]
    bad = rewrite_gguf(src, tmp_path / "a.gguf", set_keys={"general.architecture": ("llama", GGUFValueType.STRING)})
    with pytest.raises(CheckpointError, match="the architecture is 'llama'; gem4 runs Gemma 4"):
        gem4.load(bad, dtype="float32")
    renamed = rewrite_gguf(src, tmp_path / "t.gguf", rename={"blk.2.attn_q.weight": "blk.2.attn_mystery.weight"})
    with pytest.raises(CheckpointError, match="unknown tensor 'blk.2.attn_mystery.weight'"):
        gem4.load(renamed, dtype="float32")


def test_gguf_container_error_surfaces_as_checkpoint_error(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    with pytest.raises(CheckpointError, match="junk.gguf"):
        gem4.load(path, dtype="float32")


def test_gguf_vestigial_kv_on_shared_layer_is_ignored(variants, tmp_path):
    fx = variants["ple_kvshare"]
    src = fx.gguf["f32"]
    dst = rewrite_gguf(src, tmp_path / "vest.gguf", extra_tensors={"blk.5.attn_k.weight": np.zeros((32, 64), np.float32)})
    assert open_checkpoint(dst).ignored == ["blk.5.attn_k.weight"]
    assert torch.equal(logits(dst, fx.ids), logits(src, fx.ids))


# ---- convert ----

@pytest.mark.parametrize("out_type", ["f32", "bf16", "q8_0"])
def test_convert_is_read_back_by_the_gguf_package(variants, tmp_path, out_type):
    fx = variants["ple_kvshare"]
    out = tmp_path / f"{out_type}.gguf"
    assert cli_main(["convert", str(fx.hf_mm), str(out), "--type", out_type]) == 0
    oracle = gguf.GGUFReader(out)
    ours = GGUFReader(out)
    assert [t.name for t in oracle.tensors] == list(ours.tensors)
    assert set(oracle.fields) == set(ours.metadata) | {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    assert oracle.fields["general.architecture"].contents() == "gemma4"
    assert oracle.fields["gemma4.feed_forward_length"].contents() == [128, 128, 128, 256, 256, 256]
    assert oracle.fields["gemma4.attention.shared_kv_layers"].contents() == 3
    assert oracle.fields["gemma4.embedding_length_per_layer_input"].contents() == 8
    by_name = {t.name: t for t in oracle.tensors}
    rope = by_name["rope_freqs.weight"]
    assert list(rope.data) == [1.0] * 4 + [1e30] * 12           # 0.25 of 32 dims rotate: 4 pairs
    q = by_name["blk.2.attn_q.weight"]
    assert list(q.shape) == [64, 128]                           # ne order
    assert by_name["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    src = load_file(fx.hf_mm / "model.safetensors")["model.language_model.layers.2.self_attn.q_proj.weight"]
    back = gguf.quants.dequantize(q.data, q.tensor_type).reshape(128, 64)
    tol = {"f32": 0, "bf16": 0, "q8_0": 0.01}[out_type]
    assert np.abs(back - src.numpy()).max() <= tol
    ours.close()


def test_convert_refuses_a_gguf_source(variants, tmp_path, capsys):
    assert cli_main(["convert", str(variants["moe"].gguf["f32"]), str(tmp_path / "x.gguf")]) == 2
    assert "convert reads HF checkpoint directories" in capsys.readouterr().err


# ---- inspect ----

def test_inspect_json_describes_the_checkpoint(variants, capsys):
    assert cli_main(["inspect", str(variants["ple_kvshare"].gguf["q4_0"]), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["variant"] == "ple+kv-sharing (E2B/E4B-like)"
    assert s["first_shared_layer"] == 3
    assert [l["kv_source"] for l in s["layers"]] == [0, 1, 2, 1, 1, 2]
    assert [l["mlp"] for l in s["layers"]] == [128, 128, 128, 256, 256, 256]
    assert s["tensor_types"]["Q4_0"]["tensors"] > 0
    # 1 KV head: sliding 16 dims, full 32 dims, K+V in bf16; layers 0,1 sliding and 2 full own KV
    assert s["kv_bytes_per_token"] == {"dtype": "bfloat16", "sliding_attention": 2 * (2 * 16 * 2),
                                       "full_attention": 2 * 32 * 2}
    # --kv-cache-dtype int8: a byte a value and a float32 scale per position and KV head
    assert cli_main(["inspect", str(variants["ple_kvshare"].gguf["q4_0"]), "--json", "--kv-cache-dtype", "int8"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["kv_bytes_per_token"] == {"dtype": "int8", "sliding_attention": 2 * (2 * (16 + 4)),
                                       "full_attention": 2 * (32 + 4)}


def test_inspect_text_and_errors(variants, capsys, tmp_path):
    assert cli_main(["inspect", str(variants["moe"].hf_causal)]) == 0
    text = capsys.readouterr().out
    assert "moe (26B-A4B-like)" in text and "experts        8 x 32, top-2" in text
    assert cli_main(["inspect", str(tmp_path / "missing.gguf")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_convert_carries_the_tokenizer_and_chat_template(variants, tmp_path):
    from text_fixtures import templates, tiny_tokenizer_dir

    from gem4.tokenizer import Tokenizer

    d = copy_hf(variants["dense_plain"].hf_causal, tmp_path / "with_tok")
    for f in tiny_tokenizer_dir().iterdir():
        shutil.copy(f, d / f.name)
    out = tmp_path / "tok.gguf"
    assert cli_main(["convert", str(d), str(out), "--type", "f32"]) == 0
    from_gguf, from_hf = Tokenizer.from_file(out), Tokenizer.from_file(d)
    assert from_gguf.chat_template == from_hf.chat_template == templates()["C"]
    assert from_gguf.vocab_size == from_hf.vocab_size == 512
    corpus = ["Hello world!", "<|turn>user\nhi<turn|>\n", '<|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|>', "  a\n\n b ü"]
    for text in corpus:
        for special in (False, True):
            assert from_gguf.encode(text, parse_special=special) == from_hf.encode(text, parse_special=special)
    assert [from_gguf.token_type(i) for i in range(512)] == [from_hf.token_type(i) for i in range(512)]
    assert torch.equal(logits(out, variants["dense_plain"].ids), logits(d, variants["dense_plain"].ids))
    # the special ids under llama.cpp's key names, read back by gem4 and by the gguf package
    special = {k: getattr(from_hf.special, k) for k in ("bos", "eos", "unk", "pad")}
    assert None not in special.values()
    assert {k: getattr(from_gguf.special, k) for k in special} == special
    fields = gguf.GGUFReader(out).fields
    read = {k: int(fields[f"tokenizer.ggml.{key}_token_id"].parts[-1][0])
            for k, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    assert read == special
