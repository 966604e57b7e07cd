"""Models by name from a Hugging Face hub: `owner/name[:TAG]` -> a local path that `gem4.load` reads.

    resolve("gemma-4-E2B-it-Q4_0.gguf")               an existing local path: returned as is
    resolve("ggml-org/gemma-4-E2B-it-GGUF:Q4_K_M")    the repo's GGUF whose quant tag is Q4_K_M
    resolve("google/gemma-4-E2B-it")                  no GGUF in the repo: its HF checkpoint directory

Everything goes through `huggingface_hub` and its cache (`HF_HOME` / `HF_HUB_CACHE`), so the files are
shared with other tools; `HF_ENDPOINT`, `HF_TOKEN` and `HF_HUB_OFFLINE` act as huggingface_hub defines
them (read when it is imported). Choices made here:

- Listing: one model-info call (`files_metadata`: names, sizes, git blob ids, LFS SHA-256). When the hub
  cannot be reached (connection error, timeout, 5xx/429) or offline mode is on, the cached snapshot of
  the repo's main branch stands in for the listing: the same selection then runs over the files that
  an earlier call downloaded. A repo that is missing, private or gated is an error, not a fallback.
- GGUF repos (any `*.gguf` besides projector/imatrix/draft files): one file, picked by quant tag the way
  llama.cpp's `-hf` does (common/download.cpp): a tag names a file whose name, without `.gguf` and a
  split suffix `-0000i-of-0000n`, ends in `-TAG` or `.TAG`, compared case-insensitively, so `:q4_k_m` and
  `:UD-Q4_K_XL` both work. No tag: Q4_K_M, else Q8_0, else the first model file by name (logged). Unlike
  llama.cpp, a tag that fits several files is an error, and so is a split GGUF (gem4 reads one file).
  Sidecar files (tokenizer, template) are not fetched: the GGUF carries them.
- Checkpoint repos (config.json, no GGUF): config, generation config, tokenizer and chat-template files
  and the safetensors weights at the repo's top level: the shards that model.safetensors.index.json
  names when there is one, else every top-level `*.safetensors`. Other formats (.bin, .onnx, .pth,
  subfolders such as original/) are skipped.
- Downloads are huggingface_hub's (`hf_hub_download` at the main branch; Xet storage when the hub
  offers it and hf_xet is installed): a plain HTTP transfer cut in the middle is resumed with a Range
  request from the last whole 10 MiB piece written (up to 5 retries while bytes keep coming); the
  partial file of a process that is killed is not kept by huggingface_hub 2.x, so such a download
  starts over. The files of one call must all come from the commit the listing named.
- Verification: huggingface_hub checks only sizes when it downloads (`hf cache verify` is separate).
  Here every file is hashed once: LFS files by SHA-256 against the listing's `lfs.sha256` and the blob's
  name in the cache (the ETag / X-Linked-Etag, the SHA-256 for LFS files), other files by git blob SHA-1
  against the listing's blob id (the rule of huggingface_hub's `verify_repo_checksums`). A mismatch
  deletes the blob and its snapshot link and raises; a match is recorded in `.gem4-verified/` beside the
  repo's `blobs/` (size and mtime), so later runs do not hash gigabytes again.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

Log = Callable[[str], None]

# owner/name, optionally :TAG; HF repo names are letters, digits, '-', '_', '.'
_REPO = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<tag>[A-Za-z0-9][\w.-]*))?")
_SPLIT = re.compile(r"(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})", re.IGNORECASE)
_LAST_PART = re.compile(r"[-.]([A-Za-z0-9_]+)$")
# llama.cpp's gguf_filename_is_model: these GGUFs are not language models on their own
_NOT_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
INDEX = "model.safetensors.index.json"
VERIFIED_DIR = ".gem4-verified"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHA1 = re.compile(r"[0-9a-f]{40}")


class HubError(ValueError):
    """A model named by hub id cannot be had: names the repo, the file and the cause."""


@dataclass(frozen=True)
class ModelRef:
    repo_id: str
    tag: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f":{self.tag}" if self.tag else "")


def parse_ref(text: str) -> ModelRef | None:
    """`owner/name[:TAG]` -> ModelRef; None for anything else (a path such as `./a/b`, `/x`, `a/b/c`,
    or a missing `dir/model.gguf`, which stays a path so that the loader names it)."""
    m = _REPO.fullmatch(text)
    if m is None or m["repo"].lower().endswith((".gguf", ".safetensors", ".json")):
        return None
    return ModelRef(m["repo"], m["tag"])


def resolve(model: str | os.PathLike, log: Log | None = None, **hub_options) -> Path:
    """An existing local path as is; a hub id (`owner/name[:TAG]`) downloaded (or found in the cache);
    anything else as a Path, for the loader to report. `hub_options` go to `pull`."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    ref = parse_ref(str(model))
    return path if ref is None else pull(ref, log, **hub_options)


