"""Gemma 4's audio tower (E2B/E4B): log-mel frames -> soft tokens in the text width (docs/multimodal.md §3.3).
The 12B ("unified") model has none: `FrameAudioModel` projects raw waveform frames (bottom of the file).

A USM-style conformer, as transformers 5.23.0 computes it:

    features [F, 128]
      -> subsampling: 2 x (3x3 conv, stride 2, no bias -> LayerNorm over channels (no bias) -> ReLU)
         -> [T = ceil(F/4), freq, C] flattened freq-major, channel-fastest -> Linear (no bias)      [T, D]
      -> layers: h = FF1(h); h = h + RMS(attention(RMS(h))); h = light_conv(h); h = RMS(FF2(h))
      -> output_proj (Linear WITH bias)                                                             [T, out]
      -> embed_audio: RMSNorm without weight -> Linear (no bias)                                    [T, H_text]

Attention is local and causal: frame t sees frames t-11 .. t (context_left - 1 = 12 keys, no future with
context_right = 0). Logits are q.k plus a relative-position term q.relk[distance] (sinusoidal table through
`relative_k_proj`), capped as 50 tanh(x / 50) BEFORE the mask. q is scaled by head_dim^-0.5 / ln 2 times
softplus(per_dim_scale) per channel, k by ln(1 + e) / ln 2. transformers computes this in blocks of 12 query
frames against 24-frame contexts with a Transformer-XL shift; the band of keys each frame sees is the same
thing written directly (checked against it to float32 rounding, tests/test_audio_tower.py).

"Clipped" linear layers (E2B/E4B: `use_clipped_linears`) clamp their input and output to scalar bounds stored
in the checkpoint. The residual branches are clamped to +-gradient_clipping (1e10: a no-op in practice, kept
because transformers does it). transformers builds the feed-forward norms and the layer's three norms with
its default eps 1e-6 whatever the config says, and the light conv's norms with the config's: so does this file.

Activations are float32; weights are float32 or bfloat16 (matmul inputs rounded to them, as in gemma4.py), computed
by the text model's backend (docs/multimodal.md §2.5). The tower takes a batch of clips of one length ([B, F, n_mels]:
every step is per frame or per clip), each clip's soft tokens the same floats as alone.
Parameter names are transformers' without the `model.` prefix (`audio_tower.layers.0.self_attn.q_proj.linear.weight`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gem4.config import AudioConfig, FrameAudioConfig
from gem4.media import audio as media_audio
from gem4.model.layers import TOWER_PREFILL, QuantLinear, rms_norm

FIXED_EPS = 1e-6     # transformers' Gemma4RMSNorm default: the feed-forward and per-layer norms use it


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class Norm(nn.Module):
    """RMSNorm with a weight used as is (not 1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class ClippedLinear(nn.Module):
    """y = clamp(clamp(x, in_min, in_max) @ W.T, out_min, out_max): bounds are scalars from the checkpoint
    (E2B/E4B); without `clipped` it is a plain linear layer."""

    def __init__(self, in_features: int, out_features: int, clipped: bool):
        super().__init__()
        self.linear = QuantLinear(in_features, out_features)
        self.clipped = clipped
        if clipped:
            self.input_min, self.input_max, self.output_min, self.output_max = (_param() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = x.clamp(self.input_min.item(), self.input_max.item())       # numbers: clamp's fast kernel
        y = self.linear(x, TOWER_PREFILL)
        return y.clamp(self.output_min.item(), self.output_max.item()) if self.clipped else y


class SubsampleLayer(nn.Module):
    """3x3 conv, stride 2, padding 1, no bias -> LayerNorm over channels (weight, no bias) -> ReLU."""

    def __init__(self, c_in: int, c_out: int, eps: float):
        super().__init__()
        self.eps = eps
        self.conv = nn.Module()
        self.conv.weight = _param(c_out, c_in, 3, 3)
        self.norm = nn.Module()
        self.norm.weight = _param(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C_in, time, freq] -> [B, C_out, ceil(time/2), ceil(freq/2)]."""
        w = self.conv.weight
        y = F.conv2d(x.to(w.dtype), w, stride=2, padding=1).float()
        y = F.layer_norm(y.permute(0, 2, 3, 1), (y.shape[1],), self.norm.weight.float(), None, self.eps)
        return torch.relu(y).permute(0, 3, 1, 2)


class SubsampleConvProjection(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        c0, c1 = config.subsampling_channels
        self.layer0 = SubsampleLayer(1, c0, config.rms_norm_eps)
        self.layer1 = SubsampleLayer(c0, c1, config.rms_norm_eps)
        self.input_proj_linear = QuantLinear(config.subsampled_mels * c1, config.hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, F, n_mels] -> [B, ceil(F/4), D]."""
        x = self.layer1(self.layer0(features[:, None]))              # [B, C1, T, freq]
        x = x.permute(0, 2, 3, 1).reshape(x.shape[0], x.shape[2], -1)   # [B, T, freq*C1]: freq-major, channel-fastest
        return self.input_proj_linear(x, TOWER_PREFILL)


class FeedForward(nn.Module):
    """h + residual_weight * RMS(W2 act(W1 RMS(clamp h)))  (clamped again before the post norm)."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        D = config.hidden_size
        self.ffw_layer_1 = ClippedLinear(D, 4 * D, config.clipped_linears)
        self.ffw_layer_2 = ClippedLinear(4 * D, D, config.clipped_linears)
        self.pre_layer_norm = Norm(D, FIXED_EPS)
        self.post_layer_norm = Norm(D, FIXED_EPS)
        self.clip = config.gradient_clipping
        self.residual_weight = config.residual_weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.pre_layer_norm(h.clamp(-self.clip, self.clip))
        y = self.ffw_layer_2(F.silu(self.ffw_layer_1(y)))
        y = self.post_layer_norm(y.clamp(-self.clip, self.clip))
        return h + y * self.residual_weight


class Attention(nn.Module):
    """Local causal self-attention with a relative-position term and a logit cap (see the module docstring).
    `softplus_applied`: `per_dim_scale` holds softplus(per_dim_scale) already (llama.cpp's mmproj stores it so)."""

    def __init__(self, config: AudioConfig, softplus_applied: bool = False):
        super().__init__()
        D, hd = config.hidden_size, config.head_dim
        self.config = config
        self.q_proj = ClippedLinear(D, D, config.clipped_linears)
        self.k_proj = ClippedLinear(D, D, config.clipped_linears)
        self.v_proj = ClippedLinear(D, D, config.clipped_linears)
        self.post = ClippedLinear(D, D, config.clipped_linears)
        self.relative_k_proj = QuantLinear(D, D)                      # no clipping
        self.per_dim_scale = _param(hd)                               # through softplus, per head-dim channel
        self.softplus_applied = softplus_applied
        self.q_scale = hd ** -0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        # the keys frame t sees: t - past + 1 .. t + future (a band of `width` columns, column w <-> distance
        # past - 1 - w); the relative-position table's row for column w is w + 1 (transformers' row p holds
        # distance P - 1 - p and its shift puts distance d at row past - d)
        self.past = config.context_left - 1
        self.future = max(config.context_right - 1, 0)
        self.width = self.past + self.future

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """h [B, T, D] (B clips of T frames), positions [P, D] (the sinusoidal table) -> [B, T, D]."""
        cfg, (B, T) = self.config, h.shape[:2]
        nh, hd = cfg.num_heads, cfg.head_dim
        scale = self.per_dim_scale.float()
        scale = scale if self.softplus_applied else F.softplus(scale)
        q = self.q_proj(h).float().view(B, T, nh, hd) * self.q_scale * scale
        k = self.k_proj(h).float().view(B, T, nh, hd) * self.k_scale
        v = self.v_proj(h).float().view(B, T, nh, hd)
        relk = self.relative_k_proj(positions, TOWER_PREFILL).float().view(-1, nh, hd)               # [P, nh, hd]
        rows = min(self.width, relk.shape[0] - 1)
        rel = relk.new_zeros(self.width, nh, hd)
        rel[:rows] = relk[1:1 + rows]                                                 # [W, nh, hd]; past the table: 0

        # the band: key column w of frame t is frame t - past + 1 + w (zeros outside the clip, masked)
        pad = (0, 0, 0, 0, self.past - 1, self.future)
        k_band = F.pad(k, pad).unfold(1, self.width, 1)                               # [B, T, nh, hd, W]
        v_band = F.pad(v, pad).unfold(1, self.width, 1)
        logits = torch.einsum("bthd,bthdw->bthw", q, k_band) + torch.einsum("bthd,whd->bthw", q, rel)
        logits = cfg.logit_cap * torch.tanh(logits / cfg.logit_cap)                   # cap before the mask
        key = (torch.arange(T, device=h.device)[:, None] - (self.past - 1)
               + torch.arange(self.width, device=h.device)[None, :])                           # [T, W]
        outside = (key < 0) | (key >= T)
        logits = logits.masked_fill(outside[:, None, :], cfg.invalid_logit)
        out = torch.einsum("bthw,bthdw->bthd", torch.softmax(logits, dim=-1), v_band)   # [B, T, nh, hd]
        return self.post(out.reshape(B, T, nh * hd))


class LightConv(nn.Module):
    """h + W_end silu(RMS(clamp(causal depthwise conv(GLU(W_start RMS(h))))))."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        D = config.hidden_size
        self.linear_start = ClippedLinear(D, 2 * D, config.clipped_linears)
        self.linear_end = ClippedLinear(D, D, config.clipped_linears)
        self.depthwise_conv1d = nn.Module()
        self.depthwise_conv1d.weight = _param(D, 1, config.conv_kernel_size)
        self.pre_layer_norm = Norm(D, config.rms_norm_eps)
        self.conv_norm = Norm(D, config.rms_norm_eps)
        self.clip = config.gradient_clipping

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = F.glu(self.linear_start(self.pre_layer_norm(h)), dim=-1)                 # [B, T, D]: a * sigmoid(b)
        # causal depthwise conv: out_t = sum_k w[:, k] * y_{t-K+1+k}, as K shifted products (torch's grouped
        # conv1d takes ~100x longer on the CPU at these shapes)
        w = self.depthwise_conv1d.weight.float()[:, 0]                                # [D, K]
        T, K = y.shape[1], w.shape[1]
        padded = F.pad(y, (0, 0, K - 1, 0))                                           # [B, T + K - 1, D]
        conv = padded[:, :T] * w[:, 0]
        for k in range(1, K):
            conv = conv + padded[:, k:k + T] * w[:, k]
        y = self.conv_norm(conv.clamp(-self.clip, self.clip))
        return h + self.linear_end(F.silu(y))


class ConformerLayer(nn.Module):
    def __init__(self, config: AudioConfig, softplus_applied: bool):
        super().__init__()
        D = config.hidden_size
        self.feed_forward1 = FeedForward(config)
        self.self_attn = Attention(config, softplus_applied)
        self.lconv1d = LightConv(config)
        self.feed_forward2 = FeedForward(config)
        self.norm_pre_attn = Norm(D, FIXED_EPS)
        self.norm_post_attn = Norm(D, FIXED_EPS)
        self.norm_out = Norm(D, FIXED_EPS)
        self.clip = config.gradient_clipping

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.feed_forward1(h)
        a = self.self_attn(self.norm_pre_attn(h.clamp(-self.clip, self.clip)), positions)
        h = h + self.norm_post_attn(a.clamp(-self.clip, self.clip))
        h = self.feed_forward2(self.lconv1d(h))
        return self.norm_out(h.clamp(-self.clip, self.clip))


class AudioTower(nn.Module):
    def __init__(self, config: AudioConfig, softplus_applied: bool):
        super().__init__()
        self.config = config
        self.subsample_conv_projection = SubsampleConvProjection(config)
        self.layers = nn.ModuleList(ConformerLayer(config, softplus_applied) for _ in range(config.num_layers))
        self.output_proj = QuantLinear(config.hidden_size, config.output_dims)
        self.output_proj.bias = _param(config.output_dims)

    def relative_positions(self, device: torch.device) -> torch.Tensor:
        """[P, D]: row p is [sin(d * f), cos(d * f)] for distance d = P - 1 - p, f_i = 1e4^(-i / (D/2 - 1)), i < D/2."""
        D, P = self.config.hidden_size, self.config.relative_positions
        half = D // 2
        inv_timescales = torch.exp(torch.arange(half, device=device) * -(math.log(1e4) / max(half - 1, 1)))
        d = torch.arange(P - 1, -1, -1, device=device)[:, None] * inv_timescales[None, :]
        return torch.cat([torch.sin(d), torch.cos(d)], dim=-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, F, n_mels] -> [B, ceil(F/4), output_dims]."""
        h = self.subsample_conv_projection(features.float())
        positions = self.relative_positions(h.device)
        for layer in self.layers:
            h = layer(h, positions)
        return self.output_proj(h, TOWER_PREFILL) + self.output_proj.bias.float()


class Embedder(nn.Module):
    """Soft tokens into the text model: RMSNorm without weight, then a projection (no bias). Not scaled by sqrt(H)."""

    def __init__(self, in_dims: int, text_hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.embedding_projection = QuantLinear(in_dims, text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms_norm(x, None, self.eps), TOWER_PREFILL)


class AudioModel(nn.Module):
    """E2B/E4B: the tower and its embedder: features [F, n_mels] -> soft tokens [ceil(F/4), H_text] float32.
    `softplus_applied`: the attention's `per_dim_scale` tensors are stored through softplus (llama.cpp's mmproj),
    not as transformers keeps them."""

    def __init__(self, config: AudioConfig, softplus_applied: bool = False):
        super().__init__()
        self.config = config
        self.audio_tower = AudioTower(config, softplus_applied)
        self.embed_audio = Embedder(config.output_dims, config.text_hidden_size, config.rms_norm_eps)

    @torch.no_grad()
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [F, n_mels] -> [ceil(F/4), H_text]; several clips of F frames each: [B, F, n_mels] -> [B, ceil(F/4),
        H_text], each clip's soft tokens the same floats as alone (every step is per frame or per clip)."""
        if features.ndim not in (2, 3) or features.shape[-1] != self.config.n_mels:
            raise ValueError(f"audio features must be [frames, {self.config.n_mels}] (or [clips, frames, "
                             f"{self.config.n_mels}]), got {tuple(features.shape)}")
        soft = self.embed_audio(self.audio_tower(features.to(self.device).view(-1, *features.shape[-2:])))
        return soft.view(*features.shape[:-2], *soft.shape[-2:])

    @property
    def device(self) -> torch.device:
        return self.audio_tower.subsample_conv_projection.layer0.conv.weight.device     # a weight no backend packs


class FrameAudioModel(nn.Module):
    """12B ("unified", encoder-free): raw waveform frames [n, 640] -> soft-token embeddings [n, H_text] float32,
    each frame RMS-normed (no weight) and projected; no tower."""

    def __init__(self, config: FrameAudioConfig):
        super().__init__()
        self.config = config
        self.embed_audio = Embedder(config.samples_per_token, config.text_hidden_size, config.rms_norm_eps)

    @torch.no_grad()
    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        S = self.config.samples_per_token
        if frames.ndim not in (2, 3) or frames.shape[-1] != S:
            raise ValueError(f"audio frames must be [n, {S}] (or [clips, n, {S}]), got {tuple(frames.shape)}")
        return self.embed_audio(frames.float().to(self.device))

    @property
    def device(self) -> torch.device:
        return self.embed_audio.embedding_projection.weight.device


@dataclass(frozen=True)
class AudioEmbedding:
    """One audio clip ready for the text model: `embeddings` [n_tokens, H_text] replace the clip's n_tokens
    `<|audio|>` placeholders (between `<|audio>` and `<audio|>`). Audio is never attended bidirectionally."""
    embeddings: torch.Tensor
    n_tokens: int
    bidirectional: bool = False


def audio_input(model: AudioModel | FrameAudioModel, waveform: np.ndarray) -> np.ndarray:
    """What the model reads of a 16 kHz mono clip: log-mel frames [F, n_mels] (E2B/E4B), raw frames [n, 640] (12B).
    Clips whose inputs have one shape can go through the model together ([B, ...])."""
    if isinstance(model, FrameAudioModel):
        return media_audio.waveform_frames(waveform, model.config.samples_per_token)
    return media_audio.log_mel(waveform)


def encode_audio(model: AudioModel | FrameAudioModel, waveform: np.ndarray) -> AudioEmbedding:
    """A 16 kHz mono waveform (media/audio.py decode_audio) -> its soft-token embeddings and their count.

    E2B/E4B: log-mel frames through the tower; the count is media/audio.py's num_soft_tokens (25 a second, at
    most 750: audio past 30 s is cut). 12B: raw 640-sample frames, ceil(N / 640) of them, no cut."""
    embeddings = model(torch.from_numpy(audio_input(model, waveform)))
    if isinstance(model, FrameAudioModel):
        return AudioEmbedding(embeddings=embeddings, n_tokens=embeddings.shape[0])
    n = media_audio.num_soft_tokens(len(waveform))
    if embeddings.shape[0] != n:                 # the two stride-2 convolutions give ceil(F / 4) rows
        raise RuntimeError(f"the audio tower gave {embeddings.shape[0]} soft tokens, the front end counts {n}")
    return AudioEmbedding(embeddings=embeddings, n_tokens=n)
