"""A tiny seeded random 12B ("unified") model with its vision embedder and raw-frame audio (docs/multimodal.md
§2.5), built with transformers at test time; used by tests only."""
from __future__ import annotations

import numpy as np
import torch

from model_fixtures import VARIANTS, randomize
from vision_fixtures import TOKEN_IDS

VISION = dict(mm_embed_dim=48, mm_posemb_size=64, output_proj_dims=48)


def randomize_unified_vision(model: torch.nn.Module, seed: int) -> None:
    """The embedder's weights random, none at its default (an all-zero position table would hide an x/y swap, unit
    LayerNorms a missing one), bf16-representable."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("model.embed_vision."):
                continue
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "_ln" in name or "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("pos_embedding"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
            p.copy_(p.to(torch.bfloat16).float())


def build_unified_hf(seed: int = 1234):
    from transformers import (Gemma4UnifiedAudioConfig, Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration,
                              Gemma4UnifiedTextConfig, Gemma4UnifiedVisionConfig)

    config = Gemma4UnifiedConfig(
        text_config=Gemma4UnifiedTextConfig(**dict(VARIANTS["dense_keqv"], use_bidirectional_attention="vision")),
        vision_config=Gemma4UnifiedVisionConfig(**VISION), audio_config=Gemma4UnifiedAudioConfig(audio_embed_dim=640),
        **TOKEN_IDS)
    config._attn_implementation = "eager"
    model = Gemma4UnifiedForConditionalGeneration(config).eval()
    randomize(model, seed)
    randomize_unified_vision(model, seed + 1)
    model.config._attn_implementation = "eager"
    return model


def clip(n: int, seed: int = 0) -> np.ndarray:
    """n samples at 16 kHz: a sweep under noise."""
    t = np.arange(n) / 16000
    rng = np.random.default_rng(seed)
    return (0.4 * np.sin(2 * np.pi * (200 + 1500 * t) * t) + 0.1 * rng.standard_normal(n)).astype(np.float32)
