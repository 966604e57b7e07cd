"""The audio tower (model/audio.py) bound from an HF checkpoint (weights/audio.py) against transformers 5.23.0.

Tiny random `Gemma4ForConditionalGeneration` models with an audio tower are built here, every audio weight
randomised (transformers' init hides bugs: per_dim_scale 0, clip bounds +-inf, norms 1) and the clip bounds
finite so that clamping fires; saved with save_pretrained and loaded with `gem4.load`. The oracle is
`model.get_audio_features(features, mask)`: its valid rows are the soft-token embeddings.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil

import numpy as np
import pytest
import torch

import gem4
from gem4.media import audio as front_end
from gem4.model import audio as tower
from gem4.weights.audio import load_audio
from gem4.weights.checkpoint import CheckpointError

from audio_fixtures import TINY_AUDIO, randomize_audio
from model_fixtures import VARIANTS, randomize

TOL = 1e-5          # float32 HF vs gem4, relative to the embeddings' scale (~1-10)
MOVED = 1e-3        # a mistake must move some embedding by at least this (100x the tolerance)

TOWERS = {
    "e2b-like": {},                                                       # chunk 12, left 13, right 0, clipped
    "short chunks": dict(attention_chunk_size=4, attention_context_left=6),
    "future frames": dict(attention_chunk_size=5, attention_context_left=4, attention_context_right=3),
    "long context": dict(attention_chunk_size=3, attention_context_left=20, attention_context_right=2),
    "unclipped": dict(use_clipped_linears=False, rms_norm_eps=1e-3, attention_logit_cap=5.0, residual_weight=0.7,
                      conv_kernel_size=3, subsampling_conv_channels=[128, 4]),
}


def build_hf(seed: int = 0, **audio_overrides):
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

    audio = Gemma4AudioConfig(**{**TINY_AUDIO, **audio_overrides})
    model = Gemma4ForConditionalGeneration(Gemma4Config(
        text_config=Gemma4TextConfig(**VARIANTS["ple_kvshare"]), audio_config=audio, vision_config=None)).eval()
    randomize(model.model.language_model, seed)
    randomize_audio(model, seed)
    return model


def hf_embeddings(model, wave: np.ndarray, **extractor) -> torch.Tensor:
    from transformers import Gemma4AudioFeatureExtractor

    feats = Gemma4AudioFeatureExtractor(**extractor)([wave], return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_audio_features(feats["input_features"], feats["input_features_mask"])
    return out.pooler_output[0][out.attention_mask[0]]


def clip(n: int, seed: int = 0) -> np.ndarray:
    """n samples at 16 kHz: a sweep under noise."""
    t = np.arange(n) / 16000
    rng = np.random.default_rng(seed)
    return (0.4 * np.sin(2 * np.pi * (200 + 1500 * t) * t) + 0.1 * rng.standard_normal(n)).astype(np.float32)


def assert_close(ours: torch.Tensor, theirs: torch.Tensor):
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=TOL, atol=TOL)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, gem4 model) of the E2B-like tower."""
    hf = build_hf()
    path = tmp_path_factory.mktemp("audio") / "e2b-like"
    hf.save_pretrained(path)
    return hf, gem4.load(path, dtype="float32"), path


@pytest.mark.parametrize("n", [161, 1000, 16000, 16123, 33333, 96000 + 77])
def test_audio_embeddings_equal_transformers(tiny, n):
    hf, model, _ = tiny
    wave = clip(n, seed=n)
    out = tower.encode_audio(model.audio, wave)
    assert out.n_tokens == front_end.num_soft_tokens(n) == out.embeddings.shape[0]
    assert out.embeddings.shape[1] == model.config.hidden_size
    assert out.bidirectional is False                        # P8: audio is never attended both ways
    assert_close(out.embeddings, hf_embeddings(hf, wave))


def test_audio_past_30_s_is_cut_to_750_tokens_as_transformers_cuts_it(tiny):
    hf, model, _ = tiny
    wave = clip(31 * 16000, seed=3)
    out = tower.encode_audio(model.audio, wave)
    assert out.n_tokens == 750
    assert_close(out.embeddings, hf_embeddings(hf, wave))


