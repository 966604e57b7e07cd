"""`gem4 inspect`: what a checkpoint is, from its config and tensor table (nothing is materialised)."""
from __future__ import annotations

import math

import torch

from gem4.config import UnifiedVisionConfig
from gem4.kv_cache import kv_bytes_per_token, kv_dtype_name
from gem4.weights.audio import audio_summary, checkpoint_audio
from gem4.weights.checkpoint import Checkpoint, TensorEntry
from gem4.weights.towers import VISION_PREFIXES


def summarize(ckpt: Checkpoint, kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """`ckpt` described; the KV bytes a token adds as stored in `kv_dtype` (--kv-cache-dtype; bf16, the fast
    mode's, by default)."""
    config = ckpt.config
    layers = [{
        "index": s.index, "type": s.layer_type, "heads": s.n_heads, "kv_heads": s.n_kv_heads, "head_dim": s.head_dim,
        "k_eq_v": s.k_eq_v, "kv_source": s.kv_source, "mlp": s.intermediate_size,
    } for s in config.layers]
    quantization = ckpt.metadata.get("quantization")      # MLX affine: canonical name -> (bits, group_size)
    mlx_affine: dict[str, int] = {}
    for bits, group in (quantization or {}).values():
        key = f"{bits}-bit, groups of {group}"
        mlx_affine[key] = mlx_affine.get(key, 0) + 1
    return {
        "path": str(ckpt.path),
        "format": ckpt.format,
        "variant": config.variant,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "sliding_window": config.sliding_window,
        "context_length": config.max_position_embeddings,
        "final_logit_softcap": config.final_logit_softcap,
        "ple_dim": config.ple_dim,
        "moe": None if config.moe is None else vars(config.moe),
        "tied_head": config.tie_word_embeddings,
        "first_shared_layer": config.first_shared_layer,
        "parameters": sum(math.prod(e.shape) for e in ckpt.tensors.values()),
        "tensors": len(ckpt.tensors),
        "tensor_types": _by_type(ckpt.tensors.values()),
        "mlx_affine": mlx_affine or None,
        "ignored_tensors": len(ckpt.ignored),
        "kv_bytes_per_token": {"dtype": kv_dtype_name(kv_dtype), **kv_bytes_per_token(config, kv_dtype)},
        "audio": _audio(ckpt),
        "layers": layers,
        "vision": _vision(ckpt),
    }


def _by_type(entries) -> dict[str, dict[str, int]]:
    """Tensors and bytes by stored type ("F32", "Q8_0", ...)."""
    by_type: dict[str, dict[str, int]] = {}
    for entry in entries:
        row = by_type.setdefault(entry.stored, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += entry.nbytes
    return by_type


def _tower(entries: list[TensorEntry]) -> dict:
    return {"parameters": sum(math.prod(e.shape) for e in entries), "tensors": len(entries),
            "bytes": sum(e.nbytes for e in entries), "tensor_types": _by_type(entries)}


def _vision(ckpt: Checkpoint) -> dict | None:
    """The vision tower: its config and its tensors' size (docs/multimodal.md §2.3), or None."""
    v = ckpt.tower_configs.get("vision")
    if v is None:
        return None
    return {**vars(v), "kind": "encoder-free embedder (12B)" if isinstance(v, UnifiedVisionConfig) else "ViT",
            **_tower([e for name, e in ckpt.towers.items() if name.startswith(VISION_PREFIXES)])}


def _audio(ckpt: Checkpoint) -> dict | None:
    """The audio tower (an HF checkpoint's, or a GGUF's mmproj's): what it takes and its tensors' size, or None."""
    found = checkpoint_audio(ckpt)
    if found is None:
        return None
    config, entries, _ = found
    return {**audio_summary(config), **_tower(list(entries.values()))}


def _types(tower: dict) -> str:
    return ", ".join(f"{r['tensors']} {n}" for n, r in sorted(tower["tensor_types"].items()))


def format_summary(s: dict) -> str:
    lines = [
        f"{s['path']} ({s['format']})",
        f"variant        {s['variant']}",
        f"shape          hidden {s['hidden_size']}, {s['num_layers']} layers, vocab {s['vocab_size']}, "
        f"sliding window {s['sliding_window']}, context {s['context_length']}",
        f"parameters     {s['parameters']:,}",
        f"head           {'tied to the embedding' if s['tied_head'] else 'separate'}, softcap {s['final_logit_softcap']}",
    ]
    if s["ple_dim"]:
        lines.append(f"per-layer emb  {s['ple_dim']} per layer; KV shared from layer {s['first_shared_layer']}")
    if s["moe"]:
        m = s["moe"]
        lines.append(f"experts        {m['num_experts']} x {m['intermediate_size']}, top-{m['top_k']}")
    v = s.get("vision")
    if v and "embed_dim" in v:
        lines.append(f"vision         {v['kind']}: {v['patch_size']} px patches, one a token -> {v['embed_dim']} -> "
                     f"{v['text_hidden_size']}, {v['parameters']:,} parameters ({v['bytes'] / 2**20:.1f} MiB: {_types(v)})"
                     + ("; images attend both ways on sliding layers" if v["bidirectional"] else "; causal over images"))
    elif v:
        lines.append(f"vision tower   {v['num_layers']} layers x {v['hidden_size']} ({v['num_heads']} heads x "
                     f"{v['head_dim']}), patch {v['patch_size']}, pool {v['pooling']}x{v['pooling']}, "
                     f"{v['parameters']:,} parameters ({v['bytes'] / 2**20:.1f} MiB: {_types(v)})"
                     + ("; clipped linears" if v["clipped_linears"] else "")
                     + ("; standardized" if v["standardize"] else "")
                     + ("; images attend both ways on sliding layers" if v["bidirectional"] else "; causal over images"))
    if s["audio"]:
        a = s["audio"]
        if "layers" in a:
            lines.append(f"audio          {a['kind']}: {a['layers']} layers x {a['hidden_size']}, {a['heads']} heads, "
                         f"window {a['window']} frames -> {a['output_dims']} -> {a['text_hidden_size']}; "
                         f"{a['tokens_per_second']} tokens/s, at most {a['max_tokens']}")
        else:
            lines.append(f"audio          {a['kind']}: {a['samples_per_token']} samples a token -> "
                         f"{a['text_hidden_size']}; {a['tokens_per_second']:g} tokens/s")
        lines.append(f"               {a['parameters']:,} parameters ({a['bytes'] / 2**20:.1f} MiB: {_types(a)})")
    kv = s["kv_bytes_per_token"]
    lines.append(f"KV per token   full {kv['full_attention']} B, sliding {kv['sliding_attention']} B ({kv['dtype']}; "
                 f"sliding capped at the window)")
    lines.append("tensors        " + ", ".join(f"{t}: {r['tensors']} ({r['bytes'] / 2**20:.1f} MiB)"
                                                for t, r in sorted(s["tensor_types"].items())))
    if s.get("mlx_affine"):
        lines.append("quantization   MLX affine: " + ", ".join(f"{n} tensors {k}" for k, n in sorted(s["mlx_affine"].items())))
    lines.append("layers         idx type     heads kv  dim  k_eq_v kv_from mlp")
    for l in s["layers"]:
        lines.append(f"               {l['index']:>3} {'full' if l['type'] == 'full_attention' else 'slide':<8} "
                     f"{l['heads']:>5} {l['kv_heads']:>2} {l['head_dim']:>4} {str(l['k_eq_v']):<6} {l['kv_source']:>7} {l['mlp']}")
    return "\n".join(lines)
