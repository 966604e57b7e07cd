"""The Gemma 4 text decoder (docs/gemma4.md §2), one explicit layer loop for every variant.

Parameter names are the canonical tensor names every loader maps to (HF names without the
`model.` prefix, e.g. `layers.3.self_attn.q_proj.weight`); the module tree is the one owner of
which tensors a config needs and their shapes.

A step computes the new tokens of one or several sequences at once: activations are [T, H] for its T
tokens, laid out one sequence after another; `StepLayout` (kv_cache.py) tells each layer where the new
K/V go and which stored keys each row sees. Every linear layer runs once per step over all T rows. A lone
sequence is a step of one (`Model.extend` with a `KVCache`).

Media (docs/multimodal.md §5): a step may carry soft tokens -- an image's embeddings from its tower -- that
replace the rows of their placeholder tokens (`StepEmbeds`). They are not scaled by sqrt(H) as token embeddings
are, and the per-layer token table (E2B/E4B) is looked up with pad id 0 at their rows; the per-layer projection
sees the merged rows. Which keys their queries see (one image's tokens both ways on sliding layers, where the
config says so) is the step's layout (kv_cache `SeqStep.bidirectional`), not this file's.

This file is the reference and knows no backend: a backend chosen at load (model/backends.py) replaces its
modules by subclasses (the CPU kernels: model/cpu.py) and installs per-layer plans. The only thing a forward
tells its layers beyond the data is the step's `StepLayout` (prefill or decode among it).

Precision: the residual stream, norms, RoPE, softmax and router run in float32 in every mode. The
weight dtype (float32, or bfloat16 in "bfloat16" mode) is what matmul inputs are rounded to (products
accumulate in float32) and what the KV cache stores unless told otherwise (int8 / fp8: kv_cache/pool.py) --
the llama.cpp arrangement, which keeps bf16 drift vs the float32 path small (NMSE ~1e-4 on the test fixtures)
where bf16 residuals would not.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gem4.config import ModelConfig, LayerSpec
from gem4.kv_cache import KVCache, KVPool, LayerKV, StepLayout, kv_cache_dtype
from gem4.model.experts import Resident
from gem4.model.layers import (
    GeluMul, QuantLinear, RMSNorm, Softcap, attend, embed_scale, experts_forward, rms_norm, rope_cos_sin,
)
from gem4.ggml import GGMLType

DECODE_ROWS = 32   # the most rows of a decode pass: the engine packs generated tokens into passes of this size
PAD_ID = 0         # the token id the per-layer table is looked up with at media rows


@dataclass(frozen=True)
class MediaItem:
    """One media item of a sequence -- an image (an audio clip, a video frame: the same shape) -- as the text
    model takes it: soft tokens for the placeholder tokens at positions [start, start + n)."""

    start: int                  # the position of its first soft token in its sequence
    embeds: torch.Tensor        # [n, H] float32, already in the text width (a tower's output)
    bidirectional: bool         # its tokens see each other both ways on sliding layers (26B/31B images)

    @property
    def end(self) -> int:
        return self.start + self.embeds.shape[0]


@dataclass(frozen=True)
class StepEmbeds:
    """The soft tokens of one step: rows [K] of the step's T tokens and their embeddings [K, H]."""

    rows: torch.Tensor
    embeds: torch.Tensor

    @classmethod
    def of(cls, media: Sequence[MediaItem], start: int, num_tokens: int, row: int = 0) -> "StepEmbeds | None":
        """The rows of `media` (one sequence's) that fall in its tokens [start, start + num_tokens), which are the
        step's rows from `row` on; None when none do."""
        rows, embeds = [], []
        for item in media:
            lo, hi = max(item.start, start), min(item.end, start + num_tokens)
            if lo < hi:
                rows.append(torch.arange(lo - start + row, hi - start + row))
                embeds.append(item.embeds[lo - item.start:hi - item.start])
        if not rows:
            return None
        return cls(torch.cat(rows), torch.cat(embeds))

    @classmethod
    def join(cls, parts: Sequence["StepEmbeds | None"]) -> "StepEmbeds | None":
        """Several sequences' parts of one step as one."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return cls(torch.cat([p.rows for p in parts]), torch.cat([p.embeds for p in parts]))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec):
        super().__init__()
        H, d = config.hidden_size, spec.head_dim
        self.spec = spec
        self.eps = config.rms_norm_eps
        self.q_proj = QuantLinear(H, spec.n_heads * d)
        self.q_norm = RMSNorm(d, self.eps)
        self.o_proj = QuantLinear(spec.n_heads * d, H)
        if spec.owns_kv:                       # E2B/E4B: KV-shared layers have no k/v weights
            self.k_proj = QuantLinear(H, spec.n_kv_heads * d)
            self.k_norm = RMSNorm(d, self.eps)
            self.v_norm = RMSNorm(d, self.eps, scale=False)      # no weight, no rope
            if not spec.k_eq_v:                # 12B/31B/26B full layers: V is the raw K projection
                self.v_proj = QuantLinear(H, spec.n_kv_heads * d)

    def projections(self) -> list[QuantLinear]:
        """The layers that read the attention's input: Q, then K and V where the layer owns its KV."""
        if not self.spec.owns_kv:
            return [self.q_proj]
        return [self.q_proj, self.k_proj] if self.spec.k_eq_v else [self.q_proj, self.k_proj, self.v_proj]

    def project(self, h: torch.Tensor, prefill: bool) -> list[torch.Tensor]:
        """h through Q (and K, V): one output each."""
        return [lin(h, prefill) for lin in self.projections()]

    def attend(self, q: torch.Tensor, kv: LayerKV, step: StepLayout) -> torch.Tensor:
        return attend(q, kv, step.attend[self.spec.layer_type], step.prefill)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], step: StepLayout, pool: KVPool) -> torch.Tensor:
        spec, T = self.spec, h.shape[0]
        cos, sin = rope
        qkv = self.project(h, step.prefill)
        q = self.q_norm.with_rope(qkv[0].view(T, spec.n_heads, spec.head_dim), cos, sin)    # [T, nh, d]
        if spec.owns_kv:
            k_raw = qkv[1].view(T, spec.n_kv_heads, spec.head_dim)                 # [T, nkv, d]
            v_raw = k_raw if spec.k_eq_v else qkv[2].view(T, spec.n_kv_heads, spec.head_dim)   # k_eq_v: V = raw K
            k = self.k_norm.with_rope(k_raw, cos, sin)
            v = self.v_norm(v_raw)
        kv = pool.store(spec.index)                                               # [R, nkv, d]: every sequence's rows
        if spec.owns_kv:                       # E2B/E4B: a KV-shared layer reads what its donor wrote this step
            kv.write(step.write[spec.layer_type], k, v)                          # in the pool's dtype (int8: + scales)
        out = self.attend(q, kv, step)                                            # [T, nh*d]
        return self.o_proj(out, step.prefill)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = QuantLinear(hidden, inner)
        self.up_proj = QuantLinear(hidden, inner)
        self.down_proj = QuantLinear(inner, hidden)
        self.act = GeluMul()

    def glu(self, x: torch.Tensor, prefill: bool | None) -> torch.Tensor:
        """gelu_tanh(gate(x)) * up(x)."""
        return self.act(self.gate_proj(x, prefill), self.up_proj(x, prefill))

    def forward(self, x: torch.Tensor, prefill: bool | None = None) -> torch.Tensor:
        return self.down_proj(self.glu(x, prefill), prefill)


