"""MLX affine checkpoints (mlx_lm.convert, mlx-community's `-4bit` / `-8bit` repos): HF-style safetensors whose
quantized modules are stored as three tensors instead of one float weight (docs/fast-mode.md).

    <module>.weight   uint32 [..., out, in * bits / 32]   the quants, packed little-endian, low bits first:
                                                       weight j of a row is bits (j * bits) % 32 .. of word j * bits / 32
    <module>.scales   bf16 / f16 / f32 [..., out, in / group_size]
    <module>.biases   the same shape and dtype         w[j] = scales[j / group_size] * q[j] + biases[j / group_size]

config.json's `quantization` says `group_size` (32, 64 or 128), `bits` (4 or 8) and `mode` ("affine"; absent in
older files); an entry keyed by a module's path (the file's tensor name without `.weight`) overrides them for
that module: an object with its own `group_size` / `bits` (mlx_lm keeps Gemma 4's router at 8 bits, group 64), or
`false` for a module left in float. A module counts as quantized where the file has its `.scales`.

The values are kept as they are: each quantized weight is regrouped, losslessly, into gem4's 32-weight blocks
(gem4.ggml MLX_A4 / MLX_A8: the scale and bias of a group of 64 or 128 repeated in each of its 32-weight blocks,
the 4-bit quants in Q4_1's nibble order), which the CPU backend repacks for its kernels like any GGML type and
the float32 mode dequantizes (`dense`). Scales and biases stored in bf16 (what mlx-community publishes) go into
the blocks as they are; f16 ones take Q4_1 itself for 4 bits (the same arithmetic with f16 fields) and bf16 for
8 bits where they convert exactly; f32 ones the first 16-bit type that holds every value exactly. A weight whose
scales fit no 16-bit type is refused by name in the fast mode (the float32 mode reads it).

Kept in float32 whatever the file: the 26B-A4B router (as for every format: weights/loader.py), dequantized once
from its 8-bit values (exact). The 26B-A4B experts (mlx_lm's `experts.switch_glu.{gate,up,down}_proj`, one
[E, out, in] tensor each) become the model's `experts.gate_up_proj` (gate's rows, then up's, per expert) and
`experts.down_proj`.
"""
from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gem4.ggml import GGMLType, dequantize_affine
from gem4.weights.checkpoint import CheckpointError, TensorEntry

GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)
SCALE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# mlx_lm's names of 26B-A4B's experts -> the model's (gate and up become one tensor)
SWITCH = "experts.switch_glu."
KEEP_FLOAT = ("router.proj.weight",)
BLOCK_ROWS_ELEMS = 1 << 22                 # weights regrouped at a time (AffineTensor.blocks)       # dequantized to float32 at load (weights/loader.py keeps them float32)


@dataclass(frozen=True)
class Quantization:
    group_size: int
    bits: int
    overrides: dict[str, dict | bool]      # module path -> {"group_size", "bits"} or False

    def of(self, module: str) -> tuple[int, int] | None:
        """(group_size, bits) of a module path, None where config.json says it stays in float."""
        entry = self.overrides.get(module, True)
        if entry is False:
            return None
        if entry is True:
            return self.group_size, self.bits
        return entry["group_size"], entry["bits"]


def _params(value: dict, where: str) -> tuple[int, int]:
    group, bits = value.get("group_size"), value.get("bits")
    mode = value.get("mode", "affine")
    if mode != "affine":
        raise CheckpointError(f"{where}: quantization mode {mode!r} is not supported (gem4 reads MLX's 'affine')")
    if group not in GROUP_SIZES or isinstance(group, bool):
        raise CheckpointError(f"{where}: quantization group_size {group!r} is not one of {GROUP_SIZES}")
    if bits not in BITS or isinstance(bits, bool):
        raise CheckpointError(f"{where}: quantization bits {bits!r} is not one of {BITS}")
    return group, bits


def quantization(cfg: dict, where: Path) -> Quantization | None:
    """config.json's `quantization` (or `quantization_config`, which mlx_lm writes as its copy) -> Quantization;
    None for a float checkpoint. Refuses other quantization methods (an HF `quant_method`) by name."""
    q = cfg.get("quantization", cfg.get("quantization_config"))
    if q is None:
        return None
    if not isinstance(q, dict) or "quant_method" in q:
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise CheckpointError(f"{where}: quantization {method!r} is not supported (gem4 reads float safetensors, "
                              "MLX affine quantization and GGUF)")
    group, bits = _params(q, f"{where}: quantization")
    overrides: dict[str, dict | bool] = {}
    for key, value in q.items():
        if isinstance(value, dict):
            g, b = _params(value, f"{where}: quantization[{key!r}]")
            overrides[key] = {"group_size": g, "bits": b}
        elif value is False:
            overrides[key] = False
    return Quantization(group, bits, overrides)


