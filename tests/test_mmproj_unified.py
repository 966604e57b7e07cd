"""The 12B's ("unified") mmproj GGUF (weights/mmproj.py, docs/multimodal.md §2.6): a tiny random
`Gemma4UnifiedForConditionalGeneration` converted by `gem4 convert` into a text GGUF and an mmproj (projectors
"gemma4uv" / "gemma4ua"), loaded with `gem4.load(gguf, mmproj=...)`, gives the image and audio soft tokens and the
logits the HF checkpoint gives. Where llama.cpp's own converter is at hand (GEM4_LLAMA_CPP, as tests/test_mmproj.py),
its 12B mmproj holds the same tensors, types, bytes and keys as gem4's and loads to the same embedder."""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
import torch

import gem4
from gem4.cli import main
from gem4.engine.media import media_prompt
from gem4.gguf import GGUFReader
from gem4.media.image import preprocess
from gem4.model.audio import encode_audio
from gem4.model.gemma4 import MediaItem
from gem4.weights import mmproj
from gem4.weights.checkpoint import CheckpointError
from gem4.weights.mmproj import AUDIO_TOKENS, IMAGE_TOKENS, VIDEO_TOKEN
from test_mmproj import llama_cpp_mmproj, needs_llama_cpp, rewrite
from text_fixtures import tiny_vocab, write_hf_dir
from unified_fixtures import build_unified_hf, clip
from vision_fixtures import TOKEN_IDS, sample_image

EXACT = 1e-6          # float32 both ways: the same values, the same operations
BUDGET = 70
# every key llama.cpp's converter writes but general.name and general.size_label (its own naming heuristics)
KEYS = ("general.architecture", "general.type", "general.file_type", "clip.has_vision_encoder",
        "clip.vision.projection_dim", "clip.vision.image_size", "clip.vision.patch_size",
        "clip.vision.embedding_length", "clip.vision.feed_forward_length", "clip.vision.block_count",
        "clip.vision.attention.head_count", "clip.vision.image_mean", "clip.vision.image_std",
        "clip.has_audio_encoder", "clip.audio.projection_dim", "clip.audio.embedding_length",
        "clip.audio.feed_forward_length", "clip.audio.block_count", "clip.audio.attention.head_count",
        "clip.vision.projector_type", "clip.vision.attention.layer_norm_epsilon", "clip.audio.projector_type",
        "clip.audio.num_mel_bins", "clip.audio.attention.layer_norm_epsilon", "general.quantization_version")


class Pair:
    """The 12B HF checkpoint and gem4's float32 loads of it and of its converted GGUF + mmproj."""

    def __init__(self, root):
        self.hf = build_unified_hf()
        self.dir = root / "unified"
        self.hf.save_pretrained(self.dir)
        tokens, types, merges = tiny_vocab()           # the media tokens named as Gemma 4 names them
        for field, text in [*IMAGE_TOKENS.items(), ("video_token_id", VIDEO_TOKEN), *AUDIO_TOKENS.items()]:
            tokens[TOKEN_IDS[field]], types[TOKEN_IDS[field]] = text, 3
        present = set(tokens)                           # (the audio ids displace pieces some merges make)
        merges = [m for m in merges if m.replace(" ", "", 1) in present and set(m.split(" ", 1)) <= present]
        write_hf_dir(self.dir, tokens, types, merges)
        self.gguf = root / "unified.gguf"
        self.mmproj = root / "mmproj-unified.gguf"
        assert main(["convert", str(self.dir), str(self.gguf), "--type", "f32"]) == 0
        self.ref = gem4.load(self.dir, dtype="float32")
        self.model = gem4.load(self.gguf, dtype="float32", mmproj=self.mmproj)
        vc = self.ref.vision.config
        self.image = preprocess(sample_image(96, 144, seed=3), BUDGET, patch_size=vc.patch_size, pooling=vc.pooling,
                                processor=vc.image_processor)
        self.wave = clip(4000, seed=2)
        self.want = self.encode(self.ref)
        template = [2, 10, vc.image_token_id, 20, self.ref.audio.config.audio_token_id, 21]
        self.ids, self.inputs = media_prompt(template, [self.image, self.wave], vision=vc, audio=self.ref.audio.config)

    def encode(self, model) -> tuple[torch.Tensor, torch.Tensor]:
        return (model.vision.encode(self.image.patches, self.image.positions, self.image.grid),
                encode_audio(model.audio, self.wave).embeddings)

    def logits(self, model) -> torch.Tensor:
        image, audio = self.encode(model)
        media = [MediaItem(self.inputs[0].start, image, model.vision.config.bidirectional),
                 MediaItem(self.inputs[1].start, audio, False)]
        return model.logits(self.ids, media)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("mmproj-unified"))


