"""Side-by-side CPU benchmark: gem4 vs llama.cpp (llama-cpp-python) vs transformers, same weights.

    python benchmarks/run.py --gguf benchmarks/out/e2b-q4_0.gguf --hf benchmarks/out/e2b-bf16-hf \\
        --engines gem4,llama.cpp,transformers --repeats 3 --prompt 512 --gen 128 --threads 2
    python benchmarks/run.py profile --gguf benchmarks/out/e2b-q4_0.gguf      # one gem4 decode step

Every run is a fresh subprocess (one engine, one model load), and the engines are interleaved
(A B C A B C ...) so that drift of the machine hits all of them alike. Per run:

    load     s      constructing the model from the file (page cache warmed beforehand by reading the file)
    prefill  tok/s  the prompt (BOS + seeded random ids) through the model; gem4 in chunks of --chunk
    TTFT     s      prefill + picking the first token (load excluded)
    decode   tok/s  --gen single-token greedy steps after that (argmax; EOS ignored, exactly --gen steps)
    peak RSS GB     the child's VmHWM (/proc/self/status): includes mmapped file pages it touched

Each metric is reported as median (min-max) over --repeats, with the ratios gem4/llama.cpp and
gem4/transformers of the medians, next to the decode bandwidth ceiling: measured read bandwidth
divided by the bytes a decoded token reads (see `bytes_per_token`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ENGINES = ("gem4", "llama.cpp", "transformers")
RESULT = "RESULT "                      # prefix of the child's one-line JSON answer on stdout


# ---------------------------------------------------------------------------------------------
# children: one engine, one model load, one measurement
# ---------------------------------------------------------------------------------------------

def prompt_ids(n: int, seed: int, vocab: int = 262144) -> list[int]:
    import numpy as np
    return [2] + np.random.default_rng(seed).integers(3, vocab, n - 1).tolist()      # BOS + random ids


def peak_rss() -> float:
    """GB; VmHWM of this process."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def child_gem4(a) -> dict:
    import gem4                    # first: it sets torch's runtime environment before torch loads
    import torch
    torch.set_num_threads(a.threads)
    t = time.perf_counter()
    model = gem4.load(a.model, dtype="bfloat16")
    load = time.perf_counter() - t
    ids = torch.tensor(prompt_ids(a.prompt, a.seed))
    cache = model.new_cache()
    t0 = time.perf_counter()
    for s in range(0, len(ids), a.chunk):
        logits = model.extend(ids[s:s + a.chunk], cache)
    t_prefill = time.perf_counter() - t0
    tok = int(logits[-1].argmax())
    ttft = time.perf_counter() - t0
    out = [tok]
    t1 = time.perf_counter()
    for _ in range(a.gen):
        tok = int(model.extend(torch.tensor([tok]), cache)[-1].argmax())
        out.append(tok)
    t_decode = time.perf_counter() - t1
    return dict(load=load, prefill=t_prefill, ttft=ttft, decode=t_decode, tokens=out,
                version=f"gem4 {gem4.__version__} ({Path(gem4.__file__).parent}), torch {torch.__version__}")


def child_llama_cpp(a) -> dict:
    import llama_cpp
    import numpy as np
    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(a.model), n_threads=a.threads, n_threads_batch=a.threads,
                          n_ctx=a.ctx, n_batch=a.chunk, n_ubatch=a.chunk, verbose=False)
    load = time.perf_counter() - t
    n_vocab = llm.n_vocab()

    def argmax_last() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))

    ids = prompt_ids(a.prompt, a.seed)
    t0 = time.perf_counter()
    llm.eval(ids)                                   # in n_batch chunks; logits of the last token only
    t_prefill = time.perf_counter() - t0
    tok = argmax_last()
    ttft = time.perf_counter() - t0
    out = [tok]
    t1 = time.perf_counter()
    for _ in range(a.gen):
        llm.eval([tok])
        tok = argmax_last()
        out.append(tok)
    t_decode = time.perf_counter() - t1
    return dict(load=load, prefill=t_prefill, ttft=ttft, decode=t_decode, tokens=out,
                version=f"llama-cpp-python {llama_cpp.__version__}")


