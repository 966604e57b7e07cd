"""Audio soft tokens through the text model (E2B-like, causal) against transformers: logits of a prompt with two
clips, and greedy tokens equal to generate()."""
from __future__ import annotations

import pytest
import torch

import gem4
from gem4.model.audio import encode_audio
from gem4.model.gemma4 import MediaItem

from model_fixtures import VARIANTS, randomize
from test_audio_tower import TINY_AUDIO, clip
from vision_fixtures import TOKEN_IDS


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

    config = Gemma4Config(text_config=Gemma4TextConfig(**VARIANTS["ple_kvshare"]), vision_config=None,
                          audio_config=Gemma4AudioConfig(**TINY_AUDIO), **TOKEN_IDS)
    config._attn_implementation = "eager"
    hf = Gemma4ForConditionalGeneration(config).eval()
    randomize(hf.model.language_model, 7)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if "audio" not in name or "inv_timescales" in name or name.endswith("softcap"):
                continue
            if name.endswith(("input_min", "output_min")):
                p.fill_(-(1 + 2 * torch.rand((), generator=gen)).item())
            elif name.endswith(("input_max", "output_max")):
                p.fill_((1 + 2 * torch.rand((), generator=gen)).item())
            elif "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("per_dim_scale"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    hf.config._attn_implementation = "eager"
    path = tmp_path_factory.mktemp("e2e")
    hf.save_pretrained(path)
    model = gem4.load(path, dtype="float32")
    waves = [clip(16123, seed=1), clip(7000, seed=2)]
    encoded = [encode_audio(model.audio, w) for w in waves]
    ids, media = [2, 17, 33], []
    for e in encoded:
        ids.append(TOKEN_IDS["boa_token_id"])
        media.append(MediaItem(len(ids), e.embeddings, e.bidirectional))
        ids += [TOKEN_IDS["audio_token_id"]] * e.n_tokens + [TOKEN_IDS["eoa_token_id"], 40, 41]
    return hf, model, waves, ids, media


def hf_inputs(waves, ids):
    from transformers import Gemma4AudioFeatureExtractor

    feats = Gemma4AudioFeatureExtractor()(waves, return_tensors="pt")
    return dict(input_ids=torch.tensor([ids]), input_features=feats["input_features"],
                input_features_mask=feats["input_features_mask"])


def test_logits_with_two_clips_match_transformers(case):
    hf, model, waves, ids, media = case
    with torch.no_grad():
        expected = hf(**hf_inputs(waves, ids)).logits[0]
    got = model.extend(torch.tensor(ids), model.new_cache(), logits=len(ids), media=media)
    rel = (got - expected).abs().max() / expected.abs().max()
    assert rel < 1e-4, rel


def test_greedy_tokens_equal_transformers_generate(case):
    hf, model, waves, ids, media = case
    with torch.no_grad():
        out = hf.generate(**hf_inputs(waves, ids), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    cache = model.new_cache()
    logits = model.extend(torch.tensor(ids), cache, media=media)
    got = [int(logits[-1].argmax())]
    while len(got) < len(out):
        got.append(int(model.extend(torch.tensor(got[-1:]), cache)[-1].argmax()))
    assert got == out
