"""`gem4` command line: parses arguments into calls; the work lives in the rooms it calls."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def cmd_inspect(args: argparse.Namespace) -> int:
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.summary import format_summary, summarize

    summary = summarize(open_checkpoint(args.model))
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf

    counts = write_gguf(open_checkpoint(args.hf_dir), Path(args.out), args.type)
    print(f"wrote {args.out}: " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items())))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gem4", description="Gemma 4 inference engine")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="describe a checkpoint (.gguf file or HF directory)")
    p.add_argument("model")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("convert", help="write an HF checkpoint as a llama.cpp-compatible GGUF")
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--type", default="bf16", choices=["f32", "f16", "bf16", "q8_0", "q4_0"])
    p.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from gem4.weights.checkpoint import CheckpointError

    try:
        return args.func(args)
    except (CheckpointError, ValueError) as e:
        print(f"gem4: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
