// The int4 decode's shared-memory ring (decode_int4.cu): each step's TT = 16 NT tokens of codes and
// scales are copied by cp.async into one stage, NSTAGE - 1 steps ahead of the compute.

#ifndef NT
#define NT 1  // 16-token tiles per loop step; NT > 1 needs BS % (16 NT) == 0 (one block per step)
#endif
#define TT (16 * NT)
static_assert(BS % TT == 0, "a loop step must not cross a block");
static_assert(32 % NT == 0, "a copy instruction covers whole value rows (32 / NT of them)");
// One stage of the ring: key codes [TT tokens, 64] B, value codes [64 dims, TT tokens] B, the block's
// key scale and zero rows [2, 128] fp16, value scales [TT] and zeros [TT] fp16.
#define V_OFF (1024 * NT)
#define SZ_OFF (2048 * NT)
#define VSZ_OFF (SZ_OFF + 512)
#define STAGE_BYTES (VSZ_OFF + 64 * NT)
#ifndef NSTAGE
#define NSTAGE 2
#endif

__device__ __forceinline__ void cp16(void* dst, const void* src) {
  const u32 d = (u32)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
}

// step k of the split starting at lo: its physical block (-1 past the end or a hole)
__device__ __forceinline__ int tile_phys(const int* bt_row, int lo, int ntiles, int k) {
  return k < ntiles ? bt_row[(unsigned)(lo + TT * k) / BS] : -1;
}

// Copy a step's tokens into a ring stage when they are read from codes (a block of the pool, not
// staged); one commit group per call either way, so that wait_group counts steps.
__device__ __forceinline__ void fetch_tile(unsigned char* dst, const unsigned char* kc, const unsigned char* vc,
                                           const u16* ks, const u16* kz, const u16* vs, const u16* vz, int ph,
                                           int sl, int kvh, int tin, int lane) {
  if (ph >= 0 && sl < 0) {
    const size_t blk = (size_t)ph * NKV + kvh;
    const unsigned char* vp = vc + blk * (64 * BS) + tin;  // 64 dim rows, TT B each at tin
    // each copy instruction covers whole 32-byte sectors: lane l copies 16-byte pieces l, l + 32, ...
    // (a lane copying 32 NT contiguous bytes left each sector half-read per instruction: 150.9 vs
    // 142.5 us per call, H200, 32-token blocks, 2026-12-03)
    const unsigned char* kb = kc + blk * (BS * 64) + tin * 64;  // TT rows of 64 B, contiguous
    const int kd = 16 * lane, r = (int)((unsigned)lane / NT), c = (int)((unsigned)lane % NT);
    const int vd = V_OFF + r * TT + 16 * c;
#pragma unroll
    for (int k = 0; k < 2 * NT; ++k) cp16(dst + kd + 512 * k, kb + kd + 512 * k);
#pragma unroll
    for (int k = 0; k < 2 * NT; ++k)  // lane: dim row 32 k / NT + r, 16-token piece c
      cp16(dst + vd + 512 * k, vp + (k * (32 / NT) + r) * BS + 16 * c);
    const u16* sz = (lane < 16 ? ks : kz) + blk * HD + 8 * (lane & 15);
    cp16(dst + SZ_OFF + 16 * lane, sz);
    if (lane < 4 * NT) {  // lanes [0, 2 NT): value scales, [2 NT, 4 NT): zeros, 8 tokens each
      const u16* v2 = (lane < 2 * NT ? vs : vz) + blk * BS + tin + 8 * (lane % (2 * NT));
      cp16(dst + VSZ_OFF + 16 * lane, v2);
    }
  }
  asm volatile("cp.async.commit_group;");
}
