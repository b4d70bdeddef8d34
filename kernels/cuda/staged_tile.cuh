// The int4 decode's tokens read from full-precision staging (decode_int4.cu): each sequence's newest
// (open) block, or a whole split where a block before it is staged (tests stage at will; decode
// steps do not). Plain q (no key scales) against the staged keys, values as fp16 pairs in the V^T
// fragment, 16 tokens at a time through the same online softmax as the codes.

__device__ __forceinline__ void staged_tokens(Softmax& st, float (&acc)[8][4], const u32 (&ql)[8],
                                              const u32 (&qh)[8], const u16* __restrict__ kst,
                                              const u16* __restrict__ vst, const int* __restrict__ stage_of,
                                              const int* bt_row, int from, int hi, int kvh, int r0, int g, int t,
                                              float qk_scale) {
  for (int start = from; start < hi; start += 16) {
    const int ph = bt_row[start / BS];
    const int sl = ph >= 0 ? stage_of[ph] : -1;
    if (sl < 0) continue;
    const int tin = start % BS;
    const bool v0[1] = {start + r0 < hi}, v1[1] = {start + r0 + 1 < hi};
    const u16* kr = kst + (size_t)sl * (NKV * BS * HD) + kvh * (BS * HD) + (tin + r0) * HD + 16 * t;
    float s[1][4] = {{0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint4* p0 = reinterpret_cast<const uint4*>(kr + 64 * half);
      const uint4* p1 = reinterpret_cast<const uint4*>(kr + HD + 64 * half);
      const uint4 a0 = v0[0] ? p0[0] : make_uint4(0, 0, 0, 0), a1 = v0[0] ? p0[1] : make_uint4(0, 0, 0, 0);
      const uint4 c0 = v1[0] ? p1[0] : make_uint4(0, 0, 0, 0), c1 = v1[0] ? p1[1] : make_uint4(0, 0, 0, 0);
      const u32 r0w[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const u32 r1w[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
      const u32* qq = half ? qh : ql;
#pragma unroll
      for (int w = 0; w < 4; ++w)
        mma(s[0], to_f16x2(r0w[2 * w], ST_BF16), to_f16x2(r1w[2 * w], ST_BF16), to_f16x2(r0w[2 * w + 1], ST_BF16),
            to_f16x2(r1w[2 * w + 1], ST_BF16), qq[QP(2 * w)], qq[QP(2 * w + 1)]);
    }
    float alpha[2];
    softmax_step<1>(st, s, v0, v1, qk_scale, alpha);
    st.z[0] *= alpha[0];
    st.z[1] *= alpha[1];
    const u32 pb0 = trans8x8(pack_f16(s[0][0], s[0][1]));
    const u32 pb1 = trans8x8(pack_f16(s[0][2], s[0][3]));
    rescale(acc, alpha);
    // V^T fragment: dims 8i + g (lo) / 64 + 8i + g (hi), tokens (4t, 4t + 2) and (4t + 1, 4t + 3)
    const u16* vr = vst + (size_t)sl * (NKV * BS * HD) + kvh * (BS * HD) + tin * HD;
    u16 e[4][2];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool ok = start + 4 * t + k < hi;
        e[k][0] = ok ? vr[(4 * t + k) * HD + 8 * i + g] : (u16)0;
        e[k][1] = ok ? vr[(4 * t + k) * HD + 64 + 8 * i + g] : (u16)0;
      }
      const u32 a0 = to_f16x2((u32)e[0][0] | ((u32)e[2][0] << 16), ST_BF16);
      const u32 a1 = to_f16x2((u32)e[0][1] | ((u32)e[2][1] << 16), ST_BF16);
      const u32 a2 = to_f16x2((u32)e[1][0] | ((u32)e[3][0] << 16), ST_BF16);
      const u32 a3 = to_f16x2((u32)e[1][1] | ((u32)e[3][1] << 16), ST_BF16);
      mma(acc[i], a0, a1, a2, a3, pb0, pb1);
    }
  }
}
