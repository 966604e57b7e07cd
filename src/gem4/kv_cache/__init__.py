"""The KV cache: where each sequence's K/V live, in integers and in tensors.

    blocks.py   BlockManager: which blocks each sequence holds, sharing, copy-on-write, the prefix cache
                (plain integers, no tensors)
    pool.py     KVPool and the layout of one step over it (SeqStep -> StepLayout, Attend): the storage, in the
                stored dtype (--kv-cache-dtype: bf16, or int8 / fp8 quantized on write: LayerKV)
    cache.py    KVCache: one sequence in a pool of its own, grown on demand, its blocks a BlockManager's

Why a package. Which blocks a sequence holds, and which sliding blocks it gives back as its window moves on,
has one owner, the block manager, for the engine's sequences and for a `KVCache` alike. `KVCache` sits below
the model (`Model.extend` takes one), so the block manager sits here too, beside the pool, rather than in
the engine: the engine imports both from here, and nothing here imports the engine. The block manager
knows no tensors and the pool no policy; how big the engine's pool is (memory, prefix-cache room) is the
engine's (engine/pool.py).
"""
from gem4.kv_cache.blocks import BlockManager
from gem4.kv_cache.cache import KVCache
from gem4.kv_cache.pool import (BLOCK_SIZE, KV_CACHE_DTYPES, Attend, KVPool, LayerKV, SeqStep, StepLayout,
                                kv_bytes_per_token, kv_cache_dtype, kv_dtype_name, quantize, sliding_blocks_per_seq)

__all__ = ["BLOCK_SIZE", "KV_CACHE_DTYPES", "Attend", "BlockManager", "KVCache", "KVPool", "LayerKV", "SeqStep",
           "StepLayout", "kv_bytes_per_token", "kv_cache_dtype", "kv_dtype_name", "quantize", "sliding_blocks_per_seq"]
