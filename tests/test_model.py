"""Model logits against the transformers oracle, cached vs full passes, precision modes."""
from __future__ import annotations

import pytest
import torch

import gem4
from model_fixtures import VARIANTS

NAMES = list(VARIANTS)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def nmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out - ref) ** 2).mean() / (ref ** 2).mean())


def assert_matches(out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= tol, rel_err(out, ref)
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert torch.equal(out.argmax(-1)[decisive], ref.argmax(-1)[decisive])


@pytest.mark.parametrize("source", ["hf_causal", "hf_mm", "gguf_f32"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(variants, name, source):
    fx = variants[name]
    path = fx.gguf["f32"] if source == "gguf_f32" else getattr(fx, source)
    model = gem4.load(path, dtype="float32")
    out = model.logits(fx.ids)
    print(f"{name} {source}: max|diff|/max|ref| = {rel_err(out, fx.ref_logits):.2e}")
    assert_matches(out, fx.ref_logits)


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_then_decode_equals_full_pass(variants, name):
    fx = variants[name]
    model = gem4.load(fx.gguf["f32"], dtype="float32")
    full = model.logits(fx.ids)
    cache = model.new_cache()
    ids = torch.tensor(fx.ids)
    parts = [model.extend(ids[s:s + 13], cache, logits=13) for s in range(0, 26, 13)]      # two 13-token chunks
    parts += [model.extend(ids[s:s + 1], cache) for s in range(26, len(fx.ids))]  # then one token at a time
    stepped = torch.cat(parts)
    print(f"{name}: chunked vs full {rel_err(stepped, full):.2e}")
    assert cache.length == len(fx.ids)
    assert_matches(stepped, full)
    assert_matches(stepped, fx.ref_logits)


@pytest.mark.parametrize("name", NAMES)
def test_last_only_prefill_equals_last_row(variants, name):
    # E2B/E4B: KV-shared layers run only the last position when only its logits are needed
    fx = variants[name]
    model = gem4.load(fx.hf_causal, dtype="float32")
    cache = model.new_cache()
    last = model.extend(torch.tensor(fx.ids[:-1]), cache)
    assert last.shape == (1, 512)
    assert_matches(last, fx.ref_logits[-2:-1])
    nxt = model.extend(torch.tensor(fx.ids[-1:]), cache)                          # the cache is complete
    assert_matches(nxt, fx.ref_logits[-1:])


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_mode_drift(variants, name):
    fx = variants[name]
    f32 = gem4.load(fx.hf_causal, dtype="float32").logits(fx.ids)
    bf16 = gem4.load(fx.hf_causal, dtype="bfloat16").logits(fx.ids)
    drift = nmse(bf16, f32)
    print(f"{name}: bfloat16 NMSE vs float32 = {drift:.2e}")
    if name != "moe":
        assert drift <= 1e-3
    else:
        # Top-2 routing is discontinuous: near-tied experts flip under any bf16 rounding (this fixture's
        # float32 logits move by NMSE ~4e-3 under 1e-3 relative weight noise, the dense ones by ~1e-4).
        # Bound: no worse than transformers' own bf16 path on the same model, within 2x.
        hf_bf16 = fx.hf_model.to(torch.bfloat16)
        try:
            with torch.no_grad():
                ref_bf16 = hf_bf16(torch.tensor([fx.ids])).logits[0].float()
        finally:
            fx.hf_model.to(torch.float32)
        hf_drift = nmse(ref_bf16, fx.ref_logits)
        print(f"{name}: transformers bf16 NMSE vs float32 = {hf_drift:.2e}")
        assert drift <= max(1e-3, 2 * hf_drift)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", NAMES)
def test_quantized_gguf_logits(variants, name, qtype):
    fx = variants[name]
    out = gem4.load(fx.gguf[qtype], dtype="float32").logits(fx.ids)
    ref = gem4.load(fx.gguf["f32"], dtype="float32").logits(fx.ids)
    drift = nmse(out, ref)
    print(f"{name} {qtype}: NMSE vs float32 = {drift:.2e}")
    assert torch.isfinite(out).all()
    # Gaussian random weights are the worst case for 4-bit blocks; these bounds catch a wrong layout
    # (which gives NMSE ~1-2), not quantization error
    assert drift < {"q8_0": 2e-2, "q4_0": 0.6}[qtype]


def test_q8_0_tracks_float_better_than_q4_0(variants):
    fx = variants["dense_plain"]
    ref = gem4.load(fx.gguf["f32"], dtype="float32").logits(fx.ids)
    errs = {t: nmse(gem4.load(fx.gguf[t], dtype="float32").logits(fx.ids), ref) for t in ("q8_0", "q4_0")}
    assert errs["q8_0"] * 10 < errs["q4_0"]


def test_logits_rejects_bad_ids(variants):
    model = gem4.load(variants["dense_plain"].hf_causal, dtype="float32")
    with pytest.raises(ValueError, match="empty"):
        model.logits([])
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        model.logits([1, 512])
