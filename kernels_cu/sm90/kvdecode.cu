// Decode against a key/value cache on Hopper (sm_90): one new token per sequence (M = 1),
// key tiles streamed by TMA into a ring of mbarrier-guarded stages by a producer warp, so
// that the SM keeps far more bytes in flight than the cp.async kernel of kvcache.cu (whose
// block issues each tile's copies itself and waits for them at the next tile).
//
// Block = (key/value head and 16-row query tile, key split, sequence), CW + 1 warps:
//   warp CW    producer: per 64-key tile, for each 16-key chunk the tile holds below the
//              sequence's length, TMA loads of one key projection (K2 for keys at distance
//              >= w, K1 for the others; the one chunk that straddles d = w loads both, K2
//              into a slot of its own) and of V, as boxes of 16 rows x 64 columns with
//              the 128-byte swizzle. A paged cache's chunk lies in one page (block sizes are
//              multiples of 16), so the box's outer coordinate is the page from the block
//              table, read one tile ahead. The full barrier's transaction count is the
//              tile's bytes.
//   warps < CW consumers (CW = 4): warp w takes chunk w of every tile: S = Q·Kᵀ on mma.sync
//              (Q from a padded shared tile, 16 packed rows: the heads of a group), the
//              piecewise select on the straddling chunk only, the online softmax, O += P·V;
//              then it releases the stage on the empty barrier. Each warp keeps its own
//              softmax state; they merge through shared memory at the end (kv_merge_warps),
//              as the cp.async kernel's warps do.
// Key splits: with CLUSTER = 1 a split writes its float32 partial rows for pw_forward_combine
// (or, unsplit, o itself). With CLUSTER > 1 the grid's CLUSTER splits of a (head, sequence)
// form one thread-block cluster and merge their rows through distributed shared memory at
// the end: no partials in global memory and no second launch, which at a few thousand keys
// is a fifth of the step.
// With ROT != 0 (attention_with_rotary_kvcache) the K1 and K2 maps describe one cache of raw
// keys, and each consumer warp rotates the rows of its chunk (and of the straddling K2) in
// place before its score product (kv_rotate_rows, kvparams.cuh).
// Everything that depends on the cached lengths is read on the device; the grid depends on
// shapes only (CUDA graphs). Rows of a chunk past the sequence's length hold whatever the
// cache holds there (TMA fills only rows past the cache's capacity with zeros): their scores
// are masked, and the consumer zeroes their V rows before P·V, so stale NaN or Inf cannot
// reach the output (0 * Inf = NaN).
//
// Shared memory: per stage K and V of 64 keys (4 chunks x D/64 boxes of 2 KB each; D = 128:
// 32 KB, D = 64: 16 KB); the straddling chunk's K2; 2 * STAGES mbarriers, the Q1 and Q2
// tiles (16 rows, padded pitch), plus 1 KB to align the base to the swizzle's 1024 bytes.
// (The staged rotary tables, KV90_ROT_STAGE below, add each chunk's cos and sin rows to the
// stage and to the K2 slot.)
#include "kvparams.cuh"
#include "sm90/hopper.cuh"

// A/B switches (scripts/kvdecode_probe.py; bench/NOTES.md, twenty-ninth section):
// KV90_SPLIT_STRIDE 0: each key split takes a contiguous range of tiles; 1: split s takes
// tiles s, s + nsplit, ...; 2 (default): 1 for the rotary forms, 0 otherwise.
#ifndef KV90_SPLIT_STRIDE
#define KV90_SPLIT_STRIDE 2
#endif
// KV90_ROT_AHEAD: where the rotary forms load a chunk's table entries. 0: at the rotation
// (kv_rotate_rows); 2: into registers a chunk ahead (KvRotAhead), while the current chunk is
// computed; 1 (default): 2 at D = 64 (32 registers per lane: 0.96-1.27x there), 0 at D = 128
// (64 registers: 0.57-0.78x, 200 registers a thread against 151; H200, bench/NOTES.md).
#ifndef KV90_ROT_AHEAD
#define KV90_ROT_AHEAD 1
#endif

