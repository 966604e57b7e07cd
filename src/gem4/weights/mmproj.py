"""llama.cpp's mmproj GGUF: the vision and audio towers beside a GGUF text model (docs/multimodal.md §2.4).

llama.cpp keeps a Gemma 4 checkpoint's towers out of the text GGUF, in a second file (`general.architecture`
"clip", `general.type` "mmproj") that `llama-server --mmproj FILE` takes; `gem4.load(path, mmproj=FILE)` and
`--mmproj FILE` on run, chat and serve take the same file. `read_mmproj` turns it into the canonical tower tensors
and `VisionConfig` an HF checkpoint gives (weights/towers.py), so `bind_vision` binds it unchanged:

- names: `v.*` / `mm.*` <-> the HF names without `model.` (`mmproj_name`); the one transform, the patch embedder
  written as a conv kernel (D, 3, p, p), is undone to the (D, p·p·3) linear (row in patch, column, channel);
  clip bounds stored as [1] become scalars;
- config: every value the file states (`clip.vision.*`), the rest from the tensors as llama.cpp infers them
  (head_dim from `attn_q_norm`, kv heads from `attn_k`, the position table size, clipping by `….input_min`,
  standardisation by `v.std_bias`); pooling from `clip.vision.projector.scale_factor`, else 3, and RoPE theta 100,
  the two values llama.cpp hard-codes. `image_mean` must be 0 and `image_std` 1 (the tower maps pixels to
  [-1, 1] itself); the projection must map into the text model's width; the image token ids come from the text
  GGUF's vocabulary by their strings;
- bidirectional attention, which neither file records: causal when the text model has per-layer embeddings (the
  E2B/E4B family), image tokens both ways on sliding layers otherwise (26B-A4B, 31B).

E2B/E4B's conformer audio tower (`clip.has_audio_encoder`, projector "gemma4a", `a.*` / `mm.a.*`, the section at
the end of this file) comes out as the canonical tensors and `AudioConfig` weights/audio.py takes from an HF
checkpoint, bound by `bind_audio`: `clip.audio.*` for the sizes, the tensors for the subsampling channels, conv
kernel, output width and clipping, and the constants llama.cpp hard-codes for the rest (AUDIO_FIXED);
`per_dim_scale` is stored through softplus and kept so (AudioModel(softplus_applied=True)); the audio token ids
come from the text GGUF's vocabulary.

The 12B ("unified", projectors "gemma4uv" / "gemma4ua"; docs/multimodal.md §2.6) has
no tower: its embedder's tensors (patch_dense's columns and patch_ln1 stored in CHW order, the position table with
its axes swapped) and its raw-frame audio projection, read into UnifiedVisionConfig / FrameAudioConfig and
written as llama.cpp's converter writes them (the sections at the end of this file).

`write_mmproj` (gem4 convert) writes an HF checkpoint's towers in the same layout, tensor for tensor what
llama.cpp's `convert_hf_to_gguf.py --mmproj` writes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gem4.config import (AudioConfig, ConfigError, FrameAudioConfig, UnifiedVisionConfig, VisionConfig,
                         build_audio_config, build_frame_audio_config, build_unified_vision_config,
                         build_vision_config)
from gem4.ggml import GGMLType, quantize
from gem4.gguf import GGUFError, GGUFReader, GGUFValueType, GGUFWriter
from gem4.media import audio as front_end
from gem4.model.unified_vision import UnifiedVisionModel
from gem4.model.vision import VisionModel
from gem4.weights.audio import audio_shapes, hf_audio
from gem4.weights.checkpoint import Checkpoint, CheckpointError, TensorEntry
from gem4.weights.gguf_model import tensor_entry

ARCH = "clip"
PROJECTOR = "gemma4v"
ROPE_THETA = 100.0                # not in the file: llama.cpp hard-codes it for gemma4v
POOLING = 3                       # n_merge, unless clip.vision.projector.scale_factor says otherwise
# the image placeholders, found in the text model's vocabulary as llama.cpp's mtmd finds them
IMAGE_TOKENS = {"image_token_id": "<|image|>", "boi_token_id": "<|image>", "eoi_token_id": "<image|>"}
VIDEO_TOKEN = "<|video|>"    # optional: without it the model takes no video

_LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}
_NORMS = {f"{hf}.weight": gg for hf, gg in (
    ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"), ("input_layernorm", "ln1"),
    ("post_attention_layernorm", "attn_post_norm"), ("pre_feedforward_layernorm", "ln2"),
    ("post_feedforward_layernorm", "ffn_post_norm"))}
_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
_GLOBAL = {"vision_tower.patch_embedder.input_proj.weight": "v.patch_embd.weight",
           "vision_tower.patch_embedder.position_embedding_table": "v.position_embd.weight",
           "vision_tower.std_bias": "v.std_bias", "vision_tower.std_scale": "v.std_scale",
           "embed_vision.embedding_projection.weight": "mm.input_projection.weight"}
_PATCH = "vision_tower.patch_embedder.input_proj.weight"


def mmproj_name(canonical: str) -> str:
    """gem4's (HF without `model.`) vision tensor name -> llama.cpp's mmproj name."""
    return _tower_name(canonical, _GLOBAL, "vision_tower.encoder.layers.", "v.blk", _LINEARS, _NORMS)


def _tower_name(canonical: str, globals_: dict[str, str], layers: str, block: str, linears: dict[str, str],
                others: dict[str, str]) -> str:
    """A tower tensor's mmproj name: a whole-tower tensor's from `globals_`; a layer's `layers`N.part as `block`.N.
    plus its linear's name (`linears`: the weight, and the clip bounds as they are) or another tensor's (`others`)."""
    if canonical in globals_:
        return globals_[canonical]
    head, sep, rest = canonical.partition(layers)
    if head or not sep:
        raise KeyError(canonical)
    n, part = rest.split(".", 1)
    if part in others:
        return f"{block}.{n}.{others[part]}.weight"
    for hf, gg in linears.items():
        if part == f"{hf}.linear.weight":
            return f"{block}.{n}.{gg}.weight"
        for bound in _BOUNDS:
            if part == f"{hf}.{bound}":
                return f"{block}.{n}.{gg}.{bound}"
    raise KeyError(canonical)


def _expected(config: VisionConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = VisionModel(config, torch.float32)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _stored_shape(canonical: str, shape: tuple[int, ...], patch_size: int) -> tuple[int, ...]:
    """The shape llama.cpp stores a tensor of gem4's `shape` in."""
    if canonical == _PATCH:
        return (shape[0], 3, patch_size, patch_size)
    return (1,) if shape == () else shape


