"""The audio tower in llama.cpp's mmproj GGUF (weights/mmproj.py, docs/multimodal.md §2.4): a tiny E2B-like
checkpoint with both towers, converted by `gem4 convert` into a text GGUF and an mmproj, loaded with
`gem4.load(gguf, mmproj=...)`, gives the audio embeddings (0.0 apart in float32) and the logits of a prompt with a
clip and an image that the HF checkpoint gives; a corrupt or mismatched audio part is refused by name. Where
llama.cpp's converter is at hand (GEM4_LLAMA_CPP), its mmproj with the audio tower is the same tensors, types and
bytes as gem4's, and loads to the same tower."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

import gem4
from gem4.cli import main
from gem4.ggml import GGMLType
from gem4.gguf import GGUFReader
from gem4.media.image import preprocess
from gem4.model.audio import encode_audio
from gem4.model.gemma4 import MediaItem
from gem4.weights.checkpoint import CheckpointError
from gem4.weights.mmproj import IMAGE_TOKENS, VIDEO_TOKEN
from audio_fixtures import build_audio_hf
from test_audio_tower import clip, hf_embeddings
from test_mmproj import llama_cpp_mmproj, needs_llama_cpp, rewrite, tokenizer_with_media_tokens
from text_fixtures import tiny_vocab, write_hf_dir
from vision_fixtures import TOKEN_IDS, sample_image


class AudioPair:
    """An E2B-like checkpoint with both towers, and gem4's float32 loads of it and of its converted GGUF + mmproj."""

    def __init__(self, root):
        self.hf = build_audio_hf(seed=7, vision=True)
        self.dir = root / "av"
        self.hf.save_pretrained(self.dir)
        tokenizer_with_media_tokens(self.dir)
        self.gguf, self.mmproj = root / "av.gguf", root / "mmproj-av.gguf"
        assert main(["convert", str(self.dir), str(self.gguf), "--type", "f32"]) == 0
        self.ref = gem4.load(self.dir, dtype="float32")
        self.model = gem4.load(self.gguf, dtype="float32", mmproj=self.mmproj)
        self.wave = clip(16123, seed=1)
        self.want = self.encode(self.ref)
        self.image = preprocess(sample_image(96, 144, seed=3), 70, patch_size=16, pooling=3)

    def encode(self, model) -> torch.Tensor:
        return encode_audio(model.audio, self.wave).embeddings

    def logits(self, model) -> torch.Tensor:
        """A prompt with a clip and an image, through `model`'s own towers."""
        audio, image = self.encode(model), model.vision.encode(self.image.patches, self.image.positions,
                                                                self.image.grid)
        ids = [2, 10, TOKEN_IDS["boa_token_id"]]
        media = [MediaItem(len(ids), audio, False)]
        ids += [TOKEN_IDS["audio_token_id"]] * audio.shape[0] + [TOKEN_IDS["eoa_token_id"], 20, TOKEN_IDS["boi_token_id"]]
        media.append(MediaItem(len(ids), image, False))
        ids += [TOKEN_IDS["image_token_id"]] * image.shape[0] + [TOKEN_IDS["eoi_token_id"], 30, 31]
        return model.logits(ids, media)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return AudioPair(tmp_path_factory.mktemp("mmproj-audio"))


def test_the_mmproj_audio_tower_equals_the_hf_checkpoints(pair):
    assert pair.model.audio.config == pair.ref.audio.config          # every fact, the token ids included
    got = pair.encode(pair.model)
    err = float((got - pair.want).abs().max())
    print(f"audio embeddings through gem4's mmproj, max |diff| {err:.1e} (magnitude {float(pair.want.abs().max()):.1f})")
    assert err == 0.0
    theirs = hf_embeddings(pair.hf, pair.wave)                       # and transformers': within 1e-5 of their
    rel = float((got - theirs).abs().max() / theirs.abs().max())     # magnitude (float32 summation order apart)
    print(f"audio embeddings vs transformers, max |diff| / magnitude {rel:.1e}")
    assert rel < 1e-5
    want = pair.logits(pair.ref)
    err = float((pair.logits(pair.model) - want).abs().max() / want.abs().max())
    print(f"logits of a prompt with a clip and an image, GGUF pair vs HF, max relative |diff| {err:.1e}")
    assert err == 0.0


