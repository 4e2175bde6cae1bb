"""Prefix reuse on the runner's side: the copies that the scheduler's admissions and stores ask for.

Owns nothing but the execution (the decisions and the books are ``engine.sched.prefix``'s): new rows are placed
where the step's prefill passes want them, then get the KV they start from (a running row's prefix, or cached blocks),
all copies of a step batched (one gather and one scatter per buffer on a GPU, in slices of at most
``copies.MAX_COPY_BYTES``: a launch each, the next waiting for it); after a successful step, prompt blocks are written
into the prefix store.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import mlx.core as mx

from mlxbatch.engine.kv import KVLayout, copies
from mlxbatch.engine.kv.prefix_store import PrefixStore
from mlxbatch.engine.sched.prefix import BlockStore, CachedBlocks, RunningRow
from mlxbatch.engine.sched.step import Admission


def admit(batch: KVLayout, store: PrefixStore | None, admissions: Sequence[Admission],
          order: Sequence[str] | None = None, max_bytes: int | None = None) -> None:
    """Rows for newly admitted sequences, placed where the step's prefill passes want them, starting from the KV they
    reuse.

    The new rows join empty, then ``order`` (this step's prefilling rows, new and old, in pass order) is arranged
    (``arrange``: a row without KV moves by its books alone), and only then are the prefixes copied in, into the rows'
    final places: arranged after their copy-ins, a step's new rows had their prefixes moved a second time (about a
    third of every byte a run moved). A prefix that many new rows share is read once and written into all of them at
    once (``write_prefix``: a wave of ~200 fewshot rows sharing one prefix is one broadcast write per buffer); the
    other copies are batched (one gather and one scatter per buffer on a GPU). The reads go in slices of at most
    ``max_bytes`` (default ``copies.MAX_COPY_BYTES``): each but the last is launched (the next launch waits for it);
    the last, and a running row's copies, are evaluated with the step's first pass (they stay lazy here).
    """
    live: list[tuple[str, str, int]] = []
    cached: list[tuple[str, CachedBlocks]] = []
    for a in admissions:
        batch.add(a.request.request_id)
    if order is not None:
        batch.arrange(order)
    for a in admissions:
        rid = a.request.request_id
        if isinstance(a.source, RunningRow):
            live.append((rid, a.source.request_id, a.source.num_tokens))
        elif isinstance(a.source, CachedBlocks):
            cached.append((rid, a.source))
    pos = batch.position_bytes
    # what a copy gathers: a prefix shared by ``broadcast_rows`` new rows or more is read once; the other copies are
    # gathered together, each at the longest one's length
    shared = collections.Counter((s, k) for _, s, k in live)
    longest = max((n for _, _, n in live), default=0)
    seen: set[tuple[str, int]] = set()

    def read_once(c: tuple[str, str, int]) -> int:
        key = (c[1], c[2])
        if shared[key] < batch.broadcast_rows:
            return longest * pos
        first = key not in seen
        seen.add(key)
        return c[2] * pos if first else 0

    for part in copies.slices(live, read_once, max_bytes):
        batch.copy_prefixes(part)
    if cached:
        assert store is not None
        B = store.block_size
        same: dict[tuple[int, ...], list[str]] = {}  # rows that start from the same blocks
        for rid, c in cached:
            same.setdefault(c.block_ids, []).append(rid)
        # a prefix shared by ``broadcast_rows`` or more is gathered once and written into all of them at once; the
        # others' blocks go in one gather and one scatter per buffer
        wide = [(ids, rids) for ids, rids in same.items() if len(rids) >= batch.broadcast_rows]
        rest = [(ids, [rid]) for ids, rids in same.items() if len(rids) < batch.broadcast_rows for rid in rids]
        parts = copies.slices(wide + rest, lambda g: len(g[0]) * B * pos, max_bytes)
        for j, part in enumerate(parts):
            blocks = [(ids, rids[0]) for ids, rids in part if len(rids) < batch.broadcast_rows]
            for block_ids, rids in part:
                if len(rids) >= batch.broadcast_rows:  # gathered in a row's layout: [H, blocks * B, D] a buffer
                    batch.write_prefix(rids, store.gather_prefix(block_ids))
            if blocks:
                keys, values = store.gather([b for ids, _ in blocks for b in ids])
                batch.write_blocks([(rid, j * B) for ids, rid in blocks for j in range(len(ids))], keys, values, B)
                del keys, values
            # every slice but the last is launched, not waited for (the next launch waits for it: ``Traffic``), so at
            # most a slice's gathered blocks are alive at once; the last goes with the step's first pass, which reads
            # every buffer: launched here, it waited for the step in flight (``Traffic.launch`` settles it first), and
            # the host built the pass with the device idle but for the copy (a cached pass cost twice an uncached one
            # on CUDA); left lazy, the host builds copy and pass while the device finishes the step before
            if j + 1 < len(parts):
                batch.traffic.launch("prefill", *batch.kv_arrays())
        for rid, c in cached:
            batch.advance(rid, c.num_tokens)  # the row holds its cached prefix now


def store_blocks(batch: KVLayout, store: PrefixStore, stores: Sequence[BlockStore]) -> list[mx.array]:
    """Finished prompts' blocks into the prefix store, lazily, before any row moves again; returns the store's
    buffers to evaluate with the step (before the slots are written again).

    With batched moves (GPU) every block of the step goes in one gather from the slots and one scatter per buffer
    (per-row writes took 228 ms a store step on an H200 in the chat workload: a scatter per row and buffer); on the
    CPU row by row."""
    if not stores:
        return []
    if batch.options.batched_moves:
        B = store.block_size
        keys, values = batch.read_blocks([(s.request_id, (s.first_block + j) * B)
                                          for s in stores for j in range(len(s.block_ids))], B)
        store.write_blocks([b for s in stores for b in s.block_ids], keys, values)
    else:
        for s in stores:
            store.write(batch.row_view(s.request_id), s.first_block, s.block_ids)
    return store.pending()