def _patch_linear(kernel: torch.Tensor) -> torch.Tensor:
    """(D, 3, p, p) conv kernel -> (D, p·p·3) linear over (row, column, channel) patch vectors."""
    return kernel.permute(0, 2, 3, 1).reshape(kernel.shape[0], -1)


def _entry(reader: GGUFReader, name: str, canonical: str, shape: tuple[int, ...]) -> TensorEntry:
    base = tensor_entry(reader, name, canonical)
    if canonical == _PATCH:
        return TensorEntry(name=canonical, shape=shape, stored=base.stored, nbytes=base.nbytes,
                           dense=lambda: _patch_linear(base.dense().float()), release=base.release)
    if shape == ():
        return TensorEntry(name=canonical, shape=(), stored=base.stored, nbytes=base.nbytes,
                           dense=lambda: base.dense().reshape(()), release=base.release)
    return base


def _refuse_unexpected(where: str, names: set[str]) -> None:
    """A tensor the file's keys do not imply is refused by name (the first, and how many more)."""
    unexpected = sorted(names)
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r}"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))


def _get(reader: GGUFReader, key: str, where: str, kind=int):
    if key not in reader.metadata:
        raise CheckpointError(f"{where}: missing required metadata key {key!r}")
    value = reader.metadata[key]
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if kind is float else \
        (isinstance(value, int) and not isinstance(value, bool)) if kind is int else isinstance(value, kind)
    if not ok:
        raise CheckpointError(f"{where}: metadata {key} must be {kind.__name__}, got {value!r}")
    return float(value) if kind is float else value


def read_mmproj(path: str | Path, text: Checkpoint) -> tuple[dict[str, TensorEntry], dict[str, object], GGUFReader]:
    """An mmproj GGUF for the text model `text` -> (canonical tower tensors, {"vision": its config, and "audio"
    where the file has an audio tower: E2B/E4B's conformer, the 12B's raw-frame projection}, the open reader)."""
    path = Path(path)
    where = f"mmproj {path}"
    if not path.is_file():
        raise CheckpointError(f"{where}: no such file")
    try:
        reader = GGUFReader(path)
    except GGUFError as e:
        raise CheckpointError(f"{where}: {e}") from None
    try:
        _check_clip(reader, where, text)
        projector = reader.metadata.get("clip.vision.projector_type", reader.metadata.get("clip.projector_type"))
        if projector == UNIFIED_PROJECTOR:                # the 12B's encoder-free embedder
            return (*_read_unified(reader, where, text), reader)
        entries, vision = _read(reader, where, text)
        configs: dict[str, object] = {"vision": vision}
        if reader.metadata.get("clip.has_audio_encoder") is True:
            audio_entries, configs["audio"] = _read_audio(reader, where, text)
            entries = {**entries, **audio_entries}
        return entries, configs, reader
    except BaseException:
        reader.close()
        raise


def _check_clip(reader: GGUFReader, where: str, text: Checkpoint) -> None:
    """What every Gemma 4 mmproj is: a clip file with a vision part (the 12B's embedder or the tower), pixels taken
    in [0, 1] (no mean, std 1: the model maps them itself), beside a GGUF text model."""
    arch = reader.metadata.get("general.architecture")
    if arch != ARCH:
        raise CheckpointError(f"{where}: general.architecture is {arch!r}, an mmproj file says {ARCH!r}")
    if reader.metadata.get("clip.has_vision_encoder") is not True:
        raise CheckpointError(f"{where}: clip.has_vision_encoder is not true: the file has no vision tower")
    for key, want in (("clip.vision.image_mean", 0.0), ("clip.vision.image_std", 1.0)):
        value = reader.metadata.get(key)
        if value is not None and [float(x) for x in value] != [want] * 3:
            raise CheckpointError(f"{where}: {key} {list(value)} is not [{want:g}, {want:g}, {want:g}]: Gemma 4 "
                                  f"takes pixels in [0, 1] and maps them itself")
    if text.format != "gguf":
        raise CheckpointError(f"{where}: an mmproj file goes with a GGUF text model; {text.path} is an HF checkpoint "
                              f"(its towers load with it)")


