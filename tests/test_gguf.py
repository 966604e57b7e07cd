"""GGUF reader/writer: round trips (ours and the `gguf` package as oracle), the real vocab file,
crafted malformed files, exhaustive truncation and a byte-mutation fuzz."""
from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from text_fixtures import vocab_gguf
from gem4.gguf import GGUFError, GGUFReader, GGUFValueType as VT, GGUFWriter, TensorInfo
from gem4.ggml import GGMLType, tensor_nbytes

gguf = pytest.importorskip("gguf")  # test-only oracle



# --------------------------------------------------------------------------------------------------
# A tiny raw GGUF byte builder for crafted files
# --------------------------------------------------------------------------------------------------

def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def header(n_tensors: int, n_kv: int, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + u32(version) + u64(n_tensors) + u64(n_kv)


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, VT.UINT32, u32(v))


def tinfo(name: str, ne: list[int], ggml_type: int = GGMLType.F32, offset: int = 0) -> bytes:
    return gstr(name) + u32(len(ne)) + b"".join(u64(d) for d in ne) + u32(ggml_type) + u64(offset)


def gguf_bytes(kvs=(), infos=(), data: bytes = b"", alignment: int = 32, n_tensors=None, n_kv=None) -> bytes:
    body = header(len(infos) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    body += b"".join(kvs) + b"".join(infos)
    body += bytes(-len(body) % alignment)
    return body + data


F32_16 = bytes(range(64))  # 16 float32 elements of data


# --------------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------------

RNG = np.random.default_rng(0)

SCALARS = {
    "t.u8": (200, VT.UINT8),
    "t.i8": (-100, VT.INT8),
    "t.u16": (60000, VT.UINT16),
    "t.i16": (-30000, VT.INT16),
    "t.u32": (4_000_000_000, VT.UINT32),
    "t.i32": (-2_000_000_000, VT.INT32),
    "t.f32": (1.25, VT.FLOAT32),
    "t.bool_t": (True, VT.BOOL),
    "t.bool_f": (False, VT.BOOL),
    "t.str": ("héllo ✓ gemma", VT.STRING),
    "t.str_empty": ("", VT.STRING),
    "t.u64": (2**64 - 1, VT.UINT64),
    "t.i64": (-(2**63), VT.INT64),
    "t.f64": (1e300, VT.FLOAT64),
}
NUM_ARRAYS = {
    "a.u8": np.array([0, 1, 255], np.uint8),
    "a.i8": np.array([-128, 0, 127], np.int8),
    "a.u16": np.array([0, 65535], np.uint16),
    "a.i16": np.array([-32768, 32767], np.int16),
    "a.u32": np.array([0, 2**32 - 1, 7], np.uint32),
    "a.i32": np.array([8, 8, 2, -1], np.int32),
    "a.f32": np.array([0.5, -1e-6, 3e38], np.float32),
    "a.u64": np.array([2**64 - 1, 0], np.uint64),
    "a.i64": np.array([-(2**63), 2**63 - 1], np.int64),
    "a.f64": np.array([1e-300, -2.5], np.float64),
    "a.bool": np.array([True, True, False, True], np.bool_),
}
STR_ARRAY = ["<pad>", "", "▁the", "日本語", "a b"]


def make_tensors() -> dict[str, tuple[object, tuple[int, ...], GGMLType, bytes]]:
    """name -> (data passed to the writer, PyTorch shape, type, expected raw bytes)."""
    f32 = RNG.standard_normal((3, 4)).astype(np.float32)
    f32_4d = RNG.standard_normal((1, 2, 1, 3)).astype(np.float32)
    f16 = RNG.standard_normal((2, 3, 4)).astype(np.float16)
    bf16 = RNG.integers(0, 2**16, (5, 8)).astype(np.uint16)
    q8 = RNG.integers(0, 256, tensor_nbytes(GGMLType.Q8_0, 2 * 64), dtype=np.uint8).tobytes()
    q4 = RNG.integers(0, 256, tensor_nbytes(GGMLType.Q4_0, 3 * 32), dtype=np.uint8)
    norm = np.arange(7, dtype=np.float32)
    return {
        "token_embd.weight": (f32, (3, 4), GGMLType.F32, f32.tobytes()),
        "blk.0.attn_q.weight": (f16, (2, 3, 4), GGMLType.F16, f16.tobytes()),
        "blk.0.ffn_up.weight": (bf16, (5, 8), GGMLType.BF16, bf16.tobytes()),
        "blk.0.ffn_down.weight": (q8, (2, 64), GGMLType.Q8_0, q8),
        "blk.0.ffn_gate.weight": (q4, (3, 32), GGMLType.Q4_0, q4.tobytes()),
        "blk.0.attn_norm.weight": (norm, (7,), GGMLType.F32, norm.tobytes()),
        "four_d": (f32_4d, (1, 2, 1, 3), GGMLType.F32, f32_4d.tobytes()),
    }


def write_full(path: Path, alignment: int = 32):
    w = GGUFWriter(path, alignment=alignment)
    w.add("general.architecture", "gemma4")
    for k, (v, t) in SCALARS.items():
        w.add(k, v, t)
    for k, a in NUM_ARRAYS.items():
        w.add(k, a)
    w.add("a.str", STR_ARRAY)
    w.add("a.empty_u32", [], array_type=VT.UINT32)
    w.add("a.nested", [[1, 2], ["x", "y"], np.zeros(0, np.uint8)], array_type=VT.ARRAY)
    tensors = make_tensors()
    for name, (data, shape, t, _) in tensors.items():
        w.add_tensor(name, data, shape, t)
    w.write()
    return tensors


def check_values_equal(got, want):
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.ndim == 1
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable
    else:
        assert got == want and type(got) is type(want)


@pytest.mark.parametrize("alignment", [32, 64])
def test_round_trip_ours(tmp_path, alignment):
    path = tmp_path / "full.gguf"
    tensors = write_full(path, alignment)
    with GGUFReader(path) as r:
        assert r.version == 3 and r.alignment == alignment
        assert ("general.alignment" in r.metadata) == (alignment != 32)
        for k, (v, t) in SCALARS.items():
            assert r.metadata_types[k] == t
            want = float(np.float32(v)) if t == VT.FLOAT32 else v
            check_values_equal(r.metadata[k], want)
        for k, a in NUM_ARRAYS.items():
            assert r.metadata_types[k] == VT.ARRAY
            check_values_equal(r.metadata[k], a)
        assert r.array_types["a.bool"] == VT.BOOL and r.array_types["a.f64"] == VT.FLOAT64
        assert r.metadata["a.str"] == STR_ARRAY and r.array_types["a.str"] == VT.STRING
        assert r.metadata["a.empty_u32"].shape == (0,) and r.array_types["a.empty_u32"] == VT.UINT32
        nested = r.metadata["a.nested"]
        assert r.array_types["a.nested"] == VT.ARRAY
        assert list(nested[0]) == [1, 2] and nested[0].dtype == np.int32 and nested[1] == ["x", "y"]
        assert r.metadata["general.architecture"] == "gemma4"
        # key order as added (general.alignment first when written)
        keys = [k for k in r.metadata if k != "general.alignment"]
        assert keys[:2] == ["general.architecture", "t.u8"]

        assert list(r.tensors) == list(tensors)
        prev_end = 0
        for name, (_, shape, t, raw) in tensors.items():
            info = r.tensors[name]
            assert isinstance(info, TensorInfo)
            assert info.shape == shape and info.ggml_type == t and info.nbytes == len(raw)
            assert info.offset % alignment == 0 and info.offset >= prev_end
            prev_end = info.offset + info.nbytes
            data = r.tensor_data(name)
            assert data.dtype == np.uint8 and data.shape == (len(raw),)
            assert data.tobytes() == raw
            assert not data.flags.writeable and not data.flags.owndata  # a view into the mmap
        view = r.tensor_data("token_embd.weight")
    # closing with a live view must not raise, and the view stays valid
    assert view.view(np.float32).reshape(3, 4).tobytes() == tensors["token_embd.weight"][3]


def rss_bytes() -> int:
    import os
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_release_drops_pages_and_keeps_views_valid(tmp_path):
    path = tmp_path / "big.gguf"
    payload = np.random.default_rng(0).integers(0, 255, size=(1024, 16384), dtype=np.uint8)   # 16 MiB
    w = GGUFWriter(path)
    w.add("general.architecture", "gemma4")
    w.add_tensor("blk.0.big.weight", payload, payload.shape, GGMLType.I8)
    w.write()
    want = int(payload.sum(dtype=np.int64))
    with GGUFReader(path) as r:
        view = r.tensor_data("blk.0.big.weight")
        assert int(view.sum(dtype=np.int64)) == want                # every page touched: resident in this process
        before = rss_bytes()
        r.release("blk.0.big.weight")
        assert before - rss_bytes() > 12 * 2**20                     # the tensor's pages left the process
        assert int(view.sum(dtype=np.int64)) == want                # read back from the file: nothing lost
        r.release("blk.0.big.weight")                                # twice is harmless


def oracle_value(field):
    if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[-1] != gguf.GGUFValueType.STRING:
        return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.array([])
    return field.contents()


@pytest.mark.parametrize("alignment", [32, 64])
def test_round_trip_oracle_reads_ours(tmp_path, alignment):
    path = tmp_path / "full.gguf"
    tensors = write_full(path, alignment)
    o = gguf.GGUFReader(path)
    with GGUFReader(path) as r:
        oracle_keys = [k for k in o.fields if not k.startswith("GGUF.")]
        assert oracle_keys == list(r.metadata)
        for k, v in r.metadata.items():
            f = o.fields[k]
            assert int(f.types[0]) == r.metadata_types[k]
            if k == "a.nested":
                continue  # the oracle does not decode nested arrays
            if isinstance(v, np.ndarray):
                if v.size:  # the oracle records no element type for an empty array
                    assert int(f.types[-1]) == r.array_types[k]
                np.testing.assert_array_equal(oracle_value(f).astype(v.dtype), v)
            else:
                assert oracle_value(f) == v
        assert [t.name for t in o.tensors] == list(tensors)
        for t in o.tensors:
            info = r.tensors[t.name]
            assert tuple(int(d) for d in t.shape) == info.shape[::-1]  # oracle reports ne order
            assert int(t.tensor_type) == info.ggml_type
            assert t.data_offset == info.offset and t.n_bytes == info.nbytes
            assert np.ascontiguousarray(t.data).tobytes() == tensors[t.name][3]


def test_ours_reads_oracle_writer(tmp_path):
    path = tmp_path / "oracle.gguf"
    w = gguf.GGUFWriter(path, arch="gemma4")
    w.add_block_count(30)
    w.add_uint64("x.u64", 2**40)
    w.add_int8("x.i8", -5)
    w.add_float32("x.eps", 1e-6)
    w.add_float64("x.f64", 0.1)
    w.add_bool("x.flag", True)
    w.add_string("x.name", "Gemma ✓")
    w.add_array("x.pattern", [True, False, True])
    w.add_array("x.kv", [8, 8, 2])
    w.add_array("x.tokens", ["<bos>", "▁a", ""])
    f32 = RNG.standard_normal((4, 8)).astype(np.float32)
    f16 = RNG.standard_normal((16,)).astype(np.float16)
    q8 = RNG.integers(0, 256, (2, 2 * 34), dtype=np.uint8)
    w.add_tensor("token_embd.weight", f32)
    w.add_tensor("norm", f16)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    with GGUFReader(path) as r:
        m = r.metadata
        assert m["general.architecture"] == "gemma4" and m["gemma4.block_count"] == 30
        assert r.metadata_types["gemma4.block_count"] == VT.UINT32
        assert m["x.u64"] == 2**40 and r.metadata_types["x.u64"] == VT.UINT64
        assert m["x.i8"] == -5 and m["x.eps"] == float(np.float32(1e-6)) and m["x.f64"] == 0.1
        assert m["x.flag"] is True and m["x.name"] == "Gemma ✓"
        assert m["x.pattern"].dtype == np.bool_ and m["x.pattern"].tolist() == [True, False, True]
        assert m["x.kv"].tolist() == [8, 8, 2] and m["x.tokens"] == ["<bos>", "▁a", ""]
        assert r.tensors["token_embd.weight"].shape == (4, 8)
        assert r.tensors["token_embd.weight"].ggml_type == GGMLType.F32
        assert r.tensor_data("token_embd.weight").tobytes() == f32.tobytes()
        assert r.tensors["norm"].ggml_type == GGMLType.F16 and r.tensor_data("norm").tobytes() == f16.tobytes()
        assert r.tensors["q8"].shape == (2, 64) and r.tensors["q8"].ggml_type == GGMLType.Q8_0
        assert r.tensor_data("q8").tobytes() == q8.tobytes()


def test_big_endian_file_from_oracle_refused(tmp_path):
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(path, arch="gemma4", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="big-endian") as e:
        GGUFReader(path)
    assert str(path) in str(e.value)


def test_writer_type_inference_and_errors(tmp_path):
    path = tmp_path / "w.gguf"
    w = GGUFWriter(path)
    w.add("i", 5)
    w.add("big", 2**40)
    w.add("f", 0.5)
    w.add("b", True)
    w.add("s", "x")
    w.add("li", [1, 2, 3])
    w.add("lf", [1, 2.5])
    w.add("lb", [True, False])
    w.add("np_u16", np.uint16(7))
    w.add("arr_f32", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="duplicate"):
        w.add("i", 6)
    with pytest.raises(ValueError, match="does not fit"):
        w.add("bad", -1, VT.UINT32)
    with pytest.raises(ValueError, match="do not fit"):
        w.add("bad", [300], array_type=VT.UINT8)
    with pytest.raises(ValueError, match="empty"):
        w.add("bad", [])
    with pytest.raises(ValueError, match="needs 64 bytes"):
        w.add_tensor("t", np.zeros(15, np.float32), (16,), GGMLType.F32)
    with pytest.raises(TypeError, match="dtype"):
        w.add_tensor("t", np.zeros(16, np.float64), (16,), GGMLType.F32)
    with pytest.raises(ValueError, match="block size"):
        w.add_tensor("t", bytes(34), (1, 16), GGMLType.Q8_0)
    w.add_tensor("t", np.zeros(16, np.float32), (16,), GGMLType.F32)
    with pytest.raises(ValueError, match="duplicate"):
        w.add_tensor("t", np.zeros(16, np.float32), (16,), GGMLType.F32)
    w.write()
    with GGUFReader(path) as r:
        types = r.metadata_types
        assert (types["i"], types["big"], types["f"], types["b"], types["s"]) == (
            VT.INT32, VT.INT64, VT.FLOAT32, VT.BOOL, VT.STRING)
        assert types["np_u16"] == VT.UINT16
        assert (r.array_types["li"], r.array_types["lf"], r.array_types["lb"], r.array_types["arr_f32"]) == (
            VT.INT32, VT.FLOAT32, VT.BOOL, VT.FLOAT32)
        assert r.metadata["lf"].tolist() == [1.0, 2.5]


# --------------------------------------------------------------------------------------------------
# The real vocab GGUF
# --------------------------------------------------------------------------------------------------

def test_real_vocab_gguf():
    t0 = time.perf_counter()
    r = GGUFReader(vocab_gguf())
    elapsed = time.perf_counter() - t0
    with r:
        m = r.metadata
        assert len(m["tokenizer.ggml.tokens"]) == 262144
        assert len(m["tokenizer.ggml.merges"]) == 514906
        assert m["tokenizer.ggml.tokens"][2] == "<bos>"
        assert m["tokenizer.ggml.bos_token_id"] == 2
        assert m["general.architecture"] == "gemma4"
        assert m["gemma4.block_count"] == 30 and r.metadata_types["gemma4.block_count"] == VT.UINT32
        swp = m["gemma4.attention.sliding_window_pattern"]
        assert r.array_types["gemma4.attention.sliding_window_pattern"] == VT.BOOL
        assert swp.dtype == np.bool_ and swp.shape == (30,)
        assert swp.tolist() == ([True] * 5 + [False]) * 5
        assert m["gemma4.attention.head_count_kv"].tolist() == ([8] * 5 + [2]) * 5
        assert m["tokenizer.ggml.scores"].dtype == np.float32
        assert m["tokenizer.ggml.scores"].shape == (262144,)
        assert r.tensors == {}
    assert elapsed < 5.0, f"opening the vocab GGUF took {elapsed:.2f} s"


# --------------------------------------------------------------------------------------------------
# Crafted malformed files
# --------------------------------------------------------------------------------------------------

GOOD_KV = kv_u32("gemma4.block_count", 30)
TRUNC = "truncated"
PAST = "runs past end of file"

MALFORMED = {
    "empty file": (b"", "magic"),
    "bad magic": (b"GGML" + u32(3) + u64(0) + u64(0), "not a GGUF file"),
    "version 1": (header(0, 0, version=1), "unsupported GGUF version 1"),
    "version 4": (header(0, 0, version=4), "unsupported GGUF version 4"),
    "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 1) + b"\0" * 20, "big-endian"),
    "truncated in header": (b"GGUF" + u32(3) + b"\0\0\0", TRUNC),
    "truncated in key": (header(0, 1) + u64(18) + b"gemma4.bl", PAST),
    "truncated in key length": (header(0, 2) + GOOD_KV + b"\x12\0\0", TRUNC),
    "truncated in value": (header(0, 1) + gstr("gemma4.block_count") + u32(VT.UINT32) + b"\x1e\0", TRUNC),
    "truncated in string array": (header(0, 1) + kv("t", VT.ARRAY, u32(VT.STRING) + u64(3) + gstr("a") + gstr("b"))
                                  + u64(1), PAST),
    "truncated in tensor info": (header(1, 1) + GOOD_KV + tinfo("w", [16])[:-5], TRUNC),
    "truncated in tensor data": (gguf_bytes([GOOD_KV], [tinfo("w", [16])], F32_16[:40]), PAST),
    "huge tensor count": (gguf_bytes([GOOD_KV], n_tensors=2**40), "tensor infos cannot fit"),
    "huge kv count": (gguf_bytes([GOOD_KV], n_kv=2**62), "key-value pairs cannot fit"),
    "string length 2**63": (header(0, 1) + u64(2**63) + b"gemma4", "string length 9223372036854775808"),
    "value string length 2**64-1": (header(0, 1) + gstr("k") + u32(VT.STRING) + u64(2**64 - 1) + b"abc",
                                    "string length 18446744073709551615"),
    "huge array count": (header(0, 1) + kv("k", VT.ARRAY, u32(VT.UINT32) + u64(2**61) + u32(1)),
                         "array of 2305843009213693952 UINT32 elements"),
    "huge string array count": (header(0, 1) + kv("k", VT.ARRAY, u32(VT.STRING) + u64(2**60) + gstr("a")),
                                "array of 1152921504606846976 STRING elements"),
    "unknown value type": (header(0, 1) + kv("k", 13, u32(0)), "unknown value type 13"),
    "unknown array element type": (header(0, 1) + kv("k", VT.ARRAY, u32(99) + u64(1) + u32(0)),
                                   "unknown value type 99"),
    "nested arrays too deep": (header(0, 1) + gstr("k") + u32(VT.ARRAY) + (u32(VT.ARRAY) + u64(1)) * 10
                               + u32(VT.UINT8) + u64(0), "nested deeper"),
    "bool not 0/1": (header(0, 1) + kv("k", VT.BOOL, b"\x02"), "bool value is 2"),
    "bool array not 0/1": (header(0, 1) + kv("k", VT.ARRAY, u32(VT.BOOL) + u64(3) + b"\x01\x00\x07"),
                           "bool value is 7"),
    "unknown ggml type": (gguf_bytes([GOOD_KV], [tinfo("w", [16], ggml_type=4)], F32_16), "unknown ggml type 4"),
    "ggml type beyond table": (gguf_bytes([], [tinfo("w", [16], ggml_type=2**31)], F32_16), "unknown ggml type"),
    "duplicate key": (gguf_bytes([GOOD_KV, kv_u32("gemma4.block_count", 31)]), "duplicate key"),
    "duplicate tensor name": (gguf_bytes([], [tinfo("w", [16]), tinfo("w", [16], offset=64)], F32_16 * 2),
                              "duplicate tensor name"),
    "alignment not power of two": (gguf_bytes([kv_u32("general.alignment", 48)], alignment=48),
                                   "not a nonzero power of two"),
    "alignment zero": (gguf_bytes([kv_u32("general.alignment", 0)]), "not a nonzero power of two"),
    "alignment wrong type": (gguf_bytes([kv("general.alignment", VT.UINT64, u64(32))]), "must be UINT32"),
    "misaligned tensor offset": (gguf_bytes([], [tinfo("a", [16]), tinfo("b", [16], offset=68)], F32_16 * 3),
                                 "not a multiple of the alignment 32"),
    "overlapping tensors": (gguf_bytes([], [tinfo("a", [16]), tinfo("b", [16], offset=32)], F32_16 * 2),
                            "overlaps tensor 'a'"),
    "tensor past EOF": (gguf_bytes([], [tinfo("a", [16]), tinfo("b", [16], offset=64)], F32_16), PAST),
    "tensor offset huge": (gguf_bytes([], [tinfo("a", [16], offset=2**64 - 32)], F32_16), PAST),
    "n_dims 0": (gguf_bytes([], [tinfo("a", [])]), "n_dims 0 is not in 1..4"),
    "n_dims 5": (gguf_bytes([], [tinfo("a", [1, 1, 1, 1, 16])], F32_16), "n_dims 5 is not in 1..4"),
    "dim product overflows": (gguf_bytes([], [tinfo("a", [2**32, 2**32])], F32_16), "overflows int64"),
    "negative dim": (gguf_bytes([], [tinfo("a", [2**64 - 1])], F32_16), "negative as int64"),
    "row not a whole block": (gguf_bytes([], [tinfo("a", [16, 2], ggml_type=GGMLType.Q8_0)], F32_16),
                              "not a multiple of the Q8_0 block size 32"),
    "invalid UTF-8 key": (header(0, 1) + kv(b"gemma4.\xff\xfe", VT.UINT32, u32(1)), "not valid UTF-8"),
    "invalid UTF-8 tensor name": (gguf_bytes([], [gstr(b"\xc3") + tinfo("", [16])[8:]], F32_16), "not valid UTF-8"),
    "invalid UTF-8 in string array": (header(0, 1) + kv("k", VT.ARRAY, u32(VT.STRING) + u64(2) + gstr("ok")
                                                        + gstr(b"\xed\xa0\x80")), "'k'[1]"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_refused(tmp_path, case):
    data, expected = MALFORMED[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError) as e:
        GGUFReader(path)
    msg = str(e.value)
    assert expected in msg
    assert str(path) in msg and "at byte" in msg


def test_error_names_field_and_offset(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf_bytes([], [tinfo("blk.0.attn_q.weight", [16])], F32_16[:8]))
    with pytest.raises(GGUFError) as e:
        GGUFReader(path)
    start = 96  # 24 header + 48 info = 72, rounded up to 32
    assert str(e.value) == (f"{path}: tensor 'blk.0.attn_q.weight' at byte {start}: extent [{start}, {start + 64}) "
                            f"runs past end of file ({start + 8} bytes)")
    path.write_bytes(header(0, 2) + GOOD_KV + kv_u32("gemma4.block_count", 1))
    with pytest.raises(GGUFError, match=f"metadata key 'gemma4.block_count' at byte {24 + len(GOOD_KV)}: duplicate"):
        GGUFReader(path)


def test_crafted_valid_file_opens(tmp_path):
    """The builder itself produces files the reader accepts (so the malformed cases test one thing each)."""
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_bytes([GOOD_KV, kv_u32("general.alignment", 64)],
                                [tinfo("a", [16]), tinfo("b", [16], offset=64), tinfo("z", [0, 4], offset=128)],
                                F32_16 * 2, alignment=64))
    with GGUFReader(path) as r:
        assert r.alignment == 64 and r.metadata["gemma4.block_count"] == 30
        assert r.tensors["b"].offset == r.tensors["a"].offset + 64
        assert r.tensor_data("b").tobytes() == F32_16
        assert r.tensors["z"].shape == (4, 0) and r.tensor_data("z").size == 0


# --------------------------------------------------------------------------------------------------
# Truncation at every length, and a byte-mutation fuzz
# --------------------------------------------------------------------------------------------------

def small_valid_file(path: Path) -> bytes:
    w = GGUFWriter(path)
    w.add("general.architecture", "gemma4")
    w.add("gemma4.block_count", 2, VT.UINT32)
    w.add("gemma4.attention.sliding_window_pattern", [True, False])
    w.add("gemma4.attention.head_count_kv", np.array([4, 1], np.int32))
    w.add("tokenizer.ggml.tokens", ["<pad>", "<eos>", "<bos>", "▁a"])
    w.add("x.nested", [[1], ["s"]])
    w.add_tensor("w", np.arange(8, dtype=np.float32), (2, 4), GGMLType.F32)
    w.add_tensor("q", bytes(range(34)), (32,), GGMLType.Q8_0)
    w.add_tensor("h", np.ones(3, np.float16), (3,), GGMLType.F16)
    w.write()
    return path.read_bytes()


def test_every_truncation_refused(tmp_path):
    good = small_valid_file(tmp_path / "good.gguf")
    with GGUFReader(tmp_path / "good.gguf") as r:
        data_end = max(t.offset + t.nbytes for t in r.tensors.values())
    assert data_end < len(good)  # the last tensor is followed by padding
    path = tmp_path / "cut.gguf"
    for n in range(len(good)):
        path.write_bytes(good[:n])
        if n < data_end:
            with pytest.raises(GGUFError) as e:
                GGUFReader(path)
            assert str(path) in str(e.value)
        else:  # only trailing padding is missing: still a complete file
            GGUFReader(path).close()


def open_or_gguf_error(path: Path) -> None:
    try:
        with GGUFReader(path) as r:
            for name in r.tensors:
                assert r.tensor_data(name).size == r.tensors[name].nbytes
    except GGUFError as e:
        assert str(path) in str(e)


INTERESTING_U64 = [0, 1, 2, 3, 4, 5, 9, 13, 31, 32, 33, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_mutations_raise_only_gguf_error(tmp_path, data):
    good = bytearray(small_valid_file(tmp_path / "base.gguf"))
    n_edits = data.draw(st.integers(0, 6), label="n_edits")
    for _ in range(n_edits):
        kind = data.draw(st.sampled_from(["byte", "u64", "u32"]), label="kind")
        if kind == "byte":
            i = data.draw(st.integers(0, len(good) - 1), label="at")
            good[i] = data.draw(st.integers(0, 255), label="value")
        else:
            width = 8 if kind == "u64" else 4
            i = data.draw(st.integers(0, len(good) - width), label="at")
            v = data.draw(st.sampled_from(INTERESTING_U64), label="value") % (2 ** (8 * width))
            good[i:i + width] = v.to_bytes(width, "little")
    if data.draw(st.booleans(), label="truncate"):
        good = good[:data.draw(st.integers(0, len(good)), label="length")]
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(good))
    open_or_gguf_error(path)
