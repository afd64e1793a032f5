// Piecewise-attention forward for Hopper (sm_90a): TMA + mbarrier pipeline, wgmma, warp
// specialisation.
//
// A CTA works on (query tile, head, batch) work tiles (one, or several in the persistent
// grid: PW90_PERSIST below) of BM query rows: at D = 64, BM = 192 and 512 threads = 4
// warpgroups; at D = 128 and 256, BM = 128 and 384 threads = 3 warpgroups (FwdCfg, FwdWarps):
//   warpgroup 0  producer: one thread issues the TMA loads (128-byte swizzle) of Q1 and Q2 once
//                and, per key tile, only the key projections the tile needs (near-only tiles
//                K1, far-only K2, straddling tiles K1 and K2) into a ring of K slots, and V
//                into a ring of V slots, each slot guarded by full/empty mbarriers; causally
//                empty key tiles are never visited. setmaxnreg.dec to 40 registers (24
//                with PW90_CONSUMER_REGS=240 or three consumers).
//   warpgroups 1.. consumers, 64 query rows each (two at 232 registers by setmaxnreg.inc;
//                three at 160 at D = 64, FwdWarps): S = Q·Kᵀ with
//                wgmma m64nBNk16 (both operands shared-memory descriptors), on straddling
//                tiles both products (the second in parts of at most 64 keys) and a
//                per-element select, masking only on edge/diagonal tiles, online softmax in
//                the log2 domain (sm_scale*log2 e folded into one FFMA before ex2), P packed
//                to 16-bit in registers as the A operand of O += P·V (wgmma m64nDk16, V read
//                MN-major through imm-trans-b = 1). At D = 128 and 256 the O += P·V product of
//                tile t-1 is issued with S = Q·Kᵀ of tile t, so the softmax of t overlaps it
//                (PW90_OVERLAP); at D = 64 each tile's P·V is issued after its own softmax
//                and waited for in its tile (PW90_FWD_SERIAL64), the third warpgroup
//                supplying the overlap.
//                Epilogue: O / l stored directly to global memory, lse (natural log, float32).
//
// Shared memory: Q1, Q2 (2 x BM x D x 2 bytes), then KSLOTS K slots and VSLOTS V slots of
// BN x D x 2 bytes. A tile takes one K slot, a straddling one two (K1 and K2), so a K ring
// of 3 slots keeps a straddling tile and the next one in flight; the V ring of 2 holds V of
// tile t-1 (read by P·V) while V of tile t loads.
//   D = 64,  BM = 192, BN = 128, 4 + 2 slots of 16 KB: 48 KB + 96 KB = 144 KB
//   D = 128, BN = 128, 3 + 2 slots of 32 KB: 64 KB + 160 KB = 224 KB
//   D = 256, BN = 32,  4 + 2 slots of 16 KB: 128 KB + 96 KB = 224 KB
// plus the mbarriers and 1 KB to align the base to 1024 bytes. (Before the rings, each of
// two stages held K1, K2 and V whatever the tile needed: BN = 96 at D = 128, 208 KB.)
// Every tile is stored as D/64 panels of rows x 128 bytes (the TMA box is 64 elements wide
// because the 128-byte swizzle limits the inner box extent to 128 bytes).
#include "sm90/hopper.cuh"
#include "sm90/wgmma.cuh"

