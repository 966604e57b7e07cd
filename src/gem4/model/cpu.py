"""The CPU backend: gem4's compiled AVX-512 kernels (model/kernels) in place of the reference's torch ops.

The fast mode on CPUs that run the kernels (bfloat16 weights; the KV cache in bf16, int8 or fp8_e4m3, which the
attention kernels read as stored: kv_cache/pool.py). Installed once at load
(model/backends.py), in three moves:

- `prepare`, on the module tree before its weights are bound: every module whose class has a kernel
  counterpart here becomes that class (`SWAPS`: norms, the gelu gates, the softcap, attention, MLP, experts,
  decoder layers, the assistant's attention). The counterparts are subclasses that add no state, so the
  parameters and their names stay the reference's.
- `pack`, while binding: a projection weight in a type the kernels read (`PACKED_TYPES`) is rearranged once,
  losslessly, into their layout and the layer becomes a `PackedLinear`; 26B-A4B's expert weights the same way.
- `finish`, after binding: the bf16 projections that stayed dense become `Bf16Linear`s (gemv_bf16 /
  linear_bf16 read them as stored), each decoder layer gets its `DecodePlan` (the weights and dims with
  which kernels.decode_layer runs the whole layer of a decode step in one call), and the model its
  decode_rows.

The same float32 math as the reference, up to rounding. What decides the kernels is the pass kind each layer
is told (`prefill`, StepLayout.prefill): in a prefill pass every packed or bf16 weight takes the row-invariant
GEMM (kernels.linear / linear_bf16) and attention the chunk kernel, in a decode pass the GEMV kernels and the
decode attention (row-invariant too), whatever the number of rows. So a token's activations depend on its
own row alone, not on how its prompt was cut into chunks (a prefix-cache hit computes the rest of a prompt
in other chunks than a cold run) nor on what else ran beside it. A layer called alone (prefill None) takes
the GEMV for inputs of up to DECODE_ROWS rows.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from gem4.model import kernels
from gem4.model.assistant import AssistantAttention
from gem4.model.gemma4 import MLP, Attention, DecoderLayer, Experts, Model
from gem4.model.layers import GeluMul, QuantLinear, RMSNorm, Softcap, per_sequence
from gem4.kv_cache import LayerKV, StepLayout
from gem4.ggml import GGMLType

PACKED_TYPES = kernels.PACKED_TYPES   # the GGML types kept packed (the others are dequantized at load)

# a decode pass takes the compiled decode kernels; the engine packs generated tokens into decode passes of at
# most a model's decode_rows rows, one of these two (`finish`):
DECODE_ROWS = 32       # packed weights: the GEMV reads W once per pass of up to 8 rows
DECODE_ROWS_BF16 = 8   # decoder layers with bf16 weights read by gemv_bf16 (4 rows per pass), which loses to the
                       # bf16 GEMM beyond 8 rows (benchmarks/kernels.py --ops gemv_bf16 linear_bf16)
ALIGN_KEYS = 16        # prefill attention: zero keys put in front of a sequence's keys, so that key i sits at a
                       # position = i (mod 16) and kernels.attend_chunk sums in an order fixed by positions


def takes_gemv(rows: int, prefill: bool | None) -> bool:
    """Whether `rows` input rows take the GEMV kernels rather than the GEMM: in a decode pass always, in a
    prefill pass never; a layer called alone (None), up to DECODE_ROWS rows."""
    return rows <= DECODE_ROWS if prefill is None else not prefill


def gemv_input(x: torch.Tensor, prefill: bool | None) -> bool:
    """x goes to a GEMV kernel as it is: float32 [M, in], contiguous, decode rows (takes_gemv)."""
    return x.dim() == 2 and takes_gemv(x.shape[0], prefill) and x.dtype == torch.float32 and x.is_contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType,
                  prefill: bool | None) -> torch.Tensor:
    """x [M, k_in] @ W.T [M, n_out] float32 for W packed in the kernels' layout (takes_gemv says which kernel)."""
    if takes_gemv(x.shape[0], prefill):
        return kernels.gemv(x.float().contiguous(), packed, n_out, k_in, ggml_type)
    return kernels.linear(x, packed, n_out, k_in, ggml_type)


