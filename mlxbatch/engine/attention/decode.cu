// The fused decode attention's kernel body (``attention/decode.py``: ``mx.fast.cuda_kernel`` wraps it in a function
// whose parameters are the inputs q, kb, vb, rows, lengths with their shapes and strides and the output out; template
// constants T, D, R, L; SCALE is prepended per attention scale).
    constexpr int NT = 256;
    constexpr int TILE = 256;
    constexpr int NW = NT / 32;
    constexpr int VEC = 16 / sizeof(T);       // elements per 16-byte load
    // values: a thread reads VV dims of a key at once, DV threads a key, KG keys at once. Long rows (L = 1): one
    // vector load of 16 bytes (8 where 2-byte values and more than 8 heads would take too many registers), several
    // keys' loads in flight; short rows (L = 0): a dim a thread, which sums the fewest partials at the end
    constexpr int VV = L == 0 ? 1 : (sizeof(T) == 2 && R > 8) ? 4 : VEC;
    constexpr int DV = D / VV;
    constexpr int KG = NT / DV;
    constexpr int RED = (VV == 1 ? KG : 1) * R * D;  // the partial sums: each key group's, or one summed set
    __shared__ float qs[R][D];
    __shared__ float sc[R][TILE];
    __shared__ float red[RED];
    __shared__ float m_s[R];
    __shared__ float l_s[R];
    __shared__ float corr_s[R];
    const float NEG_INF = -__int_as_float(0x7f800000);

    const int HKV = kb_shape[1];
    const int blk = blockIdx.x;
    const int i = blk / HKV;                  // the i-th query row
    const int h = blk % HKV;                  // its KV head
    const int tid = threadIdx.x;
    const int row = rows[i * rows_strides[0]];          // its slot row in the buffers
    const int len = lengths[i * lengths_strides[0]];    // keys it reads: positions [0, len)
    // the buffers as allocated: rows, KV heads, positions, dims (each key's dims contiguous: the slot buffers)
    const T* kp = kb + (size_t)row * kb_strides[0] + (size_t)h * kb_strides[1];
    const T* vp = vb + (size_t)row * vb_strides[0] + (size_t)h * vb_strides[1];

    for (int e = tid; e < R * D; e += NT) {   // queries by their strides (a view of RoPE's output), then scaled
      const T* qe = q + (size_t)i * q_strides[0] + (size_t)(h * R + e / D) * q_strides[1] + (e % D) * q_strides[3];
      qs[e / D][e % D] = static_cast<float>(*qe) * SCALE;
    }
    if constexpr (VV > 1) {
      for (int e = tid; e < R * D; e += NT) red[e] = 0.0f;
    }
    if (tid < R) { m_s[tid] = NEG_INF; l_s[tid] = 0.0f; }
    const int dv = tid % DV;                  // this thread's dims while reading values: [dv * VV, dv * VV + VV)
    const int kg = tid / DV;                  // and its keys: kg, kg + KG, ... of a tile
    float acc[R][VV];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      #pragma unroll
      for (int x = 0; x < VV; ++x) acc[r][x] = 0.0f;
    }
    __syncthreads();

    for (int t0 = 0; t0 < len; t0 += TILE) {
      const int n = min(TILE, len - t0);
      // scores: one key per thread, every query head of this KV head
      if (tid < n) {
        float s[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) s[r] = 0.0f;
        const uint4* kr = reinterpret_cast<const uint4*>(kp + (size_t)(t0 + tid) * kb_strides[2]);
        #pragma unroll
        for (int c = 0; c < D / VEC; ++c) {
          uint4 u = kr[c];
          const T* ke = reinterpret_cast<const T*>(&u);
          #pragma unroll
          for (int x = 0; x < VEC; ++x) {
            const float kv = static_cast<float>(ke[x]);
            #pragma unroll
            for (int r = 0; r < R; ++r) s[r] += qs[r][c * VEC + x] * kv;
          }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) sc[r][tid] = s[r];
      }
      __syncthreads();
      // the tile's softmax terms, one warp a head: new running max, rescale factor, sum
      const int w = tid / 32, lane = tid % 32;
      for (int r = w; r < R; r += NW) {
        float mx_t = NEG_INF;
        for (int j = lane; j < n; j += 32) mx_t = fmaxf(mx_t, sc[r][j]);
        for (int o = 16; o > 0; o /= 2) mx_t = fmaxf(mx_t, __shfl_xor_sync(0xffffffff, mx_t, o));
        const float m_new = fmaxf(m_s[r], mx_t);
        float sum = 0.0f;
        for (int j = lane; j < n; j += 32) {
          const float p = __expf(sc[r][j] - m_new);
          sc[r][j] = p;
          sum += p;
        }
        for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
        if (lane == 0) {
          const float c = __expf(m_s[r] - m_new);
          corr_s[r] = c;
          l_s[r] = l_s[r] * c + sum;
          m_s[r] = m_new;
        }
      }
      __syncthreads();
      // values: thread (dv, kg) adds keys kg, kg + KG, ... of the tile at its VV dims, one vector load a key (the
      // loads of several keys in flight at once: a load a key and a dim kept the block waiting on each in turn)
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int x = 0; x < VV; ++x) acc[r][x] *= corr_s[r];
      }
      if constexpr (VV == 1) {
        for (int j = kg; j < n; j += KG) {
          const float vv = static_cast<float>(vp[(size_t)(t0 + j) * vb_strides[2] + dv]);
          #pragma unroll
          for (int r = 0; r < R; ++r) acc[r][0] += sc[r][j] * vv;
        }
      } else {
        #pragma unroll 4
        for (int j = kg; j < n; j += KG) {
          alignas(16) T vb_[VV];
          const T* src = vp + (size_t)(t0 + j) * vb_strides[2] + dv * VV;
          if constexpr (VV * sizeof(T) == 16) {
            *reinterpret_cast<uint4*>(vb_) = *reinterpret_cast<const uint4*>(src);
          } else {
            *reinterpret_cast<uint2*>(vb_) = *reinterpret_cast<const uint2*>(src);
          }
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            const float p = sc[r][j];
            #pragma unroll
            for (int x = 0; x < VV; ++x) acc[r][x] += p * static_cast<float>(vb_[x]);
          }
        }
      }
      __syncthreads();
    }
    // the key groups' sums
    if constexpr (VV == 1) {  // each group's partials in shared memory, then summed by output element
      #pragma unroll
      for (int r = 0; r < R; ++r) red[(kg * R + r) * D + dv] = acc[r][0];
      __syncthreads();
      for (int e = tid; e < R * D; e += NT) {
        const int r = e / D, dd = e % D;
        float o = 0.0f;
        #pragma unroll
        for (int gg = 0; gg < KG; ++gg) o += red[(gg * R + r) * D + dd];
        out[((size_t)i * HKV * R + (size_t)h * R) * D + e] = static_cast<T>(o / l_s[r]);
      }
    } else {  // the lanes of a warp that hold the same dims, then the warps, into one set in shared memory
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int x = 0; x < VV; ++x) {
          #pragma unroll
          for (int o = DV; o < 32; o *= 2) acc[r][x] += __shfl_xor_sync(0xffffffff, acc[r][x], o);
        }
      }
      if ((tid % 32) < DV) {
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          #pragma unroll
          for (int x = 0; x < VV; ++x) atomicAdd(&red[r * D + dv * VV + x], acc[r][x]);
        }
      }
      __syncthreads();
      for (int e = tid; e < R * D; e += NT) {
        const int r = e / D;
        out[((size_t)i * HKV * R + (size_t)h * R) * D + e] = static_cast<T>(red[e] / l_s[r]);
      }
    }