#ifndef PW90_PV_SPLIT
#define PW90_PV_SPLIT 0
#endif
// Compile-time variants of the consumer loop (A/B-tested by scripts/hopper_probe.py):
//   PW90_OVERLAP=1   (default) S_t is committed before P_{t-1}·V_{t-1}, the softmax of tile
//                    t starts after wgmma.wait_group 1 (S_t done) while the P·V product still
//                    runs; O is rescaled after wait_group 0. =0: both products are waited
//                    for before the softmax. (Against the plain loop, since removed, which
//                    issued P·V after the softmax: -3% to +9% per cell,
//                    bench/results/2026-11-30-h200-hopper-variants.)
//   PW90_PINGPONG=1  the two consumer warpgroups take turns issuing their GEMMs (named
//                    barriers 1 and 2, 256 threads), so one's softmax overlaps the other's GEMMs
//                    (two consumer warpgroups at every head dim: needs -DPW90_BM64=128 and
//                    -DPW90_PERSIST=0)
#ifndef PW90_OVERLAP
#define PW90_OVERLAP 1
#endif
#ifndef PW90_PINGPONG
#define PW90_PINGPONG 0
#endif
//   PW90_PERSIST=1   (default) persistent grid for dense batches: gridDim.x CTAs (the
//                    launcher: at most one per SM) walk the work tiles with stride gridDim.x;
//                    the producer loads the next tile's Q (once the consumers have issued
//                    their last S = Q·Kᵀ) and first K/V tiles while the consumers finish the
//                    last P·V and the epilogue of the current one. Non-causal: the (query
//                    tile, head, batch) work tiles. Causal, where FwdCfg<D>::PAIRS: units of
//                    two query tiles of one head, tile nmt-1-u (the longer) then tile u, whose
//                    key tiles add up to the same count for every u, so that a static stride
//                    stays balanced (a stride over single tiles lost 2-13% to the tail on an
//                    H200; a dynamic scheduler in the hardware's order was no faster than
//                    pairs: bench/NOTES.md). Other causal batches, and packed ones, take one
//                    CTA per work tile, balanced by the hardware's block scheduler.
#ifndef PW90_PERSIST
#define PW90_PERSIST 1
#endif
// Ping-pong counts arrivals on two named barriers per key tile. Across the work tiles of a
// persistent CTA, warpgroup 1 can arrive on barrier 1 for its next work tile before warpgroup 0
// has synced on it for the current one; two arrivals of warpgroup 1 then complete the barrier
// without warpgroup 0 (the probe hung on a causal case with empty work tiles).
#if PW90_PINGPONG && PW90_PERSIST
#error "PW90_PINGPONG needs -DPW90_PERSIST=0 (named-barrier arrivals can cross work tiles)"
#endif
// Tile-shape knobs for A/B runs (scripts/hopper_probe.py --variants); the host's figures
// (capability.HOPPER_BLOCK_M, HOPPER_BLOCK_N, HOPPER_FWD_SLOTS) follow the defaults, so the
// package itself always runs the default build. Key rows per tile and K slots at D = 128
// (80, 96): -DPW90_BN128=96 -DPW90_KSLOTS128=4 is the tile and memory of the two-stage layout the
// rings replaced (slower than the default in 7 of 8 same-run probe cells on an H200, and
// the two-stage kernel itself in 3 of 4; bench/NOTES.md).
#ifndef PW90_BN128
#define PW90_BN128 128
#endif
#ifndef PW90_KSLOTS128
#define PW90_KSLOTS128 3
#endif
// Query rows per CTA at D = 64 (the host's capability.HOPPER_BLOCK_M[64]): 192 (default)
// runs three consumer warpgroups of 64 rows (160 registers each, 512 threads), so each K/V
// tile feeds 192 rows, as FlashAttention-3 does at head dim 64 (bench/NOTES.md: the D = 64
// forward is latency-bound with two). In the pipelined loop 128-key tiles then spill (192
// bytes with the 32-key parts below; 448 with 64-key parts) and ptxas serialises their wgmma
// (-DPW90_BN64=96 or 64 avoid both, and timed -5% to +4% against BM = 128: bench/results/
// 2026-12-01-h200-fwd-bm192); the serial loop (PW90_FWD_SERIAL64, on by default with 192)
// holds no P across a product and builds clean. -DPW90_BM64=128 is the previous default (two
// consumer warpgroups, pipelined loop), kept for A/B runs.
#ifndef PW90_BM64
#define PW90_BM64 192
#endif
// Key rows per tile at D = 64: 192 (three 64-key parts on straddling tiles) was timed with
// -DPW90_BM64=128 and needs -DPW90_CONSUMER_REGS=240 there (else spills and serialised
// wgmma); within the probe's noise of that build on an H200.
#ifndef PW90_BN64
#define PW90_BN64 128
#endif
// K slots at D = 64. The rings cost D = 64 2-4% against the two-stage layout, whose K depth
// was two tiles (bench/NOTES.md); 2 and 3 timed within -2.7% to +1.3% of 4 on an H200 (with
// BM = 128).
#ifndef PW90_KSLOTS64
#define PW90_KSLOTS64 4
#endif
// Causal batches in the persistent grid over pairs of query tiles (PW90_PERSIST), per head
// dim (the host's capability.HOPPER_CAUSAL_PAIRS). On an H200, against one CTA per tile in
// the same runs: D = 128 faster in every causal cell (L 2048 and 8192); D = 64 faster at
// L = 2048 but 5-7% slower at 8192 (a dynamic scheduler lost there too; both timed with
// BM = 128 at D = 64), so it keeps one CTA per tile (bench/NOTES.md).
#ifndef PW90_PAIRS64
#define PW90_PAIRS64 0
#endif
#ifndef PW90_PAIRS128
#define PW90_PAIRS128 1
#endif
// Serial consumer loop (PW90_FWD_SERIAL: every head dim, an experiment; PW90_FWD_SERIAL64:
// D = 64 only, the default there with BM = 192): each tile's P·V is issued right after its
// own softmax and waited for before the next tile's S = Q·Kᵀ, so no P of a previous tile is
// held across a product (32 registers at BN = 128). The overlap then comes only from the
// other consumer warpgroups. With three consumer warpgroups at 160 registers it builds clean
// with 128-key tiles, and on an H200 ran the D = 64 forward 1.07-1.15x faster than BM = 128
// with the pipelined loop (same-call probe, 3 rounds, L 2048-16384, causal or not:
// bench/results/2026-12-02-h200-fwd-d64-three-warpgroups/probe_ab.txt). At D = 128 (BM 128)
// serial is 0.91-1.00x of the pipelined loop.
#ifndef PW90_FWD_SERIAL
#define PW90_FWD_SERIAL 0
#endif
#ifndef PW90_FWD_SERIAL64
#define PW90_FWD_SERIAL64 (PW90_BM64 == 192)
#endif
#if (PW90_FWD_SERIAL || PW90_FWD_SERIAL64) && PW90_PINGPONG
#error "PW90_FWD_SERIAL has no P·V of the previous tile to ping-pong (PINGPONG: -DPW90_BM64=128)"
#endif

