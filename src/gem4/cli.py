"""`gem4` command line: parses arguments into calls; the work lives in the rooms it calls.

    gem4 run MODEL -p PROMPT [-n N] [sampling] [--chat [--system TEXT] [--think]]   stream a completion
    gem4 run MODEL --image PATH --audio PATH --video PATH -p PROMPT   the same about images, clips, videos (chat)
    gem4 run --demo -p PROMPT                 the same on a tiny random-weight checkpoint (no download)
    gem4 chat MODEL | --demo                  interactive multi-turn chat (/image, /audio, /think, /reset, /exit)
    gem4 inspect MODEL | gem4 convert HF_DIR OUT.gguf | gem4 pull OWNER/NAME[:QUANT]
    gem4 doctor                               which compiled CPU kernels are active, and why

Generated text goes to stdout as it is produced; loading progress, notices and the stats line go to
stderr. With --chat / in `chat`, thinking is shown apart from the answer: between `[thinking]` and
`[/thinking]` lines (dimmed on a terminal).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

from gem4.argtypes import (CHAT_TEMPLATE_HELP, EXPERT_SLOTS_HELP, KV_CACHE_DTYPE_CHOICES, KV_CACHE_DTYPE_HELP,
                           MEMORY_LIMIT_HELP, MMPROJ_HELP, SPECULATIVE_HELP, ArgParser,
                           chat_template, check_model_or_demo, int_at_least, positive_float, speculative_config)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# inspect / convert
# ---------------------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    import torch

    from gem4.kv_cache import kv_cache_dtype
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.summary import format_summary, summarize

    kv = kv_cache_dtype(args.kv_cache_dtype, torch.bfloat16)      # "auto": the fast mode's bf16
    summary = summarize(open_checkpoint(_model_path(args), args.mmproj), kv)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf

    ckpt = open_checkpoint(args.hf_dir)
    towers = "vision" in ckpt.tower_configs     # llama.cpp's layout: the towers (vision, and audio where there is
    if towers:                                  # one) in a second file (weights/mmproj.py)
        from gem4.weights.mmproj import check_writable, mmproj_type, write_mmproj

        check_writable(ckpt)                    # refused before the text GGUF is written, not after
    counts = write_gguf(ckpt, Path(args.out), args.type)
    print(f"wrote {args.out}: " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items())))
    if towers:
        out = Path(args.mmproj) if args.mmproj else Path(args.out).with_name(f"mmproj-{Path(args.out).name}")
        counts = write_mmproj(ckpt, out, args.type)
        print(f"wrote {out} ({mmproj_type(args.type)}): " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items())))
    elif args.mmproj:
        raise ValueError(f"--mmproj {args.mmproj}: {args.hf_dir} has no vision tower to write")
    else:
        from gem4.weights.audio import checkpoint_audio

        if checkpoint_audio(ckpt) is not None:
            log("note: the audio tower is not written: llama.cpp's mmproj holds Gemma 4's audio tower beside its "
                "vision tower, and this checkpoint has none; load the HF directory to use it")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from gem4.weights.hub import pull

    print(pull(args.model, log))
    return 0


# ---------------------------------------------------------------------------------------------
# run / chat: shared setup
# ---------------------------------------------------------------------------------------------


def _model_path(args: argparse.Namespace) -> str:
    """MODEL, or the demo checkpoint (built once) with --demo."""
    if args.demo:
        from gem4.demo import NOTICE, ensure_demo

        log(NOTICE)
        return str(ensure_demo(log))
    from gem4.weights.hub import resolve

    return str(resolve(args.model, log))           # a local path as is; owner/name[:TAG] from the hub


def _open(args: argparse.Namespace):
    """-> (Engine, Tokenizer) for MODEL or --demo (gem4.launch.open_engine)."""
    from gem4.launch import open_engine

    engine = open_engine(args, _model_path(args), log)
    return engine, engine.tokenizer


@contextlib.contextmanager
def _ctrl_c_aborts(events):
    """While a reply streams, the first Ctrl-C (SIGINT) aborts its request instead of raising: the engine
    ends it within one step with its final "abort" event, so the text so far and the stats still come;
    a second Ctrl-C raises KeyboardInterrupt. Yields a function that says whether Ctrl-C was pressed.
    (Signal handlers belong to the main thread; elsewhere Ctrl-C is left as it is.)"""
    pressed: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: bool(pressed)
        return

    def on_sigint(signum, frame):
        if pressed:
            raise KeyboardInterrupt
        pressed.append(signum)
        events.close()                                # Engine.abort: a flag the engine reads between steps

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)


def _params(args: argparse.Namespace, max_tokens: int | None):
    from gem4.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=max_tokens,
                          stop=tuple(args.stop or ()))


def _stats_line(event, expert_cache=None) -> str:
    s = event.stats
    drafts = (f" | drafts accepted: {s.accepted_tokens}/{s.draft_tokens} ({100 * s.accepted_tokens / s.draft_tokens:.0f}%)"
              if s.draft_tokens else "")
    if expert_cache is not None:                       # streamed experts: the process's totals so far
        c = expert_cache.stats
        drafts += (f" | experts: {c.hits} hits, {c.misses} misses "
                   f"({100 * c.hits / max(c.hits + c.misses, 1):.0f}% hit), {c.bytes_read / 1e9:.2f} GB read")
    return (f"prompt: {s.prompt_tokens} tokens, {s.cached_tokens} cached, {s.prompt_tps:.1f} tok/s | generated: "
            f"{s.completion_tokens} tokens, {s.generation_tps:.1f} tok/s | TTFT: {s.ttft_s * 1000:.0f} ms | "
            f"finish: {event.finish_reason}{drafts}")


class ChatPrinter:
    """Writes parser events to a text stream: reasoning between [thinking] lines (dim on a terminal),
    content as is, tool calls as `[tool call] name {json}`."""

    DIM, RESET = "\x1b[2m", "\x1b[0m"

    def __init__(self, out):
        self.out = out
        self.tty = out.isatty()
        self.in_thought = False
        self.at_line_start = True

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.at_line_start = text.endswith("\n")
            self.out.flush()

    def _newline(self) -> None:
        if not self.at_line_start:
            self._write("\n")

    def _end_thought(self) -> None:
        if self.in_thought:
            self._write(self.RESET if self.tty else "")
            self._newline()
            self._write("[/thinking]\n")
            self.in_thought = False

    def events(self, events) -> None:
        from gem4.parser import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

        for ev in events:
            if isinstance(ev, ReasoningDelta):
                if not self.in_thought:
                    self._newline()
                    self._write("[thinking]\n" + (self.DIM if self.tty else ""))
                    self.in_thought = True
                self._write(ev.text)
                continue
            self._end_thought()
            if isinstance(ev, ContentDelta):
                self._write(ev.text)
            elif isinstance(ev, ToolCallStart):
                self._newline()
                self._write(f"[tool call] {ev.name} ")
            elif isinstance(ev, ToolCallArgsDelta):
                self._write(ev.text)
            elif isinstance(ev, ToolCallEnd):
                self._write("\n")

    def close(self) -> None:
        self._end_thought()
        self._newline()


def _stream_chat(engine, tokenizer, prompt_ids: list[int], params, out, media=()):
    """Generate from a rendered chat prompt (and its media, engine/media.py), printing parsed output.
    -> (ParseResult, final event, whether Ctrl-C stopped it)."""
    from gem4.parser import Gemma4Parser, Mode

    parser = Gemma4Parser(tokenizer, prompt_ids=prompt_ids, ignore_eos=params.goes_past_end)
    printer = ChatPrinter(out)
    last, ended = None, False
    with engine.generate(prompt_ids, params, media=media) as events, _ctrl_c_aborts(events) as interrupted:
        try:
            for last in events:
                if last.token_id is not None and not ended:
                    printer.events(parser.feed([last.token_id]))
                    if parser.mode is Mode.DONE and not last.finished:
                        ended = True                  # an end the engine does not stop at (a new turn): stop it
                        engine.abort(events.request_id)
        finally:
            printer.events(parser.finish())
            printer.close()
    if ended and last is not None and last.finish_reason == "abort" and not interrupted():
        last = dataclasses.replace(last, finish_reason="stop")     # the reply ended, as the server says
    return parser.result, last, interrupted()


def _reconfigure_stdout() -> None:
    try:
        sys.stdout.reconfigure(errors="replace")   # random demo text may hold anything
    except (AttributeError, ValueError):
        pass


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from gem4.chat import encode_prompt

    _reconfigure_stdout()
    engine, tokenizer = _open(args)
    params = _params(args, args.max_tokens)
    with engine:                                       # on the way out the engine thread has ended
        items = _media_files(engine.model, args.media)
        if args.chat or args.system is not None or items:
            from gem4.engine.media import media_prompt

            messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
            content = [{"type": kind} for kind, _ in args.media] + [{"type": "text", "text": args.prompt}]
            messages.append({"role": "user", "content": content if items else args.prompt})
            ids = encode_prompt(tokenizer, messages, enable_thinking=args.think)
            ids, media = media_prompt(ids, items, vision=getattr(engine.model.vision, "config", None),
                                      audio=getattr(engine.model.audio, "config", None),
                                      tokenize=lambda text: tokenizer.encode(text, add_bos=False))
            _, last, interrupted = _stream_chat(engine, tokenizer, ids, params, sys.stdout, media)
        else:
            last = None
            wrote = ""
            with engine.generate(args.prompt, params) as events, _ctrl_c_aborts(events) as pressed:
                for last in events:
                    if last.text:
                        sys.stdout.write(last.text)
                        sys.stdout.flush()
                        wrote = last.text
            interrupted = pressed()
            if not wrote.endswith("\n"):
                sys.stdout.write("\n")
            sys.stdout.flush()
    log(_stats_line(last, engine.model.expert_cache))
    return 130 if interrupted else 0                   # 128 + SIGINT, as a shell reports an interrupted command


class _MediaFile(argparse.Action):
    """--image PATH / --audio PATH / --video PATH: (kind, PATH) appended to args.media, in the order given."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, [*getattr(namespace, self.dest), (self.const, value)])


