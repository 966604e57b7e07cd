"""Tiny seeded random Gemma 4 models of the four variant shapes (docs/gemma4.md §8.3), built with transformers.

transformers 5.23.0 is the numerical oracle; these builders are used by tests only.
"""
from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "sliding_attention", "full_attention"],
    sliding_window=8, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=4096, final_logit_softcapping=30.0, tie_word_embeddings=True,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
)
VARIANTS = {
    # E2B/E4B-like: PLE + KV sharing (layers 3-5 reuse 1 / 2) + double-wide MLP, 1 KV head
    "ple_kvshare": dict(COMMON, num_key_value_heads=1, hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
                        num_kv_shared_layers=3, use_double_wide_mlp=True, attention_k_eq_v=False),
    # 31B-like: k_eq_v on full layers, 1 global KV head x 32
    "dense_keqv": dict(COMMON, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                       attention_k_eq_v=True, num_global_key_value_heads=1),
    # plain dense
    "dense_plain": dict(COMMON, hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_k_eq_v=False),
    # 26B-A4B-like: dense MLP + 8 experts (Im=32), top-2, k_eq_v
    "moe": dict(COMMON, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                attention_k_eq_v=True, num_global_key_value_heads=1,
                enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32),
}


def randomize(model: torch.nn.Module, seed: int = 1234) -> None:
    """Norm-like weights 1 + 0.5 N(0,1), layer_scalar U(0.5, 1.5), everything else 0.08 N(0,1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name or name.endswith("embed_scale"):
                continue
            if name.endswith("layer_scalar"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    # attention has scale 1.0 on RMS-normed q/k: without this the random model's attention is
                    # a chaotic argmax and bf16 rounding of one weight flips it (docs/gemma4.md §2.5, issue #6 §4)
                    p.mul_(p.shape[-1] ** -0.25)
            elif name.endswith("router.proj.weight"):
                # a trained router is decisive; 0.08 N(0,1) would give near-uniform expert probabilities
                # whose top-k order any rounding flips
                p.copy_(6.0 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
            # released checkpoints are bf16: keep every weight bf16-representable (stored as float32), so
            # the bfloat16 mode is compared with the float32 path on the same weights
            p.copy_(p.to(torch.bfloat16).float())


def build_hf(variant: str, seed: int = 1234, **overrides):
    """-> (causal_lm, conditional_generation) with identical text weights, eval mode, eager attention.
    `overrides`: config fields that differ from VARIANTS[variant]."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    fields = dict(VARIANTS[variant], **overrides)
    text = Gemma4TextConfig(**fields)
    causal = Gemma4ForCausalLM(text).eval()
    randomize(causal, seed)
    causal.config._attn_implementation = "eager"
    mm = Gemma4ForConditionalGeneration(
        Gemma4Config(text_config=Gemma4TextConfig(**fields), vision_config=None, audio_config=None)).eval()
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in causal.state_dict().items()}
    missing, unexpected = mm.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m or "embed_scale" in m or m == "lm_head.weight" for m in missing), missing
    return causal, mm


def prompt_ids(n: int = 45, vocab: int = 512, seed: int = 7) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [2] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist()
