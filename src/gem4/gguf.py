"""Strict GGUF v2/v3 container: a reader (eager header parse, mmapped zero-copy tensor bytes) and a writer.

File layout (all little-endian):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count  x  (string key, u32 value_type, value)
    tensor_count  x  (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to `alignment`  ->  data section; each tensor at data_start + offset

    string = u64 byte length + UTF-8 bytes
    array  = u32 element type + u64 count + elements

The reader trusts nothing: every count, length and offset is checked against the bytes that are
actually left in the file *before* it is used, so a hostile header can neither allocate gigabytes
nor loop for long. Every problem raises `GGUFError` naming the file, the field and the byte offset.

Shapes: GGUF stores `ne` fastest-first; `TensorInfo.shape` is PyTorch order (= reversed `ne`).
"""
from __future__ import annotations

import enum
import mmap
import os
import pathlib
import struct
from dataclasses import dataclass

import numpy as np

from gem4.ggml import BLOCK_INFO, GEM4_TYPES, GGMLType, tensor_nbytes

__all__ = [
    "GGUFError",
    "GGUFValueType",
    "TensorInfo",
    "GGUFReader",
    "GGUFWriter",
    "GGUF_MAGIC",
    "GGUF_VERSION",
    "DEFAULT_ALIGNMENT",
    "GGML_MAX_DIMS",
]

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3                 # what the writer emits
SUPPORTED_VERSIONS = (2, 3)      # v1 used 32-bit counts and lengths; refused
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
GGML_MAX_DIMS = 4
MAX_ARRAY_NESTING = 8            # arrays of arrays deeper than this are refused (bounds recursion)
_INT64_MAX = 2**63 - 1


class GGUFError(ValueError):
    """A malformed or unsupported GGUF file. The message names the file, the field and the byte offset."""


class GGUFValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_VT = GGUFValueType
_VALUE_TYPES = frozenset(int(t) for t in GGUFValueType)
_GGML_TYPES = frozenset(int(t) for t in GGMLType if t not in GEM4_TYPES)

# Fixed-size value types: struct codec and the little-endian numpy dtype of an array of them.
_SCALAR_STRUCT: dict[GGUFValueType, struct.Struct] = {
    _VT.UINT8: struct.Struct("<B"),
    _VT.INT8: struct.Struct("<b"),
    _VT.UINT16: struct.Struct("<H"),
    _VT.INT16: struct.Struct("<h"),
    _VT.UINT32: struct.Struct("<I"),
    _VT.INT32: struct.Struct("<i"),
    _VT.FLOAT32: struct.Struct("<f"),
    _VT.BOOL: struct.Struct("<B"),
    _VT.UINT64: struct.Struct("<Q"),
    _VT.INT64: struct.Struct("<q"),
    _VT.FLOAT64: struct.Struct("<d"),
}
_ARRAY_DTYPE: dict[GGUFValueType, np.dtype] = {
    _VT.UINT8: np.dtype("<u1"),
    _VT.INT8: np.dtype("<i1"),
    _VT.UINT16: np.dtype("<u2"),
    _VT.INT16: np.dtype("<i2"),
    _VT.UINT32: np.dtype("<u4"),
    _VT.INT32: np.dtype("<i4"),
    _VT.FLOAT32: np.dtype("<f4"),
    _VT.BOOL: np.dtype("<u1"),          # stored as bytes, returned as np.bool_ after a 0/1 check
    _VT.UINT64: np.dtype("<u8"),
    _VT.INT64: np.dtype("<i8"),
    _VT.FLOAT64: np.dtype("<f8"),
}
_INT_TYPES = frozenset({_VT.UINT8, _VT.INT8, _VT.UINT16, _VT.INT16, _VT.UINT32, _VT.INT32, _VT.UINT64, _VT.INT64})
_FLOAT_TYPES = frozenset({_VT.FLOAT32, _VT.FLOAT64})
# The fewest bytes one element of an array of this type can occupy (for the up-front count check).
_MIN_ELEMENT_SIZE = {t: s.size for t, s in _SCALAR_STRUCT.items()}
_MIN_ELEMENT_SIZE[_VT.STRING] = 8          # u64 length, empty string
_MIN_ELEMENT_SIZE[_VT.ARRAY] = 4 + 8       # u32 type + u64 count, empty array
_MIN_KV_SIZE = 8 + 4 + 1                   # empty key, type, one-byte value
_MIN_TENSOR_INFO_SIZE = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")