def _image_ids(text: Checkpoint, where: str) -> dict[str, int | None]:
    """The image (and video) placeholder ids, from the text GGUF's vocabulary by their strings."""
    ids: dict[str, int | None] = {field: _vocab_id(text, token, where) for field, token in IMAGE_TOKENS.items()}
    vocab = text.metadata["tokenizer.ggml.tokens"]
    ids["video_token_id"] = vocab.index(VIDEO_TOKEN) if VIDEO_TOKEN in vocab else None   # a frame's soft token
    return ids


def _read(reader: GGUFReader, where: str, text: Checkpoint) -> tuple[dict[str, TensorEntry], VisionConfig]:
    projector = reader.metadata.get("clip.vision.projector_type", reader.metadata.get("clip.projector_type"))
    if projector != PROJECTOR:
        raise CheckpointError(f"{where}: clip.vision.projector_type {projector!r} is not Gemma 4's {PROJECTOR!r}")
    tensors = {n: reader.tensors[n] for n in reader.tensors}
    if reader.metadata.get("clip.has_audio_encoder") is True:      # the audio tower's tensors are _read_audio's
        tensors = {n: t for n, t in tensors.items() if not n.startswith(AUDIO_TENSORS)}
    shape = {n: t.shape for n, t in tensors.items()}
    for name in ("v.blk.0.attn_q_norm.weight", "v.blk.0.attn_k.weight", "v.position_embd.weight"):
        if name not in shape:
            raise CheckpointError(f"{where}: missing required tensor {name!r}")
    ids = _image_ids(text, where)
    D = _get(reader, "clip.vision.embedding_length", where)
    heads = _get(reader, "clip.vision.attention.head_count", where)
    head_dim = shape["v.blk.0.attn_q_norm.weight"][0]
    kv_rows = shape["v.blk.0.attn_k.weight"][0]
    if kv_rows % head_dim:
        raise CheckpointError(f"{where}: v.blk.0.attn_k.weight has {kv_rows} rows, not a multiple of head_dim "
                              f"{head_dim} (v.blk.0.attn_q_norm.weight)")
    table = shape["v.position_embd.weight"]
    if len(table) != 3 or table[0] != 2:
        raise CheckpointError(f"{where}: v.position_embd.weight has shape {table}, expected (2, P, {D})")
    projection = _get(reader, "clip.vision.projection_dim", where)
    config = text.config
    if projection != config.hidden_size:
        raise CheckpointError(f"{where}: clip.vision.projection_dim {projection} is not the text model's width "
                              f"{config.hidden_size} ({text.path}): the mmproj belongs to another model")
    try:
        vision = build_vision_config(
            hidden_size=D, intermediate_size=_get(reader, "clip.vision.feed_forward_length", where),
            num_layers=_get(reader, "clip.vision.block_count", where), num_heads=heads,
            num_kv_heads=kv_rows // head_dim, head_dim=head_dim, patch_size=_get(reader, "clip.vision.patch_size", where),
            pooling=_get(reader, "clip.vision.projector.scale_factor", where) if
            "clip.vision.projector.scale_factor" in reader.metadata else POOLING,
            position_embedding_size=table[1], rope_theta=ROPE_THETA,
            rms_norm_eps=_get(reader, "clip.vision.attention.layer_norm_epsilon", where, float),
            clipped_linears="v.blk.0.attn_q.input_min" in shape, standardize="v.std_bias" in shape,
            text_hidden_size=projection, bidirectional=not config.ple_dim, **ids)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}" + (f" ({e.field})" if e.field else "")) from None
    entries, known = {}, set()
    for canonical, want in _expected(vision).items():
        name = mmproj_name(canonical)
        stored = _stored_shape(canonical, want, vision.patch_size)
        if name not in shape:
            raise CheckpointError(f"{where}: missing required tensor {name!r} (expected shape {stored})")
        if shape[name] != stored:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {shape[name]}, the clip.vision.* keys need "
                                  f"{stored}")
        entries[canonical] = _entry(reader, name, canonical, want)
        known.add(name)
    _refuse_unexpected(where, set(shape) - known)
    return entries, vision


def attach_mmproj(ckpt: Checkpoint, path: str | Path) -> None:
    """Give the GGUF text checkpoint `ckpt` the towers of the mmproj at `path` (bound by `bind_vision` and
    `bind_audio`)."""
    entries, configs, reader = read_mmproj(path, ckpt)
    ckpt.towers.update(entries)
    ckpt.tower_configs.update(configs)
    close_text = ckpt.close

    def close() -> None:
        reader.close()
        close_text()

    ckpt.close = close


# ---- writing (gem4 convert) ----

_VT = GGUFValueType
_TYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "bf16": GGMLType.BF16, "q8_0": GGMLType.Q8_0}


def mmproj_type(out_type: str) -> str:
    """The text file's --type -> the mmproj's: llama.cpp keeps towers at 8 bits or more (q4/q5 text: q8_0)."""
    return out_type if out_type in _TYPES else "q8_0"