def test_a_stereo_44k1_file_end_to_end(tiny, tmp_path):
    import soundfile
    from transformers.audio_utils import load_audio as hf_load_audio

    hf, model, _ = tiny
    t = np.arange(int(44100 * 1.7)) / 44100
    stereo = np.stack([0.5 * np.sin(2 * np.pi * 330 * t), 0.3 * np.sin(2 * np.pi * (100 + 900 * t) * t)], axis=1)
    path = tmp_path / "clip.wav"
    soundfile.write(path, stereo.astype(np.float32), 44100)
    out = tower.encode_audio(model.audio, front_end.decode_audio(path.read_bytes()))
    assert_close(out.embeddings, hf_embeddings(hf, hf_load_audio(str(path), sampling_rate=16000, backend="soundfile")))


@pytest.mark.parametrize("variant", [v for v in TOWERS if v != "e2b-like"])
def test_every_tower_shape_the_config_allows(tmp_path, variant):
    """Other chunk sizes, windows with future frames, longer windows than the relative table, no clipping and
    another eps: the band of keys equals transformers' blocked attention whatever the shape."""
    hf = build_hf(seed=1, **TOWERS[variant])
    hf.save_pretrained(tmp_path)
    audio = load_audio(tmp_path)
    for n in (1000, 33333):
        wave = clip(n, seed=n)
        assert_close(tower.encode_audio(audio, wave).embeddings, hf_embeddings(hf, wave))


def test_bfloat16_weights_stay_near_the_float32_embeddings(tiny):
    _, model, path = tiny
    wave = clip(16000, seed=5)
    exact = tower.encode_audio(model.audio, wave).embeddings
    fast = tower.encode_audio(load_audio(path, dtype="bfloat16"), wave).embeddings
    assert fast.dtype == torch.float32
    rel = (fast - exact).norm() / exact.norm()
    assert 0 < rel < 0.05


def test_a_text_only_checkpoint_has_no_audio_tower(tmp_path):
    from model_fixtures import build_hf as build_text

    _, mm = build_text("dense_plain")
    mm.save_pretrained(tmp_path)
    assert gem4.load(tmp_path, dtype="float32").audio is None
    assert load_audio(tmp_path) is None


# ---- pitfalls (docs/multimodal.md §3.7): each mistake moves the embeddings far beyond the tolerance ----

def _attentions(audio):
    return [layer.self_attn for layer in audio.audio_tower.layers]


def _future_frames(audio, monkeypatch):                       # P13: the window is causal
    for attn in _attentions(audio):
        monkeypatch.setattr(attn, "future", 3)
        monkeypatch.setattr(attn, "width", attn.past + 3)


def _thirteen_keys(audio, monkeypatch):                       # P13: itself + 11 past, not context_left = 13
    for attn in _attentions(audio):
        monkeypatch.setattr(attn, "past", attn.past + 1)
        monkeypatch.setattr(attn, "width", attn.width + 1)


def _softplus_twice(audio, monkeypatch):                      # P13: per_dim_scale goes through softplus once
    for attn in _attentions(audio):
        attn.per_dim_scale.data = torch.nn.functional.softplus(attn.per_dim_scale.data)


def _positions_reversed(audio, monkeypatch):                  # P13: row p of the table is distance P - 1 - p
    table = tower.AudioTower.relative_positions
    monkeypatch.setattr(tower.AudioTower, "relative_positions", lambda self, device: table(self, device).flip(0))