def test_softplus_applied_again_to_the_stored_scale_moves_the_embeddings(pair, monkeypatch):
    """P18: the file holds softplus(per_dim_scale); a reader that applies it again hears another model."""
    for layer in pair.model.audio.audio_tower.layers:
        monkeypatch.setattr(layer.self_attn, "softplus_applied", False)
    err = float((pair.encode(pair.model) - pair.want).abs().max() / pair.want.abs().max())
    print(f"softplus twice through the mmproj: audio embeddings max relative |diff| {err:.1e}")
    assert err > 1e-2


def test_the_mmproj_audio_layout_is_llama_cpps(pair):
    hf = {n.removeprefix("model."): t for n, t in pair.hf.state_dict().items()}
    layer = "audio_tower.layers.1."
    with GGUFReader(pair.mmproj) as r:
        md = r.metadata
        assert (md["clip.has_audio_encoder"], md["clip.audio.projector_type"], md["clip.audio.num_mel_bins"]) == \
            (True, "gemma4a", 128)
        assert (md["clip.audio.embedding_length"], md["clip.audio.feed_forward_length"], md["clip.audio.block_count"],
                md["clip.audio.attention.head_count"], md["clip.audio.projection_dim"]) == (32, 128, 2, 2, 64)
        data = lambda name: torch.from_numpy(np.array(r.tensor_data(name)).view(np.float32)).reshape(
            r.tensors[name].shape)
        # softplus applied once at conversion; the depthwise kernel squeezed; the light conv's norms by llama.cpp's
        # names (its conv_norm is transformers' pre_layer_norm); bounds as [1]
        assert torch.equal(data("a.blk.1.per_dim_scale.weight"),
                           torch.nn.functional.softplus(hf[layer + "self_attn.per_dim_scale"]))
        assert torch.equal(data("a.blk.1.conv_dw.weight"), hf[layer + "lconv1d.depthwise_conv1d.weight"][:, 0])
        assert torch.equal(data("a.blk.1.conv_norm.weight"), hf[layer + "lconv1d.pre_layer_norm.weight"])
        assert torch.equal(data("a.blk.1.norm_conv.weight"), hf[layer + "lconv1d.conv_norm.weight"])
        assert torch.equal(data("a.blk.1.ffn_up_1.input_max"), hf[layer + "feed_forward2.ffw_layer_1.input_max"][None])
        assert torch.equal(data("a.conv1d.1.weight"), hf["audio_tower.subsample_conv_projection.layer1.conv.weight"])
        assert {"a.pre_encode.out.bias", "mm.a.input_projection.weight", "a.blk.0.attn_k_rel.weight"} <= set(r.tensors)


def test_a_q8_0_mmproj_keeps_llama_cpps_f32_tensors_and_dequantizes(pair, tmp_path):
    gguf, mmproj = tmp_path / "t.gguf", tmp_path / "m.gguf"
    assert main(["convert", str(pair.dir), str(gguf), "--type", "q8_0", "--mmproj", str(mmproj)]) == 0
    with GGUFReader(mmproj) as r:
        types = {n: t.ggml_type for n, t in r.tensors.items()}
    assert types["a.blk.0.ffn_up.weight"] == types["a.pre_encode.out.weight"] == GGMLType.Q8_0
    assert types["a.conv1d.0.weight"] == types["a.input_projection.weight"] == types["a.blk.0.conv_dw.weight"] \
        == types["a.blk.0.per_dim_scale.weight"] == GGMLType.F32
    assert types["mm.a.input_projection.weight"] == GGMLType.F16            # 48 columns: not whole Q8_0 blocks
    model = gem4.load(pair.gguf, dtype="float32", mmproj=mmproj)
    assert model.audio.audio_tower.layers[0].feed_forward1.ffw_layer_1.linear.weight.dtype == torch.float32
    err = float((pair.encode(model) - pair.want).abs().max() / pair.want.abs().max())
    print(f"q8_0 mmproj: audio embeddings max relative |diff| {err:.1e}")
    assert 0 < err < 0.05


