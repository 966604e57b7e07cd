"""The Gemma 4 tokenizer: text <-> token ids, exactly as llama.cpp tokenizes.

Built on the `tokenizers` library from the vocabulary of a checkpoint: the GGUF keys
`tokenizer.ggml.{tokens,token_type,merges}` or an HF directory's `tokenizer.json`. The construction
is the one verified in docs/gemma4.md §6.3 (46/46 llama.cpp golden vectors):

- BPE over the characters of the text, `byte_fallback=True`, `ignore_merges=False` (docs/gemma4.md §6.3:
  `ignore_merges=True` is wrong), no pre-tokenizer; the normalizer only turns `' '` into `'▁'`.
- CONTROL tokens (`<bos>`, `<|turn>`, `<turn|>`, ...) are *special* added tokens: matched in the
  text only with `parse_special=True`.
- USER_DEFINED tokens (the seven "visible" ones: `<|channel>`, `<channel|>`, `<|tool_call>`,
  `<tool_call|>`, `<|tool_response>`, `<tool_response|>`, `<|"|>`) are *non-special* added tokens:
  llama.cpp matches them in the text even with `parse_special=False` (docs/gemma4.md §6.2), and so do we.
- NORMAL placeholders such as `<unused0>` are never matched as units; BPE spells them out.

Decoding follows llama.cpp's `token_to_piece` (docs/gemma4.md §6.2): a NORMAL token is its text with
`'▁'` turned into `' '`, a BYTE token `<0xXX>` is that raw byte, USER_DEFINED tokens are always their
text, CONTROL tokens are their text unless `skip_special=True`. The pieces' bytes are concatenated
and read as UTF-8, an invalid byte sequence becoming U+FFFD (Python's `errors="replace"`). This is
*not* `tokenizers`' ByteFallback decoder, which turns a whole run of byte tokens into U+FFFD as soon
as any byte in it is invalid; the two agree on every valid sequence. llama.cpp's lossy
`clean_spaces` is not applied.

`Tokenizer.detokenizer()` streams the same text: fed ids one at a time it returns only complete
characters (a multi-byte character split over byte tokens is held until it completes), and the
concatenation of everything it returns, `flush()` included, equals `decode(ids)` for every split.

Construction from the 262144-token vocab GGUF takes about two seconds (GGUF parse ~1 s, BPE ~1 s).
Nothing here imports torch.
"""
from __future__ import annotations

import codecs
import enum
import functools
import json
import os
import pathlib
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

__all__ = ["Tokenizer", "TokenizerError", "TokenType", "SpecialIds", "Detokenizer"]


class TokenizerError(ValueError):
    """A tokenizer file is missing, malformed or not a Gemma 4 tokenizer."""


class TokenType(enum.IntEnum):
    """llama.cpp / GGUF token types (`tokenizer.ggml.token_type`)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


SPACE = "\u2581"  # '▁': how the vocabulary spells a space

# Forced to USER_DEFINED by llama.cpp's converter so that they are always rendered as text for the
# chat parser (docs/gemma4.md §6.1, LC/conversion/gemma.py). We apply the same rule to HF directories.
VISIBLE_TOKENS = frozenset(
    ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>']
)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special and structural tokens, by role (docs/gemma4.md §6.1). None when absent."""

    pad: int | None
    eos: int | None
    bos: int | None
    unk: int | None
    mask: int | None
    turn_start: int | None  # <|turn>
    turn_end: int | None  # <turn|>          EOG
    channel_start: int | None  # <|channel>
    channel_end: int | None  # <channel|>
    tool_call_start: int | None  # <|tool_call>
    tool_call_end: int | None  # <tool_call|>
    tool_response_start: int | None  # <|tool_response>  EOG (the model hands control back)
    tool_response_end: int | None  # <tool_response|>
    string_delim: int | None  # <|"|>
    think: int | None  # <|think|>
    tool_start: int | None  # <|tool>
    tool_end: int | None  # <tool|>

    @property
    def end_of_generation(self) -> frozenset[int]:
        """The ids that end generation (EOG): `<eos>`, `<turn|>` and `<|tool_response>`, which the model emits
        right after its tool calls to hand control back (docs/gemma4.md §6.1, §7.2)."""
        return frozenset(i for i in (self.eos, self.turn_end, self.tool_response_start) if i is not None)


