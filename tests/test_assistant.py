"""The Gemma 4 assistant (MTP drafter) against transformers' Gemma4AssistantForCausalLM (docs/gemma4.md §5).

Tiny random assistants (hidden 32, backbone 64) drafting for the four tiny target variants; the oracle is
transformers 5.23.0 fed with the target's own K/V (`shared_kv_states`) and post-norm hidden state.
"""
from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch

import gem4
from gem4.kv_cache import BLOCK_SIZE, KVPool, SeqStep
from gem4.model import kernels
from gem4.model.assistant import DraftSeq, draft_view, sliding_reads_from
from gem4.weights.assistant import open_assistant, write_assistant_gguf
from gem4.weights.checkpoint import CheckpointError
from model_fixtures import COMMON, VARIANTS, randomize

NAMES = list(VARIANTS)
STEPS = 3                                  # draft steps compared per case


@contextlib.contextmanager
def assistant_workaround():
    """transformers 5.23.0 cannot build an assistant (every layer KV-shared makes kv_sharing_modes raise,
    docs/gemma4.md §5.7): all-shared configs get ["reuse"] * L while this is active."""
    from transformers.models.gemma4 import configuration_gemma4 as C

    prop = C.Gemma4TextConfig.kv_sharing_modes
    orig = prop.fget
    C.Gemma4TextConfig.kv_sharing_modes = property(
        lambda self: ["reuse"] * self.num_hidden_layers if self.num_kv_shared_layers == self.num_hidden_layers
        else orig(self))
    try:
        yield
    finally:
        C.Gemma4TextConfig.kv_sharing_modes = prop


def assistant_text(variant: str) -> dict:
    """The assistant decoder of docs/gemma4.md §8.3, its K/V geometry that of `variant`'s target."""
    target = VARIANTS[variant]
    text = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=target["num_key_value_heads"], head_dim=16, global_head_dim=32,
                layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=None,
                rope_parameters=COMMON["rope_parameters"], rms_norm_eps=1e-6, max_position_embeddings=4096)
    if target.get("attention_k_eq_v"):                  # 31B / 26B-A4B: one global KV head on full layers
        text.update(attention_k_eq_v=True, num_global_key_value_heads=target["num_global_key_value_heads"])
    return text


def build_assistant(variant: str, path, *, centroids: bool = False, seed: int = 99, **text_overrides):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    extra = dict(use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4) if centroids else {}
    with assistant_workaround():
        cfg = Gemma4AssistantConfig(text_config=dict(assistant_text(variant), **text_overrides),
                                    backbone_hidden_size=64, **extra)
        model = Gemma4AssistantForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    randomize(model, seed)
    if centroids:                                        # a permutation of the vocabulary into 16 clusters of 32
        model.masked_embedding.token_ordering.copy_(torch.randperm(512, generator=torch.Generator().manual_seed(seed)))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def assistants(tmp_path_factory):
    root = tmp_path_factory.mktemp("assistants")
    out = {}
    for name in NAMES:
        out[name] = (root / name, build_assistant(name, root / name))
    out["centroids"] = (root / "centroids", build_assistant("ple_kvshare", root / "centroids", centroids=True))
    return out


_HF_TARGETS: dict = {}


def hf_causal_of(fx):
    """transformers' target, read from the fixture's checkpoint once per test session: the shared
    `variants[...].hf_model` is not used, since other tests move it to bf16 and back (its RoPE buffers
    come back rounded)."""
    from transformers import Gemma4ForCausalLM

    if fx.name not in _HF_TARGETS:
        _HF_TARGETS[fx.name] = Gemma4ForCausalLM.from_pretrained(fx.hf_causal, attn_implementation="eager").eval()
    return _HF_TARGETS[fx.name]


@contextlib.contextmanager
def storing_last_layers(hf_target):
    """transformers returns shared_kv_states only from KV-sharing targets (docs/gemma4.md §5.4): make the last
    layer of each type store its K/V so non-sharing targets hand them out too (what llama.cpp reads)."""
    layers = hf_target.model.layers
    last = {t: i for i, t in enumerate(hf_target.config.layer_types)}
    saved = {i: layers[i].self_attn.store_full_length_kv for i in last.values()}
    for i in last.values():
        if not layers[i].self_attn.is_kv_shared_layer:
            layers[i].self_attn.store_full_length_kv = True
    try:
        yield
    finally:
        for i, v in saved.items():
            layers[i].self_attn.store_full_length_kv = v


