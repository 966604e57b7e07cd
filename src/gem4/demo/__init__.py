"""A tiny random-weight Gemma 4 checkpoint, so `gem4 run --demo` works on a fresh machine.

`ensure_demo()` builds it once into `$GEM4_CACHE/demo-<DEMO_VERSION>` (default cache:
`~/.cache/gem4`) and returns the directory, an ordinary HF checkpoint that `gem4.load` and
`Tokenizer.from_file` read:

    config.json          a Gemma 4 text config (dense: 3 sliding layers + 1 full, hidden 128)
    model.safetensors    seeded random weights (bf16), `model.`-prefixed names
    tokenizer.json       a 4096-token subset of the real Gemma 4 vocabulary (below)
    tokenizer_config.json  special token names: every CONTROL token of the vocabulary

No transformers at run time: the parameter names and shapes come from `gem4.model.gemma4.Model`
built on the meta device from the same ModelConfig the loader will derive from config.json.

The tokenizer (`vocab.json`, derived once by `derive_vocab` from llama.cpp's vocab-only
`ggml-vocab-gemma-4.gguf`, MIT) keeps Gemma 4's special and structural tokens and the 256 byte
tokens at their real ids (0-493), then the next real tokens in id order (ids 494-3963 are real
ids too), then the most frequent single characters (real ids >= 236743, renumbered), with every
BPE merge that stays inside the subset. Every token keeps its real type (CONTROL, USER_DEFINED, BYTE,
NORMAL; tests/test_demo.py compares them with the GGUF), so any text encodes (byte fallback), chat
templates and the output parser work unchanged; the model's output is random text.
"""
from __future__ import annotations

import json
import os
import shutil
import string
import tempfile
from functools import lru_cache
from pathlib import Path

from gem4.paths import cache_root

# The cache key of a built demo (`$GEM4_CACHE/demo-<DEMO_VERSION>`): bump it whenever what
# `build_demo` writes changes, so that a checkpoint built by an older gem4 is not reused.
# 2: tokenizer_config.json names every CONTROL token (in 1, <turn|> and four more read as text).
DEMO_VERSION = "2"
VOCAB_FILE = Path(__file__).with_name("vocab.json")
SEED = 20250405
NOTICE = ("gem4 --demo: a tiny Gemma 4-shaped model with RANDOM weights and a 4096-token subset of the "
          "Gemma 4 vocabulary. Its output is random text; use it to check the install, not the model.")

SLIDING, FULL = "sliding_attention", "full_attention"


def demo_config(vocab_size: int) -> dict:
    """config.json of the demo model, in the form `gem4.weights.hf` reads (transformers' Gemma4TextConfig keys)."""
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": [SLIDING, SLIDING, SLIDING, FULL],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "global_head_dim": 64,
        "sliding_window": 128,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "attention_k_eq_v": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "gem4_demo": {"version": DEMO_VERSION, "seed": SEED, "random_weights": True},
    }


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _vocab() -> dict:
    with open(VOCAB_FILE, encoding="utf-8") as f:
        return json.load(f)


def demo_tokenizer(vocab_size: int | None = None):
    """The demo tokenizer, or its first `vocab_size` ids (>= 494 keeps every special and byte token)."""
    from gem4.tokenizer import Tokenizer

    v = _vocab()
    n = len(v["tokens"]) if vocab_size is None else vocab_size
    if not 494 <= n <= len(v["tokens"]):
        raise ValueError(f"demo tokenizer size must be in [494, {len(v['tokens'])}], got {n}")
    tokens = v["tokens"][:n]
    kept = set(tokens)
    merges = [m for m in v["merges"] if _merge_inside(m, kept)]
    return Tokenizer(tokens, v["types"][:n], merges, bos_id=2, eos_id=1, pad_id=0, unk_id=3, mask_id=4,
                     add_bos=True, source=f"gem4 demo vocabulary ({n} tokens)")


def _merge_inside(merge: str, kept: set[str]) -> bool:
    cut = merge.find(" ", 1)            # tokens never contain ' ' (spaces are spelled '▁')
    a, b = merge[:cut], merge[cut + 1:]
    return a in kept and b in kept and a + b in kept


