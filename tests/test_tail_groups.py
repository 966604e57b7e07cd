"""Tail groups of the x16 layout (Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K / MLX_A4 / MLX_A8): a row whose blocks are not
a multiple of 16 keeps its last 1..15 blocks unpadded, so a packed weight is the file's size (Q4_K / Q5_K: plus their
unpacked scales), at the real widths of 26B-A4B (2816, 704, 2112), the 12B (3840) and the 31B (5376). Every kernel that
reads the layout gives what it gave on the padded rows, bit for bit: the same weight with its rows padded by zero blocks
(the old layout's padding, d = 0) and x by zeros, packed without a tail, is the reference (kernels.dequant against
quants.py's dequantization, as the other kernel tests)."""
from __future__ import annotations

import pytest
import torch

from gem4.model import kernels
from gem4.model.cpu import KernelExperts
from gem4.ggml import BLOCK_INFO, GGMLType, dequantize, quantize
from test_kquants import packed_row_bytes, random_blocks

X16_TYPES = [GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
             GGMLType.MLX_A4, GGMLType.MLX_A8]
# 26B-A4B hidden, expert and dense-branch widths, the 12B's and 31B's hidden, and a row of only a tail
WIDTHS = [2816, 704, 2112, 3840, 5376, 256]
GROUP = 16 * 32                          # weights per x16 group


def cases():
    return [(t, k) for t in X16_TYPES for k in WIDTHS if k % BLOCK_INFO[t].block_size == 0]


