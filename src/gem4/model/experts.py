"""26B-A4B's routed experts behind one interface: resident (every expert loaded at bind) or slot-cached
(streamed from the GGUF on demand, issue 17).

`Experts` (gemma4.py) holds the weights as a slab of slots -- gate_up_proj and down_proj in the layout the
resident path uses (Experts.pack's [slots * rows, ...] x16 rows in the fast mode, dense [slots, rows, k]
otherwise) -- and asks its store which slot holds expert e. The layer's forward hands the store the sorted
list of experts a step uses; `tiles(used)` yields them in groups that are all in slots before any of them is
computed:

- `Resident`: slot = expert, one group (the whole file bound at load, as without the options).
- `SlotCache`: N slots per layer. A group holds at most N experts; its misses are read from the file with
  os.preadv (one descriptor for the model, `ExpertFile`; the misses of a group read and converted in
  parallel on a small thread pool -- preadv and the repack release the GIL) into the slots of evicted
  experts. Eviction is LFU with recency as the tie-break: the victim is the slot whose expert has been used
  in the fewest steps so far (counts kept per expert across evictions, so popular experts win back their
  slot), the least recently used among equals, never an expert of the group being loaded. Groups come in
  ascending expert order, so the sum over experts runs in the resident path's order: logits are
  bit-identical for every slot count from top_k up. With fewer slots than a prefill chunk's experts, the
  chunk runs in several groups (bounded tiles), each expert read at most once per chunk. The layer calls
  `prefetch` with the router's choice before its dense branch, so a step's reads (when its experts fit in
  the slots) overlap that branch.

Where each expert lies: a GGUF expert tensor [E, rows, k] stores expert e as the contiguous byte range
[offset + e * rows * row_bytes, +rows * row_bytes), read straight from the file (no repacked copy on disk:
one pread per expert weight is already one sequential read).
"""
from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

EXPERT_NAMES = ("gate_up_proj", "down_proj")
READ_THREADS = 4            # misses of one group read at once (a decode step's top_k of one layer: 8)


class Resident:
    """Every expert in its own slot (slot = expert id): the plain path."""

    streamed = False

    def prefetch(self, idx: torch.Tensor) -> None:
        pass

    def tiles(self, used: list[int]) -> Iterator[list[int]]:
        yield used

    def slot(self, e: int) -> int:
        return e


@dataclass
class ExpertStats:
    hits: int = 0           # (layer, step group, expert) uses found in a slot
    misses: int = 0         # ... read from the file
    bytes_read: int = 0


DIRECT_ALIGN = 4096         # O_DIRECT: file offsets, lengths and buffer addresses in multiples of this


