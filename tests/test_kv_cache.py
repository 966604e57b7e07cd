"""KV pool layout: paged full layers, one ring per sequence on sliding layers, the keys each query sees."""
from __future__ import annotations

import pytest
import torch

from gem4.config import FULL, SLIDING, build_config, rope_default
from gem4.engine.block_manager import BlockManager
from gem4.kv_cache import BLOCK_SIZE, KVCache, KVPool, SeqStep, kv_bytes_per_token, kv_pool_size

S, F = SLIDING, FULL


def config(window=3, shared=0, types=(S, F, S), context=64):
    n = len(types)
    return build_config(
        vocab_size=8, hidden_size=4, layer_types=list(types), n_heads=[1] * n, n_kv_heads=[1] * n, head_dims=[2] * n,
        k_eq_v=[False] * n, intermediate_sizes=[4] * n, num_kv_shared_layers=shared, sliding_window=window,
        rms_norm_eps=1e-6, final_logit_softcap=None, ple_dim=0, ple_vocab_size=0, moe=None,
        rope_inv_freq={S: rope_default(1e4, 2), F: rope_default(1e4, 2)}, tie_word_embeddings=True,
        max_position_embeddings=context)


def seen_positions(pool: KVPool, layout, layer: int, stored: dict[int, int]) -> list[list[int]]:
    """Per query row: the positions it attends to, read back through the storage rows (stored: row -> position)."""
    a = layout.attend[pool.config.layers[layer].layer_type]
    out = []
    for t in range(layout.num_tokens):
        rows = a.key_rows[a.q_seq[t], a.q_lo[t]:a.q_hi[t]].tolist()
        out.append([stored[r] for r in rows])
    return out


def test_full_layers_are_paged_by_the_block_table():
    pool = KVPool(config(types=(F,)), num_blocks=4, num_slots=1, max_chunk=BLOCK_SIZE, dtype=torch.float32)
    table = [2, 0]                                   # positions 0..15 in block 2, 16..31 in block 0
    layout = pool.layout([SeqStep(start=14, num_tokens=4, block_table=table, slot=0)])
    assert layout.positions.tolist() == [14, 15, 16, 17]
    assert layout.write[F].tolist() == [2 * BLOCK_SIZE + 14, 2 * BLOCK_SIZE + 15, 0, 1]
    a = layout.attend[F]
    assert a.key_rows.shape == (1, 18)
    assert a.key_rows[0, :16].tolist() == list(range(2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 16))
    assert (a.q_lo.tolist(), a.q_hi.tolist()) == ([0, 0, 0, 0], [15, 16, 17, 18])     # causal
    assert layout.logit_rows.tolist() == [3]


def test_sliding_ring_per_slot_and_window_ranges():
    pool = KVPool(config(window=3, types=(S,)), num_blocks=1, num_slots=2, max_chunk=2, dtype=torch.float32)
    assert pool.ring == 5
    stored: dict[int, int] = {}
    for start in range(0, 12, 2):                   # sequence in slot 1, two tokens a step: the ring wraps
        layout = pool.layout([SeqStep(start, 2, [0], slot=1)])
        rows = layout.write[S].tolist()
        assert rows == [5 + (start % 5), 5 + ((start + 1) % 5)]       # slot 1 owns rows 5..9
        stored.update(zip(rows, layout.positions.tolist()))
        seen = seen_positions(pool, layout, 0, stored)
        assert seen == [[p for p in range(q - 2, q + 1) if p >= 0] for q in (start, start + 1)]


def test_two_sequences_in_one_step_see_only_their_own_keys():
    pool = KVPool(config(window=3), num_blocks=4, num_slots=2, max_chunk=4, dtype=torch.float32)
    layout = pool.layout([SeqStep(0, 3, [1], slot=0, logits=0), SeqStep(5, 1, [3], slot=1, logits=1)])
    assert layout.positions.tolist() == [0, 1, 2, 5]
    assert layout.logit_rows.tolist() == [3]                           # the first sequence only fills its cache
    full = layout.attend[F]
    assert full.q_seq.tolist() == [0, 0, 0, 1]
    assert full.key_rows[1, :6].tolist() == [3 * BLOCK_SIZE + p for p in range(6)]
    assert full.q_hi.tolist() == [1, 2, 3, 6]
    slide = layout.attend[S]
    assert slide.key_rows[1, :3].tolist() == [10, 11, 12]             # slot 1's ring is rows 7..13; positions 3..5
    assert (slide.q_lo.tolist(), slide.q_hi.tolist()) == ([0, 0, 0, 0], [1, 2, 3, 3])
    only_last = layout.logit_rows_only()
    assert only_last.positions.tolist() == [5] and only_last.attend[F].q_seq.tolist() == [1]
    assert only_last.logit_rows.tolist() == [0]