def blocks(t: GGMLType, rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random GGML bytes of an [rows, k] weight (MLX blocks: bf16 s and b of ordinary size, the quants random)."""
    if t not in (GGMLType.MLX_A4, GGMLType.MLX_A8):
        return random_blocks(t, rows, k, g)
    info = BLOCK_INFO[t]
    n = rows * k // info.block_size
    raw = torch.randint(0, 256, (n, info.type_size), generator=g, dtype=torch.uint8)
    raw[:, 0:4] = ((torch.rand(n, 2, generator=g) - 0.5) * 2e-2).bfloat16().view(torch.uint8).reshape(n, 4)
    return raw.reshape(-1)


def padded(raw: torch.Tensor, t: GGMLType, rows: int, k: int) -> tuple[torch.Tensor, int]:
    """The weight with each row padded by zero blocks to whole groups -> (its GGML bytes, its width)."""
    info = BLOCK_INFO[t]
    width = -(-k // GROUP) * GROUP
    zeros = torch.zeros(rows, (width - k) // info.block_size * info.type_size, dtype=torch.uint8)
    return torch.cat([raw.reshape(rows, -1), zeros], 1).reshape(-1), width


def pad_x(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


@pytest.mark.parametrize("t,k", cases(), ids=lambda v: getattr(v, "name", str(v)))
def test_tail_rows_are_the_files_bytes_and_read_back_exactly(t, k):
    g = torch.Generator().manual_seed(k + int(t))
    n = 19
    raw = blocks(t, n, k, g)
    w = kernels.repack(raw, n, k, t)
    assert w.shape == (n, packed_row_bytes(t, k))
    if t not in (GGMLType.Q4_K, GGMLType.Q5_K):
        assert w.numel() == raw.numel()                                     # the file's size, to the byte
    dense = dequantize(raw, t, (n, k))
    assert torch.equal(kernels.dequant(w, k, t, torch.float32), dense)
    assert torch.equal(kernels.dequant(w, k, t, torch.bfloat16), dense.bfloat16())
    ids = torch.tensor([n - 1, 0, 7, 7])
    assert torch.equal(kernels.dequant(w, k, t, torch.float32, rows=ids), dense[ids])   # token-table rows


@pytest.mark.parametrize("t,k", cases(), ids=lambda v: getattr(v, "name", str(v)))
def test_decode_products_equal_the_padded_layouts(t, k):
    """gemv / gemv_multi / gemv_glu of 1..8 rows (passes of 4+ rows over 2816+ inputs split the groups into spans,
    the tail group in the last) on tail rows equal the same products on the zero-padded rows, bit for bit."""
    g = torch.Generator().manual_seed(7 * k + int(t))
    n = 37                                                                 # two tasks of 16 rows and a partial one
    raws = [blocks(t, n, k, g) for _ in range(2)]
    ws = [kernels.repack(raw, n, k, t) for raw in raws]
    pads = [padded(raw, t, n, k) for raw in raws]
    width = pads[0][1]
    wps = [kernels.repack(raw, n, width, t) for raw, _ in pads]
    for m in (1, 3, 4, 8):
        x = torch.randn(m, k, generator=g)
        x[0, :32] = 0.0
        xp = pad_x(x, width)
        assert torch.equal(kernels.gemv(x, ws[0], n, k, t), kernels.gemv(xp, wps[0], n, width, t)), m
        multi = kernels.gemv_multi(x, ws, [n, n], k, t)
        multi_p = kernels.gemv_multi(xp, wps, [n, n], width, t)
        assert all(torch.equal(a, b) for a, b in zip(multi, multi_p)), m
        assert torch.equal(kernels.gemv_glu(x, ws[0], ws[1], n, k, t), kernels.gemv_glu(xp, wps[0], wps[1], n, width, t)), m
    dense = dequantize(raws[0], t, (n, k)).double()                       # and near x W^T (test_kquants' bound)
    x = torch.randn(2, k, generator=g)
    err = (kernels.gemv(x, ws[0], n, k, t).double() - x.double() @ dense.T).abs()
    block_max = x.double().abs().reshape(2, -1, 32).amax(-1).repeat_interleave(32, dim=1)
    assert (err <= block_max @ dense.abs().T / 32767 + 1e-5 * (x.double().abs() @ dense.abs().T)).all()


@pytest.mark.parametrize("t,k", cases(), ids=lambda v: getattr(v, "name", str(v)))
def test_prefill_linear_equals_the_padded_layouts(t, k):
    """kernels.linear (W turned into bf16 tiles of 32 rows, 40 rows: a partial tile) on tail rows equals it on the
    zero-padded rows bit for bit, and the bf16 product of the dequantized weight within bf16 rounding."""
    g = torch.Generator().manual_seed(11 * k + int(t))
    n = 40
    raw = blocks(t, n, k, g)
    w = kernels.repack(raw, n, k, t)
    raw_p, width = padded(raw, t, n, k)
    x = torch.randn(21, k, generator=g)
    y = kernels.linear(x, w, n, k, t)
    assert torch.equal(y, kernels.linear(pad_x(x, width), kernels.repack(raw_p, n, width, t), n, width, t))
    ref = torch.nn.functional.linear(x.bfloat16(), dequantize(raw, t, (n, k)).bfloat16()).float()
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("t", X16_TYPES, ids=lambda t: t.name)
def test_stacked_experts_at_26b_a4b_widths(t):
    """26B-A4B experts (H 2816, Im 704): gate_up [E, 2 Im, H] in t, down [E, H, Im] in t where 704 is whole blocks of it,
    else in llama.cpp's fallback Q5_0. The stack is E packed weights of their own (expert e's rows are exactly its
    own repack, as decode_layer and the slots read them), the file's size, and the layer's output is the dense one's."""
    from gem4.config import MoEConfig
    from gem4.model.gemma4 import Experts
    from types import SimpleNamespace
    E, H, Im, K = 3, 2816, 704, 2
    config = SimpleNamespace(hidden_size=H, moe=MoEConfig(num_experts=E, top_k=K, intermediate_size=Im))
    g = torch.Generator().manual_seed(50 + int(t))
    dense, fast = Experts(config), KernelExperts(config)
    for name, (rows, k) in dense.dims.items():
        wt = t if k % BLOCK_INFO[t].block_size == 0 else GGMLType.Q5_0
        if wt in (GGMLType.MLX_A4, GGMLType.MLX_A8):
            raw = blocks(wt, E * rows, k, g)
        else:
            raw = quantize(torch.randn(E, rows, k, generator=g) * 0.1, wt).reshape(-1)
        setattr(dense, name, torch.nn.Parameter(dequantize(raw, wt, (E, rows, k)), requires_grad=False))
        fast.pack(name, raw, wt)
        stack = getattr(fast, name)
        assert stack.shape == (E * rows, packed_row_bytes(wt, k))
        per = raw.numel() // E
        for e in range(E):
            assert torch.equal(stack[e * rows:(e + 1) * rows], kernels.repack(raw[e * per:(e + 1) * per], rows, k, wt))
    for T in (1, 3):
        x = torch.randn(T, H, generator=g)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=g)
        ref, out = dense(x, idx, w), fast(x, idx, w)
        assert ((out - ref) ** 2).mean() / (ref ** 2).mean() < 1e-4


def test_units_must_divide_the_rows():
    raw = random_blocks(GGMLType.Q5_0, 6, 64, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="units must divide n_out"):
        kernels.repack(raw, 6, 64, GGMLType.Q5_0, units=4)
