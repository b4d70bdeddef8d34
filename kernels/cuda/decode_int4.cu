// Paged int4 decode with hand-placed tensor-core fragments (nanokv/kernels/cuda_decode_int4.py).
//
// The products of triton_decode_swap4, written against mma.sync.m16n8k16 directly:
//   s^T [16 tok, 8] = K codes [16 tok, 128] @ (q * s_k)^T [128, 8] + Z [16 tok, 128] @ q^T [128, 8]
//   o^T [128, 8]   += V^T codes [128, 16 tok] @ (p * vs)^T [16 tok, 8]       (+ sum_n p_n vz_n)
// One warp per (sequence, KV head, split); the G <= 8 query heads of the group are the MMA's 8
// columns. Z repeats the block's key zero row over the 16 token rows, so the bias q . z comes out
// of the tensor cores in fp32 with exact fp16 products. Everything is chosen so that each lane reads
// the codes it multiplies, as whole words, straight into operand registers (no exchange between lanes):
// - the summed index of both products is free to permute. Row r of s^T holds token pi(r) =
//   4 (r >> 1) + 2 (r & 1) (r < 8) and pi(r) + 1 (row r + 8), so that after movmatrix.trans turns
//   p^T into the PV product's B operand, lane (g, t) needs tokens 4t..4t+3 of each value dim row:
//   one 32-bit word of the dims-major value block, whose nibbles land in the A fragment by one
//   mask-and-splice each (0x6400 + m is fp16 1024 + m);
// - lane (g, t) reads bytes [16t, 16t + 16) of its two key rows (dims 16t.., 64 + 16t..), and
//   its B fragments hold (q * s) for the same dims, so no lane needs another lane's codes.
// Tiles stream through a shared-memory ring (tile_ring.cuh); a loop step's two products and its
// softmax: step_int4.cuh. Open (staged) blocks are scored from
// full-precision staging in a second loop (staged_tile.cuh), as in the Triton kernels; blocks a step
// completes are quantized in the same launch (fill_int4.cuh); splits are merged by the last
// program of each (sequence, KV head) (split_merge.cuh). Fragment helpers: mma_frag.cuh.
// Compile-time: G (query heads per KV head), NKV (KV heads), BS (block size, a multiple of 16), Q_BF16,
// ST_BF16, OUT_BF16 (else fp16), NSTAGE (ring depth), NT (16-token tiles per loop step, sharing the
// block's key scales, bias and softmax reductions; BS % (16 NT) == 0), MAXNREG (register cap, 0 = none).
// Head dim 128.
// cuda_decode_int4.py inlines the #include lines for NVRTC.

#include "mma_frag.cuh"
#include "tile_ring.cuh"
#include "split_merge.cuh"
#include "fill_int4.cuh"
#include "staged_tile.cuh"
#include "step_int4.cuh"

// a register cap reaches the driver's PTX compiler only as .maxnreg in the PTX (__maxnreg__)
#if defined(MAXNREG) && MAXNREG > 0
#define BOUNDS __maxnreg__(MAXNREG)
#else
#define BOUNDS __launch_bounds__(32)
#endif

