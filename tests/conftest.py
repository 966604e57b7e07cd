"""Session fixtures: tiny seeded Gemma 4 models of every variant, in every on-disk form, built once."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import gem4  # noqa: F401  first: it sets torch's runtime environment (GOMP_SPINCOUNT) before torch loads
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_fixtures import VARIANTS, build_hf, prompt_ids  # noqa: E402


@dataclass
class Fixture:
    name: str
    hf_causal: Path
    hf_mm: Path
    gguf: dict[str, Path]          # "f32" | "q8_0" | "q4_0" -> file
    ids: list[int]                 # 45-token prompt (sliding window 8: the ring wraps several times)
    ref_logits: torch.Tensor       # transformers float32 eager logits [45, 512]
    hf_model: torch.nn.Module      # the transformers Gemma4ForCausalLM (oracle)


@pytest.fixture(scope="session")
def variants(tmp_path_factory) -> dict[str, Fixture]:
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf

    root = tmp_path_factory.mktemp("variants")
    out = {}
    for name in VARIANTS:
        causal, mm = build_hf(name)
        causal.save_pretrained(root / name / "causal")
        mm.save_pretrained(root / name / "mm")
        ids = prompt_ids()
        with torch.no_grad():
            ref = causal(torch.tensor([ids])).logits[0].float()
        ckpt = open_checkpoint(root / name / "causal")
        gguf = {}
        for t in ("f32", "q8_0", "q4_0"):
            gguf[t] = root / name / f"{t}.gguf"
            write_gguf(ckpt, gguf[t], t)
        out[name] = Fixture(name, root / name / "causal", root / name / "mm", gguf, ids, ref, causal)
    return out


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels():
    """Build (or load) the compiled kernels once, in this process, before any test starts a gem4 subprocess
    that would otherwise build them under its own time limit (test_cli shares this cache with its
    subprocesses)."""
    from gem4.model import kernels

    kernels.available()