def child_transformers(a) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(a.threads)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, attn_implementation="eager").eval()
    load = time.perf_counter() - t
    ids = torch.tensor([prompt_ids(a.prompt, a.seed)])
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        t_prefill = time.perf_counter() - t0
        tok = int(logits[0, -1].argmax())
        ttft = time.perf_counter() - t0
        out = [tok]
        t1 = time.perf_counter()
        for _ in range(a.gen):
            logits = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits
            tok = int(logits[0, -1].argmax())
            out.append(tok)
        t_decode = time.perf_counter() - t1
    return dict(load=load, prefill=t_prefill, ttft=ttft, decode=t_decode, tokens=out,
                version=f"transformers {transformers.__version__}, torch {torch.__version__}")


def child_membw(a) -> dict:
    """Read bandwidth over a 1 GiB float32 buffer (>> the 32 MiB L3) with `--threads` threads: the best of
    three read-only reductions (sum, dot, amax), each the median of 7 timed runs; copy for reference."""
    import torch
    torch.set_num_threads(a.threads)
    x = torch.rand(1 << 28, generator=torch.Generator().manual_seed(0))      # random: no page can be shared
    y = torch.empty_like(x)
    nbytes = x.numel() * 4

    def gbps(fn, traffic: int = nbytes) -> float:
        fn()
        times = []
        for _ in range(7):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return traffic / statistics.median(times) / 1e9

    reads = {"sum": gbps(x.sum), "dot": gbps(lambda: torch.dot(x, x)), "amax": gbps(x.amax)}
    xn = x.numpy()
    return dict(read=max(reads.values()), reads=reads, copy=gbps(lambda: y.copy_(x), 2 * nbytes),
                numpy_read_1thread=gbps(xn.sum), threads=a.threads)


def child_profile(a) -> dict:
    """Profile of one gem4 decode step after a --prompt prefill (torch.profiler, then cProfile)."""
    import cProfile
    import io
    import pstats

    import gem4                    # first: it sets torch's runtime environment before torch loads
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.set_num_threads(a.threads)
    model = gem4.load(a.model, dtype="bfloat16")
    cache = model.new_cache()
    ids = torch.tensor(prompt_ids(a.prompt, a.seed))
    for s in range(0, len(ids), a.chunk):
        logits = model.extend(ids[s:s + a.chunk], cache)
    tok = torch.tensor([int(logits[-1].argmax())])
    steps = []
    for _ in range(5):                               # warm
        t = time.perf_counter()
        tok = model.extend(tok, cache)[-1].argmax().view(1)
        steps.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        tok = model.extend(tok, cache)[-1].argmax().view(1)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    table = events.table(sort_by="self_cpu_time_total", row_limit=a.rows)
    ops_us = sum(e.self_cpu_time_total for e in events)
    pr = cProfile.Profile()
    pr.enable()
    tok = model.extend(tok, cache)[-1].argmax().view(1)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.rows)
    return dict(step_ms=[1e3 * x for x in steps], profiled_step_ms=1e3 * wall, ops_self_ms=ops_us / 1e3,
                torch_table=table, cprofile=s.getvalue(), n_ops=sum(e.count for e in events))


CHILDREN = {"gem4": child_gem4, "llama.cpp": child_llama_cpp, "transformers": child_transformers,
            "membw": child_membw, "profile": child_profile}