_STRUCTURAL_TEXT = {
    "turn_start": "<|turn>",
    "turn_end": "<turn|>",
    "channel_start": "<|channel>",
    "channel_end": "<channel|>",
    "tool_call_start": "<|tool_call>",
    "tool_call_end": "<tool_call|>",
    "tool_response_start": "<|tool_response>",
    "tool_response_end": "<tool_response|>",
    "string_delim": '<|"|>',
    "think": "<|think|>",
    "tool_start": "<|tool>",
    "tool_end": "<tool|>",
}


class Tokenizer:
    """Gemma 4 tokenizer. Build it with `Tokenizer.from_file(path)`.

    `tokens[i]` is the vocabulary string of id i (spaces spelled `'▁'`), `types[i]` its
    `TokenType`, `merges` the BPE merges as `"left right"` strings or `(left, right)` pairs, in rank
    order.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        types: Sequence[int] | np.ndarray,
        merges: Iterable[str] | Iterable[tuple[str, str]],
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        unk_id: int | None = None,
        mask_id: int | None = None,
        add_bos: bool = True,
        chat_template: str | None = None,
        source: str = "<memory>",
    ):
        tokens = list(tokens)
        try:
            types = np.asarray(types, dtype=np.int32)
        except (TypeError, ValueError, OverflowError):
            raise TokenizerError(f"{source}: token types must be integers") from None
        n = len(tokens)
        if n == 0:
            raise TokenizerError(f"{source}: empty vocabulary")
        if types.shape != (n,):
            raise TokenizerError(f"{source}: {types.size} token types for {n} tokens")
        bad = np.flatnonzero(~np.isin(types, [int(t) for t in TokenType]))
        if bad.size:
            raise TokenizerError(f"{source}: token {int(bad[0])} has type {int(types[bad[0]])}, not a llama.cpp token "
                                 f"type (1-6)")
        bad_token = next((i for i, t in enumerate(tokens) if not isinstance(t, str)), None)
        if bad_token is not None:
            raise TokenizerError(f"{source}: token {bad_token} is {tokens[bad_token]!r}, not a string")
        self.source = source
        self.tokens: list[str] = tokens
        self.types: np.ndarray = types
        self._vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if self._vocab.setdefault(t, i) != i:
                raise TokenizerError(f"{source}: token {t!r} appears twice (ids {self._vocab[t]} and {i})")

        pairs = []
        for rank, m in enumerate(merges):
            if isinstance(m, str):
                # Tokens never contain ' ', so the first space (from index 1) separates the pair.
                cut = m.find(" ", 1)
                if cut < 0:
                    raise TokenizerError(f"{source}: malformed merge {rank} {m!r}")
                pairs.append((m[:cut], m[cut + 1 :]))
            elif isinstance(m, (tuple, list)) and len(m) == 2 and all(isinstance(x, str) for x in m):
                pairs.append((m[0], m[1]))
            else:
                raise TokenizerError(f"{source}: malformed merge {rank} {m!r}: expected 'left right' or a pair of strings")
        self.merges: list[tuple[str, str]] = pairs  # rank order

        def named(explicit: int | None, text: str) -> int | None:
            if explicit is not None:
                if not 0 <= explicit < n:
                    raise TokenizerError(f"{source}: special id {explicit} outside the vocabulary of {n}")
                return int(explicit)
            return self._vocab.get(text)

        structural = {k: self._vocab.get(v) for k, v in _STRUCTURAL_TEXT.items()}
        self.special = SpecialIds(
            pad=named(pad_id, "<pad>"),
            eos=named(eos_id, "<eos>"),
            bos=named(bos_id, "<bos>"),
            unk=named(unk_id, "<unk>"),
            mask=named(mask_id, "<mask>"),
            **structural,
        )
        self.add_bos = bool(add_bos)
        self.chat_template: str | None = chat_template

        # docs/gemma4.md §6.3. The BPE model is shared by the two front ends below.
        unk_token = tokens[self.special.unk] if self.special.unk is not None else None
        try:
            bpe = models.BPE(
                vocab=self._vocab,
                merges=pairs,
                byte_fallback=True,
                fuse_unk=False,
                unk_token=unk_token,
                ignore_merges=False,
            )
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception ("Token `x` out of vocabulary")
            raise TokenizerError(f"{source}: the BPE merges do not fit the vocabulary: {e}") from None
        control = [t for t, ty in zip(tokens, types) if ty == TokenType.CONTROL]
        user_defined = [t for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED]

        def front_end(encode_special_tokens: bool) -> tokenizers.Tokenizer:
            tk = tokenizers.Tokenizer(bpe)
            tk.normalizer = normalizers.Replace(" ", SPACE)
            tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
            tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
            tk.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
            # True reproduces llama.cpp's parse_special=false: CONTROL tokens are spelled out as text,
            # USER_DEFINED ones are still matched (docs/gemma4.md §6.3).
            tk.encode_special_tokens = encode_special_tokens
            return tk

        self._tk_special = front_end(False)  # parse_special=True
        self._tk_plain = front_end(True)  # parse_special=False
        self._pieces: list[bytes] | None = None  # built on first decode
        self._structural: frozenset[int] | None = None

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """A GGUF file, an HF directory (tokenizer.json + tokenizer_config.json) or a tokenizer.json."""
        p = pathlib.Path(path)
        if p.is_dir():
            return cls.from_hf(p)
        if not p.exists():
            raise TokenizerError(f"{p}: no such file or directory")
        if p.suffix == ".gguf":
            return cls.from_gguf(p)
        if p.suffix == ".json":
            return cls.from_hf(p)
        with open(p, "rb") as f:
            if f.read(4) == b"GGUF":
                return cls.from_gguf(p)
        raise TokenizerError(f"{p}: neither a GGUF file, an HF directory nor a tokenizer.json")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read `tokenizer.ggml.*` and `tokenizer.chat_template` from a GGUF file (docs/gemma4.md §6.1)."""
        from gem4.gguf import GGUFError, GGUFReader

        try:
            reader = GGUFReader(path)
        except GGUFError as e:
            raise TokenizerError(str(e)) from e
        try:
            md = reader.metadata
        finally:
            reader.close()

        def need(key: str):
            if key not in md:
                raise TokenizerError(f"{path}: GGUF metadata has no {key!r}")
            return md[key]

        model = need("tokenizer.ggml.model")
        if model != "gemma4":
            raise TokenizerError(f"{path}: tokenizer.ggml.model is {model!r}, expected 'gemma4'")
        tokens = need("tokenizer.ggml.tokens")
        types = need("tokenizer.ggml.token_type")
        merges = need("tokenizer.ggml.merges")
        for key, value, kind in (("tokenizer.ggml.tokens", tokens, list), ("tokenizer.ggml.merges", merges, list),
                                 ("tokenizer.ggml.token_type", types, np.ndarray)):
            if not isinstance(value, kind):
                raise TokenizerError(f"{path}: {key} must be an array, got {type(value).__name__}")
        if len(types) != len(tokens):
            raise TokenizerError(f"{path}: {len(types)} token types for {len(tokens)} tokens")

        def opt_id(key: str, legacy: str | None = None) -> int | None:
            """A special token id; `legacy` is the name gem4's converter wrote before it used llama.cpp's."""
            found = {k: md[k] for k in (key, legacy) if k is not None and k in md}
            for k, v in found.items():
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                    raise TokenizerError(f"{path}: {k} must be an integer token id, got {v!r}")
            ids = {int(v) for v in found.values()}
            if len(ids) > 1:
                raise TokenizerError(f"{path}: {key} and {legacy} disagree ({sorted(ids)})")
            if ids and not 0 <= next(iter(ids)) < len(tokens):
                raise TokenizerError(f"{path}: {' / '.join(found)} = {next(iter(ids))} is outside the vocabulary "
                                     f"of {len(tokens)}")
            return ids.pop() if ids else None

        template = md.get("tokenizer.chat_template")
        return cls(
            tokens,
            types,
            merges,
            bos_id=opt_id("tokenizer.ggml.bos_token_id"),
            eos_id=opt_id("tokenizer.ggml.eos_token_id"),
            pad_id=opt_id("tokenizer.ggml.padding_token_id", "tokenizer.ggml.pad_token_id"),
            unk_id=opt_id("tokenizer.ggml.unknown_token_id", "tokenizer.ggml.unk_token_id"),
            mask_id=opt_id("tokenizer.ggml.mask_token_id"),
            # llama.cpp forces add_bos for gemma4 whatever the file says (docs/gemma4.md §6.1).
            add_bos=bool(md.get("tokenizer.ggml.add_bos_token", True)),
            chat_template=template if isinstance(template, str) else None,
            source=str(path),
        )

    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> "Tokenizer":
        """An HF directory (or its tokenizer.json). Only the vocabulary, merges and added tokens are
        taken from tokenizer.json; the tokenizer is rebuilt the docs/gemma4.md §6.3 way so that it
        tokenizes like llama.cpp whatever pre-tokenizer the file declares.

        Token types follow llama.cpp's converter (`LlamaHfVocab` + the Gemma 4 override):
        `<0xXX>` -> BYTE; the seven visible tokens -> USER_DEFINED; the special tokens that
        tokenizer_config.json names (`*_token` keys, `additional_special_tokens`,
        `extra_special_tokens`) -> CONTROL; everything else NORMAL (so `<unused0>` stays NORMAL
        even if tokenizer.json flags it special). Without names in tokenizer_config.json, the
        added tokens' own `special` flags decide CONTROL (special) or USER_DEFINED (not).
        Special ids, `add_bos_token` and the chat template come from tokenizer_config.json /
        chat_template.jinja when present.
        """
        p = pathlib.Path(path)
        directory = p if p.is_dir() else p.parent
        tj_path = p / "tokenizer.json" if p.is_dir() else p
        try:
            with open(tj_path, encoding="utf-8") as f:
                tj = json.load(f)
        except FileNotFoundError:
            raise TokenizerError(f"{tj_path}: not found") from None
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{tj_path}: invalid JSON: {e}") from None
        model = tj.get("model") or {}
        if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            raise TokenizerError(f"{tj_path}: expected a BPE model with a vocab, got {model.get('type')!r}")

        config: dict = {}
        cfg_path = directory / "tokenizer_config.json"
        if cfg_path.exists():
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
        named = _named_special_tokens(config)

        id_to_token: dict[int, str] = {}
        for t, i in model["vocab"].items():
            id_to_token[int(i)] = t
        added_type: dict[str, int] = {}
        for at in tj.get("added_tokens") or []:
            t, i = at["content"], int(at["id"])
            if id_to_token.setdefault(i, t) != t:
                raise TokenizerError(f"{tj_path}: id {i} is both {id_to_token[i]!r} and added token {t!r}")
            if not named:  # no names to go by: the added tokens' own flags
                added_type[t] = TokenType.CONTROL if at.get("special", False) else TokenType.USER_DEFINED
        for t in named:
            added_type[t] = TokenType.CONTROL
        for t in VISIBLE_TOKENS:
            added_type[t] = TokenType.USER_DEFINED
        n = len(id_to_token)
        if sorted(id_to_token) != list(range(n)):
            raise TokenizerError(f"{tj_path}: token ids are not 0..{n - 1}")
        tokens = [id_to_token[i] for i in range(n)]
        types = np.empty(n, dtype=np.int32)
        for i, t in enumerate(tokens):
            if _BYTE_TOKEN.fullmatch(t):
                types[i] = TokenType.BYTE
            else:
                types[i] = added_type.get(t, TokenType.NORMAL)

        tj_vocab = {t: i for i, t in enumerate(tokens)}

        def special(name: str, default: str) -> int | None:
            # Configured names must exist; the Gemma defaults are looked up leniently.
            if name not in config:
                return tj_vocab.get(default)
            v = config[name]
            if isinstance(v, dict):
                v = v.get("content")
            if v is None:
                return None
            if v not in tj_vocab:
                raise TokenizerError(f"{cfg_path}: {name} {v!r} is not in the vocabulary")
            return tj_vocab[v]

        template = None
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.exists():
            template = jinja_path.read_text(encoding="utf-8")
        else:
            ct = config.get("chat_template")
            if isinstance(ct, str):
                template = ct
            elif isinstance(ct, list):  # [{"name": ..., "template": ...}, ...]
                by_name = {d.get("name"): d.get("template") for d in ct if isinstance(d, dict)}
                template = by_name.get("default")
        return cls(
            tokens,
            types,
            model.get("merges") or [],
            bos_id=special("bos_token", "<bos>"),
            eos_id=special("eos_token", "<eos>"),
            pad_id=special("pad_token", "<pad>"),
            unk_id=special("unk_token", "<unk>"),
            mask_id=special("mask_token", "<mask>"),
            add_bos=bool(config.get("add_bos_token", True)),
            chat_template=template,
            source=str(directory if p.is_dir() else p),
        )

    # ---- vocabulary -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string (spaces spelled `'▁'`), or None."""
        return self._vocab.get(token)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary string of an id, as stored (`'▁Hello'`, `'<0xE2>'`, `'<|turn>'`)."""
        return self.tokens[token_id]

    def token_type(self, token_id: int) -> TokenType:
        return TokenType(int(self.types[token_id]))

    def is_control(self, token_id: int) -> bool:
        """CONTROL tokens: dropped by `decode(skip_special=True)`."""
        return int(self.types[token_id]) == TokenType.CONTROL

    def is_structural(self, token_id: int) -> bool:
        """CONTROL or USER_DEFINED: tokens that carry chat structure rather than text."""
        return int(self.types[token_id]) in (TokenType.CONTROL, TokenType.USER_DEFINED)

    @property
    def structural_ids(self) -> frozenset[int]:
        """Ids of all CONTROL and USER_DEFINED tokens (24 in Gemma 4)."""
        if self._structural is None:
            mask = (self.types == TokenType.CONTROL) | (self.types == TokenType.USER_DEFINED)
            self._structural = frozenset(int(i) for i in np.flatnonzero(mask))
        return self._structural

    @property
    def bos_id(self) -> int | None:
        return self.special.bos

    @property
    def eos_id(self) -> int | None:
        return self.special.eos

    @property
    def pad_id(self) -> int | None:
        return self.special.pad

    @property
    def unk_id(self) -> int | None:
        return self.special.unk

    def special_token_strings(self) -> dict[str, str]:
        """`bos_token`, `eos_token`, ... as the strings chat templates receive (transformers'
        `special_tokens_map`)."""
        out = {}
        for name in ("bos", "eos", "unk", "pad", "mask"):
            i = getattr(self.special, name)
            if i is not None:
                out[f"{name}_token"] = self.tokens[i]
        return out

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (special tokens parsed)."""
        return self._tk_special

    # ---- encode / decode -------------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
        """Token ids of `text`.

        add_bos: prepend BOS; None uses the checkpoint's `add_bos_token` flag. Chat templates emit
        `<bos>` themselves, so encode a rendered prompt with `add_bos=False, parse_special=True`.
        parse_special: match CONTROL tokens (`<|turn>`, `<bos>`, ...) written in the text. Off by
        default so that user text cannot inject them. USER_DEFINED tokens are matched either way,
        like llama.cpp.
        Runs through `encode_batch`: `tokenizers` releases the GIL there and holds it in its `encode`
        for the whole text (4M characters kept every other thread of a server waiting 15 s).
        """
        return self.encode_batch([text], add_bos=add_bos, parse_special=parse_special)[0]

    def encode_batch(
        self, texts: Sequence[str], *, add_bos: bool | None = None, parse_special: bool = False
    ) -> list[list[int]]:
        tk = self._tk_special if parse_special else self._tk_plain
        bos = (self.add_bos if add_bos is None else add_bos) and self.special.bos is not None
        return [([self.special.bos] if bos else []) + e.ids for e in tk.encode_batch(list(texts), add_special_tokens=False)]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (a scan of the vocabulary, once). A BPE
        token stands for its own string ('▁' is one space), an added token (`<|turn>`, ...) for its
        literal text, a byte token for a byte of a character (its string `<0x0A>` overcounts, which only
        loosens the bound). So a text of n characters is at least ceil(n / max_token_chars) tokens."""
        return max(map(len, self.tokens))

    def piece_table(self) -> list[bytes]:
        """`piece_bytes` for every id, as one shared list (read-only by convention)."""
        if self._pieces is None:
            pieces = []
            for t, ty in zip(self.tokens, self.types.tolist()):
                if ty == TokenType.BYTE:
                    m = _BYTE_TOKEN.fullmatch(t)
                    pieces.append(bytes([int(m.group(1), 16)]) if m else t.encode("utf-8"))
                elif ty in (TokenType.CONTROL, TokenType.USER_DEFINED):
                    pieces.append(t.encode("utf-8"))
                else:  # NORMAL, UNKNOWN, UNUSED
                    pieces.append(t.replace(SPACE, " ").encode("utf-8"))
            self._pieces = pieces
        return self._pieces

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to decoded text (llama.cpp `token_to_piece`, special=true)."""
        return self.piece_table()[token_id]

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids`: the pieces' bytes concatenated and read as UTF-8 (invalid -> U+FFFD).

        skip_special drops CONTROL tokens (`<bos>`, `<turn|>`, ...); USER_DEFINED tokens are text.
        """
        table = self.piece_table()
        ids = [int(i) for i in ids]
        n = len(table)
        for i in ids:
            if not 0 <= i < n:
                raise IndexError(f"token id {i} outside the vocabulary of {n}")
        if skip_special:
            types = self.types
            ids = [i for i in ids if types[i] != TokenType.CONTROL]
        return b"".join([table[i] for i in ids]).decode("utf-8", errors="replace")

    def detokenizer(self, *, skip_special: bool = False) -> "Detokenizer":
        """A fresh incremental detokenizer (see `Detokenizer`)."""
        return Detokenizer(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size})"


def _named_special_tokens(config: dict) -> set[str]:
    """The special tokens a tokenizer_config.json names (transformers' `all_special_tokens`)."""
    names: set[str] = set()

    def add(v) -> None:
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str) and v:
            names.add(v)

    for key, value in config.items():
        if key.endswith("_token") and key != "chat_template":
            add(value)
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key)
        if isinstance(value, dict):
            for v in value.values():
                add(v)
        elif isinstance(value, list):
            for v in value:
                add(v)
    return names


class Detokenizer:
    """Streams `Tokenizer.decode`: `feed(id)` returns the text that is now complete.

    A character spelled by several byte tokens is held until its last byte arrives; an invalid or
    interrupted byte sequence becomes U+FFFD exactly where `decode` puts it. After `flush()`, the
    concatenation of all returned strings equals `tokenizer.decode(all_ids, skip_special=...)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._table = tokenizer.piece_table()
        self._types = tokenizer.types
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        token_id = int(token_id)
        if not 0 <= token_id < len(self._table):
            raise IndexError(f"token id {token_id} outside the vocabulary of {len(self._table)}")
        if self._skip_special and self._types[token_id] == TokenType.CONTROL:
            return ""
        return self._utf8.decode(self._table[token_id])

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join([self.feed(i) for i in ids])

    @property
    def pending(self) -> bool:
        """True while an incomplete UTF-8 sequence is held back."""
        return bool(self._utf8.getstate()[0])

    def flush(self) -> str:
        """End of stream: returns U+FFFD for a held incomplete sequence, and resets."""
        return self._utf8.decode(b"", final=True)
