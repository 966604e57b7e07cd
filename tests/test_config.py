"""ModelConfig derivation: KV-sharing donors, RoPE vectors, validation (tables of hand-checkable numbers),
and every value a checkpoint gives checked for sense: a GGUF metadata fuzz and HF config.json cases."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gem4
from gem4.config import (
    FULL,
    SLIDING,
    ConfigError,
    MoEConfig,
    build_config,
    kv_sources,
    rope_default,
    rope_proportional,
    rope_with_factors,
)
from gem4.model.layers import apply_rope, rope_cos_sin

S, F = SLIDING, FULL


def test_kv_sources_real_variants():
    e2b = ([S] * 4 + [F]) * 7                      # 35 layers, 20 shared
    src = kv_sources(e2b, 20)
    assert src[:15] == list(range(15))
    assert {i: src[i] for i in range(15, 35) if e2b[i] == S} == {i: 13 for i in range(15, 35) if e2b[i] == S}
    assert {i: src[i] for i in range(15, 35) if e2b[i] == F} == {19: 14, 24: 14, 29: 14, 34: 14}
    e4b = ([S] * 5 + [F]) * 7                      # 42 layers, 18 shared -> donors 22 (sliding), 23 (full)
    src = kv_sources(e4b, 18)
    assert {src[i] for i in range(24, 42) if e4b[i] == S} == {22}
    assert {src[i] for i in range(24, 42) if e4b[i] == F} == {23}
    assert kv_sources([S, S, F], 0) == [0, 1, 2]


def test_kv_sources_general_rule_differs_from_llama_cpp_hard_coding():
    # last non-shared layer is sliding: the full donor is layer 1, not first-1 = 2
    assert kv_sources([S, F, S, F, S], 2) == [0, 1, 2, 1, 2]


def test_kv_sources_refusals():
    with pytest.raises(ConfigError, match="no earlier non-shared layer has type full_attention"):
        kv_sources([S, S, F], 1)
    with pytest.raises(ConfigError, match="must be in"):
        kv_sources([S, F], 2)


def test_rope_default_table():
    assert rope_default(10000.0, 4) == (1.0, pytest.approx(0.01))
    assert rope_default(100.0, 8) == pytest.approx((1.0, 100 ** -0.25, 0.1, 100 ** -0.75))


def test_rope_proportional_uses_full_head_dim_denominator():
    f = rope_proportional(1e6, 16, 0.25)           # int(0.25 * 16 // 2) = 2 rotated pairs of 8
    assert f[:2] == pytest.approx((1.0, 1e6 ** (-2 / 16)))   # denominator 16, not 4
    assert f[2:] == (0.0,) * 6


def test_rope_factors_equal_proportional():
    factors = [1.0, 1.0] + [1e30] * 6
    assert rope_with_factors(1e6, 16, factors) == pytest.approx(rope_proportional(1e6, 16, 0.25), abs=1e-30)
    with pytest.raises(ConfigError, match="rope_freqs has 3 entries, expected 8"):
        rope_with_factors(1e6, 16, [1.0] * 3)


def test_apply_rope_positions_0_and_1():
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])                      # [T=1, heads=1, d=4]
    inv = torch.tensor(rope_default(10000.0, 4))                   # (1, 0.01)
    cos, sin = rope_cos_sin(torch.tensor([0]), inv)
    assert torch.equal(apply_rope(x, cos, sin), x)                 # position 0 is the identity
    cos, sin = rope_cos_sin(torch.tensor([1]), inv)
    out = apply_rope(x, cos, sin)[0, 0]
    # NeoX pairs (0, 2) with angle 1 and (1, 3) with angle 0.01
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)
    expect = [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2]
    assert out.tolist() == pytest.approx(expect, rel=1e-6)


def _config(**over):
    args = dict(vocab_size=16, hidden_size=8, layer_types=[S, F], n_heads=[2, 2], n_kv_heads=[1, 1], head_dims=[4, 8],
                k_eq_v=[False, True], intermediate_sizes=[16, 16], num_kv_shared_layers=0, sliding_window=4,
                rms_norm_eps=1e-6, final_logit_softcap=30.0, ple_dim=0, ple_vocab_size=0, moe=None,
                rope_inv_freq={S: rope_default(1e4, 4), F: rope_proportional(1e6, 8, 0.25)},
                tie_word_embeddings=True, max_position_embeddings=128)
    args.update(over)
    return build_config(**args)


def test_build_config_validation():
    c = _config()
    assert [s.k_eq_v for s in c.layers] == [False, True] and c.first_shared_layer == 2
    with pytest.raises(ConfigError, match="k_eq_v is only defined for full-attention layers"):
        _config(k_eq_v=[True, False])
    with pytest.raises(ConfigError, match="not a valid GQA geometry"):
        _config(n_kv_heads=[3, 1])
    with pytest.raises(ConfigError, match="unknown layer type 'chunked'"):
        _config(layer_types=[S, "chunked"], rope_inv_freq={S: rope_default(1e4, 4), "chunked": (1.0,) * 4})
    with pytest.raises(ConfigError, match="RoPE for full_attention has 2 frequencies"):
        _config(rope_inv_freq={S: rope_default(1e4, 4), F: rope_default(1e4, 4)})
    with pytest.raises(ConfigError, match=r"rms_norm_eps must be a float in \(0, 0.01\]"):
        _config(rms_norm_eps=0.0)
    with pytest.raises(ConfigError, match="head_dims has 1 entries for 2 layers"):
        _config(head_dims=[4])


# ---- values checked for sense (issue 12): a corrupt field is refused by name, never loaded ----

@pytest.mark.parametrize("over, field", [
    ({"sliding_window": 2**31}, "sliding_window/context"),            # loaded, then 16 GiB per request
    ({"sliding_window": 129}, "sliding_window/context"),              # longer than the context (128)
    ({"max_position_embeddings": 2**32 - 1, "sliding_window": 4}, "max_position_embeddings"),  # served as max_model_len
    ({"max_position_embeddings": 2**24 + 1}, "max_position_embeddings"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"sliding_window": True}, "sliding_window"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"rms_norm_eps": 0.5}, "rms_norm_eps"),
    ({"final_logit_softcap": float("inf")}, "final_logit_softcap"),   # all-NaN logits
    ({"final_logit_softcap": float("nan")}, "final_logit_softcap"),
    ({"final_logit_softcap": 0.0}, "final_logit_softcap"),
    ({"n_heads": [2, 3], "n_kv_heads": [2, 2]}, "gqa"),
    ({"n_kv_heads": [0, 1]}, "n_kv_heads"),
    ({"head_dims": [4, 7]}, "head_dims"),
    ({"intermediate_sizes": [16, 16.0]}, "intermediate_sizes"),
    ({"ple_dim": -1}, "ple_dim"),
    ({"moe": MoEConfig(num_experts=4, top_k=5, intermediate_size=8)}, "moe.top_k"),
    ({"moe": MoEConfig(num_experts=0, top_k=0, intermediate_size=8)}, "moe.num_experts"),
    ({"hidden_size": 2**63}, "embed"),                                 # torch's int64 shapes overflowed
    ({"intermediate_sizes": [16, 2**40]}, "mlp"),
    ({"moe": MoEConfig(num_experts=2**20, top_k=2, intermediate_size=2**20)}, "moe.size"),
    ({"rope_inv_freq": {S: (1.0, float("nan")), F: rope_proportional(1e6, 8, 0.25)}}, f"rope.{S}"),
    ({"rope_inv_freq": {S: rope_default(1e4, 4), F: (1e37, 0.0, 0.0, 0.0)}}, f"rope.{F}"),  # 128 * 1e37 overflows
])
def test_build_config_refuses_values_that_make_no_sense(over, field):
    with pytest.raises(ConfigError) as info:
        _config(**over)
    assert info.value.field == field, str(info.value)


@pytest.mark.parametrize("theta", [float("nan"), 0.0, -1.0, float("inf")])
def test_rope_bases_must_be_finite_and_positive(theta):
    for build in (lambda: rope_default(theta, 8), lambda: rope_proportional(theta, 8, 0.5),
                  lambda: rope_with_factors(theta, 8, None)):
        with pytest.raises(ConfigError, match="must be a finite number > 0") as info:
            build()
        assert info.value.field == "rope_theta"


def test_values_at_their_bounds_load():
    c = _config(max_position_embeddings=2**24, sliding_window=2**24, rms_norm_eps=1e-2, final_logit_softcap=1e-30,
                moe=MoEConfig(num_experts=4, top_k=4, intermediate_size=8))
    assert (c.max_position_embeddings, c.sliding_window) == (2**24, 2**24)


# ---- the same through both readers: a tiny checkpoint with one field changed ----

FUZZ_IDS = torch.tensor([2, 5, 9, 100, 7, 8, 300, 1, 4, 9, 11, 12])          # 12 tokens: the window (8) wraps


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """The dense_plain test model as an HF directory and as an F32 GGUF written by our writer; the
    GGUF's metadata and tensors are kept in memory so that each case can rewrite one value."""
    from model_fixtures import build_hf

    from gem4.weights.checkpoint import open_checkpoint
    from gem4.gguf import GGUFReader
    from gem4.weights.gguf_model import write_gguf

    root = tmp_path_factory.mktemp("tiny_checkpoint")
    causal, _ = build_hf("dense_plain")
    causal.save_pretrained(root / "hf")
    write_gguf(open_checkpoint(root / "hf"), root / "model.gguf", "f32")
    with GGUFReader(root / "model.gguf") as r:
        meta = {k: (v, r.metadata_types[k], r.array_types.get(k)) for k, v in r.metadata.items()}
        tensors = {n: (r.tensor_data(n).copy(), info.shape, info.ggml_type) for n, info in r.tensors.items()}
    return root, meta, tensors


