"""Where gem4 keeps its files, and every `GEM4_*` setting it reads: one owner for each.

    GEM4_CACHE        the cache root (default ~/.cache/gem4), holding
                          kernels/<key>/      the compiled CPU kernels (model/kernels)
                          experts/<key>/      26B-A4B's experts repacked for streaming (weights/expert_files.py)
                          demo-<version>/     the demo checkpoint (gem4.demo)
                          chat_history        `gem4 chat`'s earlier turns on a terminal (repl.py)
    GEM4_NO_KERNELS   set (to anything but "" or "0"): no compiled CPU kernels; the fast mode runs on plain torch
    GEM4_NO_AMX       set (likewise): the kernels keep to AVX-512 VNNI / BF16 where the CPU would grant AMX tiles

Each is read when asked, so a test may set it for one call.
"""
from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def cache_root() -> Path:
    env = os.environ.get("GEM4_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "gem4"


def kernels_dir() -> Path:
    return cache_root() / "kernels"


def experts_dir() -> Path:
    return cache_root() / "experts"


def chat_history() -> Path:
    return cache_root() / "chat_history"


def no_kernels() -> bool:
    return _flag("GEM4_NO_KERNELS")


def no_amx() -> bool:
    return _flag("GEM4_NO_AMX")
