"""The Gemma 4 assistant (`gemma4_assistant`, the MTP drafter): config, module tree, one drafting step.

docs/gemma4.md §5. The assistant is a small Gemma 4 decoder without K/V of its own: every layer is a
query-only attention over the TARGET's cache. One drafting step for a sequence whose next token `tok`
(at position p) the target has not processed yet:

    e      = target.embed(tok)                         # the target's table and sqrt(Hb) scale  [Hb]
    z      = pre_projection(concat(e, h_prev))         # embedding first                        [Ha]
    layer i (type t): q from z at position p, attending the target's K/V of type t (below),
                      then the §2.4 layer without PLE/MoE, keeping layer_scalar
    hn     = norm(z)
    logits = hn @ embed_tokens.T                       # no softcap in either reference         [V]
             (or the centroid-masked head, when the checkpoint has one)
    h_next = post_projection(hn)                       # fed back as h_prev for the next step   [Hb]

`h_prev` is the target's final-normed hidden state of the token before `tok` (Model.forward(...,
hidden=True)), then the assistant's own `h_next`. All K drafts of one round use the same position p.

Where transformers and llama.cpp differ, the choices are listed in docs/gemma4.md §5.8.

Which K/V (docs/gemma4.md §5.4): for each layer type, what the target's LAST layer of that type attends
to (its KV source: E2B/E4B's donor layers, the last sliding / full layer elsewhere), read through
`KVPool.store(layer)`. Which positions, for a query at p (p itself is not in the cache yet):
    full layers       [0, p)
    sliding layers    [p - W - 1, p)  -- the last W + 1 positions: transformers' bidirectional sliding mask
                      flipped on the key axis (|q - kv| <= W). llama.cpp keeps only p - j < W, the last
                      W - 1. We follow transformers, the oracle; the difference only moves the window edge.
The rows come from `KVPool.layout` (the one owner of the cache layout), see `draft_view`.

Draft slack: the target's own next step from p reads sliding positions from p - W + 1 on; a draft at p
reads two more, from p - W - 1. So while a sequence speculates, the sliding blocks it may give back are
those wholly before p - W - 1 (block index < (p - W - 1) // block_size), not before p - W + 1. Rollback
needs nothing else: the rows of rejected drafts lie at positions >= p, which no draft view and no query
of the next step reads before the next verification overwrites them; the full layers' blocks past the
new length can be freed or kept.

Centroid-masked head (transformers only, `use_ordered_embeddings`; E2B/E4B assistants): the top-k of
`centroids(hn)` pick k clusters of V / C canonical token ids (`token_ordering`), logits are computed for
those ids only and every other token gets (smallest selected logit - 1). transformers takes that minimum
over the whole batch; we take it per row, so a row's drafts do not depend on its batch (equal for one
row). llama.cpp drops this head (its converter skips the tensors) and always scores the full vocabulary;
a GGUF assistant therefore runs the full head. Either way the target verifies every draft.

Precision as in model/gemma4.py: activations, norms, RoPE and softmax in float32, matmul inputs in the
weight dtype; the fast mode's backend (model/cpu.py) runs the compiled norm / attention / GEMV kernels.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gem4.config import FULL, LAYER_TYPES, SLIDING, ConfigError, ModelConfig
from gem4.kv_cache import Attend, KVPool, LayerKV, SeqStep
from gem4.model.gemma4 import MLP
from gem4.model.layers import QuantLinear, RMSNorm, attend, rope_cos_sin


# ---- config ----

@dataclass(frozen=True)
class AssistantLayer:
    index: int
    layer_type: str           # SLIDING | FULL: which of the target's K/V it reads
    n_heads: int              # query heads
    n_kv_heads: int | None    # KV heads of the target K/V it reads (checked against the target); None where
                              # the file does not say (a GGUF without head_count_kv: the target's, as in llama.cpp)
    head_dim: int
    intermediate_size: int

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == SLIDING


@dataclass(frozen=True)
class CentroidHead:
    """transformers' masked embedding head (use_ordered_embeddings)."""
    num_centroids: int        # C clusters of vocab_size / C tokens each
    top_k: int                # clusters scored per draft step (centroid_intermediate_top_k)


