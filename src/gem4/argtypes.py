"""Argument parsing shared by `gem4` and `gem4 serve`: one-line errors, defaults in --help, typed numbers.

A mistake in the arguments ends the command before anything loads, with exit code 2 and one line on
stderr: `gem4 run: error: argument --threads: must be >= 1, got 0 (see gem4 run --help)`.
"""
from __future__ import annotations

import argparse
import math


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help once: not when the help already says its default in words
    ("(default: one per core)"), and not for a default of None or a flag's False, which say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


class ArgParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and every default shown in --help.

    Sub-parsers made by `add_subparsers().add_parser` are of this class too.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(low: int):
    """An argparse type: an integer >= low."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (pick a free one) to 65535."""
    value = int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def speculative_config(text: str):
    """--speculative-config: vLLM's JSON object, checked (gem4.engine.speculative.SpeculativeConfig)."""
    from gem4.engine.speculative import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("speculative config: ")) from None


def chat_template(text: str) -> str:
    """--chat-template: a Jinja file, or the template itself (vLLM's rule: text with a brace or a newline
    that is not a file is a template); checked to compile."""
    from pathlib import Path

    path = Path(text)
    try:
        source = path.read_text(encoding="utf-8") if path.is_file() else None
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {getattr(e, 'strerror', None) or e}") from None
    if source is None:
        if not any(c in text for c in "{}\n"):
            raise argparse.ArgumentTypeError(f"no such file: {text} (an inline template holds '{{{{' or '{{%')")
        source = text
    from gem4.chat import ChatTemplateError, check_template

    try:
        check_template(source)
    except ChatTemplateError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return source


CHAT_TEMPLATE_HELP = ("a Jinja chat template file (or the template itself) to use instead of the checkpoint's "
                      "(default: the checkpoint's own, else the official Gemma 4 template)")
MMPROJ_HELP = ("llama.cpp's mmproj GGUF: the vision tower (and E2B/E4B's audio tower) for a GGUF MODEL (as "
               "llama-server --mmproj; an HF directory carries its towers itself)")
SPECULATIVE_HELP = ('speculative decoding, vLLM\'s form: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                    '(prompt lookup; "prompt_lookup_max" / "_min" optional) or \'{"method": "mtp", "model": '
                    'ASSISTANT, "num_speculative_tokens": 4}\' (the Gemma 4 assistant: an HF directory or GGUF)')
# --kv-cache-dtype's choices: kv_cache.KV_CACHE_DTYPES's names (written here too so that parsing the arguments
# imports no torch; tests/test_cli.py checks that the two agree)
KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "fp8_e4m3", "int8")
KV_CACHE_DTYPE_HELP = ("what the KV cache stores (vLLM's flag): auto = the model's dtype (bf16 in the fast mode); "
                       "int8 (a float32 scale per position and KV head) and fp8_e4m3 take half the bytes of bf16, "
                       "so twice the tokens fit in the same memory, at a small measured drift (docs/fast-mode.md)")
EXPERT_SLOTS_HELP = ("26B-A4B from a GGUF: keep N routed experts per layer in slots read from the file on demand "
                     "(LFU; N >= the model's top_k) instead of the whole file in memory")
MEMORY_LIMIT_HELP = ("26B-A4B from a GGUF: keep the process within this many GB (1e9 bytes) -- runtime, resident "
                     "weights, 1 GB of working memory and as many expert slots per layer as fit; a long "
                     "context's KV cache comes on top")


def check_model_or_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Exactly one of MODEL and --demo."""
    if args.demo == (args.model is not None):
        parser.error("give a MODEL (a .gguf file or an HF directory) or --demo, not both" if args.demo
                     else "MODEL is required (a .gguf file or an HF directory), or use --demo")
