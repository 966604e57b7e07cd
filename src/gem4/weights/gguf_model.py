"""Gemma 4 on top of the GGUF container: llama.cpp's tensor names and metadata keys, both ways.

`gguf.py` is the format (strict, model-agnostic); this module is the Gemma 4 vocabulary spoken in it
(docs/gemma4.md §3-§4): reading a file into canonical tensors + ModelConfig, and writing one for
`gem4 convert`.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from gem4.config import (
    FULL,
    SLIDING,
    ConfigError,
    ModelConfig,
    MoEConfig,
    build_config,
    check_rope_theta,
    rope_default,
    rope_with_factors,
)
from gem4.weights.checkpoint import Checkpoint, CheckpointError, TensorEntry
from gem4.gguf import GGUFError, GGUFReader, GGUFValueType, GGUFWriter
from gem4.ggml import BLOCK_INFO, GGMLType, dequantize, ggml_dtype_view, quantize

ARCH = "gemma4"

# llama.cpp name -> canonical name (docs/gemma4.md §3.2)
GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "per_layer_projection_norm.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.weight": "router.proj.weight",            # 26B-A4B
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",       # renamed by the converter (docs/gemma4.md §3.2)
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "inp_gate.weight": "per_layer_input_gate.weight",        # E2B/E4B
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}
CANONICAL_TO_GGUF = {v: k for k, v in GLOBAL_NAMES.items()}
LAYER_CANONICAL_TO_GGUF = {v: k for k, v in LAYER_NAMES.items()}
VESTIGIAL_KV = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")     # on KV-shared layers (docs/gemma4.md §3.4)
NOT_YET = {"attn_qkv.weight": "fused QKV (--fuse-qkv)", "ffn_gate_exps.weight": "split expert gate/up tensors",
           "ffn_up_exps.weight": "split expert gate/up tensors"}
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
ROPE_OFF = 1e30                                            # llama.cpp's "do not rotate this pair" factor
# ConfigError.field -> the metadata key (under gemma4.) it was read from, for error messages
CONFIG_KEYS = {
    "sliding_window": "attention.sliding_window",
    "max_position_embeddings": "context_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "final_logit_softcap": "final_logit_softcapping",
    "num_kv_shared_layers": "attention.shared_kv_layers",
    "hidden_size": "embedding_length",
    "n_heads": "attention.head_count",
    "n_kv_heads": "attention.head_count_kv",
    "head_dims": ("attention.key_length", "attention.key_length_swa"),
    "intermediate_sizes": "feed_forward_length",
    "ple_dim": "embedding_length_per_layer_input",
    "moe.num_experts": "expert_count",
    "moe.top_k": ("expert_used_count", "expert_count"),
    "moe.intermediate_size": "expert_feed_forward_length",
    "gqa": ("attention.head_count", "attention.head_count_kv"),
    "sliding_window/context": ("attention.sliding_window", "context_length"),
    "embed": ("embedding_length",),
    "ple": ("embedding_length_per_layer_input", "block_count"),
    "attention": ("attention.head_count", "attention.head_count_kv", "attention.key_length",
                  "attention.key_length_swa", "embedding_length"),
    "mlp": ("feed_forward_length", "embedding_length"),
    "moe.size": ("expert_count", "expert_feed_forward_length", "embedding_length"),
    f"rope.{SLIDING}": "rope.freq_base_swa",
    f"rope.{FULL}": ("rope.freq_base", "rope_freqs.weight"),
}


def to_gguf_name(canonical: str) -> str:
    if canonical in CANONICAL_TO_GGUF:
        return CANONICAL_TO_GGUF[canonical]
    _, index, suffix = canonical.split(".", 2)
    return f"blk.{index}.{LAYER_CANONICAL_TO_GGUF[suffix]}"


def to_canonical(name: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}"
    return None


# ---- reading ----

class GGUFMeta:
    """Typed access to `<arch>.*` keys (`gemma4.*`; `gemma4-assistant.*` for weights/assistant.py) with errors
    that name the file and key."""

    def __init__(self, reader: GGUFReader, arch: str = ARCH):
        self.r = reader
        self.arch = arch

    def get(self, key: str, default=None, required: bool = False):
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        if full not in self.r.metadata:
            if required:
                raise CheckpointError(f"{self.r.path}: missing required metadata key {full!r}")
            return default
        return self.r.metadata[full]

    def integer(self, key: str, default=None, required: bool = False) -> int | None:
        v = self.get(key, default, required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise CheckpointError(f"{self.r.path}: metadata {key!r} must be an integer, got {v!r}")
        return int(v)

    def number(self, key: str, default=None, required: bool = False) -> float | None:
        v = self.get(key, default, required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
            raise CheckpointError(f"{self.r.path}: metadata {key!r} must be a number, got {v!r}")
        return float(v)

    def per_layer(self, key: str, n: int, default=None, required: bool = False) -> list[int]:
        """A u32 scalar broadcast to every layer, or an array of exactly n integers."""
        v = self.get(key, default, required)
        if isinstance(v, np.ndarray) and v.dtype.kind in "iu":
            if v.shape != (n,):
                raise CheckpointError(f"{self.r.path}: metadata {key!r} has {v.size} entries for {n} layers")
            return [int(x) for x in v]
        return [self.integer(key, default, required)] * n


def _check_architecture(reader: GGUFReader) -> None:
    """A GGUF of another model family is refused by its architecture's name, before its tensors are read."""
    arch = GGUFMeta(reader).get("general.architecture", required=True)
    if arch != ARCH:
        hint = " (a Gemma 4 assistant drafts for a target model: gem4.load_assistant)" if arch == "gemma4-assistant" else ""
        raise CheckpointError(f"{reader.path}: the architecture is {arch!r}; gem4 runs Gemma 4 "
                              f"({ARCH!r}) text models{hint}")


