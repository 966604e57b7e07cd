"""The media towers of an HF checkpoint: their configs from config.json, their tensors bound into tower modules.

The vision tower (docs/multimodal.md §2): `vision_config` of a `Gemma4ForConditionalGeneration` config.json,
checked against the tensors under `model.vision_tower.` / `model.embed_vision.` as the text model is (every value
from the checkpoint, a missing, unexpected or mis-shaped tensor refused by name). Whether the tower clamps its
linears (E2B/E4B) and standardizes its output (26B/31B) is decided by the tensors present and checked against
the config's `use_clipped_linears` / `standardize`; whether an image's tokens see each other both ways is the text
config's `use_bidirectional_attention` ("vision": on sliding layers; null: causal).

The 12B ("unified", `vision_config.model_type` "gemma4_unified_vision") has no tower: its encoder-free embedder
(docs/multimodal.md §2.5) keeps its tensors under `model.vision_embedder.` and its projection under
`model.embed_vision.`, bound into model/unified_vision.py's UnifiedVisionModel by the same rules.
"""
from __future__ import annotations

from pathlib import Path

import torch

from gem4.config import ConfigError, UnifiedVisionConfig, VisionConfig, build_unified_vision_config, build_vision_config
from gem4.model.backends import Backend
from gem4.model.unified_vision import UnifiedVisionModel
from gem4.model.vision import VisionModel
from gem4.weights.binding import bind_weights
from gem4.weights.checkpoint import Checkpoint, CheckpointError, TensorEntry
from gem4.weights.hf import int_field, number_field

VISION_PREFIXES = ("vision_tower.", "embed_vision.", "vision_embedder.")    # (the last: the 12B's embedder)
VISION_MODEL_TYPES = ("gemma4_vision", "gemma4_unified_vision")   # the ViT tower, the 12B's encoder-free embedder
ROPE_TYPES = ("default", "axial")             # checkpoints write "default", transformers rewrites it to "axial"


def hf_towers(whole: dict, text: dict, tensors: dict[str, TensorEntry], where: Path
              ) -> tuple[dict[str, TensorEntry], dict[str, object]]:
    """config.json (whole, its text part) + the towers' tensors -> (the tensors, {"vision": VisionConfig}) of the
    towers gem4 binds; tensors of a tower the config does not describe are refused."""
    configs: dict[str, object] = {}
    shapes = {name: entry.shape for name, entry in tensors.items()}
    vision = vision_config_from_hf(whole, text, shapes, where)
    vision_tensors = sorted(name for name in tensors if name.startswith(VISION_PREFIXES))
    if vision is None and vision_tensors:
        raise CheckpointError(f"{where}: the checkpoint has vision tower tensors ('model.{vision_tensors[0]}', ...) "
                              f"but config.json has no vision_config")
    if vision is not None:
        configs["vision"] = vision
    return tensors, configs


def vision_config_from_hf(whole: dict, text: dict, shapes: dict[str, tuple[int, ...]], where: Path
                          ) -> VisionConfig | UnifiedVisionConfig | None:
    v = whole.get("vision_config")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise CheckpointError(f"{where}: vision_config must be an object, got {v!r}")
    what = f"{where}: vision_config"
    if v.get("model_type") not in VISION_MODEL_TYPES:
        raise CheckpointError(f"{what}: model_type {v.get('model_type')!r} is not a Gemma 4 vision tower "
                              f"{VISION_MODEL_TYPES}")
    if v["model_type"] == "gemma4_unified_vision":
        return unified_vision_config_from_hf(whole, text, v, where)
    if v.get("hidden_activation") != "gelu_pytorch_tanh":
        raise CheckpointError(f"{what}: hidden_activation {v.get('hidden_activation')!r} is not gelu_pytorch_tanh")
    rope = v.get("rope_parameters")
    if not isinstance(rope, dict) or rope.get("rope_type", "default") not in ROPE_TYPES:
        raise CheckpointError(f"{what}: rope_parameters must be an object with rope_type one of {ROPE_TYPES}, "
                              f"got {rope!r}")
    bidirectional = text.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        raise CheckpointError(f"{where}: use_bidirectional_attention {bidirectional!r} is not supported (null: "
                              f"causal; \"vision\": image tokens see each other both ways on sliding layers)")
    # decided by the tensors, checked against the config (a flag without its tensors would load nothing)
    clipped = "vision_tower.encoder.layers.0.self_attn.q_proj.input_min" in shapes
    standardize = "vision_tower.std_bias" in shapes
    for key, present in (("use_clipped_linears", clipped), ("standardize", standardize)):
        stated = v.get(key)
        if stated is not None and bool(stated) != present:
            raise CheckpointError(f"{what}: {key}={stated!r} but the checkpoint "
                                  f"{'lacks' if stated else 'has'} its tensors")
    try:
        return build_vision_config(
            hidden_size=int_field(v, "hidden_size", what), intermediate_size=int_field(v, "intermediate_size", what),
            num_layers=int_field(v, "num_hidden_layers", what), num_heads=int_field(v, "num_attention_heads", what),
            num_kv_heads=int_field(v, "num_key_value_heads", what), head_dim=int_field(v, "head_dim", what),
            patch_size=int_field(v, "patch_size", what), pooling=int_field(v, "pooling_kernel_size", what),
            position_embedding_size=int_field(v, "position_embedding_size", what),
            rope_theta=number_field(rope, "rope_theta", f"{what}.rope_parameters"),
            rms_norm_eps=number_field(v, "rms_norm_eps", what), clipped_linears=clipped, standardize=standardize,
            text_hidden_size=int_field(text, "hidden_size", where), bidirectional=bidirectional == "vision",
            image_token_id=int_field(whole, "image_token_id", where), boi_token_id=int_field(whole, "boi_token_id", where),
            eoi_token_id=int_field(whole, "eoi_token_id", where),
            video_token_id=int_field(whole, "video_token_id", where) if whole.get("video_token_id") is not None else None)
    except ConfigError as e:
        raise CheckpointError(f"{what}: {e}" + (f" ({e.field})" if e.field else "")) from None


