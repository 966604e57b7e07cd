"""ModelConfig derivation: KV-sharing donors, RoPE vectors, validation (tables of hand-checkable numbers)."""
from __future__ import annotations

import math

import pytest
import torch

from gem4.config import FULL, SLIDING, ConfigError, build_config, kv_sources, rope_default, rope_proportional, rope_with_factors
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
    with pytest.raises(ConfigError, match="rms_norm_eps must be a positive float"):
        _config(rms_norm_eps=0.0)
    with pytest.raises(ConfigError, match="head_dims has 1 entries for 2 layers"):
        _config(head_dims=[4])
