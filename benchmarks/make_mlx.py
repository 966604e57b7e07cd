"""Write an E2B-shaped MLX affine checkpoint (issue 31) from the weights of a benchmark GGUF, as mlx_lm.convert
would from those weights: each tensor dequantized by gem4, rounded to bf16 (the dtype mlx_lm quantizes from)
and quantized with mlx (`mx.quantize`, affine, --bits / --group-size) wherever mlx_lm quantizes (every linear
and embedding whose input width is a multiple of the group size; vectors stay bf16). Names are the text model's
under `model.` (mlx_lm's gemma4_text), config.json is make_e2b.py's with `quantization` added.

    python benchmarks/make_mlx.py benchmarks/out/e2b-q4_0.gguf --out benchmarks/out/e2b-mlx-4bit      # 2.6 GB
    python benchmarks/make_mlx.py benchmarks/out/e2b-q4_0.gguf --gguf q4_k_m --out benchmarks/out/e2b-q4_k_m.gguf

`--gguf TYPE` writes the same weights as a GGUF of that type instead (gem4's writer, `gem4 convert`'s types: the
Q4_K_M to compare with), dequantized from the source and quantized again.

The quantization runs in row chunks (exact: groups lie within rows), so memory stays ~the packed output
(held until the one safetensors file is written) plus a chunk.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import gem4  # noqa: F401  first: torch's runtime environment
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_e2b import Arch, hf_config  # noqa: E402

CHUNK_ELEMS = 1 << 25          # weights quantized at a time


def quantize_rows(w: torch.Tensor, bits: int, group: int):
    """float [rows, k] -> mlx (q, scales, biases), quantized CHUNK_ELEMS at a time."""
    import mlx.core as mx

    rows = max(1, CHUNK_ELEMS // w.shape[1])
    parts = []
    for r in range(0, w.shape[0], rows):
        chunk = mx.array(w[r:r + rows].float().numpy()).astype(mx.bfloat16)
        parts.append(mx.quantize(chunk, group_size=group, bits=bits))
        mx.eval(parts[-1])
    return tuple(mx.concatenate([p[i] for p in parts]) for i in range(3))


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx

    from gem4.weights.checkpoint import open_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path, help="an E2B-shaped GGUF from make_e2b.py")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    ap.add_argument("--gguf", dest="gguf_type", default=None, help="write a GGUF of this type instead (e.g. q4_k_m)")
    a = ap.parse_args(argv)
    ckpt = open_checkpoint(a.gguf)
    if ckpt.config.num_layers != Arch().layers or ckpt.config.moe is not None:
        raise SystemExit(f"{a.gguf}: not an E2B-shaped file from make_e2b.py")
    start = time.time()
    if a.gguf_type:
        from dataclasses import replace

        from gem4.weights.gguf_model import write_gguf

        # the writer reads HF checkpoints: these tensors with make_e2b's config.json (no tokenizer beside them)
        as_hf = replace(ckpt, format="safetensors", path=a.out.parent, metadata={"config.json": hf_config(Arch())})
        counts = write_gguf(as_hf, a.out, a.gguf_type, name=a.out.stem)
        print(f"wrote {a.out} ({a.out.stat().st_size / 1e9:.2f} GB: {counts}) in {time.time() - start:.0f} s")
        return 0
    out: dict = {}
    for i, (name, entry) in enumerate(ckpt.tensors.items()):
        w = entry.dense()
        key = "model." + name
        if w.dim() == 2 and w.shape[1] % a.group_size == 0:
            q, s, b = quantize_rows(w, a.bits, a.group_size)
            module = key.removesuffix(".weight")
            out[key], out[module + ".scales"], out[module + ".biases"] = q, s, b
        else:
            out[key] = mx.array(w.float().numpy()).astype(mx.bfloat16)
        entry.release()
        print(f"\r{i + 1}/{len(ckpt.tensors)} tensors, {time.time() - start:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    a.out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(a.out / "model.safetensors"), out, metadata={"format": "mlx"})
    quant = {"group_size": a.group_size, "bits": a.bits, "mode": "affine"}
    config = dict(hf_config(Arch()), quantization=quant, quantization_config=quant, gem4_bench_source=a.gguf.name)
    (a.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    size = sum(p.stat().st_size for p in a.out.glob("*.safetensors"))
    print(f"wrote {a.out}/ ({size / 1e9:.2f} GB) in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