namespace pw90 {

// Kernel arguments besides the five tensor maps (8-byte fields, two floats, 8-byte fields):
// host side cupy_piecewise/launch.py _HOPPER_PARAMS (and scripts/hopper_probe.py).
struct FwdParams {
  u16* o;                // (B, H, M, D) output, unit stride along D
  i64 o_sb, o_sh, o_sr;  // its batch / head / row strides in elements
  float* lse;            // (B, H, M) contiguous float32, natural log; null: not stored
  i64 H, group;          // query heads, H / Hkv
  i64 M, N, w;           // lengths (< 2^30) and w clamped to [shift - N, shift + M]
  i64 shift;             // P of d(i, j) = i + P - j: N - M, or within [-M, N] (offsets)
  float scale_log2;      // sm_scale * log2(e)
  float sm_scale;
  i64 batch;             // B: the persistent kernel walks (query tile, head, batch) itself
  // Packed variable-length batch (kernel built with VARLEN; else unused): B + 1 int32
  // running totals of the query and key rows. The tensor maps then describe the packed
  // (total, heads, D) arrays as batch 1, o has batch stride 0, M holds total_q (the row
  // count of lse, (H, total_q)), and each CTA reads its sequence's rows here.
  const int* cu_q;
  const int* cu_k;
};
// The host packer (cupy_piecewise/launch.py _HOPPER_PARAMS) relies on this layout.
static_assert(sizeof(FwdParams) == 120, "FwdParams layout");

// The rows of one CTA's sequence: batch entry b (dense) or packed sequence b (VARLEN). q0/k0
// are its first query/key rows in the arrays the tensor maps describe; tb the batch
// coordinate of those maps; lse0 the index of row 0 of head 0 in lse (head h adds h * lse_h).
struct SeqRows {
  int M, N, P, q0, k0, tb;
  i64 lse0, lse_h;
};

template <bool VARLEN> PW90 SeqRows seq_rows(const FwdParams& p, int b) {
  SeqRows s;
  if constexpr (VARLEN) {
    s.q0 = p.cu_q[b], s.k0 = p.cu_k[b];
    s.M = p.cu_q[b + 1] - s.q0, s.N = p.cu_k[b + 1] - s.k0, s.P = s.N - s.M;
    s.tb = 0, s.lse0 = s.q0, s.lse_h = p.M;
  } else {
    s.M = (int)p.M, s.N = (int)p.N, s.P = (int)p.shift, s.q0 = s.k0 = 0, s.tb = b;
    s.lse0 = (i64)b * p.H * p.M, s.lse_h = p.M;
  }
  return s;
}

#ifndef PW90_CONSUMER_REGS
#define PW90_CONSUMER_REGS 232
#endif

// BM query rows per CTA (64 per consumer warpgroup: the host's capability.HOPPER_BLOCK_M);
// BN key rows per tile; KSLOTS / VSLOTS buffers of BN x D in the K / V rings (the host's
// capability.HOPPER_BLOCK_N, HOPPER_FWD_SLOTS); PAIRS: causal dense batches in the
// persistent grid over pairs of query tiles (capability.HOPPER_CAUSAL_PAIRS).
template <int D> struct FwdCfg;
template <> struct FwdCfg<64> {
  static constexpr int BM = PW90_BM64, BN = PW90_BN64, KSLOTS = PW90_KSLOTS64, VSLOTS = 2;
  static constexpr bool PAIRS = PW90_PAIRS64;
};
template <> struct FwdCfg<128> {
  static constexpr int BM = 128, BN = PW90_BN128, KSLOTS = PW90_KSLOTS128, VSLOTS = 2;
  static constexpr bool PAIRS = PW90_PAIRS128;
};
// D = 256: Q1 and Q2 alone take 128 KB, so the rings hold 32-key tiles (48-key tiles in
// 4 + 2 slots would need 144 KB). O is 128 float32 registers per thread. Pairs not timed.
template <> struct FwdCfg<256> {
  static constexpr int BM = 128, BN = 32, KSLOTS = 4, VSLOTS = 2;
  static constexpr bool PAIRS = false;
};

// Warpgroups and their registers: a producer warpgroup and BM / 64 consumer warpgroups.
// The CTA launches with 65536 / THREADS registers per thread (rounded down to 8: 168 for 384
// threads, 128 for 512), which setmaxnreg moves from the producer to the consumers. Two
// consumers: 232 / 40, or 240 / 24 as in FlashAttention-3 (-DPW90_CONSUMER_REGS=240: no
// consistent gain with 128-key tiles); three (BM = 192): 160 / 24, as FlashAttention-3 at
// head dim 64.
template <int D> struct FwdWarps {
  static constexpr int CONSUMERS = FwdCfg<D>::BM / 64, THREADS = 128 * (1 + CONSUMERS);
  static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;  // (THREADS is 384 or 512)
  static constexpr int CONSUMER_REGS = CONSUMERS == 2 ? PW90_CONSUMER_REGS : 160;
  static constexpr int PRODUCER_REGS = CONSUMERS == 2 && CONSUMER_REGS <= 232 ? 40 : 24;
  static_assert(FwdCfg<D>::BM % 64 == 0 && (CONSUMERS == 2 || CONSUMERS == 3), "BM: 128 or 192");
  static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= THREADS * LAUNCH_REGS &&
                    CONSUMER_REGS % 8 == 0,
                "setmaxnreg: the warpgroups share the registers the kernel launches with");
  static_assert(!PW90_PINGPONG || CONSUMERS == 2, "ping-pong pairs two consumer warpgroups");
};

