"""26B-A4B's routed experts streamed from disk: N slots per layer filled on demand (the expert store interface
and the resident store are in model/experts.py).

- `SlotCache`: N slots per layer, one byte slab [N, stride] whose records hold both weights of one expert
  (`SlotLayout`). A group holds at most N experts; its misses are read into the slots of evicted experts in
  parallel on a small thread pool (preadv and the repack release the GIL). Eviction is LFU with recency as
  the tie-break: the victim is the slot whose expert has been used in the fewest steps so far (counts kept
  per expert across evictions, so popular experts win back their slot), the least recently used among
  equals, never an expert of the group being loaded. Groups come in ascending expert order, so the sum over
  experts runs in the resident path's order: logits are bit-identical for every slot count from top_k up.
  With fewer slots than a prefill chunk's experts, the chunk runs in several groups (bounded tiles), each
  expert read at most once per chunk. The layer calls `prefetch` with the router's choice before its dense
  branch, so a step's reads (when its experts fit in the slots) overlap that branch.

Where a miss is read from (the choice measured in benchmarks/RESULTS.md E):

- `RepackedSource` (the fast mode, packed experts): a one-time copy of the experts in slot layout,
  `$GEM4_CACHE/experts/<key>/layer-NN.bin` (`repacked_layers`), each expert one page-aligned record read
  straight into its slot with O_DIRECT -- no repack, no copy. On the 26B-A4B-shaped file in an 8 GB cgroup a
  decode step took 463 ms reading the GGUF (the repack and the copy into the slot cost 215 ms of CPU a step
  on two cores) and 366 ms reading the copy. The copy is built on first use (15.6 GB for 26B-A4B Q4_0 when
  its rows were padded to whole groups of 16 blocks -- Q8_0 / Q4_0 are not padded along k since their 16-row
  panels; 82 s here), named by the GGUF's path, size and mtime and
  the layouts, and listed in a manifest with each layer file's size and SHA-256 (checked against a re-read
  when built; sizes and identity checked at every load); a new copy of a path removes the path's older ones.
  Without room on disk for it, misses are read from the GGUF.
- `GGUFSource` (float32 / dense experts, or no room for the copy): a GGUF expert tensor [E, rows, k] stores
  expert e as one contiguous byte range, read and converted into the slot.

Reads bypass the page cache (O_DIRECT, `RawFile`) where the file system allows it: under a memory cap that
counts the page cache (a cgroup), buffered reads of a step's misses pushed the runtime's own file pages (the
shared libraries' code) out and decode ran 2.8x slower; without a cap both read at the same speed.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from gem4.procfs import proc_bytes
from gem4.weights.expert_files import GB, ExpertTensor, RawFile, SlotLayout, aligned_bytes, repacked_layers

EXPERT_NAMES = ("gate_up_proj", "down_proj")
READ_THREADS = 4            # misses of one group read at once (a decode step's top_k of one layer: 8)


@dataclass
class ExpertStats:
    hits: int = 0           # (layer, step group, expert) uses found in a slot
    misses: int = 0         # ... read from disk
    bytes_read: int = 0


class ExpertFile:
    """The GGUF (and the repacked layer files, `layer_files`) opened once for all layers' slot caches, the
    read pool, and the counters they share."""

    def __init__(self, path: str | os.PathLike, threads: int = READ_THREADS):
        self.path = Path(path)
        self.gguf = RawFile(self.path)
        self.layer_files: list[RawFile] = []
        self.repacked: Path | None = None                      # the repacked copy's directory, if read from
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gem4-experts")
        self.stats = ExpertStats()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for f in [self.gguf, *self.layer_files]:
            f.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class GGUFSource:
    """Misses read from the GGUF's expert tensors, one range per weight, converted into the slot."""

    def __init__(self, file: ExpertFile, tensors: dict[str, ExpertTensor]):
        self.file, self.tensors = file, tensors
        self.nbytes = sum(t.nbytes for t in tensors.values())

    def jobs(self, e: int, slot: dict[str, torch.Tensor], record: torch.Tensor) -> list[Callable[[], None]]:
        return [lambda name=name, t=t: slot[name].copy_(t.expert(self.file.gguf, e)) for name, t in self.tensors.items()]