// KV90_ROT_STAGE (0 by default; host mirror capability.KV90_ROT_STAGE): 1 makes the
// rotary forms' producer warp bring each chunk's cos and sin rows into the stage with its
// keys (plain bulk copies: a chunk's rows n0 / g .. (n0 + 15) / g are contiguous in the
// packed tables), so the consumers rotate from shared memory instead of waiting on a
// dependent global load per table row: the rotary decode runs at 44-56% of DRAM peak with
// its cost per table row touched (bench/NOTES.md, thirty-fourth section). Per stage it adds
// 64 * D bytes per chunk (D = 128: 32 KB a stage), plus one chunk's worth for the straddling
// chunk's K2. It is the default of pw90_kvdecode_rot's TAB parameter; the host asks for
// TAB = true by name where it picks the staged form for a shape (capability.
// KV90_ROT_STAGE_UNSPLIT). First GPU run (H100, bench/results/2026-12-06-h100-mma-d64-decode-ncu):
// correct; +2-19% where the decode does not split, 15-44% slower where it does (one block
// per SM at D = 128, so the host's split rule halves the splits). On an H200
// (bench/results/2026-12-06-h200-decode-mma-tables) slower where it does not split too
// (D = 64 B = 8: 0.83 -> 0.60x cuDNN), and racecheck reported the table copies (bulk_load)
// against kv_rotate_rows_staged's reads once the ring wraps: the copies follow the stage's
// empty-barrier wait as the K/V refills do, and racecheck flags that order for any bulk
// copy (scripts/racecheck_bulk_probe.py: a one-slot ring drew the same report, its
// control with a block barrier none; bench/results/2026-12-06-h100-tilebox).
#ifndef KV90_ROT_STAGE
#define KV90_ROT_STAGE 0
#endif
// KV90_TILE_BOX (0 by default; host mirror capability.KV90_TILE_BOX; an A/B build): 1 gives the plain decode (ROT == 0) three more tensor maps, of 64-row boxes
// (kvcache_launch builds them), and the producer loads each tile that does not straddle
// d = w as one box per 64-column panel of K and of V (lane 0: 2 * D / 64 loads of 8 KB)
// instead of 16-row boxes per chunk (four lanes: 8 * D / 64 loads of 2 KB), where a tile
// lies in one page (contiguous caches of at least 64 rows, or pages of a multiple of 64
// rows). The aim is cuDNN's DRAM efficiency: its decode reads 32 KB tiles and ran at 92.6%
// of DRAM peak against our 89.0% on the same grid and bytes (H100, bench/NOTES.md,
// thirty-fifth section). A stage's K and V are then kept panel-major (panel j of the tile
// at j * 8 KB; chunk c at c * 2 KB inside it), which at D = 64 (one panel) is the same
// layout as the chunk-major one of the default. Timed on an H100
// (bench/results/2026-12-06-h100-tilebox): +0.4-1.7% at D = 128, -0.1-6% at D = 64 (the
// eight-split N = 4096 row), paged (block size 64) within 3% of contiguous everywhere; not
// the default. KV90_TILE_BOX=2 keeps the boxes to D = 128 and paged caches; beside the
// half-row default and KV90_ROW_BOX=1 in one probe run (H100, bench/results/
// 2026-12-06-h100-rowbox) it was -1.7% to +0.9% at D = 128 where the row boxes were +3.2-5.1%,
// but +1.0-6.5% on the paged D = 64 rows (block size 64), where a 64-key tile is one 8 KB
// page that 16-row boxes read in four (H100, 2026-12-07; bench/results/
// 2026-12-07-h100-paged-d64-entry), and 2-4% slower on the contiguous D = 64 row of eight
// short splits (N = 4096), which takes no tile box but runs the tile-box form. So the paged
// D = 64 decode has an entry of its own, pw90_kvdecode_pages below, and the macro stays an
// A/B build.
#ifndef KV90_TILE_BOX
#define KV90_TILE_BOX 0
#endif
// KV90_ROW_BOX (2 by default since 2026-12-06; host mirror capability.KV90_ROW_BOX): at
// D = 128 the plain decode (ROT == 0) loads each 16-key chunk of K and V as one box of whole
// 256-byte rows (a 5-d map {64 columns, 2 panels, rows, heads, pages}; kvcache_launch builds
// it) instead of two boxes of 128-byte half rows, so each box reads 4 KB of contiguous
// memory, as the D = 64 decode's boxes read 2 KB (cuDNN reads whole rows). The chunk's shared
// layout becomes row-major over the two panels: 128-byte unit u = 2 r + panel, the 128-byte
// swizzle XORing the 16-byte group with u % 8 (swz with ROWP = 2), which makes an ldmatrix
// phase of 8 consecutive rows a 2-way bank conflict (rows r and r + 4 share u % 8); the
// consumers have slack in this DRAM-bound kernel. Timed on an H100
// (bench/results/2026-12-06-h100-rowbox): +3.2-5.1% on every unclustered D = 128 row
// (0.945-0.951 -> 0.978-0.994x cuDNN) but -2% on the one row whose splits merge in a cluster
// (B = 1, N = 4096, 4 splits in a cluster of 4: 0.955-0.956 -> 0.933-0.936x), in two runs.
// Mode 1 takes the row boxes in every plain D = 128 form; mode 2 only where CLUSTER == 1,
// the kernels they won in, so each kernel of mode 2 is, PTX for PTX, one of the two forms
// timed, tested and sanitized there (tests/test_build_check_cpu.py); 0 the half-row boxes
// everywhere. Mode 2 became the default after its own build ran the KV-cache GPU tests and
// memcheck, racecheck and synccheck on an H200 (gpu_run.sh rowbox), where it timed +1.2-3.9%
// over mode 0 on the unclustered D = 128 rows in two decode tables
// (bench/results/2026-12-06-h200-rowbox-default). A tile-box build (KV90_TILE_BOX) takes no
// row boxes: mode 2 yields to it, mode 1 is refused.
#ifndef KV90_ROW_BOX
#define KV90_ROW_BOX 2
#endif
static_assert(!(KV90_ROW_BOX == 1 && KV90_TILE_BOX),
              "KV90_ROW_BOX=1 and KV90_TILE_BOX exclude each other");