def _cos_before_sin(audio, monkeypatch):                      # P13: [sin, cos], in that order
    table = tower.AudioTower.relative_positions
    monkeypatch.setattr(tower.AudioTower, "relative_positions",
                        lambda self, device: table(self, device).roll(self.config.hidden_size // 2, dims=-1))


def _no_logit_cap(audio, monkeypatch):                        # P13: 50 tanh(x / 50)
    for attn in _attentions(audio):
        monkeypatch.setattr(attn, "config", dataclasses.replace(attn.config, logit_cap=1e4))


def _no_output_bias(audio, monkeypatch):                      # P14: output_proj has a bias
    audio.audio_tower.output_proj.bias.data.zero_()


def _channel_major_flatten(audio, monkeypatch):               # P14: freq-major, channel-fastest
    sub = audio.audio_tower.subsample_conv_projection

    def forward(features):
        x = sub.layer1(sub.layer0(features[:, None]))        # [B, C, T, freq]
        return sub.input_proj_linear(x.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1))
    monkeypatch.setattr(sub, "forward", forward)


def _one_plus_weight_norms(audio, monkeypatch):               # P5/P14: RMSNorm multiplies by w, not 1 + w
    for module in audio.modules():
        if isinstance(module, tower.Norm):
            module.weight.data += 1


def _centred_light_conv(audio, monkeypatch):                  # the depthwise conv is causal (left pad k - 1)
    for layer in audio.audio_tower.layers:
        conv = layer.lconv1d

        def forward(h, conv=conv):
            y = torch.nn.functional.glu(conv.linear_start(conv.pre_layer_norm(h)), dim=-1)
            w = conv.depthwise_conv1d.weight
            k = w.shape[-1]
            y = torch.nn.functional.conv1d(torch.nn.functional.pad(y.transpose(1, 2), (k // 2, k - 1 - k // 2)), w,
                                           groups=w.shape[0]).transpose(1, 2)
            return h + conv.linear_end(torch.nn.functional.silu(conv.conv_norm(y)))
        monkeypatch.setattr(conv, "forward", forward)


def _power_spectrum(audio, monkeypatch):                      # P10: magnitude, not power
    magnitude = front_end.magnitude
    monkeypatch.setattr(front_end, "magnitude", lambda f: magnitude(f) ** 2)


def _no_semicausal_pad(audio, monkeypatch):                   # P10: 160 zeros before the first frame
    monkeypatch.setattr(front_end, "LEFT_PAD", 0)


MISTAKES = [_future_frames, _thirteen_keys, _softplus_twice, _positions_reversed, _cos_before_sin, _no_logit_cap,
            _no_output_bias, _channel_major_flatten, _one_plus_weight_norms, _centred_light_conv, _power_spectrum,
            _no_semicausal_pad]


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda f: f.__name__.strip("_"))
def test_each_audio_mistake_moves_the_embeddings(tiny, monkeypatch, mistake):
    hf, _, path = tiny
    wave = clip(33333, seed=11)
    reference = hf_embeddings(hf, wave)
    audio = load_audio(path)
    assert_close(tower.encode_audio(audio, wave).embeddings, reference)      # right before the mistake
    mistake(audio, monkeypatch)
    features = torch.from_numpy(front_end.log_mel(wave))
    wrong = audio(features)
    rows = min(len(wrong), len(reference))
    assert (wrong[:rows] - reference[:rows]).abs().max() > MOVED


def test_the_feed_forward_and_layer_norms_keep_eps_1e_6_whatever_the_config_says(tmp_path):
    """transformers builds them with its default eps; only the light conv, the subsampling and the embedder read
    rms_norm_eps. Giving every norm the config's eps (1e-2 here) is a mistake that shows."""
    hf = build_hf(seed=2, rms_norm_eps=1e-2)
    hf.save_pretrained(tmp_path)
    audio = load_audio(tmp_path)
    wave = clip(16000, seed=2)
    reference = hf_embeddings(hf, wave)
    assert_close(tower.encode_audio(audio, wave).embeddings, reference)
    for module in audio.modules():
        if isinstance(module, tower.Norm) and module.eps == tower.FIXED_EPS:
            module.eps = 1e-2
    assert (tower.encode_audio(audio, wave).embeddings - reference).abs().max() > MOVED


def test_left_padded_features_are_not_what_gem4_computes(tiny):
    """P12: a processor config with padding_side "left" gives other embeddings for lengths not a multiple of
    128; gem4 always computes the right-padded ones."""
    hf, model, _ = tiny
    wave = clip(16000 - 37, seed=4)
    ours = tower.encode_audio(model.audio, wave).embeddings
    assert_close(ours, hf_embeddings(hf, wave, padding_side="right"))
    assert (ours - hf_embeddings(hf, wave, padding_side="left")).abs().max() > MOVED


# ---- config and tensors: refused by name ----

def _edit(path, dst, config=None, processor=None):
    shutil.copytree(path, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["audio_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    if processor is not None:
        (dst / "processor_config.json").write_text(json.dumps(processor))
    return dst


@pytest.mark.parametrize("edit,named", [
    (lambda a: a.pop("attention_logit_cap"), "attention_logit_cap"),
    (lambda a: a.update(attention_context_left=1), "attention_context_left"),
    (lambda a: a.update(num_attention_heads=3), "num_attention_heads"),
    (lambda a: a.update(hidden_act="gelu"), "hidden_act"),
    (lambda a: a.update(attention_invalid_logits_value=-10.0), "attention_invalid_logits_value"),
    (lambda a: a.update(rms_norm_eps=0.5), "rms_norm_eps"),
    (lambda a: a.update(subsampling_conv_channels=[128, 16]), "layer1.conv.weight' has shape (8, 128, 3, 3)"),
    (lambda a: a.update(hidden_size=64, num_attention_heads=4), "model.audio_tower.subsample_conv_projection"),
    (lambda a: a.update(output_proj_dims=40), "output_proj"),
    (lambda a: a.update(num_hidden_layers=1), "unexpected audio tensor 'model.audio_tower.layers.1"),
    (lambda a: a.update(num_hidden_layers=3), "missing audio tensor 'model.audio_tower.layers.2"),
    (lambda a: a.update(use_clipped_linears=False), "input_max"),
    (lambda a: a.update(model_type="gemma3n_audio"), "model_type"),
])
def test_an_inconsistent_audio_config_is_refused_by_name(tiny, tmp_path, edit, named):
    _, _, path = tiny
    broken = _edit(path, tmp_path / "broken", config=edit)
    with pytest.raises(CheckpointError, match=re.escape(named)):
        gem4.load(broken, dtype="float32")


@pytest.mark.parametrize("key,value", [("feature_size", 80), ("sampling_rate", 24000), ("hop_length", 128),
                                       ("mel_floor", 1e-5), ("preemphasis", 0.97), ("per_bin_mean", [0.0] * 128)])
def test_a_feature_extractor_gem4_does_not_compute_is_refused_by_name(tiny, tmp_path, key, value):
    from transformers import Gemma4AudioFeatureExtractor

    _, _, path = tiny
    extractor = json.loads(Gemma4AudioFeatureExtractor().to_json_string())
    fine = _edit(path, tmp_path / "fine", processor={"feature_extractor": extractor})
    assert load_audio(fine) is not None
    broken = _edit(path, tmp_path / "broken", processor={"feature_extractor": {**extractor, key: value}})
    with pytest.raises(CheckpointError, match=key):
        load_audio(broken)


def test_soft_token_count_is_the_processors_for_every_length(tiny):
    """The tower's row count is the placeholder count transformers' processor writes into the prompt."""
    from types import SimpleNamespace

    from transformers import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    _, model, _ = tiny
    processor = SimpleNamespace(feature_extractor=Gemma4AudioFeatureExtractor(), audio_seq_length=750)
    for n in (161, 320, 321, 480, 481, 640, 641, 800, 801, 1600, 4000 + 1):
        count = Gemma4Processor._compute_audio_num_tokens(processor, np.zeros(n), 16000)
        assert tower.encode_audio(model.audio, clip(n, seed=n)).n_tokens == count == math.ceil(((n - 1) // 160) / 4)


# ---- 12B ("unified"): raw 640-sample frames, no tower ----

def build_unified(seed: int = 0, samples: int = 640):
    from transformers import (Gemma4UnifiedAudioConfig, Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration,
                              Gemma4UnifiedTextConfig)

    model = Gemma4UnifiedForConditionalGeneration(Gemma4UnifiedConfig(
        text_config=Gemma4UnifiedTextConfig(**VARIANTS["dense_keqv"]), vision_config=None,
        audio_config=Gemma4UnifiedAudioConfig(audio_embed_dim=samples))).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.model.embed_audio.embedding_projection.weight.copy_(0.1 * torch.randn((64, samples), generator=gen))
    return model


@pytest.fixture(scope="module")
def unified(tmp_path_factory):
    hf = build_unified()
    path = tmp_path_factory.mktemp("audio") / "unified"
    hf.save_pretrained(path)
    return hf, gem4.load(path, dtype="float32"), path


def unified_hf_embeddings(model, wave: np.ndarray) -> torch.Tensor:
    from transformers import Gemma4UnifiedAudioFeatureExtractor

    feats = Gemma4UnifiedAudioFeatureExtractor()([wave], return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_audio_features(feats["input_features"], feats["input_features_mask"])
    return out.pooler_output[0][out.attention_mask[0]]


@pytest.mark.parametrize("n", [1, 639, 640, 641, 16123, 31 * 16000 + 5])
def test_unified_raw_frame_embeddings_equal_transformers(unified, n):
    from types import SimpleNamespace

    from transformers import Gemma4UnifiedAudioFeatureExtractor
    from transformers.models.gemma4_unified.processing_gemma4_unified import Gemma4UnifiedProcessor

    hf, model, _ = unified
    assert isinstance(model.audio, tower.FrameAudioModel)
    wave = clip(n, seed=n)
    out = tower.encode_audio(model.audio, wave)
    processor = SimpleNamespace(feature_extractor=Gemma4UnifiedAudioFeatureExtractor())
    # ceil(N / 640) and no 30 s cut: 31 s give 776 tokens, not the E2B/E4B tower's 750
    count = Gemma4UnifiedProcessor._compute_audio_num_tokens(processor, wave, 16000)
    assert out.n_tokens == math.ceil(n / 640) == count
    assert out.bidirectional is False
    assert_close(out.embeddings, unified_hf_embeddings(hf, wave))


def test_unified_frames_through_the_mel_tower_path_would_be_wrong(unified, monkeypatch):
    """The 12B takes the waveform itself: frames cut at another length, or the E2B/E4B 30 s cut, do not match."""
    hf, model, _ = unified
    wave = clip(20000, seed=8)
    reference = unified_hf_embeddings(hf, wave)
    shifted = np.concatenate([np.zeros(160, np.float32), wave])[:len(wave)]      # a semicausal pad, as for mel
    wrong = tower.encode_audio(model.audio, shifted).embeddings
    assert (wrong - reference).abs().max() > MOVED
    assert tower.encode_audio(model.audio, clip(31 * 16000, seed=1)).n_tokens != front_end.num_soft_tokens(31 * 16000)


@pytest.mark.parametrize("edit,processor,named", [
    (lambda a: a.update(audio_embed_dim=320), None, "embed_audio.embedding_projection.weight' has shape (64, 640)"),
    (lambda a: a.pop("audio_embed_dim"), None, "audio_embed_dim"),
    (lambda a: a.update(rms_norm_eps=0), None, "audio_config.rms_norm_eps"),
    (None, {"feature_extractor": {"feature_size": 640, "audio_samples_per_token": 320, "sampling_rate": 16000}},
     "audio_samples_per_token=320"),
])
def test_an_inconsistent_unified_audio_config_is_refused_by_name(unified, tmp_path, edit, processor, named):
    _, _, path = unified
    broken = _edit(path, tmp_path / "broken", config=edit, processor=processor)
    with pytest.raises(CheckpointError, match=re.escape(named)):
        load_audio(broken)


def test_inspect_shows_the_audio(tiny, unified, capsys):
    from gem4.cli import main as cli_main

    assert cli_main(["inspect", str(tiny[2])]) == 0
    assert "audio          conformer (E2B/E4B): 2 layers x 32, 2 heads, window 12 frames -> 48 -> 64; 25 tokens/s, " \
           "at most 750" in capsys.readouterr().out
    assert cli_main(["inspect", str(unified[2]), "--json"]) == 0
    audio = json.loads(capsys.readouterr().out)["audio"]
    assert audio["kind"] == "raw frames (12B)" and audio["samples_per_token"] == 640 and audio["tokens_per_second"] == 25
