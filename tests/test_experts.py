"""Streamed 26B-A4B experts (weights/expert_stream.py): per-layer slots filled from the GGUF on demand, LFU
eviction, the same logits as the resident experts for every slot count from top_k to E."""
from __future__ import annotations

import os

import pytest
import torch

import gem4
from gem4 import Engine, SamplingParams
from gem4.model import kernels
from gem4.weights import expert_files, expert_stream
from gem4.weights.expert_files import GB, ExpertTensor, RawFile, SlotLayout
from gem4.weights.expert_stream import ExpertCacheError, ExpertFile, GGUFSource, SlotCache
from model_fixtures import build_hf, prompt_ids

E, TOP_K, LAYERS = 8, 2, 6          # the tiny "moe" variant (model_fixtures.VARIANTS)
MODES = [("f32", "float32"), ("q8_0", "bfloat16"), ("q4_0", "bfloat16"),
         ("q4_k_m", "bfloat16")]      # llama.cpp's mix: down_proj Q8_0 in some layers, Q5_0 in the others


@pytest.fixture(autouse=True)
def repack_root(tmp_path_factory, monkeypatch):
    """Repacked expert files go to a directory of this test session, not the user's cache."""
    root = tmp_path_factory.getbasetemp() / "repacked-experts"
    monkeypatch.setattr(expert_files, "repack_root", lambda: root)
    return root


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf

    root = tmp_path_factory.mktemp("moe")
    causal, _ = build_hf("moe")
    causal.save_pretrained(root / "causal")
    files = {}
    for t, _ in MODES:
        files[t] = root / f"{t}.gguf"
        write_gguf(open_checkpoint(root / "causal"), files[t], t)
    return root, files


def steps(model):
    """A 20-token prefill, nine one-token decode steps and a three-token step: their logits [31, V]."""
    cache = model.new_cache()
    out = [model.extend(torch.arange(3, 23), cache, logits=20)]
    out += [model.extend(torch.tensor([t]), cache) for t in (5, 9, 100, 7, 3, 11, 40, 41, 42)]
    out.append(model.extend(torch.tensor([1, 2, 3]), cache, logits=3))
    return torch.cat(out)


def check_counters(model):
    """Every use is a hit or a miss; each miss reads one expert's two weights; no layer reads an expert it
    never used, and with every expert in a slot each is read once."""
    cache, stats = model.expert_cache, model.expert_cache.stats
    stores = [layer.experts.store for layer in model.layers]
    uses = sum(sum(s.uses) for s in stores)
    distinct = sum(sum(u > 0 for u in s.uses) for s in stores)
    assert stats.hits + stats.misses == uses
    assert stats.misses == sum(s.misses for s in stores)
    assert stats.bytes_read == sum(s.misses * s.source.nbytes for s in stores)       # nbytes may differ by layer
    assert stats.misses >= distinct
    if cache.slots == E:
        assert stats.misses == distinct
    for s in stores:                          # the slot maps agree both ways
        assert all(s.held[s.slot_of[e]] == e for e in range(E) if s.slot_of[e] >= 0)
        assert all(s.slot_of[e] == slot for slot, e in enumerate(s.held) if e >= 0)


@pytest.mark.parametrize("gguf,dtype", MODES)
def test_streamed_experts_give_the_resident_logits(moe, gguf, dtype):
    """Bit-identical logits over prefill and decode steps for every slot count top_k..E, float32 (F32 file)
    and the fast mode (Q8_0 / Q4_0 packed; the resident layers decode through kernels.decode_layer, the
    streamed ones through the Python layer)."""
    _, files = moe
    resident = gem4.load(files[gguf], dtype=dtype)
    assert resident.expert_cache is None
    want = steps(resident)
    for slots in range(TOP_K, E + 1):
        model = gem4.load(files[gguf], dtype=dtype, expert_cache_slots=slots)
        assert model.expert_cache.slots == slots
        assert all(getattr(layer, "plan", None) is None for layer in model.layers)   # the Python layer decodes
        got = steps(model)
        assert torch.equal(got, want), (gguf, slots, (got - want).abs().max())
        check_counters(model)
        # the slot slabs hold the resident layout: Experts.pack's x16 rows with the compiled kernels, else dense
        ours, theirs = model.layers[0].experts, resident.layers[0].experts
        assert ours.packed_types == theirs.packed_types
        for name in ("gate_up_proj", "down_proj"):
            mine, resident_w = getattr(ours, name), getattr(theirs, name)
            assert mine.dtype == resident_w.dtype and mine.shape[0] == slots
            assert mine.shape[1:] == resident_w.view(E, -1, resident_w.shape[-1]).shape[1:]


