"""K-quant GGUFs (issue 15): gem4 vs llama.cpp's llama-server on the same files, interleaved.

    python benchmarks/kquants.py /tmp/e2b/e2b-q4_k_m.gguf /tmp/e2b/e2b-q6_k.gguf \\
        --llama-server /tmp/lcpp/build/bin/llama-server --repeats 3 --prompt 512 --gen 128 --threads 2

Per file and repeat: the read bandwidth (run.py's membw child), then gem4 (run.py's gem4 child: load,
one prefill chunk of --prompt BOS + seeded random ids, --gen greedy decode steps, VmHWM) and llama.cpp.
llama.cpp runs as `llama-server` (built from the llama-cpp-python sdist, see README "Serve"; the
llama-cpp-python wheel need not be installed): load = process start to GET /health answering 200 (its
default warmup run included, as a user starts it), then one /completion of the same token ids with
n_predict = --gen + 1, greedy (top_k 1), ignore_eos, cache_prompt false; prefill and decode tok/s are the
server's own `timings` (prompt_per_second, predicted_per_second), peak RSS its VmHWM (mmapped file pages
it touched included, as for gem4). Medians (min-max) over the repeats, and the decode bandwidth ceiling
from the bytes a token reads (run.bytes_per_token) at the median bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run  # noqa: E402  (benchmarks/run.py: children, bandwidth, bytes per token)
from serve import free_port, vm_hwm_kb, wait_ready  # noqa: E402


def llama_server_run(model: Path, a) -> dict:
    port = free_port()
    ctx = a.prompt + a.gen + 16
    cmd = [a.llama_server, "-m", str(model), "--port", str(port), "-np", "1", "-c", str(ctx), "-b", str(a.chunk),
           "-ub", str(a.chunk), "-t", str(a.threads), "-tb", str(a.threads), "--no-webui", "--cache-ram", "0",
           "--log-disable"]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        load = wait_ready(proc, url, a.timeout)
        ids = run.prompt_ids(a.prompt, a.seed)
        body = {"prompt": ids, "n_predict": a.gen + 1, "temperature": 0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True}
        r = httpx.post(url + "/completion", json=body, timeout=a.timeout).json()
        timings = r["timings"]
        rss = vm_hwm_kb(proc.pid) * 1024 / 1e9
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return dict(load=load, prefill_tps=timings["prompt_per_second"], decode_tps=timings["predicted_per_second"],
                peak_rss=rss, tokens=r.get("tokens", []), timings=timings)


def gem4_run(model: Path, a) -> dict:
    r = run.measured_run("gem4", model, a)
    r["prefill_tps"] = a.prompt / r["prefill"]
    r["decode_tps"] = a.gen / r["decode"]
    return r


def med(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path, nargs="+")
    ap.add_argument("--llama-server", default="/tmp/lcpp/build/bin/llama-server")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--json", type=Path, default=HERE / "out" / "kquants-runs.json")
    a = ap.parse_args()
    a.ctx, a.gem4_src = a.prompt + a.gen + 16, None
    print(f"# {' '.join(sys.argv)}", flush=True)
    results = {}
    for path in a.gguf:
        bpt = run.bytes_per_token(path, a.prompt + a.gen / 2)
        runs = {"gem4": [], "llama.cpp": []}
        bw = []
        for rep in range(a.repeats):
            bw.append(run.run_child("membw", "", a)["read"])
            for engine, fn in (("gem4", gem4_run), ("llama.cpp", llama_server_run)):
                run.warm_page_cache(path)
                r = fn(path, a)
                runs[engine].append(r)
                print(f"{path.name} [{rep + 1}/{a.repeats}] {engine:9s} load {r['load']:6.2f} s  prefill "
                      f"{r['prefill_tps']:7.1f} tok/s  decode {r['decode_tps']:6.2f} tok/s  rss {r['peak_rss']:5.2f} GB",
                      flush=True)
        bw.append(run.run_child("membw", "", a)["read"])
        bandwidth = statistics.median(bw)
        ceiling = bandwidth * 1e9 / (bpt["weights"] + bpt["kv"])
        g, l = runs["gem4"], runs["llama.cpp"]
        ratio = lambda k: statistics.median([r[k] for r in g]) / statistics.median([r[k] for r in l])   # noqa: E731
        same = [run.common_prefix(x["tokens"], y["tokens"]) for x, y in zip(g, l)]
        file_gb = path.stat().st_size / 1e9
        rows = [("load (s)", "load"), ("prefill (tok/s)", "prefill_tps"), ("decode (tok/s)", "decode_tps"),
                ("peak RSS (GB)", "peak_rss")]
        table = ["| metric | gem4 | llama.cpp | gem4/llama.cpp |", "|---|---|---|---|"]
        table += [f"| {label} | {med(g, k)} | {med(l, k)} | {ratio(k):.2f}x |" for label, k in rows]
        table.append(f"| peak RSS / file size ({file_gb:.2f} GB) | {statistics.median([r['peak_rss'] for r in g]) / file_gb:.2f}x"
                     f" | {statistics.median([r['peak_rss'] for r in l]) / file_gb:.2f}x | |")
        table.append(f"| decode % of ceiling ({ceiling:.1f} tok/s) | "
                     f"{statistics.median([r['decode_tps'] for r in g]) / ceiling:.0%} | "
                     f"{statistics.median([r['decode_tps'] for r in l]) / ceiling:.0%} | |")
        table.append(f"| greedy tokens equal from the start (of {a.gen + 1}) | {' / '.join(map(str, same))} | | |")
        note = (f"Bytes per decoded token {(bpt['weights'] + bpt['kv']) / 1e9:.3f} GB (weights in their stored type, "
                f"tied head once, one PLE row, K/V at the mean context); read bandwidth {bandwidth:.1f} GB/s "
                f"(median of {len(bw)}: {', '.join(f'{b:.1f}' for b in bw)}).")
        text = f"### {path.name}\n\n" + "\n".join(table) + "\n\n" + note
        print("\n" + text + "\n", flush=True)
        results[path.name] = dict(runs=runs, bandwidth=bw, bytes_per_token=bpt, table=text)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(dict(argv=sys.argv, results=results), indent=1, default=str))
    print(f"raw runs: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
