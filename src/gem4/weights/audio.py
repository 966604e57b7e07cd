"""The audio tower of an HF checkpoint (E2B/E4B): config.json's `audio_config` and the `model.audio_tower.*` /
`model.embed_audio.*` tensors -> a bound `AudioModel` (model/audio.py).

Every value comes from the checkpoint: the tower's fields from `audio_config` (refused by name when missing or
out of range), its sizes checked against the tensors' shapes (missing, unexpected and mis-shaped tensors are
refused by name, as the text model's are). The front end is gem4's own (media/audio.py): a
`processor_config.json` / `preprocessor_config.json` whose feature extractor asks for other features
(another sample rate, frame, mel count, floor, pre-emphasis, dither, normalisation) is refused by name rather
than fed features it was not trained on. `padding_side` is not read: gem4 always computes right-padded
features (docs/multimodal.md, Audio).

`loader.bind` calls `bind_audio` once the text model is bound (`model.audio`, None without an audio tower).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from gem4.config import AudioConfig, ConfigError, build_audio_config
from gem4.media import audio as front_end
from gem4.model.audio import AudioModel
from gem4.weights.checkpoint import Checkpoint, CheckpointError
from gem4.weights.hf import STORED_DTYPES, int_field, safetensors_files

AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")
AUDIO_MODEL_TYPES = ("gemma4_audio",)

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
FRONT_END = {
    "feature_size": front_end.N_MELS, "sampling_rate": front_end.SAMPLE_RATE, "frame_length": front_end.FRAME_LENGTH,
    "hop_length": front_end.HOP_LENGTH, "fft_length": front_end.FFT_LENGTH, "mel_floor": front_end.MEL_FLOOR,
    "min_frequency": 0.0, "max_frequency": front_end.SAMPLE_RATE / 2, "preemphasis": 0.0, "dither": 0.0,
    "input_scale_factor": 1.0, "per_bin_mean": None, "per_bin_stddev": None, "fft_overdrive": False,
}


def audio_config_from_hf(cfg: dict, where: Path | str) -> AudioConfig | None:
    """config.json (the top level, with text_config and audio_config) -> AudioConfig, or None without a tower."""
    audio = cfg.get("audio_config")
    if audio is None:
        return None
    if not isinstance(audio, dict):
        raise CheckpointError(f"{where}: audio_config must be an object, got {audio!r}")
    if audio.get("model_type") not in AUDIO_MODEL_TYPES:
        raise CheckpointError(f"{where}: audio_config.model_type {audio.get('model_type')!r} is not one of "
                              f"{AUDIO_MODEL_TYPES}")
    fields = {}
    for field, key in AUDIO_KEYS.items():
        if audio.get(key) is None:
            raise CheckpointError(f"{where}: audio_config lacks {key!r}")
        fields[field] = audio[key]
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{where}: a checkpoint with audio_config needs a text_config")
    fields["text_hidden_size"] = int_field(text, "hidden_size", f"{where} text_config")
    fields["hidden_act"] = audio.get("hidden_act", DEFAULT_HIDDEN_ACT)
    fields["n_mels"] = front_end.N_MELS
    try:
        return build_audio_config(**fields)
    except ConfigError as e:
        key = AUDIO_KEYS.get((e.field or "").removeprefix("audio."), (e.field or "").removeprefix("audio."))
        raise CheckpointError(f"{where}: {e} (config.json audio_config.{key})") from None


def check_feature_extractor(directory: Path) -> None:
    """A checkpoint's saved feature extractor, where it has one, must describe gem4's front end."""
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
        for key, ours in FRONT_END.items():
            if key in extractor and extractor[key] != ours:
                raise CheckpointError(f"{path}: feature extractor {key}={extractor[key]!r}, but gem4's audio front "
                                      f"end computes {key}={ours!r} (the Gemma 4 log-mel features)")


def expected_tensors(model: AudioModel) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def bind_audio(ckpt: Checkpoint, dtype: torch.dtype, device: str = "cpu") -> AudioModel | None:
    """The audio tower of an opened HF checkpoint, bound in `dtype` (vectors and scalars in float32), or None."""
    if ckpt.format != "safetensors":
        return None                                    # a GGUF's towers live in its mmproj file
    directory = Path(ckpt.path)
    cfg = json.loads((directory / "config.json").read_text())     # the top level (the reader kept text_config)
    config = audio_config_from_hf(cfg, directory / "config.json")
    if config is None:
        return None
    check_feature_extractor(directory)
    located = {}
    for f in safetensors_files(directory):
        handle = safe_open(str(f), framework="pt")
        for name in handle.keys():
            if name.startswith(AUDIO_PREFIXES):
                located[name.removeprefix("model.")] = (handle, name, f)
    with torch.device("meta"):
        model = AudioModel(config)
    expected = expected_tensors(model)
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
    state = {}
    for name, shape in expected.items():
        handle, full, _ = located[name]
        keep = torch.float32 if len(shape) <= 1 else dtype
        state[name] = handle.get_tensor(full).to(device=device, dtype=keep).clone()
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def load_audio(path: str | Path, dtype: str = "float32", device: str = "cpu") -> AudioModel | None:
    """The audio tower of the HF checkpoint directory at `path` alone (None when it has none)."""
    from gem4.weights.hf import open_hf
    from gem4.weights.loader import DTYPES

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return bind_audio(open_hf(Path(path)), DTYPES[dtype], device)
