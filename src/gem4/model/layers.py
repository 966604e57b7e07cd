"""Building blocks of the Gemma 4 forward (docs/gemma4.md §2): norms, RoPE, linear layers, attention, experts.

Everything here computes; nothing here knows a file format. Weights arrive already in their
compute dtype (or, for lookup tables, in a row-addressable stored form) from `weights/loader.py`.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gem4.model import kernels
from gem4.weights.quants import GGMLType, dequantize, tensor_nbytes


class _Pass(threading.local):
    prefill: bool | None = None        # the kind of the forward pass under way; None: none (a layer called alone)


_PASS = _Pass()


@contextlib.contextmanager
def prefill_pass(prefill: bool):
    """The kind of the forward pass under way (StepLayout.prefill), for the fast mode's linear layers: in a prefill
    pass every packed or bf16 weight takes the row-invariant GEMM (kernels.linear / linear_bf16), in a decode pass
    the GEMV kernels (row-invariant too), whatever the number of rows. So a token's activations depend on its own
    row alone, not on how its prompt was cut into chunks (a prefix-cache hit computes the rest of a prompt in
    other chunks than a cold run) nor on what else ran beside it. Outside a pass (a layer called alone) inputs of
    up to decode_rows rows take the GEMV, longer ones the GEMM."""
    before, _PASS.prefill = _PASS.prefill, prefill
    try:
        yield
    finally:
        _PASS.prefill = before


def takes_gemv_rows(rows: int, decode_rows: int) -> bool:
    """Whether `rows` input rows take the GEMV kernels rather than the GEMM in the pass under way (prefill_pass)."""
    return rows <= decode_rows if _PASS.prefill is None else not _PASS.prefill


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-1/2 [* weight], in float32, cast back (docs/gemma4.md §2.1: weight used as is)."""
    return F.rms_norm(x.float(), x.shape[-1:], None if weight is None else weight.float(), eps).to(x.dtype)


