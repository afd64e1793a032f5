// Attention of a few new query rows per sequence against a key/value cache (decode, chunked
// prefill, speculative verification), contiguous or paged, with the new keys appended in
// place first (pw_kvcache_append). Everything that depends on the cached lengths is read on
// the device, so the grid depends on shapes only and a decode step captures in a CUDA graph.
//
// Block = (key split, key/value head and 16-row query tile, sequence). The query rows of a
// block are the (head of the group, new token) pairs of one key/value head, packed 16 to an
// mma row block, so every head of a group shares each key tile the block loads. Its WARPS
// warps split each BN-key tile 16 keys apiece and keep their own online softmax; they merge
// through shared memory at the end. Key tiles stream through a STAGES-deep cp.async ring,
// and each tile loads only the key projections its distances need (near-only: K1, far-only:
// K2, straddling d = w: both). With PER_KEY (phase kvdecode: one new token per sequence, so
// every row of a block has the same position) each key has one distance and the ring holds
// one key slot per stage, filled row by row from K1 or K2: a tile reads exactly one key
// projection per key, and the smaller ring lets more blocks share an SM. A split writes its
// normalised partial output and lse, which pw_forward_combine (forward.cu) merges; with one
// split the block writes o and lse itself.
//
// With ROT != 0 (attention_with_rotary_kvcache) K1 and K2 are one cache of raw keys: each warp
// rotates its 16 rows of a landed key slot in place (kv_rotate_rows) before the score product
// reads them, so one cached key serves both projections.
#include "kvparams.cuh"
#include "traits.cuh"

template <typename T, int D, int BM, int BN, int WARPS, bool CAUSAL, int STAGES, bool PER_KEY,
          int ROT = 0>
