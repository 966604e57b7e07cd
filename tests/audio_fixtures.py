"""A tiny random E2B-like `Gemma4ForConditionalGeneration` with an audio tower (no vision), built by transformers at
test time: the text model of model_fixtures' "ple_kvshare" variant, test_audio_tower's 2-layer D=32 conformer with
every audio weight randomised (clip bounds finite, +-1..3, so that clamping fires), and vision_fixtures' media
token ids (504-506: <|audio|>, <|audio>, <audio|>) inside the tiny vocabulary; with `vision`, also vision_fixtures'
E2B-like vision tower (both towers, as E2B/E4B have)."""
from __future__ import annotations

import torch

from model_fixtures import VARIANTS, randomize
from vision_fixtures import FLAVOURS, TOKEN_IDS, randomize_vision

# a 2-layer D=32 conformer (test_audio_tower varies it)
TINY_AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 8],
                  output_proj_dims=48, conv_kernel_size=5)


def randomize_audio(model, seed: int) -> None:
    """Every audio weight of a transformers Gemma 4 model randomised (clip bounds finite, +-1..3, so that clamping
    fires); its non-persistent buffers (the relative positions' timescales, each attention's softcap) left alone."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
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


def build_audio_hf(seed: int = 7, vision: bool = False):
    from transformers import (Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig,
                              Gemma4VisionConfig)

    config = Gemma4Config(text_config=Gemma4TextConfig(**VARIANTS["ple_kvshare"]),
                          vision_config=Gemma4VisionConfig(**FLAVOURS["e2b"][1]) if vision else None,
                          audio_config=Gemma4AudioConfig(**TINY_AUDIO), **TOKEN_IDS)
    config._attn_implementation = "eager"
    hf = Gemma4ForConditionalGeneration(config).eval()
    randomize(hf.model.language_model, seed)
    randomize_audio(hf, seed - 4)
    if vision:
        randomize_vision(hf, seed + 1)
    hf.config._attn_implementation = "eager"
    return hf