@pytest.mark.parametrize("edit, message", [
    (dict(drop=("a.blk.1.ln2.weight",)), "missing required tensor 'a.blk.1.ln2.weight'"),
    (dict(drop=("a.blk.0.conv_dw.weight",)), "missing required tensor 'a.blk.0.conv_dw.weight'"),
    (dict(meta={"clip.audio.projector_type": "ultravox"}), "clip.audio.projector_type 'ultravox'"),
    (dict(meta={"clip.audio.block_count": 3}), "missing required tensor 'a.blk.2."),
    (dict(meta={"clip.audio.num_mel_bins": 80}), "num_mel_bins 80 is not the 128 log-mel bins"),
    (dict(meta={"clip.audio.feed_forward_length": 96}), "feed_forward_length 96 is not 4 x"),
    (dict(meta={"clip.audio.attention.head_count": 3}), "not a multiple of its 3 heads"),
    (dict(meta={"clip.audio.embedding_length": 48, "clip.audio.feed_forward_length": 192}),
     "'a.input_projection.weight' has shape (32, 256)"),
    (dict(meta={"clip.audio.projection_dim": 96}), "clip.audio.projection_dim 96 is not the text model's width 64"),
    (dict(meta={"clip.has_audio_encoder": False}), "unexpected tensor 'a."),
    (dict(tensor=("a.conv1d.1.weight", np.zeros((8, 64, 3, 3), np.float32))), "'a.conv1d.1.weight' has shape"),
    (dict(extra={"a.blk.0.attn_q.bias": np.zeros(32, np.float32)}), "unexpected tensor 'a.blk.0.attn_q.bias'"),
])
def test_a_corrupt_audio_tower_is_refused_by_name(pair, tmp_path, edit, message):
    bad = rewrite(pair.mmproj, tmp_path / "bad.gguf", **edit)
    with pytest.raises(CheckpointError, match="mmproj .*" + re.escape(message)):
        gem4.load(pair.gguf, dtype="float32", mmproj=bad)


def test_a_text_gguf_without_audio_tokens_is_refused(pair, tmp_path):
    d = tmp_path / "images-only"
    shutil.copytree(pair.dir, d, ignore=shutil.ignore_patterns("tokenizer*"))
    tokens, types, merges = tiny_vocab()
    for field, text in [*IMAGE_TOKENS.items(), ("video_token_id", VIDEO_TOKEN)]:
        tokens[TOKEN_IDS[field]], types[TOKEN_IDS[field]] = text, 3
    write_hf_dir(d, tokens, types, merges)
    assert main(["convert", str(d), str(tmp_path / "t.gguf"), "--type", "f32", "--mmproj", str(tmp_path / "m.gguf")]) == 0
    with pytest.raises(CheckpointError, match=re.escape("vocabulary has no '<|audio|>' token")):
        gem4.load(tmp_path / "t.gguf", dtype="float32", mmproj=tmp_path / "m.gguf")


@pytest.mark.parametrize("key, value, field", [("attention_context_left", 7, "context_left 7"),
                                               ("attention_logit_cap", 30.0, "logit_cap 30.0"),
                                               ("rms_norm_eps", 1e-5, "rms_norm_eps 1e-05")])
def test_convert_refuses_an_audio_config_the_mmproj_cannot_hold(pair, tmp_path, capsys, key, value, field):
    """llama.cpp's gemma4a graph fixes these (the file has no key for them): a checkpoint that says otherwise would
    load as another model. Refused before anything is written: no text GGUF is left behind."""
    d = tmp_path / "other"
    shutil.copytree(pair.dir, d)
    config = json.loads((d / "config.json").read_text())
    config["audio_config"][key] = value
    (d / "config.json").write_text(json.dumps(config))
    assert main(["convert", str(d), str(tmp_path / "t.gguf"), "--type", "f32"]) == 2
    assert f"audio_config {field}: llama.cpp's mmproj holds only" in capsys.readouterr().err
    assert not (tmp_path / "t.gguf").exists() and not (tmp_path / "mmproj-t.gguf").exists()