_written = iter(range(10**9))


def write_with(tiny, tmp_path: Path, values: dict) -> Path:
    """The tiny GGUF with `values` ({key: (value, GGUFValueType)}) in place of its own."""
    from gem4.gguf import GGUFValueType, GGUFWriter

    _, meta, tensors = tiny
    path = tmp_path / f"edited-{next(_written)}.gguf"       # a fresh file: earlier models may still map theirs
    w = GGUFWriter(path)
    for key, (value, vtype, array_type) in meta.items():
        if key in values:
            w.add(key, *values[key])
        elif vtype == GGUFValueType.ARRAY:
            w.add(key, value, vtype, array_type)
        else:
            w.add(key, value, vtype)
    for name, (data, shape, ggml_type) in tensors.items():
        w.add_tensor(name, data, shape, ggml_type)
    w.write()
    return path


def load_or_refuse(path: Path, keys: list[str]) -> str:
    """Load and run 12 tokens: either a CheckpointError that names one of `keys` (or, for a size the
    tensors contradict, the tensor and "the model's metadata needs"), or finite logits."""
    from gem4.weights.checkpoint import CheckpointError

    try:
        model = gem4.load(path, dtype="float32")
    except CheckpointError as e:
        message = str(e)
        assert any(k.removeprefix("gemma4.") in message for k in keys) or "the model's metadata needs" in message, \
            f"{keys}: {message}"
        return "refused"
    logits = model.extend(FUZZ_IDS, model.new_cache(), logits=FUZZ_IDS.numel())
    assert bool(torch.isfinite(logits).all()), f"{keys}: non-finite logits"
    return "loaded"


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("key, value", [
    ("gemma4.attention.sliding_window", 2**31),                         # the findings of issue 12
    ("gemma4.rope.freq_base", NAN), ("gemma4.rope.freq_base", 0.0), ("gemma4.rope.freq_base", -1.0),
    ("gemma4.rope.freq_base_swa", NAN), ("gemma4.final_logit_softcapping", INF),
    ("gemma4.context_length", 2**32 - 1), ("gemma4.attention.layer_norm_rms_epsilon", NAN),
])
def test_gguf_values_that_make_no_sense_are_refused_by_key(tiny_checkpoint, tmp_path, key, value):
    from gem4.weights.checkpoint import CheckpointError
    from gem4.gguf import GGUFValueType

    vtype = GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32
    with pytest.raises(CheckpointError, match=re.escape(key)):
        gem4.load(write_with(tiny_checkpoint, tmp_path, {key: (value, vtype)}), dtype="float32")