def layer_types_from(m: "GGUFMeta", L: int) -> list[str]:
    """The layer types from `{arch}.attention.sliding_window_pattern`, a bool array of block_count entries."""
    pattern = m.get("attention.sliding_window_pattern", required=True)
    if not (isinstance(pattern, np.ndarray) and pattern.dtype == bool and pattern.shape == (L,)):
        raise CheckpointError(f"{m.r.path}: {m.arch}.attention.sliding_window_pattern must be a bool array of "
                              f"{m.arch}.block_count={L} entries")
    return [SLIDING if s else FULL for s in pattern]


def attention_geometry(m: GGUFMeta, L: int) -> tuple[list[int], list[int], bool, int, int]:
    """`<arch>.attention.*` -> (query heads per layer, KV heads per layer -- the query heads' where the file does
    not say --, whether it says, the full and the sliding layers' head dims); a value length must equal its key
    length."""
    n_heads = m.per_layer("attention.head_count", L, required=True)
    kv_known = m.get("attention.head_count_kv") is not None
    n_kv = m.per_layer("attention.head_count_kv", L) if kv_known else n_heads
    d_full = m.integer("attention.key_length", required=True)
    d_swa = m.integer("attention.key_length_swa", required=True)
    for k, key_k, d in (("attention.value_length", "attention.key_length", d_full),
                        ("attention.value_length_swa", "attention.key_length_swa", d_swa)):
        if m.integer(k, d) != d:
            raise CheckpointError(f"{m.r.path}: {m.arch}.{k}={m.integer(k)} differs from {m.arch}.{key_k}={d}")
    return n_heads, n_kv, kv_known, d_full, d_swa