# ---------------------------------------------------------------------------------------------
# Choosing files
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepoFile:
    """A file of the listing, with the hashes the hub (or the cache) vouches for."""
    name: str                       # path inside the repo, '/'-separated
    size: int | None = None
    sha256: str | None = None       # LFS files
    git_sha1: str | None = None     # git blob id (every file; the one to check for non-LFS files)


@dataclass(frozen=True)
class GGUFName:
    name: str        # as in the repo
    stem: str        # base name without .gguf and split suffix
    index: int
    count: int

    @property
    def tag(self) -> str:
        """llama.cpp's tag: the last '-'/'.'-separated part of the stem, upper case ('' if none)."""
        m = _LAST_PART.search(self.stem)
        return m[1].upper() if m else ""


def gguf_name(name: str) -> GGUFName | None:
    base = PurePosixPath(name).name
    if not base.lower().endswith(".gguf"):
        return None
    stem, index, count = base[:-5], 1, 1
    m = _SPLIT.fullmatch(stem)
    if m:
        stem, index, count = m["stem"], int(m["index"]), int(m["count"])
    return GGUFName(name, stem, index, count)


def _is_model_gguf(g: GGUFName) -> bool:
    base = PurePosixPath(g.name).name.lower()
    return not any(word in base for word in _NOT_MODEL)


def _groups(names: list[str]) -> dict[tuple[str, str, int], list[GGUFName]]:
    """Model GGUFs grouped so that the parts of one split model are one entry, sorted by name."""
    out: dict[tuple[str, str, int], list[GGUFName]] = {}
    for name in sorted(names):
        g = gguf_name(name)
        if g is not None and _is_model_gguf(g):
            out.setdefault((str(PurePosixPath(name).parent), g.stem, g.count), []).append(g)
    return out


def _has_tag(g: GGUFName, tag: str) -> bool:
    stem, tag = g.stem.upper(), tag.upper()
    return stem == tag or stem.endswith(("-" + tag, "." + tag))


def _describe(groups) -> str:
    lines = []
    for parts in groups:
        g = parts[0]
        split = f" (split in {g.count} files)" if g.count > 1 else ""
        lines.append(f"  {g.tag or '?':<10} {g.name}{split}")
    return "\n".join(lines)


def pick_gguf(names: list[str], tag: str | None, repo: str = "the repo", log: Log | None = None) -> str:
    """The one GGUF file for `tag` (see the module docstring) among the repo's file `names`."""
    groups = _groups(names)
    if not groups:
        raise HubError(f"{repo}: no GGUF model file (files: {', '.join(sorted(names)[:12]) or 'none'})")
    available = _describe(groups.values())

    def matching(t: str) -> list[list[GGUFName]]:
        return [parts for parts in groups.values() if _has_tag(parts[0], t)]

    def one(found: list[list[GGUFName]], t: str) -> str:
        if len(found) > 1:
            raise HubError(f"{repo}: tag {t!r} fits {len(found)} GGUF files; give a longer tag:\n"
                           + _describe(found))
        parts = found[0]
        if parts[0].count > 1:
            raise HubError(f"{repo}: {parts[0].name} is a split GGUF ({parts[0].count} files); gem4 reads "
                           f"single-file GGUFs: merge it (llama-gguf-split --merge) and pass the file")
        return parts[0].name

    if tag is not None:
        found = matching(tag)
        if not found:
            raise HubError(f"{repo}: no GGUF file with tag {tag!r}; available:\n{available}")
        return one(found, tag)
    for t in DEFAULT_TAGS:
        found = matching(t)
        if found:
            chosen = one(found, t)
            break
    else:
        chosen = one([next(iter(groups.values()))], "")
    if log is not None and len(groups) > 1:
        log(f"gem4: {repo}: no :TAG given, using {chosen}; available:\n{available}")
    return chosen


def checkpoint_files(names: list[str], index: dict | None, repo: str = "the repo") -> list[str]:
    """The files of an HF checkpoint that gem4 uses (see the module docstring). `index` is the parsed
    model.safetensors.index.json when the repo has one."""
    top = {n for n in names if "/" not in n}
    if "config.json" not in top:
        raise HubError(f"{repo}: neither a GGUF nor an HF checkpoint (no config.json; files: "
                       f"{', '.join(sorted(names)[:12]) or 'none'})")
    chosen = [n for n in CHECKPOINT_FILES if n in top]
    if index is not None:
        try:
            shards = sorted(set(index["weight_map"].values()))
        except (KeyError, AttributeError, TypeError):
            raise HubError(f"{repo}: {INDEX} has no weight_map") from None
        missing = [s for s in shards if s not in top]
        if missing:
            raise HubError(f"{repo}: {INDEX} names shards the repo does not have: {', '.join(missing)}")
        return chosen + [INDEX] + shards
    weights = sorted(n for n in top if fnmatch.fnmatch(n, "*.safetensors"))
    if not weights:
        raise HubError(f"{repo}: no *.safetensors weights at the top level of the repo")
    return chosen + weights


# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------


def file_hashes(path: Path, git: bool) -> tuple[str, str | None]:
    """-> (sha256, git blob sha1 or None), reading the file once in 8 MiB pieces."""
    sha256 = hashlib.sha256()
    sha1 = None
    if git:
        sha1 = hashlib.sha1()
        sha1.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            sha256.update(chunk)
            if sha1 is not None:
                sha1.update(chunk)
    return sha256.hexdigest(), (sha1.hexdigest() if sha1 is not None else None)


def _claims(entry: RepoFile, blob: Path) -> list[tuple[str, str, str]]:
    """(algorithm, expected hex, who says so). The blob's name is the hub's ETag: a SHA-256 for LFS
    files; a 40-hex name (git blob id) is used only when the listing gave no hash."""
    claims = []
    if entry.sha256:
        claims.append(("sha256", entry.sha256.lower(), "the hub's listing (lfs.sha256)"))
    elif entry.git_sha1:
        claims.append(("git-sha1", entry.git_sha1.lower(), "the hub's listing (git blob id)"))
    if _SHA256.fullmatch(blob.name):
        claims.append(("sha256", blob.name, "the ETag the file was downloaded under"))
    elif _SHA1.fullmatch(blob.name) and not claims:
        claims.append(("git-sha1", blob.name, "the ETag the file was downloaded under"))
    return claims


def _marker(snapshot: Path, name: str) -> Path:
    # snapshot = <cache>/models--owner--name/snapshots/<commit>
    return snapshot.parent.parent / VERIFIED_DIR / snapshot.name / name


def verify(snapshot: Path, entry: RepoFile, repo: str) -> Path:
    """Check `snapshot/entry.name` against every hash vouched for it (once per blob; see the module
    docstring). -> the path. A mismatch removes the blob and its link, then raises HubError."""
    path = snapshot / entry.name
    blob = path.resolve()
    if not blob.is_file():
        raise HubError(f"{repo}: {entry.name}: the cache links it to {blob}, which is missing")
    st = blob.stat()
    stamp = f"{st.st_size} {st.st_mtime_ns}"
    marker = _marker(snapshot, entry.name)
    try:
        if marker.read_text() == stamp:
            return path
    except OSError:
        pass
    claims = _claims(entry, blob)
    if not claims:
        raise HubError(f"{repo}: {entry.name}: the hub gave no hash for this file, so it cannot be verified")
    sha256, sha1 = file_hashes(blob, git=any(a == "git-sha1" for a, _, _ in claims))
    actual = {"sha256": sha256, "git-sha1": sha1}
    for algorithm, expected, source in claims:
        if actual[algorithm] != expected:
            for p in (path, blob, marker):
                try:
                    p.unlink()
                except OSError:
                    pass
            raise HubError(f"{repo}: {entry.name} failed verification: {source} gives {algorithm} {expected}, "
                           f"the downloaded bytes hash to {actual[algorithm]}; the file was deleted (a later "
                           f"run downloads it again)")
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(stamp)
    except OSError:                     # a read-only cache: verify again next time
        pass
    return path


# ---------------------------------------------------------------------------------------------
# Listing and downloading
# ---------------------------------------------------------------------------------------------


def _human(n: int | None) -> str:
    if n is None:
        return "? B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _unreachable(error: BaseException) -> bool:
    """True for the failures after which the cache may stand in for the hub."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(error, (httpx2.TransportError, OfflineModeIsEnabled)):
        return True
    if isinstance(error, HfHubHTTPError) and error.response is not None:
        return error.response.status_code >= 500 or error.response.status_code == 429
    return False


def _listing_online(ref: ModelRef, endpoint: str | None) -> tuple[str, dict[str, RepoFile]]:
    """-> (commit, files) from the hub's model info. Raises HubError, or the connection error."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                       RevisionNotFoundError)

    try:
        info = HfApi(endpoint=endpoint).model_info(ref.repo_id, files_metadata=True)
    except GatedRepoError:
        raise HubError(f"{ref.repo_id} is gated: accept its terms on the hub, then set HF_TOKEN") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise HubError(f"{ref.repo_id}: no such local path, and no such model repo on {_endpoint(endpoint)} "
                       f"(a private one needs HF_TOKEN)") from None
    except HfHubHTTPError as e:
        if _unreachable(e):
            raise
        raise HubError(f"{ref.repo_id}: the hub at {_endpoint(endpoint)} answered {e}") from None
    files = {}
    for s in info.siblings or []:
        lfs = s.lfs
        files[s.rfilename] = RepoFile(s.rfilename, s.size, lfs.get("sha256") if lfs else None, s.blob_id)
    if not info.sha:
        raise HubError(f"{ref.repo_id}: the hub's model info names no commit")
    return info.sha, files


