"""llama.cpp's mmproj GGUF (weights/mmproj.py, docs/multimodal.md §2.4): a tiny HF multimodal checkpoint converted by
`gem4 convert` into a text GGUF and an mmproj, loaded with `gem4.load(gguf, mmproj=...)`, gives the image embeddings
and the logits of a prompt with an image that the HF checkpoint gives; a mismatched or corrupt mmproj is refused by
name. Where llama.cpp's own converter is at hand (GEM4_LLAMA_CPP: its source directory, with convert_hf_to_gguf.py
and gguf-py; .ci/run fetches it from llama-cpp-python's sdist), its mmproj files are the same tensors, types and
bytes as gem4's and load to the same tower."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import gem4
from gem4.cli import main
from gem4.ggml import GGMLType
from gem4.gguf import GGUFReader, GGUFWriter
from gem4.media.image import preprocess
from gem4.model.gemma4 import MediaItem
from gem4.weights.checkpoint import CheckpointError
from gem4.weights.mmproj import AUDIO_TOKENS, IMAGE_TOKENS, VIDEO_TOKEN
from text_fixtures import tiny_vocab, write_hf_dir
from vision_fixtures import TOKEN_IDS, build_vision_hf, sample_image

BUDGET = 70
EXACT = 1e-6          # float32 both ways: the same values, the same operations
LLAMA_CPP = os.environ.get("GEM4_LLAMA_CPP")
needs_llama_cpp = pytest.mark.skipif(not LLAMA_CPP, reason="GEM4_LLAMA_CPP (llama.cpp's source, with its converter) "
                                                           "is not set; .ci/run sets it")


def tokenizer_with_media_tokens(directory) -> None:
    """The tiny vocabulary with the fixtures' image, video and audio token ids named as Gemma 4 names them (a GGUF
    finds them so); the merges through the pieces they replace dropped."""
    tokens, types, merges = tiny_vocab()
    for field, text in [*IMAGE_TOKENS.items(), ("video_token_id", VIDEO_TOKEN), *AUDIO_TOKENS.items()]:
        tokens[TOKEN_IDS[field]], types[TOKEN_IDS[field]] = text, 3
    present = set(tokens)
    merges = [m for m in merges if all(x in present for x in (*m.split(" ", 1), m.replace(" ", "", 1)))]
    write_hf_dir(directory, tokens, types, merges)


class Pair:
    """One flavour: the HF checkpoint and gem4's float32 loads of it and of its converted GGUF + mmproj."""

    def __init__(self, flavour: str, root):
        hf = build_vision_hf(flavour)
        self.dir = root / flavour
        hf.save_pretrained(self.dir)
        tokenizer_with_media_tokens(self.dir)
        self.gguf = root / f"{flavour}.gguf"
        assert main(["convert", str(self.dir), str(self.gguf), "--type", "f32"]) == 0
        self.mmproj = root / f"mmproj-{flavour}.gguf"
        self.ref = gem4.load(self.dir, dtype="float32")
        self.model = gem4.load(self.gguf, dtype="float32", mmproj=self.mmproj)
        image = preprocess(sample_image(96, 144, seed=3), BUDGET, patch_size=16, pooling=3)
        self.encode = lambda m: m.vision.encode(image.patches, image.positions, image.grid)
        self.want = self.encode(self.ref)
        vc = self.ref.vision.config
        self.ids = [2, 10, vc.boi_token_id] + [vc.image_token_id] * self.want.shape[0] + [vc.eoi_token_id, 20, 21]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmproj")
    return {f: Pair(f, root) for f in ("e2b", "31b")}


@pytest.mark.parametrize("flavour", ["e2b", "31b"])
def test_mmproj_tower_equals_the_hf_checkpoints(pairs, flavour):
    p = pairs[flavour]
    ref = p.ref.vision.config                 # every fact, bidirectional and token ids included; GGUF keeps eps f32
    assert p.model.vision.config == replace(ref, rms_norm_eps=float(np.float32(ref.rms_norm_eps)))
    err = float((p.encode(p.model) - p.want).abs().max())
    print(f"{flavour}: image embeddings through the mmproj, max |diff| {err:.1e}")
    assert err <= EXACT
    media = lambda m, e: [MediaItem(3, e, m.vision.config.bidirectional)]
    want = p.ref.logits(p.ids, media(p.ref, p.want))
    got = p.model.logits(p.ids, media(p.model, p.encode(p.model)))
    err = float((got - want).abs().max() / want.abs().max())
    print(f"{flavour}: logits of a prompt with an image, max relative |diff| {err:.1e}")
    assert err <= EXACT


