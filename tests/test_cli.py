"""`gem4 run` / `gem4 chat` in subprocesses, the demo checkpoint, and the CLI's error paths.

Expected outputs are computed in-process with the same engine and parser, greedy, float32.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import gem4
from gem4 import Engine, SamplingParams
from gem4.chat import encode_prompt
from gem4.cli import _stream_chat, assistant_message, main
from gem4.demo import DEMO_VERSION, write_tokenizer
from gem4.engine.engine import GenerationEvent
from gem4.engine.sequence import RequestStats
from gem4.parser import ParseResult, ToolCall
from gem4.ggml import GGMLType

STATS = re.compile(r"prompt: (\d+) tokens, (\d+) cached, [\d.]+ tok/s \| generated: (\d+) tokens, [\d.]+ tok/s "
                   r"\| TTFT: \d+ ms \| finish: (stop|length)")


def gem4_command() -> list[str]:
    script = Path(sys.executable).with_name("gem4")
    assert script.exists(), f"the gem4 console script is not installed next to {sys.executable}"
    return [str(script)]


def share_kernels(cache: Path) -> None:
    """A private GEM4_CACHE still uses this test session's compiled kernels (a build takes minutes)."""
    from gem4.demo import cache_root

    target = cache_root() / "kernels"
    target.mkdir(parents=True, exist_ok=True)
    link = cache / "kernels"
    if not link.exists():
        cache.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target, target_is_directory=True)


def run_cli(args: list[str], cache: Path, stdin: str | None = None, command: list[str] | None = None):
    share_kernels(cache)
    env = dict(os.environ, GEM4_CACHE=str(cache))
    return subprocess.run((command or gem4_command()) + args, input=stdin, capture_output=True, text=True,
                          encoding="utf-8", errors="replace", env=env, timeout=180)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The README's first command, on an empty cache: builds the demo checkpoint, then runs it."""
    cache = tmp_path_factory.mktemp("gem4-cache")
    return cache, run_cli(["run", "--demo", "-p", "hello", "-n", "8"], cache)


def test_run_demo_prints_text(demo_run):
    cache, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "RANDOM weights" in proc.stderr and "output is random" in proc.stderr
    assert "building the demo checkpoint" in proc.stderr
    m = STATS.search(proc.stderr)
    assert m and int(m.group(1)) == len(gem4.Tokenizer.from_file(cache / f"demo-{DEMO_VERSION}").encode("hello"))
    assert 1 <= int(m.group(3)) <= 8


def test_demo_checkpoint_keeps_gemma4_special_ids(demo_run):
    cache, _ = demo_run
    directory = cache / f"demo-{DEMO_VERSION}"
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                           "tokenizer_config.json"]
    tok = gem4.Tokenizer.from_file(directory)
    model = gem4.load(directory, dtype="float32")
    assert tok.vocab_size == model.config.vocab_size == 4096
    logits = model.logits(tok.encode("the answer is"))                   # [4, 4096]
    assert logits.std(-1).min() > 1.0                                     # spread enough to sample from
    expect = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<|tool_call>": 48, "<|tool_response>": 50, '<|"|>': 52,
              "<|think|>": 98, "<|channel>": 100, "<channel|>": 101, "<|turn>": 105, "<turn|>": 106,
              "<0x00>": 238, "<0xFF>": 493}
    assert {t: tok.token_to_id(t) for t in expect} == expect
    text = "Hello, world! ünïcödé ☕"
    assert tok.decode(tok.encode(text, add_bos=False)) == text
    assert len(tok.encode("the answer is", add_bos=False)) == 3          # real merges, not bytes