template <int D> struct FwdSmem {
  static constexpr int BM = FwdCfg<D>::BM, BN = FwdCfg<D>::BN, PANELS = D / 64;
  static constexpr int KSLOTS = FwdCfg<D>::KSLOTS, VSLOTS = FwdCfg<D>::VSLOTS;
  static constexpr int Q_PANEL = BM * 128, K_PANEL = BN * 128;  // bytes of a 64-column panel
  static constexpr int Q_TILE = PANELS * Q_PANEL, K_TILE = PANELS * K_PANEL;
  static constexpr int Q1 = 0, Q2 = Q_TILE, KSLOT0 = 2 * Q_TILE;
  static constexpr int VSLOT0 = KSLOT0 + KSLOTS * K_TILE;
  // qbar, full/empty of each K slot, full/empty of each V slot, qempty (PW90_PERSIST: Q no
  // longer read)
  static constexpr int BARS = VSLOT0 + VSLOTS * K_TILE;
  static constexpr int NBARS = 2 + 2 * KSLOTS + 2 * VSLOTS;
  static constexpr int BYTES = BARS + 8 * NBARS + 1024;  // + base alignment slack
  static_assert(Q_PANEL % 1024 == 0 && K_PANEL % 1024 == 0 && (BN / 2) % 8 == 0,
                "swizzle atoms are 1024 bytes (also the straddling tiles' parts of a K slot)");
  static_assert(KSLOTS >= 2 && VSLOTS >= 2, "a straddling tile takes two K slots; P·V of "
                "tile t-1 reads one V slot while the next loads");
  static_assert(BYTES <= 227 * 1024, "shared memory per block");
};

// A ring of N shared-memory buffers of BYTES each, guarded by a full and an empty mbarrier
// per buffer. Uses are counted from 0 (across the work tiles of a persistent CTA): use u
// takes buffer u % N, and its barriers complete phase u / N, of parity (u / N) & 1.
template <int N, int BYTES> struct Ring {
  u32 buf0, full0, empty0;
  PW90 u32 buf(int u) const { return buf0 + (u32)(u % N) * BYTES; }
  PW90 u32 full(int u) const { return full0 + 8 * (u % N); }
  PW90 u32 empty(int u) const { return empty0 + 8 * (u % N); }
  static PW90 u32 parity(int u) { return (u32)(u / N) & 1u; }
};
template <int D> using KRing = Ring<FwdSmem<D>::KSLOTS, FwdSmem<D>::K_TILE>;
template <int D> using VRing = Ring<FwdSmem<D>::VSLOTS, FwdSmem<D>::K_TILE>;

// Which projections a (query range x key range) block needs: bit 0 some admissible pair has
// d < w (q1·k1), bit 1 some has d >= w (q2·k2). With CAUSAL only d >= 0 is admissible.
template <bool CAUSAL>
PW90 int block_mode(int q0, int qn, int k0, int kn, int P, int w) {
  int dmin = q0 + P - (k0 + kn - 1);
  const int dmax = q0 + qn - 1 + P - k0;
  if (CAUSAL && dmin < 0) dmin = 0;
  return (dmin < w ? 1 : 0) | (dmax >= w ? 2 : 0);
}

// s(64 x NC) = Q(64 rows at qa) · K(NC rows at ka)ᵀ, both K-major swizzled panels; ka lies in
// a K tile of BN rows (its panels are BN x 128 bytes apart) and must be 1024-byte aligned.
template <typename T, int D, int BN, int NC>
PW90 void qk(float (&s)[NC / 2], u32 qa, u32 ka) {
  using S = FwdSmem<D>;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const u32 off = (kk % 4) * 32;  // k16 step inside a 128-byte row
    const u64 da = smem_desc(qa + (kk / 4) * S::Q_PANEL + off, 16, 1024);
    const u64 db = smem_desc(ka + (kk / 4) * S::K_PANEL + off, 16, 1024);
    Wgmma<T, NC>::ss(s, da, db, kk > 0 ? 1 : 0);
  }
}

PW90 void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
PW90 void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// O(64 x D) += P(64 x BN, registers) · V(BN x D at va, MN-major panels)
template <typename T, int D, int BN>
PW90 void pv(float (&o)[D / 2], const u32 (&a)[BN / 16][4], u32 va) {
  using S = FwdSmem<D>;
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
#if PW90_PV_SPLIT
#pragma unroll
    for (int pn = 0; pn < D / 64; ++pn) {
      float (&op)[32] = *reinterpret_cast<float(*)[32]>(&o[32 * pn]);
      Wgmma<T, 64>::template rs<1>(op, a[kk], smem_desc(va + pn * S::K_PANEL + kk * 2048,
                                                         S::K_PANEL, 1024), 1);
    }
#else
    Wgmma<T, D>::template rs<1>(o, a[kk], smem_desc(va + kk * 2048, S::K_PANEL, 1024), 1);
#endif
  }
}

