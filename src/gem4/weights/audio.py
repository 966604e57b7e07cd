"""The audio of an HF checkpoint: config.json's `audio_config` and the `model.audio_tower.*` / `model.embed_audio.*`
tensors -> a bound `AudioModel` (E2B/E4B's conformer) or `FrameAudioModel` (the 12B's raw-frame projection),
model/audio.py.

Every value comes from the checkpoint: the tower's fields from `audio_config` (refused by name when missing or
out of range), its sizes checked against the tensors' shapes (missing, unexpected and mis-shaped tensors are
refused by name, as the text model's are). The front end is gem4's own (media/audio.py): a
`processor_config.json` / `preprocessor_config.json` whose feature extractor asks for other features
(another sample rate, frame, mel count, floor, pre-emphasis, dither, normalisation) is refused by name rather
than fed features it was not trained on. `padding_side` is not read: gem4 always computes right-padded
features (docs/multimodal.md §3.2).

`loader.bind` calls `bind_audio` once the text model is bound (`model.audio`, None without an audio tower); a GGUF
text model's audio tower comes from llama.cpp's mmproj file (weights/mmproj.py puts its tensors and config into the
checkpoint's towers), and `hf_audio` hands an HF checkpoint's to `gem4 convert` for the mmproj it writes.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from gem4.config import AudioConfig, ConfigError, FrameAudioConfig, build_audio_config, build_frame_audio_config
from gem4.media import audio as front_end
from gem4.model.audio import AudioModel, FrameAudioModel
from gem4.model.backends import Backend, choose
from gem4.weights.binding import bind_weights
from gem4.weights.checkpoint import Checkpoint, CheckpointError, TensorEntry
from gem4.weights.hf import STORED_DTYPES, int_field, safetensors_files

AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")
AUDIO_NAMES = tuple(p.removeprefix("model.") for p in AUDIO_PREFIXES)   # gem4's names
AUDIO_MODEL_TYPES = ("gemma4_audio", "gemma4_unified_audio")    # E2B/E4B's conformer, the 12B's raw frames

# AudioConfig field -> audio_config key (all required: the released E2B/E4B configs write every one of them)
AUDIO_KEYS = {
    "hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
    "subsampling_channels": "subsampling_conv_channels", "conv_kernel_size": "conv_kernel_size",
    "residual_weight": "residual_weight", "chunk_size": "attention_chunk_size",
    "context_left": "attention_context_left", "context_right": "attention_context_right",
    "logit_cap": "attention_logit_cap", "invalid_logit": "attention_invalid_logits_value",
    "clipped_linears": "use_clipped_linears", "rms_norm_eps": "rms_norm_eps",
    "gradient_clipping": "gradient_clipping", "output_dims": "output_proj_dims",
}
# hidden_act: some released copies of the config omit it; transformers' class default, the only one the
# checkpoints use, is silu
DEFAULT_HIDDEN_ACT = "silu"

# feature-extractor fields that change the features -> the value gem4's front end computes with
LOG_MEL_FRONT_END = {
    "feature_size": front_end.N_MELS, "sampling_rate": front_end.SAMPLE_RATE, "frame_length": front_end.FRAME_LENGTH,
    "hop_length": front_end.HOP_LENGTH, "fft_length": front_end.FFT_LENGTH, "mel_floor": front_end.MEL_FLOOR,
    "min_frequency": 0.0, "max_frequency": front_end.SAMPLE_RATE / 2, "preemphasis": 0.0, "dither": 0.0,
    "input_scale_factor": 1.0, "per_bin_mean": None, "per_bin_stddev": None, "fft_overdrive": False,
}


def frame_front_end(config: FrameAudioConfig) -> dict:
    """12B: the raw-frame extractor's fields."""
    S = config.samples_per_token
    return {"sampling_rate": front_end.SAMPLE_RATE, "feature_size": S, "audio_samples_per_token": S}


