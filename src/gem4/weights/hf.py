"""HF checkpoints: a directory with config.json and *.safetensors (single file or sharded with an index).

Layouts (docs/gemma4.md §3.1):
    Gemma4ForCausalLM                 text weights under `model.`
    Gemma4ForConditionalGeneration    text weights under `model.language_model.`; the vision tower's under
                                      `model.vision_tower.` / `model.embed_vision.` (the 12B's embedder:
                                      `model.vision_embedder.`; Checkpoint.towers, bound by weights/towers.py); the
                                      audio tower's ignored here (weights/audio.py)
    (MLX: language_model.model.)      what mlx_lm / mlx-vlm save for the multimodal model (towers ignored)
MLX affine checkpoints (config.json `quantization`; weights/mlx.py) are read here too: their quantized weights
become MLX_A4 / MLX_A8 (or Q4_1) block tensors, the rest as in any HF checkpoint.
Config forms (docs/gemma4.md §1.2): top-level `global_head_dim` / `num_global_key_value_heads` (hub
configs) or `per_layer_config` (what transformers 5.23 re-saves; its keys are layer indices, zero-padded
from 10 layers on: "05"). Per-layer embeddings are decided by
the tensors present; a config that says otherwise is refused (transformers silently defaults
`hidden_size_per_layer_input` to 256 when the key is absent).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from gem4.config import FULL, ConfigError, ModelConfig, MoEConfig, build_config, rope_default, rope_proportional
from gem4.weights import mlx
from gem4.weights.checkpoint import Checkpoint, CheckpointError, TensorEntry

TEXT_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
STORED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# the towers' tensors, kept apart from the text model's (canonical name: without `model.`)
TOWER_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.vision_embedder.")   # (the last: the 12B's)
VESTIGIAL_KV = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight", "self_attn.v_norm.weight")


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({directory / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: shard {f.name} is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return files


def _text_config(directory: Path) -> tuple[dict, dict]:
    """-> (the whole config.json, its text part)."""
    path = directory / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: not a model directory (an HF checkpoint has config.json and "
                              "*.safetensors; gem4 also reads .gguf files)") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    text = cfg.get("text_config", cfg)
    model_type = text.get("model_type", cfg.get("model_type"))
    if model_type not in TEXT_MODEL_TYPES:
        raise CheckpointError(f"{path}: model_type {model_type!r} is not a Gemma 4 text model {TEXT_MODEL_TYPES}")
    return cfg, text


def _require(cfg: dict, key: str, where: Path | str):
    if cfg.get(key) is None:
        raise CheckpointError(f"{where}: config.json lacks {key!r}")
    return cfg[key]


def int_field(cfg: dict, key: str, where: Path | str, default=None) -> int:
    """An integer field (JSON int, not bool or float); `default` when absent (required if None)."""
    v = _require(cfg, key, where) if default is None or cfg.get(key) is not None else default
    if isinstance(v, bool) or not isinstance(v, int):
        raise CheckpointError(f"{where}: {key} must be an integer, got {v!r}")
    return v


def number_field(cfg: dict, key: str, where: Path | str, default=None) -> float:
    """A finite number field (JSON int or float, not bool); `default` when absent (required if None)."""
    v = _require(cfg, key, where) if default is None or cfg.get(key) is not None else default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise CheckpointError(f"{where}: {key} must be a finite number, got {v!r}")
    return float(v)


# ConfigError.field -> the config.json key it was read from, for error messages
CONFIG_KEYS = {
    "final_logit_softcap": "final_logit_softcapping",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "gqa": "num_attention_heads / num_key_value_heads",
    "sliding_window/context": "sliding_window / max_position_embeddings",
    "embed": "vocab_size / hidden_size",
    "ple": "hidden_size_per_layer_input",
    "attention": "num_attention_heads / num_key_value_heads / head_dim / global_head_dim / hidden_size",
    "mlp": "intermediate_size / hidden_size",
    "moe.size": "num_experts / moe_intermediate_size / hidden_size",
    "head_dims": "head_dim / global_head_dim",
    "intermediate_sizes": "intermediate_size",
    "ple_dim": "hidden_size_per_layer_input",
    "moe.num_experts": "num_experts",
    "moe.top_k": "top_k_experts",
    "moe.intermediate_size": "moe_intermediate_size",
    "rope.sliding_attention": "rope_parameters",
    "rope.full_attention": "rope_parameters",
}


def _rope(params: dict, head_dim: int, layer_type: str, where: Path) -> tuple[float, ...]:
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: rope_parameters[{layer_type!r}] must be an object, got {params!r}")
    rope_type = params.get("rope_type", "default")
    what = f"{where}: rope_parameters[{layer_type!r}]"
    theta = number_field(params, "rope_theta", what)
    try:
        if rope_type == "default":
            return rope_default(theta, head_dim)
        if rope_type == "proportional":
            return rope_proportional(theta, head_dim, number_field(params, "partial_rotary_factor", what, 1.0),
                                     number_field(params, "factor", what, 1.0))
    except ConfigError as e:
        raise CheckpointError(f"{what}: {e}") from None
    raise CheckpointError(f"{what} has unsupported rope_type {rope_type!r}")


def config_from_hf(cfg: dict, shapes: dict[str, tuple[int, ...]], where: Path) -> ModelConfig:
    """config.json text section + canonical tensor shapes -> ModelConfig."""
    L = int_field(cfg, "num_hidden_layers", where)
    layer_types = _require(cfg, "layer_types", where)       # never defaulted (docs/architecture.md §5.1)
    if not isinstance(layer_types, list) or len(layer_types) != L:
        raise CheckpointError(f"{where}: layer_types must be a list of {L} entries (num_hidden_layers), "
                              f"got {len(layer_types) if isinstance(layer_types, list) else layer_types!r}")
    nh = int_field(cfg, "num_attention_heads", where)
    k_eq_v_flag = bool(cfg.get("attention_k_eq_v", False))
    shared = int_field(cfg, "num_kv_shared_layers", where, 0)

    # per-layer head geometry: per_layer_config (re-saved form) or global_* keys (hub form)
    head_dims, kv_heads = [], []
    per_layer = cfg.get("per_layer_config")
    if per_layer is not None:                  # keys are layer indices, zero-padded from 10 layers on ("05")
        try:
            per_layer = {int(key): value for key, value in per_layer.items()}
        except ValueError:
            raise CheckpointError(f"{where}: per_layer_config keys must be layer indices, got {sorted(per_layer)}") from None
        if not set(per_layer) <= set(range(len(layer_types))):
            raise CheckpointError(f"{where}: per_layer_config names layers outside 0..{len(layer_types) - 1}")
    for i, t in enumerate(layer_types):
        d, nkv = int_field(cfg, "head_dim", where), int_field(cfg, "num_key_value_heads", where)
        if per_layer is not None:
            override = per_layer.get(i, {})
            if not isinstance(override, dict):
                raise CheckpointError(f"{where}: per_layer_config[{i}] must be an object, got {override!r}")
            d, nkv = int_field(override, "head_dim", where, d), int_field(override, "num_key_value_heads", where, nkv)
        elif t == FULL:
            d = int_field(cfg, "global_head_dim", where)
            if k_eq_v_flag and cfg.get("num_global_key_value_heads") is not None:
                nkv = int_field(cfg, "num_global_key_value_heads", where)
        head_dims.append(d)
        kv_heads.append(nkv)

    first = L - shared
    inter = int_field(cfg, "intermediate_size", where)
    double = bool(cfg.get("use_double_wide_mlp", False))
    intermediate = [inter * (2 if double and i >= first else 1) for i in range(L)]

    # PLE: decided by the tensors, checked against the config
    ple_shape = shapes.get("embed_tokens_per_layer.weight")
    cfg_ple = cfg.get("hidden_size_per_layer_input", "absent")
    if ple_shape is not None:
        ple_vocab, width = ple_shape
        if width % L:
            raise CheckpointError(f"{where}: embed_tokens_per_layer.weight width {width} is not a multiple of {L} layers")
        ple_dim = width // L
        if cfg_ple != "absent" and cfg_ple != ple_dim:
            raise CheckpointError(f"{where}: config hidden_size_per_layer_input={cfg_ple!r} contradicts "
                                  f"embed_tokens_per_layer.weight {tuple(ple_shape)} (per-layer dim {ple_dim})")
    else:
        ple_vocab, ple_dim = 0, 0
        if cfg_ple not in ("absent", None, 0):
            raise CheckpointError(f"{where}: config hidden_size_per_layer_input={cfg_ple} but the checkpoint has "
                                  f"no embed_tokens_per_layer.weight")

    moe = None
    if cfg.get("enable_moe_block"):
        moe = MoEConfig(num_experts=int_field(cfg, "num_experts", where), top_k=int_field(cfg, "top_k_experts", where),
                        intermediate_size=int_field(cfg, "moe_intermediate_size", where))

    rope_params = _require(cfg, "rope_parameters", where)
    if not isinstance(rope_params, dict):
        raise CheckpointError(f"{where}: rope_parameters must be an object, got {rope_params!r}")
    rope = {}
    for t in set(layer_types):
        if t not in rope_params:
            raise CheckpointError(f"{where}: rope_parameters has no entry for {t!r}")
        rope[t] = _rope(rope_params[t], head_dims[layer_types.index(t)], t, where)

    softcap = cfg.get("final_logit_softcapping")
    try:
        return build_config(
            vocab_size=int_field(cfg, "vocab_size", where), hidden_size=int_field(cfg, "hidden_size", where),
            layer_types=layer_types, n_heads=[nh] * L, n_kv_heads=kv_heads, head_dims=head_dims,
            k_eq_v=[k_eq_v_flag and t == FULL for t in layer_types], intermediate_sizes=intermediate,
            num_kv_shared_layers=shared, sliding_window=int_field(cfg, "sliding_window", where),
            rms_norm_eps=number_field(cfg, "rms_norm_eps", where),
            final_logit_softcap=None if softcap is None else number_field(cfg, "final_logit_softcapping", where),
            ple_dim=ple_dim, ple_vocab_size=ple_vocab, moe=moe, rope_inv_freq=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            max_position_embeddings=int_field(cfg, "max_position_embeddings", where),
        )
    except ConfigError as e:
        key = CONFIG_KEYS.get(e.field)
        raise CheckpointError(f"{where}: {e}" + (f" (config.json {key})" if key else "")) from None


def open_hf(directory: Path) -> Checkpoint:
    whole, cfg = _text_config(directory)
    quant = mlx.quantization(whole, directory / "config.json")
    files = safetensors_files(directory)
    handles = [safe_open(str(f), framework="pt") for f in files]
    located: dict[str, tuple[object, str]] = {}          # tensor name -> (handle, file path)
    for handle, f in zip(handles, files):
        for name in handle.keys():
            if name in located:
                raise CheckpointError(f"{f}: tensor {name!r} also appears in {located[name][1]}")
            located[name] = (handle, str(f))

    prefix = next((p for p in TEXT_PREFIXES if any(n.startswith(p + "embed_tokens.") for n in located)), None)
    if prefix is None:
        raise CheckpointError(f"{directory}: no text embedding (model.embed_tokens.weight or "
                              f"model.language_model.embed_tokens.weight)")
    canonical: dict[str, str] = {}
    towers: dict[str, str] = {}
    ignored = []
    for name in located:
        if name.startswith(TOWER_PREFIXES):
            towers[name.removeprefix("model.")] = name
        elif name.startswith(prefix):
            canonical[name[len(prefix):]] = name
        elif name in ("lm_head.weight", "lm_head.scales", "lm_head.biases"):     # (MLX: scales and biases too)
            canonical[name] = name
        else:
            ignored.append(name)                          # the audio tower and its projection

    def shape_of(n: str) -> tuple[int, ...]:
        return tuple(located[n][0].get_slice(n).get_shape())

    affine: dict[str, mlx.AffineTensor] = {}
    if quant is not None:                                 # MLX affine: weight + scales + biases -> one tensor
        canonical, affine = mlx.affine_tensors(canonical, shape_of, lambda n: located[n][0].get_slice(n).get_dtype(),
                                               lambda n: mlx.mapped(Path(located[n][1]), n), quant, directory)
    shapes = {c: shape_of(n) for c, n in canonical.items()} | {c: t.shape for c, t in affine.items()}
    config = config_from_hf(cfg, shapes, directory / "config.json")
    if config.tie_word_embeddings and "lm_head.weight" in shapes:
        ignored.append(canonical.pop("lm_head.weight", None) or affine.pop("lm_head.weight").name)  # tied: embed_tokens

    # vestigial K/V weights of KV-shared layers (docs/gemma4.md §3.4) are not loaded
    for spec in config.layers:
        if not spec.owns_kv:
            for suffix in VESTIGIAL_KV:
                c = f"layers.{spec.index}.{suffix}"
                if c in canonical:
                    ignored.append(canonical.pop(c))
                elif c in affine:
                    ignored.append(affine.pop(c).name)

    tensors = {c: _entry(c, *located[name], name, shapes[c]) for c, name in canonical.items()}
    metadata = {"config.json": cfg, "prefix": prefix}
    if quant is not None:
        files = {n: Path(f) for n, (_, f) in located.items()}
        tensors = {c: mlx.float_entry(e, canonical[c], files) for c, e in tensors.items()}
        tensors |= {c: mlx.entry(t, files) for c, t in affine.items()}
        metadata["quantization"] = {c: (t.bits, t.group) for c, t in affine.items() if isinstance(t, mlx.AffineTensor)}
        experts = sorted(c for c in tensors if c.endswith(mlx.EXPERT_WEIGHTS))
        if experts:                                       # the streamed experts' identity (weights/expert_stream.py)
            first = affine.get(experts[0])
            metadata["expert_file"] = files[first.files[0] if isinstance(first, mlx.AffineTensor)
                                            else first.gate if first is not None else canonical[experts[0]]]
    from gem4.weights.towers import hf_towers
    tower_tensors, tower_configs = hf_towers(
        whole, cfg, {c: _entry(c, *located[n], n, shape_of(n)) for c, n in towers.items()}, directory / "config.json")
    return Checkpoint(path=directory, format="safetensors", config=config, tensors=tensors, ignored=ignored,
                      metadata=metadata, towers=tower_tensors, tower_configs=tower_configs)


def _entry(canonical: str, handle, f: str, name: str, shape: tuple[int, ...]) -> TensorEntry:
    stored = handle.get_slice(name).get_dtype()
    if stored not in STORED_DTYPES:
        raise CheckpointError(f"{f}: tensor {name!r} has unsupported dtype {stored} (F32, F16 and BF16 are read)")
    nbytes = STORED_DTYPES[stored].itemsize
    for n in shape:
        nbytes *= n
    return TensorEntry(name=canonical, shape=shape, stored=stored, nbytes=nbytes,
                       dense=lambda h=handle, n=name: h.get_tensor(n))


def write_hf(directory: Path, config: dict, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Write a Gemma4ForCausalLM-layout checkpoint: config.json + model.safetensors (`model.` + canonical names)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({f"model.{name}": t.contiguous() for name, t in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt", **(metadata or {})})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