def child_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=sorted(CHILDREN))
    ap.add_argument("--model", default="")
    for name, default in (("prompt", 512), ("gen", 128), ("threads", 2), ("chunk", 512), ("ctx", 1024),
                          ("seed", 0), ("rows", 25)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args(argv)
    r = CHILDREN[a.engine](a)
    r["peak_rss"] = peak_rss()
    print(RESULT + json.dumps(r), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------

def run_child(engine: str, model: Path | str, a, extra: list[str] = ()) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    if a.gem4_src:
        env["PYTHONPATH"] = os.pathsep.join([str(a.gem4_src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, str(Path(__file__).resolve()), "_child", engine, "--model", str(model),
           "--prompt", str(a.prompt), "--gen", str(a.gen), "--threads", str(a.threads), "--chunk", str(a.chunk),
           "--ctx", str(a.ctx), "--seed", str(a.seed), *extra]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=a.timeout, check=False)
    lines = [l for l in p.stdout.splitlines() if l.startswith(RESULT)]
    if p.returncode or not lines:
        raise RuntimeError(f"{engine} child failed (exit {p.returncode}); stdout tail:\n{p.stdout[-2000:]}")
    return json.loads(lines[-1][len(RESULT):])


def busy_cpu_seconds() -> float:
    """CPU seconds spent by every process on the machine so far (/proc/stat, all cores)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, *_ = (int(x) for x in f.readline().split()[1:])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measured_run(engine: str, model, a) -> dict:
    """run_child, plus `other_load`: the cores busy with OTHER processes while it ran (ideally ~0)."""
    b0, c0, t0 = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter()
    r = run_child(engine, model, a)
    wall = time.perf_counter() - t0
    r["other_load"] = max(0.0, (busy_cpu_seconds() - b0) - (children_cpu_seconds() - c0)) / wall
    return r


def warm_page_cache(path: Path) -> None:
    """Read the model file(s) once so every load starts from a warm page cache."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    buf = bytearray(1 << 24)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def mem_available() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("inf")


def bytes_per_token(gguf: Path, context: float) -> dict:
    """Bytes one decoded token reads, from the GGUF's tensor table.

    Counted: every 2-D weight in its stored type (each layer's q/k/v/o, gate/up/down, inp_gate/proj,
    the PLE model projection; no K/V projections exist on KV-shared layers), the tied head
    (token_embd, counted once: the embedding lookup reads one row), ONE row of per_layer_token_embd
    (the current token's PLE row), the F32 vectors; plus the bf16 K/V every layer attends over at the
    given mean context (sliding layers: at most the window). `bf16_weights` is the same count with
    every matrix in bf16: what gem4's reference path (dequantized to bf16 at load) reads.
    """
    from gem4.gguf import GGUFReader
    with GGUFReader(gguf) as r:
        md = r.metadata
        weights = bf16 = ple_row = vectors = head = 0
        for name, t in r.tensors.items():
            n = 1
            for d in t.shape:
                n *= d
            if name == "per_layer_token_embd.weight":
                ple_row = t.nbytes // t.shape[0]
                weights += ple_row
                bf16 += ple_row
            elif len(t.shape) == 1:
                vectors += t.nbytes
                weights += t.nbytes
                bf16 += t.nbytes
            else:
                weights += t.nbytes
                bf16 += 2 * n
                if name == "token_embd.weight":
                    head = t.nbytes
        L = int(md["gemma4.block_count"])
        window = int(md["gemma4.attention.sliding_window"])
        pattern = md["gemma4.attention.sliding_window_pattern"]
        d_full, d_swa = int(md["gemma4.attention.key_length"]), int(md["gemma4.attention.key_length_swa"])
        nkv = md["gemma4.attention.head_count_kv"]
        nkv = [int(x) for x in nkv] if hasattr(nkv, "__len__") else [int(nkv)] * L
        kv = sum(2 * 2 * nkv[i] * (d_swa * min(context, window) if pattern[i] else d_full * context) for i in range(L))
    return dict(weights=weights, bf16_weights=bf16, head=head, ple_row=ple_row, vectors=vectors, kv=kv,
                file=gguf.stat().st_size)


def summarize(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


METRICS = [  # key, label, format
    ("load", "load (s)", "{:.2f}"),
    ("prefill_tps", "prefill (tok/s)", "{:.1f}"),
    ("ttft", "time to first token (s)", "{:.2f}"),
    ("decode_tps", "decode (tok/s)", "{:.2f}"),
    ("peak_rss", "peak RSS (GB)", "{:.2f}"),
]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def same_weights(a, engine: str) -> bool:
    """gem4 and llama.cpp read --gguf; transformers reads --hf, the same weights if make_e2b derived it from --gguf."""
    if engine != "transformers":
        return True
    cfg = json.loads((a.hf / "config.json").read_text())
    return cfg.get("gem4_bench_source") == a.gguf.name


def report(a, runs: dict[str, list[dict]], bw: dict, bpt: dict) -> str:
    engines = [e for e in a.engines if runs.get(e)]
    others = [e for e in engines if e != "gem4"] if "gem4" in engines else []
    rows = [["metric", *engines, *(f"gem4/{e}" for e in others)]]
    med = {}
    for key, label, fmt in METRICS:
        row = [label]
        for e in engines:
            m, lo, hi = summarize([r[key] for r in runs[e]])
            med[e, key] = m
            row.append(f"{fmt.format(m)} ({fmt.format(lo)}–{fmt.format(hi)})")
        rows.append(row + [f"{med['gem4', key] / med[e, key]:.2f}×" for e in others])
    ceiling = bw["read"] * 1e9 / (bpt["weights"] + bpt["kv"])
    ceiling_best = max(bw["samples"]) * 1e9 / (bpt["weights"] + bpt["kv"])
    ceiling_bf16 = bw["read"] * 1e9 / (bpt["bf16_weights"] + bpt["kv"])
    for label, c in (("median", ceiling), ("best", ceiling_best)):
        rows.append([f"decode % of ceiling ({c:.1f} tok/s at the {label} bandwidth)",
                     *(f"{100 * med[e, 'decode_tps'] / c:.0f}%" for e in engines), *([""] * len(others))])
    rows.append(["other processes' CPU load (cores, max)", *(f"{max(r['other_load'] for r in runs[e]):.2f}" for e in engines),
                 *([""] * len(others))])
    if others:
        rows.append([f"greedy tokens equal to gem4's (of {a.gen + 1}, per run)",
                     *((" / ".join(str(common_prefix(r["tokens"], g["tokens"])) for r, g in zip(runs[e], runs["gem4"]))
                        if same_weights(a, e) else "n/a (other weights)") for e in engines), *([""] * len(others))])
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    gb = 1e9
    notes = [
        "",
        (f"Bytes read per decoded token: {bpt['weights'] / gb:.3f} GB of weights in their stored type "
         f"(file {bpt['file'] / gb:.3f} GB; tied head {bpt['head'] / gb:.3f} GB counted once; "
         f"PLE: one {bpt['ple_row'] / 1e3:.1f} KB row; no K/V projections on KV-shared layers; "
         f"F32 vectors {bpt['vectors'] / 1e6:.2f} MB) + {bpt['kv'] / 1e6:.1f} MB of bf16 K/V at the mean decode "
         f"context {a.prompt + a.gen / 2:.0f}."),
        (f"Measured read bandwidth: {bw['read']:.1f} GB/s, the median of {len(bw['samples'])} samples "
         f"({', '.join(f'{x:.1f}' for x in bw['samples'])}: before each repeat and after the last), each the best of "
         f"torch sum / dot / amax over a 1 GiB random float32 buffer, {bw['threads']} threads, median of 7 "
         f"(last sample: {', '.join(f'{k} {v:.1f}' for k, v in bw['reads'].items())}; "
         f"copy {bw['copy']:.1f} GB/s read+write; numpy sum, 1 thread {bw['numpy_read_1thread']:.1f} GB/s)."),
        (f"Decode ceiling = bandwidth / bytes per token = **{ceiling:.2f} tok/s** at the median bandwidth, "
         f"{ceiling_best:.2f} tok/s at the best sample "
         f"(for the same matrices held in bf16, as gem4's reference path, dequantizing at load, holds them: "
         f"{bpt['bf16_weights'] / gb:.3f} GB/token -> {ceiling_bf16:.2f} tok/s)."),
    ]
    return "\n".join(lines + notes)


def parent_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True, help="GGUF file for gem4 and llama.cpp")
    ap.add_argument("--hf", type=Path, default=None, help="HF directory with the same weights (transformers)")
    ap.add_argument("--engines", default="gem4,llama.cpp,transformers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512, help="gem4 prefill chunk; llama.cpp n_batch/n_ubatch")
    ap.add_argument("--ctx", type=int, default=1024, help="llama.cpp n_ctx")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed")
    ap.add_argument("--gem4-src", type=Path, default=None, help="put this directory first on the gem4 child's PYTHONPATH")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per child")
    ap.add_argument("--max-other-load", type=float, default=0.25,
                    help="rerun a run during which other processes kept more than this many cores busy")
    ap.add_argument("--retries", type=int, default=2, help="reruns allowed per run for --max-other-load")
    ap.add_argument("--json", type=Path, default=None, help="write all raw runs here")
    a = ap.parse_args(argv)
    a.engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    if bad := set(a.engines) - set(ENGINES):
        ap.error(f"unknown engines {sorted(bad)}; choose from {ENGINES}")
    if a.prompt + a.gen + 1 > a.ctx:
        ap.error("--ctx must hold --prompt + --gen tokens")
    if "transformers" in a.engines:
        if a.hf is None:
            print("note: transformers skipped (no --hf directory)")
            a.engines.remove("transformers")
        else:
            need = sum(p.stat().st_size for p in a.hf.glob("*.safetensors")) / 1e9 * 1.15
            if mem_available() < need:
                print(f"note: transformers skipped: needs ~{need:.1f} GB, {mem_available():.1f} GB available")
                a.engines.remove("transformers")
    if a.gem4_src:
        sys.path.insert(0, str(a.gem4_src.resolve()))
        a.gem4_src = a.gem4_src.resolve()

    print(f"# {' '.join([Path(sys.argv[0]).name, *argv])}", flush=True)
    bpt = bytes_per_token(a.gguf, a.prompt + a.gen / 2)
    print(f"{bpt['weights'] / 1e9:.3f} GB of weights read per decoded token", flush=True)
    bw_runs = []
    models = {"gem4": a.gguf, "llama.cpp": a.gguf, "transformers": a.hf}
    runs: dict[str, list[dict]] = {e: [] for e in a.engines}
    versions = {}
    for rep in range(a.repeats):
        bw_runs.append(run_child("membw", "", a))
        print(f"read bandwidth {bw_runs[-1]['read']:.1f} GB/s", flush=True)
        for e in a.engines:
            for attempt in range(1 + a.retries):
                warm_page_cache(models[e])
                r = measured_run(e, models[e], a)
                if r["other_load"] <= a.max_other_load:
                    break
                print(f"[{rep + 1}/{a.repeats}] {e}: other processes used {r['other_load']:.2f} cores; "
                      + ("retrying" if attempt < a.retries else "keeping this run"), flush=True)
            r["prefill_tps"] = a.prompt / r["prefill"]
            r["decode_tps"] = a.gen / r["decode"]
            runs[e].append(r)
            versions[e] = r.pop("version")
            print(f"[{rep + 1}/{a.repeats}] {e:12s} load {r['load']:6.2f} s  prefill {r['prefill_tps']:7.1f} tok/s  "
                  f"ttft {r['ttft']:6.2f} s  decode {r['decode_tps']:6.2f} tok/s  rss {r['peak_rss']:5.2f} GB  "
                  f"other load {r['other_load']:.2f}", flush=True)
    bw_runs.append(run_child("membw", "", a))
    print(f"read bandwidth {bw_runs[-1]['read']:.1f} GB/s", flush=True)
    reads = [b["read"] for b in bw_runs]
    bw = dict(bw_runs[-1], read=statistics.median(reads), samples=reads)
    table = report(a, runs, bw, bpt)
    print("\n" + "\n".join(f"- {e}: {v}" for e, v in versions.items()))
    print("\n" + table, flush=True)
    out = a.json or HERE / "out" / f"run-{a.gguf.stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(argv=argv, runs=runs, bandwidth=bw, bytes_per_token=bpt, versions=versions,
                                   table=table), indent=1))
    print(f"\nraw runs: {out}")
    return 0


def profile_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="profile one gem4 decode step")
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--gem4-src", type=Path, default=None)
    a = ap.parse_args(argv)
    a.gen, a.ctx, a.seed, a.timeout = 0, 1024, 0, 3600
    r = run_child("profile", a.gguf, a, ["--rows", str(a.rows)])
    steps = ", ".join(f"{x:.0f}" for x in r["step_ms"])
    print(f"decode step wall times (ms, warm): {steps}; profiled step {r['profiled_step_ms']:.0f} ms, "
          f"of which {r['ops_self_ms']:.0f} ms self time in torch ops ({r['n_ops']} op calls); the rest, "
          f"{r['profiled_step_ms'] - r['ops_self_ms']:.0f} ms, is Python and dispatch between ops\n")
    print(r["torch_table"])
    print(r["cprofile"])
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        sys.exit(child_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "profile":
        sys.exit(profile_main(sys.argv[2:]))
    sys.exit(parent_main(sys.argv[1:]))
