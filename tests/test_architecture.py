"""The rooms of src/gem4 import downwards only (docs/architecture.md), and the model knows no mode flags.

Every `import` and `from ... import` in src/gem4 is read, at module level and inside functions alike.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "gem4"

# the rooms, lowest first: a module may import its own room and the rooms below it, never one above
ROOMS = [
    ("facts", {"numbers", "procfs", "paths", "ggml", "gguf", "config"}),
    ("text", {"tokenizer", "chat", "parser", "structured", "sampling", "stops", "media"}),
    ("kv_cache", {"kv_cache"}),
    ("model", {"model"}),
    ("weights", {"weights"}),
    ("engine", {"engine"}),
    ("demo", {"demo"}),
    ("entry points", {"launch", "argtypes", "repl", "server", "cli", "__main__", "gem4"}),
]
RANK = {part: rank for rank, (_, parts) in enumerate(ROOMS) for part in parts}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    """gem4.model.cpu -> model; gem4 (the package's public API) -> gem4."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "gem4"


def imports() -> list[tuple[str, str, list[str]]]:
    """(importing module, imported gem4 module, names imported from it) for every import in src/gem4."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        mod = module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "gem4":      # from gem4 import paths, __version__
                for a in node.names:
                    sub = (SRC / f"{a.name}.py").is_file() or (SRC / a.name).is_dir()
                    out.append((mod, f"gem4.{a.name}" if sub else "gem4", [] if sub else [a.name]))
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("gem4"):
                out.append((mod, node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                out += [(mod, a.name, []) for a in node.names if a.name.split(".")[0] == "gem4"]
    return out


def test_every_module_is_in_a_room():
    modules = {module_name(p) for p in SRC.rglob("*.py")}
    assert {room(m) for m in modules} <= set(RANK), sorted({room(m) for m in modules} - set(RANK))


def test_rooms_import_downwards_only():
    upward = [f"{a} imports {b} ({room(a)} -> {room(b)})" for a, b, _ in imports()
              if RANK[room(b)] > RANK[room(a)]]
    assert not upward, "\n".join(upward)


def test_no_cycle_between_the_rooms_of_a_rank():
    """Rooms that share a rank (the facts, the text room's modules) may use each other only one way."""
    edges = {(room(a), room(b)) for a, b, _ in imports() if room(a) != room(b) and RANK[room(a)] == RANK[room(b)]}
    assert not [e for e in edges if (e[1], e[0]) in edges], sorted(edges)


def test_no_private_name_is_imported_from_another_module():
    private = [f"{a} imports {n} from {b}" for a, b, names in imports() for n in names
               if n.startswith("_") and not n.startswith("__") and a != b]
    assert not private, "\n".join(private)


def test_the_model_has_no_mode_flags_and_no_thread_locals():
    """The backend is chosen at load (model/backends.py); nothing in the model asks a `fused` flag or keeps
    per-thread state (the kernels' build lock is a plain lock)."""
    for path in (SRC / "model").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\bfused\b", text), path
        assert "threading.local" not in text, path
