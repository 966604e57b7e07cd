"""Write a 26B-A4B-shaped Gemma 4 GGUF with seeded random weights (issue 17's benchmark file).

    python benchmarks/make_a4b.py --out benchmarks/out             # -> benchmarks/out/a4b-q4_0.gguf (14.3 GB)
    python benchmarks/make_a4b.py --out benchmarks/out --layers 2  # a quick smoke file

The real 26B-A4B hyperparameters (docs/gemma4.md §4.3, the metadata of llama.cpp's vocab GGUF): 30 layers
(5 sliding + 1 full) x 5, hidden 2816, 16 query heads, sliding layers 8 K/V heads of 256, full layers 2 of 512
with k_eq_v (no attn_v), dense MLP 2112 beside 128 routed experts of width 704, top-8, window 1024, vocabulary
262144, tied head. Q4_0 or Q8_0 for every matrix; the router (`ffn_gate_inp`) and 1-D tensors F32, as
llama.cpp's converter keeps them. Bytes are generated as make_e2b.py does (same writer, same random blocks):
the router's rows are N(0, 0.02) like every weight, so it routes about uniformly -- the worst case for an
expert cache. Tensor names and keys are llama.cpp's, so `llama-server` loads the same file.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from make_e2b import (TYPES, VOCAB_CANDIDATES, FILE_TYPE, VT, GGMLType, enc_kv, tokenizer_kvs,
                      write_gguf)

H, NH, FF, VOCAB, WINDOW, SOFTCAP = 2816, 16, 2112, 262144, 1024, 30.0
SWA_KV, SWA_D, FULL_KV, FULL_D = 8, 256, 2, 512
E, TOP_K, IM = 128, 8, 704
PATTERN = 6                    # 5 sliding + 1 full


def sliding(layers: int) -> list[bool]:                # the last layer is full (as on 26B-A4B's 30)
    return [(i + 1) % PATTERN != 0 and i != layers - 1 for i in range(layers)]


def tensor_plan(layers: int, qtype: GGMLType) -> list[tuple[str, tuple[int, ...], GGMLType, str]]:
    """(llama.cpp name, PyTorch shape, stored type, init) in file order (docs/gemma4.md §3)."""
    F32 = GGMLType.F32
    plan = [("token_embd.weight", (VOCAB, H), qtype, "w"),
            ("rope_freqs.weight", (FULL_D // 2,), F32, "rope"),
            ("output_norm.weight", (H,), F32, "norm")]
    for i, swa in enumerate(sliding(layers)):
        nkv, d = (SWA_KV, SWA_D) if swa else (FULL_KV, FULL_D)
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (H,), F32, "norm"),
                 (b + "attn_q.weight", (NH * d, H), qtype, "w"),
                 (b + "attn_k.weight", (nkv * d, H), qtype, "w")]
        if swa:                                              # full layers: k_eq_v, V is K's projection
            plan += [(b + "attn_v.weight", (nkv * d, H), qtype, "w")]
        plan += [(b + "attn_q_norm.weight", (d,), F32, "qknorm"),
                 (b + "attn_k_norm.weight", (d,), F32, "qknorm"),
                 (b + "attn_output.weight", (H, NH * d), qtype, "w"),
                 (b + "post_attention_norm.weight", (H,), F32, "norm"),
                 (b + "ffn_norm.weight", (H,), F32, "norm"),
                 (b + "ffn_gate.weight", (FF, H), qtype, "w"),
                 (b + "ffn_up.weight", (FF, H), qtype, "w"),
                 (b + "ffn_down.weight", (H, FF), qtype, "w"),
                 (b + "post_ffw_norm_1.weight", (H,), F32, "norm"),
                 (b + "ffn_gate_inp.weight", (E, H), F32, "w"),
                 (b + "ffn_gate_inp.scale", (H,), F32, "norm"),
                 (b + "pre_ffw_norm_2.weight", (H,), F32, "norm"),
                 (b + "ffn_gate_up_exps.weight", (E, 2 * IM, H), qtype, "w"),
                 (b + "ffn_down_exps.weight", (E, H, IM), qtype, "w"),
                 (b + "ffn_down_exps.scale", (E,), F32, "norm"),
                 (b + "post_ffw_norm_2.weight", (H,), F32, "norm"),
                 (b + "post_ffw_norm.weight", (H,), F32, "norm"),
                 (b + "layer_output_scale.weight", (1,), F32, "one")]
    return plan


def metadata(layers: int, qtype: GGMLType, seed: int, vocab: Path) -> list[bytes]:
    a = "gemma4."
    swa = sliding(layers)
    kvs = [enc_kv("general.architecture", VT.STRING, "gemma4"),
           enc_kv("general.name", VT.STRING, f"gem4 bench 26B-A4B-shaped random (seed {seed})"),
           enc_kv("general.file_type", VT.UINT32, FILE_TYPE[qtype]),
           enc_kv("general.quantization_version", VT.UINT32, 2)]
    for key, value in (("context_length", 262144), ("embedding_length", H), ("block_count", layers),
                       ("feed_forward_length", FF), ("attention.head_count", NH),
                       ("attention.key_length", FULL_D), ("attention.value_length", FULL_D),
                       ("attention.key_length_swa", SWA_D), ("attention.value_length_swa", SWA_D),
                       ("rope.dimension_count", FULL_D), ("rope.dimension_count_swa", SWA_D),
                       ("attention.sliding_window", WINDOW), ("attention.shared_kv_layers", 0),
                       ("embedding_length_per_layer_input", 0), ("expert_count", E),
                       ("expert_used_count", TOP_K), ("expert_feed_forward_length", IM)):
        kvs.append(enc_kv(a + key, VT.UINT32, value))
    kvs += [enc_kv(a + "attention.head_count_kv", VT.ARRAY, [SWA_KV if s else FULL_KV for s in swa], VT.INT32),
            enc_kv(a + "attention.sliding_window_pattern", VT.ARRAY, swa, VT.BOOL),
            enc_kv(a + "rope.freq_base", VT.FLOAT32, 1e6),
            enc_kv(a + "rope.freq_base_swa", VT.FLOAT32, 1e4),
            enc_kv(a + "attention.layer_norm_rms_epsilon", VT.FLOAT32, 1e-6),
            enc_kv(a + "final_logit_softcapping", VT.FLOAT32, SOFTCAP)]
    return kvs + tokenizer_kvs(vocab)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", default="q4_0", choices=["q4_0", "q8_0"])
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=30, help="fewer layers for a quick smoke file")
    ap.add_argument("--vocab", type=Path, default=None, help="Gemma 4 vocab GGUF (tokenizer.* keys)")
    args = ap.parse_args(argv)
    vocab = args.vocab or next((p for p in VOCAB_CANDIDATES if p.is_file()), None)
    if vocab is None:
        ap.error("the Gemma 4 vocab GGUF was not found; pass --vocab")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"a4b-{args.type}" + (f"-L{args.layers}" if args.layers != 30 else "") + (f"-s{args.seed}" if args.seed else "")
    path = args.out / f"{stem}.gguf"
    qtype = TYPES[args.type]
    t0 = time.perf_counter()
    print(f"writing {path} ({args.layers} layers, seed {args.seed})", flush=True)
    write_gguf(path, tensor_plan(args.layers, qtype), metadata(args.layers, qtype, args.seed, vocab), args.seed)
    print(f"wrote {path}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