def test_mmproj_layout_is_llama_cpps(pairs):
    with GGUFReader(pairs["e2b"].mmproj) as r:
        md = r.metadata
        assert (md["general.architecture"], md["general.type"], md["clip.vision.projector_type"]) == \
            ("clip", "mmproj", "gemma4v")
        assert md["clip.has_vision_encoder"] is True and md["clip.vision.projection_dim"] == 64
        assert r.tensors["v.patch_embd.weight"].shape == (32, 3, 16, 16)
        assert r.tensors["v.blk.0.attn_q.input_min"].shape == (1,)
        assert {"v.blk.1.ln2.weight", "v.blk.1.attn_out.weight", "mm.input_projection.weight"} <= set(r.tensors)
    with GGUFReader(pairs["31b"].mmproj) as r:
        assert "v.std_bias" in r.tensors and "v.blk.0.attn_q.input_min" not in r.tensors


def test_q8_0_mmproj_dequantizes_to_the_towers_dtype(pairs, tmp_path):
    p = pairs["31b"]
    gguf = tmp_path / "t.gguf"
    assert main(["convert", str(p.dir), str(gguf), "--type", "q8_0", "--mmproj", str(tmp_path / "m.gguf")]) == 0
    with GGUFReader(tmp_path / "m.gguf") as r:
        assert r.tensors["v.blk.0.ffn_gate.weight"].ggml_type.name == "Q8_0"
    model = gem4.load(p.gguf, dtype="float32", mmproj=tmp_path / "m.gguf")
    assert model.vision.vision_tower.encoder.layers[0].mlp.gate_proj.linear.weight.dtype == torch.float32
    err = float((p.encode(model) - p.want).abs().max() / p.want.abs().max())
    print(f"q8_0 mmproj: image embeddings max relative |diff| {err:.1e}")
    assert 0 < err < 0.05


def rewrite(src, dst, drop=(), meta=None, tensor=None, extra=None):
    """A copy of the GGUF at src with tensors dropped, metadata changed or added, one tensor's data replaced, or
    `extra` tensors ({name: float32 array}) added."""
    with GGUFReader(src) as r:
        w = GGUFWriter(dst)
        for key, value in {**r.metadata, **(meta or {})}.items():
            if key != "GGUF.version":
                w.add(key, value)
        for name, data in (extra or {}).items():
            w.add_tensor(name, data, data.shape, GGMLType.F32)
        for name, info in r.tensors.items():
            if name in drop:
                continue
            data, shape = np.array(r.tensor_data(name)), info.shape
            if tensor and name == tensor[0]:
                data, shape = tensor[1], tensor[1].shape
            w.add_tensor(name, data, shape, info.ggml_type)
        w.write()
    return dst


@pytest.mark.parametrize("edit, message", [
    (dict(drop=("v.blk.1.ln2.weight",)), "missing required tensor 'v.blk.1.ln2.weight'"),
    (dict(meta={"clip.vision.projector_type": "gemma3"}), "projector_type 'gemma3'"),
    (dict(meta={"general.architecture": "gemma4"}), "general.architecture is 'gemma4'"),
    (dict(meta={"clip.vision.block_count": 3}), "missing required tensor 'v.blk.2."),
    (dict(meta={"clip.vision.feed_forward_length": 48}), "'v.blk.0.ffn_gate.weight' has shape (64, 32)"),
    (dict(tensor=("v.patch_embd.weight", np.zeros((32, 3, 8, 32), np.float32))), "'v.patch_embd.weight' has shape"),
])
def test_corrupt_mmproj_is_refused_by_name(pairs, tmp_path, edit, message):
    p = pairs["e2b"]
    bad = rewrite(p.mmproj, tmp_path / "bad.gguf", **edit)
    with pytest.raises(CheckpointError, match="mmproj .*" + re.escape(message)):
        gem4.load(p.gguf, dtype="float32", mmproj=bad)


def test_mmproj_of_another_model_is_refused(pairs, tmp_path):
    e2b, big = pairs["e2b"], pairs["31b"]
    other = rewrite(e2b.mmproj, tmp_path / "o.gguf", meta={"clip.vision.projection_dim": 96})
    with pytest.raises(CheckpointError, match="projection_dim 96 is not the text model's width 64"):
        gem4.load(e2b.gguf, dtype="float32", mmproj=other)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(big.mmproj.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="mmproj .*t.gguf"):
        gem4.load(big.gguf, dtype="float32", mmproj=truncated)
    with pytest.raises(CheckpointError, match="an HF checkpoint"):
        gem4.load(big.dir, dtype="float32", mmproj=big.mmproj)
    with pytest.raises(CheckpointError, match="general.architecture is 'gemma4'"):
        gem4.load(big.gguf, dtype="float32", mmproj=big.gguf)


