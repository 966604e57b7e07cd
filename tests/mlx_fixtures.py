"""MLX affine checkpoints of the tiny fixtures, written with `mlx` itself (mlx.core.quantize, save_safetensors) the
way mlx_lm.convert writes Gemma 4: the text model's names under `model.`, 26B-A4B's experts split into
`experts.switch_glu.{gate,up,down}_proj`, every linear and embedding whose input width is a multiple of the group
size quantized, the router at 8 bits in groups of 64 (mlx_lm's gemma4_text quant_predicate, recorded in
config.json as a per-module entry), the rest left in float (bf16). Used by tests and benchmarks/make_mlx.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

ROUTER = {"group_size": 64, "bits": 8}


def _mx(t: torch.Tensor):
    import mlx.core as mx

    return mx.array(t.float().numpy()).astype(mx.bfloat16)


def mlx_tensors(state: dict[str, torch.Tensor], num_layers: int, shared: int) -> dict[str, torch.Tensor]:
    """An HF Gemma4ForCausalLM state dict -> mlx_lm's float names and tensors (its sanitize): experts split, KV-shared
    layers' vestigial k/v projections dropped."""
    out = {}
    first_shared = num_layers - shared
    for k, v in state.items():
        if "rotary_emb" in k or k == "lm_head.weight" or k.endswith("embed_scale"):
            continue
        if any(s in k for s in (".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm")):
            if int(k.split("layers.")[1].split(".")[0]) >= first_shared:
                continue
        if k.endswith(".experts.gate_up_proj"):
            base = k.removesuffix(".gate_up_proj")
            gate, up = v.chunk(2, dim=-2)
            out[f"{base}.switch_glu.gate_proj.weight"] = gate.contiguous()
            out[f"{base}.switch_glu.up_proj.weight"] = up.contiguous()
        elif k.endswith(".experts.down_proj"):
            out[k.removesuffix(".down_proj") + ".switch_glu.down_proj.weight"] = v
        else:
            out[k] = v
    return out


def write_mlx(directory: Path, hf_config: dict, state: dict[str, torch.Tensor], bits: int, group_size: int
              ) -> dict[str, torch.Tensor]:
    """Quantize `state` (HF names) with mlx and write an MLX checkpoint into `directory`. Returns the weights the
    file holds, dequantized by mlx (mx.dequantize) under the HF names, for the transformers oracle."""
    import mlx.core as mx

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text = hf_config.get("text_config", hf_config)
    tensors = mlx_tensors(state, text["num_hidden_layers"], text.get("num_kv_shared_layers") or 0)
    quant: dict = {"group_size": group_size, "bits": bits, "mode": "affine"}
    saved, values = {}, {}
    for name, v in tensors.items():
        module = name.removesuffix(".weight")
        params = {"group_size": group_size, "bits": bits}
        if module.endswith("router.proj"):
            params = ROUTER
            quant[module] = ROUTER
        quantized = (v.dim() >= 2 and name.endswith(".weight") and v.shape[-1] % params["group_size"] == 0
                     and "norm" not in name)
        if not quantized:
            saved[name] = _mx(v)
            values[name] = v.to(torch.bfloat16).float()
            continue
        q, s, b = mx.quantize(_mx(v), group_size=params["group_size"], bits=params["bits"])
        saved[name], saved[module + ".scales"], saved[module + ".biases"] = q, s, b
        # in float32: with its bf16 scales mlx would round the values to bf16
        w = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=params["group_size"],
                          bits=params["bits"])
        values[name] = torch.from_numpy(np.array(w))
    mx.save_safetensors(str(directory / "model.safetensors"), saved, metadata={"format": "mlx"})
    config = dict(hf_config, quantization=quant, quantization_config=quant)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return values


def hf_state(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """write_mlx's values back under the HF model's names (experts joined): what transformers loads."""
    out = {}
    for k, v in values.items():
        if ".switch_glu.gate_proj" in k:
            base = k.split(".switch_glu.")[0]
            up = values[f"{base}.switch_glu.up_proj.weight"]
            out[f"{base}.gate_up_proj"] = torch.cat([v, up], dim=-2)
        elif ".switch_glu.down_proj" in k:
            out[k.split(".switch_glu.")[0] + ".down_proj"] = v
        elif ".switch_glu.up_proj" not in k:
            out[k] = v
    return out
