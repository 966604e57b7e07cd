"""26B-A4B inside a memory cap (issue 17): gem4's streamed experts against llama.cpp's mmap, each run in a
cgroup v1 memory limit that counts the page cache.

    python benchmarks/make_a4b.py --out benchmarks/out                     # the 14.3 GB Q4_0 file
    sudo python benchmarks/capped.py --gguf benchmarks/out/a4b-q4_0.gguf --caps 8 6 --repeats 3 \\
        --llama-bench /path/to/llama.cpp/build/bin/llama-bench

Runs, interleaved per repeat (A B C ... A B C ...), each a fresh process:

- `gem4 <cap>`:     gem4.load(memory_limit=<cap>) -- the whole process's budget -- inside the cgroup
- `llama <cap>`:    llama-bench (mmap, its default) inside the cgroup
- `gem4 free` / `llama free` (with --uncapped): no cgroup, gem4 with every expert resident
- `base ...` (engine `base`): gem4 imported from another source tree (`--gem4-base`), for A/B runs

Before each run the page cache is dropped (`/proc/sys/vm/drop_caches`): pages already cached outside the
cgroup would not be charged to it, and the cap would hold nothing. So every run starts from a cold file; the
load time is reported apart. Measured per run: prefill tok/s (--prompt tokens in one chunk), decode tok/s
(--gen steps after that, each fed a seeded random token as llama-bench's tg does, so routing is as varied
as it gets; gem4 also the second half alone, after its slots warmed), the cgroup's peak
memory (`memory.max_usage_in_bytes`: RSS + page cache), the OOM-kill count, gem4's expert hit rate and bytes
read. llama-bench runs `-p PROMPT -n GEN -r 1` (its own warm-up run first): prefill and decode are its pp and
tg tests, decode from an empty context; under a cap with `--repack 0` (its default repack copies all 14 GB of
weights into anonymous memory, and the cgroup kills it), so its weights stay mapped from the file.

`--zipf S` (gem4 only) biases the router towards a fixed order of experts per layer (-S log(rank), in units of
each token's router-logit spread, added to the logits), the locality real routers have; the random file
itself routes without such an order. The decode hit rate and the top-slots share (of a decode step's
experts, the share that the `slots` most used experts of the layer took) say how local a run was.
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
CGROUP = Path("/sys/fs/cgroup/memory/gem4-capped")
RESULT = "RESULT "
GB = 1e9


# ---- child: gem4 in one process ----

def zipf_router(model, s: float, seed: int = 0) -> None:
    """Bias every MoE layer's router towards a fixed order of its experts: -s * log(rank) (ranks permuted per
    layer by a seeded generator) in units of the token's own router-logit spread (their standard deviation),
    added to the logits -- top-k then still varies from token to token, with popular experts ahead."""
    import torch
    for layer in model.layers:
        router = getattr(layer, "router", None)
        if router is None:
            continue
        E = router.proj.weight.shape[0]
        g = torch.Generator().manual_seed(seed * 1000 + layer.spec.index)
        rank = torch.randperm(E, generator=g).float() + 1
        bias = -s * torch.log(rank)                                   # [E]
        proj = router.proj
        forward = proj.forward
        def biased(x, forward=forward, bias=bias):
            logits = forward(x)                                       # [T, E]
            return logits + bias.to(logits.dtype) * logits.std(-1, keepdim=True)
        proj.forward = biased


def child_gem4(a) -> dict:
    import gem4                            # first: it sets torch's runtime environment before torch loads
    import torch
    torch.set_num_threads(a.threads)
    t = time.perf_counter()
    options = {} if a.memory_limit is None else dict(memory_limit=a.memory_limit)
    model = gem4.load(a.model, **options)
    load = time.perf_counter() - t
    if a.zipf:
        zipf_router(model, a.zipf)
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([2] + torch.randint(3, 262144, (a.prompt - 1,), generator=g).tolist())
    feed = torch.randint(3, 262144, (a.gen,), generator=g)    # decode inputs: random tokens, as llama-bench's tg
    cache = model.new_cache()
    ec = getattr(model, "expert_cache", None)                 # None: resident (or a gem4 before streaming)
    stats = ec.stats if ec is not None else None
    t0 = time.perf_counter()
    model.extend(ids, cache)[-1].argmax()
    prefill = time.perf_counter() - t0
    after_prefill = None if stats is None else (stats.hits, stats.misses, stats.bytes_read)
    stores = [layer.experts.store for layer in model.layers if stats is not None and hasattr(layer, "experts")]
    uses_before = [list(store.uses) for store in stores]
    times = []
    for tok in feed.split(1):
        t1 = time.perf_counter()
        model.extend(tok, cache)[-1].argmax()
        times.append(time.perf_counter() - t1)
    r = dict(load=load, prefill_tps=a.prompt / prefill, decode_tps=a.gen / sum(times),
             decode_tps_late=(a.gen - a.gen // 2) / sum(times[a.gen // 2:]))
    if stats is not None:                             # the decode steps' share of the counters
        hits, misses, nbytes = (now - then for now, then in zip((stats.hits, stats.misses, stats.bytes_read),
                                                                 after_prefill))
        top = total = 0                               # locality: the slots most used experts' share of uses
        for store, before in zip(stores, uses_before):
            used = sorted((u - b for u, b in zip(store.uses, before)), reverse=True)
            top, total = top + sum(used[:ec.slots]), total + sum(used)
        r.update(slots=ec.slots, prefill_gb_read=after_prefill[2] / GB, hits=hits, misses=misses,
                 hit_rate=hits / max(1, hits + misses), gb_per_token=nbytes / GB / a.gen,
                 top_slots_share=top / max(1, total))
    with open("/proc/self/status") as f:
        r["vm_hwm"] = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:")) / GB
    return r


def child_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--memory-limit", type=float, default=None)
    ap.add_argument("--zipf", type=float, default=0.0)
    for name, default in (("prompt", 128), ("gen", 64), ("threads", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    print(RESULT + json.dumps(child_gem4(ap.parse_args(argv))), flush=True)
    return 0


# ---- parent ----

def cgroup_set(limit: float | None) -> None:
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(int(limit * GB)) if limit else "-1")
    (CGROUP / "memory.max_usage_in_bytes").write_text("0")
    (CGROUP / "memory.failcnt").write_text("0")


def cgroup_read() -> dict:
    stat = dict(line.split() for line in (CGROUP / "memory.oom_control").read_text().splitlines())
    return dict(peak=int((CGROUP / "memory.max_usage_in_bytes").read_text()) / GB,
                failcnt=int((CGROUP / "memory.failcnt").read_text()), oom_kills=int(stat.get("oom_kill", 0)))


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def run(cmd: list[str], cap: float | None, timeout: int, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    drop_caches()
    oom0 = 0
    if cap is not None:
        cgroup_set(cap)
        oom0 = cgroup_read()["oom_kills"]
        procs = str(CGROUP / "cgroup.procs")
        pre = lambda: Path(procs).write_text(str(os.getpid()))        # noqa: E731  the child joins the cgroup
    else:
        pre = None
    t = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout,
                       preexec_fn=pre, check=False, env=env)
    info = dict(wall=time.perf_counter() - t)
    if cap is not None:
        c = cgroup_read()
        info.update(cgroup_peak=c["peak"], oom_kills=c["oom_kills"] - oom0)
    return p, info


def gem4_run(a, cap: float | None, src: Path | None = None) -> dict:
    """gem4 in a child; `src`: import gem4 from that source tree instead (a baseline checkout)."""
    env = None if src is None else dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, str(Path(__file__).resolve()), "_child", "--model", str(a.gguf), "--prompt",
           str(a.prompt), "--gen", str(a.gen), "--threads", str(a.threads), "--zipf", str(a.zipf)]
    if cap is not None:
        cmd += ["--memory-limit", str(cap)]
    p, info = run(cmd, cap, a.timeout, env)
    lines = [l for l in p.stdout.splitlines() if l.startswith(RESULT)]
    if p.returncode or not lines:
        return dict(info, error=f"exit {p.returncode}: {p.stderr[-600:]}")
    return dict(info, **json.loads(lines[-1][len(RESULT):]))


def llama_run(a, cap: float | None) -> dict:
    cmd = [str(a.llama_bench), "-m", str(a.gguf), "-p", str(a.prompt), "-n", str(a.gen), "-t", str(a.threads),
           "-r", "1", "-o", "json"]
    if cap is not None:             # its repack copies every weight into anonymous memory: killed under a cap
        cmd += ["--repack", "0"]
    p, info = run(cmd, cap, a.timeout)
    if p.returncode:
        return dict(info, error=f"exit {p.returncode}: {p.stderr[-600:]}")
    tests = json.loads(p.stdout)
    r = dict(info)
    for t in tests:
        r["prefill_tps" if t["n_prompt"] else "decode_tps"] = t["avg_ts"]
    return r


def fmt(runs: list[dict], key: str, spec: str = "{:.2f}") -> str:
    values = [r[key] for r in runs if key in r]
    if not values:
        return "-"
    m = statistics.median(values)
    return spec.format(m) + (f" ({spec.format(min(values))}-{spec.format(max(values))})" if len(values) > 1 else "")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--caps", type=float, nargs="*", default=[8.0, 6.0], help="cgroup limits, GB (1e9 bytes); none: --uncapped only")
    ap.add_argument("--uncapped", action="store_true", help="also run both engines without a cgroup")
    ap.add_argument("--engines", default="gem4,llama", help="of gem4, llama, base (gem4 from --gem4-base)")
    ap.add_argument("--gem4-base", type=Path, default=None, help="a gem4 source tree (its src/) for the base engine")
    ap.add_argument("--llama-bench", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--zipf", type=float, default=0.0)
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    engines = a.engines.split(",")
    if "llama" in engines and a.llama_bench is None:
        ap.error("--llama-bench is needed for the llama engine")
    if "base" in engines and a.gem4_base is None:
        ap.error("--gem4-base is needed for the base engine")
    caps: list[float | None] = list(a.caps) + ([None] if a.uncapped else [])
    configs = [(e, c) for c in caps for e in engines]
    runs: dict[str, list[dict]] = {}
    print(f"# {' '.join(['capped.py', *argv])}", flush=True)
    for rep in range(a.repeats):
        for engine, cap in configs:
            name = f"{engine} {'free' if cap is None else f'{cap:g} GB'}"
            r = (gem4_run(a, cap) if engine == "gem4" else gem4_run(a, cap, a.gem4_base) if engine == "base"
                 else llama_run(a, cap))
            runs.setdefault(name, []).append(r)
            print(f"[{rep + 1}/{a.repeats}] {name}: " + json.dumps(r), flush=True)
    rows = ["| run | prefill tok/s | decode tok/s | decode, 2nd half | cgroup peak GB | OOM kills | load s | "
            "slots | top-slots share | decode hit rate | decode GB read/token |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        rows.append(f"| {name} | {fmt(ok, 'prefill_tps', '{:.1f}')} | {fmt(ok, 'decode_tps')} | "
                    f"{fmt(ok, 'decode_tps_late')} | {fmt(ok, 'cgroup_peak')} | "
                    f"{sum(r.get('oom_kills', 0) for r in rs)} | {fmt(ok, 'load', '{:.0f}')} | "
                    f"{fmt(ok, 'slots', '{:.0f}')} | {fmt(ok, 'top_slots_share')} | {fmt(ok, 'hit_rate', '{:.2f}')} | "
                    f"{fmt(ok, 'gb_per_token')} |"
                    + (f" {len(rs) - len(ok)} failed" if len(ok) < len(rs) else ""))
    print("\n" + "\n".join(rows))
    out = a.json or HERE / "out" / f"capped-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(dict(argv=argv, runs=runs), indent=1))
    print(f"raw runs: {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        sys.exit(child_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
