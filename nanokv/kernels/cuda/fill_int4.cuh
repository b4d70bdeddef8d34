// Quantize-on-fill inside the int4 decode (decode_int4.cu): the block a decode token completes goes
// from full-precision staging into the pool in the same launch, by the (sequence, KV head)'s split-0
// warp after its attention work, instead of one more launch per layer and step
// (triton_blockquant._fill_quant_kernel, which the other steps keep using). Bit for bit that kernel and
// nanokv.kv.quant: keys per channel over the block's BS tokens, values per token over the 128 dims,
// both asymmetric; IEEE division, scale and zero rounded to fp16, an underflowed scale stored as 1.0,
// codes rounded half to even and clipped to [0, 15]. The block is staged during this step, so no
// warp of the launch reads its pool codes: the next step does.

__device__ __forceinline__ float stage_f32(u16 x) { return ST_BF16 ? bf16_f32(x) : f16_f32(x); }

// (hi - lo) / 15 rounded to the fp16 scale; 0 (a constant row) becomes 1.0
__device__ __forceinline__ u16 fill_scale(float lo, float hi) {
  const u16 s = f32_f16(__fdiv_rn(__fsub_rn(hi, lo), 15.f));
  return (s & 0x7FFFu) == 0 ? (u16)0x3C00u : s;
}

__device__ __forceinline__ u32 fill_code(float x, float z, float s) {
  return (u32)fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(x, z), s)), 0.f), 15.f);
}

// One warp quantizes staging slot sl of KV head kvh into pool block blk. Key codes [BS, 64] B (byte
// (t, d): channel d low nibble, d + 64 high), value codes dims-major [64, BS] B (byte (d, t) the same
// pairing over token t's dims), key scale/zero [128] fp16, value scale/zero [BS] fp16.
__device__ __noinline__ void fill_block(const u16* kst, const u16* vst, int sl, int blk, int kvh,
                                        unsigned char* kc, unsigned char* vc, u16* ks, u16* kz, u16* vs,
                                        u16* vz, int lane) {
  const size_t src = ((size_t)sl * NKV + kvh) * (BS * HD);
  const size_t b = (size_t)blk * NKV + kvh;
  const u16* kr = kst + src;
  const u16* vr = vst + src;
  // keys: lane owns channels lane + 32 j; its bytes are d = lane (channels j = 0, 2) and lane + 32 (1, 3)
  float z[4], s[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float lo = __int_as_float(0x7f800000), hi = NEG_INF;
    for (int t = 0; t < BS; ++t) {
      const float x = stage_f32(kr[t * HD + lane + 32 * j]);
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
    const u16 sc = fill_scale(lo, hi), zc = f32_f16(lo);
    ks[b * HD + lane + 32 * j] = sc;
    kz[b * HD + lane + 32 * j] = zc;
    s[j] = f16_f32(sc);
    z[j] = f16_f32(zc);
  }
  for (int t = 0; t < BS; ++t) {
    const u16* row = kr + t * HD;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int d = lane + 32 * h;
      const u32 c = fill_code(stage_f32(row[d]), z[h], s[h]) | fill_code(stage_f32(row[d + 64]), z[h + 2], s[h + 2]) << 4;
      kc[b * (BS * 64) + t * 64 + d] = (unsigned char)c;
    }
  }
  // values: token t's range over its 128 dims (4 per lane, then across the warp); lane's bytes are
  // dims d = lane and lane + 32 of tokens t..t + 3, one word each
  for (int t0 = 0; t0 < BS; t0 += 4) {
    u32 w[2] = {0u, 0u};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int t = t0 + k;
      float x[4], lo, hi;
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = stage_f32(vr[t * HD + lane + 32 * j]);
      lo = fminf(fminf(x[0], x[1]), fminf(x[2], x[3]));
      hi = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
      }
      const u16 sc = fill_scale(lo, hi), zc = f32_f16(lo);
      if (lane == 0) {
        vs[b * BS + t] = sc;
        vz[b * BS + t] = zc;
      }
      const float sf = f16_f32(sc), zf = f16_f32(zc);
#pragma unroll
      for (int h = 0; h < 2; ++h)
        w[h] |= (fill_code(x[h], zf, sf) | fill_code(x[h + 2], zf, sf) << 4) << (8 * k);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) *reinterpret_cast<u32*>(vc + b * (64 * BS) + (lane + 32 * h) * BS + t0) = w[h];
  }
}