class Router(nn.Module):
    """26B-A4B router (docs/gemma4.md §2.9): reads the un-normed residual."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        H, E = config.hidden_size, config.moe.num_experts
        self.top_k = config.moe.top_k
        self.eps = config.rms_norm_eps
        self.proj = QuantLinear(H, E)
        self.scale = nn.Parameter(torch.empty(H), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(E), requires_grad=False)
        self.root_size = H ** -0.5

    def forward(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """r [T, H] -> expert ids [T, K], weights [T, K] (float32)."""
        t = rms_norm(r, None, self.eps) * self.scale * self.root_size             # [T, H]
        # one row at a time: a float32 GEMM rounds a row differently with other rows beside it, and a token's
        # experts must not depend on its batch mates or its chunk (batch invariance, exact prefix-cache hits)
        logits = torch.cat([self.proj(row) for row in t.split(1)]) if t.shape[0] > 1 else self.proj(t)   # [T, E]
        probs = torch.softmax(logits, dim=-1)                                     # over all experts first
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)                          # renormalise the top-K
        return idx, weights * self.per_expert_scale[idx]


class Experts(nn.Module):
    """26B-A4B routed experts: gate_up_proj [E, 2*Im, H] and down_proj [E, H, Im] in the weight dtype (a backend
    may keep them packed: model/cpu.py). The weights are a slab of slots and `store` (model/experts.py) says which
    slot holds expert e: every expert in its own slot (Resident), or N slots filled from the GGUF on demand
    (SlotCache, `stream`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe, H = config.moe, config.hidden_size
        self.num_experts = moe.num_experts
        self.dims = {"gate_up_proj": (2 * moe.intermediate_size, H), "down_proj": (H, moe.intermediate_size)}  # rows, k
        for name, dims in self.dims.items():
            setattr(self, name, nn.Parameter(torch.empty(moe.num_experts, *dims), requires_grad=False))
        self.packed_types: dict[str, GGMLType] = {}                # name -> type, for a backend's packed ones
        self.store = Resident()
        self.act = GeluMul()

    def stream(self, store, slots: dict[str, torch.Tensor], packed_types: dict[str, GGMLType]) -> None:
        """Load time: the weights become views of `store`'s slots, [slots, rows, ...] each (one expert as a
        backend packs it, or dense)."""
        for name, view in slots.items():
            delattr(self, name)
            self.register_buffer(name, view, persistent=False)
        self.packed_types = dict(packed_types)
        self.store = store

    def product(self, name: str, prefill: bool | None):
        """Expert e's x @ W_e.T for the weight `name`: (e, xs [n, k]) -> [n, rows] float32."""
        w, slot = getattr(self, name), self.store.slot
        return lambda e, xs: F.linear(xs.to(w.dtype), w[slot(e)]).to(xs.dtype)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, prefill: bool | None = None) -> torch.Tensor:
        return experts_forward(x, self.product("gate_up_proj", prefill), self.product("down_proj", prefill), self.act,
                               idx, weights, self.store.tiles)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.spec = spec
        self.eps = eps
        self.self_attn = Attention(config, spec)
        self.mlp = MLP(H, spec.intermediate_size)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)
        if config.moe is not None:             # 26B-A4B: dense branch + routed experts
            self.router = Router(config)
            self.experts = Experts(config)
            self.pre_feedforward_layernorm_2 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(H, eps)
        if config.ple_dim:                     # E2B/E4B: per-layer embedding input
            self.per_layer_input_gate = QuantLinear(H, config.ple_dim)
            self.per_layer_projection = QuantLinear(config.ple_dim, H)
            self.post_per_layer_input_norm = RMSNorm(H, eps)
            self.per_layer_act = GeluMul()

    def forward(self, x: torch.Tensor, ple: torch.Tensor | None, rope, step: StepLayout, pool: KVPool) -> torch.Tensor:
        prefill = step.prefill
        # attention block
        attn = self.self_attn(self.input_layernorm(x), rope, step, pool)
        x = self.post_attention_layernorm.add_to(x, attn)
        # feed-forward block
        r = x
        if hasattr(self, "experts"):           # 26B-A4B: routed first, so streamed experts load beside the dense branch
            idx, weights = self.router(r)
            self.experts.store.prefetch(idx)
        m = self.mlp(self.pre_feedforward_layernorm(r), prefill)
        if hasattr(self, "experts"):
            routed = self.experts(self.pre_feedforward_layernorm_2(r), idx, weights, prefill)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(routed)
        x = self.post_feedforward_layernorm.add_to(r, m)
        if ple is not None:                    # E2B/E4B: ple [T, P] is this layer's slice
            gated = self.per_layer_act(self.per_layer_input_gate(x, prefill), ple)
            x = self.post_per_layer_input_norm.add_to(x, self.per_layer_projection(gated, prefill))
        return x * self.layer_scalar