def _writer(out: Path, name: str, qtype: GGMLType) -> GGUFWriter:
    """A new mmproj file with the `general.*` keys llama.cpp's converter writes first."""
    w = GGUFWriter(out)
    w.add("general.architecture", ARCH)
    w.add("general.type", "mmproj")
    w.add("general.name", name)
    w.add("general.file_type", {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q8_0: 7, GGMLType.BF16: 32}[qtype],
          _VT.UINT32)
    return w


def check_writable(ckpt: Checkpoint) -> VisionConfig | UnifiedVisionConfig:
    """The vision config of the HF checkpoint `ckpt` if its towers can be written as an mmproj, else the
    CheckpointError that says why -- before anything is written (gem4 convert writes the text GGUF first)."""
    vision = ckpt.tower_configs.get("vision")
    if vision is None:
        raise CheckpointError(f"{ckpt.path}: the checkpoint has no vision tower to write as an mmproj")
    audio = hf_audio(Path(ckpt.path)) if ckpt.format == "safetensors" else None
    if isinstance(vision, UnifiedVisionConfig):
        if audio is None or not isinstance(audio[0], FrameAudioConfig):
            raise CheckpointError(f"{ckpt.path}: llama.cpp's 12B mmproj holds the raw-frame audio projection too; "
                                  f"the checkpoint has no 12B audio_config to write")
    elif audio is not None:
        if isinstance(audio[0], FrameAudioConfig):
            raise CheckpointError(f"{ckpt.path}: the 12B's raw-frame audio projection goes only beside its embedder")
        for field, value in AUDIO_FIXED.items():
            if field not in NO_EFFECT and getattr(audio[0], field) != value:
                raise CheckpointError(f"{ckpt.path}: audio_config {field} {getattr(audio[0], field)!r}: llama.cpp's "
                                      f"mmproj holds only {value!r} (its runtime fixes it), so the tower cannot be "
                                      f"written there")
    return vision


def write_mmproj(ckpt: Checkpoint, out: Path, out_type: str, name: str | None = None) -> dict[str, int]:
    """Write the vision tower of `ckpt` (an HF checkpoint), and its audio tower where it has one (E2B/E4B), as
    llama.cpp's mmproj GGUF. Returns tensor counts by type.

    Matrices take `out_type` (f32, f16, bf16, q8_0; rows that are not whole Q8_0 blocks: F16); vectors, clip bounds
    and the position table stay F32, the patch kernel F16 in an f16 file and F32 otherwise, as llama.cpp's converter
    stores them (the same types, names, shapes and bytes: tests/test_mmproj.py)."""
    vision = check_writable(ckpt)
    if isinstance(vision, UnifiedVisionConfig):
        return write_unified_mmproj(ckpt, out, out_type, name)
    qtype = _TYPES[mmproj_type(out_type)]
    w = _writer(out, name or ckpt.path.name, qtype)
    w.add("general.quantization_version", 2, _VT.UINT32)
    w.add("clip.has_vision_encoder", True)
    w.add("clip.vision.projector_type", PROJECTOR)
    w.add("clip.vision.image_size", 224, _VT.UINT32)          # a placeholder llama.cpp's converter writes too
    for key, value in (("projection_dim", vision.text_hidden_size), ("patch_size", vision.patch_size),
                       ("embedding_length", vision.hidden_size), ("feed_forward_length", vision.intermediate_size),
                       ("block_count", vision.num_layers), ("attention.head_count", vision.num_heads)):
        w.add(f"clip.vision.{key}", value, _VT.UINT32)
    w.add("clip.vision.image_mean", np.zeros(3, dtype=np.float32), _VT.ARRAY, _VT.FLOAT32)
    w.add("clip.vision.image_std", np.ones(3, dtype=np.float32), _VT.ARRAY, _VT.FLOAT32)
    w.add("clip.vision.attention.layer_norm_epsilon", vision.rms_norm_eps, _VT.FLOAT32)
    if vision.pooling != POOLING:
        w.add("clip.vision.projector.scale_factor", vision.pooling, _VT.UINT32)
    counts: dict[str, int] = {}
    for canonical, shape in _expected(vision).items():
        t = ckpt.towers[canonical].dense().float()
        if canonical == _PATCH:                     # (D, p·p·3) linear -> (D, 3, p, p) conv kernel
            p = vision.patch_size
            t = t.reshape(shape[0], p, p, 3).permute(0, 3, 1, 2)
            ggml = GGMLType.F16 if qtype == GGMLType.F16 else GGMLType.F32
        elif len(shape) == 2:
            ggml = qtype if shape[1] % 32 == 0 or qtype != GGMLType.Q8_0 else GGMLType.F16
        else:
            ggml = GGMLType.F32
        stored = _stored_shape(canonical, shape, vision.patch_size)
        w.add_tensor(mmproj_name(canonical), quantize(t.contiguous().reshape(stored), ggml).numpy(), stored, ggml)
        counts[ggml.name] = counts.get(ggml.name, 0) + 1
    audio = hf_audio(Path(ckpt.path)) if ckpt.format == "safetensors" else None
    if audio is not None:
        _write_audio(w, *audio, qtype, counts)
    w.write()
    return counts