@dataclass(frozen=True)
class AssistantConfig:
    """The assistant as its checkpoint describes it; built by weights/assistant.py, never from defaults."""
    vocab_size: int
    hidden_size: int                      # Ha, the assistant's width
    backbone_hidden_size: int             # Hb, the target's width (its embedding and hidden state)
    layers: tuple[AssistantLayer, ...]
    sliding_window: int
    rms_norm_eps: float
    rope_inv_freq: tuple[tuple[str, tuple[float, ...]], ...]   # as ModelConfig.rope_inv_freq
    centroids: CentroidHead | None        # None: full-vocabulary head

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def inv_freq(self, layer_type: str) -> tuple[float, ...]:
        return dict(self.rope_inv_freq)[layer_type]

    @property
    def layer_types(self) -> tuple[str, ...]:
        """The target K/V types the assistant reads, in LAYER_TYPES order."""
        used = {s.layer_type for s in self.layers}
        return tuple(t for t in LAYER_TYPES if t in used)

    @classmethod
    def from_text_config(cls, text: ModelConfig, backbone_hidden_size: int, centroids: CentroidHead | None,
                         kv_heads_known: bool = True) -> "AssistantConfig":
        """From the decoder's geometry as a reader validated it (gem4.config.build_config with no layer
        shared, since every assistant layer reads another model's K/V); refuses what an assistant cannot
        have (docs/gemma4.md §5.1: no per-layer embeddings, no experts)."""
        if text.ple_dim:
            raise ConfigError("an assistant has no per-layer embeddings (hidden_size_per_layer_input must be 0)",
                              "ple_dim")
        if text.moe is not None:
            raise ConfigError("an assistant has no experts (enable_moe_block must be false)", "moe")
        if not text.tie_word_embeddings:
            raise ConfigError("an assistant's head is its embedding table (tie_word_embeddings must be true)")
        Hb = backbone_hidden_size
        if not isinstance(Hb, int) or isinstance(Hb, bool) or Hb < 1:
            raise ConfigError(f"backbone_hidden_size must be a positive integer, got {backbone_hidden_size!r}",
                              "backbone_hidden_size")
        if centroids is not None:
            c, k = centroids.num_centroids, centroids.top_k
            if not (isinstance(c, int) and isinstance(k, int) and 1 <= k <= c and text.vocab_size % c == 0):
                raise ConfigError(f"centroid head: num_centroids={c!r} must divide vocab_size={text.vocab_size} and "
                                  f"1 <= centroid_intermediate_top_k={k!r} <= num_centroids", "centroids")
        layers = tuple(AssistantLayer(s.index, s.layer_type, s.n_heads, s.n_kv_heads if kv_heads_known else None,
                                      s.head_dim, s.intermediate_size) for s in text.layers)
        return cls(vocab_size=text.vocab_size, hidden_size=text.hidden_size, backbone_hidden_size=backbone_hidden_size,
                   layers=layers, sliding_window=text.sliding_window, rms_norm_eps=text.rms_norm_eps,
                   rope_inv_freq=text.rope_inv_freq, centroids=centroids)


def target_kv_layers(target: ModelConfig) -> dict[str, int]:
    """Layer type -> the target's last layer of that type; `KVPool.store` of it is the K/V the assistant's
    layers of that type read (its KV source: the donor on E2B/E4B, docs/gemma4.md §5.4)."""
    return {s.layer_type: s.index for s in target.layers}