class Model(nn.Module):
    """Gemma 4 text model. `Model.logits(ids)` is the public full-sequence entry point."""

    expert_cache = None    # 26B-A4B with streamed experts: weights/expert_stream.py ExpertFile (slots, stats)

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        H, P = config.hidden_size, config.ple_dim
        self.config = config
        self.dtype = dtype                     # weight / KV-cache dtype; activations are float32
        self.backend = "torch"                 # which backend computes it (model/backends.py; set once at load)
        self.decode_rows = DECODE_ROWS         # the most rows of a decode pass (engine/runner.py); a backend may
                                               # set its own at load
        self.vision = None                     # the vision tower (model/vision.py VisionModel), bound at load where the
                                               # checkpoint has one; a submodule then
        # token table [V, H]: looked up by rows for the input; as a linear layer it is the tied head
        self.embed_tokens = QuantLinear(H, config.vocab_size)
        self.embed_scale = embed_scale(H)
        self.layers = nn.ModuleList(DecoderLayer(config, spec) for spec in config.layers)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.final_softcap = Softcap(config.final_logit_softcap)
        self.audio = None                      # E2B/E4B: the audio tower (model/audio.py), bound by weights/audio.py
        if not config.tie_word_embeddings:
            self.lm_head = QuantLinear(H, config.vocab_size)
        if P:                                  # E2B/E4B: per-layer token table [V_ple, L*P], only looked up by rows
            self.embed_tokens_per_layer = QuantLinear(config.num_layers * P, config.ple_vocab_size)
            self.per_layer_model_projection = QuantLinear(H, config.num_layers * P)
            self.per_layer_projection_norm = RMSNorm(P, config.rms_norm_eps)
        for layer_type, inv_freq in config.rope_inv_freq:
            self.register_buffer(f"inv_freq_{layer_type}", torch.tensor(inv_freq, dtype=torch.float32), persistent=False)

    # ---- the forward ----

    def per_layer_inputs(self, ids: torch.Tensor, x0: torch.Tensor, prefill: bool) -> torch.Tensor:
        """E2B/E4B (docs/gemma4.md §2.3): ids [T], scaled embedding x0 [T, H] -> [T, L, P]."""
        L, P, H = self.config.num_layers, self.config.ple_dim, self.config.hidden_size
        tok = self.embed_tokens_per_layer.rows(ids) * math.sqrt(P)                # [T, L*P]
        proj = self.per_layer_model_projection(x0, prefill) * H ** -0.5          # [T, L*P]
        proj = self.per_layer_projection_norm(proj.view(-1, L, P))                # [T, L, P]
        return (proj + tok.view(-1, L, P)) * 2 ** -0.5

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> scaled input embeddings [T, H] float32 (also the MTP assistant's token input, docs/gemma4.md §5.3)."""
        return self.embed_tokens.rows(ids) * self.embed_scale

    def hidden_states(self, ids: torch.Tensor, step: StepLayout, pool: KVPool, media: StepEmbeds | None = None
                      ) -> torch.Tensor:
        """ids [T] (a step's new tokens) -> the final-normed hidden states of its logit rows [M, H]; the K/V of
        all T tokens are stored in the pool. `step` is the forward's one context: the layout, and whether its
        tokens are prompt tokens (step.prefill), which every layer a backend may replace is told. `media`: soft
        tokens in place of some rows' token embeddings."""
        if media is not None:                  # placeholder rows: pad id for the tables, the soft tokens as they are
            ids = ids.index_fill(0, media.rows.to(ids.device), PAD_ID)
        x = self.embed(ids)                                                        # [T, H]
        if media is not None:
            x = x.index_copy(0, media.rows.to(x.device), media.embeds.to(device=x.device, dtype=x.dtype))
        ple = self.per_layer_inputs(ids, x, step.prefill) if self.config.ple_dim else None    # [T, L, P]
        ropes = {t: rope_cos_sin(step.positions, getattr(self, f"inv_freq_{t}"))
                 for t, _ in self.config.rope_inv_freq}
        keep = step.logit_rows                                                     # [M]
        for layer in self.layers:
            i = layer.spec.index
            if i == self.config.first_shared_layer and keep.numel() < x.shape[0]:
                # E2B/E4B: KV-shared layers write no cache, so only the rows whose logits are needed must
                # go on (docs/gemma4.md §2.6); their queries keep their own positions and keys.
                if keep.numel() == 0:
                    return x[:0]
                x, ple = x[keep], None if ple is None else ple[keep]
                ropes = {t: (c[keep], s[keep]) for t, (c, s) in ropes.items()}
                step = step.logit_rows_only()
                keep = step.logit_rows
            x = layer(x, None if ple is None else ple[:, i], ropes[layer.spec.layer_type], step, pool)
        return self.norm(x[keep] if keep.numel() < x.shape[0] else x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden [T, H] -> softcapped logits [T, V] float32 (tied head: the unscaled embedding).

        Not told the pass kind: a step's logit rows are few in either kind (a prompt's last row, a decode
        pass's rows), so a backend picks the head's kernel by their number, as for a layer called alone."""
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return self.final_softcap(head(h).float())

    @torch.no_grad()      # not inference_mode: torch.compile's AOT backends cannot take inference tensors
    def forward(self, ids: torch.Tensor, step: StepLayout, pool: KVPool, hidden: bool = False,
                media: StepEmbeds | None = None):
        """One step over the pool: ids [T] -> logits of the step's logit rows [M, V], float32. `media`: the
        step's soft tokens (StepEmbeds).

        hidden=True: -> (logits [M, V], h [M, H]) with h the final-normed hidden states of the same rows, the
        state the MTP assistant drafts from (docs/gemma4.md §5.5: post-norm, as transformers and llama.cpp hand it).
        """
        h = self.hidden_states(ids, step, pool, media)
        logits = self.head(h) if h.shape[0] else h.new_empty((0, self.config.vocab_size))
        return (logits, h) if hidden else logits

    def extend(self, ids: torch.Tensor, cache: KVCache, logits: int = 1, prefill: bool | None = None,
               media: Sequence[MediaItem] = ()) -> torch.Tensor:
        """The next tokens ids [T] of a one-sequence cache -> logits of its last `logits` rows [logits, V];
        `prefill`: prompt tokens (StepLayout; by default, T > 1). `media`: the sequence's media items (those
        that fall in these tokens are used; a bidirectional one must lie wholly inside them or outside)."""
        start, n = cache.length, ids.numel()
        spans = [(m.start, m.end) for m in media if m.bidirectional]
        step = cache.step(n, logits, prefill, bidirectional=spans)
        out = self.forward(ids, step, cache.pool, media=StepEmbeds.of(media, start, n))
        cache.commit(ids.numel())
        return out

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, kv_dtype: str | torch.dtype = "auto") -> KVCache:
        """A one-sequence cache storing K/V in `kv_dtype` (a --kv-cache-dtype name or dtype; "auto": the model's)."""
        return KVCache(self.config, dtype=kv_cache_dtype(kv_dtype, self.dtype), device=self.device)

    def logits(self, token_ids, media: Sequence[MediaItem] = (), kv_dtype: str | torch.dtype = "auto") -> torch.Tensor:
        """Full-sequence logits [len(ids), vocab] float32 with a fresh cache (in `kv_dtype`, as `new_cache`);
        `media`: soft tokens at positions."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("token_ids is empty")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        for m in media:
            if not 0 <= m.start <= m.end <= ids.numel():
                raise ValueError(f"a media item at positions [{m.start}, {m.end}) is outside the {ids.numel()} tokens")
        return self.extend(ids, self.new_cache(kv_dtype), logits=ids.numel(), media=media)
