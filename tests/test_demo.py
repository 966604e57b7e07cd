"""The demo checkpoint (`gem4.demo`): its tokenizer keeps the real Gemma 4 token types, so its chat replies
end on <turn|> like a real checkpoint's, without the token's text in the content.

The real vocabulary is llama.cpp's vocab-only GGUF (tests/assets/gemma4-vocab), the same file the demo's
vocab.json was derived from. The demo is built into a private GEM4_CACHE (a build takes seconds).
(`gem4 run --demo` / `gem4 chat --demo` in subprocesses: tests/test_cli.py.)
"""
from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

import gem4
from gem4 import Engine, SamplingParams
from gem4.chat import encode_prompt
from gem4.demo import DEMO_VERSION, VOCAB_FILE, demo_tokenizer, ensure_demo, write_tokenizer
from gem4.parser import Gemma4Parser
from gem4.tokenizer import Tokenizer, TokenType
from server_helpers import InProcessServer

VOCAB_GGUF = Path(__file__).parent / "assets" / "gemma4-vocab" / "ggml-vocab-gemma-4.gguf"
SPECIAL_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED)
TURN_END = 106
# a bias that makes the seeded demo replies below end on <turn|> within 24 tokens, most of them after some
# text (float32: 12 of 12, 9 with text; 8 gives 10 of 12, 10 makes most replies <turn|> alone)
TURN_END_BIAS = 9.0


@pytest.fixture(scope="module")
def real() -> Tokenizer:
    return Tokenizer.from_gguf(VOCAB_GGUF)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """The demo checkpoint, built by `ensure_demo` into an empty cache."""
    cache = tmp_path_factory.mktemp("gem4-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEM4_CACHE", str(cache))
        directory = ensure_demo()
    assert directory == cache / f"demo-{DEMO_VERSION}"
    return directory


def check_types(tok: Tokenizer, real: Tokenizer) -> None:
    """`tok` (a demo tokenizer) gives every token the type the real vocabulary gives it, and keeps every
    CONTROL / USER_DEFINED token of the real ids it covers at its real id."""
    real_ids = json.loads(VOCAB_FILE.read_text(encoding="utf-8"))["real_ids"][:tok.vocab_size]
    assert tok.tokens == [real.tokens[r] for r in real_ids]
    got = {tok.tokens[i]: TokenType(int(t)) for i, t in enumerate(tok.types)}
    want = {real.tokens[r]: TokenType(int(real.types[r])) for r in real_ids}
    assert {t: ty for t, ty in got.items() if got[t] != want[t]} == {}
    specials = {real.tokens[r]: r for r in range(len(real.tokens)) if real.types[r] in SPECIAL_TYPES
                and r < tok.vocab_size}
    assert {t: tok.token_to_id(t) for t in specials} == specials
    assert len(specials) == 17          # 10 CONTROL (<pad> .. <turn|>) + the 7 USER_DEFINED ones


