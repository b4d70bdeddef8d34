// Split-K merge of the int4 decode (decode_int4.cu).

// The split merge inside the decode launch (triton_softmax.merge_if_last's protocol): after this
// program stored its partial, the last of the (sequence, KV head)'s num_splits programs to arrive
// merges the group's G heads into out and sets the arrival counter back to zero for the next launch.
// part_o [B, Hq, splits, 128] fp32 (normalized partials), part_ml [2, B, Hq, splits] (max, sum; base 2);
// nrows = B.
__device__ __forceinline__ void merge_if_last(int* counts, const float* part_o, const float* part_ml, u16* out,
                                              int seq, int kvh, int nrows, int num_splits, int stride_ot,
                                              int stride_oh) {
  const int H = NKV, Hq = NKV * G, lane = threadIdx.x;
  __syncwarp();
  int* cnt = counts + (long)seq * H + kvh;
  int done = 0;
  if (lane == 0) {
    __threadfence();
    done = atomicAdd(cnt, 1);
  }
  done = __shfl_sync(0xffffffffu, done, 0);
  if (done != num_splits - 1) return;
  __threadfence();
  const long n_part = (long)nrows * Hq * num_splits;
  for (int hg = 0; hg < G; ++hg) {
    const int head = kvh * G + hg;
    const long row0 = ((long)seq * Hq + head) * num_splits;
    float mmax = NEG_INF;
    for (int s = lane; s < num_splits; s += 32) mmax = fmaxf(mmax, __ldcg(part_ml + row0 + s));
    mmax = warp_max(mmax);
    const float msafe = mmax == NEG_INF ? 0.f : mmax;
    float wsum = 0.f;
    for (int s = lane; s < num_splits; s += 32)
      wsum += __ldcg(part_ml + n_part + row0 + s) * ex2(__ldcg(part_ml + row0 + s) - msafe);
    wsum = warp_sum(wsum);
    const float inv = 1.f / (wsum > 0.f ? wsum : 1.f);
    float o4[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < num_splits; ++s) {  // empty splits have l = 0: weight 0
      const float w = __ldcg(part_ml + n_part + row0 + s) * ex2(__ldcg(part_ml + row0 + s) - msafe) * inv;
      const float4 v = __ldcg(reinterpret_cast<const float4*>(part_o + (row0 + s) * HD) + lane);
      o4[0] += w * v.x; o4[1] += w * v.y; o4[2] += w * v.z; o4[3] += w * v.w;
    }
    u16* o = out + (long)seq * stride_ot + (long)head * stride_oh + 4 * lane;
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = OUT_BF16 ? f32_bf16(o4[k]) : f32_f16(o4[k]);
  }
  if (lane == 0) *cnt = 0;
}
