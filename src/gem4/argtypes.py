"""Argument parsing shared by `gem4` and `gem4 serve`: one-line errors, defaults in --help, typed numbers.

A mistake in the arguments ends the command before anything loads, with exit code 2 and one line on
stderr: `gem4 run: error: argument --threads: must be >= 1, got 0 (see gem4 run --help)`.
"""
from __future__ import annotations

import argparse
import math


class ArgParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and every default shown in --help.

    Sub-parsers made by `add_subparsers().add_parser` are of this class too.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
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


def speculative_config(text: str):
    """--speculative-config: vLLM's JSON object, checked (gem4.engine.speculative.SpeculativeConfig)."""
    from gem4.engine.speculative import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("speculative config: ")) from None


SPECULATIVE_HELP = ('speculative decoding, vLLM\'s form: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                    '(prompt lookup; "prompt_lookup_max" / "_min" optional) or \'{"method": "mtp", "model": '
                    'ASSISTANT, "num_speculative_tokens": 4}\' (the Gemma 4 assistant: an HF directory or GGUF)')
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
