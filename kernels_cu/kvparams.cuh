// What the KV-cache kernels share: their parameter struct, the cache addressing, the
// per-warp online softmax over 16 keys and the epilogue that merges the warps' partial rows
// and writes o and lse (or one split's partials). Used by kernels_cu/kvcache.cu (cp.async,
// every architecture) and kernels_cu/sm90/kvdecode.cu (TMA, Hopper, one new token).
#pragma once
#include "params.cuh"

// A cache of (pages, heads, rows, D) with unit stride along D. Contiguous caches are one page
// per sequence: page b, rows 0 .. capacity-1.
struct CacheView {
  u16* ptr;
  i64 sp, sh, sr;  // page (or batch), head and row strides in elements
};

// Mirrors KV_FIELDS in cupy_piecewise/kvcache_launch.py (every member 8 bytes).
struct KVParams {
  Tensor q1, q2, o;           // (B, H, M, D)
  CacheView k1, k2, v;        // the caches
  Tensor k1n, k2n, vn;        // keys appended before attending, (B, Hkv, M, D); k1n.ptr null: none
  const int* seqlens;         // (B,) keys cached per sequence
  const int* block_table;     // (B, bt_stride) page of each block of rows; null: contiguous
  i64 bt_stride, block_size;  // block_size: rows per page (paged only)
  float* lse;                 // (B, H, M) natural log, or null
  float* o_part;              // (nsplit, B, H, M, D) float32, normalised per split
  float* lse_part;            // (nsplit, B, H, M)
  i64 H, group, M, capacity, w, nsplit;
  float scale_log2;           // sm_scale * log2(e)
  float sm_scale;
  // Rotary-inside calls (pw_kvcache's ROT != 0): K1 and K2 are one cache of raw keys, and key
  // n of projection i is rotated at position n / rot_group<i> (0: not rotated) with the
  // (positions, D / 2) float32 tables rot_cos, rot_sin. Null tables otherwise.
  const float* rot_cos;
  const float* rot_sin;
  i64 rot_group1, rot_group2;
};

// Element offset of row n of sequence b inside a cache view, head excluded.
PW_DEVICE i64 cache_offset(const KVParams& p, const CacheView& c, i64 b, int n) {
  if (p.block_table == nullptr) return b * c.sp + (i64)n * c.sr;
  const int blk = n / (int)p.block_size;
  const i64 page = p.block_table[b * p.bt_stride + blk];
  return page * c.sp + (i64)(n - blk * (int)p.block_size) * c.sr;
}

// Keys sequence b attends: its cached ones plus the M appended in this call, if any (never
// beyond the cache's capacity: the appended rows that do not fit were not written).
PW_DEVICE int kv_length(const KVParams& p, i64 b) {
  const i64 L = (i64)p.seqlens[b] + (p.k1n.ptr != nullptr ? p.M : 0);
  return (int)clamp64(L, 0, p.capacity);
}

// Online softmax of one warp over NB * 8 keys: `s` holds the scores of rows lane / 4 and
// lane / 4 + 8 (already scaled to log2 units, masked entries -inf) as NB 8-key mma blocks;
// on return it holds their exponentials, and the running max, sum and output rows of the
// warp are rescaled. A row's four lanes share its max.
template <int NB, int D>
PW_DEVICE void kv_softmax(float (&s)[NB][4], float (&row_max)[2], float (&row_sum)[2],
                          float (&acc)[D / 8][4]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float mx = row_max[hh];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * hh], s[nb][2 * hh + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float base = mx == PW_NEG_INF ? 0.f : mx;  // all masked so far: exp2 stays 0
    const float alpha = fast_exp2(row_max[hh] - base);
    row_max[hh] = mx;
    float sum = 0.f;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      s[nb][2 * hh] = fast_exp2(s[nb][2 * hh] - base);
      s[nb][2 * hh + 1] = fast_exp2(s[nb][2 * hh + 1] - base);
      sum += s[nb][2 * hh] + s[nb][2 * hh + 1];
    }
    row_sum[hh] = row_sum[hh] * alpha + sum;
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb) {
      acc[nb][2 * hh] *= alpha;
      acc[nb][2 * hh + 1] *= alpha;
    }
  }
}

// Epilogue of a KV-cache block whose WARPS warps each kept an online softmax over their own
// keys for the same BM packed query rows: the warps leave max, sum and unnormalised output in
// `scratch` (WARPS * BM * (D + 2) floats of shared memory no longer in use), `sync()` (a
// barrier of exactly these warps), and the warps' threads, `tid` of WARPS * 32, merge them:
// `emit(r, c, o, lse)` receives element c of the block's normalised output row r (< nrows,
// the rows that are not padding) and the row's lse (natural log; -inf with o = 0 when no
// key was admissible).
template <int D, int BM, int WARPS, class Sync, class Emit>
PW_DEVICE void kv_merge_warps(float* scratch, int tid, i64 nrows, const float (&acc)[D / 8][4],
                              const float (&row_max)[2], const float (&row_sum)[2], Sync sync,
                              Emit emit) {
  constexpr int THREADS = WARPS * 32;
  const int lane = tid % 32, warp = tid / 32;
  float* sO = scratch;                // [WARPS][BM][D]
  float* sMax = sO + WARPS * BM * D;  // [WARPS][BM]
  float* sSum = sMax + WARPS * BM;    // [WARPS][BM]
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = lane / 4 + 8 * hh;
    float l = row_sum[hh];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (lane % 4 == 0) {
      sMax[warp * BM + r] = row_max[hh];
      sSum[warp * BM + r] = l;
    }
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb)
      *reinterpret_cast<float2*>(sO + (warp * BM + r) * D + nb * 8 + 2 * (lane % 4)) =
          make_float2(acc[nb][2 * hh], acc[nb][2 * hh + 1]);
  }
  sync();

  const int valid = (int)(nrows < BM ? nrows : BM);
  for (int idx = tid; idx < valid * D; idx += THREADS) {
    const int r = idx / D, c = idx % D;
    float mx = PW_NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sMax[w * BM + r]);
    float l = 0.f, o = 0.f;
    if (mx != PW_NEG_INF) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float f = fast_exp2(sMax[w * BM + r] - mx);
        l += f * sSum[w * BM + r];
        o += f * sO[(w * BM + r) * D + c];
      }
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;  // no admissible key: o = 0, lse = -inf
    emit(r, c, o * inv, l > 0.f ? (mx + __log2f(l)) * PW_LN2 : PW_NEG_INF);
  }
}

// The global writer of a block's rows (row0.. of key/value head hk, sequence b, key split
// `split`): o and lse when the call has one split, else the split's float32 partials for
// pw_forward_combine.
template <typename T, int D> struct KvStoreGlobal {
  const KVParams& p;
  i64 b, split, hk, row0;
  PW_DEVICE void operator()(int r, int c, float o, float lse) const {
    const i64 G = p.group, M = p.M, gr = row0 + r, B = gridDim.z, H = p.H;
    const i64 h = hk * G + gr / M, t = gr % M;
    const i64 row = (b * H + h) * M + t;  // in (B, H, M)
    if (p.nsplit == 1) {
      p.o.mut(b, h)[t * p.o.sr + c] = Elem<T>::from_float(o);
      if (c == 0 && p.lse) p.lse[row] = lse;
    } else {
      const i64 part = split * B * H * M + row;
      p.o_part[part * D + c] = o;
      if (c == 0) p.lse_part[part] = lse;
    }
  }
};