def _align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # PyTorch order (= reversed GGUF ne)
    ggml_type: GGMLType
    offset: int              # absolute byte offset in the file
    nbytes: int


# --------------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------------


class _Parser:
    """Cursor over the file bytes; every read is bounds-checked. Used once by GGUFReader."""

    def __init__(self, buf, size: int, path: pathlib.Path):
        self.buf = buf
        self.size = size
        self.path = path
        self.pos = 0

    # -- errors and primitives --

    def error(self, at: int, what: str, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} at byte {at}: {problem}")

    def need(self, n: int, what: str) -> None:
        left = self.size - self.pos
        if n > left:
            raise self.error(
                self.pos, what,
                f"needs {n} bytes but only {left} remain (file is {self.size} bytes; truncated?)",
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"{what} (length)")
        left = self.size - self.pos
        if n > left:
            raise self.error(start, what, f"string length {n} runs past end of file ({left} bytes remain)")
        raw = self.buf[self.pos:self.pos + n]
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(start, what, f"string is not valid UTF-8 ({e.reason} at string byte {e.start})") from None
        self.pos += n
        return s

    def value_type(self, what: str) -> GGUFValueType:
        at = self.pos
        t = self.u32(what)
        if t not in _VALUE_TYPES:
            raise self.error(at, what, f"unknown value type {t}")
        return GGUFValueType(t)

    # -- values --

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0):
        if vtype == _VT.STRING:
            return self.string(what)
        if vtype == _VT.ARRAY:
            return self.array(what, depth)
        st = _SCALAR_STRUCT[vtype]
        at = self.pos
        self.need(st.size, what)
        (v,) = st.unpack_from(self.buf, at)
        self.pos += st.size
        if vtype == _VT.BOOL:
            if v > 1:
                raise self.error(at, what, f"bool value is {v}, not 0 or 1")
            return bool(v)
        return v

    def array(self, what: str, depth: int):
        """Returns (element type, value)."""
        start = self.pos
        etype = self.value_type(f"{what} (array element type)")
        count = self.u64(f"{what} (array count)")
        left = self.size - self.pos
        if count * _MIN_ELEMENT_SIZE[etype] > left:
            raise self.error(
                start, what,
                f"array of {count} {etype.name} elements needs at least {count * _MIN_ELEMENT_SIZE[etype]} bytes "
                f"but only {left} remain (file is {self.size} bytes)",
            )
        if etype == _VT.STRING:
            return etype, self.string_array(count, what)
        if etype == _VT.ARRAY:
            if depth + 1 >= MAX_ARRAY_NESTING:
                raise self.error(start, what, f"arrays nested deeper than {MAX_ARRAY_NESTING} levels")
            return etype, [self.array(f"{what}[{i}]", depth + 1)[1] for i in range(count)]
        dtype = _ARRAY_DTYPE[etype]
        end = self.pos + count * dtype.itemsize
        # Slicing copies the bytes out of the mmap: metadata arrays are small, and the reader can then
        # close its mmap even while the caller keeps these arrays. Backed by `bytes`, so read-only.
        arr = np.frombuffer(self.buf[self.pos:end], dtype=dtype)
        if etype == _VT.BOOL:
            bad = np.flatnonzero(arr > 1)
            if bad.size:
                i = int(bad[0])
                raise self.error(self.pos + i, f"{what}[{i}]", f"bool value is {int(arr[i])}, not 0 or 1")
            arr = arr.view(np.bool_)
        self.pos = end
        return etype, arr

    def string_array(self, count: int, what: str) -> list[str]:
        # The hot loop of the vocab GGUF (~780k strings): kept minimal, errors diagnosed after the fact.
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        i = 0
        try:
            for i in range(count):
                (n,) = unpack(buf, pos)
                end = pos + 8 + n
                if end > size:
                    break
                append(buf[pos + 8:end].decode("utf-8"))
                pos = end
        except (struct.error, UnicodeDecodeError):
            pass
        if len(out) != count:
            # Re-read the failing element with the checked reader to get the precise message.
            self.pos = pos
            self.string(f"{what}[{i}]")
            raise AssertionError("unreachable: string re-read did not fail")  # pragma: no cover
        self.pos = pos
        return out


