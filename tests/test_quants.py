"""Reference GGML (de)quantization vs gguf-py's numpy implementation (test-only oracle), bit-exact."""
from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GQ  # noqa: E402
from gguf import quants as gq  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from gem4.ggml import (  # noqa: E402
    BLOCK_INFO,
    GGMLType,
    dequantize,
    ggml_dtype_view,
    quantize,
    tensor_nbytes,
)

BLOCK_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]

# byte offsets of the fp16 fields (d, m / dmin) inside one block
FP16_FIELDS = {
    "Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}

# extreme / interesting fp16 scale values
F16_SPECIAL = np.array(
    [65504.0, -65504.0, 6e-8, -6e-8, 0.0, -0.0, 2.0 ** -24, -(2.0 ** -24), 6.1e-5, -6.1e-5,
     1.0, -1.0, 0.5, 1e-3, -3.14, 1024.0, 32768.0, -0.0001],
    dtype=np.float16,
)


def _bits(a) -> np.ndarray:
    a = np.ascontiguousarray(a.numpy() if isinstance(a, torch.Tensor) else a)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint8)


def assert_bits_equal(got, ref):
    g, r = _bits(got), _bits(ref)
    assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, r.shape, g.dtype, r.dtype)
    if not np.array_equal(g, r):
        bad = np.argwhere(g != r)
        raise AssertionError(f"{len(bad)} mismatches, first at {bad[0]}: got {g[tuple(bad[0])]:#x} ref {r[tuple(bad[0])]:#x}")