@pytest.mark.parametrize("vocab_size", [None, 512])
def test_written_tokenizer_keeps_every_special_type_of_the_real_vocab(real, tmp_path, vocab_size):
    check_types(demo_tokenizer(vocab_size), real)             # vocab.json's types
    directory = write_tokenizer(tmp_path, vocab_size)
    tok = Tokenizer.from_file(directory)
    check_types(tok, real)                                    # as tokenizer.json + tokenizer_config.json read back
    control = {t for t, ty in zip(tok.tokens, tok.types) if ty == TokenType.CONTROL}
    assert {"<bos>", "<eos>", "<|turn>", "<turn|>", "<|think|>", "<|tool>", "<tool|>"} <= control
    # the files themselves: each added token flagged special exactly when it is CONTROL, and every CONTROL
    # token named in tokenizer_config.json (names there override the flags for every HF reader)
    added = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    assert {a["content"]: a["special"] for a in added} == {
        t: ty == TokenType.CONTROL for t, ty in zip(tok.tokens, tok.types) if ty in SPECIAL_TYPES}
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    named = {config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")}
    assert named | set(config["extra_special_tokens"]) == control


def test_demo_checkpoint_keeps_every_special_type_of_the_real_vocab(demo, real):
    check_types(Tokenizer.from_file(demo), real)


def test_transformers_reads_the_same_special_tokens(demo, real):
    """The demo is an ordinary HF checkpoint: transformers' special tokens are the real CONTROL tokens."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(demo))
    real_ids = json.loads(VOCAB_FILE.read_text(encoding="utf-8"))["real_ids"]
    assert sorted(hf.all_special_ids) == [i for i, r in enumerate(real_ids) if real.is_control(r)]


def test_a_cached_demo_of_an_older_version_is_not_reused(tmp_path, monkeypatch, real):
    """Version 1 wrote a tokenizer_config.json that named only five special tokens (so <turn|> read as
    text); a cache that holds it gets a new checkpoint."""
    old = tmp_path / "demo-1"
    write_tokenizer(old)
    config = json.loads((old / "tokenizer_config.json").read_text())
    config.pop("extra_special_tokens", None)
    (old / "tokenizer_config.json").write_text(json.dumps(config))
    (old / "config.json").write_text("{}")
    assert Tokenizer.from_file(old).token_type(TURN_END) == TokenType.NORMAL    # what version 1 gave
    monkeypatch.setenv("GEM4_CACHE", str(tmp_path))
    directory = ensure_demo()
    assert directory != old
    check_types(Tokenizer.from_file(directory), real)


# ---------------------------------------------------------------------------------------------
# Chat replies that end on <turn|>
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(demo):
    tok = Tokenizer.from_file(demo)
    with Engine(gem4.load(demo, dtype="float32"), tok, max_model_len=512) as e:
        yield e


def control_texts(real: Tokenizer) -> list[str]:
    """The text of every CONTROL token of the real vocabulary (`<bos>`, `<|turn>`, `<turn|>`, `<|image>`, ...)."""
    return [real.tokens[i] for i in range(real.vocab_size) if real.is_control(i)]


def question(seed: int) -> list[dict]:
    return [{"role": "user", "content": f"Tell me something about the number {seed}."}]


def test_chat_replies_that_end_on_turn_end_hold_no_control_token_text(engine, real):
    tok = engine.tokenizer
    stopped = with_text = 0
    for seed in range(12):
        prompt = encode_prompt(tok, question(seed))
        parser = Gemma4Parser(tok, prompt_ids=prompt)
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, logit_bias={TURN_END: TURN_END_BIAS})
        events = list(engine.generate(prompt, params))
        parser.feed([e.token_id for e in events if e.token_id is not None])
        parser.finish()
        result, last = parser.result, events[-1]
        for text in control_texts(real):
            assert text not in result.content and text not in (result.reasoning_content or ""), (seed, result)
        if last.stop_reason == TURN_END:
            stopped += 1
            assert last.finish_reason == "stop" and result.stop_token_id == TURN_END
            with_text += bool(result.content)
    assert stopped >= 10 and with_text >= 6                   # the replies do end on <turn|>, most after text


def test_served_demo_chat_content_holds_no_control_token_text(engine, real):
    from gem4.server import ServerConfig, create_app

    app = create_app(ServerConfig(served_model_name="gem4-demo"), engine)
    with InProcessServer(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        stopped = with_text = 0
        for seed in range(12):
            request = dict(model="gem4-demo", messages=question(seed), seed=seed, max_tokens=24, temperature=1.0,
                           logit_bias={str(TURN_END): TURN_END_BIAS})
            reply = client.chat.completions.create(**request)
            streamed = "".join(chunk.choices[0].delta.content or ""
                               for chunk in client.chat.completions.create(**request, stream=True)
                               if chunk.choices)
            choice = reply.choices[0]
            stopped += choice.finish_reason == "stop"
            with_text += choice.finish_reason == "stop" and bool(choice.message.content)
            assert streamed == choice.message.content
            for text in control_texts(real):
                assert text not in choice.message.content, (seed, choice.message.content)
        assert stopped >= 10 and with_text >= 6
