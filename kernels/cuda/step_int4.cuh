// One loop step of the int4 decode (decode_int4.cu) on a ring stage: TT = 16 NT tokens of one block.
// key_scores: s^T [16 tok, 8] per tile h = codes @ (q * s_k)^T + bias q . z (the block's key scales
// and zero row serve all NT tiles). attend_values: the online softmax over them and the PV product
// into acc.

// s[h]: raw scores of tile h (rows g, g + 8: tokens r0, r0 + 1; columns: heads 2t, 2t + 1)
__device__ __forceinline__ void key_scores(const unsigned char* rs, const u32 (&ql)[8], const u32 (&qh)[8], int koff,
                                           int t, float (&s)[NT][4]) {
  const u16* crow = reinterpret_cast<const u16*>(rs + SZ_OFF) + 16 * t;
  const u16* zrow = crow + HD;
  u32 kw0[NT][4], kw1[NT][4];
#pragma unroll
  for (int h = 0; h < NT; ++h) {
    const uint4 k0 = *reinterpret_cast<const uint4*>(rs + 1024 * h + koff);  // rows r0, r0 + 1, bytes 16t..
    const uint4 k1 = *reinterpret_cast<const uint4*>(rs + 1024 * h + koff + 64);
    kw0[h][0] = k0.x; kw0[h][1] = k0.y; kw0[h][2] = k0.z; kw0[h][3] = k0.w;
    kw1[h][0] = k1.x; kw1[h][1] = k1.y; kw1[h][2] = k1.z; kw1[h][3] = k1.w;
  }
  // bias q . z: a natural quad of zero pairs (4a .. 4a + 3) as A against q pairs (4a, 4a + 2) gives
  // row g the sum over pairs 4a, 4a + 2 (bz0), against (4a + 1, 4a + 3) gives row g + 8 the rest
  // (bz1); the other rows are unused. No register copies: the operands are as loaded.
  float bz0[4] = {0.f, 0.f, 0.f, 0.f}, bz1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int h = 0; h < NT; ++h) s[h][0] = s[h][1] = s[h][2] = s[h][3] = 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // dims 16t + (0..15), then 64 + 16t + (0..15)
    const uint4 sa = reinterpret_cast<const uint4*>(crow + 64 * half)[0];
    const uint4 sb2 = reinterpret_cast<const uint4*>(crow + 64 * half)[1];
    const uint4 za = reinterpret_cast<const uint4*>(zrow + 64 * half)[0];
    const uint4 zb = reinterpret_cast<const uint4*>(zrow + 64 * half)[1];
    const u32 sc[8] = {sa.x, sa.y, sa.z, sa.w, sb2.x, sb2.y, sb2.z, sb2.w};
    const u32* qq = half ? qh : ql;
#pragma unroll
    for (int w = 0; w < 4; ++w) {  // word w: dims 4w..4w+3 of this lane's 16 (pairs 2w, 2w + 1)
      const u32 b0 = hmul2(qq[QP(2 * w)], sc[2 * w]), b1 = hmul2(qq[QP(2 * w + 1)], sc[2 * w + 1]);
#pragma unroll
      for (int h = 0; h < NT; ++h) {
        const u32 x0 = prmt(kw0[h][w], 0u, 0x4140u), y0 = prmt(kw0[h][w], 0u, 0x4342u);  // bytes (0, 1), (2, 3)
        const u32 x1 = prmt(kw1[h][w], 0u, 0x4140u), y1 = prmt(kw1[h][w], 0u, 0x4342u);
        if (half == 0) mma(s[h], nib_lo(x0), nib_lo(x1), nib_lo(y0), nib_lo(y1), b0, b1);
        else mma(s[h], nib_hi(x0), nib_hi(x1), nib_hi(y0), nib_hi(y1), b0, b1);
      }
    }
    mma(bz0, za.x, za.y, za.z, za.w, qq[0], qq[1]);
    mma(bz1, za.x, za.y, za.z, za.w, qq[2], qq[3]);
    mma(bz0, zb.x, zb.y, zb.z, zb.w, qq[4], qq[5]);
    mma(bz1, zb.x, zb.y, zb.z, zb.w, qq[6], qq[7]);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float bias = bz0[j] + bz1[2 + j];
#pragma unroll
    for (int h = 0; h < NT; ++h) {
      s[h][j] += bias;
      s[h][2 + j] += bias;
    }
  }
}

// The softmax over a step's scores (tokens start + 16 h + pi(row), those < hi valid) and the PV
// product with the stage's value codes, scales folded into the weights, zeros into st.z.
__device__ __forceinline__ void attend_values(const unsigned char* rs, float (&s)[NT][4], int start, int hi, int r0,
                                              int g, int t, Softmax& st, float (&acc)[8][4], float qk_scale) {
  u32 vw[NT][8], vs2[NT], vz2[NT];
#pragma unroll
  for (int h = 0; h < NT; ++h) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      vw[h][j] = *reinterpret_cast<const u32*>(rs + V_OFF + (8 * j + g) * TT + 16 * h + 4 * t);
    vs2[h] = *reinterpret_cast<const u32*>(rs + VSZ_OFF + 2 * (16 * h + r0));  // tokens r0, r0 + 1
    vz2[h] = *reinterpret_cast<const u32*>(rs + VSZ_OFF + 2 * TT + 2 * (16 * h + r0));
  }
  bool v0[NT], v1[NT];
#pragma unroll
  for (int h = 0; h < NT; ++h) {
    v0[h] = start + 16 * h + r0 < hi;
    v1[h] = start + 16 * h + r0 + 1 < hi;
  }
  float alpha[2];
  softmax_step<NT>(st, s, v0, v1, qk_scale, alpha);
  float vs0[NT], vs1[NT], vz0[NT], vz1[NT];
#pragma unroll
  for (int h = 0; h < NT; ++h) {
    vs0[h] = v0[h] ? f16_f32(vs2[h] & 0xFFFF) : 0.f;
    vs1[h] = v1[h] ? f16_f32(vs2[h] >> 16) : 0.f;
    vz0[h] = v0[h] ? f16_f32(vz2[h] & 0xFFFF) : 0.f;
    vz1[h] = v1[h] ? f16_f32(vz2[h] >> 16) : 0.f;
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float z = st.z[j] * alpha[j];
#pragma unroll
    for (int h = 0; h < NT; ++h) z = z + s[h][j] * vz0[h] + s[h][2 + j] * vz1[h];
    st.z[j] = z;
  }
  u32 pb0[NT], pb1[NT];
#pragma unroll
  for (int h = 0; h < NT; ++h) {
    pb0[h] = trans8x8(pack_f16(s[h][0] * vs0[h], s[h][1] * vs0[h]));
    pb1[h] = trans8x8(pack_f16(s[h][2] * vs1[h], s[h][3] * vs1[h]));
  }
  rescale(acc, alpha);
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // dim rows 8i + g (low nibbles) and 64 + 8i + g (high)
#pragma unroll
    for (int h = 0; h < NT; ++h) {
      const u32 x = vw[h][i], y = vw[h][i] >> 8;
      mma(acc[i], nib_lo(x), nib_hi(x), nib_lo(y), nib_hi(y), pb0[h], pb1[h]);
    }
  }
}