def random_finite_f16(rng, n) -> np.ndarray:
    """Random fp16 bit patterns that are not NaN/Inf, mixed with the special values."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits)   # exponent 31 -> 15
    vals = bits.view(np.float16).copy()
    pick = rng.random(n) < 0.5
    vals[pick] = rng.choice(F16_SPECIAL, size=int(pick.sum()))
    return vals


def random_blocks(name: str, n_blocks: int, seed: int) -> np.ndarray:
    """(n_blocks, type_size) random bytes with finite (often extreme) fp16 scale fields."""
    ts = BLOCK_INFO[GGMLType[name]].type_size
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for off in FP16_FIELDS[name]:
        raw[:, off:off + 2] = random_finite_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw


def ref_dequant(raw: np.ndarray, name: str, shape) -> np.ndarray:
    with np.errstate(all="ignore"):
        out = gq.dequantize(raw.reshape(-1), GQ[name] if name != "F32" else GQ.F32)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


def ours_dequant(raw: np.ndarray, name: str, shape) -> torch.Tensor:
    out = dequantize(torch.from_numpy(raw.reshape(-1).copy()), GGMLType[name], shape)
    assert out.dtype == torch.float32 and tuple(out.shape) == tuple(shape)
    return out


# ------------------------------------------------------------------------------------------
# dequantize: block formats
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dequant_random_blocks_bit_exact(name, seed):
    bs = BLOCK_INFO[GGMLType[name]].block_size
    for shape in [(3, 2 * bs), (5 * bs,), (2, 2, bs)]:
        n_blocks = int(np.prod(shape)) // bs
        raw = random_blocks(name, n_blocks, seed=zlib.crc32(f"{name}/{seed}/{shape}".encode()))
        assert_bits_equal(ours_dequant(raw, name, shape), ref_dequant(raw, name, shape))


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_dequant_every_special_scale(name):
    """Every (pair of) special fp16 value(s) in the scale field(s), over all-zero, all-0xFF and random payloads."""
    bs, ts = BLOCK_INFO[GGMLType[name]].block_size, BLOCK_INFO[GGMLType[name]].type_size
    rng = np.random.default_rng(1234)
    specials = F16_SPECIAL.view(np.uint8).reshape(-1, 2)
    fields = FP16_FIELDS[name]
    combos = itertools.product(range(len(specials)), repeat=len(fields))
    rows = []
    for idx in combos:
        for payload in (np.zeros(ts, np.uint8), np.full(ts, 0xFF, np.uint8), rng.integers(0, 256, ts, dtype=np.uint8)):
            blk = payload.copy()
            for off, i in zip(fields, idx):
                blk[off:off + 2] = specials[i]
            rows.append(blk)
    raw = np.stack(rows)
    shape = (raw.shape[0] * bs,)
    assert_bits_equal(ours_dequant(raw, name, shape), ref_dequant(raw, name, shape))


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_dequant_infinite_scales(name):
    """±Inf scale fields (Inf*0 -> NaN, Inf-Inf -> NaN) agree bitwise too."""
    bs = BLOCK_INFO[GGMLType[name]].block_size
    rng = np.random.default_rng(7)
    raw = random_blocks(name, 16, seed=7)
    raw[0] = 0                                                   # all q == 0 / zero sub-scales: Inf*0
    choices = np.array([np.inf, -np.inf, 1.5], dtype=np.float16).view(np.uint8).reshape(3, 2)
    for b in range(16):
        for k, off in enumerate(FP16_FIELDS[name]):
            raw[b, off:off + 2] = choices[0 if k == 0 and b < 2 else rng.integers(0, 3)]
    shape = (16 * bs,)
    ref = ref_dequant(raw, name, shape)
    assert np.isinf(ref).any() and np.isnan(ref).any()
    assert_bits_equal(ours_dequant(raw, name, shape), ref)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_0", "Q3_K", "Q6_K"])
def test_dequant_single_nan_scale(name):
    """A block whose only fp16 field is NaN: the NaN payload survives like numpy's."""
    bs = BLOCK_INFO[GGMLType[name]].block_size
    raw = random_blocks(name, 4, seed=3)
    nans = np.array([0x7C01, 0xFE00, 0x7D55, 0xFFFF], dtype=np.uint16).view(np.uint8).reshape(4, 2)
    off = FP16_FIELDS[name][0]
    raw[:, off:off + 2] = nans
    shape = (4 * bs,)
    assert_bits_equal(ours_dequant(raw, name, shape), ref_dequant(raw, name, shape))


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_dequant_misaligned_raw(name):
    """raw may start at an odd storage offset (e.g. a slice of an mmap'd file)."""
    bs = BLOCK_INFO[GGMLType[name]].block_size
    raw = random_blocks(name, 3, seed=11).reshape(-1)
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw)
    got = dequantize(buf[1:], GGMLType[name], (3 * bs,))
    assert_bits_equal(got, ref_dequant(raw, name, (3 * bs,)))
    # and a single block (its (1, type_size) slice is contiguous at an odd offset)
    got1 = dequantize(buf[1:1 + raw.size // 3], GGMLType[name], (bs,))
    assert_bits_equal(got1, ref_dequant(raw[: raw.size // 3], name, (bs,)))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"] + BLOCK_TYPES)
def test_dequant_empty(name):
    bs = BLOCK_INFO[GGMLType[name]].block_size
    out = dequantize(torch.zeros(0, dtype=torch.uint8), GGMLType[name], (0, bs))
    assert out.shape == (0, bs) and out.dtype == torch.float32


# ------------------------------------------------------------------------------------------
# dequantize: float formats
# ------------------------------------------------------------------------------------------

def test_dequant_f32():
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    x[0, :4] = [np.inf, -np.inf, np.nan, -0.0]
    raw = x.view(np.uint8).reshape(-1)
    t = torch.from_numpy(raw.copy())
    out = dequantize(t, GGMLType.F32, (3, 8))
    assert_bits_equal(out, x)
    assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()   # a copy, not a view


def test_dequant_f16_all_bit_patterns():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)         # every half, incl. NaN payloads
    raw = h.view(np.uint8)
    assert_bits_equal(ours_dequant(raw, "F16", (256, 256)), ref_dequant(raw, "F16", (256, 256)))
    assert_bits_equal(ours_dequant(raw[:10], "F16", (5,)), ref_dequant(raw[:10], "F16", (5,)))


def test_dequant_bf16_all_bit_patterns():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    raw = h.view(np.uint8)
    ref = gq.dequantize(raw.reshape(1, -1), GQ.BF16).reshape(256, 256)
    assert_bits_equal(ours_dequant(raw, "BF16", (256, 256)), ref)
    assert_bits_equal(ours_dequant(raw[:6], "BF16", (3,)), gq.dequantize(raw[:6].reshape(1, -1), GQ.BF16).reshape(3))


# ------------------------------------------------------------------------------------------
# hand-checkable tables
# ------------------------------------------------------------------------------------------

def test_q8_0_table():
    qs = np.array(list(range(-16, 16)), dtype=np.int8)
    qs[0], qs[31] = -128, 127
    raw = np.concatenate([np.array([0x00, 0x38], np.uint8), qs.view(np.uint8)])   # d = 0.5 (0x3800)
    out = dequantize(torch.from_numpy(raw), GGMLType.Q8_0, (32,))
    expected = qs.astype(np.float32) * 0.5
    assert expected[0] == -64.0 and expected[31] == 63.5 and expected[16] == 0.0
    np.testing.assert_array_equal(out.numpy(), expected)


def test_q4_0_table():
    lo = np.arange(16, dtype=np.uint8)          # elems 0..15  -> nibble j
    hi = 15 - np.arange(16, dtype=np.uint8)     # elems 16..31 -> nibble 15-j
    raw = np.concatenate([np.array([0x00, 0x3C], np.uint8), lo | (hi << 4)])      # d = 1.0 (0x3C00)
    out = dequantize(torch.from_numpy(raw), GGMLType.Q4_0, (1, 32))
    expected = np.concatenate([np.arange(16) - 8, 7 - np.arange(16)]).astype(np.float32)
    np.testing.assert_array_equal(out.numpy()[0], expected)
    assert out[0, 0] == -8 and out[0, 15] == 7 and out[0, 16] == 7 and out[0, 31] == -8


# ------------------------------------------------------------------------------------------
# quantize
# ------------------------------------------------------------------------------------------

def _quant_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(42)
    cases = {
        "normal": rng.standard_normal((4, 128)).astype(np.float32),
        "normal_1d": rng.standard_normal(96).astype(np.float32),
        "normal_3d": (rng.standard_normal((2, 3, 64)) * 0.02).astype(np.float32),
    }
    z = rng.standard_normal((3, 96)).astype(np.float32)
    z[0, :32] = 0.0
    z[1, 32:64] = -0.0
    z[2, :] = 0.0
    cases["zero_blocks"] = z
    big = (rng.standard_normal((4, 64)) * np.array([[1e4], [1e6], [1e7], [1e30]])).astype(np.float32)
    big[0, 5] = 3.0e38
    cases["large"] = big
    cases["small"] = (rng.standard_normal((3, 64)) * np.array([[1e-2], [1e-8], [1e-25]])).astype(np.float32)
    neg = np.abs(rng.standard_normal((4, 64))).astype(np.float32)
    neg[np.arange(4), [0, 17, 31, 63]] = -10.0                  # max |x| is negative
    cases["neg_max"] = neg
    # ties: +m and -m both present (order matters for Q4_0's argmax), and exact .5 after scaling
    t = np.zeros((6, 32), np.float32)
    t[0, 3], t[0, 9] = 4.0, -4.0
    t[1, 3], t[1, 9] = -4.0, 4.0
    t[2, :] = np.linspace(-127, 127, 32).round() + 0.5 * np.sign(np.linspace(-1, 1, 32))
    t[2, 0] = -127.0                                             # Q8_0: d=1 -> halves round away from 0
    t[3, :] = np.arange(32) * 0.5 - 8.0
    t[3, 0] = -8.0                                               # Q4_0: d=1 -> x+8.5 exact halves
    t[4, :] = -(np.arange(32) % 17) * 0.5
    t[5, :] = 1.0
    cases["ties"] = t
    return cases


QUANT_CASES = _quant_cases()


def ref_quant(x: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(all="ignore"):                              # fp16 overflow of large scales is expected
        return np.ascontiguousarray(gq.quantize(x, GQ[name])).view(np.uint8).reshape(-1)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32"])
@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_quantize_bytes_identical(name, case):
    x = QUANT_CASES[case]
    got = quantize(torch.from_numpy(x.copy()), GGMLType[name])
    assert got.dtype == torch.uint8 and got.dim() == 1
    assert got.numel() == tensor_nbytes(GGMLType[name], x.size)
    np.testing.assert_array_equal(got.numpy(), ref_quant(x, name))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_quantize_roundtrip_close(name, case):
    x = QUANT_CASES[case]
    y = dequantize(quantize(torch.from_numpy(x.copy()), GGMLType[name]), GGMLType[name], x.shape).numpy()
    blocks_x, blocks_y = x.reshape(-1, 32).astype(np.float64), y.reshape(-1, 32).astype(np.float64)
    amax = np.abs(blocks_x).max(axis=1, keepdims=True)
    d = amax[:, 0] / (127 if name == "Q8_0" else 8)
    fits = (d < 65000) & ((d > 6.2e-5) | (d == 0))           # skip blocks whose scale is not a normal fp16
    blocks_x, blocks_y, amax = blocks_x[fits], blocks_y[fits], amax[fits]
    assert len(amax) > 0
    # Q8_0: error <= d/2 (+ fp16 rounding of d); Q4_0: worst case is -max clamped to q=15 (error d)
    bound = amax * (0.5 / 127 + 2e-3) if name == "Q8_0" else amax * (1 / 8 + 2e-3)
    assert np.all(np.abs(blocks_y - blocks_x) <= bound + 1e-30)


def test_quantize_f16_bf16_special_bits():
    """Every rounding edge: NaN payloads (signalling/quiet, both signs), Inf, overflow, subnormals, ties."""
    rng = np.random.default_rng(5)
    special = np.array(
        [0x7F800001, 0x7F802000, 0xFFC00001, 0x7FA00000, 0x7FFFFFFF, 0xFF800001, 0x7FC00000,
         0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001, 0x00000000,
         0x80000000, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x477FF000, 0x477FEFFF,
         0x33000000, 0x33000001, 0x38800000, 0x387FE000, 0x7F7F8000, 0x7F7F7FFF],
        dtype=np.uint32)
    rand = rng.integers(0, 1 << 32, size=4096, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([special, rand]).view(np.float32)
    for name in ("F16", "BF16", "F32"):
        got = quantize(torch.from_numpy(x.copy()), GGMLType[name])
        np.testing.assert_array_equal(got.numpy(), ref_quant(x, name), err_msg=name)


_finite32 = st.one_of(
    st.just(0.0), st.just(-0.0),
    # |x| >= 2^-100: for block scales below ~1e-37 float32 1/d overflows and NaN -> int casts are UB
    st.floats(2.0 ** -100, 2.0 ** 100, width=32), st.floats(-(2.0 ** 100), -(2.0 ** -100), width=32),
    st.integers(-300, 300).map(lambda i: i / 2),                  # many exact halves / ties
)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.just(64)), elements=_finite32),
       st.sampled_from(["Q8_0", "Q4_0"]))
def test_quantize_property_bytes_identical(x, name):
    got = quantize(torch.from_numpy(x.copy()), GGMLType[name])
    np.testing.assert_array_equal(got.numpy(), ref_quant(x, name))
    y = dequantize(got, GGMLType[name], x.shape)
    assert_bits_equal(y, ref_dequant(got.numpy(), name, x.shape))


# ------------------------------------------------------------------------------------------
# ggml_dtype_view
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,dtype", [("F32", torch.float32), ("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_ggml_dtype_view_zero_copy(name, dtype):
    raw = torch.from_numpy(np.random.default_rng(0).integers(0, 256, 4 * 24, dtype=np.uint8))
    raw = raw[: tensor_nbytes(GGMLType[name], 24)]
    v = ggml_dtype_view(raw, GGMLType[name], (4, 6))
    assert v.dtype == dtype and tuple(v.shape) == (4, 6)
    assert v.data_ptr() == raw.data_ptr()
    finite = torch.isfinite(v.float())
    assert torch.equal(v.float()[finite], dequantize(raw, GGMLType[name], (4, 6))[finite])


def test_ggml_dtype_view_block_formats_none():
    for name in BLOCK_TYPES:
        bs, ts = BLOCK_INFO[GGMLType[name]].block_size, BLOCK_INFO[GGMLType[name]].type_size
        assert ggml_dtype_view(torch.zeros(ts, dtype=torch.uint8), GGMLType[name], (bs,)) is None


def test_ggml_dtype_view_wrong_size():
    with pytest.raises(ValueError, match="expected 16 bytes, got 12"):
        ggml_dtype_view(torch.zeros(12, dtype=torch.uint8), GGMLType.F32, (4,))


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["Q8_1", "Q8_K", "I8", "I32", "F64"])
def test_dequant_unsupported_type(name):
    info = BLOCK_INFO[GGMLType[name]]
    with pytest.raises(ValueError, match=name):
        dequantize(torch.zeros(info.type_size, dtype=torch.uint8), GGMLType[name], (info.block_size,))


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q8_1", "Q8_K", "I8"])
def test_quantize_unsupported_type(name):
    with pytest.raises(ValueError, match=name):
        quantize(torch.zeros(256), GGMLType[name])


def test_unknown_type_number():
    with pytest.raises(ValueError, match="99"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 99, (1,))
    with pytest.raises(ValueError, match="99"):
        quantize(torch.zeros(4), 99)


def test_int_type_accepted():
    x = torch.full((32,), 127.0)
    raw = quantize(x, 8)                                           # plain int for Q8_0 (d = 1 exactly)
    assert torch.equal(dequantize(raw, 8, (32,)), x)


@pytest.mark.parametrize("name", ["F32", "F16", "Q8_0", "Q4_K"])
def test_wrong_byte_count(name):
    info = BLOCK_INFO[GGMLType[name]]
    expected = 2 * info.type_size
    for got in (expected - 1, expected + info.type_size, 0):
        with pytest.raises(ValueError, match=rf"expected {expected} bytes, got {got}"):
            dequantize(torch.zeros(got, dtype=torch.uint8), GGMLType[name], (2, info.block_size))


def test_bad_shapes_and_inputs():
    with pytest.raises(ValueError, match="block size"):
        dequantize(torch.zeros(34, dtype=torch.uint8), GGMLType.Q8_0, (2, 16))   # 32 elems but rows of 16
    with pytest.raises(ValueError, match="block size"):
        quantize(torch.zeros(2, 16), GGMLType.Q4_0)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(8, dtype=torch.int8), GGMLType.F32, (2,))
    with pytest.raises(ValueError, match="floating"):
        quantize(torch.zeros(32, dtype=torch.int32), GGMLType.Q8_0)