def check_against_target(config: AssistantConfig, target: ModelConfig) -> None:
    """Refuse an assistant that does not belong to `target`, naming the mismatch (ConfigError)."""
    if config.backbone_hidden_size != target.hidden_size:
        raise ConfigError(f"the assistant drafts for a backbone of width {config.backbone_hidden_size} "
                          f"(backbone_hidden_size), the target model's hidden size is {target.hidden_size}",
                          "backbone_hidden_size")
    if config.vocab_size != target.vocab_size:
        raise ConfigError(f"the assistant's vocabulary has {config.vocab_size} tokens, the target's "
                          f"{target.vocab_size}", "vocab_size")
    if config.sliding_window != target.sliding_window:
        raise ConfigError(f"the assistant's sliding window {config.sliding_window} differs from the target's "
                          f"{target.sliding_window}", "sliding_window")
    last = target_kv_layers(target)
    for s in config.layers:
        if s.layer_type not in last:
            raise ConfigError(f"assistant layer {s.index} ({s.layer_type}) reads K/V of a type the target "
                              f"does not have", "layer_types")
        t = target.layers[target.layers[last[s.layer_type]].kv_source]
        if s.head_dim != t.head_dim or s.n_kv_heads not in (None, t.n_kv_heads) or s.n_heads % t.n_kv_heads:
            raise ConfigError(f"assistant layer {s.index} ({s.layer_type}) has {s.n_heads} query heads of {s.head_dim} "
                              f"and expects {s.n_kv_heads or 'any number of'} K/V heads; the target's layer {t.index} "
                              f"stores {t.n_kv_heads} x {t.head_dim}", "head_dims")


# ---- which target rows a draft step reads ----

@dataclass(frozen=True)
class DraftSeq:
    """One sequence of a draft step, in plain integers: the position p of the token being drafted from
    (the target has stored [0, p)), and where its K/V live (as in kv_cache.SeqStep). Of `sliding_table`
    only the entries from (p - W - 1) // block_size on are read."""
    position: int
    block_table: Sequence[int]
    sliding_table: Sequence[int]


@dataclass(frozen=True)
class DraftView:
    positions: torch.Tensor               # [B] int64, p of each sequence
    attend: dict[str, Attend]             # layer type -> query b sees key_rows[b, q_lo[b]:q_hi[b]]


def sliding_reads_from(position: int, window: int) -> int:
    """The oldest position a draft at `position` reads on sliding layers: position - W - 1 (the last W + 1,
    transformers' mask), two before the target's own step from there (position - W + 1). While a sequence
    speculates, its sliding blocks before this position's block are the ones it may give back."""
    return max(0, position - window - 1)


def draft_view(pool: KVPool, seqs: Sequence[DraftSeq]) -> DraftView:
    """The target rows each sequence's draft query at p reads (module docstring): full [0, p), sliding
    [p - W - 1, p). Taken from the pool's own layout of a step over the last two stored positions
    (p - 2, p - 1): the keys it lists for a sequence are exactly those, from 0 on full layers and from
    (p - 2) - W + 1 = sliding_reads_from(p) on sliding ones; the draft query sees the whole list (the
    layout's row p - 1 ends where it does, q_hi, and starts one later on sliding layers)."""
    if not seqs:
        raise ValueError("a draft step needs at least one sequence")
    if any(s.position < 1 for s in seqs):
        raise ValueError("a draft needs at least one stored position (p >= 1)")
    steps = [SeqStep(start=max(0, s.position - 2), num_tokens=min(2, s.position), block_table=s.block_table,
                     sliding_table=s.sliding_table, logits=0) for s in seqs]
    layout = pool.layout(steps)
    dev = pool.device
    last = torch.tensor([st.num_tokens for st in steps], device=dev).cumsum(0) - 1     # [B] row of p - 1
    b = torch.arange(len(seqs), device=dev)
    full, sliding = layout.attend[FULL], layout.attend[SLIDING]
    view = {FULL: Attend(full.key_rows, b, torch.zeros_like(b), full.q_hi[last]),
            SLIDING: Attend(sliding.key_rows, b, torch.zeros_like(b), sliding.q_hi[last])}
    return DraftView(layout.positions[last] + 1, view)


