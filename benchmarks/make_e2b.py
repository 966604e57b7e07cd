"""Write an E2B-shaped Gemma 4 GGUF with seeded random weights, tensor by tensor (docs/gemma4.md §1.3, §3, §4).

    python benchmarks/make_e2b.py --type q4_0 --out benchmarks/out            # -> benchmarks/out/e2b-q4_0.gguf
    python benchmarks/make_e2b.py --type bf16 --out benchmarks/out --hf       # + benchmarks/out/e2b-bf16-hf/

The GGML bytes are generated directly (no float model is ever built): Q4_0 / Q8_0 blocks get random
quants and fp16 block scales chosen so that the dequantized weights are ~N(0, 0.02); BF16 gets
N(0, 0.02) rounded to bf16. 1-D tensors stay F32 (as llama.cpp's converter keeps them): norms ~1,
q_norm/k_norm scaled by head_dim^-1/4 (issue 6 item 4: keeps random attention non-chaotic),
layer_output_scale 1. Tensor names and metadata keys are llama.cpp's (mirroring
`gem4.weights.gguf_model.write_gguf`); the tokenizer keys are copied from the real Gemma 4 vocab GGUF,
so llama.cpp loads the very same file. KV-shared layers (15..34) have no attn_k/attn_v/attn_k_norm;
the head is tied (no output.weight).

`--hf` (BF16 only) also writes the same weights as an HF `Gemma4ForCausalLM` directory (config.json +
one model.safetensors, `model.*` names), streamed from the GGUF's mmapped bytes, for transformers.
Peak memory is one chunk of one tensor (~100 MB), whatever the file size.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gem4.gguf import GGUFReader
from gem4.gguf import GGUFValueType as VT
from gem4.ggml import GGMLType, tensor_nbytes

REPO = Path(__file__).resolve().parents[1]
VOCAB_CANDIDATES = [REPO / "tests/assets/gemma4-vocab/ggml-vocab-gemma-4.gguf"]      # the repository's copy

# ---- E2B text shapes (docs/gemma4.md §1.3) ----
H, NH, NKV, D_SWA, D_FULL = 1536, 8, 1, 256, 512
FF, P, VOCAB, WINDOW, SOFTCAP = 6144, 256, 262144, 512, 30.0
STD = 0.02                     # weights ~N(0, STD) after dequantization
ALIGN = 32
TYPES = {"q4_0": GGMLType.Q4_0, "q8_0": GGMLType.Q8_0, "bf16": GGMLType.BF16}
FILE_TYPE = {GGMLType.Q4_0: 2, GGMLType.Q8_0: 7, GGMLType.BF16: 32}      # llama_ftype
CHUNK = 1 << 24                # elements generated at a time


@dataclass(frozen=True)
class Arch:
    layers: int = 35

    @property
    def sliding(self) -> list[bool]:              # (4 sliding + 1 full) x 7; the last layer is full
        return [(i + 1) % 5 != 0 and i != self.layers - 1 for i in range(self.layers)]

    @property
    def first_shared(self) -> int:                # 15 of 35 (a multiple of the pattern; scaled for --layers)
        first = -(-round(self.layers * 15 / 35) // 5) * 5
        return first if 5 <= first < self.layers else self.layers

    @property
    def shared(self) -> int:                      # 20 KV-shared layers on E2B
        return self.layers - self.first_shared

    def ff(self, i: int) -> int:                  # double-wide MLP on the KV-shared layers
        return 2 * FF if i >= self.first_shared else FF

    def head_dim(self, i: int) -> int:
        return D_SWA if self.sliding[i] else D_FULL


def tensor_plan(arch: Arch, qtype: GGMLType) -> list[tuple[str, tuple[int, ...], GGMLType, str]]:
    """(llama.cpp name, PyTorch shape [out, in], stored type, init) in file order."""
    L = arch.layers
    F32 = GGMLType.F32
    plan = [("token_embd.weight", (VOCAB, H), qtype, "w"),
            ("per_layer_token_embd.weight", (VOCAB, L * P), qtype, "w"),
            ("per_layer_model_proj.weight", (L * P, H), qtype, "w"),
            ("per_layer_proj_norm.weight", (P,), F32, "norm"),
            ("rope_freqs.weight", (D_FULL // 2,), F32, "rope"),
            ("output_norm.weight", (H,), F32, "norm")]
    for i in range(L):
        d, owns_kv = arch.head_dim(i), i < arch.first_shared
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (H,), F32, "norm"),
                 (b + "attn_q.weight", (NH * d, H), qtype, "w")]
        if owns_kv:
            plan += [(b + "attn_k.weight", (NKV * d, H), qtype, "w"),
                     (b + "attn_v.weight", (NKV * d, H), qtype, "w")]
        plan += [(b + "attn_q_norm.weight", (d,), F32, "qknorm")]
        if owns_kv:
            plan += [(b + "attn_k_norm.weight", (d,), F32, "qknorm")]
        plan += [(b + "attn_output.weight", (H, NH * d), qtype, "w"),
                 (b + "post_attention_norm.weight", (H,), F32, "norm"),
                 (b + "ffn_norm.weight", (H,), F32, "norm"),
                 (b + "ffn_gate.weight", (arch.ff(i), H), qtype, "w"),
                 (b + "ffn_up.weight", (arch.ff(i), H), qtype, "w"),
                 (b + "ffn_down.weight", (H, arch.ff(i)), qtype, "w"),
                 (b + "post_ffw_norm.weight", (H,), F32, "norm"),
                 (b + "inp_gate.weight", (P, H), qtype, "w"),
                 (b + "proj.weight", (H, P), qtype, "w"),
                 (b + "post_norm.weight", (H,), F32, "norm"),
                 (b + "layer_output_scale.weight", (1,), F32, "one")]
    return plan


# ---- random GGML bytes ----

def _f16_bytes(x: torch.Tensor) -> torch.Tensor:        # [n] float -> [n, 2] uint8
    return x.to(torch.float16).view(torch.uint8).view(-1, 2)


def random_q8_0(n: int, g: torch.Generator) -> torch.Tensor:
    """n elements -> Q8_0 blocks [n/32, 34]: d * q with q ~ round(N(0, 32)), d ~ STD/32 (+-10%)."""
    nb = n // 32
    q = (torch.randn(nb, 32, generator=g) * 32).round_().clamp_(-127, 127).to(torch.int8)
    d = STD / 32 * (1 + 0.1 * (torch.rand(nb, generator=g) - 0.5))
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=1)


def random_q4_0(n: int, g: torch.Generator) -> torch.Tensor:
    """n elements -> Q4_0 blocks [n/32, 18]: d * (q - 8) with q - 8 ~ round(N(0, 2.5)), d ~ STD/2.5 (+-10%)."""
    nb = n // 32
    q = (torch.randn(nb, 32, generator=g) * 2.5).round_().clamp_(-8, 7).add_(8).to(torch.uint8)
    d = STD / 2.5 * (1 + 0.1 * (torch.rand(nb, generator=g) - 0.5))
    return torch.cat([_f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], dim=1)   # elem j: lo nibble, 16+j: hi


def random_bf16(n: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, generator=g) * STD).to(torch.bfloat16).view(torch.uint8)


def random_f32(n: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, generator=g) * STD).view(torch.uint8)


RANDOM = {GGMLType.Q8_0: random_q8_0, GGMLType.Q4_0: random_q4_0, GGMLType.BF16: random_bf16,
          GGMLType.F32: random_f32}


def vector(init: str, n: int, g: torch.Generator) -> np.ndarray:
    """The F32 1-D tensors."""
    if init == "rope":                            # 64 rotated pairs of 256, the rest off (docs/gemma4.md §2.7)
        return np.array([1.0] * (D_FULL // 8) + [1e30] * (n - D_FULL // 8), dtype=np.float32)
    if init == "one":
        return np.ones(n, dtype=np.float32)
    w = 1 + 0.1 * torch.randn(n, generator=g)
    if init == "qknorm":                          # issue 6 item 4
        w = w * n ** -0.25
    return w.numpy().astype(np.float32)


def tensor_chunks(name: str, shape, ggml_type: GGMLType, init: str, seed: int):
    """Yield the tensor's bytes in row chunks; a generator per tensor, seeded by (seed, name)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if len(shape) == 1:
        yield vector(init, shape[0], g).tobytes()
        return
    rows, cols = int(np.prod(shape[:-1])), shape[-1]          # 3-D expert tensors: [E * rows, cols]
    step = max(1, CHUNK // cols)
    for r in range(0, rows, step):
        yield RANDOM[ggml_type](min(step, rows - r) * cols, g).numpy().tobytes()


# ---- GGUF encoding (v3, little-endian; the layout documented in gem4/gguf.py) ----

SCALAR = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
          VT.FLOAT32: "<f", VT.BOOL: "<B", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}