namespace pw90kv {

constexpr int BN = 64;           // keys per tile
constexpr int CHUNK = 16;        // keys per consumer warp and per TMA box
constexpr int CHUNKS = BN / CHUNK;  // 16-key chunks (TMA boxes) per tile
constexpr int BM = 16;           // packed query rows per block
constexpr int BOX_BYTES = CHUNK * 128;  // 16 rows x 64 16-bit columns

// TAB (the rotary forms with KV90_ROT_STAGE): each stage also holds, per chunk, up to 16
// rows of the cos table then 16 of the sin table (float32, D / 2 each), and the straddling
// chunk's K2 slot has such a pair of its own.
template <int D, int STAGES, bool TAB = false> struct Smem {
  static constexpr int panels = D / 64;
  static constexpr int chunk_bytes = panels * BOX_BYTES;  // one 16-key chunk of K or V
  static constexpr int tab_bytes = CHUNK * (D / 2) * 4;   // 16 rows of one table
  static constexpr int tab_chunk_bytes = TAB ? 2 * tab_bytes : 0;  // cos, then sin
  static constexpr int k_off = 0;  // in a stage
  static constexpr int v_off = CHUNKS * chunk_bytes;
  // TAB: chunk c's table rows at t_off + c * tab_chunk_bytes
  static constexpr int t_off = 2 * CHUNKS * chunk_bytes;
  static constexpr int stage_bytes = t_off + CHUNKS * tab_chunk_bytes;
  // K2 of the one chunk of a sequence that straddles d = w: written once, read once, so one
  // slot serves every stage (and TAB its table rows, after it)
  static constexpr int x_off = STAGES * stage_bytes;
  static constexpr int xt_off = x_off + chunk_bytes;
  static constexpr int bars_off = xt_off + tab_chunk_bytes;  // full[STAGES], empty[STAGES]
  static constexpr int q_off = bars_off + 2 * STAGES * 8;  // Q1, Q2: BM rows, padded pitch
  static constexpr int BYTES = q_off + 2 * BM * Pitch<D>::bytes + 1024;
  static_assert(D % 64 == 0, "whole 64-column panels");
  static_assert(stage_bytes % 1024 == 0 && xt_off % 1024 == 0, "swizzled boxes 1024-aligned");
  static_assert(BM * (D + 1) * 4 <= 2 * BM * Pitch<D>::bytes,
                "a cluster's partial rows and lse fit where Q was");
};

// Address of the 16-byte column group `g` (0 .. D/8-1) of row r (0..15) of a chunk at `base`:
// panel g / 8, and inside the panel's 128-byte row the 128-byte swizzle's XOR of g % 8 with
// r % 8.
// PSTRIDE: bytes from one 64-column panel of the chunk to the next (a stage's panel-major
// layout under KV90_TILE_BOX: a tile's 64 rows).
// ROWP > 0 (KV90_ROW_BOX): the chunk is row-major over its ROWP panels instead, 128-byte unit
// u = ROWP r + panel, swizzled by u % 8 (the TMA writes a 5-d box {64, ROWP, rows} in that
// order, and the 128-byte swizzle XORs address bits 4-6 with bits 7-9 of a 1024-byte aligned
// chunk). With one panel (D = 64) it is the default layout.
template <int PSTRIDE = BOX_BYTES, int ROWP = 0>
constexpr PW_DEVICE u32 swz(u32 base, int r, int g) {
  if constexpr (ROWP > 0) {
    const int u = r * ROWP + (g >> 3);
    return base + (u32)(u * 128 + (((g & 7) ^ (u & 7)) << 4));
  } else {
    return base + (u32)((g >> 3) * PSTRIDE + r * 128 + (((g & 7) ^ (r & 7)) << 4));
  }
}

// Page and first row (in the page) of the chunk starting at key n of sequence b.
PW_DEVICE void chunk_place(const KVParams& p, i64 b, int n, int& page, int& row) {
  if (p.block_table == nullptr) {
    page = (int)b;
    row = n;
  } else {
    const int blk = n / (int)p.block_size;
    page = p.block_table[b * p.bt_stride + blk];
    row = n - blk * (int)p.block_size;
  }
}

// Barrier of every thread of every block of the cluster, with release / acquire: shared
// memory written before it is visible to the cluster's blocks after it.
PW_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
}
PW_DEVICE u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The float at the same shared-memory offset as `local` in the cluster's block `rank`.
PW_DEVICE float ld_cluster(const float* local, int rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

}  // namespace pw90kv

// The kernels' body (pw90_kvdecode, pw90_kvdecode_rot below): the tensor maps are the
// kernels' __grid_constant__ parameters, passed by reference.
// TAB: the rotary forms' table rows staged by the producer (KV90_ROT_STAGE above).
// tk1w, tk2w, tvw: the maps of 64-row boxes (KV90_TILE_BOX; the others pass tk1, tk2, tv).
// TB: the tile-box form (KV90_TILE_BOX above, or the paged entry pw90_kvdecode_pages).
template <typename T, int D, int STAGES, int CLUSTER, int CW, int ROT, bool TAB,
          bool TB = (KV90_TILE_BOX != 0)>
