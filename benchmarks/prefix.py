"""Prefix-cache benchmark (issue 14): time to first token with gem4's prefix cache on and off, and llama.cpp's
`llama-server` (its `cache_prompt`, on by default) on the same file. Not part of CI.

    python benchmarks/prefix.py benchmarks/out/e2b-q4_0.gguf --llama-server /tmp/lcpp/build/bin/llama-server \\
        --repeats 3 --threads 2

Three servers run side by side for a repeat: `gem4 serve` (prefix caching on, the default), `gem4 serve
--no-enable-prefix-caching` (cold: every prompt computed whole) and llama-server (`-np 1`, its prompt cache).
Requests go one at a time, each step of a scenario to the three servers in turn (interleaved), each a
streaming POST /v1/completions of token ids rendered with the file's own chat template (gem4.chat), greedy,
--output tokens. TTFT = request sent -> first streamed text. Scenarios:

- conversation: a 10-turn chat growing to ~4k tokens: turn 1 a --doc-token document and a question, each
  later turn a ~100-token user message; the history keeps a fixed ~64-token assistant reply per turn (the
  same for every server, so the prompts are identical; a real client would send the model's reply).
- shared: 8 users, one after the other, each a --system-token system prompt and a ~100-token message.
- extend: a fresh --base-token prompt, then the same prompt and 30 more tokens.

Reported per step: prompt tokens, the tokens gem4 found cached, the three TTFTs (median over repeats) and
gem4's TTFT over the cold one and over llama-server's; and whether gem4's greedy text with the cache
equals its text without it, request by request. Raw runs go to --save as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from serve import free_port, vm_hwm_kb, wait_ready

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be or had "
         "not but have one all their they has been there also its new more first after two time other who "
         "into over city years only most would some can than such many under world state where during when "
         "made well while since then both between long these three through war film river school music "
         "team early part known game based series house people year including later work life family "
         "history group found main several season north south east west small large high great second "
         "played public local national king church being band album member best power water station").split()


def words(rng: random.Random, tok, n_tokens: int) -> str:
    """Seeded English-like text of about n_tokens tokens."""
    out: list[str] = []
    while len(tok.encode(" ".join(out), add_bos=False)) < n_tokens:
        out += [rng.choice(WORDS) for _ in range(max(1, (n_tokens - len(out)) // 2))]
        if rng.random() < 0.3:
            out[-1] += "."
    return " ".join(out)


def scenarios(tok, a: argparse.Namespace, seed: int) -> dict[str, list[list[int]]]:
    """Scenario -> its prompts (token ids, BOS first), in order."""
    from gem4.chat import encode_prompt

    rng = random.Random(seed)
    out: dict[str, list[list[int]]] = {"conversation": [], "shared": [], "extend": []}
    history: list[dict] = []
    for turn in range(a.turns):
        text = (words(rng, tok, a.doc) + "\n\nSummarise the text above." if turn == 0 else words(rng, tok, a.user))
        history.append({"role": "user", "content": text})
        out["conversation"].append(encode_prompt(tok, history, enable_thinking=False))
        history.append({"role": "assistant", "content": words(rng, tok, a.reply)})
    system = {"role": "system", "content": words(rng, tok, a.system)}
    for _ in range(a.users):
        out["shared"].append(encode_prompt(tok, [system, {"role": "user", "content": words(rng, tok, a.user)}],
                                           enable_thinking=False))
    base = encode_prompt(tok, [{"role": "user", "content": words(rng, tok, a.base)}], enable_thinking=False)
    out["extend"] = [base, base + tok.encode(words(rng, tok, 30), add_bos=False)[:30]]
    return out


def server_command(kind: str, a: argparse.Namespace, port: int) -> list[str]:
    if kind == "llama":
        return [a.llama_server, "-m", a.model, "--port", str(port), "-np", "1", "-c", str(a.ctx),
                "-t", str(a.threads), "-tb", str(a.threads), "--no-webui", "--log-disable"]
    cmd = [sys.executable, "-m", "gem4.cli", "serve", a.model, "--port", str(port), "--max-num-seqs", "1",
           "--max-model-len", str(a.ctx), "--threads", str(a.threads), "--log-level", "warning"]
    return cmd + (["--no-enable-prefix-caching"] if kind == "gem4-cold" else [])


def request(url: str, kind: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if kind == "llama":
        body["cache_prompt"] = True
    text, first, usage = [], None, None
    start = time.perf_counter()
    with httpx.Client(timeout=1800) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{kind}: {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    first = first if first is not None else time.perf_counter()
                    text.append(ch["text"])
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft_s": first - start, "text": "".join(text), "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens")}


def run_repeat(a: argparse.Namespace, prompts: dict[str, list[list[int]]], repeat: int) -> list[dict]:
    kinds = ["gem4", "gem4-cold"] + (["llama"] if a.llama_server else [])
    procs, urls = {}, {}
    try:
        for kind in kinds:
            port = free_port()
            urls[kind] = f"http://127.0.0.1:{port}"
            procs[kind] = subprocess.Popen(server_command(kind, a, port), stdout=subprocess.DEVNULL,
                                           stderr=open(a.log, "ab"), start_new_session=True)
        for kind in kinds:
            wait_ready(procs[kind], urls[kind], a.ready_timeout)
            request(urls[kind], kind, [2, 106, 3], 2)                         # warm-up, nothing in common
        rows = []
        for scenario, items in prompts.items():
            for step, prompt in enumerate(items):
                for kind in kinds:
                    res = request(urls[kind], kind, prompt, a.output)
                    rows.append({"repeat": repeat, "scenario": scenario, "step": step, "kind": kind, **res})
                    print(f"repeat {repeat} {scenario} {step} {kind}: prompt {res['prompt_tokens']} "
                          f"(cached {res['cached_tokens']}), TTFT {res['ttft_s']:.3f} s", flush=True)
        for kind in kinds:
            rows.append({"repeat": repeat, "kind": kind, "rss_gb": vm_hwm_kb(procs[kind].pid) * 1024 / 1e9})
        return rows
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGINT)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def report(rows: list[dict], prompts: dict[str, list[list[int]]], has_llama: bool) -> None:
    def med(scenario, step, kind, key="ttft_s"):
        return statistics.median(r[key] for r in rows if r.get("scenario") == scenario and r["step"] == step
                                 and r["kind"] == kind)

    head = "| scenario | step | prompt | gem4 cached | gem4 TTFT s | cold TTFT s |" + (" llama TTFT s |" if has_llama else "")
    head += " gem4 / cold |" + (" gem4 / llama |" if has_llama else "") + " same text as cold |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for scenario, items in prompts.items():
        for step in range(len(items)):
            g, c = med(scenario, step, "gem4"), med(scenario, step, "gem4-cold")
            cached = med(scenario, step, "gem4", "cached_tokens")
            same = all(r1["text"] == r2["text"] for r1 in rows for r2 in rows
                       if r1.get("scenario") == scenario and r1["step"] == step and r1["kind"] == "gem4"
                       and r2.get("scenario") == scenario and r2["step"] == step and r2["kind"] == "gem4-cold"
                       and r1["repeat"] == r2["repeat"])
            line = f"| {scenario} | {step + 1} | {len(items[step])} | {cached:.0f} | {g:.3f} | {c:.3f} |"
            if has_llama:
                line += f" {med(scenario, step, 'llama'):.3f} |"
            line += f" {g / c:.3f} |" + (f" {g / med(scenario, step, 'llama'):.2f} |" if has_llama else "")
            print(line + f" {'yes' if same else 'NO'} |")
    for kind in ("gem4", "gem4-cold", "llama"):
        rss = [r["rss_gb"] for r in rows if r["kind"] == kind and "rss_gb" in r]
        if rss:
            print(f"{kind}: peak RSS {statistics.median(rss):.2f} GB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (leave out to compare gem4 only)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--doc", type=int, default=2400, help="tokens of the first turn's document")
    ap.add_argument("--user", type=int, default=100)
    ap.add_argument("--reply", type=int, default=64)
    ap.add_argument("--system", type=int, default=2000)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--base", type=int, default=1500)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--log", default="benchmarks/out/prefix-servers.log")
    ap.add_argument("--save", default="benchmarks/out/prefix-runs.json")
    a = ap.parse_args()
    if a.llama_server and not os.access(a.llama_server, os.X_OK):
        ap.error(f"--llama-server {a.llama_server} is not an executable")
    import gem4

    tok = gem4.Tokenizer.from_file(a.model)
    prompts = scenarios(tok, a, seed=0)
    Path(a.log).parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for r in range(a.repeats):
        rows += run_repeat(a, prompts, r)
        Path(a.save).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    print(f"\nmedians of {a.repeats} repeats; output {a.output} tokens, threads {a.threads}\n")
    report(rows, prompts, bool(a.llama_server))


if __name__ == "__main__":
    main()