def enc_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def enc_kv(key: str, vtype: VT, value, array_type: VT | None = None) -> bytes:
    out = enc_str(key) + struct.pack("<I", vtype)
    if vtype == VT.STRING:
        return out + enc_str(value)
    if vtype != VT.ARRAY:
        return out + struct.pack(SCALAR[vtype], value)
    out += struct.pack("<IQ", array_type, len(value))
    if array_type == VT.STRING:
        return out + b"".join(enc_str(s) for s in value)
    return out + np.asarray(value).astype(SCALAR[array_type]).tobytes()


def metadata(arch: Arch, qtype: GGMLType, seed: int, vocab: Path) -> list[bytes]:
    """general.* + gemma4.* as `write_gguf` writes them, then the vocab file's tokenizer.* keys."""
    a, L = "gemma4.", arch.layers
    kvs = [enc_kv("general.architecture", VT.STRING, "gemma4"),
           enc_kv("general.name", VT.STRING, f"gem4 bench E2B-shaped random (seed {seed})"),
           enc_kv("general.file_type", VT.UINT32, FILE_TYPE[qtype]),
           enc_kv("general.quantization_version", VT.UINT32, 2),
           enc_kv(a + "context_length", VT.UINT32, 131072),
           enc_kv(a + "embedding_length", VT.UINT32, H),
           enc_kv(a + "block_count", VT.UINT32, L)]
    ffs = [arch.ff(i) for i in range(L)]
    kvs.append(enc_kv(a + "feed_forward_length", VT.ARRAY, ffs, VT.INT32) if len(set(ffs)) > 1
               else enc_kv(a + "feed_forward_length", VT.UINT32, ffs[0]))
    for key, value in (("attention.head_count", NH), ("attention.head_count_kv", NKV),
                       ("attention.key_length", D_FULL), ("attention.value_length", D_FULL),
                       ("attention.key_length_swa", D_SWA), ("attention.value_length_swa", D_SWA),
                       ("rope.dimension_count", D_FULL), ("rope.dimension_count_swa", D_SWA)):
        kvs.append(enc_kv(a + key, VT.UINT32, value))
    kvs += [enc_kv(a + "rope.freq_base", VT.FLOAT32, 1e6),
            enc_kv(a + "rope.freq_base_swa", VT.FLOAT32, 1e4),
            enc_kv(a + "attention.layer_norm_rms_epsilon", VT.FLOAT32, 1e-6),
            enc_kv(a + "attention.sliding_window", VT.UINT32, WINDOW),
            enc_kv(a + "attention.sliding_window_pattern", VT.ARRAY, arch.sliding, VT.BOOL),
            enc_kv(a + "attention.shared_kv_layers", VT.UINT32, arch.shared),
            enc_kv(a + "embedding_length_per_layer_input", VT.UINT32, P),
            enc_kv(a + "final_logit_softcapping", VT.FLOAT32, SOFTCAP)]
    return kvs + tokenizer_kvs(vocab)