class ExpertFile:
    """The GGUF opened once for all layers' slot caches, the read pool, and the counters they share.

    Reads bypass the page cache (O_DIRECT) where the file system allows it: under a memory cap that counts
    the page cache (a cgroup), buffered reads of a step's misses pushed the runtime's own file pages (the
    shared libraries' code) out and decode ran 2.8x slower; without a cap both read at the same speed
    (benchmarks/RESULTS.md E). Elsewhere (tmpfs, some network file systems) reads are buffered."""

    def __init__(self, path: str | os.PathLike, threads: int = READ_THREADS):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.direct = -1                                       # an O_DIRECT descriptor, or -1: buffered reads
        if hasattr(os, "O_DIRECT"):
            try:
                self.direct = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                pass
        self.use_direct = self.direct >= 0
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gem4-experts")
        self.stats = ExpertStats()

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        """nbytes at offset -> a uint8 tensor [nbytes] of its own memory (short reads retried; EOF is an error)."""
        if self.use_direct:
            try:
                return self._read_direct(offset, nbytes)
            except OSError as e:                               # EINVAL: this file system refuses direct reads
                if e.errno != errno.EINVAL:
                    raise
                self.use_direct = False
        out = torch.empty(nbytes, dtype=torch.uint8)
        self._fill(self.fd, out, offset, nbytes)
        return out

    def _read_direct(self, offset: int, nbytes: int) -> torch.Tensor:
        """The aligned pages around [offset, offset + nbytes) into an aligned buffer; -> the bytes asked for."""
        start = offset // DIRECT_ALIGN * DIRECT_ALIGN
        end = -(-(offset + nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN
        raw = torch.empty(end - start + DIRECT_ALIGN, dtype=torch.uint8)
        pad = -raw.data_ptr() % DIRECT_ALIGN
        pages = raw[pad:pad + end - start]
        self._fill(self.direct, pages, start, offset + nbytes - start)      # the last page may end at EOF
        return pages[offset - start:offset - start + nbytes]

    def _fill(self, fd: int, out: torch.Tensor, offset: int, need: int) -> None:
        """Read at least `need` bytes of out (uint8, contiguous) from fd at offset."""
        view, done = memoryview(out.numpy()), 0
        while done < need:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{self.path}: expert bytes [{offset}, {offset + need}) run past the end of the file")
            done += n

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for name in ("fd", "direct"):
            if getattr(self, name) >= 0:
                os.close(getattr(self, name))
                setattr(self, name, -1)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


@dataclass(frozen=True)
class ExpertTensor:
    """One expert weight of one layer in the file: [E, rows, k] at `offset`, expert e `nbytes` long at
    offset + e * nbytes; `convert` turns those bytes into the slot's layout ([rows, ...])."""
    offset: int
    nbytes: int
    convert: Callable[[torch.Tensor], torch.Tensor]


class SlotCache:
    """One layer's N slots (see the module docstring). `slabs` name -> the slot slab Experts computes from."""

    streamed = True

    def __init__(self, file: ExpertFile, tensors: dict[str, ExpertTensor], num_experts: int, slots: int,
                 slabs: dict[str, torch.Tensor]):
        self.file, self.tensors, self.slabs = file, tensors, slabs
        self.num_experts, self.slots = num_experts, slots
        self.slot_of = [-1] * num_experts          # expert -> slot, -1 if not held
        self.held = [-1] * slots                   # slot -> expert, -1 if empty
        self.uses = [0] * num_experts              # LFU: steps that used each expert (kept across evictions)
        self.last = [-1] * slots                   # recency tie-break: clock of the slot's last use
        self.clock = 0
        self.pending: tuple[list[int], list] | None = None        # prefetch: (group, its reads in flight)

    def slot(self, e: int) -> int:
        return self.slot_of[e]

    def prefetch(self, idx: torch.Tensor) -> None:
        """The router's choice idx [T, K], before the layer's dense branch runs: where the step's experts fit
        in one group, their misses start reading now and `tiles` waits for them (the reads overlap the
        dense branch)."""
        used = torch.unique(idx).tolist()                         # ascending, as experts_forward lists them
        if len(used) <= self.slots:
            self.pending = (used, self._start(used))

    def tiles(self, used: list[int]) -> Iterator[list[int]]:
        """used (ascending expert ids) -> groups of at most `slots`, each loaded before it is yielded."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._wait(pending[1])
        for start in range(0, len(used), self.slots):
            group = used[start:start + self.slots]
            if pending is None or pending[0] != group:
                self.load(group)
            yield group

    def load(self, group: list[int]) -> None:
        self._wait(self._start(group))

    def _wait(self, reads: list) -> None:
        """Block on a group's reads; a failed read empties its slot (never a hit on bytes not read) and raises."""
        error = None
        for (e, s), future in reads:
            try:
                future.result()
            except BaseException as exc:                        # noqa: BLE001  re-raised below
                error = error or exc
                if self.held[s] == e:
                    self.held[s], self.slot_of[e], self.last[s] = -1, -1, -1
        if error is not None:
            raise error

    def _start(self, group: list[int]) -> list:
        """Bookkeeping of a group (uses, hits, victims) and its misses' reads submitted: -> [((e, slot), future)]."""
        self.clock += 1
        stats, misses = self.file.stats, []
        for e in group:
            self.uses[e] += 1
            if self.slot_of[e] >= 0:
                stats.hits += 1
                self.last[self.slot_of[e]] = self.clock
            else:
                misses.append(e)
        if not misses:
            return []
        # victims: empty slots first, then the least used experts, least recently used among equals; the
        # group's own experts were all stamped with this clock, and a group never exceeds the slots
        free = sorted((s for s in range(self.slots) if self.last[s] != self.clock),
                      key=lambda s: (self.held[s] >= 0, self.uses[self.held[s]] if self.held[s] >= 0 else 0,
                                     self.last[s]))
        fills = []
        for e, s in zip(misses, free):
            old = self.held[s]
            if old >= 0:
                self.slot_of[old] = -1
            self.held[s], self.slot_of[e], self.last[s] = e, s, self.clock
            fills.append((e, s))
        stats.misses += len(fills)
        stats.bytes_read += len(fills) * sum(t.nbytes for t in self.tensors.values())
        return [((e, s), self.file.pool.submit(self._fill, e, s, name)) for e, s in fills for name in self.tensors]

    def _fill(self, e: int, s: int, name: str) -> None:
        t = self.tensors[name]
        slot = t.convert(self.file.read(t.offset + e * t.nbytes, t.nbytes))       # [rows, ...]
        slab = self.slabs[name]
        rows = slot.shape[0]
        if slab.dim() == slot.dim():                                             # packed: [slots * rows, ...]
            slab[s * rows:(s + 1) * rows].copy_(slot)
        else:                                                                    # dense: [slots, rows, k]
            slab[s].copy_(slot)


GB = 10 ** 9                # memory_limit's unit (decimal, as file sizes are quoted)
# memory_limit is the process's budget: besides the weights it holds the runtime already in memory when the
# load starts (Python, torch, the compiled kernels: process_rss) and this working reserve -- a prefill chunk's
# activations, the read buffers of a step's misses, the KV cache of a short context
WORKING_RESERVE = GB // 2


def process_rss() -> int:
    """The process's resident memory now (VmRSS), in bytes; 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class ExpertCacheError(ValueError):
    """Streamed experts were asked for where they cannot work (names the cause)."""


def _converter(ggml_type, rows: int, k: int, packed: bool, dtype: torch.dtype):
    """One expert's file bytes -> its slot layout, as the resident path binds it: Experts.pack's x16 rows
    (packed) or the dense weight in `dtype` (loader: entry.dense().to(dtype))."""
    from gem4.model import kernels
    from gem4.weights.quants import dequantize, ggml_dtype_view

    if packed:
        return lambda raw: kernels.repack(raw, rows, k, ggml_type)

    def dense(raw: torch.Tensor) -> torch.Tensor:
        view = ggml_dtype_view(raw, ggml_type, (rows, k))
        return (view if view is not None else dequantize(raw, ggml_type, (rows, k))).to(dtype)
    return dense


def stream_experts(model, path, entries: dict, packed: dict[str, bool], dtype: torch.dtype,
                   slots: int | None = None, memory_limit: float | None = None, resident_bytes: int = 0,
                   runtime_bytes: int = 0) -> ExpertFile:
    """Load time: every MoE layer's Experts gets a SlotCache over the GGUF at `path`.

    entries: canonical name ("layers.i.experts.gate_up_proj" / ...down_proj) -> TensorEntry (with `offset`);
    packed: name -> kept in the kernels' x16 layout (the loader's choice for the resident path). The slot
    count is `slots` (top_k <= slots; more than E is E) or what `memory_limit` GB -- the whole process --
    leaves after the runtime (`runtime_bytes`, the process's memory before the weights), the
    `resident_bytes` of the other weights and WORKING_RESERVE, divided among the layers; a long context's
    KV cache comes on top. Returns the shared ExpertFile (`slots`, `stats`, `slot_bytes`)."""
    from gem4.weights.quants import GGMLType

    moe = model.config.moe
    if (slots is None) == (memory_limit is None):
        raise ExpertCacheError("give one of expert_cache_slots and memory_limit")
    layers = [layer for layer in model.layers if hasattr(layer, "experts")]
    file = ExpertFile(path)
    try:
        per_layer = []
        for layer in layers:
            tensors, types = {}, {}
            for name in EXPERT_NAMES:
                entry = entries[f"layers.{layer.spec.index}.experts.{name}"]
                if entry.offset is None:
                    raise ExpertCacheError(f"{path}: tensor {entry.name!r} has no file offset to stream from")
                if entry.nbytes % moe.num_experts:
                    raise ExpertCacheError(f"{path}: tensor {entry.name!r}: {entry.nbytes} bytes are not "
                                           f"{moe.num_experts} equal experts")
                rows, k = entry.shape[1:]
                ggml_type = GGMLType[entry.stored]
                is_packed = packed[entry.name]
                tensors[name] = ExpertTensor(entry.offset, entry.nbytes // moe.num_experts,
                                             _converter(ggml_type, rows, k, is_packed, dtype))
                if is_packed:
                    types[name] = ggml_type
            per_layer.append((layer, tensors, types))
        # one expert's slot layout (shape, dtype, bytes) from expert 0 of the first layer
        sample = {name: t.convert(file.read(t.offset, t.nbytes)) for name, t in per_layer[0][1].items()}
        slot_bytes = sum(s.nbytes for s in sample.values())
        if slots is None:
            reserve = runtime_bytes + WORKING_RESERVE
            room = memory_limit * GB - resident_bytes - reserve
            slots = int(max(room, 0) // (slot_bytes * len(layers)))
            if slots < moe.top_k:
                need = (reserve + resident_bytes + moe.top_k * slot_bytes * len(layers)) / GB
                raise ExpertCacheError(
                    f"memory_limit {memory_limit:g} GB leaves room for {slots} expert slots per layer "
                    f"(the other weights take {resident_bytes / GB:.2f} GB, the runtime and working memory "
                    f"{reserve / GB:.2f} GB, one expert {slot_bytes / 1e6:.2f} MB x {len(layers)} layers); "
                    f"top_k = {moe.top_k} need at least {need:.2f} GB")
        elif slots < moe.top_k:
            raise ExpertCacheError(f"expert_cache_slots {slots} is fewer than the {moe.top_k} experts a token "
                                   f"uses (top_k): give at least {moe.top_k}")
        slots = min(int(slots), moe.num_experts)
        for layer, tensors, types in per_layer:
            slabs = {}
            for name, s in sample.items():
                shape = (slots * s.shape[0], *s.shape[1:]) if name in types else (slots, *s.shape)
                slabs[name] = torch.zeros(shape, dtype=s.dtype)
            store = SlotCache(file, tensors, moe.num_experts, slots, slabs)
            layer.experts.stream(store, slabs, types)
    except BaseException:
        file.close()
        raise
    file.slots, file.slot_bytes, file.layers = slots, slot_bytes, len(layers)
    return file


def expert_cache_summary(cache: ExpertFile) -> str:
    """One line for the CLI and the server's log: slots and the memory they take."""
    return (f"expert cache: {cache.slots} slots per layer x {cache.layers} layers, "
            f"{cache.slot_bytes * cache.slots * cache.layers / GB:.2f} GB of slots, experts read from {cache.path.name}")