extern "C" __global__ void BOUNDS nanokv_decode_int4(
    const u16* __restrict__ q, const unsigned char* __restrict__ kc, const unsigned char* __restrict__ vc,
    const u16* __restrict__ ks, const u16* __restrict__ kz, const u16* __restrict__ vs,
    const u16* __restrict__ vz, const u16* __restrict__ kst, const u16* __restrict__ vst,
    const int* __restrict__ stage_of, const int* __restrict__ bt, const int* __restrict__ seq_lens,
    u16* out, float* part_o, float* part_ml, int* counts, double qk_scale_d, int num_splits,
    int stride_qt, int stride_qh, int stride_ot, int stride_oh, int stride_bt, int fill,
    const long long* __restrict__ fill_slots, int by_length, const long long* __restrict__ order) {
  // the cache tensors are contiguous (checked by the caller), so every offset inside a block is a
  // compile-time constant: codes [N, NKV, BS, 64] (keys) and [N, NKV, 64, BS] (values, dims-major),
  // key scale/zero [N, NKV, 128], value scale/zero [N, NKV, BS], staging [S, NKV, BS, 128]
  // by_length: grid (splits, NKV, B), programs launched in that order, and order[i] the i-th longest
  // sequence: the last programs to start are the shortest (less idle tail over uneven lengths);
  // else grid (B, NKV, splits)
  const int nrows = by_length ? gridDim.z : gridDim.x;
  const int seq = by_length ? (int)order[blockIdx.z] : blockIdx.x, kvh = blockIdx.y;
  const int split = by_length ? blockIdx.x : blockIdx.z, H = NKV;
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const float qk_scale = (float)qk_scale_d;
  const int seq_len = seq_lens[seq];
  const int per = ((seq_len + TT - 1) / TT + num_splits - 1) / num_splits;  // loop steps per split
  const int lo = split * per * TT;
  const int hi = min(lo + per * TT, seq_len);
  const int newest = (max(seq_len - 1, 0) / BS) * BS;  // first position of the newest (open) block
  const int r0 = 4 * (g >> 1) + 2 * (g & 1);              // token of s^T row g; row g + 8: r0 + 1
  const int koff = r0 * 64 + 16 * t;                        // lane's key bytes in a tile

  // q of head g as fp16 pairs, dims 16t.. (ql) and 64 + 16t.. (qh), pair j at QP(j); lanes g >= G
  // read head G - 1: their columns of s^T and o^T are computed and never stored
  u32 ql[8], qh[8];
  {
    const u16* qr = q + (long)seq * stride_qt + (long)(kvh * G + min(g, G - 1)) * stride_qh + 16 * t;
    const uint4* p = reinterpret_cast<const uint4*>(qr);
    const uint4* ph = reinterpret_cast<const uint4*>(qr + 64);
    uint4 a = p[0], b = p[1], c = ph[0], d = ph[1];
    u32 lo8[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}, hi8[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      ql[QP(j)] = to_f16x2(lo8[j], Q_BF16);
      qh[QP(j)] = to_f16x2(hi8[j], Q_BF16);
    }
  }

  float acc[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  Softmax st;
  st.m[0] = st.m[1] = NEG_INF;
  st.l[0] = st.l[1] = st.z[0] = st.z[1] = 0.f;

  const int* bt_row = bt + (long)seq * stride_bt;
  int early = 0;  // a staged tile met before the newest block (tests stage at will; decode steps do not)
  // The split's loop steps (TT tokens: NT tiles of 16) stream through a ring of NSTAGE shared-memory
  // stages (cp.async, the warp's own copy: 16-byte pieces), NSTAGE - 1 steps ahead of the compute;
  // each step's block-table entry and staging slot are read one more step ahead (they head its chain).
  __shared__ __align__(16) unsigned char ring[NSTAGE][STAGE_BYTES];
  const int ntiles = hi > lo ? (hi - lo + TT - 1) / TT : 0;  // loop steps
  // step i + k's block (k <= NSTAGE + 1) and staging slot (k <= NSTAGE) at iteration i: registers,
  // shifted by unrolled copies; the slot is read a step after the block, so no load waits on another
  int ph[NSTAGE + 2], sl[NSTAGE + 1];
#pragma unroll
  for (int k = 0; k <= NSTAGE + 1; ++k) ph[k] = tile_phys(bt_row, lo, ntiles, k);
#pragma unroll
  for (int k = 0; k <= NSTAGE; ++k) sl[k] = ph[k] >= 0 ? stage_of[ph[k]] : -1;
#pragma unroll
  for (int k = 0; k < NSTAGE - 1; ++k)
    fetch_tile(ring[k], kc, vc, ks, kz, vs, vz, ph[k], sl[k], kvh, (unsigned)(lo + TT * k) % BS, lane);
  int stage = 0;
  for (int i = 0; i < ntiles; ++i) {
    const int start = lo + TT * i;
    const int ahead = stage == 0 ? NSTAGE - 1 : stage - 1;  // (stage + NSTAGE - 1) % NSTAGE
    fetch_tile(ring[ahead], kc, vc, ks, kz, vs, vz, ph[NSTAGE - 1], sl[NSTAGE - 1], kvh,
               (unsigned)(start + TT * (NSTAGE - 1)) % BS, lane);
    const int cur_ph = ph[0], cur_sl = sl[0];
#pragma unroll
    for (int k = 0; k < NSTAGE; ++k) sl[k] = sl[k + 1];
#pragma unroll
    for (int k = 0; k <= NSTAGE; ++k) ph[k] = ph[k + 1];
    sl[NSTAGE] = ph[NSTAGE] >= 0 ? stage_of[ph[NSTAGE]] : -1;
    ph[NSTAGE + 1] = tile_phys(bt_row, lo, ntiles, i + NSTAGE + 2);
    asm volatile("cp.async.wait_group %0;" ::"n"(NSTAGE - 1));
    __syncwarp();
    if (cur_sl >= 0 && start < newest) early = 1;
    if (cur_ph >= 0 && cur_sl < 0) {  // the NT tiles h of this step: tokens start + 16 h + (0..15)
      float s[NT][4];
      key_scores(ring[stage], ql, qh, koff, t, s);
      attend_values(ring[stage], s, start, hi, r0, g, t, st, acc, qk_scale);
    }
    __syncwarp();  // every lane has read this stage before a later fetch refills it
    stage = stage == NSTAGE - 1 ? 0 : stage + 1;
  }
  asm volatile("cp.async.wait_group 0;");

  // staged tokens in full precision (plain q): the newest block, or the whole split (see above)
  staged_tokens(st, acc, ql, qh, kst, vst, stage_of, bt_row, early ? lo : max(lo, newest), hi, kvh, r0, g, t,
                qk_scale);

  // epilogue: out (or this split's normalized partial) = (acc + z) / l, heads 2t + j < G
  float inv_l[2], zt[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float l = sum_over_rows(st.l[j]);
    st.l[j] = l;
    zt[j] = sum_over_rows(st.z[j]);
    inv_l[j] = 1.f / (l > 0.f ? l : 1.f);  // acc is 0 where l is: an all-hole context gives 0
  }
  const int Hq = H * G;
  const bool split_mode = num_splits > 1;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int hg = 2 * t + j;
    if (hg >= G) continue;
    const int head = kvh * G + hg;
    const long prow = ((long)seq * Hq + head) * num_splits + split;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float olo = (acc[i][j] + zt[j]) * inv_l[j], ohi = (acc[i][2 + j] + zt[j]) * inv_l[j];
      if (split_mode) {
        part_o[prow * HD + 8 * i + g] = olo;
        part_o[prow * HD + 64 + 8 * i + g] = ohi;
      } else {
        u16* o = out + (long)seq * stride_ot + (long)head * stride_oh;
        o[8 * i + g] = OUT_BF16 ? f32_bf16(olo) : f32_f16(olo);
        o[64 + 8 * i + g] = OUT_BF16 ? f32_bf16(ohi) : f32_f16(ohi);
      }
    }
    if (split_mode && g == 0) {
      const long n_part = (long)nrows * Hq * num_splits;
      part_ml[prow] = st.m[j];
      part_ml[n_part + prow] = st.l[j];
    }
  }
  // fill: this step's slot of each sequence's token ([B] int64, -1 = none); a token in the last slot
  // of its block completed it (fill_int4.cuh). Program (i, split) of row index i of the grid (the
  // i-th longest by length, else row i) fills part `split` of row i's block: the work of one block is
  // spread over num_splits warps, so that none ends much later than its attention work
  const int frow = by_length ? blockIdx.z : blockIdx.x;
  if (fill) {
    const long long slot = fill_slots[frow];
    const int blk = slot >= 0 && slot % BS == BS - 1 ? (int)(slot / BS) : -1;
    const int sl = blk >= 0 ? stage_of[blk] : -1;
    if (sl >= 0)
      fill_part(kst, vst, sl, blk, kvh, const_cast<unsigned char*>(kc), const_cast<unsigned char*>(vc),
                const_cast<u16*>(ks), const_cast<u16*>(kz), const_cast<u16*>(vs), const_cast<u16*>(vz), split,
                num_splits, lane);
  }
  if (!split_mode) return;

  merge_if_last(counts, part_o, part_ml, out, seq, kvh, nrows, num_splits, stride_ot, stride_oh);
}