def test_a_prefill_chunk_reads_each_expert_once_in_bounded_tiles(moe):
    """45 tokens route to every expert of a layer; with top_k slots the chunk runs in tiles of two experts
    and still reads each (layer, expert) once, as with E slots: the same misses, no hits."""
    _, files = moe
    ids = prompt_ids()
    counts = {}
    for slots in (TOP_K, E):
        model = gem4.load(files["q8_0"], dtype="bfloat16", expert_cache_slots=slots)
        model.logits(ids)
        counts[slots] = model.expert_cache.stats
        check_counters(model)
    assert counts[TOP_K] == counts[E]
    assert counts[E].hits == 0 and LAYERS * TOP_K < counts[E].misses <= LAYERS * E


def test_batched_requests_decode_the_same_tokens_streamed(moe):
    """Several sequences batched through the Engine (prefill chunks beside decodes, the prefix cache on):
    greedy tokens equal to the resident model's, the slots shared by the whole batch."""
    _, files = moe
    ids = prompt_ids()
    prompts = [ids[0:5], ids[3:30], ids[10:12], ids[1:45], ids[3:30]]
    params = SamplingParams(temperature=0, max_tokens=12)

    def run(model):
        engine = Engine(model, prefill_chunk=8, max_num_seqs=4, max_num_batched_tokens=12)
        streams = [engine.submit(p, params) for p in prompts]
        return [[e.token_id for e in s] for s in streams]

    for gguf, dtype in MODES[:2]:
        want = run(gem4.load(files[gguf], dtype=dtype))
        for slots in (TOP_K, 3, E):
            model = gem4.load(files[gguf], dtype=dtype, expert_cache_slots=slots)
            assert run(model) == want, (gguf, slots)
            check_counters(model)
            assert model.expert_cache.stats.hits > 0


def test_memory_limit_sizes_the_slots(moe, monkeypatch):
    """memory_limit (GB) minus the runtime, the other weights and the working reserve, divided among the
    layers' slots; too little is refused with the numbers."""
    _, files = moe
    runtime = 300_000_000
    monkeypatch.setattr(expert_stream, "process_rss", lambda: runtime)
    reserve = runtime + expert_stream.WORKING_RESERVE
    probe = gem4.load(files["q8_0"], dtype="bfloat16", expert_cache_slots=E)
    cache = probe.expert_cache
    slabs = sum(layer.experts.store.slab.nbytes for layer in probe.layers)
    assert slabs == cache.slot_bytes * E
    resident = sum(t.nbytes for name, t in list(probe.named_parameters()) + list(probe.named_buffers())
                   if ".experts." not in name and not t.is_meta)
    for slots in (TOP_K, 5):
        limit = (reserve + resident + (slots + 0.5) * cache.slot_bytes) / GB       # floors to slots
        model = gem4.load(files["q8_0"], dtype="bfloat16", memory_limit=limit)
        assert model.expert_cache.slots == slots
    assert gem4.load(files["q8_0"], dtype="bfloat16", memory_limit=100).expert_cache.slots == E
    with pytest.raises(ExpertCacheError, match=r"room for 1 expert slots per layer.*top_k = 2"):
        gem4.load(files["q8_0"], dtype="bfloat16",
                  memory_limit=(reserve + resident + 1.5 * cache.slot_bytes) / GB)


