// Quantize-on-fill inside the int4 decode (decode_int4.cu): the block a decode token completes goes
// from full-precision staging into the pool in the same launch, shared by the warps of a (row, KV
// head) after their attention work, instead of one more launch per layer and step
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

// One warp quantizes part `part` of `parts` of staging slot sl of KV head kvh into pool block blk:
// the key channel pairs (d, d + 64) with d = part (mod parts) and the value tokens t = part (mod parts).
// The parts go to the (sequence, KV head)'s split programs, so that no program carries a whole block
// (one warp filling a 64-token block alone, beside issue-bound decode warps, set the launch's length).
// Key codes [BS, 64] B (byte (t, d): channel d low nibble, d + 64 high), value codes dims-major
// [64, BS] B (byte (d, t) the same pairing over token t's dims), key scale/zero [128] fp16, value
// scale/zero [BS] fp16.
__device__ __noinline__ void fill_part(const u16* kst, const u16* vst, int sl, int blk, int kvh,
                                       unsigned char* kc, unsigned char* vc, u16* ks, u16* kz, u16* vs,
                                       u16* vz, int part, int parts, int lane) {
  const size_t src = ((size_t)sl * NKV + kvh) * (BS * HD);
  const size_t b = (size_t)blk * NKV + kvh;
  const u16* kr = kst + src;
  const u16* vr = vst + src;
  constexpr int TPL = (BS + 31) / 32;  // tokens per lane
  for (int d = part; d < 64; d += parts) {  // keys: channels d, d + 64 over the block's tokens
    float x[TPL][2], lo[2], hi[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      lo[c] = __int_as_float(0x7f800000);
      hi[c] = NEG_INF;
#pragma unroll
      for (int k = 0; k < TPL; ++k) {
        const int t = lane + 32 * k;
        x[k][c] = t < BS ? stage_f32(kr[t * HD + d + 64 * c]) : 0.f;
        if (t < BS) {
          lo[c] = fminf(lo[c], x[k][c]);
          hi[c] = fmaxf(hi[c], x[k][c]);
        }
      }
      lo[c] = warp_min(lo[c]);
      hi[c] = warp_max(hi[c]);
    }
    float sf[2], zf[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const u16 sc = fill_scale(lo[c], hi[c]), zc = f32_f16(lo[c]);
      if (lane == 0) {
        ks[b * HD + d + 64 * c] = sc;
        kz[b * HD + d + 64 * c] = zc;
      }
      sf[c] = f16_f32(sc);
      zf[c] = f16_f32(zc);
    }
#pragma unroll
    for (int k = 0; k < TPL; ++k) {
      const int t = lane + 32 * k;
      if (t < BS)
        kc[b * (BS * 64) + t * 64 + d] =
            (unsigned char)(fill_code(x[k][0], zf[0], sf[0]) | fill_code(x[k][1], zf[1], sf[1]) << 4);
    }
  }
  for (int t = part; t < BS; t += parts) {  // values: token t's range over its 128 dims
    float x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = stage_f32(vr[t * HD + lane + 32 * j]);
    const float lo = warp_min(fminf(fminf(x[0], x[1]), fminf(x[2], x[3])));
    const float hi = warp_max(fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3])));
    const u16 sc = fill_scale(lo, hi), zc = f32_f16(lo);
    if (lane == 0) {
      vs[b * BS + t] = sc;
      vz[b * BS + t] = zc;
    }
    const float sf = f16_f32(sc), zf = f16_f32(zc);
#pragma unroll
    for (int h = 0; h < 2; ++h)  // dims lane + 32 h (low nibble) and lane + 32 h + 64 (high)
      vc[b * (64 * BS) + (lane + 32 * h) * BS + t] =
          (unsigned char)(fill_code(x[h], zf, sf) | fill_code(x[h + 2], zf, sf) << 4);
  }
}
