"""The Gemma 4 vision tower (E2B/E4B and 26B/31B, docs/multimodal.md §2.2): image patches -> soft tokens in the
text model's width.

    x = 2 * patch - 1                                   the processor leaves pixels in [0, 1]
    h = x W_patch^T + pos[0][column] + pos[1][row]      (2, P, D) position table: [0] is x, [1] is y
    L ViT layers, all patches seeing each other:        the text layer's block structure (norms used as `w`,
        q/k RMS-normed per head with a weight, v without, 2-D RoPE: head dims [0, d/2) rotate with x,
        [d/2, d) with y, NeoX-style within each half; attention scale 1.0; gelu_tanh GLU MLP)
        E2B/E4B: every linear clamps its input and output to bounds stored in the checkpoint ("clipped")
    3x3 average pool over the (rows, cols) patch grid    one soft token per 48 x 48 px, row-major
    * sqrt(D) in float32; 26B/31B: (. - std_bias) * std_scale
    RMSNorm without weight, then a linear map into the text width (no sqrt(H) there: the text model puts these
    rows in place of its scaled token embeddings as they are)

Parameter names are the checkpoint's without `model.` (`vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight`,
`embed_vision.embedding_projection.weight`), so the module tree is the manifest the loader checks, as for the
text model. The reference in plain torch, like model/gemma4.py, computed by the text model's backend (docs/multimodal.md §2.5);
the activations are float32, the weights in the model's dtype (matmul inputs rounded to it).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gem4.config import VisionConfig
from gem4.model.layers import TOWER_PREFILL, QuantLinear, RMSNorm, apply_rope, gelu_mul, rms_norm


class ClippedLinear(nn.Module):
    """A linear layer, with (E2B/E4B) its input and output clamped to scalar bounds from the checkpoint."""

    def __init__(self, in_features: int, out_features: int, clipped: bool):
        super().__init__()
        self.linear = QuantLinear(in_features, out_features)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                setattr(self, name, nn.Parameter(torch.empty(()), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x, TOWER_PREFILL)
        # the bounds as Python numbers: clamp by 0-d tensors takes torch's broadcasting kernel, ~10x slower here
        x = x.clamp(self.input_min.item(), self.input_max.item())
        return self.linear(x, TOWER_PREFILL).clamp(self.output_min.item(), self.output_max.item())


class VisionAttention(nn.Module):
    dtype = torch.float32      # the matmuls' inputs (the model's weight dtype, set by VisionModel): bf16 halves SDPA

    def __init__(self, config: VisionConfig):
        super().__init__()
        D, d, clip = config.hidden_size, config.head_dim, config.clipped_linears
        self.config = config
        self.q_proj = ClippedLinear(D, config.num_heads * d, clip)
        self.k_proj = ClippedLinear(D, config.num_kv_heads * d, clip)
        self.v_proj = ClippedLinear(D, config.num_kv_heads * d, clip)
        self.o_proj = ClippedLinear(config.num_heads * d, D, clip)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """h [B, n, D]: B images of one grid, each attending over its own n patches."""
        c, (B, n) = self.config, h.shape[:2]
        q = rope_2d(self.q_norm(self.q_proj(h).view(B, n, c.num_heads, c.head_dim)), *rope)
        k = rope_2d(self.k_norm(self.k_proj(h).view(B, n, c.num_kv_heads, c.head_dim)), *rope)
        v = rms_norm(self.v_proj(h).view(B, n, c.num_kv_heads, c.head_dim), None, c.rms_norm_eps)
        g = c.num_heads // c.num_kv_heads
        if g > 1:
            k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
        # every patch sees every patch; SDPA's flash-attention CPU kernel never holds the [n, n] scores of a 10080-patch image
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2).to(self.dtype) for t in (q, k, v)),
                                             scale=1.0).float()                   # [B, nh, n, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, n, c.num_heads * c.head_dim))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        D, inner, clip = config.hidden_size, config.intermediate_size, config.clipped_linears
        self.gate_proj = ClippedLinear(D, inner, clip)
        self.up_proj = ClippedLinear(D, inner, clip)
        self.down_proj = ClippedLinear(inner, D, clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_mul(self.gate_proj(x), self.up_proj(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = VisionAttention(config)
        self.mlp = VisionMLP(config)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.pre_feedforward_layernorm = RMSNorm(D, eps)
        self.post_feedforward_layernorm = RMSNorm(D, eps)

    def forward(self, h: torch.Tensor, rope) -> torch.Tensor:
        h = self.post_attention_layernorm.add_to(h, self.self_attn(self.input_layernorm(h), rope))
        return self.post_feedforward_layernorm.add_to(h, self.mlp(self.pre_feedforward_layernorm(h)))


class PatchEmbedder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.input_proj = QuantLinear(config.patch_dim, config.hidden_size)
        self.position_embedding_table = nn.Parameter(
            torch.empty(2, config.position_embedding_size, config.hidden_size), requires_grad=False)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """patches [B, n, 3 p^2] in [0, 1], positions [n, 2] (x, y) -> [B, n, D]."""
        table = self.position_embedding_table.float()
        h = self.input_proj(2 * (patches - 0.5), TOWER_PREFILL)
        return h + table[0][positions[:, 0]] + table[1][positions[:, 1]]


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_layers))


class VisionTower(nn.Module):
    """`vision_tower.*`: patches -> pooled, scaled (and standardized) features [tokens, D]."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = VisionEncoder(config)
        if config.standardize:
            self.std_bias = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
            self.std_scale = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.register_buffer("inv_freq", torch.tensor(config.inv_freq(), dtype=torch.float32), persistent=False)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """patches [B, n, 3 p^2] of B images on one grid, positions [n, 2] -> [B, tokens, D]."""
        c = self.config
        rows, cols = grid
        k = c.pooling
        if rows * cols != patches.shape[1] or rows % k or cols % k:
            raise ValueError(f"{patches.shape[1]} patches on a {rows}x{cols} grid: the grid must hold them all and "
                             f"both sides must be multiples of the pooling {k}")
        if int(positions.max()) >= c.position_embedding_size:
            raise ValueError(f"a patch coordinate of {int(positions.max())} is past the position table's "
                             f"{c.position_embedding_size} rows: the image is too large for this tower")
        h = self.patch_embedder(patches.float(), positions)
        rope = rope_2d_cos_sin(positions, self.inv_freq)
        for layer in self.encoder.layers:
            h = layer(h, rope)
        D = c.hidden_size
        pooled = F.avg_pool2d(h.view(-1, rows, cols, D).permute(0, 3, 1, 2), k)   # [B, D, rows/k, cols/k]
        pooled = pooled.flatten(2).transpose(1, 2) * math.sqrt(D)                 # [B, tokens, D], row-major
        if c.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled


