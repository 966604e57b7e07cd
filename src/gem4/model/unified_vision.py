"""The 12B's ("unified") encoder-free vision embedder (docs/multimodal.md §2.5): image patches -> soft tokens in the
text model's width, with no tower in between.

    x = patch                                   48 x 48 px, (row, column, channel), in [0, 1]: no 2x - 1
    h = LN2(W_dense LN1(x) + b)                 LayerNorms with weight and bias, eps 1e-5 (torch's default,
                                                which transformers' embedder keeps whatever the config says)
    h = LN_pos(h + pos[x, 0] + pos[y, 1])       (rows, 2, D) position table: [:, 0] is x, [:, 1] is y
    soft = RMS(h) (no weight, the config's eps) W_proj^T

One soft token per patch (no pooling). The soft tokens go into the text model as the tower's do (model/vision.py):
not scaled by sqrt(H), and one image's tokens see each other both ways on sliding layers (the 12B's text config
says "vision").

Parameter names are the checkpoint's without `model.` (`vision_embedder.patch_dense.weight`,
`embed_vision.embedding_projection.weight`), so the module tree is the manifest the loader checks. `encode` has
VisionModel's signature: the engine calls either the same way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gem4.config import UnifiedVisionConfig
from gem4.model.layers import QuantLinear
from gem4.model.vision import VisionEmbedder

LAYER_NORM_EPS = 1e-5       # nn.LayerNorm's default: transformers builds the embedder's three norms with it


class LayerNorm(nn.Module):
    """torch's LayerNorm (weight and bias) over the last dim, in float32."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), LAYER_NORM_EPS)


class PatchDense(QuantLinear):
    """patch_dense: the one linear of the embedder with a bias."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias.float()


class UnifiedPatchEmbedder(nn.Module):
    """`vision_embedder.*`: patches [n, 3 p^2] and their (x, y) -> [n, D]."""

    def __init__(self, config: UnifiedVisionConfig):
        super().__init__()
        D = config.embed_dim
        self.patch_ln1 = LayerNorm(config.patch_dim)
        self.patch_dense = PatchDense(config.patch_dim, D)
        self.patch_ln2 = LayerNorm(D)
        self.pos_embedding = nn.Parameter(torch.empty(config.position_embedding_size, 2, D), requires_grad=False)
        self.pos_norm = LayerNorm(D)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.patch_ln2(self.patch_dense(self.patch_ln1(patches)))
        table = self.pos_embedding.float()
        return self.pos_norm(h + table[positions[:, 0], 0] + table[positions[:, 1], 1])


class UnifiedVisionModel(nn.Module):
    """The embedder and its projection: `encode(patches, positions, grid)` -> one image's soft tokens [n, H]."""

    def __init__(self, config: UnifiedVisionConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.vision_embedder = UnifiedPatchEmbedder(config)
        self.embed_vision = VisionEmbedder(config.embed_dim, config.text_hidden_size, config.rms_norm_eps)

    @torch.no_grad()
    def encode(self, patches, positions, grid: tuple[int, int]) -> torch.Tensor:
        """patches [n, 3 p^2] in [0, 1] (numpy or torch), positions [n, 2] (x, y), grid (rows, cols) ->
        [n, text hidden] float32 (media/image.py's ImagePatches at the config's patch size gives all three). Several
        images of one grid in one pass, as the tower's encode: patches [B, n, 3 p^2] -> [B, n, text hidden], each
        image's soft tokens the same floats as alone (every step is per patch)."""
        c = self.config
        device = self.vision_embedder.pos_embedding.device          # a weight no backend packs
        patches = torch.as_tensor(patches, dtype=torch.float32, device=device)
        positions = torch.as_tensor(positions, dtype=torch.long, device=device)
        rows, cols = grid
        if rows * cols != patches.shape[-2] or patches.shape[-1] != c.patch_dim:
            raise ValueError(f"{tuple(patches.shape)} patches on a {rows}x{cols} grid: the embedder reads "
                             f"rows x cols patches of {c.patch_dim} values")
        if int(positions.max()) >= c.position_embedding_size:
            raise ValueError(f"a patch coordinate of {int(positions.max())} is past the position table's "
                             f"{c.position_embedding_size} rows: the image is too large for this embedder")
        flat = patches.reshape(-1, c.patch_dim)
        soft = self.embed_vision(self.vision_embedder(flat, positions.repeat(flat.shape[0] // positions.shape[0], 1)))
        return soft.float().view(*patches.shape[:-1], soft.shape[-1])