// The consumer loop of one work tile. Iteration t:
//   wait K of tile t (its one or two K slots) and V of tile t-1;
//   [ping-pong: bar.sync on this warpgroup's barrier]
//   issue S_t = Q·K_tᵀ (commit), then O += P_{t-1}·V_{t-1} (commit)
//   [ping-pong: bar.arrive on the other warpgroup's barrier]
//   wait for S_t (OVERLAP: wait_group 1, P·V still running; else wait_group 0);
//   straddling fix-up; release K of tile t; mask; softmax statistics and exp;
//   wait_group 0; release V of tile t-1; rescale O; pack P_t to registers.
// After the loop the last P·V. Register cost over a loop that waits for P·V before S: P of
// the previous tile (BN/4 registers) lives across the S product. The serial loop (SERIAL,
// the D = 64 default) instead waits for V of tile t after the softmax, issues P_t·V_t and
// waits for it in the same iteration (pv_wait), so no P crosses an S product.
template <typename T, int D, bool CAUSAL, int DV>
// kc, kg: uses of the K ring and of the V ring (= key tiles) before this work tile, counted
// across the work tiles of a persistent CTA (kc is advanced here); qpar: parity of this work
// tile's Q load on qbar; qempty: where the consumers tell the producer that Q is no longer
// read (PW90_PERSIST).
PW90 void consumer_pipe(const FwdParams& p, u32 base, u32 qbar, const KRing<D>& kr,
                        const VRing<D>& vr, int m0, int h, const SeqRows& sr, int ntiles,
                        int& kc, int kg, u32 qpar, u32 qempty) {
  using S = FwdSmem<D>;
  constexpr int BN = S::BN, BM = S::BM;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = __shfl_sync(0xffffffffu, warp / 4 - 1, 0), wl = warp % 4;
  const int M = sr.M, N = sr.N, P = sr.P, w = (int)p.w;
  const int row0 = m0 + 64 * wg;
  const float sl2 = p.scale_log2;
  const u32 q1a = base + S::Q1 + wg * 64 * 128, q2a = base + S::Q2 + wg * 64 * 128;

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float mrow[2] = {PW90_NEG_INF, PW90_NEG_INF}, lrow[2] = {0.f, 0.f};
  // Thread's accumulator element (hh, j, e) of a 64-row product: row 16*wl + lane/4 + 8*hh
  // of the warpgroup, column 8*j + 2*(lane%4) + e; index 4*j + 2*hh + e.
  u32 a[BN / 16][4];  // P of the previous tile, the register A operand of P·V
  constexpr bool SERIAL = PW90_FWD_SERIAL || (D == 64 && PW90_FWD_SERIAL64);  // (a: P of tile t)
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) a[kk][0] = a[kk][1] = a[kk][2] = a[kk][3] = 0u;
  bool have_prev = false;

#if PW90_PINGPONG
  if (wg == 1) named_bar_arrive(1, 256);  // warpgroup 0 issues first