def test_demo_builds_without_transformers_and_is_reproducible(demo_run, tmp_path):
    cache, _ = demo_run
    blocked = ("import sys; sys.modules['transformers'] = None; from gem4.cli import main; "
               "sys.exit(main(sys.argv[1:]))")
    args = ["run", "--demo", "-p", "hello", "-n", "8", "--seed", "5"]
    fresh = run_cli(args, tmp_path, command=[sys.executable, "-c", blocked])
    assert fresh.returncode == 0, fresh.stderr
    again = run_cli(args, cache)                                          # the already built cache
    assert again.returncode == 0 and "building" not in again.stderr
    assert fresh.stdout == again.stdout and fresh.stdout.strip()
    a = load_file(str(tmp_path / f"demo-{DEMO_VERSION}" / "model.safetensors"))
    b = load_file(str(cache / f"demo-{DEMO_VERSION}" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)   # same seed, same weights


@pytest.fixture(scope="module")
def tokenizer_512(tmp_path_factory):
    """A tokenizer for the 512-token fixtures: the first 512 real Gemma 4 ids (specials + bytes + 18 merges)."""
    return write_tokenizer(tmp_path_factory.mktemp("tok512"), 512)


def expected_chat(engine, tok, messages, max_tokens, thinking=False):
    ids = encode_prompt(tok, messages, enable_thinking=thinking)
    out = io.StringIO()
    params = SamplingParams(temperature=0, top_k=64, top_p=0.95, max_tokens=max_tokens)
    result, last, _ = _stream_chat(engine, tok, ids, params, out)
    return out.getvalue(), result, last, len(ids)


def test_run_chat_on_a_fixture(variants, tokenizer_512, tmp_path):
    fx = variants["dense_plain"]
    proc = run_cli(["run", str(fx.hf_causal), "--tokenizer", str(tokenizer_512), "--chat", "--system", "Be brief.",
                    "-p", "Hi there", "-n", "12", "--temperature", "0", "--dtype", "float32"], tmp_path)
    assert proc.returncode == 0, proc.stderr

    tok = gem4.Tokenizer.from_file(tokenizer_512)
    engine = Engine(gem4.load(fx.hf_causal, dtype="float32"), tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text, result, last, n_prompt = expected_chat(engine, tok, messages, 12)
    assert proc.stdout == text
    assert result.content in proc.stdout
    m = STATS.search(proc.stderr)
    assert m and (int(m.group(1)), int(m.group(3)), m.group(4)) == (n_prompt, last.completion_tokens,
                                                                    last.finish_reason)


def test_chat_session_keeps_history(demo_run):
    cache, _ = demo_run
    script = "Hello there\n/think\nWhat is two plus two?\n/reset\n\n/bogus\nBye now\n/exit\nnever sent\n"
    proc = run_cli(["chat", "--demo", "-n", "10", "--temperature", "0", "--dtype", "float32"], cache, stdin=script)
    assert proc.returncode == 0, proc.stderr

    directory = cache / f"demo-{DEMO_VERSION}"
    tok = gem4.Tokenizer.from_file(directory)
    engine = Engine(gem4.load(directory, dtype="float32"), tok)
    u1, u2, u3 = ({"role": "user", "content": c} for c in ("Hello there", "What is two plus two?", "Bye now"))
    out1, r1, _, _ = expected_chat(engine, tok, [u1], 10)
    out2, r2, _, n2 = expected_chat(engine, tok, [u1, assistant_message(r1), u2], 10, thinking=True)
    out3, _, _, n3 = expected_chat(engine, tok, [u3], 10, thinking=True)     # /reset keeps the /think toggle
    assert r1.content and r2.content
    assert proc.stdout == out1 + out2 + out3
    stats = STATS.findall(proc.stderr)
    assert [int(s[0]) for s in stats][1:] == [n2, n3]
    assert "(thinking on)" in proc.stderr and "(history cleared)" in proc.stderr
    assert "unknown command '/bogus'" in proc.stderr


def test_run_with_speculative_decoding_prints_the_same_text_and_the_acceptance(demo_run):
    cache, _ = demo_run
    args = ["run", "--demo", "-p", "one two three one two three one two three", "-n", "24", "--temperature", "0",
            "--dtype", "float32"]
    plain = run_cli(args, cache)
    spec = run_cli(args + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                                   '"prompt_lookup_min": 1, "prompt_lookup_max": 2}'], cache)
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    m = re.search(r"\| drafts accepted: (\d+)/(\d+) \((\d+)%\)$", spec.stderr.strip().splitlines()[-1])
    assert m and 0 < int(m.group(2)) and int(m.group(1)) <= int(m.group(2))
    assert "drafts accepted" not in plain.stderr


def test_chat_turns_reuse_the_conversation_kv(demo_run):
    """Each turn's prompt begins with the previous turn's tokens: they come from the prefix cache, so only the
    new ones are computed (the stats line says how many were cached)."""
    cache, _ = demo_run
    script = "Hello there\nWhat is two plus two?\nAnd three plus three?\n"
    proc = run_cli(["chat", "--demo", "-n", "6", "--temperature", "0", "--dtype", "float32"], cache, stdin=script)
    assert proc.returncode == 0, proc.stderr
    stats = [(int(p), int(c), int(g)) for p, c, g, _ in STATS.findall(proc.stderr)]
    assert len(stats) == 3 and stats[0][1] == 0
    # the template ends a generation prompt with an empty thought block that the rendered history leaves
    # out: the next turn parts from the cached tokens there (docs/gemma4.md §7.2)
    tok = gem4.Tokenizer.from_file(cache / f"demo-{DEMO_VERSION}")
    first = encode_prompt(tok, [{"role": "user", "content": "Hello there"}], enable_thinking=False)
    empty_thought = tok.encode("<|channel>thought\n<channel|>", add_bos=False)
    assert first[-len(empty_thought):] == empty_thought and len(first) == stats[0][0]
    for (previous, _, _), (_, cached, _) in zip(stats, stats[1:]):
        assert cached == previous - len(empty_thought)       # the previous prompt, to the token


def test_assistant_turn_is_stored_as_parsed_fields():
    result = ParseResult(content="It is 4.", reasoning_content="2+2=4", stop_token_id=106, truncated=False,
                         malformed=False, tool_calls=(ToolCall("call_0", "add", '{"a":2,"b":2}'),))
    message = assistant_message(result)
    assert message == {"role": "assistant", "content": "It is 4.", "reasoning_content": "2+2=4",
                       "tool_calls": [{"id": "call_0", "type": "function",
                                       "function": {"name": "add", "arguments": '{"a":2,"b":2}'}}]}
    plain = assistant_message(ParseResult("Hi", None, (), 106, False, False))
    assert plain == {"role": "assistant", "content": "Hi"}


@pytest.fixture(scope="module")
def mistakes_dir(tmp_path_factory, variants):
    """Files for the mistakes table: a text file, an empty directory, a GGUF of another architecture."""
    from gem4.gguf import GGUFWriter

    d = tmp_path_factory.mktemp("mistakes")
    (d / "notes.txt").write_text("hello, I am not a model\n")
    (d / "empty").mkdir()
    w = GGUFWriter(d / "llama.gguf")
    w.add("general.architecture", "llama")
    w.add("tokenizer.ggml.model", "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32), (4, 8), GGMLType.F32)
    w.write()
    return d


HF = "{hf}"   # the tiny dense checkpoint (no tokenizer beside it)

# (argv, what the one line must say). `{d}` is mistakes_dir. Argument mistakes name a model that would
# load (or none at all): the error must come first, before any loading.
MISTAKES = [
    (["run", "{d}/missing.gguf", "-p", "hi"], "missing.gguf: no such file or directory"),
    (["run", "{d}/notes.txt", "-p", "hi"], "not a GGUF file"),
    (["run", "{d}/empty", "-p", "hi"], "not a model directory"),
    (["run", "{d}/llama.gguf", "-p", "hi"], "the architecture is 'llama'; gem4 runs Gemma 4"),
    (["run", HF, "-p", "hi"], "--tokenizer"),
    (["run", HF, "-p", "hi", "--tokenizer", "{d}/missing.json"], "missing.json: no such file"),
    (["--threads", "0", "run", HF, "-p", "hi"], "argument --threads: must be >= 1, got 0"),
    (["run", HF, "-p", "hi", "--threads", "-2"], "argument --threads: must be >= 1, got -2"),
    (["serve", HF, "--port", "99999"], "argument --port: a port is 0..65535, got 99999"),
    (["run", HF, "-p", "hi", "-n", "-1"], "argument -n/--max-tokens: must be >= 1, got -1"),
    (["run", HF, "-p", "hi", "-n", "ten"], "argument -n/--max-tokens: 'ten' is not an integer"),
    (["run", HF], "no prompt: give PROMPT, -p TEXT"),
    (["run", HF, "hi", "-p", "hello"], "give one prompt, not PROMPT and -p"),
    (["run", HF, "-f", "{d}/missing.txt"], "argument -f: cannot read"),
    (["run", "-p", "hi"], "MODEL is required"),
    (["run", HF, "--demo", "-p", "hi"], "not both"),
    (["run", HF, "-p", "hi", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    (["run", HF, "-p", "hi", "--top-p", "0"], "argument --top-p: must be in (0, 1]"),
    (["run", HF, "-p", "hi", "--repetition-penalty", "nan"], "argument --repetition-penalty:"),
    (["run", HF, "-p", "hi", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["run", HF, "-p", "hi", "--prefill-chunk", "0"], "argument --prefill-chunk: must be >= 1"),
    (["serve", HF, "--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1"),
    (["run", HF, "-p", "hi", "--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 9}}'],
     "argument --speculative-config: num_speculative_tokens must be an integer in [1, 7], got 9"),
    (["serve", HF, "--speculative-config", "{{}}"], "argument --speculative-config: method must be one of ngram, mtp"),
    (["serve", HF, "--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["serve", HF, "--heartbeat-interval", "inf"], "argument --heartbeat-interval: must be a finite number > 0"),
    (["convert", "{d}/missing", "{d}/out.gguf"], "missing: no such file or directory"),
    (["inspect", "{d}/notes.txt"], "not a GGUF file"),
    (["run", HF, "-p", "hi", "--frobnicate"], "gem4 run: error: unrecognized arguments: --frobnicate"),
    (["serve", HF, "--frobnicate", "x"], "gem4 serve: error: unrecognized arguments: --frobnicate x"),
    (["run", HF, "-p", "hi", "--chat-template", "{d}/missing.jinja"],
     "argument --chat-template: no such file: {d}/missing.jinja"),
    (["chat", HF, "--chat-template", "{{% if %}}"], "argument --chat-template: chat template syntax error on line 1"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["serve", HF, "--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: invalid choice: 'fp4'"),
    ([], "the following arguments are required: COMMAND"),
]


@pytest.mark.parametrize("argv, says", MISTAKES, ids=[" ".join(a) or "(nothing)" for a, _ in MISTAKES])
def test_a_mistake_gets_one_line_naming_its_cause(argv, says, mistakes_dir, variants, tmp_path):
    fill = {"d": str(mistakes_dir), "hf": str(variants["dense_plain"].hf_causal)}
    proc = run_cli([a.format(**fill) for a in argv], tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr                   # one line: no traceback, no usage block, no loading
    assert says.format(**fill) in lines[0], lines[0]
    assert lines[0].startswith("gem4")


def test_kv_cache_dtype_choices_are_the_caches_names():
    from gem4.argtypes import KV_CACHE_DTYPE_CHOICES
    from gem4.kv_cache import KV_CACHE_DTYPES

    assert KV_CACHE_DTYPE_CHOICES == tuple(KV_CACHE_DTYPES)


def test_help_shows_defaults_and_version(tmp_path):
    proc = run_cli(["run", "--help"], tmp_path)
    assert proc.returncode == 0
    assert "(default: 256)" in proc.stdout and "(default: auto)" in proc.stdout
    for command in ("run", "chat", "serve"):                   # each option's default said once, never "None"
        proc = run_cli([command, "--help"], tmp_path)
        options = re.split(r"\n  (?=-)", proc.stdout.split("options:", 1)[1])
        assert len(options) > 10
        for option in options:
            text = " ".join(option.split())
            assert text.count("(default") <= 1 and "(default: None)" not in text, f"gem4 {command} --help: {text}"
    proc = run_cli(["--version"], tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"gem4 {gem4.__version__}"
    proc = run_cli(["--version"], tmp_path, command=[sys.executable, "-m", "gem4"])
    assert proc.returncode == 0 and proc.stdout.strip() == f"gem4 {gem4.__version__}"


def test_prompt_from_argument_stdin_and_file(demo_run, tmp_path):
    """PROMPT, -p TEXT, -p - and -f FILE give the same greedy completion of the same text."""
    cache, _ = demo_run
    (tmp_path / "prompt.txt").write_text("the answer is", encoding="utf-8")
    common = ["-n", "6", "--temperature", "0", "--dtype", "float32"]
    outs = []
    for args, stdin in ((["run", "--demo", "the answer is"], None), (["run", "--demo", "-p", "the answer is"], None),
                        (["run", "--demo", "-p", "-"], "the answer is"),
                        (["run", "--demo", "-f", str(tmp_path / "prompt.txt")], None)):
        proc = run_cli(args + common, cache, stdin=stdin)
        assert proc.returncode == 0, proc.stderr
        outs.append((proc.stdout, STATS.search(proc.stderr).group(1)))
    assert len(set(outs)) == 1 and outs[0][0].strip()


def test_inspect_takes_the_demo(demo_run):
    cache, _ = demo_run
    proc = run_cli(["inspect", "--demo", "--json"], cache)
    assert proc.returncode == 0, proc.stderr
    import json

    assert json.loads(proc.stdout)["vocab_size"] == 4096


def test_library_default_is_the_fast_mode(demo_run):
    cache, _ = demo_run
    model = gem4.load(cache / f"demo-{DEMO_VERSION}")
    assert model.dtype == torch.bfloat16
    assert gem4.load(cache / f"demo-{DEMO_VERSION}", dtype="float32").dtype == torch.float32


def test_run_reports_context_overflow(variants, tokenizer_512, capsys):
    args = ["run", str(variants["dense_plain"].hf_causal), "--tokenizer", str(tokenizer_512), "-p", "hi",
            "-n", "5000", "--dtype", "float32"]
    assert main(args) == 2
    assert "exceeds the context length 4096" in capsys.readouterr().err


def test_ctrl_c_stops_the_reply_and_prints_the_stats(demo_run):
    """SIGINT during `gem4 run`: the request is aborted, the text so far and the stats line are printed, exit
    130 -- and no crash of the engine thread at exit (it once ended in 'terminate called', exit 134)."""
    import signal

    cache, _ = demo_run
    for mode in (["--chat"], []):
        env = dict(os.environ, GEM4_CACHE=str(cache))
        proc = subprocess.Popen(gem4_command() + ["run", "--demo", "-p", "hello", "-n", "4000"] + mode,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            first = proc.stdout.read(64)                      # generation is under way
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        err = err.decode(errors="replace")
        assert proc.returncode == 130, err
        assert "terminate called" not in err and "Traceback" not in err, err
        stats = re.search(r"prompt: \d+ tokens, \d+ cached, [\d.]+ tok/s \| generated: (\d+) tokens.* \| finish: abort",
                          err)
        assert stats, err
        assert 0 < int(stats.group(1)) < 4000 and len(first + out) > 0


def test_a_closed_pipe_ends_quietly(demo_run):
    """`gem4 inspect --json | head`: the reader went away; no 'Broken pipe' error, exit 141 (128 + SIGPIPE)."""
    cache, _ = demo_run
    env = dict(os.environ, GEM4_CACHE=str(cache))
    proc = subprocess.Popen(gem4_command() + ["inspect", "--demo", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()                                       # before gem4 writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "error" not in err and "Broken pipe" not in err, err


class _ScriptedEngine:
    """What _stream_chat uses of an Engine, replying with fixed ids: `generate` and `abort`."""

    def __init__(self, ids: list[int]):
        self.ids, self.aborted = ids, []

    @contextlib.contextmanager
    def generate(self, prompt_ids, params, media=()):
        engine = self

        class Events:
            request_id = "req-1"

            def __iter__(self):
                stats = RequestStats(len(prompt_ids), 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0)
                for n, tid in enumerate(engine.ids, 1):
                    if engine.aborted:
                        yield GenerationEvent("req-1", None, "", "abort", None, len(prompt_ids), n - 1,
                                              stats=dataclasses.replace(stats, completion_tokens=n - 1))
                        return
                    last = n == len(engine.ids)
                    yield GenerationEvent("req-1", tid, "", "length" if last else None, None, len(prompt_ids), n,
                                          stats=dataclasses.replace(stats, completion_tokens=n) if last else None)

        yield Events()

    def abort(self, request_id):
        self.aborted.append(request_id)
        return True


def test_chat_stops_the_engine_where_the_reply_runs_into_a_new_turn(demo_run):
    """A reply that runs on into a new turn (`<|turn>`, which the engine does not stop at) ends there: the
    engine's request is aborted at once instead of generating unread to max_tokens, and the finish says stop;
    with ignore_eos the parser reads on, as the server's output does."""
    cache, _ = demo_run
    tok = gem4.Tokenizer.from_file(cache / f"demo-{DEMO_VERSION}")
    ids = tok.encode("Here it is.", add_bos=False) + [105] + tok.encode("user\nAnd more text here", add_bos=False)
    engine = _ScriptedEngine(ids)
    out = io.StringIO()
    result, last, interrupted = _stream_chat(engine, tok, [2], SamplingParams(max_tokens=64), out)
    assert (result.content, out.getvalue().strip(), last.finish_reason, interrupted) == \
        ("Here it is.", "Here it is.", "stop", False)
    assert engine.aborted == ["req-1"] and last.completion_tokens < len(ids)
    engine = _ScriptedEngine(ids)
    result, last, _ = _stream_chat(engine, tok, [2], SamplingParams(max_tokens=64, ignore_eos=True), io.StringIO())
    assert not engine.aborted and last.finish_reason == "length" and "And more text" in result.content
