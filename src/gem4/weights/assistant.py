"""The Gemma 4 assistant (MTP drafter) on disk: HF directories and llama.cpp GGUFs -> a bound Assistant.

docs/gemma4.md §5.1-§5.2. Two forms:

HF (`Gemma4AssistantForCausalLM`, model_type `gemma4_assistant`): config.json holds `backbone_hidden_size`
    and the decoder's `text_config` (a gemma4_text config whose layers are all KV-shared); weights are
    `model.*` (the decoder: embed_tokens, layers, norm), `pre_projection.weight`, `post_projection.weight`
    and, with `use_ordered_embeddings`, `masked_embedding.centroids.weight` + `masked_embedding.token_ordering`
    (the centroid head; decided by the tensors, checked against the flag). `lm_head.weight` is tied.
GGUF (architecture `gemma4-assistant`, as llama.cpp's converter writes it): the gemma4 keys under
    `gemma4-assistant.*` plus `embedding_length_out` (= backbone width) and `nextn_predict_layers`
    (= block_count); tensors `token_embd`, `output_norm`, `nextn.pre_projection`, `nextn.post_projection`,
    `blk.N.*` (gemma4's names, no k/v) and the generated `rope_freqs`. The converter drops the centroid
    head; llama.cpp's loader knows `masked_embd_centroids` / `masked_embd_ordering` but never uses them and
    the GGUF has no key for the head's top-k, so where a file has them they are ignored (listed in
    `ignored`) and the full-vocabulary head runs, as in llama.cpp.

The decoder's geometry is validated by the same code as a target's (hf.config_from_hf / build_config),
read as if no layer were shared (every assistant layer reads the target's K/V, so the usual donor rule
does not apply), then turned into an AssistantConfig and checked against the target model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from gem4.config import FULL, SLIDING, ConfigError, build_config, check_rope_theta, rope_with_factors
from gem4.model.backends import choose
from gem4.model.assistant import Assistant, AssistantConfig, CentroidHead
from gem4.weights.checkpoint import CheckpointError, TensorEntry
from gem4.gguf import GGUFError, GGUFReader, GGUFValueType, GGUFWriter
from gem4.weights.gguf_model import (
    FILE_TYPE, LAYER_NAMES, OUT_TYPES, GGUFMeta, attention_geometry, layer_types_from, rope_metadata, tensor_entry,
    tensor_type,
)
from gem4.weights.hf import config_from_hf, int_field, safetensors_files
from gem4.weights.loader import AUTO_DTYPE, DTYPES, block_storage, check_manifest, weight_dtype
from gem4.ggml import GGMLType, quantize

ARCH = "gemma4-assistant"
MODEL_TYPE = "gemma4_assistant"
GLOBAL_NAMES = {                                       # llama.cpp name -> canonical name
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "nextn.pre_projection.weight": "pre_projection.weight",
    "nextn.post_projection.weight": "post_projection.weight",
}
ASSISTANT_LAYER_NAMES = {k: v for k, v in LAYER_NAMES.items()
                         if k in ("attn_norm.weight", "attn_q.weight", "attn_q_norm.weight", "attn_output.weight",
                                  "post_attention_norm.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                                  "ffn_down.weight", "post_ffw_norm.weight", "layer_output_scale.weight")}
GGUF_UNUSED_HEAD = ("masked_embd_centroids.weight", "masked_embd_ordering")   # llama.cpp loads, never uses
CENTROIDS, ORDERING = "masked_embedding.centroids.weight", "masked_embedding.token_ordering"


@dataclass
class AssistantCheckpoint:
    path: Path
    format: str                                        # "gguf" | "safetensors"
    config: AssistantConfig
    tensors: dict[str, TensorEntry]                    # canonical name -> entry
    ignored: list[str] = field(default_factory=list)
    metadata: dict[str, object] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None


# ---- HF ----

def _hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: not a model directory (no config.json)") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    if cfg.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{path}: model_type {cfg.get('model_type')!r} is not a Gemma 4 assistant "
                              f"({MODEL_TYPE!r})")
    if not isinstance(cfg.get("text_config"), dict):
        raise CheckpointError(f"{path}: config.json lacks the assistant's text_config")
    return cfg


def open_hf_assistant(directory: Path) -> AssistantCheckpoint:
    from safetensors import safe_open

    from gem4.weights.hf import STORED_DTYPES

    cfg = _hf_config(directory)
    where = directory / "config.json"
    text = cfg["text_config"]
    files = safetensors_files(directory)
    canonical, ignored = {}, []
    for f in files:
        handle = safe_open(str(f), framework="pt")
        for name in handle.keys():
            c = name[len("model."):] if name.startswith("model.") else name
            if name == "lm_head.weight":
                ignored.append(name)                    # tied to model.embed_tokens (checked: tie_word_embeddings)
                continue
            if c in canonical:
                raise CheckpointError(f"{f}: tensor {name!r} appears twice")
            canonical[c] = (handle, name, f)
    shapes = {c: tuple(h.get_slice(n).get_shape()) for c, (h, n, _) in canonical.items()}

    has_head = CENTROIDS in canonical or ORDERING in canonical
    flag = cfg.get("use_ordered_embeddings")
    if flag is not None and bool(flag) != has_head:
        raise CheckpointError(f"{where}: use_ordered_embeddings={flag} but the checkpoint "
                              f"{'has no' if flag else 'has'} masked_embedding tensors")
    centroids = None
    if has_head:
        centroids = CentroidHead(num_centroids=int_field(cfg, "num_centroids", where),
                                 top_k=int_field(cfg, "centroid_intermediate_top_k", where))
    if not cfg.get("tie_word_embeddings", True) or not text.get("tie_word_embeddings", True):
        raise CheckpointError(f"{where}: tie_word_embeddings is false; an assistant's head is its embedding table")
    try:
        # every assistant layer reads the target's K/V: its geometry is validated as a model with no sharing
        decoder = config_from_hf(dict(text, num_kv_shared_layers=0), shapes, where)
        config = AssistantConfig.from_text_config(decoder, int_field(cfg, "backbone_hidden_size", where), centroids)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None

    tensors = {}
    for c, (handle, name, f) in canonical.items():
        stored = handle.get_slice(name).get_dtype()
        if c == ORDERING:
            if stored not in ("I64", "I32"):
                raise CheckpointError(f"{f}: {name!r} must hold integer token ids, got {stored}")
        elif stored not in STORED_DTYPES:
            raise CheckpointError(f"{f}: tensor {name!r} has unsupported dtype {stored} (F32, F16 and BF16 are read)")
        tensors[c] = TensorEntry(name=c, shape=shapes[c], stored=stored, nbytes=0,
                                 dense=lambda h=handle, n=name: h.get_tensor(n))
    return AssistantCheckpoint(directory, "safetensors", config, tensors, ignored, {"config.json": cfg})


# ---- GGUF ----

def _gguf_config(reader: GGUFReader, shapes: dict[str, tuple[int, ...]], rope_freqs) -> AssistantConfig:
    m, where = GGUFMeta(reader, ARCH), reader.path
    L = m.integer("block_count", required=True)
    Ha = m.integer("embedding_length", required=True)
    Hb = m.integer("embedding_length_out", required=True)
    nextn = m.integer("nextn_predict_layers", L)
    if nextn != L:
        raise CheckpointError(f"{where}: {ARCH}.nextn_predict_layers={nextn} differs from {ARCH}.block_count={L}")
    layer_types = layer_types_from(m, L)
    n_heads, n_kv, kv_known, d_full, d_swa = attention_geometry(m, L)
    if (m.integer("rope.dimension_count", d_full), m.integer("rope.dimension_count_swa", d_swa)) != (d_full, d_swa):
        raise CheckpointError(f"{where}: {ARCH}.rope.dimension_count(_swa) must equal the head dims "
                              f"{d_full} / {d_swa}; partial rotation is expressed with rope_freqs")
    if m.integer("embedding_length_per_layer_input", 0):
        raise CheckpointError(f"{where}: {ARCH}.embedding_length_per_layer_input must be 0 for an assistant")
    if "embed_tokens.weight" not in shapes:
        raise CheckpointError(f"{where}: missing required tensor 'token_embd.weight'")
    try:
        rope = {SLIDING: rope_with_factors(check_rope_theta(m.number("rope.freq_base_swa", 10000.0),
                                                            f"{ARCH}.rope.freq_base_swa"), d_swa, None),
                FULL: rope_with_factors(check_rope_theta(m.number("rope.freq_base", 10000.0), f"{ARCH}.rope.freq_base"),
                                        d_full, rope_freqs)}
        decoder = build_config(
            vocab_size=shapes["embed_tokens.weight"][0], hidden_size=Ha, layer_types=layer_types, n_heads=n_heads,
            n_kv_heads=n_kv, head_dims=[d_swa if t == SLIDING else d_full for t in layer_types],
            k_eq_v=[False] * L, intermediate_sizes=m.per_layer("feed_forward_length", L, required=True),
            num_kv_shared_layers=0, sliding_window=m.integer("attention.sliding_window", required=True),
            rms_norm_eps=m.number("attention.layer_norm_rms_epsilon", required=True), final_logit_softcap=None,
            ple_dim=0, ple_vocab_size=0, moe=None, rope_inv_freq={t: rope[t] for t in set(layer_types)},
            tie_word_embeddings=True, max_position_embeddings=m.integer("context_length", required=True))
        return AssistantConfig.from_text_config(decoder, Hb, None, kv_heads_known=kv_known)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e} (metadata {ARCH}.*)") from None


def open_gguf_assistant(path: Path) -> AssistantCheckpoint:
    try:
        reader = GGUFReader(path)
    except GGUFError as e:
        raise CheckpointError(str(e)) from None
    arch = GGUFMeta(reader, ARCH).get("general.architecture", required=True)
    if arch != ARCH:
        raise CheckpointError(f"{path}: the architecture is {arch!r}, not a Gemma 4 assistant ({ARCH!r})")
    canonical, ignored, rope_freqs = {}, [], None
    for name, info in reader.tensors.items():
        if name == "rope_freqs.weight":
            if info.ggml_type.name != "F32" or len(info.shape) != 1:
                raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' must be a 1-D F32 vector")
            rope_freqs = reader.tensor_data(name).view(np.float32).copy()
            continue
        if name in GGUF_UNUSED_HEAD:
            ignored.append(name)
            continue
        parts = name.split(".", 2)
        if name in GLOBAL_NAMES:
            canonical[GLOBAL_NAMES[name]] = name
        elif len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in ASSISTANT_LAYER_NAMES:
            canonical[f"layers.{int(parts[1])}.{ASSISTANT_LAYER_NAMES[parts[2]]}"] = name
        else:
            raise CheckpointError(f"{path}: unknown tensor {name!r} for architecture {ARCH!r}")
    shapes = {c: reader.tensors[n].shape for c, n in canonical.items()}
    config = _gguf_config(reader, shapes, rope_freqs)
    tensors = {c: tensor_entry(reader, n, c) for c, n in canonical.items()}
    return AssistantCheckpoint(path, "gguf", config, tensors, ignored, dict(reader.metadata), reader.close)


def open_assistant(path: str | Path) -> AssistantCheckpoint:
    """A `.gguf` file or an HF directory holding a Gemma 4 assistant."""
    p = Path(path)
    if p.is_dir():
        return open_hf_assistant(p)
    if p.is_file():
        return open_gguf_assistant(p)
    raise CheckpointError(f"{p}: no such file or directory (expected a .gguf file or an HF assistant directory)")


# ---- binding ----

def bind_assistant(ckpt: AssistantCheckpoint, target, dtype: str | None = None, device: str | None = None) -> Assistant:
    """Materialise the assistant beside `target` (a gem4 Model): checked against it (ConfigError names the
    mismatch), in the target's dtype and device unless told otherwise, fast mode when the target's is."""
    if dtype is None:
        torch_dtype = target.dtype
    elif dtype == "auto" or dtype in DTYPES:
        torch_dtype = DTYPES[AUTO_DTYPE if dtype == "auto" else dtype]
    else:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    device = str(target.device) if device is None else device
    config = ckpt.config
    with torch.device("meta"):
        model = Assistant(config, torch_dtype)
    model.bind_target(target.config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    manifest = dict(expected)
    if config.centroids is not None:
        manifest[ORDERING] = (config.vocab_size,)
    check_manifest(ckpt, manifest)

    backend = choose(torch_dtype, device)
    backend.prepare(model)
    state = {}
    for name in expected:
        entry = ckpt.tensors.get(name)
        storage = block_storage(name, entry, backend.packed_types)
        if storage == "packed":
            raw, ggml_type = entry.raw()
            parent, attr = name.rsplit(".", 1)
            backend.pack(model.get_submodule(parent), attr, raw, ggml_type)
            entry.release()
        elif entry is None:                                 # layer_scalar: optional, 1 (loader.OPTIONAL_ONES)
            state[name] = torch.ones(expected[name], dtype=torch.float32, device=device)
        else:
            state[name] = entry.dense().to(device=device, dtype=weight_dtype(name, expected[name], torch_dtype))
    if config.centroids is not None:
        ordering = ckpt.tensors[ORDERING].dense().to(device=device, dtype=torch.long)
        if not torch.equal(torch.sort(ordering).values, torch.arange(config.vocab_size, device=device)):
            raise CheckpointError(f"{ckpt.path}: {ORDERING} must be a permutation of the {config.vocab_size} token ids")
        state[ORDERING] = ordering
    model.load_state_dict(state, strict=True, assign=True)
    for layer_type, inv_freq in config.rope_inv_freq:
        setattr(model, f"inv_freq_{layer_type}", torch.tensor(inv_freq, dtype=torch.float32, device=device))
    backend.finish(model)
    return model.eval()


def load_assistant(path: str | Path, target, dtype: str | None = None, device: str | None = None) -> Assistant:
    """Load a Gemma 4 assistant (HF directory or gemma4-assistant GGUF) for `target`, a loaded gem4 Model.

    Refuses (CheckpointError) an assistant whose backbone width, vocabulary, sliding window or K/V geometry
    does not match the target's, naming the field."""
    ckpt = open_assistant(path)
    try:
        return bind_assistant(ckpt, target, dtype, device)
    except ConfigError as e:
        raise CheckpointError(f"{ckpt.path}: does not belong to the target model: {e}") from None


