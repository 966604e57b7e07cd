"""KV storage for every running sequence (the pool) and the layout of one forward step over it.

The only module that knows the cache layout as tensors. Storage, per KV-owning layer, is
[rows, n_kv_heads, head_dim] (docs/gemma4.md §2.5-§2.6), in blocks of `block_size` rows, paged on both layer types:
- full layers: `num_blocks` blocks. Position p of a sequence lives in row
  `block_table[p // block_size] * block_size + p % block_size`.
- sliding layers: `num_sliding_blocks` blocks, addressed the same way through the sequence's
  `sliding_table`. Only the blocks some query may still see need to be held: a query at p sees
  p - window < j <= p, so a step from `start` reads blocks from (start - window + 1) // block_size on, and a
  sequence gives back the blocks behind its window as it goes (`sliding_blocks_per_seq` bounds what it
  holds). Paging both types, rather than a ring per sequence, makes every position's K/V a block that can
  outlive its sequence: the prefix cache keeps the sliding blocks of a prefix's last window, so a later
  request that starts with that prefix reads them instead of recomputing them (blocks.py).
- KV-shared layers own no rows; they read their donor's (the donor runs first in the same step).

Which blocks a sequence holds is decided elsewhere, in plain integers (blocks.py's `BlockManager`); per
step the caller describes each sequence's part with a `SeqStep`, and `KVPool.layout` turns the list into one
`StepLayout` of tensors:

    layout = pool.layout([SeqStep(...), ...])     # positions, rows to write, rows each query attends to
    kv = pool.store(layer)                        # the layer's KV source (LayerKV): k, v [rows, nkv, d] each
    kv.write(layout.write[type], k, v)            # a KV-owning layer writes its new rows (KV-shared: none)
    attention over layout.attend[type]            # each query row: a contiguous range of its sequence's keys

A sequence's keys are listed in position order (`Attend.key_rows`), so the keys a query may see -- causal,
and within the window on sliding layers -- are one range [q_lo, q_hi) of that list. No [T, S] masks. A
bidirectional span (`SeqStep.bidirectional`: one image's soft tokens on 26B/31B, docs/multimodal.md §5.3) keeps
it one range: on sliding layers a query inside the span sees up to the span's end, the window still bounding
the past; full layers stay causal. A step that holds part of a span must hold its end, since a token's output
depends on the span's later tokens; its start may lie in an earlier step only if that part's K/V were computed
with the whole span (a prefix-cache hit of the whole image: the engine never splits a span itself).

The stored dtype (vLLM's --kv-cache-dtype, `kv_cache_dtype`): the model's (float32 or bfloat16, "auto"),
bfloat16, or one of two 8-bit forms that halve the bytes a token takes and attention reads
(docs/fast-mode.md, "KV cache dtype"):
- int8 (torch.int8): each row of head_dim values -- one KV head at one position -- with a float32 scale
  amax / 127 of its own, the values round(x / scale) in [-127, 127] (GGML's Q8_0, with the row as the block).
  The row is what one query-key dot product reads, so the scale comes out of the sum: q.k = scale * (q.k_int8),
  and for V it folds into the probability (p * scale) -- one multiply per key, not per value.
- fp8_e4m3 (torch.float8_e4m3fn): the values themselves, clamped to +-448, no scale (vLLM's fp8 cache
  without calibrated scales, k_scale = v_scale = 1). A float format's relative step is the same at any
  magnitude, and K and V here are RMS-normed rows of magnitude ~1, so a scale would add bytes, not precision.
Either is quantized once, when its position is written (`LayerKV.write`), and dequantized where attention reads
it (`LayerKV.read` for the reference; the compiled kernels read the 8-bit rows and scales directly).

Sharing (a cached prefix, several choices of one prompt): a block may be in several sequences' tables,
read-only; the block manager decides when a copy is needed and the pool performs it: `copy_blocks` and
`copy_sliding_blocks` copy whole blocks' rows in every KV-owning layer of the type (copy-on-write).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from gem4.config import FULL, SLIDING, ModelConfig

BLOCK_SIZE = 16          # rows per block, both layer types

# --kv-cache-dtype (vLLM's flag and names) -> the stored dtype; "auto": the model's own (kv_cache_dtype)
KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
SCALED = torch.int8                        # the stored dtype that carries a float32 scale per row
FP8_MAX = 448.0                            # the largest finite float8_e4m3fn


def kv_cache_dtype(name: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """A --kv-cache-dtype name (KV_CACHE_DTYPES) or a storage dtype -> the dtype a pool stores; "auto": the model's."""
    if isinstance(name, torch.dtype):
        dtype = name
    elif name in KV_CACHE_DTYPES:
        dtype = KV_CACHE_DTYPES[name] or model_dtype
    else:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"a KV cache stores float32, bfloat16, float8_e4m3fn or int8, not {dtype}")
    return dtype


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The --kv-cache-dtype name of a stored dtype (float32: the reference mode's "float32")."""
    return next((n for n, d in KV_CACHE_DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float rows x [..., d] -> (stored [..., d] in `dtype`, int8: the scales [...] float32, else None).

    int8: scale = amax / 127 per row, values round(x / scale) (a row of zeros: scale 0, values 0); fp8_e4m3:
    clamped to +-FP8_MAX, then rounded to nearest. kernels/decode_ops.cpp's write_kv does the same ops (the fast
    mode's decode writes), so either path stores the same bits."""
    if dtype == SCALED:
        scale = x.abs().amax(dim=-1) / 127
        q = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).clamp(-127, 127)
        return q.to(torch.int8), scale
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype), None
    return x.to(dtype), None


@dataclass(frozen=True)
class LayerKV:
    """One KV-owning layer's storage: k, v [R, nkv, d] in the pool's dtype; int8: k_scale, v_scale [R, nkv] float32,
    the stored value of row r being k[r] * k_scale[r] (module docstring)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Everything stored per row: k, v and (int8) their scales."""
        return (self.k, self.v) if self.k_scale is None else (self.k, self.v, self.k_scale, self.v_scale)

    def write(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store float K/V [n, nkv, d] at storage rows [n], quantized to the stored dtype (`quantize`)."""
        for store, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            values, scale = quantize(x, store.dtype)
            store[rows] = values
            if scales is not None:
                scales[rows] = scale

    def gather(self, rows: torch.Tensor) -> "LayerKV":
        """The storage rows `rows` (any index shape), as stored: a prefill's keys, gathered once per sequence."""
        if self.k_scale is None:
            return LayerKV(self.k[rows], self.v[rows])
        return LayerKV(self.k[rows], self.v[rows], self.k_scale[rows], self.v_scale[rows])

    def read(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of storage rows `rows` (all: None) dequantized to float32 [..., nkv, d]: the reference attention's."""
        kv = self if rows is None else self.gather(rows)
        if kv.k_scale is None:
            return kv.k.float(), kv.v.float()
        return kv.k.float() * kv.k_scale[..., None], kv.v.float() * kv.v_scale[..., None]


@dataclass(frozen=True)
class SeqStep:
    """One sequence's part of a step, in plain integers.

    Its tokens [start, start + num_tokens) are computed; K/V of positions [0, start) are already stored.
    `logits`: how many of its last rows need logits (0: the step only fills the cache; 1: the next token;
    num_tokens: every row, as `Model.logits` asks).
    """

    start: int
    num_tokens: int
    block_table: Sequence[int]            # full layers: the blocks holding positions [0, start + num_tokens)
    sliding_table: Sequence[int]          # sliding layers: block j holds positions [j * bs, (j + 1) * bs); only
    logits: int = 1                       # the entries from (start - window + 1) // bs on are read
    bidirectional: Sequence[tuple[int, int]] = ()   # position spans [a, b) whose tokens see each other both ways
                                                    # on sliding layers; spans outside the step are ignored

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class Attend:
    """Which stored rows each query row of a step attends to, for one layer type.

    key_rows [B, S] int64: sequence b's visible keys, as rows of the layer's storage, in position order
    (padded with row 0 beyond its own count). Query row t belongs to sequence q_seq[t] and sees
    key_rows[q_seq[t], q_lo[t]:q_hi[t]].
    """

    key_rows: torch.Tensor
    q_seq: torch.Tensor                   # [T] int64
    q_lo: torch.Tensor                    # [T] int64
    q_hi: torch.Tensor                    # [T] int64
    first_key: torch.Tensor | None = None     # [B] int64: the position of key_rows[b, 0] (KVPool.layout's; the
                                              # prefill attention aligns its sums to positions with it)

    def select(self, rows: torch.Tensor) -> "Attend":
        return replace(self, q_seq=self.q_seq[rows], q_lo=self.q_lo[rows], q_hi=self.q_hi[rows])

    def mask(self) -> torch.Tensor:
        """[T, S] bool over key_rows[q_seq[t]]: the ranges as a mask (the reference attention's form)."""
        j = torch.arange(self.key_rows.shape[1], device=self.key_rows.device)[None, :]
        return (j >= self.q_lo[:, None]) & (j < self.q_hi[:, None])


@dataclass(frozen=True)
class StepLayout:
    """One forward step over the flat tokens of several sequences (sequence after sequence).

    `prefill`: the step's tokens are prompt tokens (a prefill pass), else generated ones (a decode pass: one
    token per sequence, or a few with speculation). The fast mode computes each kind with its own kernels,
    whatever the number of rows, so a token's K/V never depend on how its prompt was chunked or on its batch
    mates (model/cpu.py)."""

    positions: torch.Tensor                   # [T] int64, each token's position in its sequence
    write: dict[str, torch.Tensor]            # layer type -> [T] rows the new K/V go to
    attend: dict[str, Attend]                 # layer type -> the keys each query row sees
    logit_rows: torch.Tensor                  # [M] rows (into the T) whose logits are wanted, in order
    prefill: bool = False

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def logit_rows_only(self) -> "StepLayout":
        """The queries of the logit rows only (E2B/E4B: the KV-shared layers need no other row,
        docs/gemma4.md §2.6); the writes stay as they are, KV-shared layers write nothing."""
        rows = self.logit_rows
        return StepLayout(self.positions[rows], self.write, {t: a.select(rows) for t, a in self.attend.items()},
                          torch.arange(rows.numel(), device=rows.device), self.prefill)


def sliding_blocks_per_seq(window: int, max_chunk: int, block_size: int = BLOCK_SIZE) -> int:
    """Most sliding blocks a sequence holds at a step of up to `max_chunk` tokens: those covering positions
    [start - window + 1, start + max_chunk), wherever `start` falls in a block."""
    return -(-(window - 1 + max_chunk) // block_size) + 1


class KVPool:
    """K/V storage of all running sequences: full and sliding layers each in blocks of `block_size` rows."""

    def __init__(self, config: ModelConfig, *, num_blocks: int, num_sliding_blocks: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", block_size: int = BLOCK_SIZE):
        if min(num_blocks, num_sliding_blocks, block_size) < 1:
            raise ValueError(f"num_blocks ({num_blocks}), num_sliding_blocks ({num_sliding_blocks}) and "
                             f"block_size ({block_size}) must be >= 1")
        self.config = config
        self.num_blocks = num_blocks
        self.num_sliding_blocks = num_sliding_blocks
        self.block_size = block_size
        self.window = config.sliding_window
        self.dtype = kv_cache_dtype(dtype, dtype)         # what it stores (module docstring)
        self.device = torch.device(device)
        self._kv: dict[int, LayerKV] = {}                 # owning layer -> its storage
        for spec in config.layers:
            if spec.owns_kv:
                rows = (num_sliding_blocks if spec.is_sliding else num_blocks) * block_size
                shape = (rows, spec.n_kv_heads, spec.head_dim)
                # uninitialised: a row is only ever read after its sequence wrote it, and untouched pages
                # cost no memory, so the pool's memory grows with the tokens actually held
                k, v = (torch.empty(shape, dtype=dtype, device=self.device) for _ in range(2))
                scales = (torch.empty(shape[:2], dtype=torch.float32, device=self.device) for _ in range(2)) \
                    if dtype == SCALED else ()
                self._kv[spec.index] = LayerKV(k, v, *scales)

    def store(self, layer: int) -> LayerKV:
        """The storage that `layer` writes (if it owns KV) and reads: its KV source's."""
        return self._kv[self.config.layers[layer].kv_source]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grown(self, num_blocks: int, num_sliding_blocks: int) -> "KVPool":
        """A pool of `num_blocks` full and `num_sliding_blocks` sliding blocks (no fewer than this one's) holding
        this one's rows where they are."""
        if num_blocks < self.num_blocks or num_sliding_blocks < self.num_sliding_blocks:
            raise ValueError(f"a pool of {self.num_blocks} blocks and {self.num_sliding_blocks} sliding blocks "
                             f"cannot shrink to {num_blocks} and {num_sliding_blocks}")
        new = KVPool(self.config, num_blocks=num_blocks, num_sliding_blocks=num_sliding_blocks, dtype=self.dtype,
                     device=self.device, block_size=self.block_size)
        for layer, kv in self._kv.items():
            for old, grown in zip(kv.tensors(), new._kv[layer].tensors()):
                grown[:old.shape[0]] = old
        return new

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """For each (src, dst): block dst's rows become block src's, in every KV-owning full layer. Every
        source is read before any destination is written."""
        self._copy(pairs, self.num_blocks, sliding=False)

    def copy_sliding_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """`copy_blocks` for the sliding layers' blocks."""
        self._copy(pairs, self.num_sliding_blocks, sliding=True)

    def _copy(self, pairs, count: int, *, sliding: bool) -> None:
        if not pairs:
            return
        what = "sliding block" if sliding else "block"
        ids = [i for pair in pairs for i in pair]
        bad = next((i for i in ids if not 0 <= i < count), None)
        if bad is not None:
            raise ValueError(f"{what} {bad} is not in [0, {count})")
        dsts = [d for _, d in pairs]
        if len(set(dsts)) != len(dsts):
            raise ValueError(f"a {what} is the destination of two copies: {pairs}")
        offsets = torch.arange(self.block_size, device=self.device)
        src = (torch.tensor([a for a, _ in pairs], device=self.device)[:, None] * self.block_size + offsets).flatten()
        dst = (torch.tensor(dsts, device=self.device)[:, None] * self.block_size + offsets).flatten()
        for spec in self.config.layers:
            if spec.owns_kv and spec.is_sliding == sliding:
                for store in self._kv[spec.index].tensors():
                    store[dst] = store[src]                         # the gather copies first

    def layout(self, seqs: Sequence[SeqStep], prefill: bool = False) -> StepLayout:
        """The tensors of one step over `seqs` (their tokens laid out one sequence after another); `prefill`:
        the tokens are prompt tokens (StepLayout)."""
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        dev, bs, window = self.device, self.block_size, self.window
        positions, write_full, write_slide, logit_rows = [], [], [], []
        full_keys, slide_keys = [], []
        q_seq, full_hi, slide_lo, slide_hi, slide_first = [], [], [], [], []
        row = 0
        for b, s in enumerate(seqs):
            if s.num_tokens < 1 or s.start < 0:
                raise ValueError(f"a step holds at least one token of a sequence from a position >= 0, got "
                                 f"{s.num_tokens} from position {s.start}")
            if not 0 <= s.logits <= s.num_tokens:
                raise ValueError(f"logits of {s.logits} rows asked of a {s.num_tokens}-token step")
            first = max(0, s.start - window + 1)                  # the oldest position a query of the step sees
            table = self._table(s.block_table, 0, self.blocks_for(s.end), self.num_blocks, s.end, "block")
            slide = self._table(s.sliding_table, first // bs, self.blocks_for(s.end), self.num_sliding_blocks,
                                s.end, "sliding block")
            pos = torch.arange(s.start, s.end, device=dev)                        # [n]
            # full layers: every position so far, in order
            every = torch.arange(s.end, device=dev)
            full_keys.append(table[every // bs] * bs + every % bs)
            write_full.append(full_keys[-1][s.start:])
            full_hi.append(pos + 1)
            # sliding layers: the positions some query of this step may see, from the oldest one on
            seen = torch.arange(first, s.end, device=dev)
            slide_keys.append(slide[seen // bs - first // bs] * bs + seen % bs)
            write_slide.append(slide_keys[-1][s.start - first:])
            slide_lo.append(torch.clamp(pos - window + 1, min=first) - first)
            slide_hi.append(self._span_ends(pos, s) - first)
            slide_first.append(first)
            positions.append(pos)
            q_seq.append(torch.full((s.num_tokens,), b, dtype=torch.long, device=dev))
            logit_rows.append(torch.arange(row + s.num_tokens - s.logits, row + s.num_tokens, device=dev))
            row += s.num_tokens
        q_seq_t = torch.cat(q_seq)
        attend = {
            FULL: Attend(_pad(full_keys), q_seq_t, torch.zeros_like(q_seq_t), torch.cat(full_hi),
                         torch.zeros(len(seqs), dtype=torch.long, device=dev)),
            SLIDING: Attend(_pad(slide_keys), q_seq_t, torch.cat(slide_lo), torch.cat(slide_hi),
                            torch.tensor(slide_first, dtype=torch.long, device=dev)),
        }
        return StepLayout(torch.cat(positions), {FULL: torch.cat(write_full), SLIDING: torch.cat(write_slide)},
                          attend, torch.cat(logit_rows), prefill)

    @staticmethod
    def _span_ends(pos: torch.Tensor, s: SeqStep) -> torch.Tensor:
        """pos [n] -> one past the last position each query sees on sliding layers: itself, or the end of its
        bidirectional span."""
        hi = pos + 1
        for a, b in s.bidirectional:
            if b <= s.start or a >= s.end or b - a < 2:
                continue
            if b > s.end:
                raise ValueError(f"the bidirectional span [{a}, {b}) is split by the step's tokens "
                                 f"[{s.start}, {s.end}): its rest must be computed in the same step")
            inside = (pos >= a) & (pos < b)
            hi = torch.where(inside, torch.full_like(hi, b), hi)
        return hi

    def _table(self, table: Sequence[int], lo: int, hi: int, count: int, end: int, what: str) -> torch.Tensor:
        """Entries [lo, hi) of a block table as a tensor, checked: [hi - lo] int64."""
        if len(table) < hi:
            raise ValueError(f"{len(table)} {what}s cannot hold {end} positions")
        out = torch.tensor(list(table[lo:hi]), dtype=torch.long, device=self.device)
        if out.numel() and (int(out.min()) < 0 or int(out.max()) >= count):
            raise ValueError(f"{what} ids must be in [0, {count}), got {list(table[lo:hi])}")
        return out


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence key rows -> [B, S] (row 0 beyond each sequence's count; the ranges never reach it)."""
    out = torch.zeros((len(rows), max(r.numel() for r in rows)), dtype=torch.long, device=rows[0].device)
    for b, r in enumerate(rows):
        out[b, :r.numel()] = r
    return out


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """Cache bytes one token adds, per layer type, counting only layers that own KV (K and V both stored, and
    for int8 their float32 scale per KV head).

    Sliding layers hold only the positions a query may still see (`sliding_blocks_per_seq`).
    """
    size = torch.empty((), dtype=dtype).element_size()
    scale = 4 if dtype == SCALED else 0
    out = {SLIDING: 0, FULL: 0}
    for spec in config.layers:
        if spec.owns_kv:
            out[spec.layer_type] += 2 * spec.n_kv_heads * (spec.head_dim * size + scale)
    return out