class RepackedSource:
    """Misses read from a repacked layer file (`repacked_layers`): expert e's record at e * stride, read
    straight into the slot's record."""

    def __init__(self, file: RawFile, stride: int):
        self.file, self.stride, self.nbytes = file, stride, stride

    def jobs(self, e: int, slot: dict[str, torch.Tensor], record: torch.Tensor) -> list[Callable[[], None]]:
        return [lambda: self.file.read_into(record, e * self.stride)]


class SlotCache:
    """One layer's N slots (see the module docstring): `slab` uint8 [N, stride], `views` name -> [N, *shape]
    (what Experts computes from), misses filled from `source`."""

    streamed = True

    def __init__(self, file: ExpertFile, source, num_experts: int, slots: int, layout: SlotLayout):
        self.file, self.source = file, source
        self.slab = aligned_bytes(slots * layout.stride).view(slots, layout.stride)      # committed as filled
        self.views = layout.views(self.slab)
        self.num_experts, self.slots = num_experts, slots
        self.slot_of = [-1] * num_experts          # expert -> slot, -1 if not held
        self.held = [-1] * slots                   # slot -> expert, -1 if empty
        self.uses = [0] * num_experts              # LFU: steps that used each expert (kept across evictions)
        self.last = [-1] * slots                   # recency tie-break: clock of the slot's last use
        self.clock = 0
        self.misses = 0                            # this layer's share of file.stats.misses
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
        self.misses += len(fills)
        stats.bytes_read += len(fills) * self.source.nbytes
        return [((e, s), self.file.pool.submit(job)) for e, s in fills
                for job in self.source.jobs(e, {name: v[s] for name, v in self.views.items()}, self.slab[s])]


# memory_limit is the process's budget: besides the weights it holds the runtime already in memory when the
# load starts (Python, torch, the compiled kernels: process_rss) and this working reserve -- measured on the
# 26B-A4B-shaped file: 0.57 GB after a 128-token prefill, 0.8 GB after 512 tokens (activations, the kernels'
# per-thread scratch, the KV cache), and the rest for the page cache the runtime's code runs from (a cgroup
# counts it: squeezed out, the code pages thrash)
WORKING_RESERVE = GB


def process_rss() -> int:
    """The process's resident memory now (VmRSS), in bytes; 0 where /proc does not say."""
    return proc_bytes("/proc/self/status", "VmRSS") or 0


class ExpertCacheError(ValueError):
    """Streamed experts were asked for where they cannot work (names the cause)."""


def _converter(ggml_type, rows: int, k: int, packed: bool, dtype: torch.dtype):
    """One expert's file bytes -> its slot layout, as the resident path binds it: KernelExperts.pack's packed rows (model/cpu.py)
    (packed) or the dense weight in `dtype` (loader: entry.dense().to(dtype))."""
    from gem4.model import kernels
    from gem4.ggml import dequantize, ggml_dtype_view

    if packed:
        return lambda raw: kernels.repack(raw, rows, k, ggml_type)

    def dense(raw: torch.Tensor) -> torch.Tensor:
        view = ggml_dtype_view(raw, ggml_type, (rows, k))
        return (view if view is not None else dequantize(raw, ggml_type, (rows, k))).to(dtype)
    return dense


