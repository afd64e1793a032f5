// What the KV-cache kernels share: their parameter struct, the cache addressing, the
// per-warp online softmax over 16 keys, the epilogue that merges the warps' partial rows
// and writes o and lse (or one split's partials), and the rotary-inside rotation of a
// warp's key rows. Used by kernels_cu/kvcache.cu (cp.async,
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

// The key tiles of split `split` of `nsplit` over `ntiles` tiles: t_begin, t_begin + t_step,
// ... below t_end. STRIDE: split s takes tiles s, s + nsplit, ... (the rotary forms, which
// rotate only some tiles: ReRoPE's near keys are the sequence's last ones, and contiguous
// ranges left the last splits with all the rotation and the others idle: 1.8x on an H200
// at B = 1, N = 32768); otherwise a contiguous range (the plain kernels: strided timed
// 0.98-1.01x there).
template <bool STRIDE> struct KvSplitTiles {
  int t_begin, t_end, t_step;
  PW_DEVICE KvSplitTiles(int ntiles, i64 split, i64 nsplit) {
    if constexpr (STRIDE) {
      t_step = (int)nsplit;
      t_begin = (int)split;
      t_end = ntiles;
    } else {
      const int per = (int)((ntiles + nsplit - 1) / nsplit);
      t_step = 1;
      t_begin = (int)min((i64)ntiles, split * per);
      t_end = min(ntiles, t_begin + per);
    }
  }
};

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

// The two halves of a rotated pair (a, b) by angle (c, s): a c - b s and b c + a s, each
// product and the sum rounded to float32 on its own (no FMA contraction), so the result is
// the one a float32 rotation on the host (NumPy, torch) gives before rounding to T.
PW_DEVICE float rot_first(float a, float b, float c, float s) {
  return __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
}
PW_DEVICE float rot_second(float a, float b, float c, float s) {
  return __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// Rotary embedding of key rows in shared memory, in place (the KV-cache kernels' ROT:
// pw_kvcache, pw90_kvdecode): ROT = 1 rotates the two halves of a row against each other
// (GPT-NeoX and Llama's rotate_half), ROT = 2 interleaved pairs (2i, 2i + 1) (GPT-J).
// A work item is 8 pairs of a row, two 16-byte groups x and y, and 8 entries of each table
// (pairs 8c .. 8c + 7): ROT 1 pairs group c with group c + D / 16 (the same columns of the
// second half), ROT 2 takes groups 2c and 2c + 1, four neighbour pairs each. A warp's 16
// rows are 16 * D / 16 items, item i = lane + 32 k: row i / (D / 16), c = i % (D / 16).
// p.rot_cos and p.rot_sin are (positions, D / 2) float32 tables, rows 16-byte aligned.
template <int D> struct KvRotItem {
  static constexpr int PER_ROW = D / 16;
  static constexpr int PER_LANE = 16 * PER_ROW / 32;  // items per lane for 16 rows (D >= 32)
};

// The table entries of item column c of position `pos`: 8 cos and 8 sin, two float4 each.
template <int D>
PW_DEVICE void kv_rot_load(const KVParams& p, int pos, int c, float4 (&cs)[2], float4 (&sn)[2]) {
  const i64 base = (i64)pos * (D / 2) + c * 8;
  const float4* cp = reinterpret_cast<const float4*>(p.rot_cos + base);
  const float4* sp = reinterpret_cast<const float4*>(p.rot_sin + base);
  cs[0] = __ldg(cp);
  cs[1] = __ldg(cp + 1);
  sn[0] = __ldg(sp);
  sn[1] = __ldg(sp + 1);
}

// Rotates item column c of the row whose 16-byte groups `at(g)` gives, by the entries of
// kv_rot_load. Pairs are rotated in float32 (rot_first, rot_second) and rounded once to T, as
// a float32 rotation of the keys before caching them would.
template <typename T, int D, int ROT, class AtRow>
PW_DEVICE void kv_rot_apply(AtRow at, int c, const float4 (&c4)[2], const float4 (&s4)[2]) {
  static_assert(ROT == 1 || ROT == 2, "halves (1) or interleaved pairs (2)");
  u16* x = at(ROT == 1 ? c : 2 * c);
  u16* y = at(ROT == 1 ? c + D / 16 : 2 * c + 1);
  uint4 a = *reinterpret_cast<const uint4*>(x), b = *reinterpret_cast<const uint4*>(y);
  const float cs[8] = {c4[0].x, c4[0].y, c4[0].z, c4[0].w, c4[1].x, c4[1].y, c4[1].z, c4[1].w};
  const float sn[8] = {s4[0].x, s4[0].y, s4[0].z, s4[0].w, s4[1].x, s4[1].y, s4[1].z, s4[1].w};
  u32* au = reinterpret_cast<u32*>(&a);
  u32* bu = reinterpret_cast<u32*>(&b);
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // 32-bit word j of each group: columns 2j, 2j + 1
    if constexpr (ROT == 1) {  // column 2j + h of x pairs with the same column of y
      float u[2], v[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float x1 = Elem<T>::to_float((u16)(au[j] >> (16 * h)));
        const float x2 = Elem<T>::to_float((u16)(bu[j] >> (16 * h)));
        u[h] = rot_first(x1, x2, cs[2 * j + h], sn[2 * j + h]);
        v[h] = rot_second(x1, x2, cs[2 * j + h], sn[2 * j + h]);
      }
      au[j] = Elem<T>::pack(u[0], u[1]);
      bu[j] = Elem<T>::pack(v[0], v[1]);
    } else {  // the word is one pair: pair j of x, pair 4 + j of y
      const float e = Elem<T>::to_float((u16)au[j]), o = Elem<T>::to_float((u16)(au[j] >> 16));
      au[j] = Elem<T>::pack(rot_first(e, o, cs[j], sn[j]), rot_second(e, o, cs[j], sn[j]));
      const float f = Elem<T>::to_float((u16)bu[j]), q = Elem<T>::to_float((u16)(bu[j] >> 16));
      bu[j] = Elem<T>::pack(rot_first(f, q, cs[4 + j], sn[4 + j]),
                            rot_second(f, q, cs[4 + j], sn[4 + j]));
    }
  }
  *reinterpret_cast<uint4*>(x) = a;
  *reinterpret_cast<uint4*>(y) = b;
}