# ---- writing (tests; later gem4 convert) ----

def write_assistant_gguf(ckpt: AssistantCheckpoint, out: Path, out_type: str = "f32") -> None:
    """An HF assistant -> a GGUF as llama.cpp's converter writes it (docs/gemma4.md §5.2): the centroid
    head is dropped, as the converter does. (Checked once against convert_hf_to_gguf.py of llama.cpp as
    vendored in llama-cpp-python 0.3.36: the same keys and values, bit-identical tensors.)"""
    if ckpt.format != "safetensors":
        raise CheckpointError(f"{ckpt.path}: write_assistant_gguf reads HF assistant directories")
    config, qtype = ckpt.config, OUT_TYPES[out_type]
    text = ckpt.metadata["config.json"]["text_config"]
    factors, theta = rope_metadata(config, {t: float(p["rope_theta"]) for t, p in text["rope_parameters"].items()})
    w = GGUFWriter(out)
    V = GGUFValueType
    specs = config.layers
    d_full = next((s.head_dim for s in specs if s.layer_type == FULL), specs[0].head_dim)
    d_swa = next((s.head_dim for s in specs if s.layer_type == SLIDING), specs[0].head_dim)
    w.add("general.architecture", ARCH)
    w.add("general.name", ckpt.path.name)
    w.add("general.file_type", FILE_TYPE[qtype], V.UINT32)
    w.add("general.quantization_version", 2, V.UINT32)
    u32 = {"context_length": text["max_position_embeddings"], "embedding_length": config.hidden_size,
           "embedding_length_out": config.backbone_hidden_size, "block_count": config.num_layers,
           "nextn_predict_layers": config.num_layers, "attention.key_length": d_full,
           "attention.value_length": d_full, "attention.key_length_swa": d_swa, "attention.value_length_swa": d_swa,
           "rope.dimension_count": d_full, "rope.dimension_count_swa": d_swa,
           "attention.sliding_window": config.sliding_window, "attention.shared_kv_layers": config.num_layers,
           "embedding_length_per_layer_input": 0}
    for key, value in u32.items():
        w.add(f"{ARCH}.{key}", value, V.UINT32)
    for key, values in (("feed_forward_length", [s.intermediate_size for s in specs]),
                        ("attention.head_count", [s.n_heads for s in specs]),
                        ("attention.head_count_kv", [s.n_kv_heads for s in specs])):
        if len(set(values)) == 1:                         # the converter's form: a scalar when all layers agree
            w.add(f"{ARCH}.{key}", values[0], V.UINT32)
        else:
            w.add(f"{ARCH}.{key}", np.asarray(values, dtype=np.int32), V.ARRAY, V.INT32)
    w.add(f"{ARCH}.rope.freq_base", theta.get(FULL, 10000.0), V.FLOAT32)
    w.add(f"{ARCH}.rope.freq_base_swa", theta.get(SLIDING, 10000.0), V.FLOAT32)
    w.add(f"{ARCH}.attention.layer_norm_rms_epsilon", config.rms_norm_eps, V.FLOAT32)
    w.add(f"{ARCH}.attention.sliding_window_pattern", np.asarray([s.is_sliding for s in specs]), V.ARRAY, V.BOOL)
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors, (factors.size,), GGMLType.F32)
    to_gguf = {v: k for k, v in GLOBAL_NAMES.items()}
    layer_to_gguf = {v: k for k, v in ASSISTANT_LAYER_NAMES.items()}
    for canonical, entry in ckpt.tensors.items():
        if canonical in (CENTROIDS, ORDERING):
            continue                                      # the converter skips the centroid head
        if canonical in to_gguf:
            name = to_gguf[canonical]
        else:
            _, index, suffix = canonical.split(".", 2)
            name = f"blk.{index}.{layer_to_gguf[suffix]}"
        t = tensor_type(canonical, entry.shape, qtype)
        w.add_tensor(name, quantize(entry.dense().float().contiguous(), t).numpy(), entry.shape, t)
    w.write()
