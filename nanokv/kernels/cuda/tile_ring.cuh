// The int4 decode's shared-memory ring (decode_int4.cu): each 16-token tile of codes and scales is
// copied by cp.async into one stage, NSTAGE - 1 tiles ahead of the compute.

// One stage of the ring: a 16-token tile's key codes [16, 64] B, value codes [64 dims, 16 tokens] B,
// key scale and zero rows [2, 128] fp16, value scales and zeros [2, 16] fp16.
#define V_OFF 1024
#define SZ_OFF 2048
#define VSZ_OFF 2560
#define STAGE_BYTES 2624
#ifndef NSTAGE
#define NSTAGE 2
#endif

__device__ __forceinline__ void cp16(void* dst, const void* src) {
  const u32 d = (u32)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
}

// tile k of the split starting at lo: its physical block (-1 past the end or a hole)
__device__ __forceinline__ int tile_phys(const int* bt_row, int lo, int ntiles, int k) {
  return k < ntiles ? bt_row[(unsigned)(lo + 16 * k) / BS] : -1;
}

// Copy a tile into a ring stage when it is read from codes (a block of the pool, not staged); one
// commit group per call either way, so that wait_group counts tiles.
__device__ __forceinline__ void fetch_tile(unsigned char* dst, const unsigned char* kc, const unsigned char* vc,
                                           const u16* ks, const u16* kz, const u16* vs, const u16* vz, int ph,
                                           int sl, int kvh, int tin, int lane) {
  if (ph >= 0 && sl < 0) {
    const size_t blk = (size_t)ph * NKV + kvh;
    const unsigned char* kp = kc + blk * (BS * 64) + tin * 64;  // 1 KB: 16 rows of 64 B
    cp16(dst + 32 * lane, kp + 32 * lane);
    cp16(dst + 32 * lane + 16, kp + 32 * lane + 16);
    const unsigned char* vp = vc + blk * (64 * BS) + tin;  // 64 dim rows, 16 B each at tin
    cp16(dst + V_OFF + 32 * lane, vp + (2 * lane) * BS);
    cp16(dst + V_OFF + 32 * lane + 16, vp + (2 * lane + 1) * BS);
    const u16* sz = (lane < 16 ? ks : kz) + blk * HD + 8 * (lane & 15);
    cp16(dst + SZ_OFF + 16 * lane, sz);
    if (lane < 4) {
      const u16* v2 = ((lane & 2) ? vz : vs) + blk * BS + tin + 8 * (lane & 1);
      cp16(dst + VSZ_OFF + 16 * lane, v2);
    }
  }
  asm volatile("cp.async.commit_group;");
}