def oracle(hf_target, hf_assistant, ids: list[int], p: int, steps: int = STEPS):
    """transformers' drafts at position p: target over ids[:p], then `steps` assistant steps from ids[p]."""
    with torch.no_grad(), storing_last_layers(hf_target), assistant_workaround():
        out = hf_target(torch.tensor([ids[:p]]), output_hidden_states=True, return_shared_kv_states=True)
        kv = dict(out.shared_kv_states)
        assert set(kv) == {"sliding_attention", "full_attention"}
        h = out.hidden_states[-1][:, -1:]                                  # post-norm, last position [1, 1, Hb]
        tok = torch.tensor([[ids[p]]])
        logits = []
        for _ in range(steps):
            emb = hf_target.model.embed_tokens(tok)                          # scaled [1, 1, Hb]
            res = hf_assistant(inputs_embeds=torch.cat([emb, h], dim=-1), position_ids=torch.tensor([[p]]),
                               shared_kv_states=kv)
            logits.append(res.logits[0, -1].float())
            h = res.last_hidden_state
            tok = res.logits[:, -1:].argmax(-1)
    return torch.stack(logits)                                              # [steps, V]


class OneSeq:
    """One sequence in a KV pool of its own with every block kept (tables 0, 1, 2, ...); `spare` extra
    sliding blocks after them."""

    def __init__(self, target, positions: int = 64, spare: int = 0):
        self.n = -(-positions // BLOCK_SIZE)
        self.pool = KVPool(target.config, num_blocks=self.n, num_sliding_blocks=self.n + spare, dtype=target.dtype)
        self.table = list(range(self.n))

    def step(self, start: int, n: int, logits: int = 1):
        return self.pool.layout([SeqStep(start, n, self.table, self.table, logits)])

    def view(self, p: int, sliding_table=None):
        return draft_view(self.pool, [DraftSeq(p, self.table, self.table if sliding_table is None else sliding_table)])


def fill(target, seq: OneSeq, ids: list[int], p: int, chunk: int = 5, rejected: int = 0) -> torch.Tensor:
    """The target's cache of ids[:p], filled in chunks of `chunk`; then, with `rejected`, a verification-sized
    step that also wrote `rejected` junk drafts at p, p + 1, ... (rejected: never committed). -> the post-norm
    hidden state of position p - 1 [1, H]."""
    ids_t = torch.tensor(ids)
    for s in range(0, p, chunk):
        n = min(chunk, p - s)
        _, hidden = target.forward(ids_t[s:s + n], seq.step(s, n), seq.pool, hidden=True)
    if rejected:
        junk = torch.randint(3, 512, (rejected,), generator=torch.Generator().manual_seed(p))
        _, h = target.forward(torch.cat([ids_t[p - 1:p], junk]), seq.step(p - 1, rejected + 1, rejected + 1),
                              seq.pool, hidden=True)
        assert torch.allclose(h[:1], hidden[-1:], atol=1e-5)   # the kept row is the one the prefill gave
    return hidden[-1:]


def gem4_drafts(target, assistant, ids: list[int], p: int, chunk: int = 5, steps: int = STEPS, rejected: int = 0):
    """gem4's drafts at position p (see fill)."""
    seq = OneSeq(target)
    hidden = fill(target, seq, ids, p, chunk, rejected)
    return assistant.draft(target, torch.tensor(ids[p:p + 1]), hidden, seq.view(p), seq.pool, steps, keep_logits=True)


def rel_err(out, ref) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", NAMES)
def test_draft_logits_match_transformers(variants, assistants, name):
    fx = variants[name]
    path, hf_assistant = assistants[name]
    target = gem4.load(fx.hf_causal, dtype="float32")
    assistant = gem4.load_assistant(path, target)
    for p in (1, 5, 9, 10, 30):                # within the window, its edge (W + 1 = 9 keys) and far past it
        ref = oracle(hf_causal_of(fx), hf_assistant, fx.ids, p)
        got = gem4_drafts(target, assistant, fx.ids, p)
        err = rel_err(got.logits[0], ref)
        print(f"{name} p={p}: max|diff|/max|ref| = {err:.2e}")
        assert err <= 1e-4
        assert got.tokens[0].tolist() == ref.argmax(-1).tolist()


def test_window_edge_is_transformers_w_plus_1(variants, assistants):
    # the sliding layer reads the last W + 1 = 9 positions: dropping the oldest (llama.cpp's W - 1 edge
    # would drop two) changes the logits, so the edge is observable and pinned to transformers'
    fx = variants["dense_plain"]
    path, hf_assistant = assistants["dense_plain"]
    target = gem4.load(fx.hf_causal, dtype="float32")
    assistant = gem4.load_assistant(path, target)
    seq = OneSeq(target)
    hidden = fill(target, seq, fx.ids, 30, chunk=30)
    view = seq.view(30)
    sliding = view.attend["sliding_attention"]
    assert int(sliding.q_hi[0] - sliding.q_lo[0]) == 9
    assert int(view.attend["full_attention"].q_hi[0]) == 30
    ref = oracle(hf_causal_of(fx), hf_assistant, fx.ids, 30, steps=1)[0]
    good, _ = assistant.forward(target.embed(torch.tensor(fx.ids[30:31])), hidden[-1:], view, seq.pool)
    narrow = type(view)(view.positions, dict(view.attend, sliding_attention=type(sliding)(
        sliding.key_rows, sliding.q_seq, sliding.q_lo + 1, sliding.q_hi)))
    bad, _ = assistant.forward(target.embed(torch.tensor(fx.ids[30:31])), hidden, narrow, seq.pool)
    assert rel_err(good[0], ref) <= 1e-4 < rel_err(bad[0], ref)


@pytest.mark.parametrize("name", ["ple_kvshare", "dense_keqv"])
def test_rejected_rows_in_the_ring_are_not_read(variants, assistants, name):
    # A verification step of K + 1 = 4 tokens (max_chunk 4: ring = W + 4) wrote positions p-1 .. p+2 and
    # only p - 1 was kept: the sliding ring must still hold p - W - 1 .. p - 1 (no extra draft slack).
    fx = variants[name]
    path, hf_assistant = assistants[name]
    target = gem4.load(fx.hf_causal, dtype="float32")
    assistant = gem4.load_assistant(path, target)
    for p in (20, 27):
        ref = oracle(hf_causal_of(fx), hf_assistant, fx.ids, p)
        got = gem4_drafts(target, assistant, fx.ids, p, chunk=4, rejected=3)
        assert rel_err(got.logits[0], ref) <= 1e-4


def test_batched_draft_equals_one_sequence_each(variants, assistants):
    # two sequences in one pool, scattered blocks, each at its own position: one batched draft == each alone
    fx = variants["ple_kvshare"]
    path, _ = assistants["ple_kvshare"]
    target = gem4.load(fx.hf_causal, dtype="float32")
    assistant = gem4.load_assistant(path, target)
    pool = KVPool(target.config, num_blocks=8, num_sliding_blocks=8, dtype=torch.float32)
    seqs = [(fx.ids[:23], [5, 1], [7, 2]), (fx.ids[7:41], [0, 6, 3], [4, 0, 6])]   # (tokens, blocks, sliding blocks)
    hidden = []
    for toks, table, sliding in seqs:
        n = len(toks) - 1
        _, h = target.forward(torch.tensor(toks[:n]), pool.layout([SeqStep(0, n, table, sliding)]), pool, hidden=True)
        hidden.append(h[-1])
    last = torch.tensor([toks[-1] for toks, _, _ in seqs])
    views = [DraftSeq(len(toks) - 1, table, sliding) for toks, table, sliding in seqs]
    both = assistant.draft(target, last, torch.stack(hidden), draft_view(pool, views), pool, STEPS, keep_logits=True)
    for b, v in enumerate(views):
        alone = assistant.draft(target, last[b:b + 1], hidden[b][None], draft_view(pool, [v]), pool, STEPS,
                                keep_logits=True)
        assert torch.equal(alone.tokens[0], both.tokens[b])
        assert rel_err(alone.logits[0], both.logits[b]) <= 1e-6


def test_draft_reads_sliding_blocks_from_p_minus_w_minus_1(variants, assistants):
    # the draft slack: at p the draft reads sliding positions p - W - 1 .. p - 1. With W = 8 and 16-row blocks,
    # p = 24 reads position 15 (block 0) although the target's own step from 24 starts at 17 (block 1);
    # p = 26 reads from 17 on. Block 0 replaced by a block of NaN: p = 26 is unaffected, p = 24 is not.
    fx = variants["dense_plain"]
    path, hf_assistant = assistants["dense_plain"]
    target = gem4.load(fx.hf_causal, dtype="float32")
    assistant = gem4.load_assistant(path, target)
    assert [sliding_reads_from(p, 8) // BLOCK_SIZE for p in (24, 26)] == [0, 1]
    for p, needs_block_0 in ((24, True), (26, False)):
        seq = OneSeq(target, spare=1)
        hidden = fill(target, seq, fx.ids, p)
        for spec in target.config.layers:
            if spec.is_sliding and spec.owns_kv:
                for store in seq.pool.store(spec.index).tensors():
                    store[seq.n * BLOCK_SIZE:] = float("nan")
        view = seq.view(p, sliding_table=[seq.n] + seq.table[1:])
        logits, _ = assistant.forward(target.embed(torch.tensor(fx.ids[p:p + 1])), hidden, view, seq.pool)
        if needs_block_0:
            assert torch.isnan(logits).all()
        else:
            assert rel_err(logits[0], oracle(hf_causal_of(fx), hf_assistant, fx.ids, p, steps=1)[0]) <= 1e-4


def test_centroid_head_matches_transformers(variants, assistants):
    fx = variants["ple_kvshare"]
    path, hf_assistant = assistants["centroids"]
    target = gem4.load(fx.hf_causal, dtype="float32")
    assistant = gem4.load_assistant(path, target)
    assert assistant.config.centroids is not None
    for p in (9, 30):
        ref = oracle(hf_causal_of(fx), hf_assistant, fx.ids, p)
        got = gem4_drafts(target, assistant, fx.ids, p)
        assert rel_err(got.logits[0], ref) <= 1e-4
        # 4 of 16 clusters scored: 128 tokens carry real logits, the rest the filler below them
        filler = got.logits[0].min(dim=-1, keepdim=True).values
        assert ((got.logits[0] > filler).sum(-1) == 128).all()


@pytest.mark.parametrize("name", ["ple_kvshare", "moe"])
def test_gguf_assistant_equals_hf(variants, assistants, tmp_path, name):
    fx = variants[name]
    path, hf_assistant = assistants[name]
    write_assistant_gguf(open_assistant(path), tmp_path / "a.gguf")
    target = gem4.load(fx.gguf["f32"], dtype="float32")
    assistant = gem4.load_assistant(tmp_path / "a.gguf", target)
    ref = oracle(hf_causal_of(fx), hf_assistant, fx.ids, 30)
    got = gem4_drafts(target, assistant, fx.ids, 30)
    assert rel_err(got.logits[0], ref) <= 1e-4


def test_gguf_of_a_centroid_assistant_runs_the_full_head(variants, assistants, tmp_path):
    # llama.cpp's converter drops the centroid head; the GGUF drafts with the full vocabulary
    fx = variants["ple_kvshare"]
    path, _ = assistants["centroids"]
    write_assistant_gguf(open_assistant(path), tmp_path / "c.gguf")
    target = gem4.load(fx.hf_causal, dtype="float32")
    full = gem4.load_assistant(tmp_path / "c.gguf", target)
    masked = gem4.load_assistant(path, target)
    assert full.config.centroids is None
    full_logits = gem4_drafts(target, full, fx.ids, 30, steps=1).logits[0, 0]
    masked_logits = gem4_drafts(target, masked, fx.ids, 30, steps=1).logits[0, 0]
    kept = masked_logits > masked_logits.min()
    assert int(kept.sum()) == 128
    assert torch.allclose(full_logits[kept], masked_logits[kept], atol=1e-5)
    assert (full_logits[~kept] > masked_logits[~kept]).all()


@pytest.mark.parametrize("name", ["ple_kvshare", "dense_keqv"])
def test_bfloat16_fast_mode(variants, assistants, name):
    fx = variants[name]
    path, _ = assistants[name]
    f32_target = gem4.load(fx.hf_causal, dtype="float32")
    bf16_target = gem4.load(fx.hf_causal, dtype="bfloat16")
    ref = gem4_drafts(f32_target, gem4.load_assistant(path, f32_target), fx.ids, 30)
    fast_assistant = gem4.load_assistant(path, bf16_target)
    assert fast_assistant.dtype == torch.bfloat16
    got = gem4_drafts(bf16_target, fast_assistant, fx.ids, 30)
    drift = float(((got.logits - ref.logits) ** 2).mean() / (ref.logits ** 2).mean())
    print(f"{name}: bf16 draft logits NMSE vs float32 = {drift:.2e}")
    assert drift <= 1e-3
    assert got.tokens[0, 0] == ref.tokens[0, 0]


def test_q8_0_assistant_in_fast_mode(variants, assistants, tmp_path):
    # a quantized GGUF assistant beside a quantized target, bf16 fast mode: packed weights, compiled kernels
    fx = variants["ple_kvshare"]
    path, _ = assistants["ple_kvshare"]
    write_assistant_gguf(open_assistant(path), tmp_path / "q8.gguf", "q8_0")
    f32_target = gem4.load(fx.gguf["f32"], dtype="float32")
    ref = gem4_drafts(f32_target, gem4.load_assistant(path, f32_target), fx.ids, 30)
    target = gem4.load(fx.gguf["q8_0"])                                   # dtype auto: the fast mode
    assistant = gem4.load_assistant(tmp_path / "q8.gguf", target)
    if kernels.available():
        assert assistant.layers[0].self_attn.q_proj.layout == "packed" and assistant.backend == "cpu"
    got = gem4_drafts(target, assistant, fx.ids, 30)
    drift = float(((got.logits - ref.logits) ** 2).mean() / (ref.logits ** 2).mean())
    print(f"q8_0 fast-mode draft logits NMSE vs float32 = {drift:.2e}")
    assert torch.isfinite(got.logits).all() and drift <= 2e-2


def test_target_hidden_option_equals_plain_forward(variants):
    fx = variants["moe"]
    target = gem4.load(fx.hf_causal, dtype="float32")
    ids = torch.tensor(fx.ids[:20])
    a, b = OneSeq(target), OneSeq(target)
    plain = target.forward(ids, a.step(0, 20, logits=3), a.pool)
    logits, h = target.forward(ids, b.step(0, 20, logits=3), b.pool, hidden=True)
    assert torch.equal(plain, logits)
    assert h.shape == (3, 64)
    assert torch.allclose(target.head(h), logits)


# ---- refusals ----

def edit_config(src, dst, fn):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    fn(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_assistant_of_another_target_is_refused(variants, assistants, tmp_path):
    plain = gem4.load(variants["dense_plain"].hf_causal, dtype="float32")
    # built for a 1-KV-head target (E2B-like), attached to a 2-KV-head one
    with pytest.raises(CheckpointError, match=r"does not belong.*2 x 16"):
        gem4.load_assistant(assistants["ple_kvshare"][0], plain)
    narrow = edit_config(assistants["dense_plain"][0], tmp_path / "narrow",
                         lambda c: c.update(backbone_hidden_size=48))
    with pytest.raises(CheckpointError, match="backbone of width 48.*hidden size is 64"):
        gem4.load_assistant(narrow, plain)
    small_vocab = tmp_path / "vocab"
    build_assistant("dense_plain", small_vocab, vocab_size=256)
    with pytest.raises(CheckpointError, match="256 tokens, the target's 512"):
        gem4.load_assistant(small_vocab, plain)


def test_not_an_assistant_is_refused(variants, assistants, tmp_path):
    fx = variants["dense_plain"]
    target = gem4.load(fx.hf_causal, dtype="float32")
    with pytest.raises(CheckpointError, match="not a Gemma 4 assistant"):
        gem4.load_assistant(fx.hf_causal, target)
    with pytest.raises(CheckpointError, match="architecture is 'gemma4'"):
        gem4.load_assistant(fx.gguf["f32"], target)
    write_assistant_gguf(open_assistant(assistants["dense_plain"][0]), tmp_path / "a.gguf")
    with pytest.raises(CheckpointError, match="gemma4-assistant.*gem4.load_assistant"):
        gem4.load(tmp_path / "a.gguf")
    flagged = edit_config(assistants["dense_plain"][0], tmp_path / "flag",
                          lambda c: c.update(use_ordered_embeddings=True))
    with pytest.raises(CheckpointError, match="use_ordered_embeddings"):
        gem4.load_assistant(flagged, target)
    moe = edit_config(assistants["dense_plain"][0], tmp_path / "moe", lambda c: c["text_config"].update(
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8))
    with pytest.raises(CheckpointError, match="no experts"):
        gem4.load_assistant(moe, target)


# ---- the pieces together: a one-sequence reference loop of speculative decoding ----

def speculative_decode(target, drafter, prompt: list[int], n: int, params, k: int = 3, check=None) -> list[int]:
    """Reference loop for the engine (one sequence, every block kept): prefill, then rounds of draft ->
    verify the K + 1 rows in one forward -> accept; the last token is never in the cache until verified,
    the assistant drafts from the hidden state of the row that predicted it. Rejected rows are simply
    overwritten by the next round (rollback = a shorter length). `check` (an assistant): after every round,
    its drafts from the loop's state equal its drafts after a fresh prefill of the accepted tokens."""
    from gem4.engine.speculative import verify
    from gem4.sampling import Sampler

    seq = OneSeq(target, positions=len(prompt) + n + k + 1)
    gen = Sampler.make_generator(params)
    logits, hidden = target.forward(torch.tensor(prompt), seq.step(0, len(prompt)), seq.pool, hidden=True)
    out = Sampler().sample(logits, [params], [[]], [prompt], [gen]).token_ids
    h, p = hidden[-1:], len(prompt)                       # out[-1] sits at position p, not yet in the cache
    while len(out) < n:
        if hasattr(drafter, "propose"):
            drafts = drafter.propose(prompt + out)
        else:
            drafts = drafter.draft(target, torch.tensor(out[-1:]), h, seq.view(p), seq.pool, k).tokens[0].tolist()
        ids = torch.tensor(out[-1:] + drafts)
        logits, hidden = target.forward(ids, seq.step(p, len(ids), logits=len(ids)), seq.pool, hidden=True)
        verdict = verify(logits, drafts, params, out, prompt, gen)
        out += verdict.tokens
        h, p = hidden[verdict.num_accepted][None], p + verdict.num_accepted + 1
        if check is not None:
            got = check.draft(target, torch.tensor(out[-1:]), h, seq.view(p), seq.pool, 2, keep_logits=True).logits
            fresh = OneSeq(target, positions=p + 1)
            h_fresh = fill(target, fresh, prompt + out, p, chunk=p)
            ref = check.draft(target, torch.tensor(out[-1:]), h_fresh, fresh.view(p), fresh.pool, 2,
                              keep_logits=True).logits
            assert rel_err(got, ref) <= 1e-4, p
    return out[:n]


def plain_decode(target, prompt: list[int], n: int, params) -> list[int]:
    from gem4.sampling import Sampler

    seq = OneSeq(target, positions=len(prompt) + n)
    gen = Sampler.make_generator(params)
    logits = target.forward(torch.tensor(prompt), seq.step(0, len(prompt)), seq.pool)
    out = Sampler().sample(logits, [params], [[]], [prompt], [gen]).token_ids
    while len(out) < n:
        logits = target.forward(torch.tensor(out[-1:]), seq.step(len(prompt) + len(out) - 1, 1), seq.pool)
        out += Sampler().sample(logits, [params], [out], [prompt], [gen]).token_ids
    return out


@pytest.mark.parametrize("name", ["ple_kvshare", "moe"])
def test_speculative_loop_equals_plain_decoding(variants, assistants, name):
    from gem4.engine.speculative import NgramDrafter

    fx = variants[name]
    target = gem4.load(fx.hf_causal, dtype="float32")
    assistant = gem4.load_assistant(assistants[name][0], target)
    prompt = fx.ids[:12] * 2                                # a repeat, so prompt lookup finds matches
    for params in (gem4.SamplingParams(temperature=0.0),
                   gem4.SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1, seed=3)):
        plain = plain_decode(target, prompt, 30, params)
        for drafter in (assistant, NgramDrafter(3, 3, 1)):
            assert speculative_decode(target, drafter, prompt, 30, params) == plain, (params, drafter)


class ForcedDrafter:
    """Proposes a known continuation, wrong at every position listed in `wrong` (a test drafter with a
    chosen acceptance pattern)."""

    def __init__(self, prompt, continuation, wrong, k=3):
        self.prompt, self.continuation, self.wrong, self.k = len(prompt), continuation, set(wrong), k

    def propose(self, tokens):
        i = len(tokens) - self.prompt
        return [t if i + j not in self.wrong else (t + 1) % 512
                for j, t in enumerate(self.continuation[i:i + self.k])]


@pytest.mark.parametrize("name", ["ple_kvshare", "dense_keqv"])
def test_accepted_drafts_leave_the_state_of_a_fresh_prefill(variants, assistants, name):
    # partial acceptances (0-3 of 3 per round): the tokens are plain decoding's, and the assistant's state
    # (hidden row of the last accepted token, position, the target's cache) is what a fresh prefill gives
    fx = variants[name]
    target = gem4.load(fx.hf_causal, dtype="float32")
    assistant = gem4.load_assistant(assistants[name][0], target)
    prompt, params = fx.ids[:14], gem4.SamplingParams(temperature=0.0)
    plain = plain_decode(target, prompt, 24, params)
    drafter = ForcedDrafter(prompt, plain, wrong={2, 3, 9, 15, 16, 17})
    assert speculative_decode(target, drafter, prompt, 24, params, check=assistant) == plain
