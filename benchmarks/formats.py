"""gem4 on the same weights in several checkpoint formats (issue 31: MLX affine vs GGUF Q4_0 / Q4_K_M), interleaved.

    python benchmarks/formats.py benchmarks/out/e2b-q4_0.gguf benchmarks/out/e2b-mlx-4bit --repeats 3

Each run is run.py's gem4 child (a fresh process, one model load, fast mode): load time, prefill tok/s of a
--prompt token prompt in --chunk chunks, decode tok/s of --gen greedy steps, peak RSS (VmHWM, mmapped file pages
it touched included), and the cores other processes kept busy meanwhile (a run above --max-other-load is
retried). Models take turns (A B C A B C ...), each after its file's pages were read once (warm page cache);
the table gives median (min-max) and each median's ratio to the first model's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  run.py's children and measurement helpers

METRICS = (("load", "load s", "{:.2f}"), ("prefill_tps", "prefill tok/s", "{:.1f}"),
           ("decode_tps", "decode tok/s", "{:.2f}"), ("peak_rss", "peak RSS GB", "{:.2f}"))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", type=Path, nargs="+")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--max-other-load", type=float, default=0.25)
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--gem4-src", type=Path, default=None)
    a = ap.parse_args(argv)
    a.ctx = a.prompt + a.gen + 1
    if a.gem4_src:
        a.gem4_src = a.gem4_src.resolve()
    print(f"# {' '.join(['formats.py', *argv])}", flush=True)
    runs: dict[Path, list[dict]] = {m: [] for m in a.models}
    for rep in range(a.repeats):
        for m in a.models:
            for attempt in range(1 + a.retries):
                run.warm_page_cache(m)
                r = run.measured_run("gem4", m, a)
                if r["other_load"] <= a.max_other_load:
                    break
                print(f"[{rep + 1}] {m.name}: other processes used {r['other_load']:.2f} cores; "
                      + ("retrying" if attempt < a.retries else "keeping this run"), flush=True)
            r["prefill_tps"], r["decode_tps"] = a.prompt / r["prefill"], a.gen / r["decode"]
            runs[m].append(r)
            print(f"[{rep + 1}/{a.repeats}] {m.name:24s} load {r['load']:6.2f} s  prefill {r['prefill_tps']:7.1f} tok/s  "
                  f"decode {r['decode_tps']:6.2f} tok/s  rss {r['peak_rss']:5.2f} GB  other load {r['other_load']:.2f}",
                  flush=True)
    first = a.models[0]
    lines = ["| model | " + " | ".join(h for _, h, _ in METRICS) + " |", "|---" * (1 + len(METRICS)) + "|"]
    for m in a.models:
        cells = []
        for key, _, fmt in METRICS:
            values = [r[key] for r in runs[m]]
            med = statistics.median(values)
            cell = f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"
            if m != first:
                cell += f", {med / statistics.median(r[key] for r in runs[first]):.2f}x"
            cells.append(cell)
        lines.append(f"| {m.name} | " + " | ".join(cells) + " |")
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