# ---- the audio tower (E2B/E4B: projector "gemma4a", docs/multimodal.md §3.5) ----

AUDIO_PROJECTOR = "gemma4a"
AUDIO_TENSORS = ("a.", "mm.a.")
# the audio placeholders, found in the text model's vocabulary as the image ones are
AUDIO_TOKENS = {"audio_token_id": "<|audio|>", "boa_token_id": "<|audio>", "eoa_token_id": "<audio|>"}
# AudioConfig fields the file does not hold: llama.cpp's gemma4a graph hard-codes them (12-frame chunks, 12 frames
# of past, none of future, cap 50, half-step feed-forwards, eps 1e-6 in every norm, no residual clamp, silu), and
# its converter writes none of them -- `clip.audio.attention.layer_norm_epsilon` is written but not read: a first
# converter wrote a wrong value there. gem4 reads the same constants (transformers' defaults, the released
# configs' values) and writes no checkpoint whose audio_config says otherwise.
AUDIO_FIXED = {"chunk_size": 12, "context_left": 13, "context_right": 0, "logit_cap": 50.0,
               "invalid_logit": -1e9, "residual_weight": 0.5, "gradient_clipping": 1e10, "rms_norm_eps": 1e-6,
               "hidden_act": "silu"}
NO_EFFECT = ("chunk_size", "invalid_logit")   # the output does not depend on them (model/audio.py)

