"""Expert weights on disk for streamed experts (weights/expert_stream.py): page-cache-bypassing reads of
byte ranges (`RawFile`), one expert's byte range in a GGUF tensor (`ExpertTensor`), the slot record both
weights of an expert take (`SlotLayout`), and the one-time repacked copy of a GGUF's experts in that record
layout -- per-layer files with a JSON manifest (`repacked_layers`)."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from gem4 import paths

DIRECT_ALIGN = 4096         # O_DIRECT: file offsets, lengths and buffer addresses in multiples of this
REPACK_VERSION = 3          # the repacked files' layout; a change makes new ones (2: Q8_0 / Q4_0 in 16-row panels; 3: x16 tail groups)
GB = 10 ** 9                # sizes in decimal GB, as file sizes are quoted (also memory_limit's unit)


def aligned_bytes(n: int) -> torch.Tensor:
    """A uint8 tensor [n] whose first byte lies on a DIRECT_ALIGN boundary (not zeroed)."""
    raw = torch.empty(n + DIRECT_ALIGN, dtype=torch.uint8)
    pad = -raw.data_ptr() % DIRECT_ALIGN
    return raw[pad:pad + n]


class RawFile:
    """A file read at byte offsets, bypassing the page cache (O_DIRECT) where the file system allows it and
    buffered elsewhere (tmpfs, some network file systems refuse direct reads: EINVAL)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.direct = -1                                       # an O_DIRECT descriptor, or -1
        if hasattr(os, "O_DIRECT"):
            try:
                self.direct = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                pass
        self.use_direct = self.direct >= 0

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        """nbytes at offset -> a uint8 tensor [nbytes] of its own memory (short reads retried; EOF is an error).
        Direct: the aligned pages around the range into an aligned buffer, the bytes asked for a view of it."""
        if self.use_direct:
            start = offset // DIRECT_ALIGN * DIRECT_ALIGN
            end = -(-(offset + nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN
            pages = aligned_bytes(end - start)
            if self._read_direct(pages, start, offset + nbytes - start):   # the last page may end at EOF
                return pages[offset - start:offset - start + nbytes]
        out = torch.empty(nbytes, dtype=torch.uint8)
        self._fill(self.fd, out, offset, nbytes)
        return out

    def read_into(self, out: torch.Tensor, offset: int) -> None:
        """out.numel() bytes at offset into out (uint8, contiguous): direct where out, offset and length are
        aligned (slot records are), else buffered."""
        aligned = (out.data_ptr() | offset | out.numel()) % DIRECT_ALIGN == 0
        if not (aligned and self._read_direct(out, offset, out.numel())):
            self._fill(self.fd, out, offset, out.numel())

    def _read_direct(self, out: torch.Tensor, offset: int, need: int) -> bool:
        """Try a direct read; False where this file is read buffered (the file system said EINVAL)."""
        if not self.use_direct:
            return False
        try:
            self._fill(self.direct, out, offset, need)
            return True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.use_direct = False
            return False

    def _fill(self, fd: int, out: torch.Tensor, offset: int, need: int) -> None:
        """Read at least `need` bytes of out (uint8, contiguous) from fd at offset."""
        view, done = memoryview(out.numpy()), 0
        while done < need:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{self.path}: expert bytes [{offset}, {offset + need}) run past the end of the file")
            done += n

    def close(self) -> None:
        for name in ("fd", "direct"):
            if getattr(self, name, -1) >= 0:
                os.close(getattr(self, name))
                setattr(self, name, -1)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


@dataclass(frozen=True)
class ExpertTensor:
    """One expert weight of one layer in the GGUF: [E, rows, k] at `offset`, expert e `nbytes` long at
    offset + e * nbytes; `convert` turns those bytes into the slot's layout ([rows, ...])."""
    offset: int
    nbytes: int
    convert: Callable[[torch.Tensor], torch.Tensor]

    def expert(self, file: "RawFile", e: int) -> torch.Tensor:
        """Expert e's bytes read from the GGUF `file`, in the slot's layout."""
        return self.convert(file.read(self.offset + e * self.nbytes, self.nbytes))


@dataclass(frozen=True)
class SlotLayout:
    """One expert's weights in a slot record: name -> (byte offset, shape, dtype), each part and the record
    (`stride` bytes) starting on a DIRECT_ALIGN boundary, so a record is read straight into its slot."""
    parts: dict[str, tuple[int, tuple[int, ...], torch.dtype]]
    stride: int

    @staticmethod
    def of(sample: dict[str, torch.Tensor]) -> "SlotLayout":
        """From one expert's converted weights (name -> tensor in the slot layout)."""
        parts, offset = {}, 0
        for name, t in sample.items():
            parts[name] = (offset, tuple(t.shape), t.dtype)
            offset += -(-t.nbytes // DIRECT_ALIGN) * DIRECT_ALIGN
        return SlotLayout(parts, offset)

    def views(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        """records uint8 [n, stride] -> name -> [n, *shape] in its dtype (views)."""
        out = {}
        for name, (offset, shape, dtype) in self.parts.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            out[name] = records[:, offset:offset + nbytes].view(dtype).view(records.shape[0], *shape)
        return out

    def describe(self) -> dict:
        return {"stride": self.stride,
                "parts": {name: [o, list(shape), str(dtype)] for name, (o, shape, dtype) in self.parts.items()}}


def repack_root() -> Path:
    """Where repacked expert files go: `$GEM4_CACHE/experts` (default ~/.cache/gem4/experts)."""
    return paths.experts_dir()


def _sha256_file(path: Path) -> str:
    h, f = hashlib.sha256(), RawFile(path)
    try:
        size = path.stat().st_size
        for offset in range(0, size, 64 << 20):
            h.update(f.read(offset, min(64 << 20, size - offset)).numpy().data)
    finally:
        f.close()
    return h.hexdigest()


def repacked_layers(path: Path, layers: list[tuple[dict[str, ExpertTensor], SlotLayout]], num_experts: int,
                    gguf: RawFile) -> Path | None:
    """The experts of every MoE layer (its GGUF tensors and slot layout: types may differ between layers) in
    slot records, one file per layer (`layer-NN.bin`, expert e at e * stride), in a directory of
    repack_root() named by the GGUF's identity (resolved path, size, mtime) and the layouts; built here the
    first time (each file's SHA-256 taken as written and checked against a re-read), reused after a check of
    the manifest and the file sizes. -> the directory, or None where there is no room for it on disk (the
    caller reads the GGUF then)."""
    st = path.stat()
    ident = {"version": REPACK_VERSION, "source": str(path.resolve()), "size": st.st_size,
             "mtime_ns": st.st_mtime_ns, "experts": num_experts,
             "layouts": [layout.describe() for _, layout in layers]}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    root = repack_root()
    directory = root / key
    if _repacked_ok(directory, ident):
        return directory
    root.mkdir(parents=True, exist_ok=True)
    need = sum(num_experts * layout.stride for _, layout in layers)
    free = shutil.disk_usage(root).free
    if free < need + (1 << 30):
        print(f"gem4: no room to repack the experts into {root} ({need / GB:.1f} GB needed, {free / GB:.1f} GB free): "
              f"reading them from {path.name}", file=sys.stderr, flush=True)
        return None
    print(f"gem4: repacking the experts of {path.name} once into {directory} ({need / GB:.1f} GB)",
          file=sys.stderr, flush=True)
    tmp, stale = root / f"{key}.part-{os.getpid()}", root / f"{key}.stale-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        files = []
        for i, (tensors, layout) in enumerate(layers):
            record = aligned_bytes(layout.stride)
            record.zero_()                                   # the padding between parts stays zero
            slot = {name: v[0] for name, v in layout.views(record.view(1, -1)).items()}
            name = f"layer-{i:02d}.bin"
            h = hashlib.sha256()
            with open(tmp / name, "wb") as f:
                for e in range(num_experts):
                    for part, t in tensors.items():
                        slot[part].copy_(t.expert(gguf, e))
                    data = record.numpy().data
                    f.write(data)
                    h.update(data)
                f.flush()
                os.fsync(f.fileno())
            digest = h.hexdigest()
            if _sha256_file(tmp / name) != digest:
                raise OSError(f"{tmp / name}: the file read back differs from what was written")
            files.append({"file": name, "bytes": num_experts * layout.stride, "sha256": digest})
        (tmp / "manifest.json").write_text(json.dumps(dict(ident, files=files), indent=1) + "\n")
        if directory.exists() and not _repacked_ok(directory, ident):    # damaged: set aside, removed below
            os.rename(directory, stale)
        try:
            os.rename(tmp, directory)
        except OSError:                                  # another process built it meanwhile
            if not _repacked_ok(directory, ident):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
    _remove_superseded(root, directory, ident["source"])
    return directory


def _remove_superseded(root: Path, current: Path, source: str) -> None:
    """Copies of the same GGUF path made for an older file (another size or mtime) or layout: removed once a
    new one is in place (a process still reading one keeps its open files)."""
    for other in root.iterdir():
        if other == current or not other.is_dir():
            continue
        try:
            named = json.loads((other / "manifest.json").read_text()).get("source")
        except (OSError, ValueError):
            continue
        if named == source:
            shutil.rmtree(other, ignore_errors=True)


def _repacked_ok(directory: Path, ident: dict) -> bool:
    """The manifest names this source and these layouts, and every layer file is there at its size."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    files = manifest.pop("files", [])
    sizes = [ident["experts"] * layout["stride"] for layout in ident["layouts"]]
    return (manifest == ident and len(files) == len(sizes)
            and all(f["file"] == f"layer-{i:02d}.bin" and f["bytes"] == size
                    and (directory / f["file"]).is_file() and (directory / f["file"]).stat().st_size == size
                    for i, (f, size) in enumerate(zip(files, sizes))))