def _media_files(model, files: list[tuple[str, str]], flag: str = "--") -> list:
    """`gem4 run`'s --image, --audio and --video files (`gem4 chat`'s /image and /audio: flag "/"), read and
    preprocessed as the server does (images at the default budget of 280 soft tokens, video frames at 70);
    ValueError naming the file when one cannot be used or the model lacks its tower."""
    from gem4.engine.media import check_fits
    from gem4.media.audio import decode_audio
    from gem4.media.image import DEFAULT_BUDGET, decode, preprocess
    from gem4.media.video import decode as decode_video

    items = []
    for kind, path in files:
        tower = model.audio if kind == "audio" else model.vision
        if tower is None:
            raise ValueError(f"{flag}{kind} {path}: this model has no {'audio' if kind == 'audio' else 'vision'} tower")
        if kind == "video" and tower.config.video_token_id is None:
            raise ValueError(f"{flag}{kind} {path}: this model takes no video (its config has no video_token_id)")
        data = Path(path).read_bytes()
        try:
            if kind == "image":
                items.append(preprocess(decode(data), DEFAULT_BUDGET, patch_size=tower.config.patch_size,
                                        pooling=tower.config.pooling, processor=tower.config.image_processor))
                check_fits(items[-1], tower.config)
            elif kind == "video":
                items.append(decode_video(data, patch_size=tower.config.patch_size, pooling=tower.config.pooling))
                for frame in items[-1].frames:
                    check_fits(frame.patches, tower.config)
            else:
                items.append(decode_audio(data))
        except ValueError as e:
            raise ValueError(f"{flag}{kind} {path}: {e}") from None
    return items


