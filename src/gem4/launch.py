"""From the options that every generating command shares (`gem4 run`, `gem4 chat`, `gem4 serve`) to a
loaded Engine: one place, so the CLI and the server load a model the same way."""
from __future__ import annotations

import argparse
from collections.abc import Callable


def open_engine(args: argparse.Namespace, path: str, log: Callable[[str], None], **engine_options):
    """-> a gem4.Engine over the checkpoint at `path` with a load progress bar on stderr.

    From `args`: --tokenizer, --mmproj, --dtype, --device (serve), --chat-template, --expert-cache-slots,
    --memory-limit, --prefill-chunk, --speculative-config, --enable-prefix-caching, --kv-cache-dtype. `engine_options` are
    passed to the Engine as they are (the server's batching and pool sizes). Errors name the real cause
    first (weights.loader.load_with_tokenizer); a checkpoint without a tokenizer says how to give one.
    """
    from gem4.engine import Engine
    from gem4.weights.expert_stream import expert_cache_summary
    from gem4.tokenizer import TokenizerError
    from gem4.weights.loader import load_with_tokenizer

    try:
        model, tokenizer = load_with_tokenizer(path, args.tokenizer, dtype=args.dtype,
                                               device=getattr(args, "device", "cpu"), progress=True,
                                               expert_cache_slots=args.expert_cache_slots,
                                               memory_limit=args.memory_limit, mmproj=args.mmproj)
    except TokenizerError as e:
        hint = "" if args.tokenizer else " (MODEL carries no usable tokenizer: pass --tokenizer PATH, a GGUF " \
                                         "file, an HF directory or a tokenizer.json)"
        raise ValueError(f"{e}{hint}") from None
    if args.chat_template is not None:                 # --chat-template replaces the checkpoint's
        tokenizer.chat_template = args.chat_template
    if model.expert_cache is not None:
        log(expert_cache_summary(model.expert_cache))
    return Engine(model, tokenizer, prefill_chunk=args.prefill_chunk, speculative_config=args.speculative_config,
                       enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                       **engine_options)
