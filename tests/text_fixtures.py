"""Shared helpers for the text tests (tokenizer, chat, parser): the real Gemma 4 vocab, built once.

Every asset is read from this repository, never from outside it:
- `tests/assets/gemma4-vocab/`: llama.cpp's vocab-only Gemma 4 GGUF and its golden tokenizer vectors
  (test-only; MIT, `LICENSE-llama.cpp` beside them);
- `src/gem4/templates/`: the two official Gemma 4 chat templates, which ship in the package (B, C).
A missing asset fails the test that needs it, naming the path (it is never a silent skip).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "tests" / "assets" / "gemma4-vocab"
TEMPLATES = REPO / "src" / "gem4" / "templates"


def asset(directory: Path, name: str) -> Path:
    path = directory / name
    if not path.is_file():
        pytest.fail(f"test asset missing: {path} (it is part of the repository; is the checkout complete?)")
    return path


def vocab_gguf() -> Path:
    return asset(ASSETS, "ggml-vocab-gemma-4.gguf")


@functools.lru_cache(maxsize=None)
def real_tokenizer():
    """The 262144-token Gemma 4 tokenizer from the vocab GGUF (built once per test session)."""
    from gem4.tokenizer import Tokenizer

    return Tokenizer.from_file(vocab_gguf())


@functools.lru_cache(maxsize=None)
def vocab_metadata() -> dict:
    from gem4.gguf import GGUFReader

    r = GGUFReader(vocab_gguf())
    try:
        md = dict(r.metadata)
    finally:
        r.close()
    return md


@functools.lru_cache(maxsize=None)
def templates() -> dict[str, str]:
    """The three Gemma 4 templates of docs/gemma4.md §7.1: A (GGUF-embedded), B (interleaved), C (official)."""
    return {
        "A": vocab_metadata()["tokenizer.chat_template"],
        "B": asset(TEMPLATES, "google-gemma-4-31B-it-interleaved.jinja").read_text(encoding="utf-8"),
        "C": asset(TEMPLATES, "google-gemma-4-31B-it.jinja").read_text(encoding="utf-8"),
    }


def golden_cases() -> list[tuple[str, list[int]]]:
    """llama.cpp's test vectors (docs/gemma4.md §6.4)."""
    texts = asset(ASSETS, "ggml-vocab-gemma-4.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = asset(ASSETS, "ggml-vocab-gemma-4.gguf.out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    assert len(texts) == len(lines), (len(texts), len(lines))
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def build_hf_tokenizer(tokens, types, merges):
    """The docs/gemma4.md §6.3 construction with the `tokenizers` library (independent of gem4)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, byte_fallback=True, fuse_unk=False,
                              unk_token="<unk>", ignore_merges=False))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tk


def write_hf_dir(directory: Path, tokens, types, merges, chat_template: str | None = None,
                 template_file: bool = False) -> Path:
    """An HF tokenizer directory: tokenizer.json (+ tokenizer_config.json, optional template)."""
    directory.mkdir(parents=True, exist_ok=True)
    build_hf_tokenizer(tokens, types, merges).save(str(directory / "tokenizer.json"))
    # like a real Gemma 4 tokenizer_config.json: every CONTROL token is named
    named = {"<bos>", "<eos>", "<pad>", "<unk>", "<mask>"}
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
              "mask_token": "<mask>", "add_bos_token": True,
              "extra_special_tokens": [t for t, ty in zip(tokens, types) if ty == 3 and t not in named]}
    if chat_template is not None and not template_file:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if chat_template is not None and template_file:
        (directory / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    return directory


def tiny_vocab(n: int = 512):
    """The first n real tokens (all specials, the byte tokens, common pieces) and the merges
    that stay inside them (docs/gemma4.md §8.3 step 4)."""
    md = vocab_metadata()
    tokens = list(md["tokenizer.ggml.tokens"][:n])
    types = [int(t) for t in md["tokenizer.ggml.token_type"][:n]]
    present = set(tokens)
    merges = []
    for m in md["tokenizer.ggml.merges"]:
        a, b = m.split(" ", 1)
        if a in present and b in present and a + b in present:
            merges.append(m)
    return tokens, types, merges


@functools.lru_cache(maxsize=None)
def tiny_tokenizer_dir() -> Path:
    import atexit
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="gem4-tiny-tok-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    tokens, types, merges = tiny_vocab()
    return write_hf_dir(d, tokens, types, merges, chat_template=templates()["C"], template_file=True)


@functools.lru_cache(maxsize=None)
def tiny_tokenizer():
    from gem4.tokenizer import Tokenizer

    return Tokenizer.from_file(tiny_tokenizer_dir())
