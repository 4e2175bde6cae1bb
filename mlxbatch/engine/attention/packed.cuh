// Device helpers of the packed prefill attention kernel (``attention/packed.py``): bf16/fp16 packing and the
// mma.sync m16n8k16 instruction, overloaded by type. Passed to ``mx.fast.cuda_kernel`` as its header.
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
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mlxb_mma(float* c, const unsigned int* a, unsigned int b0, unsigned int b1, __half*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