def config_from_gguf(reader: GGUFReader, shapes: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None) -> ModelConfig:
    """GGUF metadata (+ tensor shapes for what the metadata leaves to them) -> ModelConfig (docs/gemma4.md §4.2)."""
    m, where = GGUFMeta(reader), reader.path
    _check_architecture(reader)
    L = m.integer("block_count", required=True)
    H = m.integer("embedding_length", required=True)
    if not L or L <= 0 or H <= 0:
        raise CheckpointError(f"{where}: {ARCH}.block_count={L} and {ARCH}.embedding_length={H} must be positive")
    layer_types = layer_types_from(m, L)
    n_heads, n_kv, _, d_full, d_swa = attention_geometry(m, L)
    head_dims = [d_swa if t == SLIDING else d_full for t in layer_types]
    n_ff = m.per_layer("feed_forward_length", L, required=True)
    shared = m.integer("attention.shared_kv_layers", 0)
    first = L - shared

    # RoPE: sliding = default over n_rot_swa; full = n_rot with per-pair factors from rope_freqs.weight
    n_rot = m.integer("rope.dimension_count", d_full)
    n_rot_swa = m.integer("rope.dimension_count_swa", n_rot)
    if (n_rot, n_rot_swa) != (d_full, d_swa):
        raise CheckpointError(f"{where}: {ARCH}.rope.dimension_count={n_rot} and {ARCH}.rope.dimension_count_swa="
                              f"{n_rot_swa} must equal the head dims {ARCH}.attention.key_length={d_full} and "
                              f"{ARCH}.attention.key_length_swa={d_swa}; partial rotation is expressed with rope_freqs")
    try:
        rope = {SLIDING: rope_with_factors(check_rope_theta(m.number("rope.freq_base_swa", 10000.0),
                                                            f"{ARCH}.rope.freq_base_swa"), d_swa, None),
                FULL: rope_with_factors(check_rope_theta(m.number("rope.freq_base", 10000.0), f"{ARCH}.rope.freq_base"),
                                        d_full, rope_freqs)}
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None

    ple_dim = m.integer("embedding_length_per_layer_input", required=True)
    ple_shape = shapes.get("embed_tokens_per_layer.weight")
    if ple_dim and ple_shape is None:
        raise CheckpointError(f"{where}: {ARCH}.embedding_length_per_layer_input={ple_dim} but per_layer_token_embd.weight "
                              f"is missing")
    if not ple_dim and ple_shape is not None:
        raise CheckpointError(f"{where}: per_layer_token_embd.weight present but {ARCH}.embedding_length_per_layer_input "
                              f"is 0")

    moe_layers = [i for i in range(L) if f"layers.{i}.router.proj.weight" in shapes]
    moe = None
    if moe_layers:
        if len(moe_layers) != L:
            raise CheckpointError(f"{where}: expert router (ffn_gate_inp.weight) present on layers {moe_layers} only")
        moe = MoEConfig(num_experts=m.integer("expert_count", required=True),
                        top_k=m.integer("expert_used_count", required=True),
                        intermediate_size=m.integer("expert_feed_forward_length", required=True))

    # k_eq_v: a full layer that computes K/V but has no V projection
    k_eq_v = [t == FULL and i < first and f"layers.{i}.self_attn.v_proj.weight" not in shapes
              for i, t in enumerate(layer_types)]
    if "embed_tokens.weight" not in shapes:
        raise CheckpointError(f"{where}: missing required tensor 'token_embd.weight'")
    softcap = m.number("final_logit_softcapping", None)
    try:
        return build_config(
            vocab_size=shapes["embed_tokens.weight"][0], hidden_size=H, layer_types=layer_types, n_heads=n_heads,
            n_kv_heads=n_kv, head_dims=head_dims, k_eq_v=k_eq_v, intermediate_sizes=n_ff,
            num_kv_shared_layers=shared, sliding_window=m.integer("attention.sliding_window", required=True),
            rms_norm_eps=m.number("attention.layer_norm_rms_epsilon", required=True),
            final_logit_softcap=softcap, ple_dim=ple_dim, ple_vocab_size=ple_shape[0] if ple_shape else 0,
            moe=moe, rope_inv_freq=rope, tie_word_embeddings="lm_head.weight" not in shapes,
            max_position_embeddings=m.integer("context_length", required=True),
        )
    except ConfigError as e:
        keys = CONFIG_KEYS.get(e.field, ())
        keys = ", ".join(f"{ARCH}.{k}" for k in ((keys,) if isinstance(keys, str) else keys))
        raise CheckpointError(f"{where}: {e}" + (f" (metadata {keys})" if keys else "")) from None


def tensor_entry(reader: GGUFReader, gguf_name: str, canonical: str) -> TensorEntry:
    info = reader.tensors[gguf_name]

    def raw_bytes() -> torch.Tensor:
        with warnings.catch_warnings():             # the mmap is read-only; nothing writes through these views
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(reader.tensor_data(gguf_name))

    def dense() -> torch.Tensor:
        view = ggml_dtype_view(raw_bytes(), info.ggml_type, info.shape)
        return view if view is not None else dequantize(raw_bytes(), info.ggml_type, info.shape)

    is_block = info.ggml_type not in FLOAT_TYPES
    return TensorEntry(name=canonical, shape=info.shape, stored=info.ggml_type.name, nbytes=info.nbytes, dense=dense,
                       raw=(lambda: (raw_bytes(), info.ggml_type)) if is_block else None,
                       release=lambda: reader.release(gguf_name), offset=info.offset)


