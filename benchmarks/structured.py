"""Constrained decoding (issue 28): what a grammar costs per output token, and its parts. Not part of CI.

    python benchmarks/structured.py micro                                   # the real 262,144-token vocabulary
    python benchmarks/structured.py serve benchmarks/out/e2b-q4_0.gguf --n 1 8 --repeats 3 [--spec both]
    python benchmarks/structured.py startup benchmarks/out/e2b-q4_0.gguf

`micro` (no model): the grammar vocabulary of the real Gemma 4 tokenizer (tests/assets/gemma4-vocab), its build
time, then for four request grammars built by gem4.structured.grammars exactly as the server builds them
(tool_choice "required" over two tools, a named tool, "auto" with a strict tool, a json_schema of 6 properties
with a nested object and an array; thinking off):
- compile: `GrammarVocab.matcher` of a grammar never seen before (each compile renames the tools / a property,
  so none is a cached copy), p50 / p99 of --compiles;
- per row, B = 1 and 8 rows, --steps steps replaying a sample answer (`SAMPLES`: English text, a tool call or
  a JSON document, tokenized by gem4; row b starts b / B of the way in, and starts again at the end): the mask
  fill (`Matchers.masks`, the engine's batched llguidance call), the apply (`sampling.apply_grammar_mask` on
  [B, 262144] float32 logits) and the consume (`Matchers.consume`). Reported per row: mean, p50, p99 (us).

`startup`: the E2B file loaded once; then, interleaved, `Engine(model, tokenizer)` with the grammar vocabulary
building in the background (structured=True, the default) and with structured=False, each followed at once by
a plain request (--prompt tokens, 4 output): its time to first token counted from the Engine() call.

`serve`: `gem4 serve FILE --max-num-seqs N --max-model-len C --threads T` (one server per N; `--spec ngram` runs it with
ngram speculation, K = 4, `--spec both` a server each), warmed with one constrained and one plain request. Each round
runs N concurrent streaming chat requests (distinct user messages of --prompt random words; thinking off;
temperature 0; max_tokens --output) of every mode, interleaved with their unconstrained twins: the twin with
tools (once), required, named, auto_strict, then the twin without tools (once), json_schema. A mode and its
twin are the same request without the constraint:

    required     tool_choice "required", two tools           twin: tool_choice "auto" (same tools, same prompt)
    named        tool_choice {function: get_weather}          twin: tool_choice "auto"
    json_schema  response_format json_schema (6 properties)   twin: no response_format
    auto_strict  tool_choice "auto", strict tools             twin: the same tools without strict

The twins run with `ignore_eos` (an unconstrained random model stops at any end id); a constrained request ends
where its grammar ends (the engine ignores ignore_eos there), so it may emit fewer tokens. Time per output token
(TPOT) of a batch: the server's own inter-token latency (/metrics `gem4:inter_token_latency_seconds`, observed as
each token leaves the engine, so a tool call's parser holding text back does not move it): its sum and count
read before and after the batch, the difference of the sums over the difference of the counts. Reported: the
median over rounds of each mode's TPOT, and the median over rounds of the ratio TPOT(mode) / TPOT(twin) of the
same round. The machine is shared, so the ratio of two wall times carries its load; the engine's own
account of the grammar's work is read too: /metrics' grammar mask and apply seconds over the batch, per engine
step (one token per request), and 1 + that / TPOT(twin) is the slowdown that work alone explains. The grammar
counters' means over the whole run (compile, mask, apply) are printed at the end.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOCAB = REPO / "tests" / "assets" / "gemma4-vocab" / "ggml-vocab-gemma-4.gguf"
sys.path.insert(0, str(REPO / "benchmarks"))


def tools(suffix: str = "", strict: bool = False) -> list[dict]:
    weather = {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}
    search = {"type": "object", "properties": {
        "query": {"type": "string"}, "max_results": {"type": "integer"},
        "filters": {"type": "object", "properties": {"site": {"type": "string"}, "recent": {"type": "boolean"}}}},
        "required": ["query"]}
    out = []
    for name, params in (("get_weather", weather), ("search_web", search)):
        fn = {"name": name + suffix, "description": f"{name} tool", "parameters": params}
        if strict:
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out


def person_schema(suffix: str = "") -> dict:
    """6 properties, a nested object and an array (the issue's json_schema)."""
    return {"type": "object", "properties": {
        "name" + suffix: {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
        "email": {"type": "string"}, "active": {"type": "boolean"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
        "required": ["name" + suffix, "age", "address"], "additionalProperties": False}


MODES = {   # mode -> (constrained request fields, twin request fields)
    "required": ({"tools": tools(), "tool_choice": "required"}, {"tools": tools(), "tool_choice": "auto"}),
    "named": ({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
              {"tools": tools(), "tool_choice": "auto"}),
    "json_schema": ({"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "person", "schema": person_schema()}}}, {}),
    "auto_strict": ({"tools": tools(strict=True), "tool_choice": "auto"}, {"tools": tools(), "tool_choice": "auto"}),
}


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


# ---------------------------------------------------------------------------------------------
# micro
# ---------------------------------------------------------------------------------------------


SAMPLES = {   # what a model answers under each grammar, in Gemma 4's syntax (thinking off), ending with its end token
    "required": '<|tool_call>call:get_weather{city:<|"|>Paris, France<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>'
                '<|tool_call>call:search_web{filters:{recent:true,site:<|"|>news.example.com<|"|>},max_results:5,'
                'query:<|"|>weather in Paris this weekend<|"|>}<tool_call|><|tool_response>',
    "named": '<|tool_call>call:get_weather{city:<|"|>San Francisco, California<|"|>,unit:<|"|>fahrenheit<|"|>}'
             '<tool_call|><|tool_response>',
    "auto_strict": 'Sure, let me look that up for you before we plan the trip.<|tool_call>call:search_web{'
                   'max_results:3,query:<|"|>best hiking trails near Lisbon<|"|>}<tool_call|><|tool_response>',
    "json_schema": '{"name":"Ada Lovelace","age":36,"email":"ada@example.com","active":true,"address":'
                   '{"city":"London","zip":"W1J 7NT"},"tags":["mathematics","poetry","engines"]}<turn|>',
}


def micro(a) -> None:
    import gem4  # noqa: F401  first: sets the OpenMP environment before torch loads
    import torch

    from gem4.engine.grammar import Matchers
    from gem4.engine.sequence import Sequence
    from gem4.sampling import SamplingParams, apply_grammar_mask
    from gem4.structured import GrammarStats, GrammarVocab
    from gem4.structured.grammars import Lead, chat_grammar
    from gem4.tokenizer import Tokenizer

    torch.set_num_threads(a.threads)
    tok = Tokenizer.from_file(VOCAB)
    start = time.perf_counter()
    vocab = GrammarVocab(tok)
    vocab.lltokenizer()
    print(f"grammar vocabulary: {tok.vocab_size} tokens, built in {time.perf_counter() - start:.2f} s "
          f"(Python side + llguidance), threads {a.threads}\n")

    def grammar(mode: str, suffix: str = ""):
        request = {"required": dict(tools=tools(suffix), tool_choice="required"),
                   "named": dict(tools=tools(suffix), tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather" + suffix}}),
                   "auto_strict": dict(tools=tools(suffix, strict=True), tool_choice="auto"),
                   "json_schema": dict(response_format={"type": "json_schema", "json_schema": {
                       "name": "p", "schema": person_schema(suffix)}})}[mode]
        fields = dict(tools=None, tool_choice=None, parallel_tool_calls=True, response_format=None,
                      structured_outputs=None)
        fields.update(request)
        return chat_grammar(lead=Lead.ANSWER, **fields)[0]

    def us(values):
        return f"{1e6 * statistics.mean(values):.0f} / {1e6 * pct(values, 50):.0f} / {1e6 * pct(values, 99):.0f}"

    print("| grammar | compile ms p50 / p99 | tokens | B | fill us/row mean / p50 / p99 | apply us/row mean / p50 / p99 "
          "| consume us/row mean |")
    print("|---|---|---|---|---|---|---|")
    for mode, sample in SAMPLES.items():
        compiles = []
        for i in range(a.compiles):
            spec = grammar(mode, f"_{i}")
            t0 = time.perf_counter()
            vocab.matcher(spec)
            compiles.append(time.perf_counter() - t0)
        spec = grammar(mode)
        ids = tok.encode(sample, add_bos=False, parse_special=True)
        check = vocab.matcher(spec)
        if check.validate_tokens(ids) != len(ids):
            raise SystemExit(f"{mode}: the sample is not a sentence of its grammar after "
                             f"{tok.decode(ids[:check.validate_tokens(ids)])!r}")
        for batch in (1, 8):
            matchers = Matchers(vocab, GrammarStats(), tok.vocab_size, a.threads)
            params = SamplingParams(structured=spec)
            # row b replays the sample from token b * len / B on, and starts it again when it ends
            seqs = [Sequence(f"r{b}", [2], params, max_tokens=10**9, end_ids=()) for b in range(batch)]
            cursor = [b * len(ids) // batch for b in range(batch)]
            for s, c in zip(seqs, cursor):
                matchers.get(s).consume_tokens(ids[:c])
            fills, applies, consumes = [], [], []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                masks, errors, _ = matchers.masks([(s, None, []) for s in seqs])
                fills.append((time.perf_counter() - t0) / batch)
                assert not any(errors), errors
                logits = torch.randn(batch, tok.vocab_size)
                t0 = time.perf_counter()
                apply_grammar_mask(logits, torch.arange(batch), masks)
                applies.append((time.perf_counter() - t0) / batch)
                picks = [[ids[c]] for c in cursor]
                assert all(torch.isfinite(logits[b, t]) for b, (t,) in enumerate(picks))
                t0 = time.perf_counter()
                errors = matchers.consume(seqs, picks)
                consumes.append((time.perf_counter() - t0) / batch)
                assert not any(errors), errors
                for b in range(batch):
                    cursor[b] += 1
                    if cursor[b] == len(ids):                      # the sample ended: start it again
                        matchers.release(seqs[b].seq_id)
                        cursor[b] = 0
            print(f"| {mode} | {1e3 * pct(compiles, 50):.2f} / {1e3 * pct(compiles, 99):.2f} | {len(ids)} | {batch} "
                  f"| {us(fills)} | {us(applies)} | {1e6 * statistics.mean(consumes):.1f} |")


# ---------------------------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------------------------


MODEL = {"id": ""}                 # the served model's name, read from /v1/models


def chat_body(fields: dict, prompt: str, max_tokens: int, twin: bool) -> dict:
    body = {"model": MODEL["id"], "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False}, **fields}
    if twin:
        body["ignore_eos"] = True
    return body


def client(url: str, body: dict, barrier, out: dict) -> None:
    import httpx

    usage = None
    with httpx.Client(timeout=900) as c:
        barrier.wait()
        with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                out["error"] = f"{r.status_code}: {r.text[:300]}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices") or []:
                    if ch.get("finish_reason"):
                        out["finish"] = ch["finish_reason"]
    out.update(usage=usage)


def histograms(url: str) -> dict[str, tuple[float, float]]:
    """The server's histograms this benchmark reads: name -> (sum, count). Inter-token latency is observed per
    engine event, as tokens leave the engine, whatever the SSE deltas group (a tool call's parser may hold
    text back); the grammar ones are the engine's GrammarStats."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("inter_token_latency_seconds", "grammar_compile_seconds", "grammar_mask_seconds",
                 "grammar_apply_seconds"):
        total = re.search(rf"^gem4:{name}_sum\{{[^}}]*\}} (\S+)", text, re.M)
        count = re.search(rf"^gem4:{name}_count\{{[^}}]*\}} (\S+)", text, re.M)
        out[name] = (float(total.group(1)) if total else 0.0, float(count.group(1)) if count else 0.0)
    return out


def batch_tpot(url: str, bodies: list[dict]) -> dict:
    """N requests at once -> their mean time per output token (the server's inter-token latency over the
    batch), the grammar's mask + apply time per engine step of the batch, completion tokens, finish reasons."""
    before = histograms(url)
    outs = [{} for _ in bodies]
    barrier = threading.Barrier(len(bodies))
    threads = [threading.Thread(target=client, args=(url, b, barrier, o)) for b, o in zip(bodies, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise RuntimeError(errors[0])
    after = histograms(url)
    delta = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
    itl_sum, itl_count = delta["inter_token_latency_seconds"]
    steps = delta["grammar_mask_seconds"][1]
    grammar = (delta["grammar_mask_seconds"][0] + delta["grammar_apply_seconds"][0]) / steps if steps else 0.0
    return dict(tpot=itl_sum / itl_count, grammar=grammar, tokens=[o["usage"]["completion_tokens"] for o in outs],
                finish=[o.get("finish") for o in outs])


def serve(a) -> None:
    import httpx

    from serve import free_port, wait_ready

    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud paper green quick lamp north seven table".split()
    results = []
    for spec in {"off": [False], "ngram": [True], "both": [False, True]}[a.spec]:
        for n in a.n:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "gem4.cli", "serve", a.model, "--port", str(port), "--max-num-seqs", str(n),
                   "--max-model-len", str(a.ctx), "--threads", str(a.threads), "--log-level", "warning"]
            if spec:
                cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                             "prompt_lookup_max": 3, "prompt_lookup_min": 1})]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(a.log, "ab"), start_new_session=True)
            try:
                wait_ready(proc, url, a.ready_timeout)
                MODEL["id"] = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
                for fields, twin in ((MODES["json_schema"][0], False), ({}, True)):
                    httpx.post(url + "/v1/chat/completions", timeout=600,
                               json={**chat_body(fields, "warm up", 8, twin), "stream": False}).raise_for_status()
                rounds = {m: [] for m in MODES}
                twins = {json.dumps(plain, sort_keys=True): plain for _, plain in MODES.values()}
                for r in range(a.repeats):
                    prompts = [" ".join(rng.choice(words) for _ in range(a.prompt)) for _ in range(n)]
                    base = {}
                    for key, plain in twins.items():       # each distinct twin once, then the modes it serves
                        base[key] = batch_tpot(url, [chat_body(plain, p, a.output, True) for p in prompts])
                        print(f"spec={spec} N={n} round {r} twin {sorted(plain) or 'plain'}: "
                              f"{1e3 * base[key]['tpot']:.1f} ms ({base[key]['tokens']} tokens); "
                              f"load {os.getloadavg()[0]:.1f}", flush=True)
                        for mode, (constrained, twin) in MODES.items():
                            if json.dumps(twin, sort_keys=True) != key:
                                continue
                            got = batch_tpot(url, [chat_body(constrained, p, a.output, False) for p in prompts])
                            rounds[mode].append((got, base[key]))
                            print(f"spec={spec} N={n} round {r} {mode}: {1e3 * got['tpot']:.1f} ms (grammar "
                                  f"{1e3 * got['grammar']:.2f} ms/step, {got['tokens']} tokens, {got['finish']}); "
                                  f"load {os.getloadavg()[0]:.1f}", flush=True)
                counters = histograms(url)
            finally:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for mode, runs in rounds.items():
                results.append(dict(spec=spec, n=n, mode=mode,
                                    tpot=statistics.median(g["tpot"] for g, _ in runs),
                                    twin=statistics.median(b["tpot"] for _, b in runs),
                                    ratio=statistics.median(g["tpot"] / b["tpot"] for g, b in runs),
                                    accounted=statistics.median(1 + g["grammar"] / b["tpot"] for g, b in runs),
                                    grammar=statistics.median(g["grammar"] for g, _ in runs),
                                    tokens=statistics.median(statistics.median(g["tokens"]) for g, _ in runs)))
            results.append(dict(spec=spec, n=n, counters=counters))
    print("\n| spec | N | mode | TPOT ms (constrained) | TPOT ms (twin) | ratio | grammar ms/step | 1 + grammar / "
          "TPOT(twin) | tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "mode" in r:
            print(f"| {'ngram' if r['spec'] else 'off'} | {r['n']} | {r['mode']} | {1e3 * r['tpot']:.1f} | "
                  f"{1e3 * r['twin']:.1f} | {r['ratio']:.3f} | {1e3 * r['grammar']:.2f} | {r['accounted']:.4f} | "
                  f"{r['tokens']:.0f} |")
    for r in results:
        if "counters" in r:
            parts = [f"{k.replace('grammar_', '').replace('_seconds', '')} {1e3 * s / c:.3f} ms x {c:.0f}"
                     for k, (s, c) in r["counters"].items() if c and k.startswith("grammar")]
            print(f"server counters (spec={r['spec']}, N={r['n']}; mean per observation): {', '.join(parts)}")
    Path(a.save).write_text(json.dumps(results, indent=1))


def startup(a) -> None:
    """The first request right after `Engine(...)`: its time to first token with the grammar vocabulary building
    in the background (structured=True, the default) and without it, interleaved."""
    import gem4  # noqa: F401  first: sets the OpenMP environment before torch loads
    import torch

    from gem4 import Engine, SamplingParams
    from gem4.tokenizer import Tokenizer

    torch.set_num_threads(a.threads)
    model = gem4.load(a.model)
    prompt = [2] + random.Random(0).sample(range(1000, 200000), a.prompt - 1)
    ttft = {True: [], False: []}
    for r in range(a.repeats):
        for structured in (True, False):
            tok = Tokenizer.from_file(a.model)                 # a fresh tokenizer: a fresh vocabulary build
            start = time.perf_counter()
            engine = Engine(model, tok, max_model_len=a.prompt + 64, structured=structured)
            stream = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=4))
            first = stream.get()
            ttft[structured].append(time.perf_counter() - start)
            list(stream) if not first.finished else None
            if structured:
                engine.grammar_vocab.lltokenizer()             # let the build end before the next run
            engine.shutdown()
            del engine, stream, tok                            # freed here, not inside the next timed Engine()
            gc.collect()
            print(f"round {r} structured={structured}: first token after {ttft[structured][-1]:.3f} s", flush=True)
    for structured, values in ttft.items():
        print(f"structured={structured}: TTFT median {statistics.median(values):.3f} s (min {min(values):.3f}, "
              f"max {max(values):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("micro")
    m.add_argument("--steps", type=int, default=200)
    m.add_argument("--compiles", type=int, default=50)
    m.add_argument("--threads", type=int, default=2)
    s = sub.add_parser("serve")
    s.add_argument("model")
    s.add_argument("--n", type=int, nargs="+", default=[1, 8])
    s.add_argument("--prompt", type=int, default=32, help="words in each user message")
    s.add_argument("--output", type=int, default=128)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--ctx", type=int, default=1024)
    s.add_argument("--spec", choices=("off", "ngram", "both"), default="off",
                   help="ngram speculation (K = 4): off, on, or a server each")
    s.add_argument("--ready-timeout", type=float, default=600)
    s.add_argument("--log", default="benchmarks/out/structured-servers.log")
    s.add_argument("--save", default="benchmarks/out/structured-runs.json")
    u = sub.add_parser("startup")
    u.add_argument("model")
    u.add_argument("--prompt", type=int, default=64)
    u.add_argument("--repeats", type=int, default=3)
    u.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    {"micro": micro, "serve": serve, "startup": startup}[a.what](a)


if __name__ == "__main__":
    main()