def _int_value():
    from gem4.gguf import GGUFValueType as VT

    edges = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 4095, 4096, 4097, 2**24, 2**24 + 1, 2**31, 2**32 - 1]
    return st.one_of(
        st.tuples(st.one_of(st.sampled_from(edges), st.integers(0, 2**32 - 1)), st.just(VT.UINT32)),
        st.tuples(st.integers(-(2**31), -1), st.just(VT.INT32)),
        st.tuples(st.sampled_from([2**32, 2**63, 2**64 - 1]), st.just(VT.UINT64)),
        st.tuples(st.sampled_from([8.0, NAN, -1.0]), st.just(VT.FLOAT32)),
        st.tuples(st.just("8"), st.just(VT.STRING)),
    )


def _float_value():
    from gem4.gguf import GGUFValueType as VT

    edges = [0.0, -0.0, -1.0, NAN, INF, -INF, 1e-45, 1e-38, 1e-6, 1e-2, 0.5, 1.0, 30.0, 1e4, 1e6, 3.4e38]
    return st.one_of(
        st.tuples(st.one_of(st.sampled_from(edges), st.floats(width=32)), st.just(VT.FLOAT32)),
        st.tuples(st.sampled_from([0, 1, 10000, 2**32 - 1]), st.just(VT.UINT32)),
        st.tuples(st.just("1e-6"), st.just(VT.STRING)),
    )