# ---- leaf modules ----

class KernelRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, residual)

    def with_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm_rope(x, self.weight, self.eps, cos, sin)


class KernelGeluMul(GeluMul):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return kernels.gelu_mul(a, b)


class KernelSoftcap(Softcap):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.cap is None else kernels.softcap(logits, self.cap)


class PackedLinear(QuantLinear):
    """`packed` holds a Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K weight (PACKED_TYPES) in the compiled kernels' layout,
    rearranged once at load, losslessly. A decode pass's rows run the GEMV kernel that reads it directly, a
    prefill pass's the GEMM that turns 32 rows of W at a time into bf16. Both equal dequantize + float matmul
    up to float rounding (tested)."""

    def pack(self, raw: torch.Tensor, ggml_type: GGMLType) -> None:
        """GGML bytes of the [out, in] weight -> the kernels' layout."""
        self.set_storage("packed", "packed", kernels.repack(raw, self.out_features, self.in_features, ggml_type),
                         ggml_type)

    @property
    def gemv_type(self) -> GGMLType:
        """The weight type the GEMV kernels read (decode_layer's dims)."""
        return self.ggml_type

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return kernels.dequant(self.packed, self.in_features, self.ggml_type, torch.float32, rows=ids.reshape(-1))

    def forward(self, x: torch.Tensor, prefill: bool | None = None) -> torch.Tensor:
        if gemv_input(x, prefill):                                # decode: the common case first
            return kernels.gemv(x, self.packed, self.out_features, self.in_features, self.ggml_type)
        y = packed_linear(x.reshape(-1, self.in_features), self.packed, self.out_features, self.in_features,
                          self.ggml_type, prefill)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class Bf16Linear(QuantLinear):
    """A bf16 weight as stored: a decode pass's inputs through kernels.gemv_bf16 (the input as two bf16 terms:
    closer to the float32 path, not further), a prefill pass's through the row-invariant kernels.linear_bf16
    (F.linear where the input width is not a multiple of 32)."""

    gemv_type = GGMLType.BF16

    def forward(self, x: torch.Tensor, prefill: bool | None = None) -> torch.Tensor:
        if gemv_input(x, prefill):
            return kernels.gemv_bf16(x, self.weight)
        if self.in_features % 32 == 0:
            y = kernels.linear_bf16(x.reshape(-1, self.in_features), self.weight)
            return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return super().forward(x, prefill)


def one_gemv_pass(x: torch.Tensor, prefill: bool | None, linears) -> bool:
    """Several packed layers of one type can take x in one kernel pass."""
    return (gemv_input(x, prefill) and all(isinstance(lin, PackedLinear) for lin in linears)
            and len({lin.ggml_type for lin in linears}) == 1)


def project(x: torch.Tensor, linears: list[QuantLinear], prefill: bool | None) -> list[torch.Tensor]:
    """x through several linear layers that share it as input (Q, K, V): one kernel pass over all their rows
    when they are packed in one type and x is decode rows, else one call each."""
    if len(linears) > 1 and one_gemv_pass(x, prefill, linears):
        first = linears[0]
        return kernels.gemv_multi(x, [lin.packed for lin in linears], [lin.out_features for lin in linears],
                                  first.in_features, first.ggml_type)
    return [lin(x, prefill) for lin in linears]


def glu(x: torch.Tensor, gate: QuantLinear, up: QuantLinear, prefill: bool | None) -> torch.Tensor:
    """gelu_tanh(gate(x)) * up(x): one kernel pass when both are packed in one type and x is decode rows."""
    if one_gemv_pass(x, prefill, (gate, up)):
        return kernels.gemv_glu(x, gate.packed, up.packed, gate.out_features, gate.in_features, gate.ggml_type)
    return kernels.gelu_mul(gate(x, prefill), up(x, prefill))


# ---- blocks ----