#endif
  if (ntiles > 0) mbar_wait(qbar, qpar);
  // V-ring use gv: wait for V, O += P(a)·V if run, wait for the product, release V.
  auto pv_wait = [&](int gv, bool run) {
    mbar_wait(vr.full(gv), vr.parity(gv));
    if (run) {
      reg_fence(o);
      wg_fence();
      pv<T, D, BN>(o, a, vr.buf(gv));
      wg_commit();
      wg_wait<0>();
      reg_fence(o);
    }
    mbar_arrive(vr.empty(gv));
  };
  // One key tile; PVX: issue P_{t-1}·V_{t-1}. Two instantiations rather than a branch around
  // the P·V product: a conditional product forces ptxas to close the group with a dummy
  // HGMMA (a third group, so wait_group 1 would also wait for P·V) or to serialise.
  auto tile = [&](auto pvx, const int t) {
    constexpr bool PVX = decltype(pvx)::value;
    const int g = kg + t, n0 = t * BN;
    // The CTA's mode says which K slots the producer filled (K1 before K2); this warpgroup's
    // rows may need fewer (mode below), never others.
    const int cmode = block_mode<CAUSAL>(m0, BM, n0, BN, P, w);
    const bool two = cmode == 3;
    mbar_wait(kr.full(kc), kr.parity(kc));
    if (two) mbar_wait(kr.full(kc + 1), kr.parity(kc + 1));
    if (!SERIAL && t > 0) mbar_wait(vr.full(g - 1), vr.parity(g - 1));
    const u32 k1a = kr.buf(kc), k2a = kr.buf(kc + (two ? 1 : 0));
    const u32 pva = vr.buf(g - 1);  // V of tile t-1
    // Rows left to this warpgroup in tile t. Without CAUSAL always true (t < ntiles), but
    // kept as a run-time test: the softmax then sits in its own basic block and ptxas does
    // not hoist wait_group 0 (below it) above the softmax, which would undo the overlap.
    const bool compute = CAUSAL ? row0 + 63 + P - n0 >= 0 : n0 < N;
    const int mode = block_mode<CAUSAL>(row0, 64, n0, BN, P, w);
    float s1[BN / 2];
#if PW90_PINGPONG
    named_bar_sync(1 + wg, 256);
#endif
    reg_fence(o);
    wg_fence();
    // S is issued even for a tile whose rows are all causally masked (a few per work tile,
    // for the warpgroups below the CTA's last rows): a conditional S product makes ptxas
    // serialise the wgmma (C7515).
    qk<T, D, BN, BN>(s1, mode == 2 ? q2a : q1a, mode == 2 ? k2a : k1a);
    wg_commit();
    if constexpr (PVX) {
      pv<T, D, BN>(o, a, pva);
      wg_commit();
    }
#if PW90_PINGPONG
    named_bar_arrive(2 - wg, 256);
#endif
    if constexpr (PVX && PW90_OVERLAP) wg_wait<1>();
    else wg_wait<0>();
    reg_fence(s1);
    const int dbase = row0 + P - n0 + 16 * wl + lane / 4 - 2 * (lane % 4);
    float alpha[2] = {1.f, 1.f};
    if (compute && mode == 3) {
      wg_wait<0>();  // (OVERLAP) no P·V in flight while the fix-up products run
      // The second product goes PART keys at a time through a small temporary, so a
      // straddling tile (rare: about two per query tile) costs PART/2 extra registers, not
      // a second score tile.
      // (32 with three consumer warpgroups: their 160 registers leave no room for 64)
      constexpr int PART = FwdWarps<D>::CONSUMERS == 3 ? 32 : BN % 64 == 0 ? 64 : BN / 2;
#pragma unroll
      for (int part = 0; part < BN / PART; ++part) {
        float s2[PART / 2];
        wg_fence();
        qk<T, D, BN, PART>(s2, q2a, k2a + part * PART * 128);
        wg_commit();
        wg_wait<0>();
        reg_fence(s2);
#pragma unroll
        for (int jj = 0; jj < PART / 8; ++jj)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = part * (PART / 8) + jj;
              if (dbase + 8 * hh - 8 * j - e >= w) s1[4 * j + 2 * hh + e] = s2[4 * jj + 2 * hh + e];
            }
      }
    }
    mbar_arrive(kr.empty(kc));  // K1/K2 of tile t no longer read
    if (two) mbar_arrive(kr.empty(kc + 1));
    kc += two ? 2 : 1;
    if (compute) {
      const bool masked = n0 + BN > N || (CAUSAL && row0 + P - (n0 + BN - 1) < 0);
      if (masked) {
        const int cols = N - n0 - 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (8 * j + e >= cols || (CAUSAL && dbase + 8 * hh - 8 * j - e < 0))
                s1[4 * j + 2 * hh + e] = PW90_NEG_INF;
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = mrow[hh];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
          mx = fmaxf(mx, fmaxf(s1[4 * j + 2 * hh], s1[4 * j + 2 * hh + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mb = mx == PW90_NEG_INF ? 0.f : __fmul_rn(mx, sl2);  // as in consumer
        alpha[hh] = exp2f_approx(__fmul_rn(mrow[hh], sl2) - mb);
        mrow[hh] = mx;
        // (one chain per row: four partial sums and maxima were up to 8% slower on an H200)
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = exp2f_approx(fmaf(s1[4 * j + 2 * hh + e], sl2, -mb));
            s1[4 * j + 2 * hh + e] = x;
            sum += x;
          }
        lrow[hh] = lrow[hh] * alpha[hh] + sum;
      }
    }
    // Keep the softmax before the wait (else the compiler sinks it past wait_group 0 and
    // nothing overlaps the P·V product).
    reg_fence(s1);
    reg_fence(alpha);
    reg_fence(lrow);
    wg_wait<0>();  // P_{t-1}·V_{t-1} done: O and the P registers are free
    reg_fence(o);
    // P_{t-1} stays live until here: were its registers reused by the softmax above, ptxas
    // would have to wait for the P·V product before the softmax (no overlap).
    if constexpr (!SERIAL) {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) reg_fence(a[kk]);
    }
    if (!SERIAL && t > 0) mbar_arrive(vr.empty(g - 1));  // V of tile t-1 no longer read
    if (compute) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          o[4 * j + 2 * hh] *= alpha[hh];
          o[4 * j + 2 * hh + 1] *= alpha[hh];
        }
    }
    // SERIAL packs on every tile (unused where !compute): a then holds nothing from one tile
    // to the next, which ptxas sees only if no path leaves it unwritten
    if (compute || SERIAL) {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        a[kk][0] = Cvt<T>::pack(s1[8 * kk + 0], s1[8 * kk + 1]);
        a[kk][1] = Cvt<T>::pack(s1[8 * kk + 2], s1[8 * kk + 3]);
        a[kk][2] = Cvt<T>::pack(s1[8 * kk + 4], s1[8 * kk + 5]);
        a[kk][3] = Cvt<T>::pack(s1[8 * kk + 6], s1[8 * kk + 7]);
      }
    }
    if constexpr (SERIAL) {  // O += P_t·V_t now, and wait for it: a is free again after
      pv_wait(g, compute);
    } else {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) reg_fence(a[kk]);
    }
    have_prev = compute;
  };
  for (int t = 0; t < ntiles; ++t) {
    if (have_prev && !SERIAL) tile(BoolC<true>{}, t);
    else tile(BoolC<false>{}, t);
  }
#if PW90_PERSIST
  if (ntiles > 0) mbar_arrive(qempty);  // every S product of this work tile is complete
#endif
  // the last P·V (SERIAL: each P·V ran in its own tile)
  if (!SERIAL && ntiles > 0) pv_wait(kg + ntiles - 1, have_prev);
#if PW90_PINGPONG
  // Warpgroup 1 arrived on barrier 1 once more than warpgroup 0 synced on it: consume that
  // arrival so that no named barrier is left mid-phase when the CTA exits.
  if (wg == 0) named_bar_sync(1, 256);
