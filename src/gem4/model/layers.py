"""Building blocks of the Gemma 4 forward (docs/gemma4.md §2): norms, RoPE, linear layers, attention, experts.

Everything here computes; nothing here knows a file format. Weights arrive already in their
compute dtype (or, for lookup tables, in a row-addressable stored form) from `weights/loader.py`.

This is the reference backend (plain torch): a backend chosen at load (model/backends.py) replaces these
modules by subclasses that compute the same with other kernels. What a layer needs to know about the forward
under way arrives as arguments: `prefill` (the step's tokens are prompt tokens, StepLayout.prefill) reaches
every linear layer and the attention, because a backend may compute prompt and generated tokens with
different kernels (the CPU backend: a row-invariant GEMM for prompts, GEMVs for generated tokens).
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gem4.ggml import GGMLType, dequantize, dequantize_affine, tensor_nbytes


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-1/2 [* weight], in float32, cast back (docs/gemma4.md §2.1: weight used as is)."""
    return F.rms_norm(x.float(), x.shape[-1:], None if weight is None else weight.float(), eps).to(x.dtype)


class RMSNorm(nn.Module):
    """RMS norm with a learned `weight` (used as is, docs/gemma4.md §2.1), or without (`scale=False`: V's norm)."""

    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps = eps
        if scale:
            self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        else:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + norm(x): a block's output norm and residual add."""
        return residual + rms_norm(x, self.weight, self.eps)

    def with_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q/k norm then RoPE: x [T, heads, d], cos/sin [T, 1, d]."""
        return apply_rope(self.forward(x), cos, sin)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def gelu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return gelu_tanh(a) * b


class GeluMul(nn.Module):
    """gelu_tanh(a) * b: the gate of the MLPs, the experts and the E2B/E4B per-layer input."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return gelu_mul(a, b)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else cap * torch.tanh(logits / cap)


