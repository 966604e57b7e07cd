"""KV pool layout (full and sliding layers paged, the keys each query sees) and the block manager's
accounting: tables, sliding windows, sharing, copy-on-write, and the prefix cache."""
from __future__ import annotations

import random

import pytest
import torch

from gem4.config import FULL, SLIDING, build_config, rope_default
from gem4.engine.pool import kv_pool_size
from gem4.kv_cache import (BLOCK_SIZE, BlockManager, KVCache, KVPool, SeqStep, kv_bytes_per_token,
                           sliding_blocks_per_seq)

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
    pool = KVPool(config(types=(F,)), num_blocks=4, num_sliding_blocks=1, dtype=torch.float32)
    table = [2, 0]                                   # positions 0..15 in block 2, 16..31 in block 0
    layout = pool.layout([SeqStep(start=14, num_tokens=4, block_table=table, sliding_table=[0, 0])])
    assert layout.positions.tolist() == [14, 15, 16, 17]
    assert layout.write[F].tolist() == [2 * BLOCK_SIZE + 14, 2 * BLOCK_SIZE + 15, 0, 1]
    a = layout.attend[F]
    assert a.key_rows.shape == (1, 18)
    assert a.key_rows[0, :16].tolist() == list(range(2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 16))
    assert (a.q_lo.tolist(), a.q_hi.tolist()) == ([0, 0, 0, 0], [15, 16, 17, 18])     # causal
    assert layout.logit_rows.tolist() == [3]