def attend_chunk(q: torch.Tensor, kv: LayerKV, mask: torch.Tensor, first_key: int) -> torch.Tensor:
    """One sequence's prefill rows through kernels.attend_chunk (its keys as stored: bf16, or int8 / fp8, which the
    kernel dequantizes), with zero keys (masked) in front up to a position that is a multiple of ALIGN_KEYS, so
    that each row's sums run in an order fixed by positions, whatever the chunk (row-invariant)."""
    pad = first_key % ALIGN_KEYS
    if pad:
        kv = LayerKV(*(torch.cat([t.new_zeros((pad, *t.shape[1:])), t]) for t in kv.tensors()))
        mask = torch.cat([mask.new_zeros((mask.shape[0], pad)), mask], dim=1)
    return kernels.attend_chunk(q, kv.k, kv.v, mask, kv.k_scale, kv.v_scale)


class KernelAttention(Attention):
    def project(self, h: torch.Tensor, prefill: bool) -> list[torch.Tensor]:
        return project(h, self.projections(), prefill)

    def attend(self, q: torch.Tensor, kv: LayerKV, step: StepLayout) -> torch.Tensor:
        """A decode pass's rows in one kernels.attend call that reads the storage rows directly; a prefill pass
        sequence by sequence through kernels.attend_chunk (`attend_chunk`)."""
        a = step.attend[self.spec.layer_type]
        if not step.prefill:
            return kernels.attend(q, kv.k, kv.v, a, kv.k_scale, kv.v_scale)
        return per_sequence(q, kv, a, attend_chunk)


class KernelAssistantAttention(AssistantAttention):
    def attend(self, q: torch.Tensor, kv: LayerKV, a) -> torch.Tensor:
        return kernels.attend(q, kv.k, kv.v, a, kv.k_scale, kv.v_scale)


class KernelMLP(MLP):
    def glu(self, x: torch.Tensor, prefill: bool | None) -> torch.Tensor:
        return glu(x, self.gate_proj, self.up_proj, prefill)


class KernelExperts(Experts):
    """26B-A4B's routed experts; `pack` keeps Q8_0 / Q4_0 (and the K-quants) packed as [E * rows, ...] in the
    kernels' layout: expert e is the row range [e * rows, (e + 1) * rows) of it, a packed weight of its own (repacked
    as one of E units), read only when a token is routed to e."""

    def pack(self, name: str, raw: torch.Tensor, ggml_type: GGMLType) -> None:
        """GGML bytes of `name` ("gate_up_proj" / "down_proj", [E, rows, k]) -> the kernels' layout."""
        rows, k = self.dims[name]
        if ggml_type in kernels.PANEL_TYPES and rows % 16:                  # expert e's rows must start a panel
            raise ValueError(f"{name}: {rows} rows per expert are not a multiple of 16, which packed "
                             f"{GGMLType(ggml_type).name} experts need; load in float32 mode")
        packed = kernels.repack(raw, self.num_experts * rows, k, ggml_type, units=self.num_experts)
        delattr(self, name)
        self.register_buffer(name, packed, persistent=False)
        self.packed_types[name] = GGMLType(ggml_type)

    def product(self, name: str, prefill: bool):
        if name not in self.packed_types:
            return super().product(name, prefill)
        w, slot = getattr(self, name), self.store.slot
        (rows, k), ggml_type = self.dims[name], self.packed_types[name]
        per_slot = w.view(-1, rows, w.shape[-1])          # resident [E * rows, ...] or slots [slots, rows, ...]
        return lambda e, xs: packed_linear(xs, per_slot[slot(e)], rows, k, ggml_type, prefill)


# ---- a decoder layer of a decode step in one call ----

# kernels.decode_layer's arguments, named as the Python layer names its modules and attributes: the norms' weights,
# layer_scalar, the projections' weights, and for 26B-A4B the MoE tensors; the dims: the LayerSpec's, each
# projection's, and for 26B-A4B the experts'. decode_layer.cpp declares its own order under the same names
# (kernels.decode_layer_schema), checked against these once per process, at the first DecodePlan.
DECODE_LAYER_NORMS = ("input_layernorm", "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm",
                      "pre_feedforward_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm")