def test_run_takes_an_audio_mmproj_as_llama_server_does(pair, tmp_path, capsys):
    """`gem4 run MODEL.gguf --mmproj FILE --audio PATH --image PATH` answers as `gem4 run HF_DIR ...` (greedy)."""
    import soundfile

    wav, png = tmp_path / "a.wav", tmp_path / "a.png"
    soundfile.write(wav, pair.wave, 16000, subtype="FLOAT")
    sample_image(96, 144, seed=3).save(png)
    args = ["--audio", str(wav), "--image", str(png), "-p", "what is this?", "--temperature", "0", "-n", "6",
            "--dtype", "float32", "--prefill-chunk", "512"]
    answers = []
    for model in ([str(pair.dir)], [str(pair.gguf), "--mmproj", str(pair.mmproj)]):
        assert main(["run", *model, *args]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and answers[0].strip()


@needs_llama_cpp
@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_llama_cpps_mmproj_with_the_audio_tower_is_gem4s(pair, tmp_path, outtype):
    theirs = llama_cpp_mmproj(pair, tmp_path, outtype)
    ours = tmp_path / "ours.gguf"
    assert main(["convert", str(pair.dir), str(tmp_path / "t.gguf"), "--type", outtype, "--mmproj", str(ours)]) == 0
    with GGUFReader(theirs) as a, GGUFReader(ours) as b:
        assert set(a.tensors) == set(b.tensors) and any(n.startswith("a.blk.") for n in a.tensors)
        for name, info in a.tensors.items():
            assert (info.shape, info.ggml_type) == (b.tensors[name].shape, b.tensors[name].ggml_type), name
            assert np.array_equal(a.tensor_data(name), b.tensor_data(name)), name
        keys = [k for k in a.metadata if k.startswith("clip.") or k in ("general.file_type", "general.type")]
        assert set(keys) == {k for k in b.metadata if k.startswith("clip.")} | {"general.file_type", "general.type"}
        for key in keys:
            assert a.metadata_types[key] == b.metadata_types[key], key
            assert np.array_equal(np.asarray(a.metadata[key]), np.asarray(b.metadata[key])), key
    model = gem4.load(pair.gguf, dtype="float32", mmproj=theirs)
    err = float((pair.encode(model) - pair.want).abs().max() / pair.want.abs().max())
    print(f"{outtype}: audio embeddings through llama.cpp's mmproj, max relative |diff| {err:.1e}")
    if outtype == "f32":
        assert err == 0.0 and model.audio.config == pair.ref.audio.config
        assert torch.equal(pair.logits(model), pair.logits(pair.ref))
        assert not model.vision.config.bidirectional             # per-layer embeddings: causal over images


def test_inspect_shows_the_towers_of_a_gguf_pair_and_of_the_hf_checkpoint(pair, capsys):
    """`gem4 inspect MODEL.gguf --mmproj FILE` describes both towers as `gem4 inspect HF_DIR` does; only the stored
    types and bytes differ (a q8_0 pair would differ more)."""
    assert main(["inspect", str(pair.dir), "--json"]) == 0
    hf = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(pair.gguf), "--mmproj", str(pair.mmproj), "--json"]) == 0
    gguf = json.loads(capsys.readouterr().out)
    hf["vision"]["rms_norm_eps"] = float(np.float32(hf["vision"]["rms_norm_eps"]))   # a GGUF keeps it float32
    for tower in ("vision", "audio"):
        assert hf[tower] == gguf[tower], tower                  # float32 both: the same facts, tensors and bytes
    audio = hf["audio"]
    assert (audio["layers"], audio["hidden_size"], audio["tensor_types"]["F32"]["tensors"]) == (2, 32, audio["tensors"])
    assert audio["parameters"] == sum(p.numel() for n, p in pair.hf.named_parameters() if "audio" in n) + \
        sum(b.numel() for n, b in pair.hf.named_buffers() if "audio" in n and n.endswith(("_min", "_max")))
    assert audio["bytes"] == 4 * audio["parameters"]
    assert main(["inspect", str(pair.gguf), "--mmproj", str(pair.mmproj)]) == 0
    text = capsys.readouterr().out
    assert "vision tower   2 layers x 32" in text and f"{audio['parameters']:,} parameters" in text
    assert main(["inspect", str(pair.gguf), "--json"]) == 0                 # the GGUF alone: no towers
    alone = json.loads(capsys.readouterr().out)
    assert alone["vision"] is None and alone["audio"] is None


def test_convert_says_an_audio_tower_without_a_vision_tower_is_not_written(tmp_path, capsys):
    """llama.cpp's mmproj holds Gemma 4's audio beside its vision tower: a checkpoint with audio alone gets no
    mmproj, and is told so."""
    build_audio_hf(seed=3).save_pretrained(tmp_path / "audio-only")
    tokenizer_with_media_tokens(tmp_path / "audio-only")
    assert main(["convert", str(tmp_path / "audio-only"), str(tmp_path / "t.gguf"), "--type", "f32"]) == 0
    assert "note: the audio tower is not written" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audio-only", "t.gguf"]
