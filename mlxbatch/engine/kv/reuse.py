"""Prefix reuse on the runner's side: the copies that the scheduler's admissions and stores ask for.

Owns nothing but the execution (the decisions and the books are ``engine.sched.prefix``'s): new rows get the KV
they start from (a running row's prefix, or cached blocks), all copies of a step batched (one gather and one scatter
per buffer on a GPU, two syncs a step); after a successful step, prompt blocks are written into the prefix store.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxbatch.engine.kv import KVLayout
from mlxbatch.engine.kv.prefix_store import PrefixStore
from mlxbatch.engine.sched.prefix import BlockStore, CachedBlocks, RunningRow
from mlxbatch.engine.sched.scheduler import Admission


def admit(batch: KVLayout, store: PrefixStore | None, admissions: Sequence[Admission]) -> None:
    """Rows for newly admitted sequences, starting from the KV they reuse."""
    live: list[tuple[str, str, int]] = []
    cached: list[tuple[str, CachedBlocks]] = []
    for a in admissions:
        rid = a.request.request_id
        if isinstance(a.source, RunningRow):
            batch.add(rid)
            live.append((rid, a.source.request_id, a.source.num_tokens))
        elif isinstance(a.source, CachedBlocks):
            batch.add(rid, length=a.source.num_tokens)
            cached.append((rid, a.source))
        else:
            batch.add(rid)
    batch.copy_prefixes(live)
    if cached:
        assert store is not None
        keys, values = store.gather([b for _, c in cached for b in c.block_ids])
        B = store.block_size
        batch.write_blocks([(rid, j * B) for rid, c in cached for j in range(len(c.block_ids))], keys, values, B)
        batch.traffic.evaluate(batch.kv_arrays())  # one sync for every copy-in, before the blocks may be rewritten


def store_blocks(batch: KVLayout, store: PrefixStore, stores: Sequence[BlockStore]) -> None:
    """Finished prompts' blocks into the prefix store (one sync for all), before any row moves again.

    With batched moves (GPU) every block of the step goes in one gather from the slots and one scatter per buffer
    (per-row writes took 228 ms a store step on an H200 in the chat workload: a scatter per row and buffer); on the CPU row by row."""
    if not stores:
        return
    if batch.batched_moves:
        B = store.block_size
        keys, values = batch.read_blocks([(s.request_id, (s.first_block + j) * B)
                                          for s in stores for j in range(len(s.block_ids))], B)
        store.write_blocks([b for s in stores for b in s.block_ids], keys, values)
    else:
        for s in stores:
            store.write(batch.row_view(s.request_id), s.first_block, s.block_ids)
    store.flush()
