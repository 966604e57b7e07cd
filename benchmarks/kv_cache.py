"""KV cache dtype benchmark (issue 31, part 2): what an int8 or fp8_e4m3 cache costs in accuracy and buys in room
and speed, against the bf16 cache, on the same model. Not part of CI.

    python benchmarks/kv_cache.py drift benchmarks/out/e2b-q4_0.gguf --lengths 512 2048 8192
    python benchmarks/kv_cache.py drift --tiny --lengths 512 2048 8192
    python benchmarks/kv_cache.py speed benchmarks/out/e2b-q4_0.gguf --context 512 8192 --rounds 3 \\
        --llama-bench /path/to/llama.cpp/build/bin/llama-bench
    python benchmarks/kv_cache.py room benchmarks/out/e2b-q4_0.gguf --kv-cache-memory 4

- drift: a seeded random prompt of each length, prefilled in chunks of --chunk, then --decode tokens fed one at a
  time (the decode kernels), once per cache dtype on one loaded model (the fast mode, bf16). The logits of the
  prompt's last --tail positions and of every decoded one are compared with the bf16 cache's: NMSE, argmax
  agreement, and the agreement where the bf16 run's top two logits are at least 0.1 apart (on random weights
  many positions are near-ties, which any rounding flips). --tiny: the four tiny test variants instead
  (tests/model_fixtures.py, built with transformers, context raised to fit the lengths).
- speed: per --context, one sequence per cache dtype (--kv; auto = bf16) prefilled to it, then rounds of --tokens
  greedy-fed decode steps, the dtypes interleaved (bf16, int8, fp8, bf16, ...): decode tok/s per round, median
  over --rounds. With --llama-bench, each round also runs llama.cpp's llama-bench on the same file once per
  --llama-kv cache type (`-ctk T -ctv T -fa 1 -d CONTEXT -n TOKENS -r 1`: its own prefill of the context, then
  the decode steps; flash attention because llama.cpp's quantized V cache needs it).
- room: from the file's config alone (engine/pool.py's kv_pool_size with a --kv-cache-memory budget), the most
  sequences of each context length that fit the budget, per cache dtype, and the bytes per token.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import gem4  # noqa: F401  first: gem4 sets torch's runtime environment
import torch

KV = ("auto", "int8", "fp8_e4m3")
DECISIVE = 0.1


def nmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out - ref) ** 2).mean() / (ref ** 2).mean())


def run_prompt(model, ids: list[int], kv: str, chunk: int, tail: int, decode: int) -> torch.Tensor:
    """Logits [tail + decode, V] of the prompt's last `tail` positions and of `decode` tokens fed one at a time."""
    cache = model.new_cache(kv)
    prompt, fed = ids[:len(ids) - decode], ids[len(ids) - decode:]
    out = []
    for start in range(0, len(prompt), chunk):
        piece = torch.tensor(prompt[start:start + chunk])
        left = len(prompt) - start                                  # positions from this chunk's first to the end
        want = max(0, min(piece.numel(), tail - (left - piece.numel())))
        logits = model.extend(piece, cache, logits=want, prefill=True)
        if want:
            out.append(logits)
    out += [model.extend(torch.tensor([t]), cache) for t in fed]
    return torch.cat(out)