DECODE_LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "per_layer_input_gate", "per_layer_projection")
DECODE_LAYER_MOE = ("pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_1.weight",
                    "post_feedforward_layernorm_2.weight", "router.scale", "router.proj.weight",
                    "router.per_expert_scale", "experts.gate_up_proj", "experts.down_proj")
DECODE_LAYER_DIMS = ("n_heads", "n_kv_heads", "head_dim", "owns_kv", "k_eq_v")     # of the layer's LayerSpec
DECODE_LAYER_LINEAR_DIMS = ("out_features", "in_features", "gemv_type")            # of each projection, in turn
DECODE_LAYER_MOE_DIMS = ("experts.num_experts", "router.top_k", "experts.gate_up_proj.type", "experts.down_proj.type")


def decode_layer_schema() -> tuple[tuple[str, ...], ...]:
    """The names of the weights and dims DecodePlan gives kernels.decode_layer, in its order and as
    kernels.decode_layer_schema() names them: a dense layer's weights and dims, then the MoE ones."""
    weights = (*DECODE_LAYER_NORMS, "layer_scalar", *DECODE_LAYER_LINEARS)
    dims = (*DECODE_LAYER_DIMS, *(f"{lin}.{d}" for lin in DECODE_LAYER_LINEARS for d in DECODE_LAYER_LINEAR_DIMS))
    return weights, dims, DECODE_LAYER_MOE, DECODE_LAYER_MOE_DIMS


def check_decode_layer_schema(native: tuple[tuple[str, ...], ...] | None = None) -> None:
    """Raise when decode_layer.cpp takes its arguments in another order than DecodePlan gives them (native: its
    schema, kernels.decode_layer_schema() unless given): a reordering on one side only fails at load, by name."""
    native = kernels.decode_layer_schema() if native is None else native
    for what, ours, theirs in zip(("weights", "dims", "MoE weights", "MoE dims"), decode_layer_schema(), native):
        if tuple(ours) != tuple(theirs):
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise RuntimeError(
                f"kernels.decode_layer and cpu.py's DecodePlan disagree on the layer's {what} at position {at}: "
                f"decode_layer.cpp expects {theirs[at] if at < len(theirs) else '(nothing)'!r}, DecodePlan gives "
                f"{ours[at] if at < len(ours) else '(nothing)'!r} (decode_layer.cpp: {', '.join(theirs)}; "
                f"DecodePlan: {', '.join(ours)})")


@functools.cache
def _check_decode_layer_schema_once() -> None:
    check_decode_layer_schema()


def _find(module: nn.Module, path: str):
    """module.a.b for path "a.b", or None where the layer has no such part (a variant's branch)."""
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


class DecodePlan:
    """The weights and dims with which kernels.decode_layer runs one decoder layer for decode passes of up to
    `max_rows` rows."""

    def __init__(self, weights: list[torch.Tensor], dims: list[int], max_rows: int):
        self.weights, self.dims, self.max_rows = weights, dims, max_rows

    @classmethod
    def of(cls, layer: DecoderLayer, max_rows: int) -> "DecodePlan | None":
        """The layer's plan, or None where kernels.decode_layer does not cover it: a projection that no GEMV kernel
        reads (neither packed nor bf16), a 26B-A4B router projection that is not a dense float32 matrix, or
        streamed experts (their slots are filled by the Python store)."""
        _check_decode_layer_schema_once()
        spec = layer.spec
        linears = [_find(layer, path) for path in DECODE_LAYER_LINEARS]
        if any(lin is not None and not isinstance(lin, (PackedLinear, Bf16Linear)) for lin in linears):
            return None
        none = torch.empty(0)
        norms = [_find(layer, path) for path in DECODE_LAYER_NORMS]
        weights = ([none if n is None else n.weight for n in norms] + [layer.layer_scalar]
                   + [none if lin is None else lin.packed if isinstance(lin, PackedLinear) else lin.weight
                      for lin in linears])
        dims = [int(getattr(spec, name)) for name in DECODE_LAYER_DIMS]
        for lin in linears:
            dims += [0 if lin is None else int(getattr(lin, name)) for name in DECODE_LAYER_LINEAR_DIMS]
        if hasattr(layer, "experts"):                  # 26B-A4B
            router, experts = layer.router, layer.experts
            if experts.store.streamed:
                return None
            if router.proj.layout != "dense" or router.proj.weight.dtype != torch.float32:
                return None
            weights += [_find(layer, path) for path in DECODE_LAYER_MOE]
            # "experts.<weight>.type": the GGML type that expert weight is packed in (0: dense)
            dims += [int(experts.packed_types.get(path.split(".")[1], 0)) if path.endswith(".type")
                     else int(_find(layer, path)) for path in DECODE_LAYER_MOE_DIMS]
        return cls(weights, dims, max_rows)