def audio_config_from_hf(cfg: dict, where: Path | str) -> AudioConfig | FrameAudioConfig | None:
    """config.json (the top level, with text_config and audio_config) -> the audio config, or None without audio."""
    audio = cfg.get("audio_config")
    if audio is None:
        return None
    if not isinstance(audio, dict):
        raise CheckpointError(f"{where}: audio_config must be an object, got {audio!r}")
    if audio.get("model_type") not in AUDIO_MODEL_TYPES:
        raise CheckpointError(f"{where}: audio_config.model_type {audio.get('model_type')!r} is not one of "
                              f"{AUDIO_MODEL_TYPES}")
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{where}: a checkpoint with audio_config needs a text_config")
    text_hidden = int_field(text, "hidden_size", f"{where} text_config")
    if audio["model_type"] == "gemma4_unified_audio":     # 12B: audio_embed_dim is the frame length and the width
        keys = {"samples_per_token": "audio_embed_dim", "rms_norm_eps": "rms_norm_eps"}
        fields = {field: _required(audio, key, where) for field, key in keys.items()}
        build = build_frame_audio_config
    else:
        keys = AUDIO_KEYS
        fields = {field: _required(audio, key, where) for field, key in keys.items()}
        fields["hidden_act"] = audio.get("hidden_act", DEFAULT_HIDDEN_ACT)
        fields["n_mels"] = front_end.N_MELS
        build = build_audio_config
    fields.update(audio_token_ids(cfg, where))
    try:
        return build(**fields, text_hidden_size=text_hidden)
    except ConfigError as e:
        field = (e.field or "").removeprefix("audio.")
        raise CheckpointError(f"{where}: {e} (config.json audio_config.{keys.get(field, field)})") from None


def audio_token_ids(cfg: dict, where: Path | str) -> dict:
    """The top level's audio token ids: `audio_token_id`, `boa_token_id` and `eoa_token_id` (transformers 5.23 names
    the last `eoa_token_index`; a config with both must agree)."""
    ids = {key: int_field(cfg, key, where) for key in ("audio_token_id", "boa_token_id")}
    named = {key: int_field(cfg, key, where) for key in ("eoa_token_id", "eoa_token_index") if cfg.get(key) is not None}
    if not named:
        raise CheckpointError(f"{where}: config.json lacks 'eoa_token_id' (or 'eoa_token_index'), the <audio|> token")
    if len(set(named.values())) > 1:
        raise CheckpointError(f"{where}: eoa_token_id {named['eoa_token_id']} and eoa_token_index "
                              f"{named['eoa_token_index']} disagree")
    return {**ids, "eoa_token_id": next(iter(named.values()))}


def _required(audio: dict, key: str, where):
    if audio.get(key) is None:
        raise CheckpointError(f"{where}: audio_config lacks {key!r}")
    return audio[key]


