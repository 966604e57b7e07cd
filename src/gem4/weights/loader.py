"""(config, tensors) -> bound model: the strict manifest check and every load-time transform.

`load(path)` opens a GGUF file or an HF directory, builds the model's module tree on the meta
device, checks the checkpoint's canonical tensors against the tree's parameters (missing, unexpected
and mis-shaped tensors are refused by name), then materialises each tensor once in the compute dtype.
"""
from __future__ import annotations

import gc
from pathlib import Path

import torch
from tqdm import tqdm

from gem4.model.backends import choose
from gem4.model.gemma4 import Model
from gem4.weights.checkpoint import Checkpoint, CheckpointError, open_checkpoint
from gem4.weights.binding import EXPERT_WEIGHTS, PLE_TABLE, aligned, block_storage, pack, weight_dtype
from gem4.weights.towers import bind_vision

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# "auto" is the fast mode: bf16 weights and KV cache, Q8_0/Q4_0/Q4_K/Q5_K/Q6_K kept packed for the compiled kernels where
# the CPU runs them (plain bf16 torch where it does not). float32 is the reference mode, asked for by name.
AUTO_DTYPE = "bfloat16"
# Tensors a file may omit, with the value llama.cpp's loader assumes (docs/gemma4.md §3.2).
OPTIONAL_ONES = ("layer_scalar", "router.per_expert_scale")


def check_manifest(ckpt: Checkpoint, expected: dict[str, tuple[int, ...]]) -> None:
    where = ckpt.path
    for name, shape in expected.items():
        entry = ckpt.tensors.get(name)
        if entry is None:
            if name.endswith(OPTIONAL_ONES):
                continue
            raise CheckpointError(f"{where}: missing required tensor {name!r} (expected shape {shape})")
        if tuple(entry.shape) != tuple(shape):
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(entry.shape)}, "
                                  f"the model's metadata needs {tuple(shape)}")
    unexpected = sorted(set(ckpt.tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r}"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                              + " for this model's metadata")


def _check_streamable(ckpt: Checkpoint, device: str, slots, memory_limit) -> None:
    """Streamed experts need a 26B-A4B GGUF or MLX checkpoint on the CPU, and one well-formed option."""
    from gem4.weights.expert_stream import ExpertCacheError

    if slots is not None and memory_limit is not None:
        raise ExpertCacheError("give one of expert_cache_slots and memory_limit, not both")
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
        raise ExpertCacheError(f"expert_cache_slots must be a positive integer, got {slots!r}")
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float))
                                     or not memory_limit > 0):
        raise ExpertCacheError(f"memory_limit must be a positive number of GB, got {memory_limit!r}")
    if ckpt.config.moe is None:
        raise ExpertCacheError(f"{ckpt.path}: the model has no routed experts to stream "
                               "(expert_cache_slots / memory_limit are for 26B-A4B)")
    experts = [e for name, e in ckpt.tensors.items() if name.endswith(EXPERT_WEIGHTS)]
    if ckpt.format != "gguf" and not all(e.stream is not None for e in experts):     # MLX: entry.stream
        raise ExpertCacheError(f"{ckpt.path}: experts are streamed from a GGUF file or an MLX checkpoint only "
                               f"(this is a float {ckpt.format} checkpoint; gem4 convert writes a GGUF)")
    if torch.device(device).type != "cpu":
        raise ExpertCacheError(f"streamed experts run on the CPU only, not {device!r}")


def load_with_tokenizer(path: str | Path, tokenizer: str | Path | None = None, dtype: str = "auto",
                        device: str = "cpu", progress: bool = False, expert_cache_slots: int | None = None,
                        memory_limit: float | None = None, mmproj: str | Path | None = None):
    """-> (Model, Tokenizer) of the checkpoint at `path`, the tokenizer read from `tokenizer` (a file or
    directory) or from the checkpoint itself; `mmproj`: llama.cpp's tower file for a GGUF text model.

    The checkpoint is opened before the tokenizer is read, so the first error names the real cause: no
    such file, not a model file, an unsupported architecture, and only then a missing tokenizer
    (TokenizerError). A tokenizer with more tokens than the model's vocabulary is refused.
    """
    from gem4.tokenizer import Tokenizer

    ckpt = open_checkpoint(path, mmproj)
    try:
        tok = Tokenizer.from_file(tokenizer or path)
    except BaseException:
        ckpt.close()
        raise
    model = bind(ckpt, dtype=dtype, device=device, progress=progress, expert_cache_slots=expert_cache_slots,
                 memory_limit=memory_limit)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens, the model only "
                         f"{model.config.vocab_size}: they do not belong together")
    return model, tok