class GGUFReader:
    """Parses a GGUF v2/v3 file eagerly and mmaps it read-only.

    Attributes: path, version, alignment, data_offset (start of the data section), metadata,
    metadata_types, array_types, tensors (name -> TensorInfo, in file order).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self._mm: mmap.mmap | None = None
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > 0:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        try:
            self._parse(self._mm if self._mm is not None else b"", size)
        except BaseException:
            self.close()
            raise

    # -- parsing --

    def _parse(self, buf, size: int) -> None:
        p = _Parser(buf, size, self.path)

        p.need(4, "magic")
        magic = bytes(buf[0:4])
        if magic != GGUF_MAGIC:
            raise p.error(0, "magic", f"expected {GGUF_MAGIC!r}, found {magic!r}: not a GGUF file")
        p.pos = 4
        version = p.u32("version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if version & 0xFFFF == 0 and 1 <= swapped <= 0xFFFF:
                raise p.error(4, "version", f"big-endian GGUF (version {swapped} byte-swapped) is not supported")
            raise p.error(4, "version", f"unsupported GGUF version {version} (supported: 2, 3)")
        self.version = version

        n_tensors = p.u64("tensor count")
        n_kv = p.u64("metadata kv count")
        left = size - p.pos
        if n_kv * _MIN_KV_SIZE > left:
            raise p.error(16, "metadata kv count", f"{n_kv} key-value pairs cannot fit in the {left} bytes left")
        if n_tensors * _MIN_TENSOR_INFO_SIZE > left:
            raise p.error(8, "tensor count", f"{n_tensors} tensor infos cannot fit in the {left} bytes left")

        # -- metadata --
        metadata: dict[str, object] = {}
        metadata_types: dict[str, GGUFValueType] = {}
        array_types: dict[str, GGUFValueType] = {}
        alignment = DEFAULT_ALIGNMENT
        for i in range(n_kv):
            kv_at = p.pos
            key = p.string(f"metadata key #{i}")
            if key in metadata:
                raise p.error(kv_at, f"metadata key {key!r}", "duplicate key")
            what = f"metadata key {key!r}"
            vtype = p.value_type(f"{what} (value type)")
            val_at = p.pos
            if vtype == _VT.ARRAY:
                etype, value = p.array(what, 0)
                array_types[key] = etype
            else:
                value = p.value(vtype, what)
            if key == ALIGNMENT_KEY:
                if vtype != _VT.UINT32:
                    raise p.error(val_at, what, f"must be UINT32, found {vtype.name}")
                if not _is_pow2(value):
                    raise p.error(val_at, what, f"alignment {value} is not a nonzero power of two")
                alignment = value
            metadata[key] = value
            metadata_types[key] = vtype
        self.metadata = metadata
        self.metadata_types = metadata_types
        self.array_types = array_types
        self.alignment = alignment

        # -- tensor infos --
        raw: list[tuple[int, str, tuple[int, ...], GGMLType, int, int]] = []
        seen: set[str] = set()
        for i in range(n_tensors):
            info_at = p.pos
            name = p.string(f"tensor #{i} name")
            what = f"tensor {name!r}"
            if name in seen:
                raise p.error(info_at, what, "duplicate tensor name")
            seen.add(name)
            dims_at = p.pos
            n_dims = p.u32(f"{what} n_dims")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise p.error(dims_at, what, f"n_dims {n_dims} is not in 1..{GGML_MAX_DIMS}")
            ne = []
            for j in range(n_dims):
                d_at = p.pos
                d = p.u64(f"{what} ne[{j}]")
                if d > _INT64_MAX:
                    raise p.error(d_at, what, f"ne[{j}] = {d} is negative as int64")
                ne.append(d)
            n_elements = 1
            for d in ne:
                n_elements *= d
            if n_elements > _INT64_MAX:
                raise p.error(dims_at, what, f"element count of ne {ne} overflows int64")
            type_at = p.pos
            t = p.u32(f"{what} ggml type")
            if t not in _GGML_TYPES or GGMLType(t) not in BLOCK_INFO:
                raise p.error(type_at, what, f"unknown ggml type {t}")
            ggml_type = GGMLType(t)
            block = BLOCK_INFO[ggml_type].block_size
            if ne[0] % block:
                raise p.error(
                    dims_at, what,
                    f"row length ne[0] = {ne[0]} is not a multiple of the {ggml_type.name} block size {block}",
                )
            nbytes = tensor_nbytes(ggml_type, n_elements)
            rel = p.u64(f"{what} offset")
            raw.append((info_at, name, tuple(reversed(ne)), ggml_type, rel, nbytes))

        data_offset = _align_up(p.pos, alignment)
        self.data_offset = data_offset

        # -- tensor extents --
        tensors: dict[str, TensorInfo] = {}
        for info_at, name, shape, ggml_type, rel, nbytes in raw:
            what = f"tensor {name!r}"
            if rel % alignment:
                raise p.error(info_at, what, f"data offset {rel} is not a multiple of the alignment {alignment}")
            start = data_offset + rel
            end = start + nbytes
            if end > size:
                raise p.error(start, what, f"extent [{start}, {end}) runs past end of file ({size} bytes)")
            tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
        by_start = sorted((t for t in tensors.values() if t.nbytes), key=lambda t: t.offset)
        for a, b in zip(by_start, by_start[1:]):
            if b.offset < a.offset + a.nbytes:
                raise p.error(
                    b.offset, f"tensor {b.name!r}",
                    f"extent [{b.offset}, {b.offset + b.nbytes}) overlaps tensor {a.name!r} "
                    f"[{a.offset}, {a.offset + a.nbytes})",
                )
        self.tensors = tensors

    # -- access --

    def tensor_data(self, name: str) -> np.ndarray:
        """Zero-copy read-only uint8 view of the tensor's bytes in the mmap."""
        info = self.tensors[name]
        if info.nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        if self._mm is None:
            raise ValueError(f"{self.path}: reader is closed")
        return np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def release(self, name: str) -> None:
        """Drop the whole pages of tensor `name` from this process's memory (madvise DONTNEED).

        For a caller that has copied the tensor: the file's pages stay in the page cache, and a later read
        through a view faults them back in, so nothing is lost."""
        info = self.tensors[name]
        if self._mm is None or info.nbytes == 0:
            return
        page = mmap.PAGESIZE
        start = -(-info.offset // page) * page                      # whole pages inside the tensor only
        end = (info.offset + info.nbytes) // page * page
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # Views from tensor_data() are still alive; they keep the mapping until they are freed.
                pass

    def __enter__(self) -> "GGUFReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFReader({str(self.path)!r}, version={self.version}, "
                f"{len(self.metadata)} keys, {len(self.tensors)} tensors)")


