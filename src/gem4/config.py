"""ModelConfig / LayerSpec: the one description of a Gemma 4 text model that every room reads.

Built only by `weights/` from what a checkpoint says (GGUF metadata or config.json, checked against
its tensors); nothing here has a default that could stand in for a missing fact. `build_config`
derives what both formats share: the KV-sharing donor of each layer (docs/gemma4.md §2.6, the general
HF rule) and the per-layer MLP width.

Variants (docs/gemma4.md §1.3):
    E2B/E4B   per-layer embeddings (ple_dim > 0), KV sharing, double-wide MLP on shared layers (E2B)
    12B/31B   dense, k_eq_v on full layers
    26B-A4B   dense MLP + routed experts on every layer (moe), k_eq_v
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from gem4.numbers import is_finite_number

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)


MAX_CONTEXT = 2**24
# The largest context length a checkpoint may claim. RoPE turns positions into angles in float32
# (`positions.float() * inv_freq`), and float32 holds every integer only up to 2^24: beyond it
# neighbouring positions get the same angle. Gemma 4 claims 128K-256K, 64-128 times less.
MAX_RMS_NORM_EPS = 1e-2
# rms_norm_eps is a guard against division by zero (Gemma 4: 1e-6); a value near the activations'
# mean square would change the model, so anything above 1e-2 is taken for a corrupt field.
MAX_TENSOR_ELEMENTS = 2**40
# The most elements any one weight may have. The largest Gemma 4 tensor (the 262144 x 5376 embedding)
# has ~2^30.4; a size that implies more is a corrupt field, and refusing it here keeps the products
# the loader computes (and torch's int64 shapes: 2^63 overflows) far from overflowing.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class ConfigError(ValueError):
    """A checkpoint's description of the model is missing, inconsistent or unsupported.

    `field` names the ModelConfig quantity at fault when there is one (`sliding_window`,
    `max_position_embeddings`, `rms_norm_eps`, `final_logit_softcap`, `rope_theta` (a base),
    `rope.<layer type>` (a frequency vector), `moe.top_k`, `gqa` (heads vs kv heads), ...); each
    reader maps it to its own key name for the message.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field




def check_rope_theta(theta, what: str = "rope_theta") -> float:
    """A RoPE base must be a finite number > 0 (NaN, 0 or a negative base gives NaN angles)."""
    if not is_finite_number(theta) or theta <= 0:
        raise ConfigError(f"{what} must be a finite number > 0, got {theta!r}", "rope_theta")
    return float(theta)


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int        # E
    top_k: int              # K experts per token
    intermediate_size: int  # Im, width of one expert


@dataclass(frozen=True)
class LayerSpec:
    index: int
    layer_type: str           # SLIDING | FULL
    n_heads: int              # query heads
    n_kv_heads: int
    head_dim: int             # same for q, k and v
    k_eq_v: bool              # 12B/31B/26B full layers: V is the raw K projection (docs/gemma4.md §2.5)
    kv_source: int            # layer whose K/V this layer attends to; == index when it computes its own
    intermediate_size: int    # dense MLP width (doubled on E2B's shared layers)

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == SLIDING

    @property
    def owns_kv(self) -> bool:
        return self.kv_source == self.index


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    sliding_window: int
    rms_norm_eps: float
    final_logit_softcap: float | None  # None: no softcap
    ple_dim: int                       # P, per-layer embedding width; 0: no PLE
    ple_vocab_size: int                # rows of the PLE table (0 without PLE)
    moe: MoEConfig | None
    rope_inv_freq: tuple[tuple[str, tuple[float, ...]], ...]  # ((layer_type, inv_freq[head_dim/2]), ...)
    tie_word_embeddings: bool          # LM head is embed_tokens (no separate lm_head tensor)
    max_position_embeddings: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def first_shared_layer(self) -> int:
        """Index of the first KV-shared layer (num_layers when none)."""
        return next((s.index for s in self.layers if not s.owns_kv), self.num_layers)

    def inv_freq(self, layer_type: str) -> tuple[float, ...]:
        return dict(self.rope_inv_freq)[layer_type]

    @property
    def variant(self) -> str:
        if self.moe is not None:
            return "moe (26B-A4B-like)"
        if self.ple_dim:
            return "ple+kv-sharing (E2B/E4B-like)"
        if any(s.k_eq_v for s in self.layers):
            return "dense k_eq_v (12B/31B-like)"
        return "dense"