def test_the_12b_through_its_mmproj_equals_the_hf_checkpoint(pair):
    ref = pair.ref.vision.config                    # every fact; GGUF keeps eps in float32
    assert pair.model.vision.config == replace(ref, rms_norm_eps=float(np.float32(ref.rms_norm_eps)))
    assert pair.model.audio.config == replace(pair.ref.audio.config,
                                              rms_norm_eps=float(np.float32(pair.ref.audio.config.rms_norm_eps)))
    for got, want, what in zip(pair.encode(pair.model), pair.want, ("image", "audio")):
        err = float((got - want).abs().max())
        print(f"12B {what} embeddings through the mmproj, max |diff| {err:.1e}")
        assert err <= EXACT
    want = pair.logits(pair.ref)
    err = float((pair.logits(pair.model) - want).abs().max() / want.abs().max())
    print(f"12B logits of a prompt with an image and a clip through the mmproj, max relative |diff| {err:.1e}")
    assert err <= EXACT


def test_the_12b_mmproj_layout_is_llama_cpps(pair):
    with GGUFReader(pair.mmproj) as r:
        md = r.metadata
        assert (md["clip.vision.projector_type"], md["clip.audio.projector_type"]) == ("gemma4uv", "gemma4ua")
        assert (md["clip.vision.patch_size"], md["clip.audio.embedding_length"], md["clip.vision.block_count"]) == \
            (16, 640, 0)
        assert r.tensors["v.patch_embd.weight"].shape == (48, 48 * 48 * 3)
        assert r.tensors["v.position_embd.weight"].shape == (2, 64, 48)
        assert {"v.patch_norm.1.weight", "v.patch_norm.3.bias", "mm.input_projection.weight",
                "mm.a.input_projection.weight"} <= set(r.tensors)
        # patch_dense's columns and patch_ln1 in (channel, row, column) order: column 1 is the red of pixel (0, 1)
        stored = np.asarray(r.tensor_data("v.patch_embd.weight")).view(np.float32).reshape(48, -1)     # an f32 file
        hf = pair.hf.model.embed_vision.patch_dense.weight.detach().numpy()
        assert np.array_equal(stored[:, 1], hf[:, 3]) and np.array_equal(stored[:, 48 * 48], hf[:, 1])


def test_pitfall_the_chw_permutation_not_undone(pair, monkeypatch):
    """P18: llama.cpp's converter stores patch_dense's columns and patch_ln1 in CHW order; read as they lie, the
    embedder sees every pixel's channels in another place."""
    monkeypatch.setattr(mmproj, "chw_order", lambda p: torch.arange(p * p * 3))
    model = gem4.load(pair.gguf, dtype="float32", mmproj=pair.mmproj)
    assert float((pair.encode(model)[0] - pair.want[0]).abs().max()) > 0.1