# --------------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------------

_NP_TO_VT = {np.dtype(d).newbyteorder("<"): t for t, d in _ARRAY_DTYPE.items() if t != _VT.BOOL}
# numpy dtypes accepted as tensor data for each ggml type, besides raw uint8 bytes.
_NATURAL_TENSOR_DTYPES = {
    GGMLType.F32: (np.dtype(np.float32),),
    GGMLType.F16: (np.dtype(np.float16),),
    GGMLType.BF16: (np.dtype(np.uint16), np.dtype(np.int16)),   # numpy has no bfloat16: the raw bits
    GGMLType.F64: (np.dtype(np.float64),),
    GGMLType.I8: (np.dtype(np.int8),),
    GGMLType.I16: (np.dtype(np.int16),),
    GGMLType.I32: (np.dtype(np.int32),),
    GGMLType.I64: (np.dtype(np.int64),),
}


def _enc_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return _U64.pack(len(b)) + b


def _infer_scalar_type(value) -> GGUFValueType:
    if isinstance(value, (bool, np.bool_)):
        return _VT.BOOL
    if isinstance(value, np.integer):
        return _NP_TO_VT[value.dtype.newbyteorder("<")]
    if isinstance(value, int):
        if -(2**31) <= value < 2**31:
            return _VT.INT32
        if -(2**63) <= value < 2**63:
            return _VT.INT64
        return _VT.UINT64
    if isinstance(value, (float, np.floating)):
        return _VT.FLOAT32
    if isinstance(value, str):
        return _VT.STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        return _VT.ARRAY
    raise TypeError(f"cannot infer a GGUF value type for {type(value).__name__}")


def _infer_element_type(values) -> GGUFValueType:
    if isinstance(values, np.ndarray):
        if values.dtype == np.bool_:
            return _VT.BOOL
        if values.dtype.kind == "U":
            return _VT.STRING
        if values.dtype.kind == "f" and values.dtype.itemsize < 4:
            return _VT.FLOAT32
        t = _NP_TO_VT.get(values.dtype.newbyteorder("<"))
        if t is None:
            raise TypeError(f"no GGUF element type for numpy dtype {values.dtype}")
        return t
    if len(values) == 0:
        raise ValueError("cannot infer the element type of an empty array; pass array_type")
    if all(isinstance(v, str) for v in values):
        return _VT.STRING
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return _VT.BOOL
    if all(isinstance(v, (list, tuple, np.ndarray)) for v in values):
        return _VT.ARRAY
    if any(isinstance(v, (bool, np.bool_)) for v in values):
        raise TypeError("array mixes bools with other types")
    if all(isinstance(v, (int, np.integer)) for v in values):
        lo, hi = min(int(v) for v in values), max(int(v) for v in values)
        if -(2**31) <= lo and hi < 2**31:
            return _VT.INT32
        if -(2**63) <= lo and hi < 2**63:
            return _VT.INT64
        return _VT.UINT64
    if all(isinstance(v, (int, float, np.integer, np.floating)) for v in values):
        return _VT.FLOAT32
    raise TypeError(f"cannot infer one element type for {sorted({type(v).__name__ for v in values})}")


