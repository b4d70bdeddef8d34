// PTX wrappers and MMA-fragment helpers of the int4 decode (decode_int4.cu): fp16 pairs in u32
// registers, int4 nibbles to exact fp16, m16n8k16 with fp32 accumulators, the online softmax on an
// s^T fragment (rows = tokens, columns = query heads 2t, 2t + 1 of lane (g, t)).

#define HD 128
#define NEG_INF __int_as_float(0xff800000)
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel)); return r;
}
__device__ __forceinline__ u32 mask_or(u32 x, u32 m, u32 o) {  // (x & m) | o
  u32 r; asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(m), "r"(o)); return r;
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
  u32 r; asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 r; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r; asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r;
}
__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
  u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ float ex2(float x) {
  float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}
__device__ __forceinline__ u32 trans8x8(u32 x) {
  u32 r; asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x)); return r;
}
__device__ __forceinline__ float bf16_f32(u16 x) { return __uint_as_float(((u32)x) << 16); }
__device__ __forceinline__ float f16_f32(u16 x) {
  float r; asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x)); return r;
}
__device__ __forceinline__ u16 f32_f16(float x) {
  u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r;
}
__device__ __forceinline__ u16 f32_bf16(float x) {
  u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r;
}
// a pair of 16-bit values of a bf16 tensor -> the same pair in fp16 (ST_BF16 / Q_BF16)
__device__ __forceinline__ u32 bf16x2_f16x2(u32 x) {
  return pack_f16(__uint_as_float(x << 16), __uint_as_float(x & 0xFFFF0000u));
}
__device__ __forceinline__ u32 to_f16x2(u32 x, bool bf16) { return bf16 ? bf16x2_f16x2(x) : x; }

// low / high nibbles of bytes 0 and 2 of x as fp16 pairs, exactly
#define MAGIC 0x64006400u
__device__ __forceinline__ u32 nib_lo(u32 x) { return hsub2(mask_or(x, 0x000F000Fu, MAGIC), MAGIC); }
__device__ __forceinline__ u32 nib_hi(u32 x) {  // (1024 + 16 c) / 16 - 64 = c
  return hfma2(mask_or(x, 0x00F000F0u, MAGIC), 0x2C002C00u, 0xD400D400u);
}

__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where a lane keeps q's pair j (dims 2j, 2j + 1 of its 16): pairs 4a, 4a + 2 and 4a + 1, 4a + 3 side
// by side, the B operands of the bias products below
#define QP(j) (((j) & ~3) | (((j) & 1) << 1) | (((j) >> 1) & 1))

__device__ __forceinline__ float max_over_rows(float x) {  // over the 8 lanes of equal t
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
// over the whole warp
__device__ __forceinline__ float warp_min(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float sum_over_rows(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

struct Softmax {  // per lane: heads 2t and 2t + 1; l and z are this lane's partial sums
  float m[2], l[2], z[2];
};

// One online-softmax step on the raw scores of N tiles, s[h] (rows g, g + 8 = tokens pi(g), pi(g) + 1 of
// tile h, valid if v0[h] / v1[h]; heads 2t, 2t + 1): scaled, masked to -inf; returns alpha per head,
// p in s.
template <int N>
__device__ __forceinline__ void softmax_step(Softmax& st, float (&s)[N][4], const bool (&v0)[N],
                                             const bool (&v1)[N], float qk_scale, float (&alpha)[2]) {
#pragma unroll
  for (int h = 0; h < N; ++h) {
    s[h][0] = v0[h] ? s[h][0] * qk_scale : NEG_INF;
    s[h][1] = v0[h] ? s[h][1] * qk_scale : NEG_INF;
    s[h][2] = v1[h] ? s[h][2] * qk_scale : NEG_INF;
    s[h][3] = v1[h] ? s[h][3] * qk_scale : NEG_INF;
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float mx = fmaxf(s[0][j], s[0][2 + j]);
#pragma unroll
    for (int h = 1; h < N; ++h) mx = fmaxf(mx, fmaxf(s[h][j], s[h][2 + j]));
    float m_new = fmaxf(st.m[j], max_over_rows(mx));
    float m_safe = m_new == NEG_INF ? 0.f : m_new;
    alpha[j] = ex2(st.m[j] - m_safe);
    float l = st.l[j] * alpha[j];
#pragma unroll
    for (int h = 0; h < N; ++h) {
      s[h][j] = ex2(s[h][j] - m_safe);
      s[h][2 + j] = ex2(s[h][2 + j] - m_safe);
      l = l + s[h][j] + s[h][2 + j];
    }
    st.l[j] = l;
    st.m[j] = m_new;
  }
}

__device__ __forceinline__ void rescale(float (&acc)[8][4], const float (&alpha)[2]) {
  // alpha is 1 once a head's running max stops growing: skip the 32 products then (warp-uniform)
  if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    acc[i][0] *= alpha[0]; acc[i][1] *= alpha[1]; acc[i][2] *= alpha[0]; acc[i][3] *= alpha[1];
  }
}