@pytest.mark.parametrize("edit, message", [
    (dict(drop=("v.patch_norm.3.bias",)), "missing required tensor 'v.patch_norm.3.bias'"),
    (dict(meta={"clip.audio.projector_type": "gemma4a"}), "clip.audio.projector_type 'gemma4a' is not the 12B's"),
    (dict(meta={"clip.vision.projection_dim": 96}), "projection_dim 96 is not the text model's width 64"),
    (dict(meta={"clip.audio.projection_dim": 96}), "projection_dim 96 is not the text model's width 64"),
    (dict(meta={"clip.vision.patch_size": 8}), "'v.patch_norm.1.weight' has shape (6912,), the clip.* keys need (1728,)"),
    (dict(meta={"clip.vision.embedding_length": 32}), "has shape"),
    (dict(meta={"clip.audio.embedding_length": 320}), "'mm.a.input_projection.weight' has shape"),
    (dict(extra={"v.blk.0.attn_q.weight": np.zeros((4, 4), np.float32)}), "unexpected tensor 'v.blk.0.attn_q"),
])
def test_a_corrupt_12b_mmproj_is_refused_by_name(pair, tmp_path, edit, message):
    bad = rewrite(pair.mmproj, tmp_path / "bad.gguf", **edit)
    with pytest.raises(CheckpointError, match="mmproj .*" + re.escape(message)):
        gem4.load(pair.gguf, dtype="float32", mmproj=bad)


def test_a_12b_mmproj_without_its_audio_gives_the_embedder(pair, tmp_path):
    vision_only = rewrite(pair.mmproj, tmp_path / "v.gguf", drop=("mm.a.input_projection.weight",),
                          meta={"clip.has_audio_encoder": False})
    model = gem4.load(pair.gguf, dtype="float32", mmproj=vision_only)
    assert model.audio is None
    image = model.vision.encode(pair.image.patches, pair.image.positions, pair.image.grid)
    assert float((image - pair.want[0]).abs().max()) <= EXACT


@needs_llama_cpp
@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_llama_cpps_12b_mmproj_is_gem4s(pair, tmp_path, outtype):
    theirs = llama_cpp_mmproj(pair, tmp_path, outtype)
    ours = tmp_path / "ours.gguf"
    assert main(["convert", str(pair.dir), str(tmp_path / "t.gguf"), "--type", outtype, "--mmproj", str(ours)]) == 0
    with GGUFReader(theirs) as a, GGUFReader(ours) as b:
        assert list(a.tensors) == list(b.tensors)                  # the same tensors in the same order
        for name, info in a.tensors.items():
            assert (info.shape, info.ggml_type) == (b.tensors[name].shape, b.tensors[name].ggml_type), name
            assert np.array_equal(a.tensor_data(name), b.tensor_data(name)), name
        assert [k for k in a.metadata if k in KEYS] == [k for k in b.metadata if k in KEYS] == list(KEYS)
        for key in KEYS:
            assert np.array_equal(np.asarray(a.metadata[key]), np.asarray(b.metadata[key])), key
    model = gem4.load(pair.gguf, dtype="float32", mmproj=theirs)
    errs = [float((got - want).abs().max()) for got, want in zip(pair.encode(model), pair.want)]
    print(f"12B {outtype}: image and audio embeddings through llama.cpp's mmproj, max |diff| {errs}")
    if outtype == "f32":
        assert max(errs) == 0.0


def test_run_takes_the_12b_with_its_mmproj_as_with_its_hf_directory(pair, tmp_path, capsys):
    """`gem4 run MODEL.gguf --mmproj FILE --image PATH --audio PATH` answers as `gem4 run HF_DIR ...` (greedy,
    float32): the command line preprocesses images with the 12B's own rule."""
    import soundfile

    image, audio = tmp_path / "a.png", tmp_path / "a.wav"
    sample_image(96, 144, seed=3).save(image)
    soundfile.write(audio, clip(8000, seed=4), 16000)
    args = ["--image", str(image), "--audio", str(audio), "-p", "what is this?", "--temperature", "0", "-n", "6",
            "--dtype", "float32", "--prefill-chunk", "512"]
    answers = []
    for model in ([str(pair.dir)], [str(pair.gguf), "--mmproj", str(pair.mmproj)]):
        assert main(["run", *model, *args]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and answers[0].strip()