#endif

  // Epilogue (as in consumer): normalise, store O and lse.
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float l = lrow[hh];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int r = row0 + 16 * wl + lane / 4 + 8 * hh;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (r < M) {
      if (p.lse && lane % 4 == 0)
        p.lse[sr.lse0 + (i64)h * sr.lse_h + r] =
            l > 0.f ? (mrow[hh] * sl2 + log2f_approx(l)) * PW90_LN2 : PW90_NEG_INF;
      u16* dst = p.o + (i64)sr.tb * p.o_sb + (i64)h * p.o_sh + (i64)(sr.q0 + r) * p.o_sr +
                 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < DV / 8; ++j)  // the stored columns (DV < D: zero padding computed)
        *reinterpret_cast<u32*>(dst + 8 * j) =
            Cvt<T>::pack(o[4 * j + 2 * hh] * inv, o[4 * j + 2 * hh + 1] * inv);
    }
  }
}
// Use u of a ring (K or V): wait until its slot is free, expect its bytes on the slot's full
// barrier, and load key rows [k0 + n0, k0 + n0 + BN) of head hk, batch b from map as D / 64
// panels. (k0 + n0 is formed here, after the wait, as the producer did before this helper:
// the PTX of every instantiation is unchanged by it.)
template <int D, typename R>
PW90 void ring_load(const R& r, int u, const TmaDesc* map, int k0, int n0, int hk, int b) {
  using S = FwdSmem<D>;
  mbar_wait(r.empty(u), R::parity(u) ^ 1u);
  const u32 dst = r.buf(u), fb = r.full(u);
  mbar_expect_tx(fb, S::K_TILE);
#pragma unroll
  for (int pn = 0; pn < S::PANELS; ++pn)
    tma_load_4d(dst + pn * S::K_PANEL, map, 64 * pn, k0 + n0, hk, b, fb);
}

// The producer of one work tile: Q (after the previous work tile's consumers released it,
// PW90_PERSIST), then per key tile t the K slot(s) of t and V of t-1 (V is consumed one
// iteration after K). kc, kg: uses of the K and V rings so far (kc is advanced here); qn:
// work tiles with keys so far.
template <int D, bool CAUSAL>
PW90 void produce_pipe(const TmaDesc* tq1, const TmaDesc* tq2, const TmaDesc* tk1,
                       const TmaDesc* tk2, const TmaDesc* tv, u32 base, u32 qbar, u32 qempty,
                       const KRing<D>& kr, const VRing<D>& vr, int m0, int h, int b, int hk,
                       int ntiles, int& kc, int kg, int qn, int P, int w, int q0, int k0) {
  using S = FwdSmem<D>;
  constexpr int BN = S::BN, BM = S::BM;
#if PW90_PERSIST
  if (qn > 0) mbar_wait(qempty, (qn - 1) & 1);
#endif
  mbar_expect_tx(qbar, 2 * S::Q_TILE);
#pragma unroll
  for (int pn = 0; pn < S::PANELS; ++pn) {
    tma_load_4d(base + S::Q1 + pn * S::Q_PANEL, tq1, 64 * pn, q0 + m0, h, b, qbar);
    tma_load_4d(base + S::Q2 + pn * S::Q_PANEL, tq2, 64 * pn, q0 + m0, h, b, qbar);
  }
  for (int t = 0; t <= ntiles; ++t) {
    if (t < ntiles) {
      const int n0 = t * BN, mode = block_mode<CAUSAL>(m0, BM, n0, BN, P, w);
      for (int j = 0; j < 2; ++j) {  // K1 (bit 0), then K2 (bit 1), each in its own slot
        if (!(mode & (1 << j))) continue;
        ring_load<D>(kr, kc, j ? tk2 : tk1, k0, n0, hk, b);
        ++kc;
      }
    }
    if (t > 0) ring_load<D>(vr, kg + t - 1, tv, k0, (t - 1) * BN, hk, b);  // V of tile t-1
  }
}

}  // namespace pw90