def _enc_scalar(value, vtype: GGUFValueType) -> bytes:
    if vtype == _VT.STRING:
        if not isinstance(value, str):
            raise TypeError(f"STRING value must be str, got {type(value).__name__}")
        return _enc_str(value)
    if vtype == _VT.BOOL:
        if not isinstance(value, (bool, np.bool_)) and value not in (0, 1):
            raise ValueError(f"BOOL value must be a bool, got {value!r}")
        return bytes([1 if value else 0])
    if vtype in _INT_TYPES:
        if isinstance(value, (float, np.floating)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{vtype.name} value must be an integer, got {value!r}")
        value = int(value)
    elif vtype in _FLOAT_TYPES:
        if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{vtype.name} value must be a number, got {value!r}")
        value = float(value)
    try:
        return _SCALAR_STRUCT[vtype].pack(value)
    except (struct.error, OverflowError) as e:
        raise ValueError(f"{value!r} does not fit in {vtype.name}: {e}") from None


def _enc_array(values, etype: GGUFValueType | None, depth: int = 0) -> bytes:
    """u32 element type + u64 count + elements."""
    if depth >= MAX_ARRAY_NESTING:
        raise ValueError(f"arrays nested deeper than {MAX_ARRAY_NESTING} levels")
    if isinstance(values, np.ndarray) and values.ndim != 1:
        raise ValueError(f"array values must be 1-D, got shape {values.shape}")
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise TypeError(f"array value must be a list, tuple or 1-D numpy array, got {type(values).__name__}")
    etype = _infer_element_type(values) if etype is None else GGUFValueType(etype)
    head = _U32.pack(etype) + _U64.pack(len(values))
    if etype == _VT.STRING:
        items = values.tolist() if isinstance(values, np.ndarray) else values
        return head + b"".join(_enc_scalar(v, _VT.STRING) for v in items)
    if etype == _VT.ARRAY:
        return head + b"".join(_enc_array(v, None, depth + 1) for v in values)
    arr = np.asarray(values)
    if arr.size == 0:
        return head
    kind = arr.dtype.kind
    if etype == _VT.BOOL:
        if kind == "b":
            pass
        elif kind in "iu" and ((arr == 0) | (arr == 1)).all():
            arr = arr != 0
        else:
            raise ValueError(f"BOOL array elements must be bools, got dtype {arr.dtype}")
        return head + arr.astype(np.uint8).tobytes()
    dtype = _ARRAY_DTYPE[etype]
    if etype in _INT_TYPES:
        if kind not in "iu":
            raise TypeError(f"{etype.name} array elements must be integers, got dtype {arr.dtype}")
        info = np.iinfo(dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            raise ValueError(f"array values [{lo}, {hi}] do not fit in {etype.name}")
    elif kind not in "iuf":
        raise TypeError(f"{etype.name} array elements must be numbers, got dtype {arr.dtype}")
    return head + arr.astype(dtype).tobytes()


def _tensor_bytes(name: str, data, ggml_type: GGMLType) -> memoryview:
    if isinstance(data, (bytes, bytearray, memoryview)):
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise ValueError(f"tensor {name!r}: data buffer is not contiguous")
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if isinstance(data, np.ndarray):
        natural = _NATURAL_TENSOR_DTYPES.get(ggml_type, ())
        base = data.dtype.newbyteorder("=") if data.dtype.byteorder not in "=|" else data.dtype
        if base != np.uint8 and base not in natural:
            allowed = ", ".join(str(d) for d in (*natural, np.dtype(np.uint8)))
            raise TypeError(f"tensor {name!r}: {ggml_type.name} data must have dtype {allowed}, got {data.dtype}")
        arr = np.ascontiguousarray(data, dtype=base.newbyteorder("<"))
        return memoryview(arr.reshape(-1).view(np.uint8))
    raise TypeError(f"tensor {name!r}: data must be a numpy array or bytes, got {type(data).__name__}")


class GGUFWriter:
    """Collects metadata and tensors, then `write()` emits a GGUF v3 little-endian file.

    Keys and tensors are written in the order added. Tensor data is referenced, not copied, until
    `write()` streams it to the file, each tensor aligned to `alignment`.
    """

    def __init__(self, path: str | os.PathLike, alignment: int = DEFAULT_ALIGNMENT):
        if not isinstance(alignment, int) or not _is_pow2(alignment) or alignment >= 2**32:
            raise ValueError(f"alignment {alignment!r} is not a power of two that fits in u32")
        self.path = pathlib.Path(path)
        self.alignment = alignment
        self._kv: dict[str, bytes] = {}
        self._tensors: dict[str, tuple[tuple[int, ...], GGMLType, int, memoryview]] = {}

    def add(self, key: str, value, vtype: GGUFValueType | None = None,
            array_type: GGUFValueType | None = None) -> None:
        if not isinstance(key, str):
            raise TypeError(f"key must be str, got {type(key).__name__}")
        if key in self._kv:
            raise ValueError(f"duplicate key {key!r}")
        vtype = _infer_scalar_type(value) if vtype is None else GGUFValueType(vtype)
        if key == ALIGNMENT_KEY and (vtype != _VT.UINT32 or value != self.alignment):
            raise ValueError(f"{ALIGNMENT_KEY} must be UINT32 {self.alignment}; set it with GGUFWriter(alignment=...)")
        try:
            payload = _enc_array(value, array_type) if vtype == _VT.ARRAY else _enc_scalar(value, vtype)
        except (TypeError, ValueError) as e:
            raise type(e)(f"key {key!r}: {e}") from None
        self._kv[key] = _enc_str(key) + _U32.pack(vtype) + payload

    def add_tensor(self, name: str, data, shape: tuple[int, ...], ggml_type: GGMLType) -> None:
        if not isinstance(name, str):
            raise TypeError(f"tensor name must be str, got {type(name).__name__}")
        if name in self._tensors:
            raise ValueError(f"duplicate tensor name {name!r}")
        ggml_type = GGMLType(ggml_type)
        if ggml_type in GEM4_TYPES:
            raise ValueError(f"tensor {name!r}: {ggml_type.name} is gem4's own block type, not GGML's: a GGUF cannot hold it")
        shape = tuple(int(d) for d in shape)
        if not 1 <= len(shape) <= GGML_MAX_DIMS or any(d < 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape} must have 1..{GGML_MAX_DIMS} non-negative dims")
        ne = shape[::-1]
        block = BLOCK_INFO[ggml_type].block_size
        if ne[0] % block:
            raise ValueError(f"tensor {name!r}: row length {ne[0]} is not a multiple of the "
                             f"{ggml_type.name} block size {block}")
        n_elements = 1
        for d in ne:
            n_elements *= d
        nbytes = tensor_nbytes(ggml_type, n_elements)
        mv = _tensor_bytes(name, data, ggml_type)
        if mv.nbytes != nbytes:
            raise ValueError(f"tensor {name!r}: {ggml_type.name} {shape} needs {nbytes} bytes, got {mv.nbytes}")
        self._tensors[name] = (ne, ggml_type, nbytes, mv)

    def write(self) -> None:
        kvs = list(self._kv.values())
        if self.alignment != DEFAULT_ALIGNMENT and ALIGNMENT_KEY not in self._kv:
            kvs.insert(0, _enc_str(ALIGNMENT_KEY) + _U32.pack(_VT.UINT32) + _U32.pack(self.alignment))
        a = self.alignment
        with open(self.path, "wb") as f:
            f.write(_HEADER.pack(GGUF_MAGIC, GGUF_VERSION, len(self._tensors), len(kvs)))
            for kv in kvs:
                f.write(kv)
            rel = 0
            for name, (ne, ggml_type, nbytes, _) in self._tensors.items():
                info = [_enc_str(name), _U32.pack(len(ne))]
                info += [_U64.pack(d) for d in ne]
                info += [_U32.pack(ggml_type), _U64.pack(rel)]
                f.write(b"".join(info))
                rel = _align_up(rel + nbytes, a)
            pos = f.tell()
            f.write(bytes(_align_up(pos, a) - pos))
            for ne, ggml_type, nbytes, mv in self._tensors.values():
                f.write(mv)
                f.write(bytes(_align_up(nbytes, a) - nbytes))
