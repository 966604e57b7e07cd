"""Speculative decoding on the E2B-shaped target (issue 16). Not part of CI.

    python benchmarks/spec.py benchmarks/out/e2b-q4_0.gguf --assistant benchmarks/out/e2b-assistant-hf

The assistant directory is built first if missing (`--build-assistant` forces it): an HF `gemma4_assistant`
with random weights, written by transformers 5.23.0 at the shapes below, drafting for the E2B target
(backbone 1536, vocab 262144, window 512, the target's K/V geometry: sliding 1 x 256, full 1 x 512).
The released E2B assistant's config was not available (docs/gemma4.md §1.4), so its decoder shape here is
an assumption, written down in RESULTS.md: 4 layers (3 sliding + 1 full), width 256, 4 query heads,
MLP 2048, the centroid-masked head (2048 centroids, top 32) that the E2B/E4B assistants are said to use.

Three measurements, all single request, fast mode, --threads (2), each a median over --repeats rounds in
which the compared cases run interleaved (A, B, A, B, ...):

1. verify: one target forward of K + 1 rows (K = 1..7) against one of 1 row, at a context of --context
   tokens (one KVCache, the same positions rewritten each call, every row's logits as verification wants),
   and the head's share of it; per round the fastest of --calls calls (a shared machine);
2. draft: one assistant call drafting 1 and K tokens at that context, timed the same way;
3. e2e: engine decode tok/s (greedy, --output tokens after a --prompt-token random prompt): plain; test
   drafters (runner.drafter replaced) that propose the plain run's continuation with each token right with
   probability 1.0 / 0.9 / 0.7 / 0.5 at chosen Ks (--forced; seeded; a wrong draft is the right token + 1) or
   never right (--wrong-ks); the ngram and mtp methods (--method-ks). Plain runs are repeated between the
   cases (--plain-every). Every speculative run's tokens are checked against the plain run's; per case the
   verification steps and drafts of a run (a verification of d drafts runs d + 1 rows).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from pathlib import Path

import gem4  # noqa: F401  first: sets the OpenMP environment before torch loads
import torch

from gem4 import Engine, SamplingParams

# ---- the assistant checkpoint (assumed E2B-assistant decoder shape; the target's K/V geometry) ----

ASSISTANT_TEXT = dict(
    vocab_size=262144, hidden_size=256, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=None,
    rms_norm_eps=1e-6, max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh",
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1000000.0}},
)
ASSISTANT = dict(backbone_hidden_size=1536, use_ordered_embeddings=True, num_centroids=2048,
                 centroid_intermediate_top_k=32)


@contextlib.contextmanager
def _all_layers_shared():
    """transformers 5.23.0 raises in kv_sharing_modes when every layer is KV-shared (docs/gemma4.md §5.7):
    answer ["reuse"] * L for such configs while building."""
    from transformers.models.gemma4 import configuration_gemma4 as C

    prop = C.Gemma4TextConfig.kv_sharing_modes
    C.Gemma4TextConfig.kv_sharing_modes = property(
        lambda c: ["reuse"] * c.num_hidden_layers if c.num_kv_shared_layers == c.num_hidden_layers else prop.fget(c))
    try:
        yield
    finally:
        C.Gemma4TextConfig.kv_sharing_modes = prop


def build_assistant(out: Path, seed: int = 0) -> None:
    """Random weights as the tiny test fixtures draw them (norms 1 + 0.5 N, q_norm scaled by d^-1/4,
    layer scalars U(0.5, 1.5), the rest 0.08 N), bf16, token_ordering a random permutation."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    with _all_layers_shared():
        cfg = Gemma4AssistantConfig(text_config=dict(ASSISTANT_TEXT), **ASSISTANT)
        model = Gemma4AssistantForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_scalar"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
                if name.endswith("q_norm.weight"):
                    p.mul_(p.shape[-1] ** -0.25)
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
            elif name.endswith("token_ordering"):
                b.copy_(torch.randperm(b.numel(), generator=g))
    out.mkdir(parents=True, exist_ok=True)
    with _all_layers_shared():
        model.save_pretrained(out)
    print(f"assistant: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters -> {out}", flush=True)