// Grid: (ceil(M / BM), H, B), or for the persistent walks (dense non-causal; dense causal
// where FwdCfg<D>::PAIRS) (at most the work units, 1, 1); FwdWarps<D>::THREADS threads
// (512 at D = 64, 384 at 128 and 256); dynamic shared memory pw90::FwdSmem<D>::BYTES.
// Tensor maps (cupy_piecewise/tma.py): 4-D {D, rows, heads, batch}, box {64, BM (Q) or BN
// (K, V), 1, 1}, 128-byte swizzle, zero fill out of bounds; q1/q2 over (M, H), k1/k2/v over
// (N, Hkv).
// VARLEN (a packed variable-length batch): the grid is (ceil(longest sequence / BM), H, B)
// and a CTA whose query tile starts past its sequence's end leaves at once.
// DV < D (head dims 80 and 96 on the D = 128 kernel): the tensors have DV columns; the TMA
// boxes that reach past them fill zeros, so the products see D columns of which the last
// D - DV are zero (S unchanged, O's padding columns zero), and only DV columns are stored.
template <typename T, int D, bool CAUSAL, bool VARLEN = false, int DV = D>
__global__ void __launch_bounds__(pw90::FwdWarps<D>::THREADS, 1)
    pw90_forward(const __grid_constant__ pw90::TmaDesc tq1, const __grid_constant__ pw90::TmaDesc tq2,
                 const __grid_constant__ pw90::TmaDesc tk1, const __grid_constant__ pw90::TmaDesc tk2,
                 const __grid_constant__ pw90::TmaDesc tv, const pw90::FwdParams p) {
  using namespace pw90;
  using S = FwdSmem<D>;
  constexpr int BN = S::BN, BM = S::BM, NC = FwdWarps<D>::CONSUMERS;  // NC consumer warpgroups
  static_assert(DV % 16 == 0 && DV <= D && (DV > D / 2 || D == 64), "stored head dim");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  // Barriers: qbar, the K ring's full then empty ones, the V ring's, qempty.
  const u32 qbar = base + S::BARS;
  const KRing<D> kr{base + S::KSLOT0, qbar + 8, qbar + 8 + 8 * S::KSLOTS};
  const VRing<D> vr{base + S::VSLOT0, qbar + 8 + 16 * S::KSLOTS,
                    qbar + 8 + 16 * S::KSLOTS + 8 * S::VSLOTS};
  const u32 qempty = qbar + 8 + 16 * (S::KSLOTS + S::VSLOTS);  // (PW90_PERSIST only)

  // Dense batches walk work tiles in a persistent grid (PW90_PERSIST): non-causal ones by
  // single tiles, causal ones by pairs of tiles where FwdCfg<D>::PAIRS. Other causal and
  // packed ones, and every build without it, take one work tile per CTA from blockIdx:
  // heavier causal tiles (later queries) launch first, evening out the tail of the grid.
  constexpr bool PERSIST = PW90_PERSIST && !VARLEN && !CAUSAL;
  constexpr bool PERSIST_PAIRS = PW90_PERSIST && !VARLEN && CAUSAL && FwdCfg<D>::PAIRS;
  const int mt = CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
  const int m0 = mt * BM, h = blockIdx.y, b = blockIdx.z;
  const int w = (int)p.w;
  if (VARLEN && m0 >= seq_rows<VARLEN>(p, b).M) return;  // uniform, before any barrier is used
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    mbar_init(qbar, 1);
    for (int s = 0; s < S::KSLOTS; ++s) {
      mbar_init(kr.full(s), 1);         // the producer's arrive.expect_tx
      mbar_init(kr.empty(s), NC * 128);  // every consumer thread
    }
    for (int s = 0; s < S::VSLOTS; ++s) {
      mbar_init(vr.full(s), 1);
      mbar_init(vr.empty(s), NC * 128);
    }
    mbar_init(qempty, NC * 128);
    mbar_init_fence();
  }
  __syncthreads();

  // This CTA's work tiles (query tile, head, batch): fn(m0, h, b) for each. Persistent: query
  // tile (or pair) fastest (CTAs running together share K/V in L2), with stride gridDim.x
  // (int: B * H * ceil(M / 128) < 2^31 for any tensors that fit in memory).
  auto each_work = [&](auto&& fn) {
    if constexpr (PERSIST) {
      const int nmt = ((int)p.M + BM - 1) / BM, H = (int)p.H;
      const int total = nmt * H * (int)p.batch;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        const int r = tile % nmt, hb = tile / nmt;
        fn(r * BM, hb % H, hb / H);
      }
    } else if constexpr (PERSIST_PAIRS) {
      // Query tiles nmt-1-u and u of head (hb % H, hb / H): (u + 1) + (nmt - u) key tiles
      // when M = N; an odd nmt's middle tile is a unit of its own (the last of its head).
      const int nmt = ((int)p.M + BM - 1) / BM, H = (int)p.H, units = (nmt + 1) / 2;
      const int total = units * H * (int)p.batch;
      for (int unit = blockIdx.x; unit < total; unit += gridDim.x) {
        const int u = unit % units, hb = unit / units;
        // a loop rather than two calls: fn (the whole consumer loop) is inlined once
        for (int m = nmt - 1 - u; m >= u; m = m == u ? -1 : u) fn(m * BM, hb % H, hb / H);
      }
    } else {
      fn(m0, h, b);
    }
  };
  // Key tiles of a work tile: keys past the last query's diagonal are masked for every row.
  auto key_tiles = [&](int m0w, const SeqRows& sw) {
    return (CAUSAL ? max(0, min(sw.N, m0w + BM + sw.P)) + BN - 1 : sw.N + BN - 1) / BN;
  };
  int kc = 0, kg = 0, qn = 0;  // K-ring uses, V-ring uses (key tiles), work tiles with keys
  if (warp < 4) {  // ---------------------------------------------------------------- producer
    regs_dec<FwdWarps<D>::PRODUCER_REGS>();
    if (warp == 0 && lane == 0) {
      tma_prefetch_desc(&tk1);
      tma_prefetch_desc(&tk2);
      tma_prefetch_desc(&tv);
      each_work([&](int m0w, int hw, int bw) {
        const SeqRows sw = seq_rows<VARLEN>(p, bw);
        const int nt = key_tiles(m0w, sw);
        if (nt > 0) {
          produce_pipe<D, CAUSAL>(&tq1, &tq2, &tk1, &tk2, &tv, base, qbar, qempty, kr, vr, m0w,
                                  hw, sw.tb, hw / (int)p.group, nt, kc, kg, qn, sw.P, w, sw.q0,
                                  sw.k0);
          kg += nt;
          ++qn;
        }
      });
    }
  } else {  // ------------------------------------------------------------------------ consumers
    regs_inc<FwdWarps<D>::CONSUMER_REGS>();
    each_work([&](int m0w, int hw, int bw) {
      const SeqRows sw = seq_rows<VARLEN>(p, bw);
      const int nt = key_tiles(m0w, sw);
      consumer_pipe<T, D, CAUSAL, DV>(p, base, qbar, kr, vr, m0w, hw, sw, nt, kc, kg,
                                      (u32)(qn & 1), qempty);
      if (nt > 0) {
        kg += nt;
        ++qn;
      }
    });
  }
}