# ---- modules ----

class AssistantAttention(nn.Module):
    """Query-only attention: q from the assistant, K/V from the target's store (no k/v weights). A draft step
    is a decode pass (one query row a sequence): every layer here is told prefill=False."""

    def __init__(self, config: AssistantConfig, spec: AssistantLayer):
        super().__init__()
        self.spec = spec
        self.q_proj = QuantLinear(config.hidden_size, spec.n_heads * spec.head_dim)
        self.q_norm = RMSNorm(spec.head_dim, config.rms_norm_eps)
        self.o_proj = QuantLinear(spec.n_heads * spec.head_dim, config.hidden_size)

    def attend(self, q: torch.Tensor, kv: LayerKV, a: Attend) -> torch.Tensor:
        return attend(q, kv, a, prefill=False)

    def forward(self, h: torch.Tensor, rope, kv: LayerKV, a: Attend) -> torch.Tensor:
        spec, B = self.spec, h.shape[0]
        q = self.q_norm.with_rope(self.q_proj(h, False).view(B, spec.n_heads, spec.head_dim), *rope)   # [B, nh, d]
        return self.o_proj(self.attend(q, kv, a), False)                                        # [B, Ha]


class AssistantLayerModule(nn.Module):
    """docs/gemma4.md §2.4 without PLE and experts; the attention reads the target's K/V."""

    def __init__(self, config: AssistantConfig, spec: AssistantLayer):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.spec = spec
        self.self_attn = AssistantAttention(config, spec)
        self.mlp = MLP(H, spec.intermediate_size)                 # the target's MLP module
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)

    def forward(self, x: torch.Tensor, rope, kv, a: Attend) -> torch.Tensor:
        x = self.post_attention_layernorm.add_to(x, self.self_attn(self.input_layernorm(x), rope, kv, a))
        x = self.post_feedforward_layernorm.add_to(x, self.mlp(self.pre_feedforward_layernorm(x), False))
        return x * self.layer_scalar