def _listing_cached(ref: ModelRef, cache_dir: str | None, why: str) -> tuple[Path, dict[str, RepoFile]]:
    """-> (snapshot folder, files) of the repo's cached main branch."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(ref.repo_id, cache_dir=cache_dir, local_files_only=True))
    except LocalEntryNotFoundError:
        raise HubError(f"{ref.repo_id}: no such local path, not in the hub cache ({_cache(cache_dir)}), and "
                       f"{why}") from None
    files = {}
    for p in sorted(snapshot.rglob("*")):
        if p.is_file():
            name = p.relative_to(snapshot).as_posix()
            files[name] = RepoFile(name, p.stat().st_size)
    return snapshot, files


def _endpoint(endpoint: str | None) -> str:
    from huggingface_hub import constants

    return endpoint or constants.ENDPOINT


def _cache(cache_dir: str | None) -> str:
    from huggingface_hub import constants

    return str(cache_dir or constants.HF_HUB_CACHE)


def pull(model: str | ModelRef, log: Log | None = None, *, endpoint: str | None = None,
         cache_dir: str | os.PathLike | None = None, offline: bool | None = None) -> Path:
    """Download (or find in the cache) the model `owner/name[:TAG]` names. -> the GGUF file, or the
    checkpoint directory (a snapshot folder of the cache). `endpoint`, `cache_dir` and `offline` default
    to huggingface_hub's (HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE)."""
    import httpx2
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    ref = model if isinstance(model, ModelRef) else parse_ref(model)
    if ref is None:
        raise HubError(f"{model!r} is not a hub model id (owner/name or owner/name:TAG)")
    say = log or (lambda message: None)
    cache_dir = None if cache_dir is None else str(cache_dir)
    offline = constants.is_offline_mode() if offline is None else offline

    snapshot: Path | None = None
    commit = None
    if offline:
        snapshot, files = _listing_cached(ref, cache_dir, "offline mode is on (HF_HUB_OFFLINE)")
    else:
        try:
            commit, files = _listing_online(ref, endpoint)
        except Exception as e:  # noqa: BLE001 - only the failures `_unreachable` names fall back
            if not _unreachable(e):
                raise
            why = f"the hub at {_endpoint(endpoint)} cannot be reached ({type(e).__name__}: {e})"
            snapshot, files = _listing_cached(ref, cache_dir, why)
            say(f"gem4: {why}; using the cached copy of {ref.repo_id} ({snapshot.name[:12]})")
            offline = True

    def fetch(name: str) -> Path:
        """The verified file `name` of the snapshot, downloaded when it is not cached yet."""
        nonlocal snapshot
        entry = files[name]
        if offline:
            path = snapshot / name
        else:
            if try_to_load_from_cache(ref.repo_id, name, cache_dir=cache_dir, revision=commit) is None:
                say(f"gem4: {ref.repo_id}: downloading {name} ({_human(entry.size)})")
            try:
                path = Path(hf_hub_download(ref.repo_id, name, cache_dir=cache_dir, endpoint=endpoint))
            except (OSError, httpx2.HTTPError) as e:   # huggingface_hub's errors are OSErrors
                raise HubError(f"{ref.repo_id}: {name} could not be downloaded ({type(e).__name__}: {e})") from None
            root = path.parents[len(PurePosixPath(name).parts) - 1]
            if root.name != commit:
                raise HubError(f"{ref.repo_id} changed while downloading (commit {commit} -> {root.name}): "
                               f"run again")
            snapshot = root
            if entry.size is not None and path.stat().st_size != entry.size:
                raise HubError(f"{ref.repo_id}: {name} has {path.stat().st_size} bytes, the hub lists {entry.size}")
        return verify(snapshot, entry, ref.repo_id)

    names = sorted(files)
    if _groups(names):
        return fetch(pick_gguf(names, ref.tag, ref.repo_id, log))
    if ref.tag is not None:
        raise HubError(f"{ref.repo_id}: a :TAG picks a GGUF file, and this repo has none")
    index = None
    if INDEX in files:
        text = fetch(INDEX).read_text()
        try:
            index = json.loads(text)
        except ValueError as e:
            raise HubError(f"{ref.repo_id}: {INDEX} is not valid JSON ({e})") from None
    for name in checkpoint_files(names, index, ref.repo_id):
        fetch(name)
    assert snapshot is not None
    return snapshot