def bind(ckpt: Checkpoint, dtype: str = "auto", device: str = "cpu", progress: bool = False,
         expert_cache_slots: int | None = None, memory_limit: float | None = None) -> Model:
    """`expert_cache_slots` / `memory_limit` (GB; one of them): 26B-A4B's routed experts are not bound but
    streamed from the GGUF into per-layer slots (weights/expert_stream.py); model.expert_cache holds the slot count
    and the counters."""
    if dtype == "auto":
        dtype = AUTO_DTYPE
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    config = ckpt.config
    stream = expert_cache_slots is not None or memory_limit is not None
    if stream:
        from gem4.weights.expert_stream import process_rss, stream_experts
        _check_streamable(ckpt, device, expert_cache_slots, memory_limit)
        runtime = process_rss()                            # memory_limit counts the runtime loaded so far
    backend = choose(torch_dtype, device)                 # the fast mode: the CPU kernels where they run
    with torch.device("meta"):
        model = Model(config, torch_dtype)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    check_manifest(ckpt, expected)
    backend.prepare(model)

    state, streamed = {}, {}
    for name in tqdm(list(expected), desc="loading weights", unit="tensor", disable=not progress):
        entry = ckpt.tensors.get(name)
        storage = block_storage(name, entry, backend.packed_types)
        if stream and name.endswith(EXPERT_WEIGHTS):       # read on demand into slots (weights/expert_stream.py)
            streamed[name] = entry
            continue
        if storage == "blocks":
            module = model.get_submodule(name.rsplit(".", 1)[0])
            if entry.affine is not None:                   # MLX: the file's three tensors, not regrouped
                q, scales, biases, bits, group = entry.affine()
                module.keep_affine(q.to(device), scales.to(device), biases.to(device), bits, group)
            else:
                raw, ggml_type = entry.raw()
                module.keep_blocks(raw.to(device), ggml_type)
        elif storage is not None:
            pack(model, name, entry, backend)              # "packed" (a linear's weight) or "experts" (one of two)
        elif entry is None:                                # optional scalars default to 1 (OPTIONAL_ONES)
            state[name] = torch.ones(expected[name], dtype=weight_dtype(name, expected[name], torch_dtype), device=device)
        elif name == PLE_TABLE:                            # float table: kept in its stored dtype, read by rows
            state[name] = entry.dense().to(device)
        else:
            state[name] = aligned(entry.dense().to(device=device, dtype=weight_dtype(name, expected[name], torch_dtype)))
    if stream:
        resident = (sum(t.nbytes for t in state.values())
                    + sum(b.nbytes for b in model.buffers() if not b.is_meta))
        packed = {name: block_storage(name, entry, backend.packed_types) == "experts" for name, entry in streamed.items()}
        source = ckpt.metadata.get("expert_file", ckpt.path)    # MLX: the file of the first layer's experts
        model.expert_cache = stream_experts(model, source, streamed, packed, torch_dtype, expert_cache_slots,
                                            memory_limit, resident, runtime)
    model.load_state_dict(state, strict=True, assign=True)
    for layer_type, inv_freq in config.rope_inv_freq:    # non-persistent buffers were built on meta
        setattr(model, f"inv_freq_{layer_type}", torch.tensor(inv_freq, dtype=torch.float32, device=device))
    backend.finish(model, keep_heap=not stream)            # streamed experts: memory bounded, the heap handed back
    model.vision = bind_vision(ckpt, torch_dtype, device, backend)    # the towers through the same backend
    model.eval()
    from gem4.weights.audio import bind_audio               # E2B/E4B: the audio tower of an HF checkpoint, or None
    model.audio = bind_audio(ckpt, torch_dtype, device, backend)
    return model


def load(path: str | Path, dtype: str = "auto", device: str = "cpu", progress: bool = False,
         expert_cache_slots: int | None = None, memory_limit: float | None = None,
         mmproj: str | Path | None = None) -> Model:
    """Load a Gemma 4 text model from a `.gguf` file or an HF checkpoint directory; an HF checkpoint's vision tower
    comes with it (`model.vision`, model/vision.py), a GGUF's from llama.cpp's mmproj file `mmproj`
    (weights/mmproj.py).

    dtype "auto" (the default) is the fast mode, "bfloat16": bf16 weights and matmul inputs, compiled
    kernels on CPUs that run them. "float32" is the reference mode (matches transformers to ~1e-5).

    26B-A4B in a memory cap: `expert_cache_slots=N` (top_k <= N) keeps N routed experts per layer in slots
    filled from disk on demand (LFU), `memory_limit=GB` computes N from the whole process's budget
    (weights/expert_stream.py stream_experts); the other weights stay resident. The logits are the same as without.

    Python's garbage collector is paused while loading: parsing and binding make many small objects and no
    reference cycles worth collecting, and its passes over them took ~14% of a Q4_K_M load (perf).
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        ckpt = open_checkpoint(path, mmproj)
        return bind(ckpt, dtype=dtype, device=device, progress=progress, expert_cache_slots=expert_cache_slots,
                    memory_limit=memory_limit)
    finally:
        if paused:
            gc.enable()