_A_LINEARS = {"feed_forward1.ffw_layer_1": "ffn_up", "feed_forward1.ffw_layer_2": "ffn_down",
              "feed_forward2.ffw_layer_1": "ffn_up_1", "feed_forward2.ffw_layer_2": "ffn_down_1",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.post": "attn_out", "lconv1d.linear_start": "conv_pw1", "lconv1d.linear_end": "conv_pw2"}
# a layer's other tensors; note the light conv's two norms: llama.cpp's `conv_norm` is the one before the conv
_A_LAYER = {"feed_forward1.pre_layer_norm.weight": "ffn_norm", "feed_forward1.post_layer_norm.weight": "ffn_post_norm",
            "feed_forward2.pre_layer_norm.weight": "ffn_norm_1",
            "feed_forward2.post_layer_norm.weight": "ffn_post_norm_1",
            "self_attn.relative_k_proj.weight": "attn_k_rel", "self_attn.per_dim_scale": "per_dim_scale",
            "norm_pre_attn.weight": "attn_pre_norm", "norm_post_attn.weight": "attn_post_norm",
            "norm_out.weight": "ln2",
            "lconv1d.pre_layer_norm.weight": "conv_norm", "lconv1d.conv_norm.weight": "norm_conv",
            "lconv1d.depthwise_conv1d.weight": "conv_dw"}
_SUBSAMPLE = "audio_tower.subsample_conv_projection."
_A_GLOBAL = {**{f"{_SUBSAMPLE}layer{i}.{part}.weight": f"a.conv1d.{i}.{gg}weight"
                for i in (0, 1) for part, gg in (("conv", ""), ("norm", "norm."))},
             _SUBSAMPLE + "input_proj_linear.weight": "a.input_projection.weight",
             "audio_tower.output_proj.weight": "a.pre_encode.out.weight",
             "audio_tower.output_proj.bias": "a.pre_encode.out.bias",
             "embed_audio.embedding_projection.weight": "mm.a.input_projection.weight"}
_DEPTHWISE = ".lconv1d.depthwise_conv1d.weight"
_SCALE = ".self_attn.per_dim_scale"


def audio_mmproj_name(canonical: str) -> str:
    """gem4's (HF without `model.`) audio tensor name -> llama.cpp's mmproj name."""
    return _tower_name(canonical, _A_GLOBAL, "audio_tower.layers.", "a.blk", _A_LINEARS, _A_LAYER)


def _audio_stored_shape(canonical: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape llama.cpp stores an audio tensor of gem4's `shape` in: the depthwise kernel (D, 1, K) as (D, K),
    scalars as [1]."""
    if canonical.endswith(_DEPTHWISE):
        return (shape[0], shape[2])
    return (1,) if shape == () else shape


def _read_audio(reader: GGUFReader, where: str, text: Checkpoint) -> tuple[dict[str, TensorEntry], AudioConfig]:
    """The audio tower of an mmproj (`clip.has_audio_encoder`): its canonical tensors (per_dim_scale as stored,
    through softplus: AudioModel(softplus_applied=True)) and its AudioConfig."""
    projector = reader.metadata.get("clip.audio.projector_type")
    if projector != AUDIO_PROJECTOR:
        raise CheckpointError(f"{where}: clip.audio.projector_type {projector!r} is not Gemma 4's {AUDIO_PROJECTOR!r}")
    shape = {n: t.shape for n, t in reader.tensors.items() if n.startswith(AUDIO_TENSORS)}
    # what the keys do not say comes from the tensors, as llama.cpp takes it
    for name in ("a.conv1d.0.weight", "a.conv1d.1.weight", "a.blk.0.conv_dw.weight", "a.pre_encode.out.weight"):
        if name not in shape:
            raise CheckpointError(f"{where}: missing required tensor {name!r}")
    D = _get(reader, "clip.audio.embedding_length", where)
    ff = _get(reader, "clip.audio.feed_forward_length", where)
    if ff != 4 * D:
        raise CheckpointError(f"{where}: clip.audio.feed_forward_length {ff} is not 4 x clip.audio.embedding_length "
                              f"{D}: Gemma 4's conformer feed-forward is 4 x its width")
    mels = _get(reader, "clip.audio.num_mel_bins", where)
    if mels != front_end.N_MELS:
        raise CheckpointError(f"{where}: clip.audio.num_mel_bins {mels} is not the {front_end.N_MELS} log-mel bins "
                              f"gem4's front end computes")
    projection = _get(reader, "clip.audio.projection_dim", where)
    if projection != text.config.hidden_size:
        raise CheckpointError(f"{where}: clip.audio.projection_dim {projection} is not the text model's width "
                              f"{text.config.hidden_size} ({text.path}): the mmproj belongs to another model")
    ids = {field: _vocab_id(text, token, where) for field, token in AUDIO_TOKENS.items()}
    try:
        audio = build_audio_config(
            n_mels=mels, subsampling_channels=(shape["a.conv1d.0.weight"][0], shape["a.conv1d.1.weight"][0]),
            hidden_size=D, num_layers=_get(reader, "clip.audio.block_count", where),
            num_heads=_get(reader, "clip.audio.attention.head_count", where),
            conv_kernel_size=shape["a.blk.0.conv_dw.weight"][-1], output_dims=shape["a.pre_encode.out.weight"][0],
            clipped_linears="a.blk.0.attn_q.input_min" in shape, text_hidden_size=projection, **AUDIO_FIXED, **ids)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}" + (f" ({e.field})" if e.field else "")) from None
    entries, known = {}, set()
    for canonical, want in audio_shapes(audio).items():
        name = audio_mmproj_name(canonical)
        stored = _audio_stored_shape(canonical, want)
        if name not in shape:
            raise CheckpointError(f"{where}: missing required tensor {name!r} (expected shape {stored})")
        if shape[name] != stored:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {shape[name]}, the clip.audio.* keys need "
                                  f"{stored}")
        base = tensor_entry(reader, name, canonical)
        if stored != want:                   # [1] -> a scalar, (D, K) -> the (D, 1, K) depthwise kernel
            base = TensorEntry(name=canonical, shape=want, stored=base.stored, nbytes=base.nbytes,
                               dense=lambda b=base, s=want: b.dense().reshape(s), release=base.release)
        entries[canonical] = base
        known.add(name)
    _refuse_unexpected(where, set(shape) - known)
    return entries, audio


def _vocab_id(text: Checkpoint, token: str, where: str) -> int:
    vocab = text.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(vocab, list):
        raise CheckpointError(f"{where}: the text model {text.path} has no vocabulary (tokenizer.ggml.tokens) to "
                              f"find the {token!r} token in")
    if token not in vocab:
        raise CheckpointError(f"{where}: the text model's vocabulary has no {token!r} token")
    return vocab.index(token)


# ---- the 12B ("unified"): projectors "gemma4uv" / "gemma4ua" (docs/multimodal.md §2.6) ----

UNIFIED_PROJECTOR = "gemma4uv"
UNIFIED_AUDIO_PROJECTOR = "gemma4ua"
_U_NAMES = {"vision_embedder.patch_dense.weight": "v.patch_embd.weight",
            "vision_embedder.patch_dense.bias": "v.patch_embd.bias",
            "vision_embedder.patch_ln1.weight": "v.patch_norm.1.weight",
            "vision_embedder.patch_ln1.bias": "v.patch_norm.1.bias",
            "vision_embedder.patch_ln2.weight": "v.patch_norm.2.weight",
            "vision_embedder.patch_ln2.bias": "v.patch_norm.2.bias",
            "vision_embedder.pos_norm.weight": "v.patch_norm.3.weight",
            "vision_embedder.pos_norm.bias": "v.patch_norm.3.bias",
            "vision_embedder.pos_embedding": "v.position_embd.weight",
            "embed_vision.embedding_projection.weight": "mm.input_projection.weight"}
_U_AUDIO = ("embed_audio.embedding_projection.weight", "mm.a.input_projection.weight")
_U_CHW = ("vision_embedder.patch_dense.weight", "vision_embedder.patch_ln1.weight", "vision_embedder.patch_ln1.bias")
_U_TABLE = "vision_embedder.pos_embedding"


def chw_order(p: int) -> torch.Tensor:
    """The patch-vector permutation llama.cpp's converter applies to the 12B's patch_dense columns and patch_ln1:
    entry i, in (channel, row, column) order -- what ggml's im2col gives its graph -- is the (row, column, channel)
    index transformers' patches have there."""
    i = torch.arange(p * p * 3)
    channel, row, column = i // (p * p), (i % (p * p)) // p, i % p
    return row * p * 3 + column * 3 + channel


def _u_stored(canonical: str, t: torch.Tensor, p: int) -> torch.Tensor:
    """gem4's tensor -> llama.cpp's: the CHW permutation, the position table's axes first."""
    if canonical in _U_CHW:
        return t[..., chw_order(p)]
    if canonical == _U_TABLE:
        return t.permute(1, 0, 2)
    return t


def _u_entry(reader: GGUFReader, name: str, canonical: str, shape: tuple[int, ...], p: int) -> TensorEntry:
    """A tensor of the file as gem4's: the CHW permutation undone, the position table (rows, 2, D) again."""
    base = tensor_entry(reader, name, canonical)
    if canonical in _U_CHW:
        inverse = torch.argsort(chw_order(p))
        dense = lambda: base.dense()[..., inverse]                                  # noqa: E731
    elif canonical == _U_TABLE:
        dense = lambda: base.dense().permute(1, 0, 2).contiguous()                  # noqa: E731
    else:
        return base
    return TensorEntry(name=canonical, shape=shape, stored=base.stored, nbytes=base.nbytes, dense=dense,
                       release=base.release)


def _read_unified(reader: GGUFReader, where: str, text: Checkpoint
                  ) -> tuple[dict[str, TensorEntry], dict[str, object]]:
    """The 12B's mmproj: its embedder (UnifiedVisionConfig) and, where the file has it (llama.cpp's converter always
    writes it), its raw-frame audio projection (FrameAudioConfig)."""
    shape = {n: t.shape for n, t in reader.tensors.items()}
    if "v.position_embd.weight" not in shape:
        raise CheckpointError(f"{where}: missing required tensor 'v.position_embd.weight'")
    table = shape["v.position_embd.weight"]
    if len(table) != 3 or table[0] != 2:
        raise CheckpointError(f"{where}: v.position_embd.weight has shape {table}, expected (2, P, D)")
    width = text.config.hidden_size
    ids = _image_ids(text, where)
    projection = _get(reader, "clip.vision.projection_dim", where)
    if projection != width:
        raise CheckpointError(f"{where}: clip.vision.projection_dim {projection} is not the text model's width "
                              f"{width} ({text.path}): the mmproj belongs to another model")
    merge = (_get(reader, "clip.vision.projector.scale_factor", where)
             if "clip.vision.projector.scale_factor" in reader.metadata else POOLING)
    try:
        vision = build_unified_vision_config(
            patch_size=_get(reader, "clip.vision.patch_size", where) * merge,
            embed_dim=_get(reader, "clip.vision.embedding_length", where), position_embedding_size=table[1],
            rms_norm_eps=_get(reader, "clip.vision.attention.layer_norm_epsilon", where, float),
            text_hidden_size=width, bidirectional=not text.config.ple_dim, **ids)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}" + (f" ({e.field})" if e.field else "")) from None
    configs: dict[str, object] = {"vision": vision}
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in UnifiedVisionModel(vision, torch.float32).named_parameters()}
    if reader.metadata.get("clip.has_audio_encoder") is True:
        projector = reader.metadata.get("clip.audio.projector_type")
        if projector != UNIFIED_AUDIO_PROJECTOR:
            raise CheckpointError(f"{where}: clip.audio.projector_type {projector!r} is not the 12B's "
                                  f"{UNIFIED_AUDIO_PROJECTOR!r}")
        audio_width = _get(reader, "clip.audio.projection_dim", where)
        if audio_width != width:
            raise CheckpointError(f"{where}: clip.audio.projection_dim {audio_width} is not the text model's width "
                                  f"{width} ({text.path}): the mmproj belongs to another model")
        try:       # clip.audio.num_mel_bins is not read: the converter writes a meaningless 128 there
            configs["audio"] = audio = build_frame_audio_config(
                _get(reader, "clip.audio.embedding_length", where),
                _get(reader, "clip.audio.attention.layer_norm_epsilon", where, float), width,
                **{field: _vocab_id(text, token, where) for field, token in AUDIO_TOKENS.items()})
        except ConfigError as e:
            raise CheckpointError(f"{where}: {e}" + (f" ({e.field})" if e.field else "")) from None
        expected[_U_AUDIO[0]] = (width, audio.samples_per_token)
    entries, known = {}, set()
    for canonical, want in expected.items():
        name = _U_AUDIO[1] if canonical == _U_AUDIO[0] else _U_NAMES[canonical]
        stored = (want[1], want[0], want[2]) if canonical == _U_TABLE else want
        if name not in shape:
            raise CheckpointError(f"{where}: missing required tensor {name!r} (expected shape {stored})")
        if shape[name] != stored:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {shape[name]}, the clip.* keys need {stored}")
        entries[canonical] = _u_entry(reader, name, canonical, want, vision.patch_size)
        known.add(name)
    _refuse_unexpected(where, set(shape) - known)
    return entries, configs