def test_kv_shared_layers_read_their_donor_storage():
    cfg = config(types=(S, F, S, F), shared=2)
    pool = KVPool(cfg, num_blocks=2, num_slots=1, max_chunk=4, dtype=torch.float32)
    assert pool.store(2)[0] is pool.store(0)[0] and pool.store(3)[1] is pool.store(1)[1]
    assert sorted(pool._k) == [0, 1]                                   # shared layers own nothing


@pytest.mark.parametrize("bad, message", [
    (SeqStep(0, 5, [0], 0), "1..4 tokens"),
    (SeqStep(0, 2, [0], 3), "ring slot 3"),
    (SeqStep(14, 4, [0], 0), "1 blocks cannot hold 18"),
    (SeqStep(0, 2, [9], 0), "block ids must be in"),
    (SeqStep(0, 2, [0], 0, logits=3), "logits of 3 rows"),
])
def test_layout_refuses_what_the_pool_cannot_hold(bad, message):
    pool = KVPool(config(), num_blocks=2, num_slots=2, max_chunk=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        pool.layout([bad])


def test_one_sequence_cache_grows_and_keeps_its_rows():
    cfg = config(types=(F,))
    cache = KVCache(cfg, max_chunk=2, dtype=torch.float32)
    first = cache.pool
    layout = cache.step(2)
    first.store(0)[0][layout.write[F]] = 7.0
    cache.commit(2)
    for _ in range(40):                                                # past the first pool's 64 rows
        cache.step(2)
        cache.commit(2)
    assert cache.pool is not first and cache.pool.num_blocks * BLOCK_SIZE >= 82
    assert torch.all(cache.pool.store(0)[0][:2] == 7.0)


def test_block_manager_tables_slots_and_capacity():
    bm = BlockManager(num_blocks=4, block_size=4, num_slots=2)
    bm.reserve("a", 5)
    assert bm.table("a") == [0, 1] and bm.slot("a") == 0 and bm.free_blocks == 2
    assert bm.capacity("b") == 8 and bm.capacity("b", spare=1) == 4
    bm.reserve("b", 4)
    assert bm.table("b") == [2] and bm.slot("b") == 1
    assert not bm.can_reserve("c", 1)                                  # no ring slot left
    assert bm.can_reserve("a", 12) and not bm.can_reserve("a", 13)
    bm.free("a")
    assert bm.free_blocks == 3 and bm.usage == 0.25
    bm.reserve("c", 1)
    assert bm.slot("c") == 0 and bm.table("c") == [0]
    with pytest.raises(RuntimeError, match="no room"):
        bm.reserve("c", 17)


def test_pool_size_from_a_budget_or_the_context():
    cfg = config(window=3, context=64)
    per = kv_bytes_per_token(cfg, torch.bfloat16)
    assert per == {S: 2 * 2 * 2 * 2, F: 2 * 2 * 2}                   # 2 sliding layers, 1 full, bf16 K and V
    size = kv_pool_size(cfg, torch.bfloat16, max_chunk=4, num_slots=2, max_model_len=64, budget=None)
    assert size.num_blocks == 2 * 4 and size.slot_bytes == per[S] * 7
    size = kv_pool_size(cfg, torch.bfloat16, max_chunk=4, num_slots=2, max_model_len=64, budget=10_000)
    assert size.num_blocks == (10_000 - 2 * per[S] * 7) // (per[F] * BLOCK_SIZE)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len 64"):
        kv_pool_size(cfg, torch.bfloat16, max_chunk=4, num_slots=2, max_model_len=64, budget=500)


def test_block_manager_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=6, block_size=4, num_slots=3)
    bm.reserve("p", 6)                                                 # positions 0..5: block 0 full, block 1 partial
    bm.fork("p", "c")
    assert bm.table("c") == [0, 1] and bm.slot("c") == 1 and bm.refs(0) == bm.refs(1) == 2
    assert bm.free_blocks == 4 and bm.usage == pytest.approx(2 / 6)                  # shared blocks count once
    with pytest.raises(RuntimeError, match="already holds"):
        bm.fork("p", "c")
    # the child writes position 6 (block 1, shared): it gets a copy; block 0 (not written) stays shared
    assert bm.capacity("c", start=6) == 4 * 4 + 4                      # 2 blocks held + 4 free - 1 for the copy
    bm.reserve("c", 7, start=6)
    assert bm.table("c") == [0, 2] and bm.take_copies() == [(1, 2)] and bm.take_copies() == []
    assert bm.refs(1) == 1 and bm.refs(2) == 1 and bm.refs(0) == 2
    bm.reserve("p", 7, start=6)                                        # the parent now holds block 1 alone: no copy
    assert bm.table("p") == [0, 1] and bm.take_copies() == []
    bm.reserve("c", 9, start=7)                                        # growing takes a fresh block, no copy
    assert bm.table("c") == [0, 2, 3] and bm.take_copies() == []
    bm.free("p")
    assert bm.refs(0) == 1 and bm.refs(1) == 0 and bm.free_blocks == 3
    bm.free("c")
    assert bm.usage == 0 and bm.free_blocks == 6 and all(bm.refs(b) == 0 for b in range(6))