INT_KEYS = ["context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
            "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.key_length_swa",
            "attention.value_length_swa", "rope.dimension_count", "rope.dimension_count_swa",
            "attention.sliding_window", "attention.shared_kv_layers", "embedding_length_per_layer_input"]
FLOAT_KEYS = ["rope.freq_base", "rope.freq_base_swa", "attention.layer_norm_rms_epsilon", "final_logit_softcapping"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_gguf_metadata_values_give_a_named_error_or_finite_logits(tiny_checkpoint, tmp_path, data):
    keys = data.draw(st.lists(st.sampled_from(INT_KEYS + FLOAT_KEYS), min_size=1, max_size=2, unique=True), label="keys")
    values = {f"gemma4.{k}": data.draw(_int_value() if k in INT_KEYS else _float_value(), label=k) for k in keys}
    path = write_with(tiny_checkpoint, tmp_path, values)
    try:
        load_or_refuse(path, list(values))
    finally:
        path.unlink()


@pytest.mark.parametrize("key, value", [
    ("sliding_window", 2**31), ("max_position_embeddings", 2**32 - 1), ("rms_norm_eps", "1e-6"),
    ("final_logit_softcapping", INF), ("num_attention_heads", 4.5), ("sliding_window", None),
    ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": NAN},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
    ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 2.0,
                                            "rope_theta": 1e6}}),
])
def test_hf_config_values_that_make_no_sense_are_refused_by_key(tiny_checkpoint, tmp_path, key, value):
    import shutil

    from gem4.weights.checkpoint import CheckpointError

    directory = shutil.copytree(tiny_checkpoint[0] / "hf", tmp_path / "hf")
    cfg = json.loads((directory / "config.json").read_text())
    cfg[key] = value
    (directory / "config.json").write_text(json.dumps(cfg))                 # NaN / Infinity as Python writes them
    with pytest.raises(CheckpointError, match=key):
        gem4.load(directory, dtype="float32")