def test_sliding_layers_are_paged_and_read_only_the_window():
    pool = KVPool(config(window=3, types=(S,)), num_blocks=4, num_sliding_blocks=4, dtype=torch.float32, block_size=4)
    sliding = [3, 1, 2]                             # positions 0..3 in sliding block 3, 4..7 in 1, 8..11 in 2
    stored: dict[int, int] = {}
    for start in range(0, 12, 2):
        # what a sequence holds: the entries behind its window may be gone (-1) and are never read
        table = [b if j >= max(0, start - 2) // 4 else -1 for j, b in enumerate(sliding)]
        layout = pool.layout([SeqStep(start, 2, [0, 1, 2], table)])
        rows = layout.write[S].tolist()
        assert rows == [sliding[p // 4] * 4 + p % 4 for p in (start, start + 1)]
        stored.update(zip(rows, layout.positions.tolist()))
        seen = seen_positions(pool, layout, 0, stored)
        assert seen == [[p for p in range(q - 2, q + 1) if p >= 0] for q in (start, start + 1)]
    with pytest.raises(ValueError, match=r"sliding block ids must be in \[0, 4\), got \[-1, 2\]"):
        pool.layout([SeqStep(8, 1, [0, 1, 2], [3, -1, 2])])           # position 6 (block 1) is still seen


def test_two_sequences_in_one_step_see_only_their_own_keys():
    pool = KVPool(config(window=3), num_blocks=4, num_sliding_blocks=4, dtype=torch.float32)
    layout = pool.layout([SeqStep(0, 3, [1], [0], logits=0), SeqStep(5, 1, [3], [2], logits=1)])
    assert layout.positions.tolist() == [0, 1, 2, 5]
    assert layout.logit_rows.tolist() == [3]                           # the first sequence only fills its cache
    full = layout.attend[F]
    assert full.q_seq.tolist() == [0, 0, 0, 1]
    assert full.key_rows[1, :6].tolist() == [3 * BLOCK_SIZE + p for p in range(6)]
    assert full.q_hi.tolist() == [1, 2, 3, 6]
    slide = layout.attend[S]
    assert slide.key_rows[1, :3].tolist() == [2 * BLOCK_SIZE + p for p in (3, 4, 5)]   # its window: positions 3..5
    assert (slide.q_lo.tolist(), slide.q_hi.tolist()) == ([0, 0, 0, 0], [1, 2, 3, 3])
    only_last = layout.logit_rows_only()
    assert only_last.positions.tolist() == [5] and only_last.attend[F].q_seq.tolist() == [1]
    assert only_last.logit_rows.tolist() == [0]


def test_kv_shared_layers_read_their_donor_storage():
    cfg = config(types=(S, F, S, F), shared=2)
    pool = KVPool(cfg, num_blocks=2, num_sliding_blocks=2, dtype=torch.float32)
    assert pool.store(2).k is pool.store(0).k and pool.store(3).v is pool.store(1).v
    assert sorted(pool._kv) == [0, 1]                                  # shared layers own nothing


@pytest.mark.parametrize("bad, message", [
    (SeqStep(0, 0, [0], [0]), "at least one token"),
    (SeqStep(14, 4, [0], [0, 0]), "1 blocks cannot hold 18"),
    (SeqStep(14, 4, [0, 1], [0]), "1 sliding blocks cannot hold 18"),
    (SeqStep(0, 2, [9], [0]), r"block ids must be in \[0, 2\)"),
    (SeqStep(0, 2, [0], [5]), r"sliding block ids must be in \[0, 2\)"),
    (SeqStep(0, 2, [0], [0], logits=3), "logits of 3 rows"),
])
def test_layout_refuses_what_the_pool_cannot_hold(bad, message):
    pool = KVPool(config(), num_blocks=2, num_sliding_blocks=2, dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        pool.layout([bad])


def test_one_sequence_cache_grows_keeps_its_rows_and_reuses_sliding_blocks():
    cfg = config(window=3, types=(F, S))
    cache = KVCache(cfg, dtype=torch.float32)
    first = cache.pool
    layout = cache.step(2)
    first.store(0).k[layout.write[F]] = 7.0
    first.store(1).k[layout.write[S]] = 5.0
    cache.commit(2)
    stored: dict[int, int] = dict(zip(layout.write[S].tolist(), [0, 1]))
    for _ in range(40):                                                # past the first pool's 64 rows
        layout = cache.step(2)
        stored.update(zip(layout.write[S].tolist(), layout.positions.tolist()))
        assert seen_positions(cache.pool, layout, 1, stored)[-1] == [cache.length - 1, cache.length, cache.length + 1]
        # the block manager's tables: full blocks in order, sliding ones only from the window's block on
        first, sliding = (cache.length - 2) // BLOCK_SIZE, cache.sliding_table
        assert cache.block_table == list(range(len(cache.block_table)))
        assert sliding[:first] == [-1] * first and -1 not in sliding[first:]
        assert cache.blocks.free_sliding_blocks == cache.pool.num_sliding_blocks - len(sliding[first:])
        cache.commit(2)
    assert cache.pool is not first and cache.pool.num_blocks * BLOCK_SIZE >= 82
    assert cache.blocks.num_blocks == cache.pool.num_blocks and len(cache.block_table) == 6
    assert torch.all(cache.pool.store(0).k[:2] == 7.0)
    assert cache.pool.num_sliding_blocks == sliding_blocks_per_seq(3, BLOCK_SIZE)   # the window's blocks, reused
    big = cache.step(60)                                               # a long step: more sliding blocks
    assert big.write[S].unique().numel() == 60 and cache.pool.num_sliding_blocks > 3


def test_pool_size_from_a_budget_or_the_context():
    cfg = config(window=3, context=64)
    per = kv_bytes_per_token(cfg, torch.bfloat16)
    assert per == {S: 2 * 2 * 2 * 2, F: 2 * 2 * 2}                   # 2 sliding layers, 1 full, bf16 K and V
    assert sliding_blocks_per_seq(3, 4) == 2 and sliding_blocks_per_seq(3, 16) == 3 and sliding_blocks_per_seq(17, 16) == 3
    size = kv_pool_size(cfg, torch.bfloat16, max_chunk=4, num_seqs=2, max_model_len=64)
    assert size.num_blocks == 2 * 4 and size.num_sliding_blocks == 2 * 2
    assert size.sliding_block_bytes == per[S] * BLOCK_SIZE
    cached = kv_pool_size(cfg, torch.bfloat16, max_chunk=4, num_seqs=2, max_model_len=64, prefix_caching=True)
    assert cached.num_sliding_blocks == 2 * size.num_sliding_blocks    # room for finished windows too
    size = kv_pool_size(cfg, torch.bfloat16, max_chunk=4, num_seqs=2, max_model_len=64, budget=10_000)
    assert size.num_blocks == (10_000 - 4 * per[S] * BLOCK_SIZE) // (per[F] * BLOCK_SIZE)
    assert size.total_bytes <= 10_000
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len 64"):
        kv_pool_size(cfg, torch.bfloat16, max_chunk=4, num_seqs=2, max_model_len=64, budget=700)


def test_pool_copies_blocks_in_every_owning_layer_of_their_type():
    cfg = config(window=3, types=(S, F, S, F), shared=0)
    pool = KVPool(cfg, num_blocks=4, num_sliding_blocks=3, dtype=torch.float32, block_size=4)
    for layer in range(4):
        k, v = pool.store(layer).tensors()
        k.copy_(torch.arange(k.numel(), dtype=torch.float32).view_as(k) + 1000 * layer)
        v.copy_(-k)
    before = {layer: [t.clone() for t in pool.store(layer).tensors()] for layer in range(4)}
    pool.copy_blocks([(1, 3), (3, 0)])                                 # sources are read before any write
    pool.copy_sliding_blocks([(2, 0)])
    for layer in range(4):
        for new, old in zip(pool.store(layer).tensors(), before[layer]):
            if cfg.layers[layer].is_sliding:
                assert torch.equal(new[0:4], old[8:12]) and torch.equal(new[4:], old[4:])
            else:
                assert torch.equal(new[12:16], old[4:8]) and torch.equal(new[0:4], old[12:16])
                assert torch.equal(new[4:12], old[4:12])
    with pytest.raises(ValueError, match="block 4 is not in"):
        pool.copy_blocks([(0, 4)])
    with pytest.raises(ValueError, match="destination of two copies"):
        pool.copy_sliding_blocks([(0, 1), (2, 1)])


# ---- the block manager: tables, windows, sharing ----


def test_block_manager_tables_windows_and_capacity():
    bm = BlockManager(num_blocks=4, block_size=4, num_sliding_blocks=3, window=3, caching=False)
    bm.reserve("a", 5)
    assert bm.table("a") == [0, 1] and bm.sliding_table("a") == [0, 1] and bm.free_blocks == 2
    assert bm.capacity("b") == 4                                       # one sliding block left
    bm.commit("a", range(5), 5)                                        # queries from 5 on see 3.. : block 0 stays
    assert bm.sliding_table("a") == [0, 1]
    bm.reserve("a", 7, start=5)
    bm.commit("a", range(7), 7)                                        # from 7 on: 5.. -> block 0's part goes back
    assert bm.sliding_table("a") == [-1, 1] and bm.free_sliding_blocks == 2
    assert bm.capacity("b") == 8 and bm.capacity("b", spare=1) == 4
    bm.reserve("b", 4)
    assert bm.table("b") == [2] and bm.sliding_table("b") == [0]
    assert bm.can_reserve("a", 12, start=7) and not bm.can_reserve("a", 13, start=7)
    bm.free("a")
    assert bm.free_blocks == 3 and bm.usage == 0.25 and bm.free_sliding_blocks == 2
    with pytest.raises(RuntimeError, match="no room"):
        bm.reserve("b", 17)


def test_block_manager_grows_with_its_pool_and_takes_the_new_ids_last():
    bm = BlockManager(num_blocks=2, block_size=4, num_sliding_blocks=2, window=3, caching=False)
    bm.reserve("a", 8)
    bm.commit("a", range(8), 8)                                        # from 8 on: 6.. -> block 0's part goes back
    assert not bm.can_reserve("a", 9, start=8)
    bm.grow(4, 3)
    assert (bm.free_blocks, bm.free_sliding_blocks) == (2, 2)
    bm.reserve("a", 13, start=8)
    assert bm.table("a") == [0, 1, 2, 3] and bm.sliding_table("a") == [-1, 1, 0, 2]   # the freed part first
    with pytest.raises(ValueError, match="cannot shrink"):
        bm.grow(3, 3)


def test_pool_grows_with_its_rows_where_they_are():
    pool = KVPool(config(types=(S, F)), num_blocks=2, num_sliding_blocks=1, dtype=torch.float32, block_size=4)
    for layer in range(2):
        for store in pool.store(layer).tensors():
            store.copy_(torch.rand(store.shape))
    big = pool.grown(4, 3)
    assert (big.num_blocks, big.num_sliding_blocks, big.block_size) == (4, 3, 4)
    for layer, rows, new_rows in ((0, 4, 12), (1, 8, 16)):                # sliding, full
        for new, old in zip(big.store(layer).tensors(), pool.store(layer).tensors()):
            assert new.shape[0] == new_rows and torch.equal(new[:rows], old)
    with pytest.raises(ValueError, match="cannot shrink"):
        pool.grown(1, 3)


def test_block_manager_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=6, block_size=4, num_sliding_blocks=6, window=8, caching=False)
    bm.reserve("p", 6)                                                 # positions 0..5: block 0 full, block 1 partial
    bm.fork("p", "c")
    assert bm.table("c") == [0, 1] and bm.refs(0) == bm.refs(1) == 2 and bm.sliding_table("c") == [0, 1]
    assert bm.free_blocks == 4 and bm.usage == pytest.approx(2 / 6)                  # shared blocks count once
    with pytest.raises(RuntimeError, match="already holds"):
        bm.fork("p", "c")
    # the child writes position 6 (block 1, shared): it gets a copy; block 0 (not written) stays shared
    assert bm.capacity("c", start=6) == 4 * 4 + 4                      # 2 blocks held + 4 free - 1 for the copy
    bm.reserve("c", 7, start=6)
    assert bm.table("c") == [0, 2] and bm.take_copies() == ([(1, 2)], [(1, 2)]) and bm.take_copies() == ([], [])
    assert bm.refs(1) == 1 and bm.refs(2) == 1 and bm.refs(0) == 2
    bm.reserve("p", 7, start=6)                                        # the parent now holds block 1 alone: no copy
    assert bm.table("p") == [0, 1] and bm.take_copies() == ([], [])
    bm.reserve("c", 9, start=7)                                        # growing takes a fresh block, no copy
    assert bm.table("c") == [0, 2, 3] and bm.take_copies() == ([], [])
    bm.free("p")
    assert bm.refs(0) == 1 and bm.refs(1) == 0 and bm.free_blocks == 3
    bm.free("c")
    assert bm.usage == 0 and bm.free_blocks == 6 and bm.free_sliding_blocks == 6
    assert all(bm.refs(b) == 0 for b in range(6))


def test_block_manager_copy_needs_a_free_block_and_a_freed_destination_drops_its_copy():
    bm = BlockManager(num_blocks=2, block_size=4, num_sliding_blocks=4, window=8, caching=False)
    bm.reserve("p", 6)
    bm.fork("p", "c")
    assert not bm.can_reserve("c", 7, start=6)                         # the copy of block 1 needs a free block
    assert bm.capacity("c", start=6) == 6                              # so it cannot write past what it has
    bm.free("p")
    assert bm.can_reserve("c", 7, start=6)                             # block 1 is the child's alone now
    bm.reserve("c", 7, start=6)
    assert bm.take_copies() == ([], [])
    bm2 = BlockManager(num_blocks=4, block_size=4, num_sliding_blocks=4, window=8, caching=False)
    bm2.reserve("p", 2)
    bm2.fork("p", "c")
    bm2.reserve("c", 3, start=2)                                       # copy 0 -> 1 recorded
    bm2.free("c")                                                      # ... into a block freed before it ran
    assert bm2.take_copies() == ([], [])


# ---- the prefix cache ----

def cached_run(bm, name, tokens, chunk=4):
    """A sequence through the block manager as the scheduler drives it: match, then reserve and commit a
    chunk at a time; returns the cached prefix it started from."""
    hit = bm.match(name, tokens)
    done = hit
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        bm.reserve(name, done + n, done)
        done += n
        bm.commit(name, tokens, done)
    return hit


def test_a_finished_prefix_is_reused_to_the_token_and_its_last_block_copied_on_write():
    bm = BlockManager(num_blocks=8, block_size=4, num_sliding_blocks=8, window=3)
    a = [5, 6, 7, 8, 9, 10, 11]                                        # blocks 0 (full) and 1 (3 tokens)
    assert cached_run(bm, "a", a) == 0
    table_a = list(bm.table("a"))
    bm.free("a", a, 7)                                                 # finished: both blocks stay cached
    assert bm.usage == 0 and bm.cached_blocks == 2 and bm.free_blocks == 8
    # the same 7 tokens and more: 7 cached (the last block's 3 tokens too); positions 7.. are computed
    b = a + [12, 13]
    assert bm.match("b", b) == 7 and bm.table("b") == table_a
    bm.reserve("b", 9, start=7)                                        # writes into the cached block 1: a copy
    copies = bm.take_copies()
    assert copies[0] == [(table_a[1], bm.table("b")[1])] and len(copies[1]) == 1
    # the prompt equal to the cached tokens: the last one is computed again (its logits are needed)
    assert bm.match("c", a) == 6
    # a prompt that parts from the cache inside block 1 reuses it up to there
    assert bm.match("d", [5, 6, 7, 8, 9, 99, 1, 2]) == 5
    # nothing in common
    assert bm.match("e", [1, 2, 3, 4, 5]) == 0 and not bm.holds("e")
    with pytest.raises(RuntimeError, match="already holds"):
        bm.match("b", b)


def test_free_registers_what_was_computed_since_the_last_commit():
    """A sequence that ends in the step that completes its prompt (or in any step) is freed without a commit
    after that step: `free` registers every block it computed, so the whole prompt is cached."""
    bm = BlockManager(num_blocks=8, block_size=4, num_sliding_blocks=8, window=3)
    a = list(range(100, 111))                                          # 11 tokens: two whole blocks, 3 more
    bm.reserve("a", 6)
    bm.commit("a", a, 6)                                               # the first chunk: block 0 registered
    bm.reserve("a", 11, 6)
    bm.free("a", a, 11)                                                # the last chunk ran; no commit after it
    assert bm.cached_blocks == 3
    assert bm.match("b", a) == 10 and bm.match("c", a + [1, 2]) == 11
    bm.free("b")
    bm.free("c")
    bm.reserve("d", 8)
    bm.free("d", None, 8)                                              # a failed sequence: nothing cached
    assert bm.cached_blocks == 3 and bm.free_blocks == 8


def test_a_hit_needs_the_sliding_window_before_it_and_is_cut_back_when_it_was_evicted():
    def cached_a(num_sliding_blocks):
        bm = BlockManager(num_blocks=16, block_size=4, num_sliding_blocks=num_sliding_blocks, window=3)
        cached_run(bm, "a", a)                                         # 5 blocks, each with a sliding part
        assert bm.sliding_table("a") == [-1] * 4 + [4]                 # behind its window: given back, cached
        bm.free("a", a, 20)                                            # cached parts, oldest first: blocks 0..4
        return bm

    a = list(range(100, 120))
    b = a + [1, 2]
    bm = cached_a(6)
    assert bm.match("b", b) == 20                                      # the window of 20: 18, 19 (block 4's part)
    bm.free("b")
    bm.reserve("x", 24)                                                # takes every sliding part: all evicted
    assert bm.free_sliding_blocks == 0
    assert bm.match("b", b) == 0                                       # no window left anywhere: from 0
    bm = cached_a(6)
    bm.reserve("y", 12)                                                # 3 parts: the free one, blocks 0's and 1's
    assert bm.match("b", b) == 20
    assert bm.match("z", a[:14]) == 13                                 # window of 13: 11, 12 (blocks 2, 3): kept
    # window of 9: 7, 8 (blocks 1, 2): block 1's part is gone, and so is block 0's: cut back to 8, 4, then 0
    assert bm.match("w", a[:10]) == 0


def test_prefix_cache_reference_counts_lru_eviction_and_running_sequences():
    bm = BlockManager(num_blocks=4, block_size=4, num_sliding_blocks=8, window=2)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    cached_run(bm, "a", a)                                             # still running: blocks 0, 1 registered
    assert bm.cached_blocks == 2
    b = [1, 2, 3, 4, 5, 6, 7, 8, 0, 0]
    assert bm.match("b", b) == 8                                       # a running request's prefix
    assert bm.refs(bm.table("a")[0]) == 2 and bm.usage == 3 / 4
    bm.free("a", a, 9)
    bm.free("b")
    assert bm.usage == 0 and bm.cached_blocks == 3 and bm.free_blocks == 4     # a's last block (9) too
    # a new sequence needing every block evicts the cached ones, least recently used first
    cached_run(bm, "c", list(range(50, 66)))
    assert bm.cached_blocks == 4 and bm.match("d", b) == 0
    bm.free("c")
    bm.free("d")


def test_caching_off_matches_nothing_and_registers_nothing():
    bm = BlockManager(num_blocks=4, block_size=4, num_sliding_blocks=4, window=2, caching=False)
    cached_run(bm, "a", list(range(9)))
    bm.free("a", list(range(9)), 9)
    assert bm.cached_blocks == 0 and bm.match("b", list(range(12))) == 0 and bm.free_blocks == 4


def test_block_manager_random_walk_keeps_its_invariants():
    """Random admissions, chunks, forks, frees and hits: reference counts equal the tables, no block is
    both free and cached, every hit's blocks hold exactly the tokens it claims, and a held sliding part is
    never evicted."""
    rng = random.Random(3)
    bs, window = 4, 5
    bm = BlockManager(num_blocks=24, block_size=bs, num_sliding_blocks=14, window=window)
    content: dict[int, list[int]] = {}                                 # block -> the tokens written there
    live: dict[int, tuple[list[int], int]] = {}                        # seq -> (tokens, computed)
    vocab = [1, 2, 3]
    hits, copies = [], 0
    for step in range(600):
        op = rng.random()
        if op < 0.3 and len(live) < 4:
            name = step
            tokens = [rng.choice(vocab) for _ in range(rng.randint(2, 30))]
            hit = bm.match(name, tokens)
            hits.append(hit)
            for j, b in enumerate(bm.table(name) if hit else []):
                lo = j * bs
                assert content[b][:min(bs, hit - lo)] == tokens[lo:min(lo + bs, hit)]     # exact
            live[name] = (tokens, hit)
        elif op < 0.8 and live:
            name = rng.choice(list(live))
            tokens, done = live[name]
            if done >= len(tokens):
                tokens = tokens + [rng.choice(vocab)]                  # a sampled token
            n = min(rng.randint(1, 6), len(tokens) - done)
            if not bm.can_reserve(name, done + n, done):
                continue
            bm.reserve(name, done + n, done)
            for src, dst in bm.take_copies()[0]:
                content[dst] = list(content.get(src, []))
                copies += 1
            table = bm.table(name)
            for p in range(done, done + n):
                assert bm.refs(table[p // bs]) == 1                    # written only by its one holder
                content.setdefault(table[p // bs], [])
                row = content[table[p // bs]]
                del row[p % bs:]
                row.append(tokens[p])
            assert all(s >= 0 for s in bm.sliding_table(name)[max(0, done - window + 1) // bs:])
            if rng.random() < 0.8:                                     # else a later commit or free registers it
                bm.commit(name, tokens, done + n)
            live[name] = (tokens, done + n)
        elif op < 0.85 and live and len(live) < 4:
            parent = rng.choice(list(live))
            if not bm.holds(parent):
                continue
            name = -step
            bm.fork(parent, name)
            live[name] = (list(live[parent][0]), live[parent][1])
        elif live:
            name = rng.choice(list(live))
            tokens, done = live.pop(name)
            bm.free(name, tokens if rng.random() < 0.8 else None, done)
        held = [b for name in live if bm.holds(name) for b in bm.table(name)]
        assert all(bm.refs(b) == held.count(b) for b in range(24))
        assert not set(bm._free) & set(bm._lru) and len(set(bm._free)) == len(bm._free)
        assert bm.free_blocks + len(set(held)) == 24
    assert sum(h > 0 for h in hits) > len(hits) // 3 and copies > 10            # the walk did hit and copy
