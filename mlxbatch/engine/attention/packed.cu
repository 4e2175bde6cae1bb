// The packed prefill attention's kernel body (``attention/packed.py``: ``mx.fast.cuda_kernel`` wraps it in a function
// whose parameters are the inputs q, kb, vb, units with their shapes and strides and the output out; template
// constants T, D, R; SCALE is prepended per attention scale).
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
