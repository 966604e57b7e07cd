"""KV cache layout: ring wrap, masks, full-layer growth, shared reads."""
from __future__ import annotations

import pytest
import torch

from gem4.config import FULL, SLIDING, build_config, rope_default
from gem4.kv_cache import KVCache, kv_bytes_per_token

S, F = SLIDING, FULL


def config(window=3, shared=0, types=(S, F, S)):
    n = len(types)
    return build_config(
        vocab_size=8, hidden_size=4, layer_types=list(types), n_heads=[1] * n, n_kv_heads=[1] * n, head_dims=[2] * n,
        k_eq_v=[False] * n, intermediate_sizes=[4] * n, num_kv_shared_layers=shared, sliding_window=window,
        rms_norm_eps=1e-6, final_logit_softcap=None, ple_dim=0, ple_vocab_size=0, moe=None,
        rope_inv_freq={S: rope_default(1e4, 2), F: rope_default(1e4, 2)}, tie_word_embeddings=True,
        max_position_embeddings=64)


def kv(positions):
    # k = v = position, so a row's content names the position it holds: [T, 1, 2]
    p = torch.tensor(positions, dtype=torch.float32)
    return p[:, None, None].expand(-1, 1, 2).clone()


def step(cache, layer_types, n):
    st = cache.begin(n)
    pos = st.positions.tolist()
    outs = {i: cache.write(i, kv(pos), kv(pos)) for i, t in enumerate(layer_types)}
    cache.commit(st)
    return st, outs


def test_sliding_ring_wraps_and_masks_by_position():
    cache = KVCache(config(window=3), max_chunk=2, dtype=torch.float32)
    assert cache.ring == 5
    for _ in range(3):
        step(cache, (S, F, S), 2)                                  # positions 0..5
    st, outs = step(cache, (S, F, S), 2)                           # positions 6, 7 -> rows 1, 2
    keys = outs[0][0][:, 0, 0].tolist()
    assert keys == [5.0, 6.0, 7.0, 3.0, 4.0]                       # ring rows hold positions 5, 6, 7, 3, 4
    # query 6 sees 4, 5, 6 (p - j < 3); query 7 sees 5, 6, 7
    assert st.masks[S].tolist() == [[True, True, False, False, True], [True, True, True, False, False]]
    # full layer: every position up to the query
    full_keys, _ = outs[1]
    assert full_keys[:, 0, 0].tolist() == list(range(8))
    assert st.masks[F].tolist() == [[True] * 7 + [False], [True] * 8]
    assert cache.length == 8


def test_chunk_larger_than_max_chunk_is_refused():
    cache = KVCache(config(), max_chunk=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="a step holds 1..2 tokens"):
        cache.begin(3)


def test_full_store_grows():
    cache = KVCache(config(types=(F,)), max_chunk=1, dtype=torch.float32)
    for _ in range(70):                                            # past the initial 64 rows
        _, outs = step(cache, (F,), 1)
    assert outs[0][0][:, 0, 0].tolist() == list(range(70))


def test_shared_layer_reads_the_donor_of_its_type():
    cfg = config(types=(S, F, S, F), shared=2)
    assert [s.kv_source for s in cfg.layers] == [0, 1, 0, 1]
    cache = KVCache(cfg, max_chunk=4, dtype=torch.float32)
    st = cache.begin(2)
    k0, _ = cache.write(0, kv([0, 1]), kv([0, 1]))
    k1, _ = cache.write(1, kv([0, 1]), kv([0, 1]) * 10)
    read0 = cache.read(0)[0]
    assert read0.data_ptr() == k0.data_ptr() and read0.shape == k0.shape == (2, 1, 2)   # the donor's rows, no copy
    assert torch.equal(cache.read(1)[1][:, 0, 0], torch.tensor([0.0, 10.0]))
    cache.commit(st)
    assert set(cache._k) == {0, 1}                                 # shared layers own no storage


def test_slot_names_the_rows_a_kernel_writes_and_the_span_it_attends_to():
    cfg = config(types=(S, F, S, F), shared=2, window=3)
    cache = KVCache(cfg, max_chunk=2, dtype=torch.float32)             # ring = 3 + 2 rows
    for _ in range(3):                                                 # positions 0..5; the ring wrapped
        st = cache.begin(2)
        pos = st.positions.tolist()
        for i in (0, 1):
            k_store, v_store, rows, span = cache.slot(i)
            k_store[rows] = kv(pos)                                    # what a kernel does
            assert span == (min(cache.ring, pos[-1] + 1) if i == 0 else pos[-1] + 1)
        shared = cache.slot(2)
        assert shared[0] is cache._k[0] and shared[2] is None and shared[3] == min(cache.ring, pos[-1] + 1)
        with pytest.raises(RuntimeError, match="KV-shared"):
            cache.write(2, kv(pos), kv(pos))
        cache.commit(st)
    assert cache._k[0][:, 0, 0].tolist() == [5.0, 1.0, 2.0, 3.0, 4.0]   # position p in row p % 5
    assert cache._k[1][:6, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(RuntimeError, match="outside begin"):
        cache.slot(0)


def test_sliding_keys_stop_at_the_rows_written_until_the_ring_wraps():
    cache = KVCache(config(types=(S,)), max_chunk=4, dtype=torch.float32)     # ring = window + 4 rows
    seen = []
    for n in (3, 4, 4, 4):
        st = cache.begin(n)
        keys, _ = cache.write(0, kv(list(range(cache.length, cache.length + n))), kv([0] * n))
        assert st.masks[S].shape == (n, keys.shape[0])
        seen.append(keys.shape[0])
        cache.commit(st)
    ring = cache.ring
    assert seen == [min(ring, end) for end in (3, 7, 11, 15)]


def test_kv_bytes_per_token_counts_only_owners():
    cfg = config(types=(S, F, S, F), shared=2)
    assert kv_bytes_per_token(cfg, torch.bfloat16) == {S: 2 * 2 * 2, F: 2 * 2 * 2}