def unified_vision_config_from_hf(whole: dict, text: dict, v: dict, where: Path) -> UnifiedVisionConfig:
    """The 12B's `vision_config` (model_type gemma4_unified_vision): every field required. transformers' embedder
    reads patches of patch_size x pooling_kernel_size px and feeds its mm_embed_dim output to a projection sized
    output_proj_dims: the two must agree."""
    what = f"{where}: vision_config"
    embed_dim, out_dims = int_field(v, "mm_embed_dim", what), int_field(v, "output_proj_dims", what)
    if out_dims != embed_dim:
        raise CheckpointError(f"{what}: output_proj_dims {out_dims} must equal mm_embed_dim {embed_dim} (the "
                              f"projection reads the embedder's output)")
    if "use_bidirectional_attention" not in text:
        raise CheckpointError(f"{where}: text_config lacks use_bidirectional_attention (the 12B's image tokens see "
                              f"each other both ways on sliding layers when it says \"vision\")")
    bidirectional = text["use_bidirectional_attention"]
    if bidirectional not in (None, "vision"):
        raise CheckpointError(f"{where}: use_bidirectional_attention {bidirectional!r} is not supported (null: "
                              f"causal; \"vision\": image tokens see each other both ways on sliding layers)")
    names = {"patch_size": "patch_size x pooling_kernel_size", "embed_dim": "mm_embed_dim",
             "position_embedding_size": "mm_posemb_size"}
    try:
        return build_unified_vision_config(
            patch_size=int_field(v, "patch_size", what) * int_field(v, "pooling_kernel_size", what),
            embed_dim=embed_dim, position_embedding_size=int_field(v, "mm_posemb_size", what),
            rms_norm_eps=number_field(v, "rms_norm_eps", what), text_hidden_size=int_field(text, "hidden_size", where),
            bidirectional=bidirectional == "vision", image_token_id=int_field(whole, "image_token_id", where),
            boi_token_id=int_field(whole, "boi_token_id", where), eoi_token_id=int_field(whole, "eoi_token_id", where),
            video_token_id=int_field(whole, "video_token_id", where) if whole.get("video_token_id") is not None else None)
    except ConfigError as e:
        raise CheckpointError(f"{what}: {e}" + (f" ({names.get(e.field, e.field)})" if e.field else "")) from None


def bind_vision(ckpt: Checkpoint, dtype: torch.dtype, device: str, backend: Backend
                ) -> VisionModel | UnifiedVisionModel | None:
    """The checkpoint's vision tower (the 12B: its embedder) bound in `dtype` (vectors and scalars float32, as the
    text model's) through the text model's backend (binding.bind_weights: an mmproj's Q8_0 matrices stay Q8_0 on
    the CPU backend), or None."""
    config = ckpt.tower_configs.get("vision")
    if config is None:
        return None
    with torch.device("meta"):
        model = UnifiedVisionModel(config, dtype) if isinstance(config, UnifiedVisionConfig) else VisionModel(config, dtype)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    present = {name: entry for name, entry in ckpt.towers.items() if name.startswith(VISION_PREFIXES)}
    for name, shape in expected.items():
        entry = present.get(name)
        if entry is None:
            raise CheckpointError(f"{ckpt.path}: missing required tensor 'model.{name}' of the vision tower "
                                  f"(expected shape {shape})")
        if tuple(entry.shape) != shape:
            raise CheckpointError(f"{ckpt.path}: tensor 'model.{name}' has shape {tuple(entry.shape)}, the vision "
                                  f"config needs {shape}")
    unexpected = sorted(set(present) - set(expected))
    if unexpected:
        raise CheckpointError(f"{ckpt.path}: unexpected vision tower tensor 'model.{unexpected[0]}'"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    bind_weights(model, present, backend, dtype, device)
    if isinstance(model, VisionModel):
        model.vision_tower.inv_freq = torch.tensor(config.inv_freq(), dtype=torch.float32, device=device)
    return model.eval()