# ---- 1, 2: one verification forward, one draft call ----

def _fastest_call(fn, calls: int) -> float:
    """The fastest of `calls` calls of fn(), seconds: on a shared machine the closest to the cost of a call
    that had the cores to itself (the rounds' median of it is what is reported)."""
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_steps(model, assistant, context: int, ks: list[int], repeats: int, calls: int) -> dict:
    """Per round, interleaved: the target forward of n = 1 and K + 1 rows (all rows' logits) over a context of
    `context` tokens, split into the layer stack and the head; the assistant drafting 1 and K tokens."""
    from gem4.model.assistant import DraftSeq, draft_view

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 200000, (context + 8,), generator=g)
    cache = model.new_cache()
    with torch.inference_mode():
        _, h = model.forward(ids[:context], cache.step(context), cache.pool, hidden=True)
        cache.commit(context)
        view = draft_view(cache.pool, [DraftSeq(context, cache.block_table, cache.sliding_table)])
    rows = sorted({1} | {k + 1 for k in ks})
    drafts = sorted({1} | set(ks))
    res: dict = {"forward": {n: [] for n in rows}, "head": {n: [] for n in rows}, "draft": {k: [] for k in drafts}}

    @torch.inference_mode()
    def forward(n):
        model.forward(ids[context:context + n], cache.step(n, logits=n, prefill=False), cache.pool)   # decode rows

    hn = {n: h[-1:].expand(n, -1).contiguous() for n in rows}

    @torch.inference_mode()
    def head(n):
        model.head(hn[n])

    @torch.inference_mode()
    def draft(k):
        assistant.draft(model, ids[context:context + 1], h[-1:], view, cache.pool, k)

    for fn in (forward, head):
        for n in rows:
            fn(n)                                                # warm-up
    for k in drafts:
        draft(k)
    for r in range(repeats):
        for n in rows:
            res["forward"][n].append(_fastest_call(lambda: forward(n), calls))
            res["head"][n].append(_fastest_call(lambda: head(n), calls))
        for k in drafts:
            res["draft"][k].append(_fastest_call(lambda: draft(k), calls))
        print(f"round {r}: forward ms " + ", ".join(f"{n}:{1000 * res['forward'][n][-1]:.1f}" for n in rows)
              + " | draft ms " + ", ".join(f"{k}:{1000 * res['draft'][k][-1]:.1f}" for k in drafts), flush=True)
    return res


def report_steps(res: dict) -> None:
    """Medians over the rounds, the per-round ratios' median, and the fastest call of all rounds."""
    med = {part: {n: statistics.median(v) for n, v in d.items()} for part, d in res.items()}
    f1, fast1, head1 = res["forward"][1], min(res["forward"][1]), min(res["head"][1])
    print("\n| rows (K + 1) | forward ms (median of rounds) | x 1 row | x 1 row, fastest | head ms, fastest (x 1 row) |")
    print("|---|---|---|---|---|")
    for n in med["forward"]:
        ratio = statistics.median(a / b for a, b in zip(res["forward"][n], f1))
        head = min(res["head"][n])
        print(f"| {n} | {1000 * med['forward'][n]:.0f} | {ratio:.2f} | {min(res['forward'][n]) / fast1:.2f} "
              f"| {1000 * head:.1f} ({head / head1:.2f}) |")
    print("\n| drafts | assistant ms (median of rounds) | per draft ms | x one 1-row target forward | fastest ms |")
    print("|---|---|---|---|---|")
    for k, t in med["draft"].items():
        ratio = statistics.median(a / b for a, b in zip(res["draft"][k], f1))
        print(f"| {k} | {1000 * t:.1f} | {1000 * t / k:.1f} | {ratio:.3f} | {1000 * min(res['draft'][k]):.1f} |")


