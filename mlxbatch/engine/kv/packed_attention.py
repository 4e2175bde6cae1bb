"""A packed prefill pass's attention as one tensor-core kernel a layer, on CUDA.

A packed pass (``kv.packed``) lays a step's prefill tokens end to end; each token attends to its own slot row's keys
up to its own position. Through MLX's ops that takes a gather, a scale, two matmuls, a mask and a softmax per group of
similar rows and a gather back, every layer: ~16 launches and two cuBLAS heuristic queries a group, and the groups'
shapes (rows, width, keys) are new at nearly every step, so the host spent more encoding a cached pass (~27 ms on the
H200) than the device spent running it (~13 ms). This kernel takes the pass as it is: one launch a layer, whatever
the rows, their lengths or their offsets, no mask, no regrouping, no materialised scores.

Work is cut into units of 64 query rows of one slot row and one KV head: a row's ``n`` new tokens times the ``R``
query heads of a KV head (GQA: the heads share the keys) are ``n * R`` rows, 64 at a time. A block of four warps runs
a unit (flash attention: tiles of 64 keys and values staged in shared memory once for the four warps, 16 query rows a
warp through ``mma.sync`` m16n8k16 in bf16/fp16 with float32 accumulation, an online softmax in registers), up to the
unit's last position. ``units`` makes the unit table on the host, once a pass.

``PackedAttention.create()`` returns None where it cannot run (no CUDA, a head size or type it does not take) or
where its output disagrees with ``reference`` (MLX's attention, token by token) on a ragged probe; the packed pass
then keeps MLX's ops (``kv.prefill_attention``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import mlx.core as mx

log = logging.getLogger(__name__)

UNIT = 64  # query rows a unit: a block of four warps, 16 rows (an mma tile) each
_WARPS = 4  # warps a block (a unit)
FIELDS = 5  # a unit: slot row, its first packed token, its tokens in the pass, first query row, its offset

_HEADER = """
__device__ __forceinline__ unsigned int mlxb_pack(float lo, float hi, __nv_bfloat16*) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned int*>(&v);
}
__device__ __forceinline__ unsigned int mlxb_pack(float lo, float hi, __half*) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned int*>(&v);
}
__device__ __forceinline__ unsigned int mlxb_pair(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  __nv_bfloat162 v; v.x = lo; v.y = hi;
  return *reinterpret_cast<unsigned int*>(&v);
}
__device__ __forceinline__ unsigned int mlxb_pair(__half lo, __half hi) {
  __half2 v; v.x = lo; v.y = hi;
  return *reinterpret_cast<unsigned int*>(&v);
}
__device__ __forceinline__ void mlxb_mma(float* c, const unsigned int* a, unsigned int b0, unsigned int b1,
                                         __nv_bfloat16*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mlxb_mma(float* c, const unsigned int* a, unsigned int b0, unsigned int b1, __half*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""

_SOURCE = """
    constexpr int WARPS = 4;                // a block: 64 query rows of one slot row and KV head, 16 a warp
    constexpr int KT = 64;                  // keys a tile
    constexpr int NT = KT / 8;              // score tiles (8 keys) a key tile
    constexpr int KS = D / 16;              // k-steps over the head dims (scores)
    constexpr int DT = D / 8;               // output tiles (8 dims)
    constexpr int PAD = D + 8;              // shared rows padded: fragment reads fall in distinct banks
    constexpr int KPAD = KT + 8;
    constexpr int VEC = 8;                  // elements a 16-byte load
    __shared__ __align__(16) T ks_[KT][PAD];     // the tile's keys, [key][dim]
    __shared__ __align__(16) T vt_[D][KPAD];     // its values transposed, [dim][key]
    const float NEG_INF = -__int_as_float(0x7f800000);
    T* tag = nullptr;                       // picks the mma and packing overloads by type

    const int HKV = kb_shape[1];
    const int H = HKV * R;
    const int U = units_shape[0];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, tg = lane & 3;

    if ((int)blockIdx.x >= U * HKV) {       // the last block: the pass's padding tokens get zeros
      const int first = units[(size_t)(U - 1) * 5 + 1] + units[(size_t)(U - 1) * 5 + 2];  // past the last row
      const int total = (q_shape[0] - first) * H * D;
      for (int e = threadIdx.x; e < total; e += blockDim.x) out[(size_t)first * H * D + e] = static_cast<T>(0.0f);
      return;
    }
    const int h = blockIdx.x % HKV;
    const int* un = units + (size_t)(blockIdx.x / HKV) * 5;
    const int row = un[0], tok0 = un[1], n = un[2], off = un[4];
    const int m0 = un[3] + 16 * warp;       // this warp's first query row
    const int rows_here = n * R;
    const int kmax = off + (min(un[3] + 16 * WARPS, rows_here) - 1) / R;   // the block's last key (inclusive)
    const bool active = m0 < rows_here;
    const int kmax_w = active ? off + (min(m0 + 16, rows_here) - 1) / R : -1;  // this warp's

    // this thread's two query rows (g and g + 8): their token, head and last key
    int tok[2], head[2], last[2];
    bool valid[2];
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int m = m0 + g + 8 * i;
      valid[i] = m < rows_here;
      const int j = valid[i] ? m / R : 0;
      tok[i] = tok0 + j;
      head[i] = h * R + (valid[i] ? m % R : 0);
      last[i] = valid[i] ? off + j : -1;
    }

    // queries as A fragments (row-major 16 x 16 a k-step), read by their strides (a view of RoPE's output)
    unsigned int qa[KS][4];
    #pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      #pragma unroll
      for (int hi = 0; hi < 2; ++hi) {      // columns tg * 2 (+ 8)
        #pragma unroll
        for (int i = 0; i < 2; ++i) {       // rows g (+ 8)
          const int c = ks * 16 + tg * 2 + hi * 8;
          T a0 = static_cast<T>(0.0f), a1 = static_cast<T>(0.0f);
          if (valid[i]) {
            const T* qp = q + (size_t)tok[i] * q_strides[0] + (size_t)head[i] * q_strides[1];
            a0 = qp[(size_t)c * q_strides[3]];
            a1 = qp[(size_t)(c + 1) * q_strides[3]];
          }
          qa[ks][hi * 2 + i] = mlxb_pair(a0, a1);
        }
      }
    }

    const T* kp = kb + (size_t)row * kb_strides[0] + (size_t)h * kb_strides[1];
    const T* vp = vb + (size_t)row * vb_strides[0] + (size_t)h * vb_strides[1];
    const size_t ks2 = kb_strides[2], vs2 = vb_strides[2];
    const float sl2 = SCALE * 1.4426950408889634f;   // scores in log2 units: exp2 below

    float o[DT][4];
    #pragma unroll
    for (int d = 0; d < DT; ++d) { o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f; }
    float m_run[2] = {NEG_INF, NEG_INF};
    float l_run[2] = {0.0f, 0.0f};

    for (int t0 = 0; t0 <= kmax; t0 += KT) {
      __syncthreads();                      // the last tile's reads are done
      for (int c = threadIdx.x; c < KT * D / VEC; c += WARPS * 32) {   // 16-byte loads, keys past the end as 0
        const int key = c / (D / VEC), d0 = (c % (D / VEC)) * VEC;
        uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
        if (t0 + key <= kmax) {
          kv4 = *reinterpret_cast<const uint4*>(kp + (size_t)(t0 + key) * ks2 + d0);
          vv4 = *reinterpret_cast<const uint4*>(vp + (size_t)(t0 + key) * vs2 + d0);
        }
        *reinterpret_cast<uint4*>(&ks_[key][d0]) = kv4;
        const T* ve = reinterpret_cast<const T*>(&vv4);
        #pragma unroll
        for (int x = 0; x < VEC; ++x) vt_[d0 + x][key] = ve[x];
      }
      __syncthreads();
      if (t0 > kmax_w) continue;            // (this warp's rows end before the tile: it only helps load)
      float s[NT][4];
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        #pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          const T* kr = &ks_[nt * 8 + g][ks * 16 + tg * 2];   // B fragment: key g of the score tile
          const unsigned int b0 = *reinterpret_cast<const unsigned int*>(kr);
          const unsigned int b1 = *reinterpret_cast<const unsigned int*>(kr + 8);
          mlxb_mma(s[nt], qa[ks], b0, b1, tag);
        }
      }
      // mask (causal by each row's own position), scale, the tile's row maxima
      float tmax[2] = {NEG_INF, NEG_INF};
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e >> 1;
          const int key = t0 + nt * 8 + tg * 2 + (e & 1);
          const float v = key <= last[i] ? s[nt][e] * sl2 : NEG_INF;
          s[nt][e] = v;
          tmax[i] = fmaxf(tmax[i], v);
        }
      }
      float corr[2];
      #pragma unroll
      for (int i = 0; i < 2; ++i) {
        tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffff, tmax[i], 1));
        tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffff, tmax[i], 2));
        const float m_new = fmaxf(m_run[i], tmax[i]);
        const float m_use = m_new == NEG_INF ? 0.0f : m_new;
        corr[i] = exp2f(m_run[i] - m_use);
        m_run[i] = m_new;
        float sum = 0.0f;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float p0 = exp2f(s[nt][2 * i] - m_use), p1 = exp2f(s[nt][2 * i + 1] - m_use);
          s[nt][2 * i] = p0;
          s[nt][2 * i + 1] = p1;
          sum += p0 + p1;
        }
        l_run[i] = l_run[i] * corr[i] + sum;   // this thread's share of the row (summed over the 4 at the end)
      }
      #pragma unroll
      for (int d = 0; d < DT; ++d) {
        o[d][0] *= corr[0]; o[d][1] *= corr[0]; o[d][2] *= corr[1]; o[d][3] *= corr[1];
      }
      // values: the probabilities as A fragments (score tiles 2k and 2k + 1 make k-step k), V as B fragments
      #pragma unroll
      for (int kk = 0; kk < KT / 16; ++kk) {
        unsigned int pa[4];
        pa[0] = mlxb_pack(s[2 * kk][0], s[2 * kk][1], tag);
        pa[1] = mlxb_pack(s[2 * kk][2], s[2 * kk][3], tag);
        pa[2] = mlxb_pack(s[2 * kk + 1][0], s[2 * kk + 1][1], tag);
        pa[3] = mlxb_pack(s[2 * kk + 1][2], s[2 * kk + 1][3], tag);
        #pragma unroll
        for (int d = 0; d < DT; ++d) {
          const T* vr = &vt_[d * 8 + g][kk * 16 + tg * 2];     // B fragment: dim g, keys tg * 2 (+ 1, + 8, + 9)
          mlxb_mma(o[d], pa, *reinterpret_cast<const unsigned int*>(vr),
                   *reinterpret_cast<const unsigned int*>(vr + 8), tag);
        }
      }
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      l_run[i] += __shfl_xor_sync(0xffffffff, l_run[i], 1);
      l_run[i] += __shfl_xor_sync(0xffffffff, l_run[i], 2);
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!valid[i]) continue;
      const float inv = 1.0f / l_run[i];
      T* op = out + ((size_t)tok[i] * H + head[i]) * D;
      #pragma unroll
      for (int d = 0; d < DT; ++d) {
        const int dim = d * 8 + tg * 2;
        op[dim] = static_cast<T>(o[d][2 * i] * inv);
        op[dim + 1] = static_cast<T>(o[d][2 * i + 1] * inv);
      }
    }
"""


def units(start: int | Sequence[int], offsets: Sequence[int], lengths: Sequence[int], rep: int) -> list[int]:
    """The unit table of a packed pass over slot rows ``start ..`` (or each row's slot: ``start`` a sequence;
    ``offsets``: their committed lengths; ``lengths``: their new tokens, laid end to end in row order), flat,
    ``FIELDS`` ints a unit."""
    slots = range(start, start + len(offsets)) if isinstance(start, int) else start
    table: list[int] = []
    first = 0
    for slot, off, n in zip(slots, offsets, lengths):
        for m0 in range(0, n * rep, UNIT):
            table += (slot, first, n, m0, off)
        first += n
    return table


class PackedAttention:
    """``attend(queries, k_buf, v_buf, units, scale)``: every packed token's attention over its slot row's keys up to
    its own position (``queries``: ``[padded, heads, 1, dim]``, the real tokens first; ``units``: the table ``units()``
    makes, ``[n, 5]``; the buffers ``[slots, kv_heads, capacity, dim]``, this layer's keys written).
    Returns ``[padded, heads, 1, dim]``, the padding tokens' rows zero."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        self.rep = heads // kv_heads
        self._kernels: dict[float, object] = {}  # one per attention scale (a constant of the kernel)

    def _kernel(self, scale: float) -> object:
        kernel = self._kernels.get(scale)
        if kernel is None:
            kernel = self._kernels[scale] = mx.fast.cuda_kernel(
                name=f"mlxbatch_packed_attention_{len(self._kernels)}",
                input_names=["q", "kb", "vb", "units"],
                output_names=["out"],
                source=f"    constexpr float SCALE = {scale:.9e}f;\n" + _SOURCE,
                header=_HEADER,
                ensure_row_contiguous=False,  # the queries are a view of RoPE's output: read by their strides
            )
        return kernel

    @staticmethod
    def supports(heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> bool:
        rep = heads // kv_heads if kv_heads else 0
        return head_dim in (64, 128) and rep * kv_heads == heads and rep >= 1 and dtype in (mx.bfloat16, mx.float16)

    def __call__(self, queries: mx.array, k_buf: mx.array, v_buf: mx.array, units: mx.array, scale: float
                 ) -> mx.array:
        padded, heads, _, dim = queries.shape
        kv_heads = k_buf.shape[1]
        q = queries if queries.dtype == k_buf.dtype else queries.astype(k_buf.dtype)
        blocks = units.shape[0] * kv_heads + 1  # and one for the padding tokens
        (out,) = self._kernel(scale)(  # type: ignore[operator]
            inputs=[q, k_buf, v_buf, units],
            template=[("T", k_buf.dtype), ("D", dim), ("R", heads // kv_heads)],
            grid=(32 * _WARPS * blocks, 1, 1),
            threadgroup=(32 * _WARPS, 1, 1),
            output_shapes=[(padded, heads, 1, dim)],
            output_dtypes=[k_buf.dtype],
        )
        return out

    @classmethod
    def create(cls, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> PackedAttention | None:
        """The kernel, if this device runs it and it agrees with ``reference`` on a ragged probe."""
        if mx.default_device() != mx.gpu or mx.metal.is_available() or not hasattr(mx.fast, "cuda_kernel"):
            return None
        if not cls.supports(heads, kv_heads, head_dim, dtype):
            return None
        try:
            kernel = cls(heads, kv_heads)
            err = probe_error(kernel, heads, kv_heads, head_dim, dtype)
        except Exception as exc:  # no compiler, a driver that refuses it: MLX's ops stay
            log.warning("packed prefill attention kernel unavailable (%s); using MLX's attention", exc)
            return None
        if not err <= 2e-2:  # (NaN too)
            log.warning("packed prefill attention kernel disagrees with MLX's attention (max error %.3g); not used",
                        err)
            return None
        return kernel


def reference(queries: mx.array, k_buf: mx.array, v_buf: mx.array, start: int, offsets: Sequence[int],
              lengths: Sequence[int], scale: float) -> mx.array:
    """What the kernel computes, through MLX's attention row by row (each row's new tokens over its keys up to their
    positions); ``[padded, heads, 1, dim]``, the padding tokens' rows zero."""
    padded, heads, _, dim = queries.shape
    outs, first = [], 0
    for r, (off, n) in enumerate(zip(offsets, lengths)):
        q = queries[first : first + n, :, 0, :].transpose(1, 0, 2)[None]  # [1, heads, n, dim]
        k = k_buf[start + r : start + r + 1, :, : off + n, :]
        v = v_buf[start + r : start + r + 1, :, : off + n, :]
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        outs.append(o[0].transpose(1, 0, 2))  # [n, heads, dim]
        first += n
    if padded > first:
        outs.append(mx.zeros((padded - first, heads, dim), queries.dtype))
    return mx.concatenate(outs)[:, :, None, :]


def probe_error(kernel: PackedAttention, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype,
                capacity: int = 768) -> float:
    """Largest difference between the kernel and ``reference`` on a ragged packed pass: rows of 1 to 150 new tokens
    after 0 to 600 committed ones (a unit across two rows' tokens, a row past two key tiles, padding tokens), read
    from non-consecutive slot rows of a larger buffer, the queries a strided view."""
    offsets, lengths = [0, 37, 600, 5, 256, 130], [150, 1, 90, 3, 64, 17]
    start, n = 2, sum(lengths)
    padded = -(-n // 128) * 128
    kq, kk, kv = mx.random.split(mx.random.key(11), 3)
    q = mx.random.normal((padded, heads + kv_heads, 1, head_dim), key=kq).astype(dtype)[:, :heads]
    kb = mx.random.normal((start + len(lengths) + 2, kv_heads, capacity, head_dim), key=kk).astype(dtype)
    vb = mx.random.normal((start + len(lengths) + 2, kv_heads, capacity, head_dim), key=kv).astype(dtype)
    table = mx.array(units(start, offsets, lengths, heads // kv_heads), dtype=mx.int32).reshape(-1, FIELDS)
    scale = head_dim ** -0.5
    got = kernel(q, kb, vb, table, scale).astype(mx.float32)
    want = reference(q, kb, vb, start, offsets, lengths, scale).astype(mx.float32)
    return float(mx.max(mx.abs(got - want)).item())
