"""The prefix cache's KV tensors: full prompt blocks, kept after their sequence moved on, addressed by block id.

Owns the block tensors (per layer, ``[blocks, kv_heads, block_size, head_dim]``), grown on demand up to the number
of blocks the scheduler's ``PrefixIndex`` manages. Which block holds what, who references it and what is evicted
are the index's books (``engine.sched.prefix``); this store only reads blocks out (``gather``) and writes a row's
prompt blocks in (``write``), as the ``SchedulerOutput`` says.

It also keeps the last few prefixes it gathered in a row's layout (``gather_prefix``), until a write touches one of
their blocks: the waves of admissions that start from one cached instruction (label, fewshot) take it from there,
where each pass gathered it again (a gather per buffer: 48 kernels a pass on the 0.5B shape, and a host-made index
array). They are a copy beside the blocks, bounded by ``HOT_PREFIXES`` and an eighth of the store's blocks' bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlxbatch.engine.kv import copies
from mlxbatch.engine.kv.packed import host_arrays
from mlxbatch.engine.outputs import Traffic

HOT_PREFIXES = 4  # gathered prefixes kept, the most recently used


class PrefixStore:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, bytes_per_token: int,
                 num_blocks: int, block_size: int, traffic: Traffic | None = None) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.traffic = traffic if traffic is not None else Traffic()
        self._token_bytes = bytes_per_token
        self._shape = (kv_heads, block_size, head_dim)
        self._dtype = dtype
        self._num_layers = num_layers
        self._keys: list[mx.array] = []
        self._values: list[mx.array] = []
        self._capacity = 0
        self._dirty = False
        self._hot: dict[tuple[int, ...], list[mx.array]] = {}  # block ids -> gathered prefix, the last used last
        self._hot_limit = num_blocks * block_size * bytes_per_token // 8

    def _ensure(self, max_id: int) -> None:
        if max_id < self._capacity:
            return
        cap = min(self.num_blocks, max(64, 2 * self._capacity, max_id + 1))
        self.traffic.grown_bytes += self.nbytes
        self.traffic.resizes += 1

        def grown(old: mx.array) -> mx.array:
            g = mx.zeros((cap, *self._shape), self._dtype)
            g[: old.shape[0]] = old
            return g

        for bufs in (self._keys, self._values):
            if not bufs:
                bufs.extend([mx.zeros((0, *self._shape), self._dtype)] * self._num_layers)
        copies.replace_each((self._keys, self._values), grown, self.traffic)
        self._capacity = cap

    @property
    def nbytes(self) -> int:
        """The block tensors and the gathered prefixes kept beside them."""
        return sum(a.nbytes for a in (*self._keys, *self._values)) + self._hot_bytes()

    def _hot_bytes(self) -> int:
        return sum(a.nbytes for kv in self._hot.values() for a in kv)

    def gather(self, block_ids: Sequence[int]) -> tuple[list[mx.array], list[mx.array]]:
        """These blocks, in order, per layer ``[blocks, H, block_size, D]`` (one gather per layer, lazy)."""
        idx = mx.array(list(block_ids), dtype=mx.int32)
        return [k[idx] for k in self._keys], [v[idx] for v in self._values]

    def gather_prefix(self, block_ids: Sequence[int]) -> list[mx.array]:
        """These blocks as one prefix in a row's layout, every layer's keys then values, each ``[H, blocks *
        block_size, D]`` (lazy): one gather per buffer (``gather`` then a transpose to a row's layout costs a copy per
        buffer more: 48 kernels a copy-in on the 0.5B shape). Taken from the prefixes kept, where one of them holds
        these blocks (no block of it written since it was gathered)."""
        key = tuple(block_ids)
        kv = self._hot.pop(key, None)
        if kv is not None:
            self.traffic.hot_prefix_hits += 1
        else:
            B, n = self.block_size, len(block_ids)
            blk, pos = host_arrays([b for b in block_ids for _ in range(B)], list(range(B)) * n)
            heads = mx.arange(self._shape[0], dtype=mx.int32)[:, None]
            kv = [buf[blk[None, :], heads, pos[None, :]] for buf in (*self._keys, *self._values)]
            self.traffic.prefix_gathers += 1
        self._hot[key] = kv  # evaluated with the copy-in that reads it
        while self._hot and (len(self._hot) > HOT_PREFIXES or self._hot_bytes() > self._hot_limit):
            del self._hot[next(iter(self._hot))]  # the least recently used (this one too, if it alone is over)
        return kv

    def reset(self, keep_blocks: bool) -> None:
        """After a failed evaluation: the gathered prefixes kept go (they may be its results); unless
        ``keep_blocks``, the block tensors too (a failed evaluation wrote them: every block is undefined, so the index
        must forget them all), regrown empty on the next write."""
        self._hot.clear()
        if not keep_blocks:
            self._keys, self._values = [], []
            self._capacity = 0
            self._dirty = False

    def _written(self, block_ids: Sequence[int]) -> None:
        """Drop the kept prefixes that hold any of these blocks (they are rewritten)."""
        ids = set(block_ids)
        for key in [k for k in self._hot if ids.intersection(k)]:
            del self._hot[key]

    def write(self, row_kv: Sequence[tuple[mx.array, mx.array]], first_block: int, block_ids: Sequence[int]) -> None:
        """Copy blocks ``first_block ..`` of a row (per layer ``[1, H, length, D]``, lazy views) into ``block_ids`` (the
        last may be partial: the row's length ends inside it).
        Evaluated with the step (``pending``), once for every write of a step."""
        self._ensure(max(block_ids))
        self._written(block_ids)
        B, n = self.block_size, len(block_ids)
        idx = mx.array(list(block_ids), dtype=mx.int32)
        start, stop = first_block * B, (first_block + n) * B
        for layer, (k, v) in enumerate(row_kv):
            self._keys[layer][idx] = _blocks(k[0, :, start:stop, :], n, B)
            self._values[layer][idx] = _blocks(v[0, :, start:stop, :], n, B)
        self.traffic.stored_bytes += n * B * self._token_bytes
        self._dirty = True

    def write_blocks(self, block_ids: Sequence[int], keys: Sequence[mx.array], values: Sequence[mx.array]) -> None:
        """Whole blocks (per layer ``[n, H, block_size, D]``, e.g. ``read_blocks`` of the running batch) into
        ``block_ids``: one scatter per buffer for every block of a step. Evaluated with the step (``pending``)."""
        assert len(set(block_ids)) == len(block_ids), "a block is written once a step"
        self._ensure(max(block_ids))
        self._written(block_ids)
        idx = mx.array(list(block_ids), dtype=mx.int32)
        for layer in range(self._num_layers):
            self._keys[layer][idx] = keys[layer]
            self._values[layer][idx] = values[layer]
        self.traffic.stored_bytes += len(block_ids) * self.block_size * self._token_bytes
        self._dirty = True

    def pending(self) -> list[mx.array]:
        """The buffers with this step's writes, for the step's last evaluation (their sources are lazy views of the
        running batch's slots: they must be evaluated before the slots are written again); empty if none."""
        if not self._dirty:
            return []
        self._dirty = False
        return self._keys + self._values


def _blocks(x: mx.array, n: int, block_size: int) -> mx.array:
    """``[H, <= n * B, D]`` positions as ``n`` blocks ``[n, H, B, D]``; a partial last block (the row ends inside it)
    is padded, and only its first positions are ever read back."""
    H, T, D = x.shape
    if T < n * block_size:
        x = mx.pad(x, ((0, 0), (0, n * block_size - T), (0, 0)))
    return x.reshape(H, n, block_size, D).transpose(1, 0, 2, 3)