def _write_audio(w: GGUFWriter, audio: AudioConfig, tensors: dict[str, TensorEntry], qtype: GGMLType,
                 counts: dict[str, int]) -> None:
    """An HF checkpoint's conformer into the mmproj being written, as llama.cpp's converter writes it: matrices in
    `qtype` (Q8_0: F16 where a row is not whole blocks), vectors, clip bounds, the subsampling convolutions and
    projection and the depthwise kernel F32; per_dim_scale through softplus (check_writable checked the config)."""
    w.add("clip.has_audio_encoder", True)
    w.add("clip.audio.projector_type", AUDIO_PROJECTOR)
    for key, value in (("projection_dim", audio.text_hidden_size), ("embedding_length", audio.hidden_size),
                       ("feed_forward_length", 4 * audio.hidden_size), ("block_count", audio.num_layers),
                       ("attention.head_count", audio.num_heads), ("num_mel_bins", audio.n_mels)):
        w.add(f"clip.audio.{key}", value, _VT.UINT32)
    w.add("clip.audio.attention.layer_norm_epsilon", AUDIO_FIXED["rms_norm_eps"], _VT.FLOAT32)
    for canonical, shape in audio_shapes(audio).items():
        t = tensors[canonical].dense().float()
        if canonical.endswith(_SCALE):
            t = torch.nn.functional.softplus(t)
        if len(shape) <= 1 or canonical.startswith(_SUBSAMPLE) or canonical.endswith(_DEPTHWISE):
            ggml = GGMLType.F32
        else:
            ggml = qtype if shape[1] % 32 == 0 or qtype != GGMLType.Q8_0 else GGMLType.F16
        stored = _audio_stored_shape(canonical, shape)
        w.add_tensor(audio_mmproj_name(canonical), quantize(t.contiguous().reshape(stored), ggml).numpy(), stored, ggml)
        counts[ggml.name] = counts.get(ggml.name, 0) + 1