# ---------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------

CHAT_HELP = ("commands: /image PATH and /audio PATH attach a file to the next message, /think toggles thinking, "
             "/reset clears the history, /exit quits (also Ctrl-D)")


def assistant_message(result) -> dict:
    """The assistant turn to keep in the history: parsed content, reasoning and tool calls."""
    message: dict = {"role": "assistant", "content": result.content}
    if result.reasoning_content:
        message["reasoning_content"] = result.reasoning_content
    if result.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in result.tool_calls]
    return message


def cmd_chat(args: argparse.Namespace) -> int:
    _reconfigure_stdout()
    engine, tokenizer = _open(args)
    with engine:                                       # on the way out the engine thread has ended
        return _chat_loop(args, engine, tokenizer)


def _chat_loop(args: argparse.Namespace, engine, tokenizer) -> int:
    from gem4.chat import encode_prompt
    from gem4.engine.media import media_prompt
    from gem4.repl import turn_reader

    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    history: list[dict] = list(system)
    items: list = []                                   # the history's images and clips, in order
    attached: list[tuple[str, object]] = []            # (kind, item) for the next message
    thinking = args.think
    reader = turn_reader()                             # line editor on a terminal, plain lines from a pipe
    log(CHAT_HELP + (f"; {reader.help}" if reader.help else "") + f" (thinking {'on' if thinking else 'off'})")
    while True:
        line = reader.read()
        if line is None:                               # end of input (Ctrl-D)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history, items, attached = list(system), [], []
            log("(history cleared)")
            continue
        if text.split()[0] in ("/image", "/audio"):
            kind, _, path = text[1:].partition(" ")
            try:
                if not path.strip():
                    raise ValueError(f"/{kind} needs a PATH")
                attached += [(kind, item) for item in _media_files(engine.model, [(kind, path.strip())], "/")]
                log(f"({kind} {path.strip()} attached to the next message)")
            except (ValueError, OSError) as e:
                log(f"gem4: error: {e}")
            continue
        if text == "/think":
            thinking = not thinking
            log(f"(thinking {'on' if thinking else 'off'})")
            continue
        if text.startswith("/"):
            log(f"unknown command {text.split()[0]!r}; " + CHAT_HELP)
            continue
        content = [{"type": kind} for kind, _ in attached] + [{"type": "text", "text": text}]
        turn = history + [{"role": "user", "content": content if attached else text}]
        try:
            ids = encode_prompt(tokenizer, turn, enable_thinking=thinking)
            ids, media = media_prompt(ids, items + [item for _, item in attached],
                                      vision=getattr(engine.model.vision, "config", None),
                                      audio=getattr(engine.model.audio, "config", None))
            room = engine.max_model_len - len(ids)
            if room < 1:
                raise ValueError(f"the conversation has {len(ids)} tokens and fills the context of "
                                 f"{engine.max_model_len}: /reset")
            with reader.replying():                    # keys typed during the reply are dropped
                result, last, interrupted = _stream_chat(engine, tokenizer, ids,
                                                         _params(args, min(args.max_tokens, room)), sys.stdout, media)
        except ValueError as e:                        # this turn cannot run; the session goes on
            log(f"gem4: error: {e}")
            continue
        except KeyboardInterrupt:                      # a second Ctrl-C: the request was aborted on the way out
            interrupted = True
        if interrupted:                                # Ctrl-C stopped the reply: the turn is not kept
            log("(interrupted)")
            continue
        history = turn + [assistant_message(result)]
        items, attached = items + [item for _, item in attached], []
        log(_stats_line(last, engine.model.expert_cache))


