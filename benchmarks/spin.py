"""Decode speed against the OpenMP wait policy, on free cores and with a busy process on one core (issue 12).

    python benchmarks/spin.py benchmarks/out/e2b-q4_0.gguf                   # E2B-shaped Q4_0, bf16 fast mode
    python benchmarks/spin.py --demo --tokens 256                            # the tiny demo checkpoint

libgomp reads GOMP_SPINCOUNT (how long an idle worker thread spins before it sleeps) and
OMP_WAIT_POLICY once, when it starts, so each setting runs in its own process. In it the model
loads into a `gem4.Engine`, and one greedy request (a 32-token prompt, then --tokens decode steps) is
timed three times: on the cores as they
are ("free"), with a CPU hog (`python3 -c "while True: pass"`) pinned to core 0 ("hog"), and free
again. The settings are interleaved over --repeats rounds; the table gives the median decode tok/s
and the min-max, and how many cores other processes kept busy during the "free" phases (from
/proc/stat: all busy time less this process's; the hog's core shows in the "hog" phase).
`--quiet-below C` waits (up to a minute) before each run until other processes use less than C cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {                       # name -> environment for the child (the rest inherited)
    "spin 0": {"GOMP_SPINCOUNT": "0"},
    "spin 1000": {"GOMP_SPINCOUNT": "1000"},
    "spin 10000": {"GOMP_SPINCOUNT": "10000"},
    "spin 100000": {"GOMP_SPINCOUNT": "100000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
    "spin 100000, 1 thread": {"GOMP_SPINCOUNT": "100000", "GEM4_BENCH_THREADS": "1"},
}
PHASES = ("free", "hog", "free again")


def busy_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def others_busy(seconds: float) -> float:
    """Cores other processes keep busy over the next `seconds`."""
    b0, c0, t0 = busy_seconds(), time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (busy_seconds() - b0 - (time.process_time() - c0)) / (time.perf_counter() - t0)


def child(path: str, tokens: int) -> dict:
    import torch

    import gem4

    if os.environ.get("GEM4_BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["GEM4_BENCH_THREADS"]))
    model = gem4.load(path)
    engine = gem4.Engine(model, gem4.Tokenizer.from_file(path))
    prompt = list(range(1000, 1032))

    def decode(n: int) -> tuple[float, float]:
        """(decode tok/s of one greedy request of n tokens after the 32-token prompt, cores other
        processes kept busy meanwhile)"""
        params = gem4.SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True)
        b0, c0 = busy_seconds(), time.process_time()
        times = [time.perf_counter() for event in engine.generate(prompt, params) if event.token_id is not None]
        wall = times[-1] - times[0]                  # first token to last: decode only
        return (len(times) - 1) / wall, (busy_seconds() - b0 - (time.process_time() - c0)) / wall

    decode(4)                                        # warm up
    out = {"threads": torch.get_num_threads(), "load": os.getloadavg()[0]}
    for phase in PHASES:
        hog = None
        if phase == "hog":
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                   preexec_fn=lambda: os.sched_setaffinity(0, {0}))
            time.sleep(0.5)
        try:
            out[phase], out[phase + " others"] = decode(tokens)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--demo", action="store_true", help="the demo checkpoint ($GEM4_CACHE, built if missing)")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per phase")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), metavar="NAME")
    ap.add_argument("--quiet-below", type=float, default=None, metavar="CORES",
                    help="before each run, wait (at most 60 s) until other processes use fewer cores")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.demo:
        from gem4.demo import ensure_demo

        a.model = str(ensure_demo())
    if a.child:
        print(json.dumps(child(a.model, a.tokens)))
        return 0
    runs: dict[str, list[dict]] = {s: [] for s in a.settings}
    for r in range(a.repeats):
        for name in a.settings:
            env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
            env.update(SETTINGS[name])
            deadline = time.time() + 60
            while a.quiet_below is not None and time.time() < deadline and others_busy(2.0) >= a.quiet_below:
                pass
            res = subprocess.run([sys.executable, __file__, a.model, "--tokens", str(a.tokens), "--child"],
                                 env=env, capture_output=True, text=True, check=True)
            got = json.loads(res.stdout.strip().splitlines()[-1])
            runs[name].append(got)
            print(f"round {r + 1} {name:24s} load {got['load']:5.1f}  " +
                  "  ".join(f"{p} {got[p]:7.2f} (others {got[p + ' others']:.2f})" for p in PHASES), flush=True)
    print(f"\n| setting | threads | {' | '.join(p + ' (tok/s)' for p in PHASES)} | others' cores when free |")
    print("|---|---|" + "---|" * len(PHASES) + "---|")
    for name, rs in runs.items():
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in
                 ([x[p] for x in rs] for p in PHASES)]
        others = [x[p + " others"] for x in rs for p in ("free", "free again")]
        print(f"| {name} | {rs[0]['threads']} | {' | '.join(cells)} | {min(others):.2f}-{max(others):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