# ---- 3: end to end through the engine ----

class ForcedDrafter:
    """Test drafter over one known greedy continuation: each draft is the right token with probability
    `p` (seeded, drawn per draft), else the right token + 1 (never accepted)."""

    def __init__(self, prompt: list[int], continuation: list[int], k: int, p: float, vocab: int, seed: int = 0):
        self.prompt, self.continuation, self.num_speculative_tokens = prompt, continuation, k
        self.p, self.vocab, self.rng = p, vocab, random.Random(seed)

    def propose(self, tokens, max_drafts):
        n = len(self.prompt)
        right = self.continuation[len(tokens) - n:len(tokens) - n + min(max_drafts, self.num_speculative_tokens)]
        return [t if self.p >= 1 or self.rng.random() < self.p else (t + 1) % self.vocab for t in right]


def run_once(engine: Engine, prompt: list[int], output: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    before = (engine.spec_drafts, engine.spec_draft_tokens, engine.spec_accepted_tokens)
    tokens, times = [], []
    for e in engine.generate(prompt, params):
        times.append(time.perf_counter())
        tokens.append(e.token_id)
    drafts, drafted, accepted = (a - b for a, b in zip(
        (engine.spec_drafts, engine.spec_draft_tokens, engine.spec_accepted_tokens), before))
    return {"tps": (len(times) - 1) / (times[-1] - times[0]), "tokens": tokens, "steps": drafts,
            "drafted": drafted, "accepted": accepted}


def bench_e2e(model, prompt_len: int, output: int, forced: list[tuple[float, list[int]]], wrong_ks: list[int],
              method_ks: list[int], assistant: str | None, repeats: int, plain_every: int = 6) -> dict:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 200000, (prompt_len,), generator=g).tolist()
    common = dict(max_model_len=prompt_len + output + 16, enable_prefix_caching=False)
    plain = Engine(model, **common)
    want = run_once(plain, prompt, output)["tokens"]                             # warm-up and the reference
    vocab = model.config.vocab_size
    cases: list[tuple[str, int, Engine, object]] = [("plain", 0, plain, None)]
    engines = {k: Engine(model, speculative_config={"method": "ngram", "num_speculative_tokens": k}, **common)
               for k in sorted({k for _, p_ks in forced for k in p_ks} | set(wrong_ks) | set(method_ks))}
    for p, p_ks in forced:
        for k in p_ks:
            cases.append((f"p={p}", k, engines[k], ForcedDrafter(prompt, want, k, p, vocab)))
    for k in wrong_ks:
        cases.append(("wrong", k, engines[k], ForcedDrafter(prompt, want, k, 0.0, vocab)))
    for k in method_ks:
        cases.append(("ngram", k, engines[k], engines[k]._runner.drafter))
        if assistant:
            cases.append(("mtp", k, Engine(model, speculative_config={"method": "mtp", "model": assistant,
                                                                      "num_speculative_tokens": k}, **common), None))
    results: dict[str, list[dict]] = {}
    order = 0                                                                     # each run's place in time
    for r in range(repeats):
        for i, (label, k, engine, drafter) in enumerate(cases):
            if i and i % plain_every == 0:                                        # plain again, between cases
                results.setdefault("plain", []).append(_strip(run_once(plain, prompt, output), want, order))
                order += 1
            if drafter is not None:
                engine._runner.drafter = drafter
                if isinstance(drafter, ForcedDrafter):
                    drafter.rng.seed(k)                                           # the same draws every round
            out = _strip(run_once(engine, prompt, output), want, order)
            order += 1
            results.setdefault(f"{label} K={k}" if k else label, []).append(out)
            print(f"round {r} {label} K={k}: {out['tps']:.2f} tok/s, accepted {out['accepted']}/{out['drafted']} "
                  f"in {out['steps']} steps, tokens {'equal' if out['equal'] else 'DIFFER'}", flush=True)
    return results


