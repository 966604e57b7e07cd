"""Audio encode time (issue 36): the E2B/E4B-shaped conformer (12 layers, D=1024, 8 heads, subsampling [128, 32],
output 1536 -> text 1536) with seeded random weights, gem4 (float32 and bfloat16 weights) against transformers'
`get_audio_features` on the same weights (float32), interleaved, medians. Not part of CI.

    python benchmarks/audio.py [--seconds 10] [--repeats 5] [--threads N]

Prints one markdown table: the front end (log-mel) and the tower + embedder per clip, and the largest difference
between gem4's float32 embeddings and transformers'.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gem4.config import build_audio_config
from gem4.media import audio as front_end
from gem4.model.audio import AudioModel

E2B_AUDIO = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, subsampling_conv_channels=[128, 32],
                 conv_kernel_size=5, residual_weight=0.5, attention_chunk_size=12, attention_context_left=13,
                 attention_context_right=0, attention_logit_cap=50.0, attention_invalid_logits_value=-1e9,
                 use_clipped_linears=True, rms_norm_eps=1e-6, gradient_clipping=1e10, output_proj_dims=1536)
TEXT_HIDDEN = 1536


def random_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        if name.endswith(("input_min", "output_min")):
            state[name] = torch.tensor(-4.0)
        elif name.endswith(("input_max", "output_max")):
            state[name] = torch.tensor(4.0)
        elif "norm" in name:
            state[name] = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            fan_in = int(np.prod(p.shape[1:])) if p.ndim > 1 else p.shape[0]
            state[name] = torch.randn(p.shape, generator=gen) / fan_in ** 0.5
    return state


def audio_config():
    a = E2B_AUDIO
    return build_audio_config(
        n_mels=front_end.N_MELS, subsampling_channels=a["subsampling_conv_channels"], hidden_size=a["hidden_size"],
        num_layers=a["num_hidden_layers"], num_heads=a["num_attention_heads"], hidden_act="silu",
        conv_kernel_size=a["conv_kernel_size"], residual_weight=a["residual_weight"],
        chunk_size=a["attention_chunk_size"], context_left=a["attention_context_left"],
        context_right=a["attention_context_right"], logit_cap=a["attention_logit_cap"],
        invalid_logit=a["attention_invalid_logits_value"], clipped_linears=a["use_clipped_linears"],
        rms_norm_eps=a["rms_norm_eps"], gradient_clipping=a["gradient_clipping"], output_dims=a["output_proj_dims"],
        text_hidden_size=TEXT_HIDDEN, audio_token_id=258881, boa_token_id=256000, eoa_token_id=258883)


def gem4_model(state: dict[str, torch.Tensor], dtype: torch.dtype) -> AudioModel:
    with torch.device("meta"):
        model = AudioModel(audio_config())
    model.load_state_dict({k: v.to(torch.float32 if v.ndim <= 1 else dtype) for k, v in state.items()},
                          strict=True, assign=True)
    return model.eval()


def hf_model(state: dict[str, torch.Tensor]):
    from transformers import Gemma4AudioConfig, Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel, Gemma4MultimodalEmbedder

    config = Gemma4AudioConfig(**E2B_AUDIO)
    tower = Gemma4AudioModel(config).eval()
    embed = Gemma4MultimodalEmbedder(config, Gemma4TextConfig(hidden_size=TEXT_HIDDEN)).eval()
    tower.load_state_dict({k.removeprefix("audio_tower."): v for k, v in state.items() if k.startswith("audio_tower.")},
                          strict=False)
    embed.load_state_dict({k.removeprefix("embed_audio."): v for k, v in state.items() if k.startswith("embed_audio.")})

    def encode(wave: np.ndarray) -> torch.Tensor:
        from transformers import Gemma4AudioFeatureExtractor
        feats = Gemma4AudioFeatureExtractor()([wave], return_tensors="pt")
        with torch.no_grad():
            out = tower(feats["input_features"], feats["input_features_mask"])
            return embed(out.last_hidden_state)[0][out.attention_mask[0]]
    return encode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.seconds * front_end.SAMPLE_RATE)
    t = np.arange(n) / front_end.SAMPLE_RATE
    wave = (0.4 * np.sin(2 * np.pi * (200 + 300 * t) * t)
            + 0.05 * np.random.default_rng(0).standard_normal(n)).astype(np.float32)

    with torch.device("meta"):
        skeleton = AudioModel(audio_config())
    state = random_state(skeleton, seed=0)
    runs = {"gem4 float32": gem4_model(state, torch.float32), "gem4 bfloat16": gem4_model(state, torch.bfloat16)}
    encoders = {name: (lambda m: lambda w: m(torch.from_numpy(front_end.log_mel(w))))(m) for name, m in runs.items()}
    if not args.no_transformers:
        encoders["transformers float32"] = hf_model(state)
    times = {name: [] for name in encoders}
    mel_times = []
    outputs = {}
    for _ in range(args.repeats):
        start = time.perf_counter()
        front_end.log_mel(wave)
        mel_times.append(time.perf_counter() - start)
        for name, encode in encoders.items():
            start = time.perf_counter()
            outputs[name] = encode(wave)
            times[name].append(time.perf_counter() - start)
    print(f"| {args.seconds:g} s clip ({front_end.num_soft_tokens(n)} tokens), {torch.get_num_threads()} threads "
          f"| median s | min-max s |")
    print("|---|---|---|")
    print(f"| log-mel front end | {statistics.median(mel_times):.4f} | {min(mel_times):.4f}-{max(mel_times):.4f} |")
    for name, ts in times.items():
        print(f"| {name} (front end + tower + embedder) | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} |")
    if "transformers float32" in outputs:
        ref = outputs["transformers float32"]
        for name in runs:
            diff = (outputs[name] - ref).abs().max().item()
            print(f"\n{name}: max |difference| to transformers {diff:.2e} (embeddings up to {ref.abs().max():.2f})")


if __name__ == "__main__":
    main()