def open_gguf(path: Path) -> Checkpoint:
    try:
        reader = GGUFReader(path)
    except GGUFError as e:
        raise CheckpointError(str(e)) from None
    _check_architecture(reader)
    canonical: dict[str, str] = {}
    rope_freqs = None
    for name, info in reader.tensors.items():
        if name == "rope_freqs.weight":
            if info.ggml_type != GGMLType.F32 or len(info.shape) != 1:
                raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' must be a 1-D F32 vector")
            rope_freqs = reader.tensor_data(name).view(np.float32).copy()
            continue
        suffix = name.split(".", 2)[-1]
        if suffix in NOT_YET:
            raise CheckpointError(f"{path}: tensor {name!r}: {NOT_YET[suffix]} is not supported yet")
        c = to_canonical(name)
        if c is None:
            raise CheckpointError(f"{path}: unknown tensor {name!r} for architecture {ARCH!r}")
        canonical[c] = name
    shapes = {c: reader.tensors[n].shape for c, n in canonical.items()}
    config = config_from_gguf(reader, shapes, rope_freqs)

    ignored = []
    for spec in config.layers:                      # vestigial K/V of KV-shared layers are not loaded
        if not spec.owns_kv:
            for suffix in VESTIGIAL_KV:
                c = to_canonical(f"blk.{spec.index}.{suffix}")
                if c in canonical:
                    ignored.append(canonical.pop(c))
    tensors = {c: tensor_entry(reader, n, c) for c, n in canonical.items()}
    return Checkpoint(path=path, format="gguf", config=config, tensors=tensors, ignored=ignored,
                      metadata=dict(reader.metadata), close=reader.close)


# ---- writing (gem4 convert) ----

OUT_TYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "bf16": GGMLType.BF16, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0,
             "q4_k": GGMLType.Q4_K, "q5_k": GGMLType.Q5_K, "q6_k": GGMLType.Q6_K}
# llama.cpp's _M mixes: the base type, with the token tables, some attn_v and some ffn_down in Q6_K (mix_type)
MIXES = {"q4_k_m": GGMLType.Q4_K, "q5_k_m": GGMLType.Q5_K}
# llama_ftype (general.file_type); q4_k / q5_k (every matrix in one type) are named as llama.cpp's _S files
FILE_TYPE = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q4_0: 2, GGMLType.Q8_0: 7, GGMLType.BF16: 32,
             GGMLType.Q4_K: 14, GGMLType.Q5_K: 16, GGMLType.Q6_K: 18}
MIX_FILE_TYPE = {"q4_k_m": 15, "q5_k_m": 17}
# rows that are not whole 256-blocks (26B-A4B's experts, Im = 704): llama.cpp's fallbacks (F16 when not even 32-blocks)
K_FALLBACK = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q5_K: GGMLType.Q5_1, GGMLType.Q6_K: GGMLType.Q8_0}
_VT = GGUFValueType


def tensor_type(canonical: str, shape: tuple[int, ...], out_type: GGMLType) -> GGMLType:
    """llama.cpp's policy: vectors and the 26B-A4B router stay F32; rows that are not whole blocks of the type
    fall back (K-quants: K_FALLBACK, then F16; 32-blocks: F16)."""
    if len(shape) == 1 or canonical.endswith(("router.proj.weight", "layer_scalar")):
        return GGMLType.F32
    if shape[-1] % BLOCK_INFO[out_type].block_size:
        fallback = K_FALLBACK.get(out_type, GGMLType.F16)
        return fallback if shape[-1] % BLOCK_INFO[fallback].block_size == 0 else GGMLType.F16
    return out_type


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix_type(canonical: str, shape: tuple[int, ...], base: GGMLType, num_layers: int, v_layers: list[int]) -> GGMLType:
    """The type of one tensor in a Q4_K_M / Q5_K_M mix (our reading of llama.cpp's llama-quant.cpp for a tied
    model): the token table (also the head) and the per-layer token table Q6_K; attn_v Q6_K where use_more_bits
    holds for its rank among the layers that have one (`v_layers`, ascending); ffn_down (dense and experts) Q6_K
    where it holds for its layer; everything else `base`; then tensor_type's fallbacks. llama.cpp never quantizes
    the E2B/E4B per-layer model projection: BF16 here (it keeps the source's type)."""
    t = base
    if canonical == "per_layer_model_projection.weight":
        return GGMLType.BF16
    if canonical in ("embed_tokens.weight", "embed_tokens_per_layer.weight"):
        t = GGMLType.Q6_K
    elif canonical.startswith("layers."):
        layer = int(canonical.split(".")[1])
        if canonical.endswith("self_attn.v_proj.weight") and _more_bits(v_layers.index(layer), len(v_layers)):
            t = GGMLType.Q6_K
        elif canonical.endswith(("mlp.down_proj.weight", "experts.down_proj")) and _more_bits(layer, num_layers):
            t = GGMLType.Q6_K
    return tensor_type(canonical, shape, t)