def stream_experts(model, path, entries: dict, packed: dict[str, bool], dtype: torch.dtype,
                   slots: int | None = None, memory_limit: float | None = None, resident_bytes: int = 0,
                   runtime_bytes: int = 0) -> ExpertFile:
    """Load time: every MoE layer's Experts gets a SlotCache over the GGUF at `path` (or its repacked copy:
    packed experts, room on disk).

    entries: canonical name ("layers.i.experts.gate_up_proj" / ...down_proj) -> TensorEntry (with `offset`);
    packed: name -> kept in the kernels' packed layout (the loader's choice for the resident path). The slot
    count is `slots` (top_k <= slots; more than E is E) or what `memory_limit` GB -- the whole process --
    leaves after the runtime (`runtime_bytes`, the process's memory before the weights), the
    `resident_bytes` of the other weights and WORKING_RESERVE, divided among the layers; a long context's
    KV cache comes on top. Returns the shared ExpertFile (`slots`, `stats`, `slot_bytes`: one slot in every
    layer)."""
    from gem4.ggml import GGMLType

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
                is_packed = packed[entry.name]
                if entry.stream is not None:            # MLX: one expert at a time from its own byte ranges
                    tensors[name] = entry.stream(is_packed, dtype)
                    if is_packed:
                        types[name] = tensors[name].ggml_type
                    continue
                if entry.offset is None:
                    raise ExpertCacheError(f"{path}: tensor {entry.name!r} has no file offset to stream from")
                if entry.nbytes % moe.num_experts:
                    raise ExpertCacheError(f"{path}: tensor {entry.name!r}: {entry.nbytes} bytes are not "
                                           f"{moe.num_experts} equal experts")
                rows, k = entry.shape[1:]
                ggml_type = GGMLType[entry.stored]
                tensors[name] = ExpertTensor(entry.offset, entry.nbytes // moe.num_experts,
                                             _converter(ggml_type, rows, k, is_packed, dtype))
                if is_packed:
                    types[name] = ggml_type
            # the layer's slot layout (shapes, dtypes, bytes) from its expert 0: types may differ between
            # layers (llama.cpp's Q4_K_M keeps some layers' down_proj in Q8_0, the others in Q5_0)
            layout = SlotLayout.of({name: t.expert(file.gguf, 0) for name, t in tensors.items()})
            per_layer.append((layer, tensors, types, layout))
        slot_bytes = sum(layout.stride for *_, layout in per_layer)             # one slot in every layer
        if slots is None:
            reserve = runtime_bytes + WORKING_RESERVE
            room = memory_limit * GB - resident_bytes - reserve
            slots = int(max(room, 0) // slot_bytes)
            if slots < moe.top_k:
                need = (reserve + resident_bytes + moe.top_k * slot_bytes) / GB
                raise ExpertCacheError(
                    f"memory_limit {memory_limit:g} GB leaves room for {slots} expert slots per layer "
                    f"(the other weights take {resident_bytes / GB:.2f} GB, the runtime and working memory "
                    f"{reserve / GB:.2f} GB, one slot in each of the {len(layers)} layers {slot_bytes / 1e6:.1f} MB); "
                    f"top_k = {moe.top_k} need at least {need:.2f} GB")
        elif slots < moe.top_k:
            raise ExpertCacheError(f"expert_cache_slots {slots} is fewer than the {moe.top_k} experts a token "
                                   f"uses (top_k): give at least {moe.top_k}")
        slots = min(int(slots), moe.num_experts)
        all_packed = all(len(types) == len(EXPERT_NAMES) for _, _, types, _ in per_layer)
        if all_packed:
            file.repacked = repacked_layers(Path(path), [(t, layout) for _, t, _, layout in per_layer],
                                            moe.num_experts, file.gguf)
        if file.repacked is not None:
            file.layer_files = [RawFile(file.repacked / f"layer-{i:02d}.bin") for i in range(len(per_layer))]
        for i, (layer, tensors, types, layout) in enumerate(per_layer):
            source = (RepackedSource(file.layer_files[i], layout.stride) if file.repacked is not None
                      else GGUFSource(file, tensors))
            store = SlotCache(file, source, moe.num_experts, slots, layout)
            layer.experts.stream(store, store.views, types)
    except BaseException:
        file.close()
        raise
    file.slots, file.slot_bytes, file.layers = slots, slot_bytes, len(layers)
    return file


def expert_cache_summary(cache: ExpertFile) -> str:
    """One line for the CLI and the server's log: slots and the memory they take."""
    return (f"expert cache: {cache.slots} slots per layer x {cache.layers} layers, "
            f"{cache.slot_bytes * cache.slots / GB:.2f} GB of slots, experts read from "
            f"{cache.repacked if cache.repacked is not None else cache.path.name}")