class KernelDecoderLayer(DecoderLayer):
    plan: DecodePlan | None = None             # set by `finish`

    def forward(self, x: torch.Tensor, ple: torch.Tensor | None, rope, step: StepLayout, pool) -> torch.Tensor:
        plan, spec = self.plan, self.spec
        if plan is not None and not step.prefill and x.shape[0] <= plan.max_rows:     # a decode pass: one call
            kv = pool.store(spec.index)
            rows = step.write[spec.layer_type] if spec.owns_kv else None
            return kernels.decode_layer(x, ple, *rope, kv.k, kv.v, rows, step.attend[spec.layer_type],
                                        plan.weights, plan.dims, self.eps, kv.k_scale, kv.v_scale)
        return super().forward(x, ple, rope, step, pool)


# ---- installing it ----

SWAPS = {RMSNorm: KernelRMSNorm, GeluMul: KernelGeluMul, Softcap: KernelSoftcap, Attention: KernelAttention,
         MLP: KernelMLP, Experts: KernelExperts, DecoderLayer: KernelDecoderLayer,
         AssistantAttention: KernelAssistantAttention}


class CpuBackend:
    name = "cpu"
    packed_types = PACKED_TYPES

    def prepare(self, model: nn.Module) -> None:
        """Before binding: each module whose class has a kernel counterpart becomes it (same state)."""
        for module in model.modules():
            swap = SWAPS.get(type(module))
            if swap is not None:
                module.__class__ = swap

    def pack(self, module: nn.Module, name: str, raw: torch.Tensor, ggml_type: GGMLType) -> None:
        """Bind the weight `name` of `module` (a linear layer's "weight", or an expert tensor) packed."""
        if isinstance(module, KernelExperts):
            module.pack(name, raw, ggml_type)
            return
        module.__class__ = PackedLinear
        module.pack(raw, ggml_type)

    def finish(self, model: nn.Module, keep_heap: bool = True) -> None:
        """After binding: dense bf16 projections read as stored, a decode plan per decoder layer, the model's
        decode_rows (DECODE_ROWS_BF16 when gemv_bf16 reads a weight of the decoder layers -- most of a step's
        reads --, else DECODE_ROWS: a bf16 matrix outside them, such as the E2B/E4B per-layer model projection
        llama.cpp's GGUFs keep in BF16, then takes gemv_bf16 up to DECODE_ROWS rows, slower there than the bf16
        GEMM but one matrix of the step). The process's heap keeps freed prefill temporaries from then on
        (kernels.keep_heap), or with keep_heap=False (streamed experts: a bounded process) hands them back."""
        for module in model.modules():
            if type(module) is QuantLinear and module.layout == "dense" and module.weight.dtype == torch.bfloat16:
                module.__class__ = Bf16Linear
        if isinstance(model, Model):
            kernels.keep_heap(keep_heap)
            bf16 = any(isinstance(m, Bf16Linear) for m in model.layers.modules())
            model.decode_rows = DECODE_ROWS_BF16 if bf16 else DECODE_ROWS
            for layer in model.layers:
                layer.plan = DecodePlan.of(layer, model.decode_rows)
        model.backend = self.name