class Softcap(nn.Module):
    """cap * tanh(logits / cap) (docs/gemma4.md §2.8); no cap: the identity."""

    def __init__(self, cap: float | None):
        super().__init__()
        self.cap = cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return softcap(logits, self.cap)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], inv_freq [d/2] -> cos, sin [T, 1, d] float32 (NeoX layout: pair (i, i + d/2))."""
    angles = positions.float()[:, None] * inv_freq[None, :]       # [T, d/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]         # [T, 1, d]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]: out[i] = x[i] cos - x[i+d/2] sin; out[i+d/2] = x[i+d/2] cos + x[i] sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# What the media towers (model/vision.py, model/audio.py) tell their linear layers: every row of a tower pass is a
# prompt row, so a backend computes them all with its row-invariant prefill kernels (model/cpu.py), whatever their
# number -- one image or several batched give each row the same floats.
TOWER_PREFILL = True


class QuantLinear(nn.Module):
    """y = x @ W.T with W [out, in]. The one linear layer of the model.

    Two storages (`layout`):
    - "dense": `weight` in the weight dtype (GGML block formats dequantized once at load). The input is
      rounded to W's dtype, products accumulate in float32, the result comes back in the activation dtype.
    - "affine" (`keep_affine()`): an MLX affine table's three tensors as the file has them, read by rows.
    - "blocks" (`keep_blocks()`): `raw` holds GGML blocks of any type exactly as the file has them, for a
      table that is only ever read by rows (the per-layer token embedding); it stays in the mmap.

    `prefill` (the kind of the forward pass, StepLayout.prefill; None: a layer called alone) does not change
    the reference's result; a backend's linear layers choose their kernels by it (model/cpu.py).
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.layout = "dense"
        self.ggml_type: GGMLType | None = None                    # set for "blocks" (and a backend's packings)

    def keep_blocks(self, raw: torch.Tensor, ggml_type: GGMLType) -> None:
        """Load time: keep the GGML bytes of the [out, in] weight as they are (a table read by rows)."""
        row_bytes = tensor_nbytes(ggml_type, self.in_features)
        self.set_storage("blocks", "raw", raw.reshape(self.out_features, row_bytes), ggml_type)

    def keep_affine(self, q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int) -> None:
        """Load time: keep an MLX affine table (gem4.ggml.dequantize_affine) as the file has it, read by rows: the
        E2B/E4B per-layer embedding of an MLX checkpoint (weights/mlx.py), never regrouped."""
        del self.weight
        for name, t in (("q", q), ("scales", scales), ("biases", biases)):
            self.register_buffer(name, t, persistent=False)
        self.layout, self.affine = "affine", (bits, group)

    def set_storage(self, layout: str, name: str, data: torch.Tensor, ggml_type: GGMLType) -> None:
        """Load time: the weight becomes the buffer `name` in `layout` (blocks here; a backend's packed forms)."""
        del self.weight
        self.register_buffer(name, data, persistent=False)
        self.layout = layout
        self.ggml_type = GGMLType(ggml_type)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as float32 [len(ids), in]: W used as a lookup table (token embeddings).

        Only these rows are converted, so a table in blocks (the 262144 x 8960 E2B per-layer
        embedding) is never materialised. Gathered with index_select: the same rows as W[ids], ~8x faster for
        thousands of rows (the assistant's centroid head: 4096 rows of its [262144, 256] table).
        """
        ids = ids.reshape(-1)
        if self.layout == "dense":
            return self.weight.index_select(0, ids).float()
        if self.layout == "affine":
            return dequantize_affine(self.q.index_select(0, ids), self.scales.index_select(0, ids),
                                     self.biases.index_select(0, ids), *self.affine)
        return dequantize(self.raw.index_select(0, ids), self.ggml_type, (ids.numel(), self.in_features))

    def forward(self, x: torch.Tensor, prefill: bool | None = None) -> torch.Tensor:
        if self.layout in ("blocks", "affine"):
            raise RuntimeError("this weight is kept in GGML blocks as a lookup table; it has no matmul")
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [T, nh, d], k/v [S, nkv, d], mask [T, S] bool -> [T, nh*d]. Scale 1.0 (docs/gemma4.md §2.5).

    GQA without repeating K/V: query head h = kv * g + j uses KV head kv, so the g query heads of a KV
    head are stacked as rows of one matmul against that head's keys. Float32 throughout (the cache may
    hold bf16). torch's CPU SDPA with enable_gqa is ~100x slower than this at decode shapes.
    """
    T, nh, d = q.shape
    S, nkv, _ = k.shape
    g = nh // nkv
    qg = q.float().reshape(T, nkv, g, d).permute(1, 2, 0, 3).reshape(nkv, g * T, d)   # [nkv, g*T, d]
    scores = torch.bmm(qg, k.float().permute(1, 2, 0))                                  # [nkv, g*T, S]
    scores = scores.masked_fill(~mask.repeat(g, 1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, v.float().transpose(0, 1))                                   # [nkv, g*T, d]
    return out.reshape(nkv, g, T, d).permute(2, 0, 1, 3).reshape(T, nh * d).to(q.dtype)


def attend(q: torch.Tensor, kv, a, prefill: bool) -> torch.Tensor:
    """Attention of a step's query rows q [T, nh, d] over the KV storage of several sequences (kv_cache.LayerKV:
    [R, nkv, d], in the pool's dtype), each row seeing the keys `a` (kv_cache.Attend) gives it -> [T, nh*d] float32.

    A decode pass (a few rows a sequence): every row against its own sequence's keys at once, one batched
    gather (no per-sequence loop, so the decode step compiles as one graph). A prefill pass (many rows of few
    sequences): sequence by sequence, its keys gathered once (`per_sequence`). Either reads the gathered rows
    dequantized to float32 (LayerKV.read).
    """
    if prefill:
        return per_sequence(q, kv, a, lambda q_b, kv_b, mask, first_key: attention(q_b, *kv_b.read(), mask))
    T, nh, d = q.shape
    keys = a.key_rows[a.q_seq]                                                          # [T, S]
    k, v = kv.read(keys)                                                                # [T, S, nkv, d] float32
    nkv = k.shape[2]
    qg = q.float().reshape(T, nkv, nh // nkv, d)                                        # [T, nkv, g, d]
    scores = torch.einsum("tkgd,tskd->tkgs", qg, k)                                     # [T, nkv, g, S]
    scores = scores.masked_fill(~a.mask()[:, None, None, :], float("-inf"))
    out = torch.einsum("tkgs,tskd->tkgd", torch.softmax(scores, dim=-1), v)             # [T, nkv, g, d]
    return out.reshape(T, nh * d)


def per_sequence(q: torch.Tensor, kv, a, attend_rows) -> torch.Tensor:
    """A prefill pass's attention, one sequence at a time: attend_rows(q rows [n, nh, d], the sequence's keys it may
    see, gathered in position order as stored (a LayerKV of S_b rows), mask [n, S_b], the position of key 0) ->
    [n, nh*d]."""
    T = q.shape[0]
    out = q.new_empty((T, q.shape[1] * q.shape[2]), dtype=torch.float32)
    seqs, counts = torch.unique_consecutive(a.q_seq, return_counts=True)
    row = 0
    for b, n in zip(seqs.tolist(), counts.tolist()):
        rows = slice(row, row + n)
        row += n
        seen = int(a.q_hi[rows].max())                      # the sequence's keys its rows may see: [0, seen)
        keys = a.key_rows[b, :seen]
        mask = a.select(torch.arange(rows.start, rows.stop)).mask()[:, :seen]     # [n, S_b]
        first_key = None if a.first_key is None else int(a.first_key[b])
        out[rows] = attend_rows(q[rows], kv.gather(keys), mask, first_key)
    return out


def experts_forward(x: torch.Tensor, gate_up, down, act, expert_idx: torch.Tensor, expert_w: torch.Tensor,
                    tiles=None) -> torch.Tensor:
    """Routed experts (26B-A4B), batched by expert.

    x [T, H]; gate_up(e, xs [n, H]) -> [n, 2*Im] (columns [0, Im) gate, [Im, 2Im) up) and down(e, h [n, Im])
    -> [n, H]: expert e's products; act(g, u): the gelu gate; expert_idx, expert_w [T, K]. Returns
    sum_k w[t,k] * down_e(gelu(g) * u) -> [T, H]. (token, slot) pairs are grouped by expert, so the loop runs
    over the experts in use, never over tokens. `tiles` (the expert store's, model/experts.py): the
    ascending experts in use -> groups, each ready in the store before it is yielded; the experts are summed
    in ascending order whatever the grouping.
    """
    T, K = expert_idx.shape
    flat_expert = expert_idx.reshape(-1)                          # [T*K]
    order = torch.argsort(flat_expert, stable=True)
    token_of = order // K                                         # [T*K] token of each sorted pair
    weight_of = expert_w.reshape(-1)[order]                       # [T*K]
    counts = torch.bincount(flat_expert).tolist()
    starts = [0] + list(itertools.accumulate(counts))
    used = [e for e, n in enumerate(counts) if n]
    out = torch.zeros_like(x)
    for group in (tiles(used) if tiles is not None else (used,)):
        for e in group:
            start, n = starts[e], counts[e]
            tokens = token_of[start:start + n]
            gu = gate_up(e, x[tokens])                            # [n, 2*Im]
            im = gu.shape[-1] // 2
            y = down(e, act(gu[:, :im].contiguous(), gu[:, im:].contiguous()))    # [n, H]
            out.index_add_(0, tokens, y * weight_of[start:start + n, None].to(x.dtype))
    return out


def embed_scale(hidden_size: int) -> float:
    """sqrt(H) in float32 (llama.cpp's choice; HF rounds it to the weight dtype: docs/architecture.md §5.3)."""
    return float(np.float32(math.sqrt(hidden_size)))