def _strip(out: dict, want: list[int], order: int) -> dict:
    tokens = out.pop("tokens")
    out["equal"], out["order"] = tokens == want, order
    return out


def _against_plain(run: dict, plain: list[dict]) -> float:
    """A run's tok/s over the mean of the plain runs just before and after it (the load drifts)."""
    before = max((p for p in plain if p["order"] < run["order"]), key=lambda p: p["order"])
    after = [p for p in plain if p["order"] > run["order"]]
    near = [before] + ([min(after, key=lambda p: p["order"])] if after else [])
    return run["tps"] / statistics.mean(p["tps"] for p in near)


def report_e2e(results: dict) -> None:
    base = statistics.median(x["tps"] for x in results["plain"])
    print(f"\nplain: {base:.2f} tok/s over {len(results['plain'])} runs")
    print("\n| drafter | K | decode tok/s | x plain (the plain runs around each run) [rounds] | acceptance "
          "(accepted / drafted) | tokens / step | verifications, drafts per run | all tokens equal plain |")
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        if name == "plain":
            continue
        tps = statistics.median(x["tps"] for x in runs)
        drafted, accepted, steps = (sum(x[f] for x in runs) for f in ("drafted", "accepted", "steps"))
        label, k = name.rsplit(" K=", 1)
        acc = f"{accepted / drafted:.2f}" if drafted else "no drafts"
        ratios = [_against_plain(x, results["plain"]) for x in runs]
        print(f"| {label} | {k} | {tps:.2f} | {statistics.median(ratios):.2f} "
              f"[{', '.join(f'{x:.2f}' for x in ratios)}] | {acc} | "
              f"{(accepted + steps) / steps if steps else 1:.2f} | {steps / len(runs):.1f}, {drafted / len(runs):.1f} | "
              f"{all(x['equal'] for x in runs)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--assistant", default="benchmarks/out/e2b-assistant-hf")
    ap.add_argument("--build-assistant", action="store_true")
    ap.add_argument("--part", nargs="+", choices=["steps", "e2e"], default=["steps", "e2e"])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--wrong-ks", type=int, nargs="+", default=[1])
    ap.add_argument("--method-ks", type=int, nargs="+", default=[3])
    ap.add_argument("--forced", nargs="+", default=["1.0:7", "0.9:3,7", "0.7:1,2,3,4", "0.5:1,2"],
                    help="forced-acceptance drafters, P:K,K,... (each draft right with probability P)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plain-every", type=int, default=6,
                    help="in part e2e, a plain run before every N-th case (1: before each; the ratios to plain "
                         "use the plain runs next to each run)")
    ap.add_argument("--calls", type=int, default=5, help="calls per timing in part steps (the fastest counts)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    assistant_dir = Path(a.assistant)
    if a.build_assistant or not (assistant_dir / "config.json").exists():
        build_assistant(assistant_dir)
    model = gem4.load(a.model)
    raw: dict = {}
    if "steps" in a.part:
        assistant = gem4.load_assistant(assistant_dir, target=model)
        raw["steps"] = bench_steps(model, assistant, a.context, list(range(1, 8)), a.repeats, a.calls)
        report_steps(raw["steps"])
    if "e2e" in a.part:
        forced = [(float(p), [int(k) for k in ks.split(",")]) for p, ks in (f.split(":") for f in a.forced)]
        raw["e2e"] = bench_e2e(model, a.prompt, a.output, forced, a.wrong_ks, a.method_ks, str(assistant_dir),
                               a.repeats, a.plain_every)
        report_e2e(raw["e2e"])
    if a.json:
        a.json.write_text(json.dumps(raw, indent=1, default=str))


if __name__ == "__main__":
    main()