def write_unified_mmproj(ckpt: Checkpoint, out: Path, out_type: str, name: str | None = None) -> dict[str, int]:
    """The 12B's embedder and raw-frame audio projection as llama.cpp's converter writes them (its
    Gemma4UnifiedVisionAudioModel): the keys it writes in its order, the patch_dense columns and patch_ln1 in CHW
    order, the position table (2, rows, D); the two projections in `out_type` (Q8_0: F16 where a row is not whole
    blocks), patch_dense F16 in an f16 file and F32 otherwise, every vector and the table F32."""
    vision: UnifiedVisionConfig = ckpt.tower_configs["vision"]
    audio, projection = _hf_frame_audio(ckpt)
    qtype = _TYPES[mmproj_type(out_type)]
    w = _writer(out, name or ckpt.path.name, qtype)
    w.add("clip.has_vision_encoder", True)
    w.add("clip.vision.projection_dim", vision.text_hidden_size, _VT.UINT32)
    w.add("clip.vision.image_size", 224, _VT.UINT32)          # placeholders llama.cpp's converter writes too
    w.add("clip.vision.patch_size", vision.patch_size // POOLING, _VT.UINT32)
    w.add("clip.vision.embedding_length", vision.embed_dim, _VT.UINT32)
    for key in ("feed_forward_length", "block_count", "attention.head_count"):
        w.add(f"clip.vision.{key}", 0, _VT.UINT32)
    w.add("clip.vision.image_mean", np.zeros(3, dtype=np.float32), _VT.ARRAY, _VT.FLOAT32)
    w.add("clip.vision.image_std", np.ones(3, dtype=np.float32), _VT.ARRAY, _VT.FLOAT32)
    w.add("clip.has_audio_encoder", True)
    w.add("clip.audio.projection_dim", audio.text_hidden_size, _VT.UINT32)
    w.add("clip.audio.embedding_length", audio.samples_per_token, _VT.UINT32)
    for key in ("feed_forward_length", "block_count", "attention.head_count"):
        w.add(f"clip.audio.{key}", 0, _VT.UINT32)
    w.add("clip.vision.projector_type", UNIFIED_PROJECTOR)
    w.add("clip.vision.attention.layer_norm_epsilon", vision.rms_norm_eps, _VT.FLOAT32)
    w.add("clip.audio.projector_type", UNIFIED_AUDIO_PROJECTOR)
    w.add("clip.audio.num_mel_bins", 128, _VT.UINT32)         # meaningless for raw frames; the converter writes it
    w.add("clip.audio.attention.layer_norm_epsilon", audio.rms_norm_eps, _VT.FLOAT32)
    w.add("general.quantization_version", 2, _VT.UINT32)
    counts: dict[str, int] = {}
    tensors = [(c, _U_NAMES[c], ckpt.towers[c].dense()) for c in _U_NAMES] + [(*_U_AUDIO, projection)]
    for canonical, gguf_name, t in sorted(tensors):                  # the converter's order: the HF names
        t = _u_stored(canonical, t.float(), vision.patch_size).contiguous()
        if canonical == "vision_embedder.patch_dense.weight":
            ggml = GGMLType.F16 if qtype == GGMLType.F16 else GGMLType.F32
        elif t.ndim == 2:
            ggml = qtype if t.shape[1] % 32 == 0 or qtype != GGMLType.Q8_0 else GGMLType.F16
        else:
            ggml = GGMLType.F32
        w.add_tensor(gguf_name, quantize(t, ggml).numpy(), tuple(t.shape), ggml)
        counts[ggml.name] = counts.get(ggml.name, 0) + 1
    w.write()
    return counts


def _hf_frame_audio(ckpt: Checkpoint) -> tuple[FrameAudioConfig, torch.Tensor]:
    """The 12B HF checkpoint's raw-frame audio (check_writable: it has one): its config and its projection."""
    audio, entries = hf_audio(Path(ckpt.path))
    return audio, entries[_U_AUDIO[0]].dense()