def test_streaming_refusals(moe, tmp_path):
    root, files = moe
    with pytest.raises(ExpertCacheError, match="fewer than the 2 experts a token uses"):
        gem4.load(files["q8_0"], expert_cache_slots=1)
    with pytest.raises(ExpertCacheError, match="not both"):
        gem4.load(files["q8_0"], expert_cache_slots=4, memory_limit=8)
    with pytest.raises(ExpertCacheError, match="positive integer"):
        gem4.load(files["q8_0"], expert_cache_slots=0)
    with pytest.raises(ExpertCacheError, match="positive number of GB"):
        gem4.load(files["q8_0"], memory_limit=-1)
    with pytest.raises(ExpertCacheError, match="GGUF file or an MLX checkpoint only"):
        gem4.load(root / "causal", expert_cache_slots=4)
    assert gem4.load(files["q8_0"], expert_cache_slots=100).expert_cache.slots == E     # more than E: E
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf
    dense, _ = build_hf("dense_plain")
    dense.save_pretrained(tmp_path / "dense")
    write_gguf(open_checkpoint(tmp_path / "dense"), tmp_path / "dense.gguf", "q8_0")
    with pytest.raises(ExpertCacheError, match="no routed experts"):
        gem4.load(tmp_path / "dense.gguf", expert_cache_slots=4)


def test_lfu_eviction_with_recency_tie_break(tmp_path):
    """SlotCache over a file of 6 experts (rows 2, k 3, float32): the least used expert goes, the least
    recently used among equals, never one of the group being loaded; slots hold the file's bytes."""
    experts = torch.arange(6 * 2 * 3, dtype=torch.float32).reshape(6, 2, 3)
    path = tmp_path / "experts.bin"
    path.write_bytes(b"\0" * 16 + experts.numpy().tobytes())
    file = ExpertFile(path)
    tensor = ExpertTensor(16, 2 * 3 * 4, lambda raw: raw.view(torch.float32).reshape(2, 3))
    layout = SlotLayout.of({"w": torch.zeros(2, 3)})
    store = SlotCache(file, GGUFSource(file, {"w": tensor}), 6, 2, layout)
    slab = store.views["w"]                              # [slots, 2, 3]

    def held():
        return sorted(e for e in store.held if e >= 0)

    list(store.tiles([0, 1]))
    store.load([0])                      # uses: 0 -> 2, 1 -> 1
    store.load([2])                      # evicts 1 (fewer uses)
    assert held() == [0, 2]
    store.load([2])                      # uses: 0 -> 2, 2 -> 2; 0 less recent
    store.load([3])                      # equal uses: evicts 0, the least recently used
    assert held() == [2, 3]
    for _ in range(3):
        store.load([2])                  # uses: 2 -> 5, 3 -> 1
    store.load([3, 4])                   # 3 is in the group: 2 goes although 3 is used less (2 uses)
    assert held() == [3, 4]
    store.load([1])                      # 1's use before its eviction counts: 2 uses now; evicts 4 (1 use)
    assert held() == [1, 3]
    store.load([5])                      # 1 and 3 both used twice: evicts 3, the less recent
    assert held() == [1, 5]
    for slot, e in enumerate(store.held):
        assert torch.equal(slab[slot], experts[e])
    assert (file.stats.hits, file.stats.misses) == (6, 7)
    assert file.stats.bytes_read == 7 * 24
    assert [g for g in store.tiles([0, 2, 4, 5])] == [[0, 2], [4, 5]]       # tiles of at most `slots`
    store.prefetch(torch.tensor([[3, 1]]))               # reads start before the layer's dense branch
    assert store.pending is not None and held() == [1, 3]
    assert list(store.tiles([1, 3])) == [[1, 3]] and store.pending is None
    for slot, e in enumerate(store.held):
        assert torch.equal(slab[slot], experts[e])
    short = SlotCache(file, GGUFSource(file, {"w": ExpertTensor(16 + 5 * 24, 24, tensor.convert)}), 6, 2, layout)
    short.load([0])
    with pytest.raises(OSError, match="past the end of the file"):
        short.load([1])                                  # expert 1 of this view lies past the end
    assert short.held.count(-1) == 1 and short.slot_of[1] == -1 and short.slot(0) >= 0   # never a hit on it
    file.close()