def tokenizer_kvs(vocab: Path) -> list[bytes]:
    """The vocab file's tokenizer.* keys, encoded as they are stored."""
    kvs = []
    with GGUFReader(vocab) as r:
        for key, value in r.metadata.items():
            if key.startswith("tokenizer."):
                kvs.append(enc_kv(key, VT(r.metadata_types[key]), value,
                                  VT(r.array_types[key]) if key in r.array_types else None))
    return kvs


def write_gguf(path: Path, plan: list[tuple[str, tuple[int, ...], GGMLType, str]], kvs: list[bytes],
               seed: int) -> None:
    """plan (tensor_plan's form) and encoded metadata -> a GGUF at path, tensor bytes generated chunk by chunk."""
    tmp = path.with_suffix(".gguf.part")
    t0 = time.perf_counter()
    with open(tmp, "wb") as f:
        f.write(struct.pack("<4sIQQ", b"GGUF", 3, len(plan), len(kvs)))
        f.writelines(kvs)
        offset, sizes = 0, []
        for name, shape, t, _ in plan:
            ne = shape[::-1]
            nbytes = tensor_nbytes(t, int(np.prod(shape)))
            f.write(enc_str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                    + struct.pack("<IQ", t, offset))
            sizes.append(nbytes)
            offset += -(-nbytes // ALIGN) * ALIGN
        f.write(bytes(-f.tell() % ALIGN))
        for (name, shape, t, init), nbytes in zip(plan, sizes):
            written = 0
            for chunk in tensor_chunks(name, shape, t, init, seed):
                f.write(chunk)
                written += len(chunk)
            assert written == nbytes, (name, written, nbytes)
            f.write(bytes(-nbytes % ALIGN))
            if nbytes > 100e6:
                print(f"  {name:32s} {t.name:5s} {shape!s:18s} {nbytes / 1e6:8.1f} MB  "
                      f"[{time.perf_counter() - t0:5.0f} s]", flush=True)
    tmp.rename(path)


# ---- HF safetensors directory from a BF16 GGUF ----

HF_DTYPE = {GGMLType.BF16: "BF16", GGMLType.F32: "F32"}


def hf_name(gguf_name: str) -> str | None:
    from gem4.weights.gguf_model import to_canonical
    c = to_canonical(gguf_name)
    return None if c is None else "model." + c


def hf_config(arch: Arch) -> dict:
    """config.json in the hub form (top-level global_head_dim) that transformers 5.23 Gemma4ForCausalLM reads."""
    types = ["sliding_attention" if s else "full_attention" for s in arch.sliding]
    return {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "dtype": "bfloat16",
        "vocab_size": VOCAB, "hidden_size": H, "intermediate_size": FF, "num_hidden_layers": arch.layers,
        "layer_types": types, "num_attention_heads": NH, "num_key_value_heads": NKV,
        "head_dim": D_SWA, "global_head_dim": D_FULL, "attention_k_eq_v": False,
        "sliding_window": WINDOW, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "final_logit_softcapping": SOFTCAP, "tie_word_embeddings": True,
        "hidden_size_per_layer_input": P, "vocab_size_per_layer_input": VOCAB,
        "num_kv_shared_layers": arch.shared, "use_double_wide_mlp": True, "enable_moe_block": False,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "attention_bias": False,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
    }


def write_hf(gguf: Path, out: Path, arch: Arch) -> None:
    """Stream the BF16 GGUF's tensors (byte-identical, docs/gemma4.md §3.3) into out/model.safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    with GGUFReader(gguf) as r:
        header, names, offset = {}, [], 0
        for name, info in r.tensors.items():
            key = hf_name(name)
            if key is None:                               # rope_freqs: generated by llama.cpp's converter, no HF source
                continue
            if info.ggml_type not in HF_DTYPE:
                raise SystemExit(f"{gguf}: {name} is {info.ggml_type.name}; --hf needs a BF16 file")
            header[key] = {"dtype": HF_DTYPE[info.ggml_type], "shape": list(info.shape),
                           "data_offsets": [offset, offset + info.nbytes]}
            names.append(name)
            offset += info.nbytes
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        tmp = out / "model.safetensors.part"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for name in names:
                f.write(memoryview(r.tensor_data(name)))
        tmp.rename(out / "model.safetensors")
    config = dict(hf_config(arch), gem4_bench_source=gguf.name)     # run.py: same weights as this GGUF
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", required=True, choices=sorted(TYPES))
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=35, help="fewer layers for a quick smoke file")
    ap.add_argument("--hf", action="store_true", help="(bf16) also write <out>/e2b-bf16-hf/ for transformers")
    ap.add_argument("--vocab", type=Path, default=None, help="Gemma 4 vocab GGUF (tokenizer.* keys)")
    args = ap.parse_args(argv)
    if args.hf and args.type != "bf16":
        ap.error("--hf needs --type bf16")
    vocab = args.vocab or next((p for p in VOCAB_CANDIDATES if p.is_file()), None)
    if vocab is None:
        ap.error("the Gemma 4 vocab GGUF was not found; pass --vocab")
    arch = Arch(args.layers)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"e2b-{args.type}" + (f"-L{args.layers}" if args.layers != 35 else "") + (f"-s{args.seed}" if args.seed else "")
    path = args.out / f"{stem}.gguf"
    t0 = time.perf_counter()
    print(f"writing {path} ({args.layers} layers, {arch.shared} KV-shared, seed {args.seed})", flush=True)
    qtype = TYPES[args.type]
    write_gguf(path, tensor_plan(arch, qtype), metadata(arch, qtype, args.seed, vocab), args.seed)
    print(f"wrote {path}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.hf:
        hf = args.out / f"{stem}-hf"
        write_hf(path, hf, arch)
        print(f"wrote {hf}/ (config.json + model.safetensors, "
              f"{(hf / 'model.safetensors').stat().st_size / 1e9:.2f} GB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