__global__ void __launch_bounds__(WARPS * 32) pw_kvcache(const KVParams p) {
  using Tr = KvTraits<D, BM, BN, WARPS, STAGES, PER_KEY ? 1 : 2>;  // smem layout (traits.cuh)
  constexpr int THREADS = Tr::threads, PITCH = Tr::pitch, CPR = D / 8;
  constexpr int RSTEP = THREADS / CPR;                    // rows one pass of the block copies
  constexpr int ROWS_PER_THREAD = (BN + RSTEP - 1) / RSTEP;
  static_assert(THREADS % CPR == 0, "a thread's 16-byte column stays fixed");
  extern __shared__ __align__(16) unsigned char smem[];
  u16* sQ1 = reinterpret_cast<u16*>(smem) + Tr::q1_offset;
  u16* sQ2 = reinterpret_cast<u16*>(smem) + Tr::q2_offset;
  u16* sKV = reinterpret_cast<u16*>(smem) + Tr::kv_offset;  // per stage: K1, K2, V tiles
  constexpr int TILE = Tr::k_tile_elems, STAGE = Tr::stage_elems;
  // a stage is K1, K2, V (PER_KEY: K, V); PER_KEY's K slot serves as K1 and as K2
  constexpr int K2_SLOT = PER_KEY ? 0 : TILE, V_SLOT = Tr::v_in_stage;
  static_assert(Tr::k2_in_stage == K2_SLOT, "stage order K1, K2, V");

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // grid: x = (key/value head, query tile) (up to 2^31 - 1: long chunked prefills),
  // y = key split (at most 64), z = sequence
  const i64 b = blockIdx.z, split = blockIdx.y;
  const i64 G = p.group, M = p.M, rows = G * M;
  const i64 rtiles = (rows + BM - 1) / BM;
  const i64 hk = blockIdx.x / rtiles, row0 = (blockIdx.x % rtiles) * BM;
  const int L = kv_length(p, b);
  const i64 P = (i64)L - M;  // query t sits at position L - M + t: d(t, n) = t + P - n

  // Query rows: packed row r is (head hk * G + r / M, token r % M); padding rows read zeros.
  for (int idx = threadIdx.x; idx < BM * CPR; idx += THREADS) {
    const int r = idx / CPR, ch = idx % CPR;
    const i64 gr = row0 + r;
    const bool ok = gr < rows;
    const i64 h = hk * G + (ok ? gr / M : 0), t = ok ? gr % M : 0;
    const u32 off = (u32)((r * PITCH + ch * 8) * 2);
    cp_async16(smem_addr(sQ1) + off, p.q1.at(b, h) + t * p.q1.sr + ch * 8, ok);
    cp_async16(smem_addr(sQ2) + off, p.q2.at(b, h) + t * p.q2.sr + ch * 8, ok);
  }

  // This split's key tiles, from the sequence's own length (known only on the device).
  // tiles t_begin, t_begin + t_step, ... below t_end: strided for the rotary forms from
  // D = 64 (at D = 16 and 32 the strided loop's registers spilled on sm_80/86/89 in one
  // form or another at the 80 registers ptxas gives these kernels)
  constexpr bool STRIDE = ROT != 0 && D >= 64;
  const int ntiles_all = (L + BN - 1) / BN;
  const KvSplitTiles<STRIDE> range(ntiles_all, split, p.nsplit);
  const int t_begin = range.t_begin, t_end = range.t_end, t_step = range.t_step;
  // ring stage of the tile `j` tiles after t_begin, which is `tile` (a division-free form
  // for the strided split: the division cost the rotary D = 32 form a spill on sm_86)
  auto stage_of = [&](int tile, int j) { return (STRIDE ? j : tile - t_begin) % STAGES; };

  // Tokens of the block's rows span at most [0, M): tile modes use that range.
  const int tlo = 0, tn = (int)min(M, (i64)1 << 30);
  const u16* k1h = p.k1.ptr + hk * p.k1.sh;
  const u16* k2h = p.k2.ptr + hk * p.k2.sh;
  const u16* vh = p.v.ptr + hk * p.v.sh;
  const int my_row = threadIdx.x / CPR, my_ch = threadIdx.x % CPR;

  // Where this thread's rows of key tile `tile` live: page and row in the page. Paged
  // caches read the block table here, a tile ahead of the copies that use it (see the
  // loop), so the table loads' latency hides behind a tile of work.
  i64 page[ROWS_PER_THREAD];
  int rin[ROWS_PER_THREAD];
  auto locate = [&](int tile) {
#pragma unroll
    for (int it = 0; it < ROWS_PER_THREAD; ++it) {
      const int n = min(tile * BN + my_row + it * RSTEP, max(L - 1, 0));  // past L: row L-1..
      if (p.block_table == nullptr) {
        page[it] = b;
        rin[it] = n;
      } else {
        const int blk = n / (int)p.block_size;
        page[it] = p.block_table[b * p.bt_stride + blk];
        rin[it] = n - blk * (int)p.block_size;
      }
    }
  };
  // Copies key tile `tile` (located by the last locate) into ring stage `stage`: the
  // projections the tile needs, and V.
  auto issue = [&](int tile, int stage) {
    const int n0 = tile * BN;
    const int mode = tile_mode(tlo, tn, n0, BN, P, p.w);
    const u32 st = smem_addr(sKV + stage * STAGE) + (u32)((my_row * PITCH + my_ch * 8) * 2);
#pragma unroll
    for (int it = 0; it < ROWS_PER_THREAD; ++it) {
      const int r = my_row + it * RSTEP;
      if (BN % RSTEP == 0 || r < BN) {
        const int n = n0 + r;
        const bool ok = n < L;  // ..and zero-filled instead
        const u32 d = st + (u32)(it * RSTEP * PITCH * 2);
        if (PER_KEY) {
          const bool far = P - n >= p.w;  // the one token's distance to this key
          const CacheView& kv = far ? p.k2 : p.k1;
          cp_async16(d, (far ? k2h : k1h) + page[it] * kv.sp + rin[it] * kv.sr + my_ch * 8, ok);
        } else {
          if (mode & 1)
            cp_async16(d, k1h + page[it] * p.k1.sp + rin[it] * p.k1.sr + my_ch * 8, ok);
          if (mode & 2)
            cp_async16(d + K2_SLOT * 2, k2h + page[it] * p.k2.sp + rin[it] * p.k2.sr + my_ch * 8,
                       ok);
        }
        cp_async16(d + V_SLOT * 2, vh + page[it] * p.v.sp + rin[it] * p.v.sr + my_ch * 8, ok);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (t_begin + s * t_step < t_end) {
      locate(t_begin + s * t_step);
      issue(t_begin + s * t_step, s);
    }
    cp_async_commit();  // the query rows ride in the first group
  }
  if (t_begin + (STAGES - 1) * t_step < t_end) locate(t_begin + (STAGES - 1) * t_step);

  // Tokens of this thread's two fragment rows (lane / 4 and lane / 4 + 8).
  int tok[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const i64 gr = row0 + lane / 4 + 8 * hh;
    tok[hh] = gr < rows ? (int)(gr % M) : 0;
  }
  float acc[1][D / 8][4];
  zero_n<D / 2>(&acc[0][0][0]);
  float row_max[2] = {PW_NEG_INF, PW_NEG_INF}, row_sum[2] = {0.f, 0.f};
  const int wp = (int)clamp64(p.w, -(1 << 30), 1 << 30);

  for (int tile = t_begin, j = 0; tile < t_end; tile += t_step, ++j) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile's stage landed for all; the stage of tile - 1 is free again
    const int nxt = tile + (STAGES - 1) * t_step;
    if (nxt < t_end) issue(nxt, stage_of(nxt, j + STAGES - 1));  // located an iteration ago
    cp_async_commit();
    const u16* st = sKV + stage_of(tile, j) * STAGE;
    const int n0 = tile * BN + warp * 16;  // this warp's 16 keys
    const int mode = tile_mode(tlo, tn, n0, 16, P, p.w);
    const int dbase = (int)clamp64(P - n0, -(1 << 30), 1 << 30);  // d = tok + dbase - c

    if constexpr (ROT != 0) {  // raw keys in: rotate the warp's rows of the slots it reads
      u16* mine = const_cast<u16*>(st) + warp * 16 * PITCH;
      // 16-byte group g of row r of a slot: padded rows, PITCH elements apart
      auto at_row = [](u16* slot) { return [slot](int r, int g) { return slot + r * PITCH + g * 8; }; };
      const int g1 = (int)p.rot_group1, g2 = (int)p.rot_group2;
      if (PER_KEY) {  // one slot, each row from the projection its distance picks
        kv_rotate_rows<T, D, ROT, 1>(at_row(mine), n0, L, p, lane,
                                  [&](int n) { return P - n >= p.w ? g2 : g1; });
      } else {
        if (mode & 1)
          kv_rotate_rows<T, D, ROT, 1>(at_row(mine), n0, L, p, lane, [&](int) { return g1; });
        if (mode & 2)
          kv_rotate_rows<T, D, ROT, 1>(at_row(mine + K2_SLOT), n0, L, p, lane,
                                    [&](int) { return g2; });
      }
      __syncwarp();
    }

    float s[1][2][4];
    zero_n<8>(&s[0][0][0]);
    const u32 aK1 = smem_addr(st), aK2 = smem_addr(st + K2_SLOT);
    if (mode == 3) {
      float t2[1][2][4];
      zero_n<8>(&t2[0][0][0]);
      mma_abt_block<T, D, 1>(s, smem_addr(sQ1), aK1, warp, lane);
      mma_abt_block<T, D, 1>(t2, smem_addr(sQ2), aK2, warp, lane);
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (tok[e / 2] + dbase - frag_col(nb, e, lane) >= wp) s[0][nb][e] = t2[0][nb][e];
    } else {
      mma_abt_block<T, D, 1>(s, smem_addr(mode == 1 ? sQ1 : sQ2), mode == 1 ? aK1 : aK2, warp,
                             lane);
    }
    const bool masked = n0 + 16 > L || (CAUSAL && P - (n0 + 15) < 0);
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[0][nb][e] * p.scale_log2;
        if (masked) {
          const int c = frag_col(nb, e, lane);
          if (n0 + c >= L || (CAUSAL && tok[e / 2] + dbase - c < 0)) x = PW_NEG_INF;
        }
        s[0][nb][e] = x;
      }

    kv_softmax<2, D>(s[0], row_max, row_sum, acc[0]);
    mma_xb<T, D, 16, 1>(acc, s, smem_addr(st + V_SLOT + warp * 16 * PITCH), lane);
    if (nxt + t_step < t_end) locate(nxt + t_step);  // the next iteration's copies
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the ring: reuse it to merge the warps

  kv_merge_warps<D, BM, WARPS>(reinterpret_cast<float*>(sKV), threadIdx.x, rows - row0, acc[0],
                               row_max, row_sum, [] { __syncthreads(); },
                               KvStoreGlobal<T, D>{p, b, split, hk, row0});
}

// Writes the M new rows of k1, k2 and v of each sequence into its cache at positions
// seqlens[b] + t (rows that would fall outside [0, capacity) are dropped). One thread per
// 16-byte chunk: blockIdx.x * 256 + threadIdx.x enumerates (token, tensor, chunk).
template <typename T, int D>
__global__ void __launch_bounds__(256) pw_kvcache_append(const KVParams p) {
  constexpr int CPR = D / 8;
  const i64 idx = (i64)blockIdx.x * 256 + threadIdx.x;
  if (idx >= p.M * 3 * CPR) return;
  const i64 hk = blockIdx.y, b = blockIdx.z;
  const int t = (int)(idx / (3 * CPR)), which = (int)(idx / CPR % 3), ch = (int)(idx % CPR);
  if (which == 1 && p.rot_cos != nullptr) return;  // rotary-inside: K2 is K1's cache
  const i64 pos = (i64)p.seqlens[b] + t;
  if (pos < 0 || pos >= p.capacity) return;  // outside the cache: not written (nor attended)
  const Tensor& src = which == 0 ? p.k1n : (which == 1 ? p.k2n : p.vn);
  const CacheView& dst = which == 0 ? p.k1 : (which == 1 ? p.k2 : p.v);
  const uint4 x = *reinterpret_cast<const uint4*>(src.at(b, hk) + t * src.sr + ch * 8);
  *reinterpret_cast<uint4*>(dst.ptr + hk * dst.sh + cache_offset(p, dst, b, (int)pos) + ch * 8) = x;
}