def write_tokenizer(directory: str | os.PathLike, vocab_size: int | None = None) -> Path:
    """Write tokenizer.json + tokenizer_config.json (HF form, read by `Tokenizer.from_file(directory)`)."""
    from gem4.tokenizer import TokenType

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = demo_tokenizer(vocab_size)
    tok.backend.save(str(directory / "tokenizer.json"))
    config = {"add_bos_token": True, "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
              "unk_token": "<unk>", "mask_token": "<mask>", "tokenizer_class": "GemmaTokenizer"}
    # When tokenizer_config.json names special tokens, the names alone decide which tokens are CONTROL
    # (transformers' all_special_tokens, llama.cpp's converter, `Tokenizer.from_hf`): an added token it
    # does not name is read as text whatever its `special` flag in tokenizer.json (the seven visible
    # tokens are USER_DEFINED either way). So every CONTROL token of the vocabulary is named here; naming
    # only the five above made <|turn>, <turn|>, <|think|>, <|tool> and <tool|> NORMAL tokens.
    named = {config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")}
    config["extra_special_tokens"] = [t for t, ty in zip(tok.tokens, tok.types.tolist())
                                      if ty == TokenType.CONTROL and t not in named]
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def derive_vocab(gguf_path: str | os.PathLike, out: str | os.PathLike = VOCAB_FILE, size: int = 4096,
                 n_chars: int = 128) -> None:
    """Development-time: how vocab.json was made from the real vocabulary (not run by users).

    Real ids [0, size - k) are kept as they are; then the k single-character tokens: the first
    `n_chars` by id from the character block (starting at '▁', real id 236743) plus any printable
    ASCII character not among them.
    """
    from gem4.tokenizer import Tokenizer

    real = Tokenizer.from_gguf(gguf_path)                 # the one reader of the GGUF tokenizer keys
    tokens = list(real.tokens)
    types = [int(t) for t in real.types]
    merges = [f"{a} {b}" for a, b in real.merges]
    first_char = tokens.index("\u2581")
    chars = [i for i in range(first_char, len(tokens)) if len(tokens[i]) == 1][:n_chars]
    have = {tokens[i] for i in chars}
    index = {t: i for i, t in enumerate(tokens)}
    chars += [index[c] for c in string.printable if c not in have and c in index and index[c] >= size]
    ids = list(range(size - len(chars))) + chars
    kept = {tokens[i] for i in ids}
    data = {
        "source": "llama.cpp models/ggml-vocab-gemma-4.gguf (MIT), subset made by gem4.demo.derive_vocab",
        "real_ids": ids,
        "tokens": [tokens[i] for i in ids],
        "types": [types[i] for i in ids],
        "merges": [m for m in merges if _merge_inside(m, kept)],
    }
    Path(out).write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def random_state(config: dict, seed: int = SEED) -> dict:
    """Seeded random weights for every parameter the model needs: canonical name -> bf16 tensor."""
    import torch

    from gem4.model.gemma4 import Model
    from gem4.weights.hf import config_from_hf

    model_config = config_from_hf(config, {}, Path("<demo config>"))
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in Model(model_config).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("layer_scalar"):
            t = torch.ones(shape)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            # attention scale is 1 on RMS-normed q/k (docs/gemma4.md §2.5): keep scores moderate
            t = (1.0 + 0.2 * torch.randn(shape, generator=gen)) * shape[-1] ** -0.25
        elif name == "norm.weight":
            # final norm x4: logits [V] get a spread (std ~2) that sampling can tell apart
            t = 4.0 * (1.0 + 0.2 * torch.randn(shape, generator=gen))
        elif "norm" in name:
            t = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif name == "embed_tokens.weight":
            # small rows: the scaled input embedding (x sqrt(H)) must not dominate the residual, or the
            # tied head (logit_t = h . e_t) just repeats the input token. Special/structural rows are
            # shrunk further so that sampled text rarely ends at once on <eos> / <turn|>.
            t = 0.05 * torch.randn(shape, generator=gen)
            t[:238] *= 0.05
        else:
            t = (2.0 / shape[-1]) ** 0.5 * torch.randn(shape, generator=gen)
        state[name] = t.to(torch.bfloat16)
    return state


def build_demo(directory: str | os.PathLike) -> Path:
    """Write the demo checkpoint into `directory` (created)."""
    from gem4.weights.hf import write_hf

    config = demo_config(len(_vocab()["tokens"]))
    directory = write_hf(Path(directory), config, random_state(config), metadata={"gem4_demo": DEMO_VERSION})
    write_tokenizer(directory)
    return directory


def demo_dir() -> Path:
    return cache_root() / f"demo-{DEMO_VERSION}"


def ensure_demo(log=None) -> Path:
    """The demo checkpoint directory, built on first use (atomically: a finished build is renamed in)."""
    target = demo_dir()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if log is not None:
        log(f"building the demo checkpoint in {target} (once)")
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=target.parent))
    try:
        build_demo(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():   # not a concurrent build that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
