"""The repository stands alone.

- Nothing in src/, tests/ or .ci/ names a path outside the checkout (a shared folder beside it, the
  machine it was written on): a clone anywhere else must build and pass its tests.
- Every citation of a document section in the code (`docs/gemma4.md §2.5`, `§7.2-7.5`,
  `§1.3, §3, §4`) names a file the repository holds and a numbered heading that exists in it.
- Every non-Python file of the package is declared as package data, so a wheel carries it (the
  chat templates that `gem4.chat` falls back to, the kernel sources, the demo vocab).
"""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent

# Built from pieces, so that this file does not match itself.
OUTSIDE = re.compile("|".join(re.escape(p) for p in ("/" + "work" + "/", ".." + "/shared", "shared" + "/assets")))

# `some/file.md §2.5`, optionally followed by `, §3`, `-§2.6`, `-7.5`
_ID = r"(?:\d+(?:\.\d+)*|[A-Z])"
CITATION = re.compile(r"([\w./-]+\.md) (§" + _ID + r"(?:\s*[,–-]\s*(?:§" + _ID + r"|\d+\.\d+))*)")
HEADING = re.compile(r"#{2,6}\s+(?:Appendix\s+)?(" + _ID + r")[.:]?\s")


def text_files(*tops: str):
    """(path, text) of every text file under the given top-level folders (binary files skipped)."""
    for top in tops:
        for path in sorted((REPO / top).rglob("*")):
            if not path.is_file() or any(part == "__pycache__" or part.endswith(".egg-info") for part in path.parts):
                continue                                          # generated: bytecode, pip's copy of the README
            with path.open("rb") as f:
                if b"\0" in f.read(8192):
                    continue  # binary: the vocab GGUF, compiled objects
            yield path, path.read_text(encoding="utf-8", errors="replace")


def headings(doc: Path) -> set[str]:
    """The section numbers of a Markdown file ('2', '2.5', 'A'), outside fenced code blocks."""
    ids, fenced = set(), False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            ids.add(m.group(1))
    return ids


def test_patterns_catch_outside_paths():
    for bad in ("/" + "work/shared/x", "../" + "shared/x", "shared/" + "assets/gemma4-vocab"):
        assert OUTSIDE.search(f"open('{bad}')"), bad
    assert not OUTSIDE.search("tests/assets/gemma4-vocab/ggml-vocab-gemma-4.gguf")


def test_no_path_outside_the_repository():
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
            for path, text in text_files("src", "tests", ".ci")
            for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def citations(text: str):
    """(document, [section ids]) for each citation in text."""
    for m in CITATION.finditer(text):
        yield m.group(1), re.findall(_ID, m.group(2))


def test_citation_parser():
    text = ("a (docs/x.md §2.5-§2.6) b docs/x.md §7.2-7.5 c docs/x.md §1.3, §3, §4. "
            "d docs/x.md §6.3. e docs/x.md §2.5, issue #6 §4 f docs/x.md §A")
    assert list(citations(text)) == [("docs/x.md", ["2.5", "2.6"]), ("docs/x.md", ["7.2", "7.5"]),
                                     ("docs/x.md", ["1.3", "3", "4"]), ("docs/x.md", ["6.3"]),
                                     ("docs/x.md", ["2.5"]), ("docs/x.md", ["A"])]
    assert headings(REPO / "docs" / "gemma4.md") >= {"1", "1.1", "2.5", "7.5", "8.4", "A", "B"}


def test_every_section_citation_resolves():
    found, broken = 0, []
    for path, text in text_files("src", "tests", "benchmarks"):
        if path == Path(__file__).resolve():
            continue  # the examples in test_citation_parser
        for n, line in enumerate(text.splitlines(), 1):
            for doc, ids in citations(line):
                found += 1
                target = REPO / doc
                if not target.is_file():
                    broken.append(f"{path.relative_to(REPO)}:{n}: {doc} is not in the repository")
                    continue
                missing = [i for i in ids if i not in headings(target)]
                if missing:
                    broken.append(f"{path.relative_to(REPO)}:{n}: {doc} has no section {', '.join(missing)}")
    assert found > 20  # the code does cite the reference
    assert not broken, "citations that do not resolve:\n" + "\n".join(broken)


def test_package_files_are_package_data():
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-data"]
    root = REPO / "src"
    missing = []
    for path in sorted((root / "gem4").rglob("*")):
        if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
            continue
        covered = False
        for package, patterns in package_data.items():
            base = root / package.replace(".", "/")
            if base in path.parents:
                rel = path.relative_to(base).as_posix()
                covered |= any(fnmatch.fnmatchcase(rel, p) for p in patterns)
        if not covered:
            missing.append(path.relative_to(REPO).as_posix())
    assert not missing, f"files a wheel would leave out (add them to [tool.setuptools.package-data]): {missing}"


MD_NAME = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)\b")


def test_every_document_named_in_the_code_and_docs_exists():
    """A `docs/x.md` or `benchmarks/RESULTS.md` named in src/, docs/ or the README is a file of the repository
    (relative to its root, or to the naming file's folder). docs/gemma4.md's `LC/...` are llama.cpp's sources,
    which it cites as such."""
    missing = [f"{path.relative_to(REPO)}: {name}"
               for path, text in [*text_files("src", "docs"), (REPO / "README.md", (REPO / "README.md").read_text())]
               for name in MD_NAME.findall(text)
               if not name.startswith("LC/") and not (REPO / name).is_file() and not (path.parent / name).is_file()]
    assert not missing, "documents that are not in the repository:\n" + "\n".join(missing)


def test_the_readme_opens_with_the_two_commands_on_one_screen():
    """What gem4 is, the install-and-run command, the test command and an example, in the first 40 lines."""
    first = (REPO / "README.md").read_text(encoding="utf-8").split("\n## ", 1)[0].splitlines()
    assert len(first) <= 40, len(first)
    text = "\n".join(first)
    assert "gem4 run --demo" in text and "python3 -m pytest -q" in text