def rope_metadata(config: ModelConfig, theta: dict[str, float]) -> tuple[np.ndarray | None, dict[str, float]]:
    """Express the config's inv_freq vectors in llama.cpp terms: base per type + rope_freqs factors (full layers).

    Refuses a RoPE that GGUF cannot carry (sliding layers have no factor vector).
    """
    full_d = next((s.head_dim for s in config.layers if s.layer_type == FULL), None)
    swa_d = next((s.head_dim for s in config.layers if s.layer_type == SLIDING), None)
    if swa_d is not None:
        want = np.asarray(config.inv_freq(SLIDING))
        if not np.allclose(np.asarray(rope_default(theta[SLIDING], swa_d)), want, rtol=1e-6, atol=0):
            raise CheckpointError("sliding-layer RoPE is not the default form; GGUF cannot express it")
    factors = None
    if full_d is not None:
        inv_freq = np.asarray(config.inv_freq(FULL), dtype=np.float64)
        base = np.asarray(rope_default(theta[FULL], full_d), dtype=np.float64)
        factors = np.where(inv_freq > 0, base / np.where(inv_freq > 0, inv_freq, 1.0), ROPE_OFF).astype(np.float32)
    return factors, theta


def _tokenizer_keys(directory: Path, writer: GGUFWriter) -> bool:
    """The directory's tokenizer (read by gem4.Tokenizer, the owner of token types) -> tokenizer.* keys.

    False when the directory has no tokenizer.json.
    """
    if not (directory / "tokenizer.json").is_file():
        return False
    from gem4.tokenizer import Tokenizer

    tok = Tokenizer.from_hf(directory)
    writer.add("tokenizer.ggml.model", "gemma4")
    writer.add("tokenizer.ggml.tokens", tok.tokens, _VT.ARRAY, _VT.STRING)
    writer.add("tokenizer.ggml.scores", np.full(len(tok.tokens), -1000.0, dtype=np.float32), _VT.ARRAY, _VT.FLOAT32)
    writer.add("tokenizer.ggml.token_type", tok.types.astype(np.int32), _VT.ARRAY, _VT.INT32)
    writer.add("tokenizer.ggml.merges", [f"{a} {b}" for a, b in tok.merges], _VT.ARRAY, _VT.STRING)
    # llama.cpp's key names (gguf-py Keys.Tokenizer): unknown_, padding_, not unk_ / pad_
    for attr, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = getattr(tok.special, attr)
        if token_id is not None:
            writer.add(f"tokenizer.ggml.{key}_token_id", token_id, _VT.UINT32)
    writer.add("tokenizer.ggml.add_bos_token", tok.add_bos)
    writer.add("tokenizer.ggml.add_space_prefix", False)
    if tok.chat_template is not None:
        writer.add("tokenizer.chat_template", tok.chat_template)
    return True