def check_feature_extractor(directory: Path, ours: dict) -> None:
    """A checkpoint's saved feature extractor, where it has one, must describe gem4's front end (`ours`: field ->
    the value gem4 computes with)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = directory / name
        if not path.is_file():
            continue
        try:
            saved = json.loads(path.read_text())
        except ValueError as e:
            raise CheckpointError(f"{path}: invalid JSON ({e})") from None
        extractor = saved.get("feature_extractor", saved) if isinstance(saved, dict) else None
        if not isinstance(extractor, dict) or "feature_size" not in extractor:
            continue                                   # an image processor only, or no audio settings
        for key, value in ours.items():
            if key in extractor and extractor[key] != value:
                raise CheckpointError(f"{path}: feature extractor {key}={extractor[key]!r}, but gem4's audio front "
                                      f"end computes {key}={value!r} for this model")


def audio_summary(config: AudioConfig | FrameAudioConfig) -> dict:
    """`gem4 inspect`: the audio a tower config takes."""
    if isinstance(config, FrameAudioConfig):
        return {"kind": "raw frames (12B)", "samples_per_token": config.samples_per_token,
                "tokens_per_second": front_end.SAMPLE_RATE / config.samples_per_token, "max_tokens": None,
                "text_hidden_size": config.text_hidden_size}
    return {"kind": "conformer (E2B/E4B)", "layers": config.num_layers, "hidden_size": config.hidden_size,
            "heads": config.num_heads, "window": config.context_left - 1, "clipped_linears": config.clipped_linears,
            "output_dims": config.output_dims, "text_hidden_size": config.text_hidden_size,
            "tokens_per_second": front_end.TOKENS_PER_SECOND,
            "max_tokens": front_end.num_soft_tokens(front_end.MAX_SAMPLES)}


def checkpoint_audio(ckpt: Checkpoint) -> tuple[AudioConfig | FrameAudioConfig, dict[str, TensorEntry], bool] | None:
    """An opened checkpoint's audio: (config, tensors, whether `per_dim_scale` is stored through softplus), or None.
    An HF checkpoint's own (hf_audio), or the one a GGUF's mmproj brought (weights/mmproj.py: through softplus)."""
    if ckpt.format == "safetensors":
        found = hf_audio(Path(ckpt.path))
        return None if found is None else (*found, False)
    if "audio" in ckpt.tower_configs:
        return (ckpt.tower_configs["audio"], {n: e for n, e in ckpt.towers.items() if n.startswith(AUDIO_NAMES)},
                True)
    return None


def hf_audio(directory: Path) -> tuple[AudioConfig | FrameAudioConfig, dict[str, TensorEntry]] | None:
    """The audio of the HF checkpoint directory: its config and its tensors (names without `model.`, shapes and
    dtypes checked against the config; nothing read yet), or None without audio."""
    cfg = json.loads((directory / "config.json").read_text())     # the top level (the reader kept text_config)
    config = audio_config_from_hf(cfg, directory / "config.json")
    if config is None:
        return None
    check_feature_extractor(directory, frame_front_end(config) if isinstance(config, FrameAudioConfig)
                            else LOG_MEL_FRONT_END)
    located = {}
    for f in safetensors_files(directory):
        handle = safe_open(str(f), framework="pt")
        for name in handle.keys():
            if name.startswith(AUDIO_PREFIXES):
                located[name.removeprefix("model.")] = (handle, name, f)
    expected = audio_shapes(config)
    for name, shape in expected.items():
        if name not in located:
            raise CheckpointError(f"{directory}: missing audio tensor {'model.' + name!r} (expected shape {shape})")
        handle, full, f = located[name]
        found = tuple(handle.get_slice(full).get_shape())
        if found != shape:
            raise CheckpointError(f"{f}: audio tensor {full!r} has shape {found}, audio_config needs {shape}")
        if handle.get_slice(full).get_dtype() not in STORED_DTYPES:
            raise CheckpointError(f"{f}: audio tensor {full!r} has unsupported dtype "
                                  f"{handle.get_slice(full).get_dtype()} (F32, F16 and BF16 are read)")
    unexpected = sorted(set(located) - set(expected))
    if unexpected:
        raise CheckpointError(f"{directory}: unexpected audio tensor {'model.' + unexpected[0]!r}"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                              + " for its audio_config")
    entries = {}
    for name, shape in expected.items():
        handle, full, _ = located[name]
        stored = handle.get_slice(full).get_dtype()
        entries[name] = TensorEntry(name=name, shape=shape, stored=stored,
                                    nbytes=STORED_DTYPES[stored].itemsize * math.prod(shape),
                                    dense=lambda h=handle, n=full: h.get_tensor(n))
    return config, entries


def audio_shapes(config: AudioConfig | FrameAudioConfig) -> dict[str, tuple[int, ...]]:
    """The tensors (names without `model.`) and shapes an audio config implies: gem4's audio modules' parameters."""
    with torch.device("meta"):
        model = FrameAudioModel(config) if isinstance(config, FrameAudioConfig) else AudioModel(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def bind_audio(ckpt: Checkpoint, dtype: torch.dtype, device: str, backend: Backend
               ) -> AudioModel | FrameAudioModel | None:
    """The audio model of an opened checkpoint (checkpoint_audio), bound in `dtype` (vectors and scalars in
    float32) through the text model's backend (binding.bind_weights: an mmproj's Q8_0 matrices stay Q8_0 on the
    CPU backend), or None."""
    found = checkpoint_audio(ckpt)
    if found is None:
        return None
    config, entries, softplus_applied = found
    frames = isinstance(config, FrameAudioConfig)
    with torch.device("meta"):
        model = FrameAudioModel(config) if frames else AudioModel(config, softplus_applied)
    bind_weights(model, entries, backend, dtype, device)   # the readers checked names and shapes (hf_audio, mmproj)
    return model.eval()


def load_audio(path: str | Path, dtype: str = "float32", device: str = "cpu") -> AudioModel | FrameAudioModel | None:
    """The audio model of the HF checkpoint directory at `path` alone (None when it has none)."""
    from gem4.weights.hf import open_hf
    from gem4.weights.loader import DTYPES

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return bind_audio(open_hf(Path(path)), DTYPES[dtype], device, choose(DTYPES[dtype], device))