class VisionEmbedder(nn.Module):
    """`embed_vision.*`: RMSNorm without weight, then D -> the text width (the 12B's embedder ends with it too)."""

    def __init__(self, hidden_size: int, text_hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.embedding_projection = QuantLinear(hidden_size, text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms_norm(x, None, self.eps), TOWER_PREFILL)


class VisionModel(nn.Module):
    """The tower and its projection: `encode(patches, positions, grid)` -> one image's soft tokens [tokens, H]."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.vision_tower = VisionTower(config)
        self.embed_vision = VisionEmbedder(config.hidden_size, config.text_hidden_size, config.rms_norm_eps)
        for layer in self.vision_tower.encoder.layers:
            layer.self_attn.dtype = dtype                 # attention's matmul inputs in the weights' dtype

    @torch.no_grad()
    def encode(self, patches, positions, grid: tuple[int, int]) -> torch.Tensor:
        """patches [n, 3 p^2] in [0, 1] (numpy or torch), positions [n, 2] (x, y), grid (rows, cols) ->
        [n / pooling^2, text hidden] float32 (media/image.py's ImagePatches gives all three). Several images of one
        grid in one pass: patches [B, n, 3 p^2] -> [B, n / pooling^2, text hidden], each image's soft tokens the
        same floats as alone (every step is per row or per image; the backends' products are row-invariant)."""
        device = self.vision_tower.patch_embedder.position_embedding_table.device    # a weight no backend packs
        patches = torch.as_tensor(patches, dtype=torch.float32, device=device)
        positions = torch.as_tensor(positions, dtype=torch.long, device=device)
        soft = self.embed_vision(self.vision_tower(patches.view(-1, *patches.shape[-2:]), positions, grid)).float()
        return soft.view(*patches.shape[:-2], *soft.shape[-2:])


def rope_2d_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [n, 2] (x, y), inv_freq [d/4] -> (cos, sin) [n, 2, 1, d/2] each: axis 0 (x) for the first half
    of a head, axis 1 (y) for the second; NeoX layout within each half."""
    angles = positions.float()[:, :, None] * inv_freq                     # [n, 2, d/4]
    emb = torch.cat([angles, angles], dim=-1)[:, :, None, :]              # [n, 2, 1, d/2]
    return emb.cos(), emb.sin()


def rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d]: dims [0, d/2) rotated by the x position, [d/2, d) by the y position."""
    half = x.shape[-1] // 2
    return torch.cat([apply_rope(x[..., :half], cos[:, 0], sin[:, 0]),
                      apply_rope(x[..., half:], cos[:, 1], sin[:, 1])], dim=-1)