def cmd_serve(args: argparse.Namespace) -> int:
    from gem4.server import serve

    return serve(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Which compiled kernels are active and why (the facts come from gem4.model.kernels.describe)."""
    from gem4.model import kernels

    info = kernels.describe()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {(' '.join(value) or '(none)') if isinstance(value, list) else value}")
    return 0


# ---------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------


def _model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="a .gguf file, an HF checkpoint directory or a hub id owner/name[:QUANT]")
    p.add_argument("--demo", action="store_true",
                   help="use a tiny random-weight demo checkpoint (built once into $GEM4_CACHE or ~/.cache/gem4)")


def _generation_options() -> argparse.ArgumentParser:
    g = ArgParser(add_help=False)
    g.add_argument("--tokenizer", help="tokenizer file or directory, if MODEL does not carry one")
    g.add_argument("--mmproj", metavar="FILE", help=MMPROJ_HELP)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto = bfloat16, the fast mode; float32 is the reference mode")
    g.add_argument("--threads", type=int_at_least(1), default=argparse.SUPPRESS,
                   help="torch intra-op threads (default: one per core)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=64, help="0 = off")
    g.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=None, help="same seed, same output")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--system", default=None, help="system prompt (implies --chat for run)")
    g.add_argument("--think", action="store_true", help="enable thinking in the chat template")
    g.add_argument("--chat-template", type=chat_template, default=None, metavar="FILE", help=CHAT_TEMPLATE_HELP)
    g.add_argument("--prefill-chunk", type=int_at_least(1), default=256, help="prompt tokens per forward pass")
    g.add_argument("--expert-cache-slots", type=int_at_least(1), default=None, metavar="N", help=EXPERT_SLOTS_HELP)
    g.add_argument("--memory-limit", type=positive_float, default=None, metavar="GB", help=MEMORY_LIMIT_HELP)
    g.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON", help=SPECULATIVE_HELP)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of the longest cached prefix (chat: the conversation so far)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES, help=KV_CACHE_DTYPE_HELP)
    return g


def build_parser() -> argparse.ArgumentParser:
    from gem4 import __version__

    parser = ArgParser(prog="gem4", description="Gemma 4 inference engine and OpenAI-compatible server")
    parser.add_argument("--version", action="version", version=f"gem4 {__version__}")
    parser.add_argument("--threads", type=int_at_least(1), default=None,
                        help="torch intra-op threads (default: one per core)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = _generation_options()

    p = sub.add_parser("run", parents=[gen], help="generate a completion for one prompt, streamed to stdout",
                       description="Generate a completion for one prompt. The prompt is PROMPT, -p TEXT, "
                                   "-p - (standard input) or -f FILE.")
    _model_arguments(p)
    p.add_argument("prompt_arg", nargs="?", metavar="PROMPT", help="the prompt (or use -p / -f)")
    p.add_argument("-p", "--prompt", help="the prompt; '-' reads it from standard input")
    p.add_argument("-f", "--file", help="read the prompt from this file")
    p.add_argument("-n", "--max-tokens", type=int_at_least(1), default=256, help="tokens to generate at most")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template; parse the answer")
    for kind, what in (("image", "an image (any format Pillow reads)"),
                       ("audio", "an audio clip (WAV, FLAC, OGG, MP3, M4A, WebM, ...)"),
                       ("video", "a video (any format PyAV's FFmpeg reads; up to 32 frames are seen)")):
        p.add_argument(f"--{kind}", dest="media", action=_MediaFile, const=kind, default=[], metavar="PATH",
                       help=f"{what} before the prompt, in the order given (repeatable; implies --chat)")
    p.set_defaults(func=cmd_run, command_parser=p)

    p = sub.add_parser("chat", parents=[gen], help="interactive multi-turn chat on stdin/stdout")
    _model_arguments(p)
    p.add_argument("-n", "--max-tokens", type=int_at_least(1), default=1024, help="tokens per reply at most")
    p.set_defaults(func=cmd_chat, command_parser=p)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (loopback by default)")
    from gem4.server.main import add_arguments as add_serve_arguments

    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve, command_parser=p)

    p = sub.add_parser("inspect", help="describe a checkpoint (.gguf file or HF directory) and its towers")
    _model_arguments(p)
    p.add_argument("--mmproj", metavar="FILE", help=MMPROJ_HELP)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="the KV cache dtype whose bytes per token to show (auto: bfloat16, the fast mode's)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect, command_parser=p)

    p = sub.add_parser("convert", help="write an HF checkpoint as a llama.cpp-compatible GGUF")
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--type", default="bf16",
                   choices=["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m"],
                   help="tensor type; q4_k_m / q5_k_m: llama.cpp's mixes (token tables, some attn_v and ffn_down in Q6_K)")
    p.add_argument("--mmproj", metavar="OUT", default=None,
                   help="where the towers go (vision, and audio on E2B/E4B), as llama.cpp's mmproj GGUF (default: "
                        "mmproj-<OUT's name> beside OUT; its type is --type, q8_0 for the 4- to 6-bit types)")
    p.set_defaults(func=cmd_convert, command_parser=p)

    p = sub.add_parser("pull", help="download a model from a Hugging Face hub; print its local path")
    p.add_argument("model", metavar="REPO[:TAG]", help="owner/name (HF checkpoint) or owner/name:QUANT (a GGUF)")
    p.set_defaults(func=cmd_pull, command_parser=p)

    p = sub.add_parser("doctor", help="which compiled CPU kernels are active and why (builds them if needed)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor, command_parser=p)
    return parser


def _read_prompt(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """`gem4 run`'s prompt from exactly one of PROMPT, -p TEXT, -p - (stdin) and -f FILE."""
    given = [(name, value) for name, value in (("PROMPT", args.prompt_arg), ("-p", args.prompt), ("-f", args.file))
             if value is not None]
    if not given:
        parser.error("no prompt: give PROMPT, -p TEXT, -p - (standard input) or -f FILE")
    if len(given) > 1:
        parser.error(f"give one prompt, not {' and '.join(name for name, _ in given)}")
    name, value = given[0]
    if name == "-p" and value == "-":
        return sys.stdin.read()
    if name == "-f":
        try:
            return Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"argument -f: cannot read {value}: {getattr(e, 'strerror', None) or e}")
    return value


