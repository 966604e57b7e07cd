"""The fast mode's logits, bit for bit, against logits saved from an earlier version of the code.

A redesign of how the fast mode is installed (backends, module swaps, plans) must not change a single float:
`tests/assets/fast_mode_logits.pt` holds the logits of every tiny variant in every fast-mode format, computed by
the code before the redesign. Regenerate it only when a change of the numbers is intended:
`python tests/test_backends.py` (and say why in the commit).

The AMX kernels are switched off for this comparison: they are bit-identical to the VNNI ones for the GEMV but
not for the prefill GEMM, and the file must hold on every AVX-512 host.
"""
from __future__ import annotations

import sys
from pathlib import Path

import gem4  # first: it sets torch's runtime environment before torch loads
import pytest
import torch

from gem4.model import kernels

GOLDEN = Path(__file__).parent / "assets" / "fast_mode_logits.pt"
FORMATS = ("q8_0", "q4_0", "hf")


def fast_mode_logits(fixture, fmt: str) -> torch.Tensor:
    """[9, V]: a 40-token prompt as one prefill pass (its last 4 rows), a 4-row decode pass, a 1-row decode step."""
    path = fixture.hf_causal if fmt == "hf" else fixture.gguf[fmt]
    model = gem4.load(path, dtype="bfloat16")
    ids = torch.tensor(fixture.ids)
    cache = model.new_cache()
    rows = [model.extend(ids[:40], cache, logits=4, prefill=True),
            model.extend(ids[40:44], cache, logits=4, prefill=False),
            model.extend(ids[44:45], cache, logits=1, prefill=False)]
    return torch.cat(rows)


def all_logits(variants) -> dict[str, torch.Tensor]:
    amx = kernels.set_amx()
    kernels.set_amx(False)
    try:
        return {f"{name}/{fmt}": fast_mode_logits(fixture, fmt) for name, fixture in variants.items()
                for fmt in FORMATS}
    finally:
        kernels.set_amx(amx)


@pytest.mark.skipif(not kernels.available(), reason="the saved logits are the compiled kernels'; they are off here")
def test_fast_mode_logits_are_the_saved_ones(variants):
    saved = torch.load(GOLDEN)
    got = all_logits(variants)
    assert sorted(got) == sorted(saved)
    for key, logits in got.items():
        assert logits.dtype == torch.float32 and logits.shape == saved[key].shape, key
        diff = (logits - saved[key]).abs().max().item()
        assert torch.equal(logits, saved[key]), f"{key}: fast-mode logits moved (max |diff| {diff:.3g})"


if __name__ == "__main__":                      # regenerate the saved logits (on purpose only)
    sys.path.insert(0, str(Path(__file__).parent))
    import tempfile

    from conftest import Fixture  # noqa: F401
    from model_fixtures import VARIANTS, build_hf, prompt_ids

    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf

    assert kernels.available(), "build the compiled kernels first"
    fixtures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in VARIANTS:
            causal, _ = build_hf(name)
            causal.save_pretrained(Path(tmp) / name)
            ckpt = open_checkpoint(Path(tmp) / name)
            gguf = {}
            for t in ("q8_0", "q4_0"):
                gguf[t] = Path(tmp) / f"{name}.{t}.gguf"
                write_gguf(ckpt, gguf[t], t)
            fixtures[name] = Fixture(name, Path(tmp) / name, None, gguf, prompt_ids(), None, None)
        logits = all_logits(fixtures)
    torch.save(logits, GOLDEN)
    print(f"wrote {GOLDEN}: {len(logits)} entries")


@pytest.mark.parametrize("name", ["dense_plain", "dense_keqv", "ple_kvshare"])
def test_the_reference_decode_step_compiles_as_one_graph(variants, name):
    """The torch backend's decode step (two sequences, one row each) traces under torch.compile(fullgraph=True)
    with no graph break -- the seam a GPU backend compiles -- and the compiled step gives the eager step's
    logits. (26B-A4B's routed experts group tokens by expert, a data-dependent loop: not covered.)"""
    model = gem4.load(variants[name].hf_causal, dtype="float32")
    assert model.backend == "torch"
    ids = torch.tensor(variants[name].ids)

    def decode_step():
        from gem4.kv_cache import KVPool, SeqStep
        pool = KVPool(model.config, num_blocks=8, num_sliding_blocks=8, dtype=model.dtype)
        seqs = [([0, 1], [2, 3]), ([4, 5], [6, 7])]            # two sequences' full and sliding blocks
        for (full, sliding), n in zip(seqs, (20, 13)):         # their prompts, one prefill step each
            model.forward(ids[:n], pool.layout([SeqStep(0, n, full, sliding)], prefill=True), pool)
        step = pool.layout([SeqStep(20, 1, *seqs[0]), SeqStep(13, 1, *seqs[1])])
        return torch.stack([ids[20], ids[13]]), step, pool

    explained = torch._dynamo.explain(model.forward)(*decode_step())
    assert explained.graph_break_count == 0, explained.break_reasons
    eager = model.forward(*decode_step())
    # TorchDynamo's graph as traced; inductor (generated C++ kernels, ~30 s) on one variant
    for backend in ("eager", "inductor") if name == "dense_plain" else ("eager",):
        compiled = torch.compile(model.forward, fullgraph=True, backend=backend)(*decode_step())
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_every_backend_gives_the_engine_its_model_contract(variants):
    """A loaded model is an EngineModel (model/backends.py) whichever backend computes it."""
    from gem4.model.backends import EngineModel

    fx = variants["ple_kvshare"]
    backends = set()
    for path, dtype in ((fx.hf_causal, "float32"), (fx.gguf["q4_0"], "bfloat16")):
        model = gem4.load(path, dtype=dtype)
        assert isinstance(model, EngineModel), (path, dtype)
        backends.add(model.backend)
    assert backends == ({"torch", "cpu"} if kernels.available() else {"torch"})