class RMSNorm(nn.Module):
    fused = False          # fast mode (Model.use_kernels): the compiled kernels, the same float32 math

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return kernels.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + norm(x): a block's output norm and residual add."""
        if self.fused:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        return residual + rms_norm(x, self.weight, self.eps)

    def with_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q/k norm then RoPE: x [T, heads, d], cos/sin [T, 1, d]."""
        if self.fused:
            return kernels.rms_norm_rope(x, self.weight, self.eps, cos, sin)
        return apply_rope(self.forward(x), cos, sin)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def gelu_mul(a: torch.Tensor, b: torch.Tensor, fused: bool) -> torch.Tensor:
    """gelu_tanh(a) * b; `fused` (fast mode): one compiled vector pass."""
    return kernels.gelu_mul(a, b) if fused else gelu_tanh(a) * b


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else cap * torch.tanh(logits / cap)


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


# Fast mode: a decode pass (prefill_pass) takes the compiled decode kernels; the engine packs generated tokens
# into decode passes of at most a model's decode_rows rows (set_decode_rows, at load), one of these two:
DECODE_ROWS = 32       # packed weights: the GEMV reads W once per pass of up to 8 rows
DECODE_ROWS_BF16 = 8   # decoder layers with bf16 weights read by gemv_bf16 (4 rows per pass): 2.2x the bf16 GEMM's
                       # time at 8 rows here (an AMX host), 4-9x at 16-32
ALIGN_KEYS = 16        # fast-mode prefill attention: zero keys put in front of a sequence's keys, so that key i
                       # sits at a position = i (mod 16) and kernels.attend_chunk sums in an order fixed by positions


class QuantLinear(nn.Module):
    """y = x @ W.T with W [out, in]. The one linear layer of the model.

    Three storages (`layout`), one forward:
    - "dense" (reference): `weight` in the weight dtype (GGML block formats dequantized once at load).
      The input is rounded to W's dtype, products accumulate in float32, the result comes back in the
      activation dtype. In fast mode (`fused`) a bf16 weight takes a decode pass's inputs through
      kernels.gemv_bf16 (the input as two bf16 terms: closer to the float32 path, not further) and a prefill
      pass's through kernels.linear_bf16 (prefill_pass).
    - "packed" (fast path, `pack()`): `packed` holds Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K weights
      (kernels.PACKED_TYPES) in the compiled kernels' layout, rearranged once at load, losslessly. A decode
      pass's rows run the GEMV kernel that reads it directly; a prefill pass's the GEMM that turns 32 rows of W
      at a time into bf16 (prefill_pass). Both equal dequantize + float matmul up to float rounding (tested).
    - "blocks" (`keep_blocks()`): `raw` holds GGML blocks of any type exactly as the file has them, for a
      table that is only ever read by rows (the per-layer token embedding); it stays in the mmap.
    """

    fused = False          # fast mode (Model.use_kernels): bf16 weights take decode-sized inputs through gemv_bf16
    decode_rows = DECODE_ROWS   # the model's (set_decode_rows)

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.layout = "dense"
        self.ggml_type: GGMLType | None = None                    # set for "packed" and "blocks"

    def pack(self, raw: torch.Tensor, ggml_type: GGMLType) -> None:
        """Load time: GGML bytes of the [out, in] weight (a kernels.PACKED_TYPES type) -> the kernels' layout."""
        packed = kernels.repack(raw, self.out_features, self.in_features, ggml_type)
        self._set_storage("packed", "packed", packed, ggml_type)

    def keep_blocks(self, raw: torch.Tensor, ggml_type: GGMLType) -> None:
        """Load time: keep the GGML bytes of the [out, in] weight as they are (a table read by rows)."""
        row_bytes = tensor_nbytes(ggml_type, self.in_features)
        self._set_storage("blocks", "raw", raw.reshape(self.out_features, row_bytes), ggml_type)

    def _set_storage(self, layout: str, name: str, data: torch.Tensor, ggml_type: GGMLType) -> None:
        del self.weight
        self.register_buffer(name, data, persistent=False)
        self.layout = layout
        self.ggml_type = GGMLType(ggml_type)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as float32 [len(ids), in]: W used as a lookup table (token embeddings).

        Only these rows are converted, so a table in blocks (the 262144 x 8960 E2B per-layer
        embedding) is never materialised. Gathered with index_select (packed: the kernels' dequant of the row
        ids): the same rows as W[ids], ~8x faster for thousands of rows (the assistant's centroid head: 4096
        rows of its [262144, 256] table).
        """
        ids = ids.reshape(-1)
        if self.layout == "dense":
            return self.weight.index_select(0, ids).float()
        if self.layout == "packed":
            return kernels.dequant(self.packed, self.in_features, self.ggml_type, torch.float32, rows=ids)
        return dequantize(self.raw.index_select(0, ids), self.ggml_type, (ids.numel(), self.in_features))

    @property
    def gemv_type(self) -> GGMLType | None:
        """The weight type a GEMV kernel reads for this layer: its packed type, BF16 for a bf16 weight in fast
        mode, else None."""
        if self.layout == "packed":
            return self.ggml_type
        if self.fused and self.layout == "dense" and self.weight.dtype == torch.bfloat16:
            return GGMLType.BF16
        return None

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """True when forward(x) is one GEMV kernel call: x float32 [M, in], contiguous, in a decode pass (outside a
        pass: M <= decode_rows; prefill_pass), and a kernel reads this weight (gemv_type)."""
        return (self.gemv_type is not None and x.dim() == 2 and takes_gemv_rows(x.shape[0], self.decode_rows)
                and x.dtype == torch.float32 and x.is_contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_gemv(x):                                    # decode: the common case first
            if self.layout == "dense":
                return kernels.gemv_bf16(x, self.weight)
            return kernels.gemv(x, self.packed, self.out_features, self.in_features, self.ggml_type)
        if self.layout == "dense":
            if self.gemv_type is not None and self.in_features % 32 == 0:    # fast mode, bf16: row-invariant
                y = kernels.linear_bf16(x.reshape(-1, self.in_features), self.weight)
                return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
            return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        if self.layout == "blocks":
            raise RuntimeError("this weight is kept in GGML blocks as a lookup table; it has no matmul")
        y = packed_linear(x.reshape(-1, self.in_features), self.packed, self.out_features, self.in_features, self.ggml_type)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def set_decode_rows(model: nn.Module, bulk: nn.Module) -> int:
    """Fast mode, once at load (after `fused` is set): the model's decode_rows, given to every module that has
    the class attribute. One number per model, so that every layer switches from the GEMV kernels to the GEMMs
    at the same row count and a forward pass of small chunks (engine/runner.py) takes one path throughout.
    DECODE_ROWS_BF16 when gemv_bf16 reads a weight of `bulk` (the decoder layers: most of a step's reads), else
    DECODE_ROWS: a bf16 matrix outside them (llama.cpp's GGUFs, and gem4 convert's K-quant mixes, keep the
    E2B/E4B per-layer model projection in BF16) then takes gemv_bf16 up to DECODE_ROWS rows, slower there than
    the bf16 GEMM but one matrix of the step."""
    bf16 = any(isinstance(m, QuantLinear) and m.gemv_type == GGMLType.BF16 for m in bulk.modules())
    rows = DECODE_ROWS_BF16 if bf16 else DECODE_ROWS
    for module in model.modules():
        if hasattr(type(module), "decode_rows"):
            module.decode_rows = rows
    return rows


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """x [M, k_in] @ W.T [M, n_out] float32 for W packed in the kernels' layout: the GEMV kernel in a decode pass
    (outside a pass: up to DECODE_ROWS rows), the row-invariant GEMM in a prefill pass (prefill_pass)."""
    if takes_gemv_rows(x.shape[0], DECODE_ROWS):
        return kernels.gemv(x.float().contiguous(), packed, n_out, k_in, ggml_type)
    return kernels.linear(x, packed, n_out, k_in, ggml_type)


def _one_pass(x: torch.Tensor, linears) -> bool:
    """Several packed layers of one type can take x in one kernel pass."""
    return (all(lin.layout == "packed" and lin.takes_gemv(x) for lin in linears)
            and len({lin.ggml_type for lin in linears}) == 1)


def project(x: torch.Tensor, linears: list[QuantLinear]) -> list[torch.Tensor]:
    """x through several linear layers that share it as input (Q, K, V): one kernel pass over all their
    rows when they are packed in one type and x is a decode-sized batch, else one call each."""
    if len(linears) > 1 and _one_pass(x, linears):
        first = linears[0]
        return kernels.gemv_multi(x, [lin.packed for lin in linears], [lin.out_features for lin in linears],
                                  first.in_features, first.ggml_type)
    return [lin(x) for lin in linears]


def glu(x: torch.Tensor, gate: QuantLinear, up: QuantLinear, fused: bool) -> torch.Tensor:
    """gelu_tanh(gate(x)) * up(x): one kernel pass when both are packed in one type and x is decode-sized."""
    if _one_pass(x, (gate, up)):
        return kernels.gemv_glu(x, gate.packed, up.packed, gate.out_features, gate.in_features, gate.ggml_type)
    return gelu_mul(gate(x), up(x), fused)


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


def attend(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, a, fused: bool = False,
           prefill: bool = False) -> torch.Tensor:
    """Attention of a step's query rows q [T, nh, d] over the KV storage [R, nkv, d] of several sequences,
    each row seeing the keys `a` (kv_cache.Attend) gives it -> [T, nh*d] float32.

    Reference: one `attention` per sequence, on its keys gathered in position order and its rows' ranges
    as a mask. Fast mode (`fused`): a decode pass's rows in one kernels.attend call that reads the storage rows
    directly; a prefill pass (`prefill`) sequence by sequence through kernels.attend_chunk on its gathered keys,
    with zero keys (masked) in front up to a position that is a multiple of ALIGN_KEYS, so that each row's sums
    run in an order fixed by positions, whatever the chunk (row-invariant).
    """
    T = q.shape[0]
    if fused and not prefill:
        return kernels.attend(q, k_store, v_store, a)
    out = q.new_empty((T, q.shape[1] * q.shape[2]), dtype=torch.float32)
    seqs, counts = torch.unique_consecutive(a.q_seq, return_counts=True)
    row = 0
    for b, n in zip(seqs.tolist(), counts.tolist()):
        rows = slice(row, row + n)
        row += n
        seen = int(a.q_hi[rows].max())                      # the sequence's keys its rows may see: [0, seen)
        keys = a.key_rows[b, :seen]
        k, v = k_store[keys], v_store[keys]                 # [S_b, nkv, d]
        mask = a.select(torch.arange(rows.start, rows.stop)).mask()[:, :seen]     # [n, S_b]
        if not fused:
            out[rows] = attention(q[rows], k, v, mask)
            continue
        pad = int(a.first_key[b]) % ALIGN_KEYS
        if pad:
            k, v = (torch.cat([t.new_zeros((pad, *t.shape[1:])), t]) for t in (k, v))
            mask = torch.cat([mask.new_zeros((n, pad)), mask], dim=1)
        out[rows] = kernels.attend_chunk(q[rows], k, v, mask)
    return out


def experts_forward(x: torch.Tensor, gate_up, down, expert_idx: torch.Tensor, expert_w: torch.Tensor,
                    fused: bool = False, tiles=None) -> torch.Tensor:
    """Routed experts (26B-A4B), batched by expert.

    x [T, H]; gate_up(e, xs [n, H]) -> [n, 2*Im] (columns [0, Im) gate, [Im, 2Im) up) and down(e, h [n, Im])
    -> [n, H]: expert e's products; expert_idx, expert_w [T, K]. Returns sum_k w[t,k] * down_e(gelu(g) * u)
    -> [T, H]. (token, slot) pairs are grouped by expert, so the loop runs over the experts in use, never
    over tokens. `fused` (fast mode): the gelu gate runs kernels.gelu_mul. `tiles` (the expert store's,
    model/experts.py): the ascending experts in use -> groups, each ready in the store before it is yielded;
    the experts are summed in ascending order whatever the grouping.
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
            y = down(e, gelu_mul(gu[:, :im].contiguous(), gu[:, im:].contiguous(), fused))    # [n, H]
            out.index_add_(0, tokens, y * weight_of[start:start + n, None].to(x.dtype))
    return out


def embed_scale(hidden_size: int) -> float:
    """sqrt(H) in float32 (llama.cpp's choice; HF rounds it to the weight dtype, see STYLE.md)."""
    return float(np.float32(math.sqrt(hidden_size)))
