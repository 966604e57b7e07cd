"""Tiny seeded random Gemma 4 models with a vision tower (docs/multimodal.md §8), built with transformers at test
time, and generated test images. transformers 5.23.0 is the oracle; these builders are used by tests only."""
from __future__ import annotations

import numpy as np
import torch

from model_fixtures import VARIANTS, randomize

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, patch_size=16, pooling_kernel_size=3, position_embedding_size=64)
# (text variant, vision config) of the two tower flavours: E2B/E4B-like (PLE, causal text, clipped linears) and
# 26B/31B-like (k_eq_v, image tokens both ways on sliding layers, standardized output)
FLAVOURS = {
    "e2b": ("ple_kvshare", dict(VISION, use_clipped_linears=True, standardize=False), None),
    "31b": ("dense_keqv", dict(VISION, use_clipped_linears=False, standardize=True), "vision"),
}


# the media token ids, moved into the tiny vocabulary (512)
TOKEN_IDS = dict(image_token_id=500, boi_token_id=501, eoi_token_id=502, video_token_id=503, audio_token_id=504,
                 boa_token_id=505, eoa_token_id=506, eoa_token_index=506)


def randomize_vision(model: torch.nn.Module, seed: int = 99) -> None:
    """Every tower weight random, none at its default (the defaults hide bugs: an all-ones position table makes an
    x/y swap invisible, infinite clip bounds never clamp, std 0/1 is the identity): norm weights 1 + 0.5 N(0,1)
    (q/k norms scaled by d^-1/4 as the text's), clip bounds finite so that clamping fires, the rest 0.08 N(0,1)
    (the position table 0.5 N(0,1)); every value bf16-representable."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not name.startswith(("model.vision_tower.", "model.embed_vision.")) or "inv_freq" in name:
                continue
            u = torch.rand(p.shape, generator=gen)
            if name.endswith("input_min"):
                p.copy_(-(1.0 + u))
            elif name.endswith("input_max"):
                p.copy_(1.0 + u)
            elif name.endswith("output_min"):
                p.copy_(-(0.3 + 0.5 * u))
            elif name.endswith("output_max"):
                p.copy_(0.3 + 0.5 * u)
            elif "norm" in name or name.endswith("std_scale"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.mul_(p.shape[-1] ** -0.25)
            elif name.endswith("position_embedding_table"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("std_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
            p.copy_(p.to(torch.bfloat16).float())


def build_vision_hf(flavour: str, seed: int = 1234, **sizes):
    """-> a random Gemma4ForConditionalGeneration with a vision tower (eval, eager attention); `sizes`: vision_config
    fields other than the flavour's."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig

    variant, vision, bidirectional = FLAVOURS[flavour]
    vision = dict(vision, **sizes)
    text = Gemma4TextConfig(**dict(VARIANTS[variant], use_bidirectional_attention=bidirectional))
    config = Gemma4Config(text_config=text, vision_config=Gemma4VisionConfig(**vision), audio_config=None,
                          **TOKEN_IDS)
    config._attn_implementation = "eager"
    model = Gemma4ForConditionalGeneration(config).eval()
    randomize(model, seed)
    randomize_vision(model, seed + 1)
    model.config._attn_implementation = "eager"
    return model


def sample_image(height: int, width: int, seed: int = 0, mode: str = "RGB"):
    """A smooth random picture (a gradient plus blobs: bicubic resizing sees structure, not noise) as a PIL image."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    channels = []
    for _ in range(len(mode)):
        a, b, c = rng.uniform(-1, 1, 3)
        f = 0.5 + 0.25 * np.sin(6 * (a * x + b * y) + c) + 0.2 * rng.uniform(-1, 1, (height, width))
        channels.append(np.clip(f * 255, 0, 255).astype(np.uint8))
    return Image.fromarray(np.stack(channels, axis=-1), mode)


def greedy_with_media(model, ids: list[int], media, steps: int) -> list[int]:
    """gem4's greedy tokens after a prompt holding media soft tokens (`media`: MediaItems), one cache, `steps` of them."""
    cache = model.new_cache()
    logits = model.extend(torch.tensor(ids), cache, media=media)
    got = []
    for _ in range(steps):
        got.append(int(logits[-1].argmax()))
        logits = model.extend(torch.tensor(got[-1:]), cache)
    return got