def test_text_gguf_without_image_tokens_is_refused(pairs, tmp_path):
    p = pairs["e2b"]
    shutil.copytree(p.dir, tmp_path / "plain", ignore=shutil.ignore_patterns("tokenizer*"))
    tokens, types, merges = tiny_vocab()
    write_hf_dir(tmp_path / "plain", tokens, types, merges)
    assert main(["convert", str(tmp_path / "plain"), str(tmp_path / "plain.gguf"), "--type", "f32"]) == 0
    with pytest.raises(CheckpointError, match=re.escape("vocabulary has no '<|image|>' token")):
        gem4.load(tmp_path / "plain.gguf", dtype="float32", mmproj=p.mmproj)


def llama_cpp_mmproj(pair: Pair, tmp_path: Path, outtype: str) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py --mmproj` on the pair's checkpoint (it wants image_mean/std from a processor
    config; gem4 needs none)."""
    src = tmp_path / "hf"
    shutil.copytree(pair.dir, src)
    (src / "processor_config.json").write_text(json.dumps(
        {"image_processor": {"image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0]}}))
    out = tmp_path / f"lc-mmproj-{outtype}.gguf"
    env = dict(os.environ, PYTHONPATH=str(Path(LLAMA_CPP) / "gguf-py"), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run([sys.executable, str(Path(LLAMA_CPP) / "convert_hf_to_gguf.py"), str(src), "--mmproj",
                           "--outtype", outtype, "--outfile", str(out)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@needs_llama_cpp
@pytest.mark.parametrize("flavour, outtype", [("e2b", "f32"), ("31b", "f32"), ("e2b", "f16"), ("31b", "q8_0"),
                                              ("31b", "bf16")])
def test_llama_cpps_mmproj_is_gem4s(pairs, tmp_path, flavour, outtype):
    p = pairs[flavour]
    theirs = llama_cpp_mmproj(p, tmp_path, outtype)
    ours = tmp_path / "ours.gguf"
    assert main(["convert", str(p.dir), str(tmp_path / "t.gguf"), "--type", outtype, "--mmproj", str(ours)]) == 0
    with GGUFReader(theirs) as a, GGUFReader(ours) as b:
        assert set(a.tensors) == set(b.tensors)
        for name, info in a.tensors.items():
            assert (info.shape, info.ggml_type) == (b.tensors[name].shape, b.tensors[name].ggml_type), name
            assert np.array_equal(a.tensor_data(name), b.tensor_data(name)), name
        for key in ("general.architecture", "general.type", "general.file_type", "clip.has_vision_encoder",
                    "clip.vision.projector_type", "clip.vision.projection_dim", "clip.vision.patch_size",
                    "clip.vision.embedding_length", "clip.vision.feed_forward_length", "clip.vision.block_count",
                    "clip.vision.attention.head_count", "clip.vision.attention.layer_norm_epsilon"):
            assert a.metadata[key] == b.metadata[key], key
    model = gem4.load(p.gguf, dtype="float32", mmproj=theirs)
    got = p.encode(model)
    err = float((got - p.want).abs().max())
    print(f"{flavour} {outtype}: image embeddings through llama.cpp's mmproj, max |diff| {err:.1e}")
    if outtype == "f32":
        assert err <= EXACT
        assert model.vision.config == gem4.load(p.gguf, dtype="float32", mmproj=p.mmproj).vision.config


def test_run_takes_mmproj_as_llama_server_does(pairs, tmp_path, capsys):
    """`gem4 run MODEL.gguf --mmproj FILE --image PATH` answers as `gem4 run HF_DIR --image PATH` (greedy, float32)."""
    p = pairs["31b"]
    image = tmp_path / "a.png"
    sample_image(96, 144, seed=3).save(image)
    args = ["--image", str(image), "-p", "what is this?", "--temperature", "0", "-n", "6", "--dtype", "float32",
            "--prefill-chunk", "512"]
    answers = []
    for model in ([str(p.dir)], [str(p.gguf), "--mmproj", str(p.mmproj)]):
        assert main(["run", *model, *args]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and answers[0].strip()
    assert main(["run", str(p.gguf), *args]) == 2          # the GGUF alone has no tower: the image is refused
    assert "this model has no vision tower" in capsys.readouterr().err