def _check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Mistakes in the arguments, caught before anything loads (each a one-line argparse error)."""
    if (args.command == "run" and args.demo and args.model is not None
            and args.prompt_arg is args.prompt is args.file is None):
        args.model, args.prompt_arg = None, args.model       # `gem4 run --demo "a prompt"`
    if "demo" in args:
        check_model_or_demo(args, parser)
    if args.command == "run":
        args.prompt = _read_prompt(args, parser)
    if "temperature" in args:                               # the sampler's own checks, before loading
        try:
            _params(args, getattr(args, "max_tokens", None))
        except ValueError as e:
            parser.error(_flag_message(str(e)))


def _flag_message(message: str) -> str:
    """'SamplingParams.top_k: ...' -> 'argument --top-k: ...' (the CLI's name for the field)."""
    m = re.match(r"SamplingParams\.(\w+): (.*)", message, re.S)
    return f"argument --{m.group(1).replace('_', '-')}: {m.group(2)}" if m else message


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:                                     # named by the command they were given to
            args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
        _check_arguments(args, args.command_parser)
        args.argv = list(sys.argv[1:] if argv is None else argv)   # `serve --data-parallel-size` passes it on
    except SystemExit as e:                           # --help, --version, or a one-line argument error
        return e.code
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from gem4.weights.checkpoint import CheckpointError

    try:
        return args.func(args)
    except BrokenPipeError:                           # `gem4 inspect --json | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit's flush
        return 141                                    # 128 + SIGPIPE, what a shell reports for such a writer
    except (CheckpointError, ValueError, OSError) as e:
        print(f"gem4: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