PW_DEVICE void pw90_kvdecode_body(const pw90::TmaDesc& tk1, const pw90::TmaDesc& tk2,
                                  const pw90::TmaDesc& tv, const pw90::TmaDesc& tk1w,
                                  const pw90::TmaDesc& tk2w, const pw90::TmaDesc& tvw,
                                  const KVParams& p) {
  using namespace pw90kv;
  static_assert(!TAB || ROT != 0, "only the rotary forms read tables");
  using Sm = Smem<D, STAGES, TAB>;
  // KV90_TILE_BOX (plain forms): whole-tile boxes where a tile lies in one page, and the
  // stage's K and V panel-major: PS from a panel to the next, COFF from a chunk to the next
  constexpr bool TILE_BOX = TB && ROT == 0;
  constexpr int PS = TILE_BOX ? BN * 128 : BOX_BYTES;
  constexpr int COFF = TILE_BOX ? BOX_BYTES : Sm::chunk_bytes;
  static_assert(CW == CHUNKS, "a consumer warp per 16-key chunk of a tile");
  static_assert(CW * BM * (D + 2) * 4 <= STAGES * Sm::stage_bytes,
                "the warps' merge scratch fits in the ring");
  constexpr int PANELS = D / 64;
  // KV90_ROW_BOX (plain forms, D >= 128; mode 2 only without a cluster): one box of whole
  // rows per chunk; RP the swizzle's row-major form (swz), 0 for the panel-major layout. The
  // host builds the maps by the same rule (kvcache_launch.kv90_row_box).
  constexpr bool ROW_BOX = ROT == 0 && PANELS > 1 && !TILE_BOX &&
                           (KV90_ROW_BOX == 1 || (KV90_ROW_BOX == 2 && CLUSTER == 1));
  constexpr int RP = ROW_BOX ? PANELS : 0;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // the 128-byte swizzle repeats every 1024 bytes: boxes start 1024-byte aligned
  const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - smem_addr(smem_raw));
  const u32 bars = base + Sm::bars_off;
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (STAGES + s); };

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const i64 b = blockIdx.z, split = blockIdx.y;
  const i64 G = p.group, rows = G;  // M = 1: one packed row per head of the group
  const i64 rtiles = (rows + BM - 1) / BM;
  const i64 hk = blockIdx.x / rtiles, row0 = (blockIdx.x % rtiles) * BM;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      pw90::mbar_init(full(s), 1);
      pw90::mbar_init(empty(s), CW);  // every consumer warp reads a chunk of every stage
    }
    pw90::mbar_init_fence();
  }
  if (warp == CW && lane == 0) {  // the descriptors are kernel parameters
    pw90::tma_prefetch_desc(&tk1);
    pw90::tma_prefetch_desc(&tk2);
    pw90::tma_prefetch_desc(&tv);
    if constexpr (TILE_BOX) {
      pw90::tma_prefetch_desc(&tk1w);
      pw90::tma_prefetch_desc(&tk2w);
      pw90::tma_prefetch_desc(&tvw);
    }
  }
  __syncthreads();
  // Programmatic dependent launch (common.cuh). When pw_forward_combine merges the splits,
  // it may start now: it waits for this grid's completion before reading the partials.
  // Nothing else is triggered early: when the next kernel is the next step's decode, its
  // blocks would start beside these ones and wait, which timed 16% slower with splits in
  // clusters on an H200 (bench/NOTES.md); without the trigger it may start as this grid's
  // blocks exit. And this grid may itself have started before the kernel ahead
  // of it on the stream completed (that kernel may have written the lengths, the queries
  // or the caches: the append kernel does): everything above touches only shared memory
  // and the parameters; every global read and write comes after the wait.
  if constexpr (CLUSTER == 1) {
    if (p.nsplit > 1) grid_launch_dependents();
  }
  grid_dependency_wait();

  const int L = kv_length(p, b);
  const int P = L - 1;  // the token's position; d(n) = P - n
  // keys n < nfar are at distance >= w (K2); the others use K1
  const int nfar = (int)clamp64((i64)P - p.w + 1, 0, L);

  const int ntiles_all = (L + BN - 1) / BN;
  // tiles t_begin, t_begin + t_step, ... below t_end (strided for the rotary forms)
  constexpr bool STRIDE = KV90_SPLIT_STRIDE == 1 || (KV90_SPLIT_STRIDE == 2 && ROT != 0);
  const KvSplitTiles<STRIDE> range(ntiles_all, split, p.nsplit);
  const int t_begin = range.t_begin, t_end = range.t_end, t_step = range.t_step;

  if (warp == CW) {  // ------------------------------------------------ producer
    // lane c < CHUNKS loads chunk c of each tile; its page is looked up a tile ahead
    // (TILE_BOX: lane 0 loads a whole tile where the tile lies in one page: its chunk 0's
    // page and row are the tile's; with KV90_TILE_BOX=2 only at D = 128 or from pages, and
    // so in pw90_kvdecode_pages at D = 64 only from pages; the host builds the 64-row maps
    // by the same rule, kvcache_launch.kv90_tile_box)
    const bool wide_ok =
        TILE_BOX && (KV90_TILE_BOX == 1 || D == 128 || p.block_table != nullptr) &&
        (p.block_table == nullptr ? p.capacity >= BN : p.block_size % BN == 0);
    int page = 0, prow = 0;
    if (lane < CHUNKS && t_begin < t_end && t_begin * BN + lane * CHUNK < L)
      chunk_place(p, b, t_begin * BN + lane * CHUNK, page, prow);
    for (int tile = t_begin; tile < t_end; tile += t_step) {
      const int i = (tile - t_begin) / t_step, s = i % STAGES;
      const int n = tile * BN + lane * CHUNK;
      const bool load = lane < CHUNKS && n < L;
      const bool both = load && n < nfar && n + CHUNK > nfar;  // straddles d = w
      u32 bytes = (load ? 2u : 0u) * Sm::chunk_bytes + (both ? Sm::chunk_bytes : 0u);
      // TAB: the table rows of the chunk's keys (group gk: K2's for chunks wholly at d >= w,
      // else K1's) and of the straddling chunk's K2 (group g2), rows n / g .. last / g
      // TILE_BOX: a tile wholly at d >= w (K2) or wholly at d < w (K1) in whole-tile boxes;
      // their bytes are the stage's, rows past the length or the cache included (TMA fills
      // rows past the cache with zeros; the consumers skip or mask the rows past L)
      const int tn0 = tile * BN;
      const bool wide = wide_ok && (tn0 + BN <= nfar || tn0 >= nfar);
      const int last = min(n + CHUNK, L) - 1;
      const int gk =
          TAB && load ? (n + CHUNK <= nfar ? (int)p.rot_group2 : (int)p.rot_group1) : 0;
      const int gx = TAB && both ? (int)p.rot_group2 : 0;
      const u32 tab_k = gk ? (u32)(last / gk - n / gk + 1) * (D / 2) * 4u : 0u;
      const u32 tab_x = gx ? (u32)(last / gx - n / gx + 1) * (D / 2) * 4u : 0u;
      bytes += 2u * (tab_k + tab_x);
      const u32 total = wide ? 2u * CHUNKS * Sm::chunk_bytes
                             : __reduce_add_sync(0xffffffffu, bytes);
      pw90::mbar_wait(empty(s), ((i / STAGES) & 1) ^ 1);  // fresh barriers pass at once
      if (lane == 0) pw90::mbar_expect_tx(full(s), total);
      __syncwarp();
      if (wide) {
        if (lane == 0) {
          const u32 st = base + (u32)(s * Sm::stage_bytes);
          const pw90::TmaDesc* kmap = tn0 + BN <= nfar ? &tk2w : &tk1w;
#pragma unroll
          for (int j = 0; j < PANELS; ++j) {
            pw90::tma_load_4d(st + Sm::k_off + j * PS, kmap, j * 64, prow, (int)hk, page, full(s));
            pw90::tma_load_4d(st + Sm::v_off + j * PS, &tvw, j * 64, prow, (int)hk, page, full(s));
          }
        }
      } else if (load) {
        const u32 st = base + (u32)(s * Sm::stage_bytes);
        const u32 kdst = st + Sm::k_off + lane * COFF;
        const u32 vdst = st + Sm::v_off + lane * COFF;
        const pw90::TmaDesc* kmap = n < nfar && !both ? &tk2 : &tk1;
        if constexpr (ROW_BOX) {  // whole rows: the maps are 5-d (kvcache_launch)
          pw90::tma_load_5d(kdst, kmap, 0, 0, prow, (int)hk, page, full(s));
          pw90::tma_load_5d(vdst, &tv, 0, 0, prow, (int)hk, page, full(s));
          if (both)
            pw90::tma_load_5d(base + Sm::x_off, &tk2, 0, 0, prow, (int)hk, page, full(s));
        } else {
#pragma unroll
          for (int j = 0; j < PANELS; ++j) {
            pw90::tma_load_4d(kdst + j * PS, kmap, j * 64, prow, (int)hk, page, full(s));
            pw90::tma_load_4d(vdst + j * PS, &tv, j * 64, prow, (int)hk, page, full(s));
            if (both)
              pw90::tma_load_4d(base + Sm::x_off + j * BOX_BYTES, &tk2, j * 64, prow, (int)hk,
                                page, full(s));
          }
        }
        if constexpr (TAB) {
          if (gk) {
            const u32 tdst = st + Sm::t_off + lane * Sm::tab_chunk_bytes;
            const i64 row = (i64)(n / gk) * (D / 2);
            pw90::bulk_load(tdst, p.rot_cos + row, tab_k, full(s));
            pw90::bulk_load(tdst + Sm::tab_bytes, p.rot_sin + row, tab_k, full(s));
          }
          if (gx) {
            const i64 row = (i64)(n / gx) * (D / 2);
            pw90::bulk_load(base + Sm::xt_off, p.rot_cos + row, tab_x, full(s));
            pw90::bulk_load(base + Sm::xt_off + Sm::tab_bytes, p.rot_sin + row, tab_x, full(s));
          }
        }
      }
      const int nn = n + t_step * BN;  // the next tile's chunk
      if (lane < CHUNKS && tile + t_step < t_end && nn < L) chunk_place(p, b, nn, page, prow);
    }
    __syncwarp();
    if constexpr (CLUSTER > 1) {  // the producer warp takes part in the cluster's barriers
      cluster_sync();
      cluster_sync();
    }
    return;  // the consumers' last waits cover every load issued
  }

  // ------------------------------------------------------------------------ consumers
  // Q1 and Q2 of the block's 16 packed rows (row r: head hk * G + row0 + r; padding rows
  // zero) into padded shared tiles, read as A fragments by ldmatrix at every chunk.
  constexpr int CPR = D / 8;  // 16-byte chunks per row
  const u32 sq1 = base + Sm::q_off, sq2 = sq1 + BM * Pitch<D>::bytes;
  for (int idx = threadIdx.x; idx < BM * CPR; idx += CW * 32) {
    const int r = idx / CPR, ch = idx % CPR;
    const i64 gr = row0 + r;
    uint4 x1 = make_uint4(0, 0, 0, 0), x2 = x1;
    if (gr < rows) {
      x1 = *reinterpret_cast<const uint4*>(p.q1.at(b, hk * G + gr) + ch * 8);
      x2 = *reinterpret_cast<const uint4*>(p.q2.at(b, hk * G + gr) + ch * 8);
    }
    const u32 off = (u32)(r * Pitch<D>::bytes + ch * 16);
    *reinterpret_cast<uint4*>(smem + (sq1 + off - base)) = x1;
    *reinterpret_cast<uint4*>(smem + (sq2 + off - base)) = x2;
  }
  asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory");

  float acc[D / 8][4];
  zero_n<D / 2>(&acc[0][0]);
  float row_max[2] = {PW_NEG_INF, PW_NEG_INF}, row_sum[2] = {0.f, 0.f};

  // Warp w takes chunk w (16 keys) of every tile. (A warp per whole tile, four independent
  // chunk products per k step, measured slower on an H200: 0.84-0.86x cuDNN at D = 128
  // against 0.95-0.98x; bench/NOTES.md.)
  const int kr = (lane % 8) + (lane / 16) * 8, kg = (lane / 8) % 2;  // K fragment rows, cols
  const int vr = (lane % 8) + ((lane / 8) % 2) * 8, vg = lane / 16;  // V (transposed)
  // ROT: the group size of this warp's chunk at n0 (K2's for chunks wholly at d >= w)
  auto chunk_group = [&](int n0) {
    return n0 + CHUNK <= nfar ? (int)p.rot_group2 : (int)p.rot_group1;
  };
  constexpr bool AHEAD =
      ROT != 0 && !TAB && (KV90_ROT_AHEAD == 2 || (KV90_ROT_AHEAD == 1 && D <= 64));
  KvRotAhead<T, D, ROT == 0 ? 1 : ROT> ahead;  // AHEAD: the next chunk's table entries
  if constexpr (AHEAD) {
    const int n0 = t_begin * BN + warp * CHUNK;
    if (t_begin < t_end && n0 < L) ahead.load(p, n0, L, chunk_group(n0), lane);
  }
  for (int tile = t_begin; tile < t_end; tile += t_step) {
    const int i = (tile - t_begin) / t_step, s = i % STAGES;
    const int n0 = tile * BN + warp * CHUNK;  // this warp's 16 keys
    pw90::mbar_wait(full(s), (i / STAGES) & 1);
    if (n0 < L) {  // chunks past the length were not loaded
      const u32 st = base + (u32)(s * Sm::stage_bytes);
      const u32 sk = st + Sm::k_off + warp * COFF;
      const u32 sv = st + Sm::v_off + warp * COFF;
      const bool both = n0 < nfar && n0 + CHUNK > nfar;  // straddles d = w: K2 in the x slot
      const bool far_only = n0 + CHUNK <= nfar;
      bool wrote = false;  // ROT: rows of a stage rewritten (generic proxy) by this warp
      if constexpr (ROT != 0) {  // raw keys (kvparams.cuh): rotate the rows this warp reads
        auto at = [&](u32 chunk) {  // 16-byte group g of row r of a swizzled chunk
          return [&, chunk](int r, int g) {
            return reinterpret_cast<u16*>(smem + (swz(chunk, r, g) - base));
          };
        };
        // a group of 0 leaves the keys raw (ReRoPE's K2): nothing to rotate, sync or fence
        const int g2 = (int)p.rot_group2, gk = chunk_group(n0);  // K2 or K1
        if constexpr (TAB) {  // the rows the producer staged with this chunk
          const float* tc = reinterpret_cast<const float*>(
              smem + (st + Sm::t_off + warp * Sm::tab_chunk_bytes - base));
          if (gk != 0)
            kv_rotate_rows_staged<T, D, ROT>(at(sk), n0, L, gk, tc, tc + CHUNK * D / 2, lane);
        } else if constexpr (AHEAD) {
          ahead.apply(at(sk), n0, L, gk, lane);  // loaded for this chunk (group gk)
          const int nn = n0 + t_step * BN;  // the next chunk's entries, in flight meanwhile
          ahead.load(p, nn, L, tile + t_step < t_end && nn < L ? chunk_group(nn) : 0, lane);
        } else if (gk != 0) {
          kv_rotate_rows<T, D, ROT, 2>(at(sk), n0, L, p, lane, [&](int) { return gk; });
        }
        if (both && g2 != 0) {  // the straddling chunk's K2 (once per sequence)
          if constexpr (TAB) {
            const float* tx = reinterpret_cast<const float*>(smem + (Sm::xt_off));
            kv_rotate_rows_staged<T, D, ROT>(at(base + Sm::x_off), n0, L, g2, tx,
                                             tx + CHUNK * D / 2, lane);
          } else {
            kv_rotate_rows<T, D, ROT, 2>(at(base + Sm::x_off), n0, L, p, lane,
                                         [&](int) { return g2; });
          }
        }
        wrote = gk != 0 || (both && g2 != 0);
        if (wrote) __syncwarp();
      }
      float sc[2][4];
      zero_n<8>(&sc[0][0]);
      if (both) {
        float s2[2][4];
        zero_n<8>(&s2[0][0]);
#pragma unroll
        for (int k = 0; k < D / 16; ++k) {
          u32 a1[1][4], a2[1][4], bk[4], bx[4];
          load_a<D, 1>(a1, sq1, k, lane);
          load_a<D, 1>(a2, sq2, k, lane);
          ldsm_x4(bk, swz<PS, RP>(sk, kr, 2 * k + kg));
          ldsm_x4(bx, swz<BOX_BYTES, RP>(base + Sm::x_off, kr, 2 * k + kg));
          Elem<T>::mma(sc[0], a1[0], bk[0], bk[1]);
          Elem<T>::mma(sc[1], a1[0], bk[2], bk[3]);
          Elem<T>::mma(s2[0], a2[0], bx[0], bx[1]);
          Elem<T>::mma(s2[1], a2[0], bx[2], bx[3]);
        }
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (n0 + frag_col(nb, e, lane) < nfar) sc[nb][e] = s2[nb][e];
      } else {
        const u32 sq = far_only ? sq2 : sq1;
#pragma unroll
        for (int k = 0; k < D / 16; ++k) {
          u32 a[1][4], bk[4];
          load_a<D, 1>(a, sq, k, lane);
          ldsm_x4(bk, swz<PS, RP>(sk, kr, 2 * k + kg));
          Elem<T>::mma(sc[0], a[0], bk[0], bk[1]);
          Elem<T>::mma(sc[1], a[0], bk[2], bk[3]);
        }
      }
      const bool tail = n0 + CHUNK > L;
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = sc[nb][e] * p.scale_log2;
          if (tail && n0 + frag_col(nb, e, lane) >= L) x = PW_NEG_INF;
          sc[nb][e] = x;
        }
      kv_softmax<2, D>(sc, row_max, row_sum, acc);
      if (tail) {  // V rows past the length: zeros instead of whatever the cache holds
        for (int idx = lane; idx < CHUNK * PANELS * 8; idx += 32) {
          const int r = idx / (PANELS * 8), g = idx % (PANELS * 8);
          if (n0 + r >= L)
            *reinterpret_cast<uint4*>(smem + (swz<PS, RP>(sv, r, g) - base)) =
                make_uint4(0, 0, 0, 0);
        }
        __syncwarp();
      }
      // O += P · V: P (16 rows x 16 keys) as the A fragment, V read transposed
      u32 pa[4];
      pa[0] = Elem<T>::pack(sc[0][0], sc[0][1]);
      pa[1] = Elem<T>::pack(sc[0][2], sc[0][3]);
      pa[2] = Elem<T>::pack(sc[1][0], sc[1][1]);
      pa[3] = Elem<T>::pack(sc[1][2], sc[1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        u32 bv[4];
        ldsm_x4_trans(bv, swz<PS, RP>(sv, vr, 2 * dp + vg));
        Elem<T>::mma(acc[2 * dp], pa, bv[0], bv[1]);
        Elem<T>::mma(acc[2 * dp + 1], pa, bv[2], bv[3]);
      }
      // the zeros above (and ROT's rotated rows) were generic-proxy writes into a stage TMA
      // will refill
      if (tail || wrote) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncwarp();
    if (lane == 0) pw90::mbar_arrive(empty(s));
  }

  // every consumer is past its last tile: the ring is free for the merge
  asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory");
  auto consumers_sync = [] { asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory"); };
  if constexpr (CLUSTER == 1) {
    kv_merge_warps<D, BM, CW>(reinterpret_cast<float*>(smem), threadIdx.x, rows - row0, acc,
                                 row_max, row_sum, consumers_sync,
                                 KvStoreGlobal<T, D>{p, b, split, hk, row0});
  } else {
    // This block's normalised rows and lse into the Q tiles' space (Q is read no more),
    // then the cluster's blocks (one per split) merge them: rank j reads every block's
    // rows through distributed shared memory and writes its share of o and lse.
    float* sPo = reinterpret_cast<float*>(smem + Sm::q_off);  // [BM][D]
    float* sPl = sPo + BM * D;                                // [BM]
    kv_merge_warps<D, BM, CW>(reinterpret_cast<float*>(smem), threadIdx.x, rows - row0, acc,
                                 row_max, row_sum, consumers_sync,
                                 [&](int r, int c, float o, float lse) {
                                   sPo[r * D + c] = o;
                                   if (c == 0) sPl[r] = lse;
                                 });
    cluster_sync();  // every block's partial rows are written and visible cluster-wide
    const int nvalid = (int)min((i64)BM, rows - row0);
    const int rank = (int)cluster_rank();
    for (int idx = rank * CW * 32 + threadIdx.x; idx < nvalid * D; idx += CLUSTER * CW * 32) {
      const int r = idx / D, c = idx % D;
      float lj[CLUSTER], mx = PW_NEG_INF;
#pragma unroll
      for (int j = 0; j < CLUSTER; ++j) {
        lj[j] = ld_cluster(sPl + r, j) * PW_LOG2E;
        mx = fmaxf(mx, lj[j]);
      }
      float l = 0.f, o = 0.f;
      if (mx != PW_NEG_INF) {
#pragma unroll
        for (int j = 0; j < CLUSTER; ++j) {
          const float f = fast_exp2(lj[j] - mx);
          l += f;
          o += f * ld_cluster(sPo + r * D + c, j);
        }
      }
      const i64 h = hk * G + row0 + r;
      p.o.mut(b, h)[c] = Elem<T>::from_float(l > 0.f ? o / l : 0.f);
      if (c == 0 && p.lse) p.lse[b * p.H + h] = l > 0.f ? (mx + __log2f(l)) * PW_LN2 : PW_NEG_INF;
    }
    cluster_sync();  // no block leaves while another still reads its shared memory
  }
}

#if KV90_TILE_BOX
// three more maps, of 64-row boxes (KV90_TILE_BOX above); the host passes six
template <typename T, int D, int STAGES, int CLUSTER, int CW>
__global__ void __cluster_dims__(1, CLUSTER, 1) __launch_bounds__((CW + 1) * 32)
    pw90_kvdecode(const __grid_constant__ pw90::TmaDesc tk1, const __grid_constant__ pw90::TmaDesc tk2,
                  const __grid_constant__ pw90::TmaDesc tv,
                  const __grid_constant__ pw90::TmaDesc tk1w,
                  const __grid_constant__ pw90::TmaDesc tk2w,
                  const __grid_constant__ pw90::TmaDesc tvw, const KVParams p) {
  pw90_kvdecode_body<T, D, STAGES, CLUSTER, CW, 0, false>(tk1, tk2, tv, tk1w, tk2w, tvw, p);
}
#else
template <typename T, int D, int STAGES, int CLUSTER, int CW>
__global__ void __cluster_dims__(1, CLUSTER, 1) __launch_bounds__((CW + 1) * 32)
    pw90_kvdecode(const __grid_constant__ pw90::TmaDesc tk1, const __grid_constant__ pw90::TmaDesc tk2,
                  const __grid_constant__ pw90::TmaDesc tv, const KVParams p) {
  pw90_kvdecode_body<T, D, STAGES, CLUSTER, CW, 0, false>(tk1, tk2, tv, tk1, tk2, tv, p);
}
#endif

// The paged plain decode at D = 64 (kvcache_launch.page_box; compile.Variant.page_box): the
// tile-box form without the macro, six maps (the last three of 64-row boxes, one page per
// box), whole tiles loaded from pages only (wide_ok). Its body is, PTX for PTX, the D = 64
// kernel of the KV90_TILE_BOX=2 build, timed, tested and sanitized on paged and contiguous
// caches (bench/results/2026-12-07-h100-paged-d64-entry); the contiguous D = 64 decode keeps
// pw90_kvdecode, where the tile-box form ran 2-4% slower on the eight-split N = 4096 row.
// KV90_PAGE_BOX (1; host mirror capability.KV90_PAGE_BOX): 0 builds no such entry and the
// host sends those caches to pw90_kvdecode (an A/B build).
#ifndef KV90_PAGE_BOX
#define KV90_PAGE_BOX 1
#endif
#if KV90_PAGE_BOX
template <typename T, int D, int STAGES, int CLUSTER, int CW>
__global__ void __cluster_dims__(1, CLUSTER, 1) __launch_bounds__((CW + 1) * 32)
    pw90_kvdecode_pages(const __grid_constant__ pw90::TmaDesc tk1,
                        const __grid_constant__ pw90::TmaDesc tk2,
                        const __grid_constant__ pw90::TmaDesc tv,
                        const __grid_constant__ pw90::TmaDesc tk1w,
                        const __grid_constant__ pw90::TmaDesc tk2w,
                        const __grid_constant__ pw90::TmaDesc tvw, const KVParams p) {
  static_assert(D == 64, "the paged entry is D = 64's (D = 128 keeps its row boxes)");
  pw90_kvdecode_body<T, D, STAGES, CLUSTER, CW, 0, false, true>(tk1, tk2, tv, tk1w, tk2w, tvw, p);
}
#endif

// The rotary forms (ROT 1: halves, 2: interleaved pairs), a kernel of their own for their
// register cap: with the table entries held a chunk ahead at D = 128 (KV90_ROT_AHEAD=2:
// 64 registers per lane) ptxas took 214 registers, which fits one block per SM; 200 keeps
// the two that shared memory allows (65536 / (2 x 160 threads) = 204, in steps of 8) without
// spills. (__launch_bounds__ with 2 blocks per SM capped it at 168 and spilled about 100
// bytes; __maxnreg__ and __launch_bounds__ exclude each other.) The default forms use
// 128-165 registers under the cap, and were timed under it.
#ifndef KV90_ROT_MAXNREG
#define KV90_ROT_MAXNREG 200
#endif
// __maxnreg__ came with CUDA 12.4; older NVRTC builds the rotary forms with the plain bounds
// (the default forms fit them: 128-165 registers)
#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
#define KV90_ROT_BOUNDS(threads) __maxnreg__(KV90_ROT_MAXNREG)
#else
#define KV90_ROT_BOUNDS(threads) __launch_bounds__(threads)
#endif
// TAB: the staged table rows (KV90_ROT_STAGE, its default), chosen per shape by the host.
template <typename T, int D, int STAGES, int CLUSTER, int CW, int ROT,
          bool TAB = (KV90_ROT_STAGE != 0)>
__global__ void __cluster_dims__(1, CLUSTER, 1) KV90_ROT_BOUNDS((CW + 1) * 32)
    pw90_kvdecode_rot(const __grid_constant__ pw90::TmaDesc tk1,
                      const __grid_constant__ pw90::TmaDesc tk2,
                      const __grid_constant__ pw90::TmaDesc tv, const KVParams p) {
  static_assert(ROT == 1 || ROT == 2, "rotary forms only");
  pw90_kvdecode_body<T, D, STAGES, CLUSTER, CW, ROT, TAB>(tk1, tk2, tv, tk1, tk2, tv, p);
}