# ---- RoPE: every parameterisation becomes one inv_freq vector of length head_dim/2 (docs/gemma4.md §2.7) ----

def rope_default(theta: float, head_dim: int) -> tuple[float, ...]:
    """f_i = theta^(-2i/d), i < d/2; float32 arithmetic as the reference computes it."""
    check_rope_theta(theta)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return tuple((1.0 / (theta ** exponent)).tolist())


def rope_proportional(theta: float, head_dim: int, partial_rotary_factor: float, factor: float = 1.0) -> tuple[float, ...]:
    """Full layers: the first int(p*d/2) pairs rotate with f_i = theta^(-2i/d) (denominator the FULL d), the rest not."""
    check_rope_theta(theta)
    if not is_finite_number(partial_rotary_factor) or not 0 <= partial_rotary_factor <= 1:
        raise ConfigError(f"partial_rotary_factor must be in [0, 1], got {partial_rotary_factor!r}", "rope_theta")
    if not is_finite_number(factor) or factor <= 0:
        raise ConfigError(f"rope factor must be a finite number > 0, got {factor!r}", "rope_theta")
    n_rot = int(partial_rotary_factor * head_dim // 2)
    exponent = torch.arange(0, 2 * n_rot, 2, dtype=torch.float32) / head_dim
    rotated = 1.0 / (theta ** exponent)
    inv_freq = torch.cat([rotated, torch.zeros(head_dim // 2 - n_rot)]) / factor
    return tuple(inv_freq.tolist())


def rope_with_factors(theta: float, n_rot: int, freq_factors: Sequence[float] | None) -> tuple[float, ...]:
    """llama.cpp form: f_i = theta^(-2i/n_rot) / factor_i (factors of 1e30 switch a pair off)."""
    check_rope_theta(theta)
    inv_freq = 1.0 / (theta ** (torch.arange(0, n_rot, 2, dtype=torch.float32) / n_rot))
    if freq_factors is not None:
        factors = torch.as_tensor(list(freq_factors), dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ConfigError(f"rope_freqs has {factors.numel()} entries, expected {inv_freq.numel()} (n_rot/2)")
        inv_freq = inv_freq / factors
    return tuple(inv_freq.tolist())


# ---- derivation shared by both formats ----

def _check_tensor_sizes(vocab: int, hidden: int, specs: Sequence[LayerSpec], ple_dim: int, ple_vocab: int,
                        moe: MoEConfig | None) -> None:
    """Every weight the sizes imply has at most MAX_TENSOR_ELEMENTS elements (field: the sizes at fault)."""
    products = [("embed", vocab * hidden), ("ple", ple_vocab * len(specs) * ple_dim)]
    for s in specs:
        products += [("attention", max(s.n_heads, s.n_kv_heads) * s.head_dim * hidden),
                     ("mlp", s.intermediate_size * hidden)]
    if moe is not None:
        products.append(("moe.size", moe.num_experts * 2 * moe.intermediate_size * hidden))
    for field, n in products:
        if n > MAX_TENSOR_ELEMENTS:
            raise ConfigError(f"the {field.removesuffix('.size')} sizes imply a weight of {n} elements, more than "
                              f"2^40 = {MAX_TENSOR_ELEMENTS}", field)


def kv_sources(layer_types: Sequence[str], num_kv_shared_layers: int) -> list[int]:
    """Per layer, the index of the layer whose K/V it attends to (docs/gemma4.md §2.6, general HF rule).

    Layers >= first = L - shared reuse the K/V of the LAST layer below `first` of their own type.
    """
    n = len(layer_types)
    if not 0 <= num_kv_shared_layers < n:
        raise ConfigError(f"num_kv_shared_layers={num_kv_shared_layers} must be in [0, {n})", "num_kv_shared_layers")
    first = n - num_kv_shared_layers
    donors = {t: i for i, t in enumerate(layer_types[:first])}  # last index of each type wins
    sources = []
    for i, t in enumerate(layer_types):
        if i < first:
            sources.append(i)
        elif t in donors:
            sources.append(donors[t])
        else:
            raise ConfigError(f"layer {i} ({t}) shares KV but no earlier non-shared layer has type {t}")
    return sources


def build_config(
    *,
    vocab_size: int,
    hidden_size: int,
    layer_types: Sequence[str],
    n_heads: Sequence[int],
    n_kv_heads: Sequence[int],
    head_dims: Sequence[int],
    k_eq_v: Sequence[bool],
    intermediate_sizes: Sequence[int],
    num_kv_shared_layers: int,
    sliding_window: int,
    rms_norm_eps: float,
    final_logit_softcap: float | None,
    ple_dim: int,
    ple_vocab_size: int,
    moe: MoEConfig | None,
    rope_inv_freq: dict[str, tuple[float, ...]],
    tie_word_embeddings: bool,
    max_position_embeddings: int,
) -> ModelConfig:
    """Validate the facts a checkpoint gave and assemble the frozen config.

    Every value is checked for sense, not only for type, so that a corrupt field is refused here by
    name instead of loading and then allocating gigabytes or producing NaN logits:
        sizes, head counts, dims, widths      positive integers (head_dim even, heads a multiple of kv heads)
        max_position_embeddings               1 .. MAX_CONTEXT (2^24: see above)
        sliding_window                        1 .. max_position_embeddings
        rms_norm_eps                          finite, 0 < eps <= MAX_RMS_NORM_EPS (1e-2)
        final_logit_softcap                   absent, or finite > 0
        rope_inv_freq                         finite, >= 0, and position * frequency finite in float32
                                              for every position below max_position_embeddings
        moe                                   1 <= top_k <= num_experts, positive widths
        the weights those sizes imply         at most MAX_TENSOR_ELEMENTS (2^40) elements each
    """
    n = len(layer_types)
    for name, seq in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dims", head_dims),
                      ("k_eq_v", k_eq_v), ("intermediate_sizes", intermediate_sizes)):
        if len(seq) != n:
            raise ConfigError(f"{name} has {len(seq)} entries for {n} layers", name)
    for key, value, least in (("vocab_size", vocab_size, 1), ("hidden_size", hidden_size, 1),
                              ("sliding_window", sliding_window, 1), ("max_position_embeddings", max_position_embeddings, 1),
                              ("ple_dim", ple_dim, 0), ("ple_vocab_size", ple_vocab_size, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"{key} must be an integer >= {least}, got {value!r}", key)
    if not n:
        raise ConfigError("the model has no layers", "layers")
    if max_position_embeddings > MAX_CONTEXT:
        raise ConfigError(f"max_position_embeddings (the context length) {max_position_embeddings} is above "
                          f"2^24 = {MAX_CONTEXT}, past which float32 RoPE positions are not exact", "max_position_embeddings")
    if sliding_window > max_position_embeddings:
        raise ConfigError(f"sliding_window {sliding_window} is longer than the context length "
                          f"{max_position_embeddings}", "sliding_window/context")
    if not (isinstance(rms_norm_eps, float) and math.isfinite(rms_norm_eps) and 0 < rms_norm_eps <= MAX_RMS_NORM_EPS):
        raise ConfigError(f"rms_norm_eps must be a float in (0, {MAX_RMS_NORM_EPS:g}], got {rms_norm_eps!r}",
                          "rms_norm_eps")
    if final_logit_softcap is not None and not (is_finite_number(final_logit_softcap) and final_logit_softcap > 0):
        raise ConfigError(f"final_logit_softcapping must be a finite number > 0 or absent, got {final_logit_softcap!r}",
                          "final_logit_softcap")
    if (ple_dim > 0) != (ple_vocab_size > 0):
        raise ConfigError(f"per-layer embedding dim {ple_dim} and table rows {ple_vocab_size} disagree", "ple_dim")
    for name, seq in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dims", head_dims),
                      ("intermediate_sizes", intermediate_sizes)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in seq):
            raise ConfigError(f"{name} must be integers, got {list(seq)!r}", name)

    sources = kv_sources(layer_types, num_kv_shared_layers)
    specs = []
    for i, t in enumerate(layer_types):
        if t not in LAYER_TYPES:
            raise ConfigError(f"layer {i}: unknown layer type {t!r} (expected one of {LAYER_TYPES})")
        d, nh, nkv = head_dims[i], n_heads[i], n_kv_heads[i]
        if d <= 0 or d % 2 or nh <= 0 or nkv <= 0 or nh % nkv:
            field = ("head_dims" if d <= 0 or d % 2 else "n_heads" if nh <= 0 else "n_kv_heads" if nkv <= 0
                     else "gqa")
            raise ConfigError(f"layer {i}: head_dim={d}, heads={nh}, kv_heads={nkv} is not a valid GQA geometry "
                              f"(head_dim even, heads a multiple of kv_heads)", field)
        if k_eq_v[i] and t != FULL:
            raise ConfigError(f"layer {i}: k_eq_v is only defined for full-attention layers")
        if intermediate_sizes[i] <= 0:
            raise ConfigError(f"layer {i}: intermediate size {intermediate_sizes[i]} must be positive",
                              "intermediate_sizes")
        src = sources[i]
        if src != i and (head_dims[src], n_kv_heads[src]) != (d, nkv):
            raise ConfigError(f"layer {i} reuses the K/V of layer {src} but their KV geometry differs")
        specs.append(LayerSpec(index=i, layer_type=t, n_heads=nh, n_kv_heads=nkv, head_dim=d,
                               k_eq_v=bool(k_eq_v[i]) and src == i, kv_source=src,
                               intermediate_size=intermediate_sizes[i]))
    _check_tensor_sizes(vocab_size, hidden_size, specs, ple_dim, ple_vocab_size, moe)
    for t in set(layer_types):
        if t not in rope_inv_freq:
            raise ConfigError(f"no RoPE parameters for layer type {t!r}")
        dims = {s.head_dim for s in specs if s.layer_type == t}
        if len(dims) != 1 or len(rope_inv_freq[t]) * 2 != dims.pop():
            raise ConfigError(f"RoPE for {t} has {len(rope_inv_freq[t])} frequencies; layers of that type need head_dim/2")
        # angles are positions * inv_freq in float32: NaN, inf or a product past float32's range is NaN in cos/sin
        top = max(rope_inv_freq[t], default=0.0)
        if not all(is_finite_number(f) and f >= 0 for f in rope_inv_freq[t]) or top * max_position_embeddings >= _FLOAT32_MAX:
            raise ConfigError(f"RoPE frequencies for {t} must be finite and >= 0 with context length x frequency "
                              f"finite in float32, got up to {top!r}", f"rope.{t}")
    if moe is not None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            v = getattr(moe, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"MoE {name} must be a positive integer, got {v!r}", f"moe.{name}")
        if moe.top_k > moe.num_experts:
            raise ConfigError(f"MoE top_k {moe.top_k} (experts per token) exceeds num_experts {moe.num_experts}",
                              "moe.top_k")
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, layers=tuple(specs), sliding_window=sliding_window,
        rms_norm_eps=float(rms_norm_eps), final_logit_softcap=final_logit_softcap, ple_dim=ple_dim,
        ple_vocab_size=ple_vocab_size, moe=moe,
        rope_inv_freq=tuple((t, tuple(rope_inv_freq[t])) for t in LAYER_TYPES if t in rope_inv_freq),
        tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings,
    )


# ---- the vision tower (docs/multimodal.md §2) ----

@dataclass(frozen=True)
class VisionConfig:
    """A Gemma 4 vision tower (E2B/E4B and 26B/31B: a ViT over 16 px patches, pooled 3x3 into soft tokens) and the
    image tokens of its text model. Built only by `weights/` from a checkpoint (`build_vision_config` checks it)."""

    hidden_size: int              # D, the tower's width
    intermediate_size: int        # its MLP width
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int                 # a multiple of 4: half of it rotates with x, half with y, NeoX-style each
    patch_size: int               # pixels per patch side (16)
    pooling: int                  # patches per soft token side (3)
    position_embedding_size: int  # rows of each axis' position table: the largest patch coordinate + 1
    rope_theta: float             # the 2-D RoPE base (100)
    rms_norm_eps: float           # every norm of the tower and of its projection into the text width
    clipped_linears: bool         # E2B/E4B: each linear clamps its input and output to stored bounds
    standardize: bool             # 26B/31B: (pooled - std_bias) * std_scale after pooling
    text_hidden_size: int         # the text model's width, which the projection maps into
    bidirectional: bool           # the text model's sliding layers let one image's tokens see each other both
                                  # ways (config "use_bidirectional_attention": "vision"; 26B/31B)
    image_token_id: int           # the placeholder one soft token replaces
    boi_token_id: int             # <|image>, before an image's soft tokens
    eoi_token_id: int             # <image|>, after them
    video_token_id: int | None = None   # <|video|>: a video frame's soft-token placeholder (None: no video)

    image_processor = "pil"       # a class constant: media/image.py follows transformers' PIL image processor

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2

    def inv_freq(self) -> tuple[float, ...]:
        """The head_dim/4 frequencies each axis rotates with: theta^(-2i/(head_dim/2)) in float32."""
        half = self.head_dim // 2
        exponent = torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half    # not a load's meta device
        return tuple((1.0 / (self.rope_theta ** exponent)).tolist())


def _check_vision_ints(config: VisionConfig | UnifiedVisionConfig, sizes: tuple[str, ...]) -> None:
    """The sizes (>= 1), the text width and the image token ids (>= 0; video_token_id may be None) of either
    vision config are integers."""
    for name in (*sizes, "text_hidden_size", "image_token_id", "boi_token_id", "eoi_token_id", "video_token_id"):
        v = getattr(config, name)
        if name == "video_token_id" and v is None:
            continue
        least = 0 if name.endswith("token_id") else 1
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ConfigError(f"vision {name} must be an integer >= {least}, got {v!r}", name)


def build_vision_config(**fields) -> VisionConfig:
    """Check a vision tower's facts for sense (field: the VisionConfig field at fault) and freeze them."""
    config = VisionConfig(**fields)
    _check_vision_ints(config, ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                                "head_dim", "patch_size", "pooling", "position_embedding_size"))
    if config.head_dim % 4:
        raise ConfigError(f"vision head_dim {config.head_dim} must be a multiple of 4 (x and y each rotate half of "
                          f"it in pairs)", "head_dim")
    if config.num_heads % config.num_kv_heads:
        raise ConfigError(f"vision heads {config.num_heads} are not a multiple of kv heads {config.num_kv_heads}", "gqa")
    check_rope_theta(config.rope_theta)
    eps = config.rms_norm_eps
    if not (isinstance(eps, float) and math.isfinite(eps) and 0 < eps <= MAX_RMS_NORM_EPS):
        raise ConfigError(f"vision rms_norm_eps must be a float in (0, {MAX_RMS_NORM_EPS:g}], got {eps!r}", "rms_norm_eps")
    products = {"hidden_size": config.hidden_size * max(config.intermediate_size, config.patch_dim,
                                                        config.num_heads * config.head_dim, config.text_hidden_size,
                                                        2 * config.position_embedding_size)}
    for field, n in products.items():
        if n > MAX_TENSOR_ELEMENTS:
            raise ConfigError(f"the vision sizes imply a weight of {n} elements, more than 2^40", field)
    return config
# ---- the 12B's encoder-free vision embedder (docs/multimodal.md §2.5) ----

@dataclass(frozen=True)
class UnifiedVisionConfig:
    """12B ("unified", encoder-free): no tower. Each soft token is one `patch_size` x `patch_size` pixel patch in
    [0, 1] (the checkpoint's patch_size x pooling_kernel_size, 48 px), LayerNormed, projected to `embed_dim`,
    LayerNormed, given its (x, y) position, LayerNormed, then RMS-normed (no weight) and projected to the text
    width. Built only by `weights/` from a checkpoint (`build_unified_vision_config` checks it).

    The fields media/ and engine/ read have VisionConfig's names and meanings: `patch_size` and `pooling` size an
    image's patches (one soft token per patch here: pooling 1), `position_embedding_size` bounds its grid, the
    token ids and `bidirectional` place it in the prompt."""

    patch_size: int               # pixels per side of the patch one soft token reads (48)
    embed_dim: int                # the embedder's width (mm_embed_dim)
    position_embedding_size: int  # rows of the (rows, 2, embed_dim) position table (mm_posemb_size)
    rms_norm_eps: float           # the RMSNorm before the projection (the three LayerNorms use 1e-5, torch's default)
    text_hidden_size: int         # the text model's width, which the projection maps into
    bidirectional: bool           # as VisionConfig's ("vision": the 12B's sliding layers)
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    video_token_id: int | None = None   # <|video|>: a frame's placeholder (None: no video)

    pooling = 1                   # a class constant, not a field: one soft token per patch
    image_processor = "torchvision"   # transformers' only 12B image processor (media/image.py follows it)

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2


def build_unified_vision_config(**fields) -> UnifiedVisionConfig:
    """Check the 12B embedder's facts for sense (field: the UnifiedVisionConfig field at fault) and freeze them."""
    config = UnifiedVisionConfig(**fields)
    _check_vision_ints(config, ("patch_size", "embed_dim", "position_embedding_size"))
    eps = config.rms_norm_eps
    if not (isinstance(eps, float) and math.isfinite(eps) and 0 < eps <= MAX_RMS_NORM_EPS):
        raise ConfigError(f"vision rms_norm_eps must be a float in (0, {MAX_RMS_NORM_EPS:g}], got {eps!r}", "rms_norm_eps")
    widest = max(config.patch_dim, 2 * config.position_embedding_size, config.text_hidden_size)
    if config.embed_dim * widest > MAX_TENSOR_ELEMENTS:
        raise ConfigError("the vision sizes imply a weight of more than 2^40 elements", "embed_dim")
    return config


# ---- the audio tower (E2B/E4B; docs/multimodal.md §3.3) ----

AUDIO_ACTIVATIONS = ("silu",)
AUDIO_TOKEN_FIELDS = (("audio_token_id", 0), ("boa_token_id", 0), ("eoa_token_id", 0))   # (field, least value)


@dataclass(frozen=True)
class AudioConfig:
    """The conformer audio tower of E2B/E4B and the projection of its output into the text model's width.

    Built only by `weights/` from a checkpoint's `audio_config` and checked against its tensors
    (`build_audio_config`); model/audio.py reads it."""
    n_mels: int                          # input features per frame (the front end's 128)
    subsampling_channels: tuple[int, int]  # the two stride-2 3x3 convolutions' output channels
    hidden_size: int                     # D
    num_layers: int
    num_heads: int                       # head_dim = D / heads
    hidden_act: str                      # the feed-forward and light-conv activation
    conv_kernel_size: int                # the light conv's causal depthwise kernel
    residual_weight: float               # the feed-forward blocks' output scale
    chunk_size: int                      # transformers' attention block (the result does not depend on it)
    context_left: int                    # a frame sees itself and context_left - 2 earlier frames
    context_right: int                   # ... and context_right - 1 later ones (0 and 1: none)
    logit_cap: float                     # cap * tanh(logit / cap), before the mask
    invalid_logit: float                 # the logit of a key a frame may not see
    clipped_linears: bool                # the linear layers clamp their inputs and outputs to stored bounds
    rms_norm_eps: float                  # the light conv's norms, the subsampling LayerNorms, the embedder's norm
    gradient_clipping: float             # the residual branches are clamped to +- this
    output_dims: int                     # output_proj's width (with bias)
    text_hidden_size: int                # the text model's H: where embed_audio projects to
    audio_token_id: int                  # the placeholder one soft token replaces
    boa_token_id: int                    # <|audio>, before a clip's soft tokens
    eoa_token_id: int                    # <audio|>, after them

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def subsampled_mels(self) -> int:
        """The frequency bins left after the two stride-2 convolutions (padding 1): ceil(ceil(n_mels / 2) / 2)."""
        return -(-(-(-self.n_mels // 2)) // 2)

    @property
    def relative_positions(self) -> int:
        """Rows of the relative-position table, as transformers sizes it: (chunk + left - 1 + right) // 2 + 1."""
        return (self.chunk_size + self.context_left - 1 + self.context_right) // 2 + 1


def build_audio_config(**fields) -> AudioConfig:
    """Validate an audio tower's facts (ConfigError naming the field) and freeze them."""
    for key in ("n_mels", "hidden_size", "num_layers", "num_heads", "conv_kernel_size", "chunk_size", "output_dims",
                "text_hidden_size"):
        v = fields[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"audio {key} must be an integer >= 1, got {v!r}", f"audio.{key}")
    for key, least in (("context_left", 2), ("context_right", 0), *AUDIO_TOKEN_FIELDS):
        v = fields[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ConfigError(f"audio {key} must be an integer >= {least}, got {v!r}", f"audio.{key}")
    channels = fields["subsampling_channels"]
    if (not isinstance(channels, (list, tuple)) or len(channels) != 2
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in channels)):
        raise ConfigError(f"audio subsampling channels must be two integers >= 1, got {channels!r}",
                          "audio.subsampling_channels")
    if fields["hidden_size"] % fields["num_heads"]:
        raise ConfigError(f"audio hidden_size {fields['hidden_size']} is not a multiple of its "
                          f"{fields['num_heads']} heads", "audio.num_heads")
    if fields["hidden_size"] < 2:
        raise ConfigError("audio hidden_size must be at least 2 (sine and cosine halves)", "audio.hidden_size")
    if fields["hidden_act"] not in AUDIO_ACTIVATIONS:
        raise ConfigError(f"audio hidden_act {fields['hidden_act']!r} is not supported ({AUDIO_ACTIVATIONS})",
                          "audio.hidden_act")
    eps = fields["rms_norm_eps"]
    if not (isinstance(eps, float) and math.isfinite(eps) and 0 < eps <= MAX_RMS_NORM_EPS):
        raise ConfigError(f"audio rms_norm_eps must be a float in (0, {MAX_RMS_NORM_EPS:g}], got {eps!r}",
                          "audio.rms_norm_eps")
    for key in ("residual_weight", "logit_cap", "gradient_clipping"):
        v = fields[key]
        if not is_finite_number(v) or v <= 0:
            raise ConfigError(f"audio {key} must be a finite number > 0, got {v!r}", f"audio.{key}")
    # softmax subtracts the row's max (>= -cap): a masked key's weight is then exp(< -200) = exactly 0 in float32,
    # as transformers' -1e9 makes it; a milder value would give the keys outside the window a share
    if not is_finite_number(fields["invalid_logit"]) or fields["invalid_logit"] > -(fields["logit_cap"] + 200):
        raise ConfigError(f"audio invalid_logit {fields['invalid_logit']!r} must be finite and at most "
                          f"-(logit_cap + 200), so that a masked key gets no weight", "audio.invalid_logit")
    if not isinstance(fields["clipped_linears"], bool):
        raise ConfigError(f"audio clipped_linears must be true or false, got {fields['clipped_linears']!r}",
                          "audio.clipped_linears")
    return AudioConfig(**{**fields, "subsampling_channels": tuple(channels),
                          "residual_weight": float(fields["residual_weight"]), "logit_cap": float(fields["logit_cap"]),
                          "invalid_logit": float(fields["invalid_logit"]),
                          "gradient_clipping": float(fields["gradient_clipping"])})


@dataclass(frozen=True)
class FrameAudioConfig:
    """12B ("unified", encoder-free): no tower. Each soft token is a frame of `samples_per_token` raw 16 kHz samples,
    RMS-normed (no weight) and projected to the text width."""
    samples_per_token: int               # 640 = 40 ms: also the projection's input width
    rms_norm_eps: float
    text_hidden_size: int
    audio_token_id: int                  # as AudioConfig's
    boa_token_id: int
    eoa_token_id: int


def build_frame_audio_config(samples_per_token, rms_norm_eps, text_hidden_size, audio_token_id, boa_token_id,
                             eoa_token_id) -> FrameAudioConfig:
    for key, v in (("samples_per_token", samples_per_token), ("text_hidden_size", text_hidden_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"audio {key} must be an integer >= 1, got {v!r}", f"audio.{key}")
    for key, v in (("audio_token_id", audio_token_id), ("boa_token_id", boa_token_id), ("eoa_token_id", eoa_token_id)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"audio {key} must be an integer >= 0, got {v!r}", f"audio.{key}")
    if not (isinstance(rms_norm_eps, float) and math.isfinite(rms_norm_eps) and 0 < rms_norm_eps <= MAX_RMS_NORM_EPS):
        raise ConfigError(f"audio rms_norm_eps must be a float in (0, {MAX_RMS_NORM_EPS:g}], got {rms_norm_eps!r}",
                          "audio.rms_norm_eps")
    return FrameAudioConfig(samples_per_token=samples_per_token, rms_norm_eps=rms_norm_eps,
                            text_hidden_size=text_hidden_size, audio_token_id=audio_token_id,
                            boa_token_id=boa_token_id, eoa_token_id=eoa_token_id)