def write_gguf(ckpt: Checkpoint, out: Path, out_type: str, name: str | None = None) -> dict[str, int]:
    """Write `ckpt` (an HF checkpoint) as a llama.cpp-compatible Gemma 4 GGUF. Returns tensor counts by type."""
    if out_type not in OUT_TYPES and out_type not in MIXES:
        raise ValueError(f"--type must be one of {sorted([*OUT_TYPES, *MIXES])}, got {out_type!r}")
    if ckpt.format != "safetensors":
        raise CheckpointError(f"{ckpt.path}: convert reads HF checkpoint directories")
    qtype = MIXES.get(out_type) or OUT_TYPES[out_type]
    if ckpt.metadata.get("quantization") and out_type != "f32":
        # MLX affine (weights/mlx.py): float32 holds its values (scale * q + bias) exactly; every other type would
        # round them again: GGML's blocks hold a group's scale and bias in f16 (Q4_1) or have no bias at all
        bits = sorted({f"{b}-bit, groups of {g}" for b, g in ckpt.metadata["quantization"].values()})
        raise CheckpointError(f"{ckpt.path}: an MLX affine checkpoint ({'; '.join(bits)}) converts to GGUF losslessly "
                              f"only with --type f32; --type {out_type} would requantize its values (gem4 runs the "
                              "MLX checkpoint itself on its kernels: no conversion is needed)")
    config = ckpt.config
    rope_params = ckpt.metadata["config.json"].get("text_config", ckpt.metadata["config.json"])["rope_parameters"]
    factors, theta = rope_metadata(config, {t: float(p["rope_theta"]) for t, p in rope_params.items()})

    w = GGUFWriter(out)
    L = config.num_layers
    specs = config.layers
    w.add("general.architecture", ARCH)
    w.add("general.name", name or ckpt.path.name)
    w.add("general.file_type", MIX_FILE_TYPE.get(out_type, FILE_TYPE[qtype]), _VT.UINT32)
    w.add("general.quantization_version", 2, _VT.UINT32)

    def scalar_or_array(key: str, values: list[int]) -> None:
        if len(set(values)) == 1:
            w.add(f"{ARCH}.{key}", values[0], _VT.UINT32)
        else:
            w.add(f"{ARCH}.{key}", np.asarray(values, dtype=np.int32), _VT.ARRAY, _VT.INT32)

    d_full = next((s.head_dim for s in specs if s.layer_type == FULL), specs[0].head_dim)
    d_swa = next((s.head_dim for s in specs if s.layer_type == SLIDING), specs[0].head_dim)
    w.add(f"{ARCH}.context_length", config.max_position_embeddings, _VT.UINT32)
    w.add(f"{ARCH}.embedding_length", config.hidden_size, _VT.UINT32)
    w.add(f"{ARCH}.block_count", L, _VT.UINT32)
    scalar_or_array("feed_forward_length", [s.intermediate_size for s in specs])
    scalar_or_array("attention.head_count", [s.n_heads for s in specs])
    scalar_or_array("attention.head_count_kv", [s.n_kv_heads for s in specs])
    for key, value in (("attention.key_length", d_full), ("attention.value_length", d_full),
                       ("attention.key_length_swa", d_swa), ("attention.value_length_swa", d_swa),
                       ("rope.dimension_count", d_full), ("rope.dimension_count_swa", d_swa)):
        w.add(f"{ARCH}.{key}", value, _VT.UINT32)
    w.add(f"{ARCH}.rope.freq_base", theta.get(FULL, 10000.0), _VT.FLOAT32)
    w.add(f"{ARCH}.rope.freq_base_swa", theta.get(SLIDING, 10000.0), _VT.FLOAT32)
    w.add(f"{ARCH}.attention.layer_norm_rms_epsilon", config.rms_norm_eps, _VT.FLOAT32)
    w.add(f"{ARCH}.attention.sliding_window", config.sliding_window, _VT.UINT32)
    w.add(f"{ARCH}.attention.sliding_window_pattern", np.asarray([s.is_sliding for s in specs]), _VT.ARRAY, _VT.BOOL)
    w.add(f"{ARCH}.attention.shared_kv_layers", L - config.first_shared_layer, _VT.UINT32)
    w.add(f"{ARCH}.embedding_length_per_layer_input", config.ple_dim, _VT.UINT32)
    if config.final_logit_softcap is not None:
        w.add(f"{ARCH}.final_logit_softcapping", config.final_logit_softcap, _VT.FLOAT32)
    if config.moe is not None:
        w.add(f"{ARCH}.expert_count", config.moe.num_experts, _VT.UINT32)
        w.add(f"{ARCH}.expert_used_count", config.moe.top_k, _VT.UINT32)
        w.add(f"{ARCH}.expert_feed_forward_length", config.moe.intermediate_size, _VT.UINT32)
    _tokenizer_keys(ckpt.path, w)

    counts: dict[str, int] = {}
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors, (factors.size,), GGMLType.F32)
        counts["F32"] = 1
    v_layers = sorted(int(c.split(".")[1]) for c in ckpt.tensors if c.endswith("self_attn.v_proj.weight"))
    for canonical, entry in ckpt.tensors.items():
        t = (mix_type(canonical, entry.shape, qtype, L, v_layers) if out_type in MIXES
             else tensor_type(canonical, entry.shape, qtype))
        data = quantize(entry.dense().float().contiguous(), t).numpy()
        w.add_tensor(to_gguf_name(canonical), data, entry.shape, t)
        counts[t.name] = counts.get(t.name, 0) + 1
    w.write()
    return counts