// One warp's 16 key rows rotated in place: `at(r, g)` is the address of the 16-byte group g
// (columns 8g .. 8g + 7) of row r, whatever the tile's layout (padded or swizzled). Key
// n = n0 + r is rotated at position n / group_of(n); group_of(n) = 0 leaves it as it is, and
// so do rows at n >= L (past the sequence: their scores are masked). UNROLL: work items per
// lane in flight (1 or 2). The caller syncs the warp before other lanes read the rows.
template <typename T, int D, int ROT, int UNROLL, class At, class GroupOf, class Load>
PW_DEVICE void kv_rotate_rows_from(At at, int n0, int L, int lane, GroupOf group_of, Load load) {
  constexpr int PER_ROW = KvRotItem<D>::PER_ROW;
  // UNROLL items in flight per lane. Fully unrolled, ptxas hoisted every table load and
  // took 160 registers in pw90_kvdecode at D = 128 (128 without the rotation); pw_kvcache
  // takes one: by two, its D = 64 kvcache non-causal interleaved form spilled 4 bytes on
  // sm_90, and its rotation overlaps the next tile's copies anyway.
#pragma unroll (UNROLL)
  for (int i = lane; i < 16 * PER_ROW; i += 32) {  // 16 rows: one warp's keys
    const int r = i / PER_ROW, c = i % PER_ROW, n = n0 + r;
    const int g = n < L ? group_of(n) : 0;
    if (g == 0) continue;
    float4 cs[2], sn[2];
    load(n / g, c, cs, sn);
    kv_rot_apply<T, D, ROT>([&](int gg) { return at(r, gg); }, c, cs, sn);
  }
}
template <typename T, int D, int ROT, int UNROLL, class At, class GroupOf>
PW_DEVICE void kv_rotate_rows(At at, int n0, int L, const KVParams& p, int lane,
                              GroupOf group_of) {
  kv_rotate_rows_from<T, D, ROT, UNROLL>(
      at, n0, L, lane, group_of,
      [&](int pos, int c, float4(&cs)[2], float4(&sn)[2]) { kv_rot_load<D>(p, pos, c, cs, sn); });
}

// kv_rotate_rows with the table rows already in shared memory (the Hopper decode's staged
// tables, KV90_ROT_STAGE): `tcos` and `tsin` hold rows n0 / g, n0 / g + 1, ... of the tables
// (packed, D / 2 floats each), for key n = n0 + r at position n / g, g > 0.
template <typename T, int D, int ROT, class At>
PW_DEVICE void kv_rotate_rows_staged(At at, int n0, int L, int g, const float* tcos,
                                     const float* tsin, int lane) {
  const int first = n0 / g;
  kv_rotate_rows_from<T, D, ROT, 2>(
      at, n0, L, lane, [&](int) { return g; },
      [&](int pos, int c, float4(&cs)[2], float4(&sn)[2]) {
        const int off = (pos - first) * (D / 2) + c * 8;
        const float4* cp = reinterpret_cast<const float4*>(tcos + off);
        const float4* sp = reinterpret_cast<const float4*>(tsin + off);
        cs[0] = cp[0], cs[1] = cp[1], sn[0] = sp[0], sn[1] = sp[1];
      });
}

// The table entries of one warp's 16 rows held in registers, so that they can be loaded a
// chunk ahead of the rotation (pw90_kvdecode: the loads' L2 latency then overlaps the
// current chunk's products instead of stalling the rotation). Every row of the chunk uses
// one group size g (0: nothing loaded, nothing rotated).
template <typename T, int D, int ROT> struct KvRotAhead {
  static constexpr int PER_ROW = KvRotItem<D>::PER_ROW, ITEMS = KvRotItem<D>::PER_LANE;
  static_assert(16 * PER_ROW % 32 == 0, "whole items per lane");
  float4 cs[ITEMS][2], sn[ITEMS][2];

  PW_DEVICE void load(const KVParams& p, int n0, int L, int g, int lane) {
    if (g == 0) return;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int i = lane + 32 * k, n = n0 + i / PER_ROW;
      if (n < L) kv_rot_load<D>(p, n / g, i % PER_ROW, cs[k], sn[k]);
    }
  }
  template <class At> PW_DEVICE void apply(At at, int n0, int L, int g, int lane) const {
    if (g == 0) return;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int i = lane + 32 * k, r = i / PER_ROW;
      if (n0 + r < L)
        kv_rot_apply<T, D, ROT>([&](int gg) { return at(r, gg); }, i % PER_ROW, cs[k], sn[k]);
    }
  }
};