class MaskedEmbedding(nn.Module):
    """The centroid-masked head (transformers' Gemma4AssistantMaskedEmbedder; see the module docstring)."""

    def __init__(self, config: AssistantConfig):
        super().__init__()
        c = config.centroids
        self.top_k = c.top_k
        self.centroids = QuantLinear(config.hidden_size, c.num_centroids)
        # cluster j holds canonical token ids token_ordering[j * V/C : (j + 1) * V/C] (a permutation of [0, V))
        self.register_buffer("token_ordering", torch.empty(config.vocab_size, dtype=torch.long))

    def forward(self, hn: torch.Tensor, table: QuantLinear) -> torch.Tensor:
        """hn [B, Ha], table: the [V, Ha] embedding -> logits [B, V] float32."""
        B, C, V = hn.shape[0], self.centroids.out_features, self.token_ordering.numel()
        top = self.centroids(hn, False).topk(self.top_k, dim=-1).indices            # [B, k]
        ids = self.token_ordering.view(C, V // C)[top].reshape(B, -1)                # [B, k*V/C]
        rows = table.rows(ids.reshape(-1)).view(B, ids.shape[1], -1)                 # [B, k*V/C, Ha] float32
        picked = torch.bmm(rows, hn.float()[:, :, None]).squeeze(-1)                 # [B, k*V/C]
        out = (picked.amin(dim=-1, keepdim=True) - 1.0).expand(B, V).clone()
        return out.scatter_(-1, ids, picked)


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor                  # [B, K] int64, greedy drafts
    logits: torch.Tensor | None = None    # [B, K, V] float32, each step's logits (keep_logits=True only)


class Assistant(nn.Module):
    """The MTP drafter. Parameter names are its canonical tensor names (HF names without `model.`)."""

    def __init__(self, config: AssistantConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.backend = "torch"                 # which backend computes it (model/backends.py; set once at load)
        Ha, Hb = config.hidden_size, config.backbone_hidden_size
        self.embed_tokens = QuantLinear(Ha, config.vocab_size)       # [V, Ha]: the head only
        self.pre_projection = QuantLinear(2 * Hb, Ha)
        self.post_projection = QuantLinear(Ha, Hb)
        self.layers = nn.ModuleList(AssistantLayerModule(config, s) for s in config.layers)
        self.norm = RMSNorm(Ha, config.rms_norm_eps)
        if config.centroids is not None:                             # E2B/E4B assistants (transformers)
            self.masked_embedding = MaskedEmbedding(config)
        for layer_type, inv_freq in config.rope_inv_freq:
            self.register_buffer(f"inv_freq_{layer_type}", torch.tensor(inv_freq, dtype=torch.float32),
                                 persistent=False)
        self.kv_layers: dict[str, int] = {}                          # set by bind_target

    def bind_target(self, target: ModelConfig) -> None:
        """Check the assistant against its target and remember which target layers' K/V it reads."""
        check_against_target(self.config, target)
        self.kv_layers = {t: i for t, i in target_kv_layers(target).items() if t in self.config.layer_types}

    @torch.inference_mode()
    def forward(self, embedded: torch.Tensor, h_prev: torch.Tensor, view: DraftView, pool: KVPool,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step for B sequences.

        embedded [B, Hb]: the target's scaled embedding of each sequence's last token (Model.embed);
        h_prev [B, Hb]: the target's final-normed hidden state of the token before it, or this
        assistant's previous h_next. -> (logits [B, V] float32, h_next [B, Hb] float32).
        """
        if not self.kv_layers:
            raise RuntimeError("the assistant is not bound to a target (bind_target / load_assistant(target=...))")
        z = self.pre_projection(torch.cat([embedded.float(), h_prev.float()], dim=-1), False)   # [B, Ha]; no sqrt(Ha)
        ropes = {t: rope_cos_sin(view.positions, getattr(self, f"inv_freq_{t}")) for t in self.config.layer_types}
        stores = {t: pool.store(i) for t, i in self.kv_layers.items()}
        for layer in self.layers:
            t = layer.spec.layer_type
            z = layer(z, ropes[t], stores[t], view.attend[t])
        hn = self.norm(z)                                                                # [B, Ha]
        if self.config.centroids is not None:
            logits = self.masked_embedding(hn, self.embed_tokens)
        else:
            logits = self.embed_tokens(hn, False).float()                                # no softcap (§5.7)
        return logits, self.post_projection(hn, False).float()

    @torch.inference_mode()
    def draft(self, target, tokens: torch.Tensor, hidden: torch.Tensor, view: DraftView, pool: KVPool,
              num_tokens: int, keep_logits: bool = False) -> Draft:
        """`num_tokens` greedy drafts per sequence (transformers and llama.cpp both take the argmax), all at
        the positions of `view`. tokens [B]: each sequence's last token (not yet in the target's cache);
        hidden [B, Hb]: the target's final-normed hidden state of the token before it. `target` is the
        gem4 Model whose embedding table the assistant reads. The drafts are deterministic, so verification
        treats them as one-hot q (engine/speculative.verify without draft_probs)."""
        out_tokens, out_logits = [], []
        tok, h = tokens, hidden
        for _ in range(num_tokens):
            logits, h = self.forward(target.embed(tok), h, view, pool)
            tok = logits.argmax(dim=-1)                                                  # [B], ties to the lowest id
            out_tokens.append(tok)
            if keep_logits:
                out_logits.append(logits)
        B, V = tokens.shape[0], self.config.vocab_size
        if not out_tokens:
            return Draft(tokens.new_empty((B, 0)), torch.empty((B, 0, V)) if keep_logits else None)
        return Draft(torch.stack(out_tokens, dim=1), torch.stack(out_logits, dim=1) if keep_logits else None)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device