def test_block_manager_copy_needs_a_free_block_and_a_freed_destination_drops_its_copy():
    bm = BlockManager(num_blocks=2, block_size=4, num_slots=2)
    bm.reserve("p", 6)
    bm.fork("p", "c")
    assert not bm.can_reserve("c", 7, start=6)                         # the copy of block 1 needs a free block
    bm.free("p")
    assert bm.can_reserve("c", 7, start=6)                             # block 1 is the child's alone now
    bm.reserve("c", 7, start=6)
    assert bm.take_copies() == []
    bm2 = BlockManager(num_blocks=4, block_size=4, num_slots=3)
    bm2.reserve("p", 2)
    bm2.fork("p", "c")
    bm2.reserve("c", 3, start=2)                                       # copy 0 -> 1 recorded
    bm2.free("c")                                                      # ... into a block freed before it ran
    assert bm2.take_copies() == []
    bm2.fork("p", "x")
    bm2.fork("p", "y")                                                 # the third and last ring slot
    with pytest.raises(RuntimeError, match="no ring slot"):
        bm2.fork("p", "z")


def test_pool_copies_blocks_and_rings_in_every_owning_layer():
    cfg = config(window=3, types=(S, F, S, F), shared=0)
    pool = KVPool(cfg, num_blocks=4, num_slots=3, max_chunk=2, dtype=torch.float32, block_size=4)
    for layer in range(4):
        k, v = pool.store(layer)
        k.copy_(torch.arange(k.numel(), dtype=torch.float32).view_as(k) + 1000 * layer)
        v.copy_(-k)
    before = {layer: [t.clone() for t in pool.store(layer)] for layer in range(4)}
    pool.copy_blocks([(1, 3), (3, 0)])                                 # sources are read before any write
    pool.copy_slots([(2, 0)])
    for layer in range(4):
        for new, old in zip(pool.store(layer), before[layer]):
            if cfg.layers[layer].is_sliding:                           # ring = window + max_chunk = 5 rows
                assert torch.equal(new[0:5], old[10:15]) and torch.equal(new[5:], old[5:])
            else:
                assert torch.equal(new[12:16], old[4:8]) and torch.equal(new[0:4], old[12:16])
                assert torch.equal(new[4:12], old[4:12])
    with pytest.raises(ValueError, match="block 4 is not in"):
        pool.copy_blocks([(0, 4)])
    with pytest.raises(ValueError, match="destination of two copies"):
        pool.copy_slots([(0, 1), (2, 1)])
