"""How fast the KV block copies run, by how they index (GPU diagnostic for the prefix copy-ins)

    python3 scripts/copy_kernels.py [--blocks 1024] [--layers 48] [--reps 10]

A prefix copy-in moves cached blocks from the prefix store (per buffer ``[blocks, H, block_size, D]``) into slot rows
(``[rows, H, T, D]``) at block-aligned positions: one gather from the store and one scatter into the slots per buffer
(``kv.slots.SlotBatch.write_blocks``); storing a prompt's blocks is the inverse (``read_blocks``). MLX's CUDA
scatter and gather run a thread per element with the index arithmetic of every index array, so how a copy is indexed
may matter more than the bytes it moves. This times, over ``--layers`` buffers of the 0.5B shape (2 KV heads, head
dim 64, bf16), per way: the slot side as it is now (three index arrays: rows, heads, positions, a ``[D]`` slice
each), one index array over the slots viewed as ``[rows * H * T / block_size, block_size, D]`` (a ``[block_size, D]``
slice each), and that one over 32-bit words (``view(uint32)``). Prints ms a copy, GB/s (bytes written) and the peak
memory growth (the gathered blocks, ~the bytes written, are expected there; a whole-buffer copy instead of an
in-place write shows as more), and checks each way writes the same.
"""

# ruff: isort: skip_file
from __future__ import annotations

import argparse
import statistics
import time

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs, and direct CUDA launches)
import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1024, help="blocks a copy moves (per buffer)")
    ap.add_argument("--layers", type=int, default=48, help="buffers (2 per layer: keys and values)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--capacity", type=int, default=1024, help="slot positions a row")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    H, D, B, dt = 2, 64, 16, mx.bfloat16
    R, T, n = a.rows, a.capacity, a.blocks
    store = [mx.random.normal((4 * n, H, B, D)).astype(dt) for _ in range(a.layers)]
    slots = [mx.zeros((R, H, T, D), dtype=dt) for _ in range(a.layers)]
    mx.eval(store, slots)
    # block j of the copy: store block 4j + 1 -> row j % R at position B * (j // R) (block-aligned, like a copy-in)
    src = mx.array([4 * j + 1 for j in range(n)], dtype=mx.int32)
    rows_l = [j % R for j in range(n)]
    starts_l = [B * (j // R) for j in range(n)]
    rows = mx.array(rows_l, dtype=mx.int32)[:, None, None]
    pos = (mx.array(starts_l, dtype=mx.int32)[:, None] + mx.arange(B, dtype=mx.int32)[None, :])[:, None, :]
    heads = mx.arange(H, dtype=mx.int32)[None, :, None]
    # one index: slot (row, head, block) of the view [R * H * (T // B), B, D]
    flat = mx.array([(r * H + h) * (T // B) + s // B for r, s in zip(rows_l, starts_l) for h in range(H)],
                    dtype=mx.int32)

    def three(i: int) -> None:
        slots[i][rows, heads, pos] = store[i][src]

    def one(i: int) -> None:
        v = slots[i].reshape(R * H * (T // B), B, D)
        v[flat] = store[i][src].reshape(n * H, B, D)
        slots[i] = v.reshape(R, H, T, D)

    def words(i: int) -> None:
        v = slots[i].view(mx.uint32).reshape(R * H * (T // B), B, D // 2)
        v[flat] = store[i][src].view(mx.uint32).reshape(n * H, B, D // 2)
        slots[i] = v.reshape(R, H, T, D // 2).view(dt)

    ways = {"3 index arrays (now)": three, "1 index array": one, "1 index array, uint32 words": words}
    written = a.layers * n * H * B * D * 2
    print(f"device {mx.default_device()}; {a.layers} buffers [{R}, {H}, {T}, {D}] bf16; {n} blocks of {B} a copy; "
          f"{written / 2**20:.0f} MiB written a copy")
    print("| way | ms a copy (median) | GB/s written | peak memory growth MiB | same as now |")
    print("|---|---|---|---|---|")
    want = None
    for name, way in ways.items():
        for i in range(a.layers):
            slots[i] = mx.zeros_like(slots[i])
        mx.eval(slots)
        times = []
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        for _ in range(a.reps):
            mx.synchronize()
            t0 = time.perf_counter()
            for i in range(a.layers):
                way(i)
            mx.eval(slots)
            times.append(time.perf_counter() - t0)
        grew = (mx.get_peak_memory() - base) / 2**20
        got = mx.concatenate([s.reshape(-1)[: 1 << 16] for s in slots[:2]])
        same = "-" if want is None else str(bool(mx.array_equal(got, want).item()))
        want = got if want is None else want
        ms = 1e3 * statistics.median(times)
        print(f"| {name} | {ms:.2f} | {written / (ms / 1e3) / 1e9:.1f} | {grew:.0f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
