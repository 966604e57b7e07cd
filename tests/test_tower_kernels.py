"""The media towers on the CPU backend (docs/multimodal.md §2.5): bound through the same backend as the text model
(weights/binding.py), an mmproj's Q8_0 matrices stay Q8_0 in the kernels' layout and run through the same GEMM
kernels, and the towers' outputs stay within the fast mode's drift of the reference path.

Tolerances, from the measured drift (printed; `pytest -s`) with a margin of ~3x or more: against the torch backend at
the same dtype (bf16 weights and matmul inputs: the same roundings, only the kernels' summation order and the norm
kernel differ, and a bf16 rounding flipped early moves what follows) NMSE <= 1e-4 (measured 1.2-1.6e-5 vision,
3.3e-5 audio); against the float32 path of the same file, the text model's fast-mode bound NMSE <= 1e-3 (measured
0.8-2.5e-5 vision, 1.4e-4 audio: the torch backend's bf16 drifts as far). The GEMM rounds activations to bf16, not
to q8 (the towers' linears take the prefill kernels: layers.TOWER_PREFILL). A wrong product costs ~1.
"""
from __future__ import annotations

import pytest
import torch

import gem4
from gem4.cli import main
from gem4.ggml import GGMLType
from gem4.gguf import GGUFReader
from gem4.media import audio as front_end
from gem4.media.image import preprocess
from gem4.model import kernels
from gem4.model.backends import TorchBackend
from gem4.model.cpu import Bf16Linear, PackedLinear
from gem4.model.audio import encode_audio
from gem4.weights.audio import bind_audio
from gem4.weights.checkpoint import open_checkpoint
from gem4.weights.towers import bind_vision
from audio_fixtures import build_audio_hf
from test_mmproj import tokenizer_with_media_tokens
from vision_fixtures import build_vision_hf, sample_image

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the CPU backend needs the compiled kernels")

SAME_DTYPE = 1e-4       # NMSE against the torch backend at bf16
FLOAT32 = 1e-3          # NMSE against the float32 path (the text model's fast-mode bound)


def nmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out - ref) ** 2).mean() / (ref ** 2).mean())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(flavour, type) -> (text GGUF, mmproj) written by `gem4 convert` from the tiny vision checkpoints."""
    root = tmp_path_factory.mktemp("towers")
    out = {}
    for flavour, types, sizes in (("e2b", ("f32", "f16", "q8_0"), {}), ("31b", ("q8_0",), {}), ("wide", ("q8_0",), WIDE)):
        directory = root / flavour
        build_vision_hf("e2b" if flavour == "wide" else flavour, **sizes).save_pretrained(directory)
        tokenizer_with_media_tokens(directory)
        for t in types:
            gguf, mmproj = root / f"{flavour}-{t}.gguf", root / f"mmproj-{flavour}-{t}.gguf"
            assert main(["convert", str(directory), str(gguf), "--type", t, "--mmproj", str(mmproj)]) == 0
            out[flavour, t] = gguf, mmproj
    return out


# a tower whose every matrix has a multiple of 64 inputs: the kernels' Q8_0 panels pad each panel's scales to 64 bytes
# (k_in = 32: 32 bytes of scales and 32 of padding per 16 rows; none at real sizes: 768, 1152, 3072 inputs)
WIDE = dict(hidden_size=64, intermediate_size=128, head_dim=32)
IMAGE = preprocess(sample_image(96, 144, seed=3), 70, patch_size=16, pooling=3)


def encode(vision) -> torch.Tensor:
    return vision.encode(IMAGE.patches, IMAGE.positions, IMAGE.grid)


@pytest.mark.parametrize("flavour, t", [("e2b", "f32"), ("e2b", "f16"), ("e2b", "q8_0"), ("31b", "q8_0")])
def test_vision_tower_on_the_cpu_backend_tracks_the_reference(files, flavour, t):
    gguf, mmproj = files[flavour, t]
    fast = gem4.load(gguf, dtype="bfloat16", mmproj=mmproj)
    assert fast.backend == fast.vision.backend == "cpu"
    linears = [m for m in fast.vision.modules() if isinstance(m, (PackedLinear, Bf16Linear))]
    # every matrix of the tower (q/k/v/o, the MLP, the patch embedder, the projection) is the backend's
    assert len(linears) == 7 * 2 + 2
    if t == "q8_0":                    # the file's Q8_0 matrices stay Q8_0, the rest (the patch kernel: F32) bf16
        assert sum(isinstance(m, PackedLinear) and m.ggml_type == GGMLType.Q8_0 for m in linears) == 7 * 2 + 1
    reference = bind_vision(open_checkpoint(gguf, mmproj), torch.bfloat16, "cpu", TorchBackend())
    assert reference.backend == "torch" and not any(isinstance(m, (PackedLinear, Bf16Linear))
                                                    for m in reference.modules())
    f32 = gem4.load(gguf, dtype="float32", mmproj=mmproj).vision
    got, same, exact = encode(fast.vision), encode(reference), encode(f32)
    drift, drift32 = nmse(got, same), nmse(got, exact)
    print(f"{flavour} {t}: soft tokens NMSE vs the torch backend (bf16) {drift:.1e}, vs float32 {drift32:.1e} "
          f"(torch bf16 vs float32 {nmse(same, exact):.1e})")
    assert drift <= SAME_DTYPE and drift32 <= FLOAT32


def test_a_q8_0_tower_is_resident_as_the_files_bytes(files):
    """Each Q8_0 matrix keeps exactly its bytes of the file (repacked, not dequantized: `WIDE`); with the vectors in
    float32 and the other matrices (the patch kernel, the position table: F32 in the file) in bf16, the tower holds
    what the file holds less half of those."""
    gguf, mmproj = files["wide", "q8_0"]
    vision = gem4.load(gguf, dtype="bfloat16", mmproj=mmproj).vision
    with GGUFReader(mmproj) as r:
        stored = {name: (info.ggml_type, info.nbytes, len(info.shape)) for name, info in r.tensors.items()}
    q8 = sum(n for t, n, _ in stored.values() if t == GGMLType.Q8_0)
    packed = [m for m in vision.modules() if isinstance(m, PackedLinear)]
    assert sum(m.packed.nbytes for m in packed) == q8
    want = sum(n if t == GGMLType.Q8_0 or dims == 1 else n // 2
               for t, n, dims in stored.values())
    resident = sum(t.nbytes for t in [*vision.parameters(), *vision.buffers()]) - vision.vision_tower.inv_freq.nbytes
    print(f"q8_0 tower: {resident} bytes resident, {sum(n for _, n, _ in stored.values())} in the file, "
          f"{q8} of them Q8_0")
    assert resident == want


def test_audio_tower_on_the_cpu_backend_tracks_the_reference(tmp_path):
    directory = tmp_path / "audio"
    build_audio_hf().save_pretrained(directory)
    fast = gem4.load(directory, dtype="bfloat16")
    assert fast.audio.backend == "cpu"
    assert sum(isinstance(m, Bf16Linear) for m in fast.audio.modules()) > 0
    reference = bind_audio(open_checkpoint(directory), torch.bfloat16, "cpu", TorchBackend())
    f32 = gem4.load(directory, dtype="float32").audio
    t = torch.arange(int(1.3 * front_end.SAMPLE_RATE)) / front_end.SAMPLE_RATE
    wave = (0.3 * torch.sin(2 * torch.pi * 440 * t) + 0.1 * torch.sin(2 * torch.pi * 97 * t)).float().numpy()
    got, same, exact = (encode_audio(m, wave).embeddings for m in (fast.audio, reference, f32))
    drift, drift32 = nmse(got, same), nmse(got, exact)
    print(f"audio: soft tokens NMSE vs the torch backend (bf16) {drift:.1e}, vs float32 {drift32:.1e} "
          f"(torch bf16 vs float32 {nmse(same, exact):.1e})")
    assert drift <= SAME_DTYPE and drift32 <= FLOAT32