def _kernels_available() -> bool:
    from gem4.model import kernels

    return kernels.available()


def _bytes16(t: torch.Tensor) -> torch.Tensor:
    """[..., n] 16-bit floats -> [..., n, 2] uint8 (little-endian)."""
    return t.contiguous().view(torch.uint8).reshape(*t.shape, 2)


def _exactly(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """t in `dtype` where every value converts exactly (NaN for NaN), else None."""
    if t.dtype == dtype:
        return t
    c = t.to(dtype)
    back = c.to(t.dtype)
    same = (back == t) | (torch.isnan(back) & torch.isnan(t))
    return c if bool(same.all()) else None


class AffineTensor:
    """One quantized weight of the file ([..., out, in] logically): its three tensors, read on demand.
    `files`: the file names of weight, scales and biases (26B-A4B's experts are streamed from them)."""

    files: tuple[str, str, str] = ()

    def __init__(self, name: str, weight, scales, biases, group: int, bits: int):
        self.name, self.group, self.bits = name, group, bits
        self._weight, self._scales, self._biases = weight, scales, biases     # callables -> tensors

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._weight(), self._scales(), self._biases()

    def dense(self) -> torch.Tensor:
        """float32 [..., out, in]: (scale * q) + bias, the format's values (gem4.ggml.dequantize_affine)."""
        return dequantize_affine(*self.parts(), self.bits, self.group)

    def blocks(self) -> tuple[torch.Tensor, GGMLType]:
        """gem4's 32-weight blocks of it, uint8 [..., out, in / 32 * block bytes], and their type (module doc);
        made BLOCK_ROWS_ELEMS weights at a time (the temporaries stay small whatever the tensor)."""
        w, s, b = self.parts()
        (s16, b16), ggml_type = self._fields(s, b)
        *lead, cols = w.shape
        n_in = cols * 32 // self.bits
        block_bytes = 20 if self.bits == 4 else 36
        w, s16, b16 = (t.reshape(-1, t.shape[-1]) for t in (w, s16, b16))
        if ggml_type != GGMLType.Q4_1 and _kernels_available():       # the same bytes, in one compiled pass
            from gem4.model import kernels

            return kernels.affine_blocks(w.view(torch.int32), s16, b16, self.bits, self.group).reshape(*lead, -1), ggml_type
        out = torch.empty(w.shape[0], n_in // 32 * block_bytes, dtype=torch.uint8)
        step = max(1, BLOCK_ROWS_ELEMS // n_in)
        for r in range(0, w.shape[0], step):
            out[r:r + step] = self._block_rows(w[r:r + step], s16[r:r + step], b16[r:r + step])
        return out.reshape(*lead, -1), ggml_type

    def _block_rows(self, w: torch.Tensor, s16: torch.Tensor, b16: torch.Tensor) -> torch.Tensor:
        """Rows of the packed words and their 16-bit scales / biases -> their blocks [rows, in / 32 * bytes]."""
        q = w.contiguous().view(torch.uint8)                 # little-endian words: byte k = weights of bits 8k..
        if self.bits == 4:
            q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(q.shape[0], -1)
        qb = q.reshape(q.shape[0], -1, 32)
        if self.bits == 4:                                  # Q4_1's order: byte j holds weights j (low) and j + 16
            qb = qb[..., :16] | (qb[..., 16:] << 4)
        rep = self.group // 32                              # 32-weight blocks per group
        s16, b16 = (f.repeat_interleave(rep, dim=-1) for f in (s16, b16))
        return torch.cat([_bytes16(s16), _bytes16(b16), qb], dim=-1).reshape(q.shape[0], -1)

    def _fields(self, s: torch.Tensor, b: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], GGMLType]:
        """The scales and biases in the 16-bit type of the blocks, exactly, and the block type (module doc)."""
        own = GGMLType.MLX_A4 if self.bits == 4 else GGMLType.MLX_A8
        choices = [(torch.bfloat16, own)] + ([(torch.float16, GGMLType.Q4_1)] if self.bits == 4 else [])
        if s.dtype == torch.float16 and self.bits == 4:
            choices = choices[::-1]                         # f16: Q4_1 itself first
        for dtype, t in choices:
            fs, fb = _exactly(s, dtype), _exactly(b, dtype)
            if fs is not None and fb is not None:
                return (fs, fb), t
        raise CheckpointError(f"tensor {self.name!r}: its {str(s.dtype).removeprefix('torch.')} scales and biases fit "
                              f"no 16-bit type exactly, which gem4's {self.bits}-bit kernels read; load it in float32 mode")


def affine_tensors(names: dict[str, str], shape_of, dtype_of, read, quant: Quantization, where: Path
                   ) -> tuple[dict[str, str], dict[str, AffineTensor]]:
    """Split a checkpoint's canonical names (canonical -> file name) into its float tensors and its quantized
    weights (canonical name of the weight -> AffineTensor), with 26B-A4B's switch_glu experts renamed and gate /
    up joined. shape_of / dtype_of / read(file name) give a tensor's shape, safetensors dtype and data.
    Refuses, by name, a `.weight` without its `.scales` or `.biases` (and the reverse), a weight that is not
    uint32, and shapes that disagree with each other or with config.json's bits and group size."""
    floats: dict[str, str] = {}
    affine: dict[str, AffineTensor] = {}
    for c, name in names.items():
        if c.endswith((".scales", ".biases")):
            base = c.rsplit(".", 1)[0]
            if base + ".weight" not in names:
                raise CheckpointError(f"{where}: tensor {name!r} has no {base}.weight beside it")
            continue
        base = c.removesuffix(".weight")
        has_scales, has_biases = base + ".scales" in names, base + ".biases" in names
        if not (c.endswith(".weight") and (has_scales or has_biases)):
            floats[c] = name
            continue
        if not (has_scales and has_biases):
            missing = ".biases" if has_scales else ".scales"
            raise CheckpointError(f"{where}: quantized tensor {name!r} has no {name.removesuffix('.weight')}{missing}")
        module = name.removesuffix(".weight")
        params = quant.of(module)
        if params is None:
            raise CheckpointError(f"{where}: config.json's quantization says {module!r} is not quantized, "
                                  f"but the file has its scales")
        group, bits = params
        s_name, b_name = names[base + ".scales"], names[base + ".biases"]
        w_shape, s_shape, b_shape = shape_of(name), shape_of(s_name), shape_of(b_name)
        if dtype_of(name) != "U32":
            raise CheckpointError(f"{where}: quantized tensor {name!r} is {dtype_of(name)}, not U32 (packed quants)")
        for other in (s_name, b_name):
            if dtype_of(other) not in SCALE_DTYPES:
                raise CheckpointError(f"{where}: tensor {other!r} is {dtype_of(other)}, not one of {sorted(SCALE_DTYPES)}")
        n_in = w_shape[-1] * 32 // bits if w_shape else 0
        if (len(w_shape) < 2 or s_shape != b_shape or tuple(s_shape[:-1]) != tuple(w_shape[:-1])
                or n_in % group or s_shape[-1] * group != n_in):
            raise CheckpointError(
                f"{where}: quantized tensor {name!r} {tuple(w_shape)} disagrees with {s_name!r} {tuple(s_shape)} "
                f"and {b_name!r} {tuple(b_shape)} for {bits}-bit quants in groups of {group} (config.json quantization)")
        logical = (*w_shape[:-1], n_in)
        tensor = AffineTensor(c, lambda n=name: read(n), lambda n=s_name: read(n), lambda n=b_name: read(n), group, bits)
        tensor.shape, tensor.files = logical, (name, s_name, b_name)
        affine[c] = tensor
    _join_experts(affine, floats, shape_of, dtype_of, read, where)
    return floats, affine


class JoinedExperts(AffineTensor):
    """26B-A4B's gate_up_proj from mlx_lm's separate gate and up experts: [E, 2 * I, H], gate's rows first."""

    def __init__(self, name: str, gate: AffineTensor, up: AffineTensor):
        super().__init__(name, None, None, None, gate.group, gate.bits)
        self.gate, self.up = gate, up
        self.shape = (gate.shape[0], 2 * gate.shape[1], gate.shape[2])

    def parts(self):
        return tuple(torch.cat([g, u], dim=-2) for g, u in zip(self.gate.parts(), self.up.parts()))

    @property
    def files(self):
        return self.gate.files + self.up.files


class FloatExperts:
    """gate_up_proj from mlx_lm's separate gate and up experts left in float (their input width is not a multiple
    of the group size)."""

    def __init__(self, name: str, gate: str, up: str, shape_of, dtype_of, read):
        self.name, self.gate, self.up, self.read = name, gate, up, read
        e, rows, k = shape_of(gate)
        self.shape, self.stored = (e, 2 * rows, k), dtype_of(gate)

    def dense(self) -> torch.Tensor:
        return torch.cat([self.read(self.gate), self.read(self.up)], dim=-2)


def _join_experts(affine: dict, floats: dict[str, str], shape_of, dtype_of, read, where: Path) -> None:
    for c in [c for c in floats if SWITCH + "gate_proj" in c]:
        prefix = c.split(SWITCH)[0]
        up = prefix + SWITCH + "up_proj.weight"
        if up not in floats:
            raise CheckpointError(f"{where}: {c!r} has no float {up!r} beside it")
        gate_name, up_name = floats.pop(c), floats.pop(up)
        if shape_of(gate_name) != shape_of(up_name) or dtype_of(gate_name) != dtype_of(up_name):
            raise CheckpointError(f"{where}: {gate_name!r} and {up_name!r} differ in shape or dtype")
        affine[prefix + "experts.gate_up_proj"] = FloatExperts(prefix + "experts.gate_up_proj", gate_name, up_name,
                                                               shape_of, dtype_of, read)
    for c in [c for c in floats if SWITCH + "down_proj" in c]:
        floats[c.split(SWITCH)[0] + "experts.down_proj"] = floats.pop(c)
    for c in [c for c in affine if SWITCH + "gate_proj" in c]:
        prefix = c.split(SWITCH)[0]
        up = prefix + SWITCH + "up_proj.weight"
        gate = affine.pop(c)
        if up not in affine:
            raise CheckpointError(f"{where}: {c!r} has no quantized {up!r} beside it")
        up_t = affine.pop(up)
        if (gate.group, gate.bits, gate.shape) != (up_t.group, up_t.bits, up_t.shape):
            raise CheckpointError(f"{where}: {c!r} and {up!r} are quantized differently; gem4 joins them into one tensor")
        affine[prefix + "experts.gate_up_proj"] = JoinedExperts(prefix + "experts.gate_up_proj", gate, up_t)
    for c in [c for c in affine if SWITCH + "down_proj" in c]:
        t = affine.pop(c)
        t.name = c.split(SWITCH)[0] + "experts.down_proj"
        affine[t.name] = t
    left = [c for c in [*affine, *floats] if SWITCH in c]
    if left:
        raise CheckpointError(f"{where}: tensor {left[0]!r} is not an expert weight gem4 knows "
                              "(switch_glu.gate_proj / up_proj / down_proj, quantized)")


# ---- 26B-A4B's experts streamed from the safetensors files (weights/expert_stream.py) ----

TORCH_DTYPES = {"U32": torch.int32, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@functools.lru_cache(maxsize=16)
def tensor_ranges(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """A safetensors file's tensors: name -> (dtype, shape, absolute byte offset of its data). The format: a
    little-endian u64 header length N, N bytes of JSON (each tensor's dtype, shape and data_offsets, relative
    to the end of the header), then the data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {name: (v["dtype"], tuple(v["shape"]), 8 + n + v["data_offsets"][0])
            for name, v in header.items() if name != "__metadata__"}


class StreamedExperts:
    """One layer's expert weight (gate_up_proj or down_proj) read one expert at a time from the file: the
    interface of expert_files.ExpertTensor (`expert(file, e)`, `nbytes`), reading its own byte ranges (each of
    the expert's weight / scales / biases tensors, gate's then up's) rather than the one range of a GGUF tensor,
    and turning them into the slot's layout: the kernels' packed rows or the dense weight in `dtype`."""

    def __init__(self, t: AffineTensor | None, names: tuple[str, ...], shape: tuple[int, ...], located: dict[str, Path],
                 packed: bool, dtype: torch.dtype):
        from gem4.weights.expert_files import RawFile

        self.t, self.shape, self.packed, self.dtype = t, shape, packed, dtype
        self.ranges = []                                     # (RawFile, offset of expert 0, bytes per expert, dtype, shape)
        handles: dict[Path, RawFile] = {}
        for name in names:
            path = located[name]
            if path not in handles:
                handles[path] = RawFile(path)
            dtype_name, shape, offset = tensor_ranges(path)[name]
            per = math.prod(shape[1:]) * TORCH_DTYPES[dtype_name].itemsize
            self.ranges.append((handles[path], offset, per, TORCH_DTYPES[dtype_name], shape[1:]))
        self.path = located[names[0]]
        self.nbytes = sum(r[2] for r in self.ranges)
        if t is None:                                        # left in float: one tensor, or gate's and up's
            return
        scales = self.ranges[1][3]
        if packed and scales != torch.bfloat16:
            raise CheckpointError(f"{self.path}: {t.name!r}: streamed packed experts need bf16 scales and biases, "
                                  f"the file has {str(scales).removeprefix('torch.')}")
        self.ggml_type = GGMLType.MLX_A4 if t.bits == 4 else GGMLType.MLX_A8

    def expert(self, file, e: int) -> torch.Tensor:
        """Expert e in the slot's layout (`file`, the GGUF's handle in ExpertTensor, is not used)."""
        # read() gives a view into its aligned pages at the range's offset: cloned where that is not on an element
        parts = [_typed(f.read(offset + e * per, per), dtype).view(shape) for f, offset, per, dtype, shape in self.ranges]
        rows, k = self.shape[1:]
        if self.t is None:
            return torch.cat(parts, dim=-2).to(self.dtype)
        one = AffineTensor(self.t.name, *(lambda p=p: p for p in parts[:3]), self.t.group, self.t.bits)
        one.shape = self.t.shape[1:]
        if len(parts) == 6:                                  # gate, then up
            up = AffineTensor(self.t.name, *(lambda p=p: p for p in parts[3:]), self.t.group, self.t.bits)
            up.shape = one.shape
            one = JoinedExperts(self.t.name, _lead(one), _lead(up))
        if not self.packed:
            return one.dense().reshape(rows, k).to(self.dtype)
        from gem4.model import kernels

        raw, _ = one.blocks()
        return kernels.repack(raw.reshape(-1), rows, k, self.ggml_type)

    def close(self) -> None:
        for f, *_ in self.ranges:
            f.close()


def mapped(path: Path, name: str) -> torch.Tensor:
    """Tensor `name` of a safetensors file as a view of the file's pages (mmap, copy-on-write: never written), so a
    table read by rows costs only the pages its rows touch."""
    import numpy as np

    dtype_name, shape, offset = tensor_ranges(path)[name]
    dtype = TORCH_DTYPES[dtype_name]
    pages = np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(math.prod(shape) * dtype.itemsize,))
    return torch.from_numpy(pages).view(dtype).view(shape)


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (raw if raw.storage_offset() % dtype.itemsize == 0 else raw.clone()).view(dtype)


def _lead(t: AffineTensor) -> AffineTensor:
    """t with a leading expert dimension of 1 (JoinedExperts joins [E, rows, k] tensors)."""
    t.shape = (1, *t.shape)
    return t


EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")


def entry(t: AffineTensor | FloatExperts, located: dict[str, Path]) -> TensorEntry:
    """The loader's view of a quantized weight: `raw` gives the blocks (packed by the backend), `dense` the values
    in float32; the router (KEEP_FLOAT) offers only `dense`. 26B-A4B's expert weights also `stream`
    (StreamedExperts), and so do float ones (`float_entry`). located: file tensor name -> its file."""
    n = math.prod(t.shape)
    if isinstance(t, FloatExperts):
        stream = lambda packed, dtype: StreamedExperts(None, (t.gate, t.up), t.shape, located, packed, dtype)  # noqa: E731
        return TensorEntry(name=t.name, shape=t.shape, stored=t.stored, nbytes=SCALE_DTYPES[t.stored].itemsize * n,
                           dense=t.dense, stream=stream)
    block_bytes = 20 if t.bits == 4 else 36
    stored = f"MLX_A{t.bits}"
    raw = None if t.name.endswith(KEEP_FLOAT) else t.blocks
    stream = None
    if t.name.endswith(EXPERT_WEIGHTS):
        stream = lambda packed, dtype: StreamedExperts(t, t.files, t.shape, located, packed, dtype)  # noqa: E731
    return TensorEntry(name=t.name, shape=tuple(t.shape), stored=stored, nbytes=n // 32 * block_bytes, dense=t.dense,
                       raw=raw, stream=stream, affine=lambda: (*(mapped(located[n], n) for n in t.files), t.bits, t.group))


def float_entry(e: TensorEntry, file_name: str, located: dict[str, Path]) -> TensorEntry:
    """A float expert weight of an MLX checkpoint (mlx_lm's down_proj where its input width is not a multiple of
    the group size) with its `stream`."""
    if not e.name.endswith(EXPERT_WEIGHTS):
        return e
    return replace(e, stream=lambda packed, dtype: StreamedExperts(None, (file_name,), e.shape, located, packed, dtype))