def drift_rows(name: str, model, lengths: list[int], a: argparse.Namespace) -> list[str]:
    rows = []
    for n in lengths:
        gen = torch.Generator().manual_seed(n)
        ids = torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
        t0 = time.perf_counter()
        ref = run_prompt(model, ids, "auto", a.chunk, a.tail, a.decode)
        top2 = ref.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) >= DECISIVE
        for kv in KV[1:]:
            out = run_prompt(model, ids, kv, a.chunk, a.tail, a.decode)
            same = out.argmax(-1) == ref.argmax(-1)
            p, d = slice(0, a.tail), slice(a.tail, None)
            rows.append(f"| {name} | {n} | {kv} | {nmse(out[p], ref[p]):.2e} | {nmse(out[d], ref[d]):.2e} | "
                        f"{float(same.float().mean()):.3f} | {float(same[decisive].float().mean()):.3f} "
                        f"({int(decisive.sum())}/{len(same)}) |")
            print(rows[-1], f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return rows


def cmd_drift(a: argparse.Namespace) -> None:
    print(f"prefill chunk {a.chunk}; compared: the prompt's last {a.tail} positions (prefill) and {a.decode} "
          f"decoded ones, against the bf16 cache\n")
    print("| model | tokens | KV cache | NMSE prefill | NMSE decode | argmax agreement | at decisive positions |")
    print("|---|---|---|---|---|---|---|")
    if a.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import tempfile

        from model_fixtures import VARIANTS, build_hf

        for name in VARIANTS:
            causal, _ = build_hf(name, max_position_embeddings=max(a.lengths) + 64)
            with tempfile.TemporaryDirectory() as tmp:
                causal.save_pretrained(tmp)
                model = gem4.load(tmp, dtype="bfloat16")
            for row in drift_rows(name, model, a.lengths, a):
                print(row, flush=True)
    else:
        model = gem4.load(a.model, dtype="bfloat16")
        for row in drift_rows(Path(a.model).name, model, a.lengths, a):
            print(row, flush=True)


def llama_bench(a: argparse.Namespace, context: int, kv: str) -> float:
    """llama-bench's decode tok/s: --tokens steps (tg) after a --context-token prompt (-d), one repetition, its
    K and V caches in `kv` (f16, q8_0), flash attention on (a quantized V cache needs it)."""
    cmd = [a.llama_bench, "-m", str(a.model), "-p", "0", "-n", str(a.tokens), "-d", str(context), "-r", "1",
           "-t", str(a.threads), "-ctk", kv, "-ctv", kv, "-fa", "1", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"llama-bench exited {done.returncode}: {done.stderr[-2000:]}")
    (test,) = json.loads(done.stdout)
    return float(test["avg_ts"])


def cmd_speed(a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    model = gem4.load(a.model, dtype="bfloat16")
    kvs = a.kv
    engines = [f"gem4 {kv}" for kv in kvs] + ([f"llama.cpp {kv}" for kv in a.llama_kv] if a.llama_bench else [])
    tables = []
    for context in a.context:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (context,), generator=gen)
        caches, last = {}, {}
        for kv in kvs:
            t0 = time.perf_counter()
            caches[kv] = model.new_cache(kv)
            for start in range(0, context, a.chunk):
                logits = model.extend(ids[start:start + a.chunk], caches[kv], prefill=True)
            last[kv] = int(logits[-1].argmax())
            print(f"prefill {context} tokens, {kv}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        rates: dict[str, list[float]] = {e: [] for e in engines}
        for r in range(a.rounds):
            for kv in kvs:
                tok = last[kv]
                t0 = time.perf_counter()
                for _ in range(a.tokens):
                    tok = int(model.extend(torch.tensor([tok]), caches[kv])[-1].argmax())
                rates[f"gem4 {kv}"].append(a.tokens / (time.perf_counter() - t0))
                last[kv] = tok
                print(f"context {context} round {r} gem4 {kv}: {rates[f'gem4 {kv}'][-1]:.2f} tok/s", file=sys.stderr,
                      flush=True)
            for kv in a.llama_kv if a.llama_bench else ():
                rates[f"llama.cpp {kv}"].append(llama_bench(a, context, kv))
                print(f"context {context} round {r} llama.cpp {kv}: {rates[f'llama.cpp {kv}'][-1]:.2f} tok/s",
                      file=sys.stderr, flush=True)
        del caches
        tables.append((context, rates))
    print(f"decode after a prompt of CONTEXT tokens, {a.tokens} tokens a round (gem4: rounds continue one "
          f"sequence; llama.cpp: llama-bench -d CONTEXT -n {a.tokens} -fa 1, one run a round), {a.rounds} rounds "
          f"interleaved, {a.threads} threads\n")
    print("| context | engine, KV cache | decode tok/s, median | min - max | vs the engine's first |")
    print("|---|---|---|---|---|")
    for context, rates in tables:
        for e in engines:
            base = statistics.median(rates[next(x for x in engines if x.split()[0] == e.split()[0])])
            med = statistics.median(rates[e])
            print(f"| {context} | {e} | {med:.2f} | {min(rates[e]):.2f} - {max(rates[e]):.2f} | {med / base:.3f} |")


def cmd_room(a: argparse.Namespace) -> None:
    from gem4.engine.pool import kv_pool_size
    from gem4.kv_cache import kv_bytes_per_token, kv_cache_dtype
    from gem4.weights.checkpoint import open_checkpoint

    config = open_checkpoint(a.model).config
    budget = int(a.kv_cache_memory * 2 ** 30)
    print(f"--kv-cache-memory {a.kv_cache_memory} GiB, prefix caching on, prefill chunk {a.chunk}: the most "
          f"sequences of each context that fit\n")
    print("| KV cache | bytes / token (sliding + full layers) | " + " | ".join(f"ctx {c}" for c in a.contexts) + " |")
    print("|---|---|" + "---|" * len(a.contexts))
    for kv in ("bfloat16", "int8", "fp8_e4m3"):
        dtype = kv_cache_dtype(kv, torch.bfloat16)
        per = kv_bytes_per_token(config, dtype)
        fits = []
        for ctx in a.contexts:
            best = 0
            for seqs in range(1, 4097):
                try:
                    size = kv_pool_size(config, dtype, max_chunk=a.chunk, num_seqs=seqs, max_model_len=ctx,
                                        budget=budget, prefix_caching=True)
                except ValueError:
                    break
                if size.tokens < seqs * ctx:
                    break
                best = seqs
            fits.append(best)
        print(f"| {kv} | {sum(per.values())} ({' + '.join(str(v) for v in per.values())}) | "
              + " | ".join(str(f) for f in fits) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drift")
    d.add_argument("model", nargs="?")
    d.add_argument("--tiny", action="store_true", help="the four tiny test variants instead of MODEL")
    d.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    d.add_argument("--chunk", type=int, default=256)
    d.add_argument("--tail", type=int, default=32, help="prompt positions compared (the last ones)")
    d.add_argument("--decode", type=int, default=16, help="decoded positions compared")
    d.set_defaults(func=cmd_drift)
    s = sub.add_parser("speed")
    s.add_argument("model")
    s.add_argument("--context", type=int, nargs="+", default=[8192])
    s.add_argument("--chunk", type=int, default=256)
    s.add_argument("--tokens", type=int, default=16)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--kv", nargs="+", default=list(KV), choices=KV, help="the cache dtypes, the first the baseline")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench: its caches side by side")
    s.add_argument("--llama-kv", nargs="+", default=["f16", "q8_0"], help="llama-bench's -ctk/-ctv types")
    s.set_defaults(func=cmd_speed)
    r = sub.add_parser("room")
    r.add_argument("model")
    r.add_argument("--kv-cache-memory", type=float, default=4.0, metavar="GIB")
    r.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    r.add_argument("--chunk", type=int, default=256)
    r.set_defaults(func=cmd_room)
    a = p.parse_args()
    if a.cmd == "drift" and not a.tiny and not a.model:
        p.error("drift needs MODEL or --tiny")
    a.func(a)


if __name__ == "__main__":
    main()