def test_raw_reads_give_the_file_bytes_direct_or_buffered(tmp_path, monkeypatch):
    """Reads at any offset and length (across and inside the O_DIRECT pages, up to the end of the file), and
    reads into aligned and unaligned buffers, give the file's bytes; a file system that refuses direct reads
    (EINVAL) gets buffered reads from then on."""
    import errno
    data = torch.randint(0, 256, (3 * 4096 + 123,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "bytes.bin"
    path.write_bytes(data.numpy().tobytes())
    cases = [(0, 10), (5, 4096), (4095, 2), (4096, 4096), (100, len(data) - 100), (len(data) - 7, 7)]

    def check(file):
        for offset, n in cases:
            got = file.read(offset, n)
            assert got.shape == (n,) and torch.equal(got, data[offset:offset + n]), (offset, n)
        for offset, n in ((4096, 8192), (0, 4096), (8, 4096), (4096, 100)):
            out = expert_files.aligned_bytes(n + 8)[8 if offset == 8 else 0:][:n]    # one buffer off the alignment
            file.read_into(out, offset)
            assert torch.equal(out, data[offset:offset + n]), (offset, n)
        with pytest.raises(OSError, match="past the end of the file"):
            file.read(len(data) - 5, 10)

    file = RawFile(path)
    check(file)
    real = os.preadv
    refused = []

    def preadv(fd, buffers, offset):
        if fd == file.direct:
            refused.append(fd)
            raise OSError(errno.EINVAL, "direct I/O refused")
        return real(fd, buffers, offset)
    monkeypatch.setattr(os, "preadv", preadv)
    if file.direct < 0:                                  # as where the descriptor opened but reads are refused
        file.direct = os.open(path, os.O_RDONLY)
    file.use_direct = True
    check(file)
    assert refused and not file.use_direct
    file.close()


def test_packed_experts_are_read_from_a_repacked_copy_built_once(moe, repack_root, monkeypatch):
    """The fast mode repacks the experts once into per-layer files of slot records (manifest with sizes and
    SHA-256) and reads misses straight into the slots: the resident logits; a second load reuses the files; a
    changed source or a damaged file makes new ones; no room on disk reads the GGUF instead."""
    import json
    import shutil
    _, files = moe
    want = steps(gem4.load(files["q4_0"], dtype="bfloat16"))
    model = gem4.load(files["q4_0"], dtype="bfloat16", expert_cache_slots=TOP_K)
    directory = model.expert_cache.repacked
    if not kernels.available():                                  # GEM4_NO_KERNELS: dense experts, the GGUF
        assert directory is None and isinstance(model.layers[0].experts.store.source, GGUFSource)
        assert torch.equal(steps(model), want)
        return
    assert directory is not None and directory.parent == repack_root
    assert isinstance(model.layers[0].experts.store.source, expert_stream.RepackedSource)
    assert torch.equal(steps(model), want)
    check_counters(model)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert len(manifest["files"]) == LAYERS and manifest["source"] == str(files["q4_0"].resolve())
    for entry, layout in zip(manifest["files"], manifest["layouts"]):
        f = directory / entry["file"]
        assert f.stat().st_size == entry["bytes"] == E * layout["stride"]
        assert expert_files._sha256_file(f) == entry["sha256"]
    stamp = (directory / "layer-00.bin").stat().st_mtime_ns
    again = gem4.load(files["q4_0"], dtype="bfloat16", expert_cache_slots=E)
    assert again.expert_cache.repacked == directory and (directory / "layer-00.bin").stat().st_mtime_ns == stamp
    assert torch.equal(steps(again), want)
    with open(directory / "layer-01.bin", "r+b") as f:           # a damaged (short) file is rebuilt
        f.truncate(100)
    rebuilt = gem4.load(files["q4_0"], dtype="bfloat16", expert_cache_slots=TOP_K)
    assert rebuilt.expert_cache.repacked == directory and torch.equal(steps(rebuilt), want)
    copy = files["q4_0"].with_name("copy.gguf")                 # another source: its own directory
    shutil.copy(files["q4_0"], copy)
    other = gem4.load(copy, dtype="bfloat16", expert_cache_slots=TOP_K)
    first = other.expert_cache.repacked
    assert first not in (None, directory)
    os.utime(copy, ns=(1, 1))                                    # the same path changed: a new copy, the old one gone
    newer = gem4.load(copy, dtype="bfloat16", expert_cache_slots=TOP_K).expert_cache.repacked
    assert newer not in (None, first, directory) and not first.exists() and directory.exists()
    monkeypatch.setattr(expert_files.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40, 0))
    copy.touch()                                                 # a new mtime: would need a new copy, no room
    plain = gem4.load(copy, dtype="bfloat16", expert_cache_slots=TOP_K)
    assert plain.expert_cache.repacked is None
    assert isinstance(plain.layers[0].experts.store.source, GGUFSource)
    assert torch.equal(steps(plain), want)
    f32 = gem4.load(files["f32"], dtype="float32", expert_cache_slots=TOP_K)     # dense experts: the GGUF
    assert f32.expert_cache.repacked is None


def test_metrics_and_stats_line_report_the_cache(moe):
    """/metrics' gem4:expert_cache_* counters and the CLI stats line read the model's counters at the time."""
    from types import SimpleNamespace
    from gem4.cli import _stats_line
    from gem4.server.metrics import Metrics

    _, files = moe
    model = gem4.load(files["q8_0"], dtype="bfloat16", expert_cache_slots=3)
    engine = Engine(model)
    metrics = Metrics("moe", 1, lambda: engine)
    events = list(engine.generate(prompt_ids()[:20], SamplingParams(temperature=0, max_tokens=4)))
    s = model.expert_cache.stats
    assert s.hits > 0 and s.misses > 0
    text = metrics.render()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    for name, value in (("hits", s.hits), ("misses", s.misses), ("bytes_read", s.bytes_read)):
        assert float(samples[f'gem4:expert_cache_{name}_total{{model_name="moe"}}']) == value, name
    line = _stats_line(events[-1], model.expert_cache)
    assert f"experts: {s.hits} hits, {s.misses} misses ({round(100 * s.hits / (s.hits + s.misses))}% hit)" in line
    plain = Metrics("plain", 1, lambda: SimpleNamespace(model=gem4.load(files["q8_0"], dtype="bfloat16")))
    assert "gem4:expert_cache_hits_total{" not in plain.render()          # resident experts: declared, no sample
    assert "experts:" not in _stats_line(events[-1])


def test_cli_flags(moe, tmp_path, capsys):
    """gem4 run --expert-cache-slots N / --memory-limit GB: the slot line at load, the counters in the stats
    line; a bad count is one clear error; gem4 serve takes the same flags."""
    import argparse
    from gem4.cli import main
    from gem4.demo import write_tokenizer
    from gem4.server.main import add_arguments

    _, files = moe
    tok = write_tokenizer(tmp_path / "tok", 512)
    base = ["run", str(files["q8_0"]), "--tokenizer", str(tok), "-p", "hi", "-n", "3", "--temperature", "0"]
    assert main(base + ["--expert-cache-slots", "3"]) == 0
    err = capsys.readouterr().err
    assert f"expert cache: 3 slots per layer x {LAYERS} layers" in err and "| experts: " in err
    assert main(base + ["--memory-limit", "50"]) == 0
    assert f"expert cache: {E} slots per layer" in capsys.readouterr().err
    assert main(base + ["--expert-cache-slots", "1"]) != 0
    assert "fewer than the 2 experts a token uses" in capsys.readouterr().err
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["m.gguf", "--expert-cache-slots", "8", "--memory-limit", "7.5"])
    assert (args.expert_cache_slots, args.memory_limit) == (8, 7.5)
