// Piecewise-attention backward for Hopper (sm_90a): TMA + mbarrier ring, wgmma, warp
// specialisation. The package's backward on compute capability 9.0 for float16/bfloat16 and
// D = 64, 128 (cupy_piecewise/launch.py, HopperBackward), dense or, built with VARLEN, over a
// packed batch of variable-length sequences (BwdSeq below); scripts/hopper_bwd_probe.py
// builds, checks and times the dense build standalone.
//
// Three kernels, launched in this order on one stream:
//   pw90_bwd_prep<T, D>     one warp per padded query row pair (i, i + 8) of a (b, h), 16
//                           rows a block (capability.hopper_bwd_helper_grid): delta = rowsum(dO * O),
//                           lse2 = lse * log2(e) (+inf for rows with no admissible key and for
//                           padding rows, so that P = exp2(s * scale_log2 - lse2) = 0 there),
//                           both float32 (B, H, Mpad) with Mpad = M rounded up to BM (packed
//                           batches: B = 1 and per-sequence padding, see BwdSeq); zeroes the
//                           float32 dQ accumulator (2, B, H, Mpad, D) when it is given, in
//                           linear order over the whole grid (D the compute head dim: 128 for
//                           tensors of DV = 80 or 96 columns).
//   pw90_bwd<T, D, CAUSAL, DQ>  the main kernel below.
//   pw90_bwd_dq_convert<T, D>   dq1/dq2 = sm_scale * accumulator, to the input dtype (DQ
//                           only); the same row-pair grid, over M rows.
//
// Main kernel: one CTA per (key tile of BN = 128 keys, kv head, batch), 384 threads:
//   warpgroup 0  producer (setmaxnreg.dec 24): one thread loads, by TMA with 128-byte swizzle,
//                the resident K1, K2, V of the key tile (only the projections some pass needs)
//                and then streams, per visited (pass, query head of the group, 64-row query
//                tile), the pass's Q (Q1 in pass 1, Q2 in pass 2) and dO into a 2-stage ring,
//                plus lse2 and delta of those 64 rows by 1-D bulk copies (cp.async.bulk) from the
//                padded arrays. Full/empty mbarriers per stage, one more for K1/K2/V.
//   warpgroups 1, 2  consumers (setmaxnreg.inc 240), 64 keys each (keys n0 + 64 * wg ...).
//                Per visited query tile, for its 64 keys x 64 queries:
//                  Sᵀ  = K·Qᵀ     wgmma m64nNCk16, A = K rows, B = Q rows (both K-major)
//                  dPᵀ = V·dOᵀ    same form
//                  Pᵀ = exp2(Sᵀ * scale_log2 - lse2[query]), dSᵀ = Pᵀ ⊙ (dPᵀ - delta[query])
//                  dV += Pᵀ·dO    wgmma m64nDk16, A = Pᵀ from registers (16-bit), B = dO MN-major
//                  dK += dSᵀ·Q    same form
//                  dQ(64 q x D) += dS·K (DQ only): both warpgroups store their dSᵀ (16-bit,
//                                 swizzled) to a shared buffer (two, alternating), meet at a
//                                 barrier, and each computes dQ over all 128 keys for its
//                                 64-column panel(s) (MN-major A = dSᵀ, B = K): D = 128 one
//                                 panel each, D = 64 every other tile; the float32 result is
//                                 added to the global accumulator with red.global.add.v4.f32,
//                                 in the accumulator fragments' order (dq_run), so that a
//                                 warp's instruction covers 512 contiguous bytes (or, with
//                                 PW90_BWD_DQ_WRITER=1, through a shared staging buffer that
//                                 a writer warp adds by one bulk reduce-add per panel).
//                (Sᵀ and dPᵀ can be computed in QH chunks of NC = 64/QH query columns: QH = 1
//                at D = 64; PW90_BWD_QH128 at D = 128, default 1, the only clean build.)
//
// Piecewise pairs, two passes. Accumulating dK1 and dK2 together would need 3 D-wide float32
// accumulators per thread (dV, dK1, dK2: 192 registers at D = 128 before S and dP), so, as in
// the mma.sync dkv kernel (kernels_cu/backward.cu), the consumers make two passes over the query
// tiles: pass 1 visits the tiles with some pair d < w and accumulates dK1 (and dQ1), pass 2 those
// with some d >= w, dK2 (and dQ2); dK_pair is stored after its pass, dV after both. A
// straddling tile is visited in both passes; in a straddling (64-key, 64-query) block the
// elements on the other pass's side of d = w are masked (P = 0), so every (query, key) element
// enters dV, dK and dQ exactly once, from the right projection (pass 1: q1·k1, d < w; pass 2:
// q2·k2, d >= w). tests/test_sm90_bwd_build_cpu.py checks this bookkeeping on a Python mirror.
// With grouped-query attention the query heads of the group are walked inside each pass, so
// dK and dV are summed on chip and stored once, without atomics.
//
// Deterministic mode: DQ = false computes only dK1, dK2, dV (bitwise reproducible: no atomics);
// dQ then comes from the mma.sync pw_backward_dq kernel (launch.HopperBackward).
//
// Registers (NVRTC 13, offline): every instantiation builds with 0 spills and no wgmma
// serialisation (consumer peak about 236 of 240 at D = 128 with fused dQ). Fragile: the two
// passes must stay one run-time loop (two inlined copies made ptxas serialise all wgmma at
// D = 128, C7512), the masks branch-free, and QH = 1 (QH = 2 or 4 spill with fused dQ).
//
// Shared memory (bytes), every tile stored as D/64 panels of rows x 128 bytes (TMA box 64 wide):
//   K1, K2, V: 3 x BN x D x 2; ring: 2 stages x (Q, dO: 2 x BM x D x 2);
//   dSᵀ: 2 buffers x BN x BM x 2 (each two 64 x 64 halves, one per consumer warpgroup);
//   lse2/delta: 2 x 2 x BM x 4; [PW90_BWD_DQ_WRITER: 2 x 64 x 64 x 4 dQ staging];
//   mbarriers (kbar, full[2], empty[2] [, dq_full[2], dq_empty[2]]); 1 KB to align the base.
//   D = 64:  48 KB + 32 KB + 32 KB + 1 KB + 40 + 1024 = 116,776 bytes
//   D = 128: 96 KB + 64 KB + 32 KB + 1 KB + 40 + 1024 = 198,696 bytes (of 227 KB; 231,512 with
//   the DQ_WRITER staging buffers, mbarriers and panel addresses). capability.hopper_bwd_shared_bytes mirrors this (checked by
//   tests/test_traits_cpu.py).
#include "sm90/hopper.cuh"
#include "sm90/wgmma.cuh"
#include "sm90/wgmma_bwd.cuh"

// Query chunks of the Sᵀ/dPᵀ products at D = 128 (see Chunks below): 1 (default), 2 or 4.
#ifndef PW90_BWD_QH128
#define PW90_BWD_QH128 1
#endif
// dQ through a writer warp (1, opt-in): each consumer warpgroup stores its 64 x 64 dQ panel,
// in the accumulator's order, to its shared staging buffer and goes on; one thread of warp 1
// of the producer warpgroup adds the buffer to the accumulator with one bulk reduce-add
// (cp.reduce.async.bulk .add.f32, 16 KB) and frees it (an mbarrier pair per buffer); the
// panel's accumulator address comes with it. Without spills (producer warpgroup at 32
// registers, consumers at 232) it ran at 0.92-1.04x the default backward on an H200, as the
// spilling version before it had (0.96-1.09x): the reductions' L2 work, not the consumers'
// issue of them, is what costs (bench/NOTES.md). (An earlier variant, in which a consumer
// thread issued the bulk reduce behind two warpgroup barriers, was slower and is gone.)
#ifndef PW90_BWD_DQ_WRITER
#define PW90_BWD_DQ_WRITER 0
#endif

namespace pw90 {
namespace bwd {

constexpr int BM = 64;        // query rows per streamed tile
constexpr int BN = 128;       // key rows per CTA: two consumer warpgroups x 64
constexpr int THREADS = 384;  // producer warpgroup + 2 consumer warpgroups
// Ring stages of (Q, dO, lse2, delta): 2, or 3 (fits at D = 128 only without DQ_WRITER).
#ifndef PW90_BWD_STAGES
#define PW90_BWD_STAGES 2
#endif
constexpr int STAGES = PW90_BWD_STAGES;
// setmaxnreg moves registers inside the CTA's own allocation (3 warpgroups x 168 at launch):
// PRODUCER_REGS + 2 * CONSUMER_REGS must stay <= 3 * 168 = 504, or the consumers' increase
// waits forever (a DQ_WRITER build with 32 + 2 x 240 hung this way).
// A DQ_WRITER build gives the producer warpgroup 32 (its two threads' code spilled at 24) and
// the consumers 232, which their code then fits without spills.
constexpr int PRODUCER_REGS = PW90_BWD_DQ_WRITER ? 32 : 24, CONSUMER_REGS = PW90_BWD_DQ_WRITER ? 232 : 240;
static_assert(PRODUCER_REGS + 2 * CONSUMER_REGS <= 3 * 168, "setmaxnreg budget of the CTA");
constexpr int CONSUMERS = 256;
// Sᵀ/dPᵀ are computed in QH chunks of NC query columns (register budget at D = 128).
template <int D> struct Chunks {
  static constexpr int QH = D == 128 ? PW90_BWD_QH128 : 1, NC = BM / QH;
};

// Kernel arguments of pw90_bwd besides the six tensor maps. Host side: launch._BWD_MAIN
// ("<Qqqq Qqqq Qqqq QQQ qqqqqqq ff"), also packed by scripts/hopper_bwd_probe.py.
struct BwdParams {
  u16* dk1;
  i64 dk1_sb, dk1_sh, dk1_sr;  // (B, Hkv, N, D) strides in elements, unit stride along D
  u16* dk2;
  i64 dk2_sb, dk2_sh, dk2_sr;
  u16* dv;
  i64 dv_sb, dv_sh, dv_sr;
  float* dq_acc;        // (2, B, H, Mpad, D) float32, zero on entry (DQ only); order inside a 64-row tile: dq_run
  const float* lse2;    // (B, H, Mpad)
  const float* delta;   // (B, H, Mpad)
  i64 B, H, group, M, N, Mpad, w;  // w clamped to [shift - N, shift + M]; lengths < 2^30
  i64 shift;                       // P of d(i, j) = i + P - j: N - M, or within [-M, N]
  float scale_log2;     // sm_scale * log2(e)
  float sm_scale;
  // Packed variable-length batch (kernel built with VARLEN; else unused): B + 1 int32 running
  // totals of the query and key rows. The tensor maps then describe the packed (total, heads,
  // D) arrays as batch 1, dk1/dk2/dv have batch stride 0, B is 1, and Mpad is the row count of
  // the padded statistics (see BwdSeq): lse2/delta (H, Mpad), dq_acc (2, H, Mpad, D).
  const int* cu_q;
  const int* cu_k;
};

// The rows of one CTA's sequence: batch entry b (dense) or packed sequence b (VARLEN). q0/k0:
// its first query/key rows in the arrays the tensor maps describe; tb: the batch coordinate of
// those maps and of the statistics; row0: the statistics row of its query row 0. Packed
// sequences get FlashAttention-3's padded layout, row0 = floor((q0 + 64 b) / 64) * 64: a
// multiple of 64 (the 1-D bulk copies of lse2/delta need 16-byte aligned sources), with at
// least ceil(M / 64) * 64 rows before the next sequence's row0, so that the padding rows of
// a sequence's last tile are its own (+inf lse2: P = 0 for the next sequence's queries that
// the tile's TMA box reaches). The arrays hold Mpad = total_q + 64 B rows rounded up to 64
// (so that every head's rows start 16-byte aligned too).
struct BwdSeq {
  int M, N, P, q0, k0, tb, row0;
};

template <bool VARLEN, typename Prm> PW90 BwdSeq bwd_seq(const Prm& p, int b) {
  BwdSeq s;
  if constexpr (VARLEN) {
    s.q0 = p.cu_q[b], s.M = p.cu_q[b + 1] - s.q0;
    s.tb = 0, s.row0 = (int)(((i64)s.q0 + 64 * (i64)b) / 64 * 64);
  } else {
    s.M = (int)p.M, s.q0 = 0, s.tb = b, s.row0 = 0;
  }
  return s;
}
template <bool VARLEN> PW90 void bwd_keys(const BwdParams& p, int b, BwdSeq& s) {
  if constexpr (VARLEN) {
    s.k0 = p.cu_k[b], s.N = p.cu_k[b + 1] - s.k0, s.P = s.N - s.M;
  } else {
    s.k0 = 0, s.N = (int)p.N, s.P = (int)p.shift;
  }
}

template <int D> struct Smem {
  static constexpr int PANELS = D / 64;
  static constexpr int K_PANEL = BN * 128, K_TILE = PANELS * K_PANEL;  // bytes
  static constexpr int Q_PANEL = BM * 128, Q_TILE = PANELS * Q_PANEL;
  static constexpr int K1 = 0, K2 = K_TILE, V = 2 * K_TILE;
  static constexpr int RING = 3 * K_TILE;  // stage s at RING + s * STAGE: Q (Q1 or Q2), dO
  static constexpr int STAGE = 2 * Q_TILE;
  static constexpr int DS = RING + STAGES * STAGE;  // 2 x dSᵀ: 128 key rows x 128 bytes (64 queries)
  static constexpr int DS_BYTES = BN * BM * 2;
  static constexpr int STATS = DS + 2 * DS_BYTES;  // stage s: lse2[BM] then delta[BM], float32
  static constexpr int STATS_STAGE = 2 * BM * 4;
  // DQ_WRITER: a 64 x 64 float32 dQ staging buffer per consumer warpgroup
  static constexpr int DQBUF = STATS + STAGES * STATS_STAGE, DQBUF_BYTES = 64 * 64 * 4;
  static constexpr int BARS = DQBUF + (PW90_BWD_DQ_WRITER ? 2 * DQBUF_BYTES : 0);
  // kbar, full[STAGES], empty[STAGES]; DQ_WRITER: dq_full[2], dq_empty[2] (one per buffer)
  static constexpr int DQBARS = BARS + 8 * (1 + 2 * STAGES);
  static constexpr int NBARS = 1 + 2 * STAGES + (PW90_BWD_DQ_WRITER ? 4 : 0);
  // DQ_WRITER: the accumulator address of each staging buffer's panel (u64 each; 0: no more)
  static constexpr int DQPTR = BARS + 8 * NBARS;
  static constexpr int BYTES = DQPTR + (PW90_BWD_DQ_WRITER ? 16 : 0) + 1024;  // + base alignment slack
  static_assert(K_PANEL % 1024 == 0 && Q_PANEL % 1024 == 0 && DS % 1024 == 0 && STATS % 16 == 0,
                "swizzle atoms are 1024 bytes");
  static_assert(BYTES <= 227 * 1024, "shared memory per block");
};

// ---------------------------------------------------------------- small PTX helpers
PW90 void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
PW90 void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
PW90 void sts_u32(u32 addr, u32 v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
PW90 void sts_u64(u32 addr, u64 v) {
  asm volatile("st.shared.u64 [%0], %1;" ::"r"(addr), "l"(v) : "memory");
}
PW90 u64 lds_u64(u32 addr) {
  u64 v;
  asm volatile("ld.shared.u64 %0, [%1];" : "=l"(v) : "r"(addr) : "memory");
  return v;
}
PW90 void lds_f2(u32 addr, float& x, float& y) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(x), "=f"(y) : "r"(addr) : "memory");
}
// 1-D bulk copy global -> shared, completing `bytes` on `bar` (16-byte aligned, multiple of 16).
PW90 void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "{ .reg .u64 g; cvta.to.global.u64 g, %1;"
      " cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [g], %2, [%3]; }" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
PW90 void red_add_f4(float* gptr, float x, float y, float z, float u) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(gptr), "f"(x), "f"(y), "f"(z), "f"(u)
               : "memory");
}
PW90 void sts_f4(u32 addr, float x, float y, float z, float u) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(x), "f"(y), "f"(z), "f"(u)
               : "memory");
}
// Bulk reduce-add of `bytes` (multiple of 16, both addresses 16-byte aligned) of float32 from
// shared memory into global memory, in this thread's bulk async-group.
PW90 void bulk_reduce_add_f32(float* gdst, u32 src, u32 bytes) {
  asm volatile(
      "{ .reg .u64 g; cvta.to.global.u64 g, %0;"
      " cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [g], [%1], %2; }" ::"l"(gdst),
      "r"(src), "r"(bytes)
      : "memory");
}
PW90 void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
PW90 void bulk_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
PW90 void bulk_wait0() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// The dQ accumulator's order inside a 64-row query tile (D x 64 floats): the order of the
// consumers' m64n64 accumulator fragments, in 64-column panels of 4096 floats each. Thread
// `lane` of warp `wl` of a warpgroup holds, for column block j of panel pn, the elements
// (hh, e) at row r = 16 wl + lane / 4 + 8 hh, column c = 8 j + 2 (lane % 4) + e of the panel;
// they are the four floats at dq_run(pn, wl, j, lane) + 2 hh + e, so that they are one
// red.global.add.v4.f32 (or one st.shared.v4 into the DQ_WRITER staging buffer) and a warp's
// instruction covers 512 contiguous bytes. (A row-major order, whose v2 reductions each
// touched 8 rows, made the backward 1.07-1.23x slower on an H200: bench/NOTES.md.)
PW90 int dq_run(int pn, int wl, int j, int lane) { return pn * 4096 + ((j * 4 + wl) * 32 + lane) * 4; }
// Adds a warpgroup's 64 x 64 dQ panel pn (accumulator fragments dq) to the accumulator
// block `tile` of its 64-row query tile.
PW90 void dq_red_panel(float* tile, int pn, const float (&dq)[32], int wl, int lane) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
    red_add_f4(tile + dq_run(pn, wl, j, lane), dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
}

template <typename T> struct ToF;
template <> struct ToF<bf16> {
  static PW90 float f(u16 x) { return __uint_as_float((u32)x << 16); }
};
template <> struct ToF<f16> {
  static PW90 float f(u16 x) {
    float y;
    asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(y) : "h"(x));
    return y;
  }
};

PW90 i64 floor_div(i64 a, i64 b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
PW90 i64 ceil_div(i64 a, i64 b) { return -floor_div(-a, b); }
PW90 i64 clamp64(i64 x, i64 lo, i64 hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Which projections a (query range x key range) block needs: bit 0 some admissible pair has
// d < w, bit 1 some has d >= w (with CAUSAL only d >= 0 is admissible). Same rule as the
// forward's block_mode (kernels_cu/sm90/forward.cu); emptiness is checked by the caller.
template <bool CAUSAL> PW90 int block_mode(int q0, int qn, int k0, int kn, int P, int w) {
  int dmin = q0 + P - (k0 + kn - 1);
  const int dmax = q0 + qn - 1 + P - k0;
  if (CAUSAL && dmin < 0) dmin = 0;
  return (dmin < w ? 1 : 0) | (dmax >= w ? 2 : 0);
}

// The query tiles a CTA (keys n0 .. n0 + BN - 1) visits in pass PAIR, shared by the producer
// and the consumers so that both walk the same ring slots: tiles [lo, hi) of the pass's range
// for which visit() holds.
struct Walk {
  int P, w, n0;  // 32-bit: lengths < 2^30, w clamped to [-(M+N+1), M+N+1]
  int tlo, thi, end1, first2;
  template <bool CAUSAL> PW90 void init(i64 M, i64 P64, i64 w_, int n0_) {
    P = (int)P64, w = (int)w_, n0 = n0_;
    thi = (int)((M + BM - 1) / BM);
    // causal: tile t has an admissible pair iff t*BM + BM - 1 + P >= n0
    tlo = CAUSAL ? (int)clamp64(floor_div(n0 - P64, BM), 0, thi) : 0;
    end1 = (int)clamp64(ceil_div(w_ - P64 + n0 + BN - 1, BM), tlo, thi);    // some d < w
    first2 = (int)clamp64(ceil_div(w_ - P64 + n0 - BM + 1, BM), tlo, thi);  // some d >= w
  }
  PW90 int lo(int pair) const { return pair == 1 ? tlo : first2; }
  PW90 int hi(int pair) const { return pair == 1 ? end1 : thi; }
  template <bool CAUSAL> PW90 int mode(int t) const {
    return block_mode<CAUSAL>(t * BM, BM, n0, BN, P, w);
  }
  template <bool CAUSAL> PW90 bool visit(int pair, int t) const {
    if (CAUSAL && t * BM + BM - 1 + P - n0 < 0) return false;
    return (mode<CAUSAL>(t) & pair) != 0;
  }
  // The producer and the consumers walk (pass, query head of the group, query tile) with
  // visit() in loops of their own, in the same order: the order of the ring slots.
};

// acc(64 x NC) = A(64 rows at a, K-major panels a_panel apart) · B(NC rows at b, K-major
// panels b_panel apart)ᵀ over the D columns: used for Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ.
// Every product here builds its base descriptors once and steps them per k-step with desc_at
// (an add to the address field) rather than building each from its address: descriptor work
// on the uniform datapath was ~290 of the ~930 SASS instructions a consumer warp issued per
// tile at D = 128. With the masked/unmasked softmax split below, it made the backward
// 1.07-1.26x faster on an H200 (bench/results/2026-12-02-h200-hopper-bwd-issue-cuts).
template <typename T, int D, int NC>
PW90 void gemm_kmajor(float (&acc)[NC / 2], u32 a, int a_panel, u32 b, int b_panel) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const u32 off = (kk % 4) * 32;  // k16 step inside a 128-byte row
    const u64 da = desc_at(smem_desc(a, 16, 1024), (kk / 4) * a_panel + off);
    const u64 db = desc_at(smem_desc(b, 16, 1024), (kk / 4) * b_panel + off);
    if constexpr (NC == 64) Wgmma<T, 64>::ss(acc, da, db, kk > 0 ? 1 : 0);
    else WgmmaT<T, NC>::template ss<0, 0>(acc, da, db, kk > 0 ? 1 : 0);
  }
}

// acc(64 x D) += A(64 x BM, registers: 16-bit accumulator-layout fragments) · B(BM rows x D at
// b, MN-major panels of BM x 128 bytes): dV += Pᵀ·dO and dK += dSᵀ·Q.
template <typename T, int D>
PW90 void gemm_rs(float (&acc)[D / 2], const u32 (&a)[BM / 16][4], u32 b) {
  constexpr int Q_PANEL = Smem<D>::Q_PANEL;
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk)
    Wgmma<T, D>::template rs<1>(acc, a[kk], desc_at(smem_desc(b, Q_PANEL, 1024), kk * 2048), 1);
}

template <typename T, int D, bool CAUSAL, bool DQ, bool VARLEN, int DV>
PW90 void consumer(const BwdParams& p, u32 base, u32 kbar, u32 full0, u32 empty0, int n0, int hk,
                   int b, const BwdSeq sq) {
  using S = Smem<D>;
  constexpr int QH = Chunks<D>::QH, NC = Chunks<D>::NC;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Broadcast so that ptxas knows the warpgroup index is warp-uniform (no wgmma serialisation).
  const int wg = __shfl_sync(0xffffffffu, warp / 4 - 1, 0), wl = warp % 4;
  // Lengths are below 2^30 and w is clamped to [-(M+N+1), M+N+1]: distances fit 32 bits.
  const int M = sq.M, N = sq.N, P = sq.P, w = (int)p.w;
  const int kw0 = n0 + 64 * wg;  // first key of this warpgroup
  const float sl2 = p.scale_log2;
  const int group = (int)p.group;
  Walk walk;
  walk.template init<CAUSAL>(M, P, w, n0);
  const bool any = walk.lo(1) < walk.hi(1) || walk.lo(2) < walk.hi(2);  // producer loaded K/V
  if (any) mbar_wait(kbar, 0);

  // Thread's accumulator element (hh, j, e) of a 64 x NC tile: row 16*wl + lane/4 + 8*hh,
  // column 8*j + 2*(lane%4) + e; index 4*j + 2*hh + e.
  const int krow = kw0 + 16 * wl + lane / 4;  // key of element hh = 0
  float dv[D / 2], dk[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dv[i] = 0.f;
  const u32 ka_off = 64 * wg * 128;      // this warpgroup's rows inside a K/V tile (per panel)
  const u32 dsa = base + S::DS + 64 * wg * 128;  // this warpgroup's dSᵀ rows (buffer 0)
  int g = 0;                             // ring slot counter (both passes)
#if PW90_BWD_DQ_WRITER
  int staged = 0;                        // dQ panels this warpgroup has staged
#endif

  auto store_rows = [&](const float (&acc)[D / 2], u16* ptr, i64 sb, i64 sh, i64 sr, float scale) {
    // Lane re-read here (volatile): otherwise ptxas keeps the 64-bit column offset alive
    // across both passes and, at D = 128, spills it.
    u32 lid;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lid));
    const int r0 = kw0 + 16 * wl + (int)(lid / 4);
    // A packed sequence's first key row, re-read (volatile) rather than kept live through
    // the passes: the registers are all taken there.
    int k0 = 0;
    if constexpr (VARLEN) asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(k0) : "l"(p.cu_k + b));
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = r0 + 8 * hh;
      if (r < N) {
        u16* dst = ptr + (i64)b * sb + (i64)hk * sh + (i64)(k0 + r) * sr + 2 * (lid % 4);
#pragma unroll
        for (int j = 0; j < DV / 8; ++j)  // the stored columns (DV < D: zero padding computed)
          *reinterpret_cast<u32*>(dst + 8 * j) =
              Cvt<T>::pack(acc[4 * j + 2 * hh] * scale, acc[4 * j + 2 * hh + 1] * scale);
      }
    }
  };

  // The two passes share one copy of the code (PAIR is a run-time value): two inlined copies
  // let ptxas place dK/dV differently in each, and at D = 128 the moves between them made it
  // serialise every wgmma of the kernel (C7512).
#pragma unroll 1
  for (int PAIR = 1; PAIR <= 2; ++PAIR) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = 0.f;
    const u32 kpair = base + (PAIR == 1 ? S::K1 : S::K2);
    for (int hq = 0; hq < group; ++hq) {
      const int h = hk * group + hq;
      (void)h;  // (used by the dQ accumulator address only)
      for (int t = walk.lo(PAIR); t < walk.hi(PAIR); ++t) {
        if (!walk.template visit<CAUSAL>(PAIR, t)) continue;
        const int stage = g % STAGES, slot = g & 1;  // ring stage; dSᵀ buffer (DQ)
        mbar_wait(full0 + 8 * stage, (g / STAGES) & 1);
        ++g;
        const int m0 = t * BM;
        const u32 st = base + S::RING + stage * S::STAGE;
        const u32 qpa = st, doa = st + S::Q_TILE;  // Q of this pass (Q1 or Q2), dO
        const u32 stats = base + S::STATS + stage * S::STATS_STAGE;
        // This warpgroup's 64 keys against the 64 queries of the tile.
        const int dmin = m0 + P - (kw0 + 63), dmax = m0 + BM - 1 + P - kw0;
        const bool live = kw0 < N && (!CAUSAL || dmax >= 0);
        const int wmode = block_mode<CAUSAL>(m0, BM, kw0, 64, P, w);
        const bool work = live && (wmode & PAIR);
        // With fused dQ both warpgroups take part in every tile the CTA visits (they share
        // the dSᵀ buffer and a barrier); one with nothing to do computes with every element
        // masked (P = dS = 0), which only happens on edge tiles.
        if (!DQ && !work) {
          mbar_arrive(empty0 + 8 * stage);
          continue;
        }
        // Elements of a straddling block (wmode == 3) on the other pair's side of d = w are
        // masked (P = 0): each (key, query) element enters dV, dK and dQ in exactly one pass.
        const bool split = wmode == 3;
        const bool edge = !work || kw0 + 64 > N || (CAUSAL && dmin < 0);
        // distance of element (hh, j, e) = dbase + 8*j + e - 8*hh
        const int dbase = m0 + 2 * (lane % 4) + P - krow;
        const int rows_left = N - krow;  // element (hh, ...) is a key < N iff 8*hh < rows_left

        // Sᵀ and dPᵀ in QH chunks of NC query columns (D = 128: two chunks of 32, so that
        // dV + dK (128 registers) + S + dP of a chunk fit the 240-register budget); each chunk's
        // Pᵀ and dSᵀ are packed to 16 bits as soon as they are computed. Element pair
        // (column block j, hh) -> register 2*(j%2) + hh of k-step j/2 (the A-operand layout).
        u32 pa[BM / 16][4], da[BM / 16][4];
#pragma unroll
        for (int c = 0; c < QH; ++c) {
          float s[NC / 2], dp[NC / 2];
          reg_fence(dv);
          reg_fence(dk);
          wg_fence();
          gemm_kmajor<T, D, NC>(s, kpair + ka_off, S::K_PANEL, qpa + c * NC * 128, S::Q_PANEL);
          gemm_kmajor<T, D, NC>(dp, base + S::V + ka_off, S::K_PANEL, doa + c * NC * 128, S::Q_PANEL);
          wg_commit();
          wg_wait<0>();
          reg_fence(s);
          reg_fence(dp);
          // Pᵀ and dSᵀ of this chunk, in two copies behind a warpgroup-uniform branch. MASKED:
          // the per-element mask of edge and straddling blocks; interior blocks, most of a long
          // row's, skip its ~6 instructions an element (a branch-free mask on every block was
          // ~190 of the ~930 SASS instructions per tile at D = 128, in the softmax segment
          // that the tensor cores wait behind). The mask inputs pass through an empty asm in
          // the masked copy: otherwise ptxas computes all the per-element distances before
          // the GEMMs, ~30 registers that the D = 128 build does not have.
          auto softmax = [&](auto masked_c) {
            constexpr bool MASKED = decltype(masked_c)::value;
            int db = dbase, rl = rows_left;
            if constexpr (MASKED) asm volatile("" : "+r"(db), "+r"(rl));
#pragma unroll
            for (int jj = 0; jj < NC / 8; ++jj) {
              const int j = c * (NC / 8) + jj;
              float lse2v[2], delv[2];
              lds_f2(stats + (8 * j + 2 * (lane % 4)) * 4, lse2v[0], lse2v[1]);
              lds_f2(stats + BM * 4 + (8 * j + 2 * (lane % 4)) * 4, delv[0], delv[1]);
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                float pr[2], ds[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const int idx = 4 * jj + 2 * hh + e;
                  bool keep = true;
                  if constexpr (MASKED) {
                    // branch-free (bitwise, not short-circuit), and below the argument of ex2
                    // is selected, not its result: no per-element branch
                    const int d = db + 8 * j + e - 8 * hh;
                    keep = !edge | (work & (8 * hh < rl) & (!CAUSAL | (d >= 0)));
                    keep = keep & (!split | (PAIR == 1 ? d < w : d >= w));
                  }
                  pr[e] = exp2f_approx(keep ? fmaf(s[idx], sl2, -lse2v[e]) : PW90_NEG_INF);
                  ds[e] = pr[e] * (dp[idx] - delv[e]);
                }
                pa[j / 2][2 * (j % 2) + hh] = Cvt<T>::pack(pr[0], pr[1]);
                da[j / 2][2 * (j % 2) + hh] = Cvt<T>::pack(ds[0], ds[1]);
              }
            }
          };
          if (edge | split) softmax(BoolC<true>{});  // warpgroup-uniform
          else softmax(BoolC<false>{});
        }
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
          reg_fence(pa[kk]);
          reg_fence(da[kk]);
        }
        reg_fence(dv);
        reg_fence(dk);
        wg_fence();
        gemm_rs<T, D>(dv, pa, doa);
        gemm_rs<T, D>(dk, da, qpa);
        wg_commit();
        if constexpr (DQ) {
          // dSᵀ to shared memory (buffer `slot`, this warpgroup's 64 key rows): key row r,
          // query c at byte r*128 + ((c/8) ^ (r%8))*16 + (c%8)*2 (the 128-byte swizzle TMA
          // would produce). Then both warpgroups meet: each dQ product below reads all 128
          // key rows. Two buffers: a warpgroup writes tile g+2's dSᵀ into this one only
          // after the barrier of tile g+1, which the other warpgroup reaches only after its
          // tile-g product (read of this buffer) has completed.
#pragma unroll
          for (int j = 0; j < BM / 8; ++j)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int r = 16 * wl + lane / 4 + 8 * hh;
              sts_u32(dsa + slot * S::DS_BYTES + r * 128 + ((j ^ (r & 7)) << 4) + 4 * (lane % 4),
                      da[j / 2][2 * (j % 2) + hh]);
            }
          fence_proxy_async();
          named_bar_sync(1, CONSUMERS);
        }
        wg_wait<0>();
        reg_fence(dv);
        reg_fence(dk);
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
          reg_fence(pa[kk]);
          reg_fence(da[kk]);
        }
        mbar_arrive(empty0 + 8 * stage);  // Q/dO/lse2/delta of this stage no longer read
        if constexpr (DQ) {
          // dQ(64 queries x 64-column panel pn) = dS · K over all BN = 128 keys of the CTA,
          // panel pn by warpgroup (pn + slot) % 2: at D = 128 each warpgroup takes one panel
          // per tile, at D = 64 they alternate tiles. Summing the two warpgroups' keys on chip
          // halves the float32 atomic traffic (the bound of this kernel: 4 B x M x D per key
          // tile and pass) against each adding its own 64 keys.
          float* dst = p.dq_acc + ((((i64)(PAIR - 1) * p.B + sq.tb) * p.H + h) * p.Mpad + sq.row0 + m0) * D;  // tile block
          const u32 dsb = base + S::DS + slot * S::DS_BYTES;
#pragma unroll
          for (int pn = 0; pn < D / 64; ++pn) {
            if (((pn + slot) & 1) != wg) continue;  // warpgroup-uniform
            float dq[32];
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
              const u64 a = desc_at(smem_desc(dsb, 64 * 128, 1024), kk * 2048);
              const u64 bb = desc_at(smem_desc(kpair + pn * S::K_PANEL, S::K_PANEL, 1024), kk * 2048);
              WgmmaT<T, 64>::template ss<1, 1>(dq, a, bb, kk > 0 ? 1 : 0);
            }
            wg_commit();
            wg_wait<0>();
            reg_fence(dq);
#if PW90_BWD_DQ_WRITER
            // Stage the panel (accumulator order: a thread's column block j is 16 contiguous
            // bytes, conflict-free) once the writer warp has read the previous one, and go on.
            const u32 buf = base + S::DQBUF + wg * S::DQBUF_BYTES;
            const u32 dqf = base + S::DQBARS + 8 * wg, dqe = dqf + 16;
            // this warpgroup's k-th panel (k = staged): the writer has read panel k - 1
            mbar_wait(dqe, (staged & 1) ^ 1);
            ++staged;
#pragma unroll
            for (int j = 0; j < 8; ++j)
              sts_f4(buf + 4 * dq_run(0, wl, j, lane), dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
            // where the writer adds it (read by the writer after the mbarrier's acquire)
            if (threadIdx.x % 128 == 0) sts_u64(base + S::DQPTR + 8 * wg, (u64)(dst + pn * 4096));
            fence_proxy_async();  // the generic-proxy stores, before the async-proxy bulk read
            mbar_arrive(dqf);
#else
            dq_red_panel(dst, pn, dq, wl, lane);
#endif
          }
        }
      }
    }
    if (PAIR == 1) store_rows(dk, p.dk1, p.dk1_sb, p.dk1_sh, p.dk1_sr, p.sm_scale);
    else store_rows(dk, p.dk2, p.dk2_sb, p.dk2_sh, p.dk2_sr, p.sm_scale);
  }
#if PW90_BWD_DQ_WRITER
  if constexpr (DQ) {  // no more panels: a null address in this warpgroup's next staging turn
    mbar_wait(base + S::DQBARS + 16 + 8 * wg, (staged & 1) ^ 1);
    if (threadIdx.x % 128 == 0) sts_u64(base + S::DQPTR + 8 * wg, 0);
    mbar_arrive(base + S::DQBARS + 8 * wg);
  }
#endif
  store_rows(dv, p.dv, p.dv_sb, p.dv_sh, p.dv_sr, 1.f);
}

template <int D, bool CAUSAL>
PW90 void producer(const BwdParams& p, const TmaDesc* tq1, const TmaDesc* tq2, const TmaDesc* tdo,
                   const TmaDesc* tk1, const TmaDesc* tk2, const TmaDesc* tv, u32 base, u32 kbar,
                   u32 full0, u32 empty0, int n0, int hk, const BwdSeq sq) {
  using S = Smem<D>;
  Walk walk;
  walk.template init<CAUSAL>(sq.M, sq.P, p.w, n0);
  const int b = sq.tb, kr = sq.k0 + n0;  // TMA batch coordinate; first key row of the tile
  const bool need1 = walk.lo(1) < walk.hi(1), need2 = walk.lo(2) < walk.hi(2);
  if (!need1 && !need2) return;  // no query sees these keys: the consumers store zeros
  mbar_expect_tx(kbar, ((need1 ? 1 : 0) + (need2 ? 1 : 0) + 1) * S::K_TILE);
#pragma unroll
  for (int pn = 0; pn < S::PANELS; ++pn) {
    if (need1) tma_load_4d(base + S::K1 + pn * S::K_PANEL, tk1, 64 * pn, kr, hk, b, kbar);
    if (need2) tma_load_4d(base + S::K2 + pn * S::K_PANEL, tk2, 64 * pn, kr, hk, b, kbar);
    tma_load_4d(base + S::V + pn * S::K_PANEL, tv, 64 * pn, kr, hk, b, kbar);
  }
  const int group = (int)p.group;
  int g = 0;
#pragma unroll 1
  for (int pair = 1; pair <= 2; ++pair)
    for (int hq = 0; hq < group; ++hq) {
      const int h = hk * group + hq;
      const float* lse2 = p.lse2 + ((i64)b * p.H + h) * p.Mpad + sq.row0;
      const float* delta = p.delta + ((i64)b * p.H + h) * p.Mpad + sq.row0;
      for (int t = walk.lo(pair); t < walk.hi(pair); ++t) {
        if (!walk.template visit<CAUSAL>(pair, t)) continue;
        const int stage = g % STAGES;
        mbar_wait(empty0 + 8 * stage, ((g / STAGES) & 1) ^ 1);
        ++g;
        const int m0 = t * BM;
        const u32 st = base + S::RING + stage * S::STAGE, fb = full0 + 8 * stage;
        const u32 stats = base + S::STATS + stage * S::STATS_STAGE;
        mbar_expect_tx(fb, 2 * S::Q_TILE + 2 * BM * 4);
#pragma unroll
        for (int pn = 0; pn < S::PANELS; ++pn) {  // Q of the pass's pair, then dO
          tma_load_4d(st + pn * S::Q_PANEL, pair == 1 ? tq1 : tq2, 64 * pn, sq.q0 + m0, h, b, fb);
          tma_load_4d(st + S::Q_TILE + pn * S::Q_PANEL, tdo, 64 * pn, sq.q0 + m0, h, b, fb);
        }
        bulk_load(stats, lse2 + m0, BM * 4, fb);
        bulk_load(stats + BM * 4, delta + m0, BM * 4, fb);
      }
    }
}

// DQ_WRITER: one thread of warp 1 adds the staged dQ panels to the accumulator by bulk
// reduce-adds, in the order the consumers stage them: the buffers alternate (D = 128: both
// warpgroups' panels of a tile, warpgroup 0 first; D = 64: the tile's panel, staged by
// warpgroup slot = tile & 1), so the i-th panel is warpgroup i % 2's (i / 2)-th. The address
// comes with the panel (Smem::DQPTR), so this thread needs a handful of registers (a version
// that walked the tiles itself spilled); a null address ends the walk.
template <int D> PW90 void dq_writer(u32 base) {
  using S = Smem<D>;
  const u32 dqf0 = base + S::DQBARS, dqe0 = dqf0 + 16;
#pragma unroll 1
  for (int i = 0;; ++i) {
    const int w = i & 1;
    mbar_wait(dqf0 + 8 * w, (i >> 1) & 1);
    const u64 dst = lds_u64(base + S::DQPTR + 8 * w);
    if (dst == 0) break;
    bulk_reduce_add_f32(reinterpret_cast<float*>(dst), base + S::DQBUF + w * S::DQBUF_BYTES, S::DQBUF_BYTES);
    bulk_commit();
    bulk_wait_read0();  // the buffer has been read: the warpgroup may stage its next panel
    mbar_arrive(dqe0 + 8 * w);
  }
  bulk_wait0();  // every reduce-add complete before the CTA's shared memory goes away
}

// ---------------------------------------------------------------- helper kernels' arguments
struct PrepParams {
  const u16* o;
  i64 o_sb, o_sh, o_sr;
  const u16* dout;
  i64 do_sb, do_sh, do_sr;
  const float* lse;  // (B, H, M) contiguous, natural log
  float* lse2;       // (B, H, Mpad) out
  float* delta;      // (B, H, Mpad) out
  float* dq_acc;     // (2, B, H, Mpad, D) zeroed here; null: not touched
  i64 B, H, M, Mpad;
  const float* dlse;  // (B, H, M) contiguous gradient of lse, or null: delta -= dlse
  i64 rows;           // padded rows per (b, h) of the grid: Mpad, or (VARLEN) the longest sequence's
  const int* cu_q;    // VARLEN: B + 1 running totals; M is total_q, lse/dlse (H, total_q), B 1
};

struct ConvertParams {
  u16* dq1;
  i64 dq1_sb, dq1_sh, dq1_sr;
  u16* dq2;
  i64 dq2_sb, dq2_sh, dq2_sr;
  const float* dq_acc;  // (2, B, H, Mpad, D)
  i64 B, H, M, Mpad;
  float sm_scale;
  i64 rows;           // query rows per (b, h) of the grid: M, or (VARLEN) the longest sequence
  const int* cu_q;    // VARLEN: B + 1 running totals (then M is total_q and B is 1)
};

// Host packers (cupy_piecewise/launch.py _BWD_*, scripts/hopper_bwd_probe.py) rely on these sizes.
static_assert(sizeof(BwdParams) == 208, "BwdParams layout");
static_assert(sizeof(PrepParams) == 152, "PrepParams layout");
static_assert(sizeof(ConvertParams) == 128, "ConvertParams layout");

}  // namespace bwd
}  // namespace pw90

// The helper kernels' grid: (H * ceil(rows / 16), B), 256 threads; block x covers 16 rows
// (group g = x % ceil(rows / 16)) of head x / ceil(rows / 16), and warp k of it the row pair
// (16 g + k, 16 g + k + 8): the two rows whose dQ share the float4 runs of the accumulator
// (dq_run), so that the convert kernel reads whole runs, and each warp has twice the loads in
// flight of a warp per row. `rows`: the rows of one (batch entry, head) the grid covers.
namespace pw90 {
namespace bwd {
struct RowPair {
  i64 h;
  int i;  // the pair's first row: i and i + 8, both in one 64-row tile
};
PW90 RowPair row_pair(i64 rows) {
  const i64 groups = (rows + 15) / 16;
  RowPair r;
  r.h = blockIdx.x / groups;
  r.i = (int)(blockIdx.x % groups) * 16 + threadIdx.x / 32;
  return r;
}
}  // namespace bwd
}  // namespace pw90

// rows = Mpad (dense) or the longest sequence rounded up to 64 (VARLEN). Zeroes the float32
// dQ accumulator (when given) in linear order with float4 stores across the whole grid (zeros
// need no particular order: the old per-row zeroing in dq_run order wrote half-sectors), then
// lse2 and delta of every padded row; a VARLEN row past its sequence's padded rows is skipped.
template <typename T, int D, bool VARLEN = false, int DV = D>
__global__ void __launch_bounds__(256) pw90_bwd_prep(const pw90::bwd::PrepParams p) {
  using namespace pw90;
  if (p.dq_acc) {
    const i64 n4 = 2 * p.B * p.H * p.Mpad * (D / 4);
    const i64 stride = (i64)gridDim.x * gridDim.y * blockDim.x;
    float4* acc = reinterpret_cast<float4*>(p.dq_acc);
    for (i64 k = ((i64)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x; k < n4; k += stride)
      acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const int lane = threadIdx.x % 32;
  const bwd::RowPair rp = bwd::row_pair(p.rows);
  const bwd::BwdSeq sq = bwd::bwd_seq<VARLEN>(p, blockIdx.y);
  const i64 b = sq.tb, h = rp.h, M = sq.M;
  if (h >= p.H || rp.i >= (VARLEN ? (M + 63) / 64 * 64 : p.rows)) return;
  // both rows' loads first, then the two sums (the loads of a row pair in flight together)
  constexpr int NC = (DV + 63) / 64;
  u32 ov[2][NC], dv[2][NC];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const i64 i = rp.i + 8 * hh;
    const u16* o = p.o + b * p.o_sb + h * p.o_sh + (sq.q0 + i) * p.o_sr;
    const u16* d = p.dout + b * p.do_sb + h * p.do_sh + (sq.q0 + i) * p.do_sr;
#pragma unroll
    for (int k = 0; k < NC; ++k) {
      const int c = 64 * k + 2 * lane;
      const bool in = i < M && c < DV;  // the tensors' DV columns of the real rows
      ov[hh][k] = in ? *reinterpret_cast<const u32*>(o + c) : 0u;
      dv[hh][k] = in ? *reinterpret_cast<const u32*>(d + c) : 0u;
    }
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const i64 i = rp.i + 8 * hh;
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < NC; ++k) {
      acc += bwd::ToF<T>::f((u16)(ov[hh][k] & 0xffff)) * bwd::ToF<T>::f((u16)(dv[hh][k] & 0xffff));
      acc += bwd::ToF<T>::f((u16)(ov[hh][k] >> 16)) * bwd::ToF<T>::f((u16)(dv[hh][k] >> 16));
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
      const i64 idx = (b * p.H + h) * p.Mpad + sq.row0 + i;
      const i64 li = (b * p.H + h) * p.M + sq.q0 + i;  // lse: (B, H, M) or (H, total_q)
      const float l = i < M ? p.lse[li] : PW90_NEG_INF;
      // lse = -inf: no admissible key; lse2 = +inf makes P = exp2(s - lse2) = 0 for the row
      p.lse2[idx] = l == PW90_NEG_INF ? -PW90_NEG_INF : l * PW90_LOG2E;
      // a gradient into lse: ds = p * (dp - delta + dlse); none on rows without keys
      if (p.dlse != nullptr && l != PW90_NEG_INF) acc -= p.dlse[li];
      p.delta[idx] = acc;
    }
  }
}

// rows = M, or with VARLEN the longest sequence. Each lane reads one float4 run per 64-column
// panel, (rows i, i + 8) x (columns 64 pn + 2 lane, + 1): a warp's load covers eight 64-byte
// pieces, a row's store 128 contiguous bytes.
template <typename T, int D, bool VARLEN = false, int DV = D>
__global__ void __launch_bounds__(256) pw90_bwd_dq_convert(const pw90::bwd::ConvertParams p) {
  using namespace pw90;
  const int lane = threadIdx.x % 32;
  const bwd::RowPair rp = bwd::row_pair(p.rows);
  const bwd::BwdSeq sq = bwd::bwd_seq<VARLEN>(p, blockIdx.y);
  const i64 b = sq.tb, h = rp.h;
  const int i = rp.i, wl = (i % 64) / 16, r8 = i % 8;
  if (h >= p.H || i >= sq.M) return;
  const bool second = i + 8 < sq.M;
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    const float* tile = p.dq_acc + (((i64)pair * p.B + b) * p.H + h) * p.Mpad * D + (i64)(sq.row0 + i / 64 * 64) * D;
    u16* dst = pair == 0 ? p.dq1 + b * p.dq1_sb + h * p.dq1_sh + (sq.q0 + i) * p.dq1_sr
                         : p.dq2 + b * p.dq2_sb + h * p.dq2_sh + (sq.q0 + i) * p.dq2_sr;
    const i64 next = 8 * (pair == 0 ? p.dq1_sr : p.dq2_sr);  // row i + 8
#pragma unroll
    for (int pn = 0; pn < D / 64; ++pn) {
      const int c = 64 * pn + 2 * lane;
      if (c >= DV) continue;  // the tensors' DV columns
      const float4 v = *reinterpret_cast<const float4*>(tile + bwd::dq_run(pn, wl, lane / 4, 4 * r8 + lane % 4));
      *reinterpret_cast<u32*>(dst + c) = Cvt<T>::pack(v.x * p.sm_scale, v.y * p.sm_scale);
      if (second) *reinterpret_cast<u32*>(dst + next + c) = Cvt<T>::pack(v.z * p.sm_scale, v.w * p.sm_scale);
    }
  }
}

// Grid (ceil(N / 128), Hkv, B); 384 threads; dynamic shared memory pw90::bwd::Smem<D>::BYTES.
// Tensor maps (cupy_piecewise/tma.py tensor_map_bhld): 4-D {D, rows, heads, batch}, box
// {64, 64, 1, 1} for q1, q2, dout over (M, H) and {64, 128, 1, 1} for k1, k2, v over (N, Hkv);
// 128-byte swizzle, zero fill out of bounds.
// VARLEN (a packed variable-length batch): the maps describe the packed arrays as batch 1, the
// grid is (ceil(longest key sequence / 128), Hkv, B), and a CTA whose key tile starts past its
// sequence's end leaves at once. Query rows of the next sequence that a tile's box reaches
// get P = 0 from the +inf padding of lse2 (BwdSeq); key rows of it are masked and not stored.
// DV < D (head dims 80 and 96 on the D = 128 kernel): as in pw90_forward, the TMA boxes fill
// the columns past DV with zeros, the products carry them (dK, dV, dQ zero there), and the
// stores and the helper kernels touch DV columns only.
template <typename T, int D, bool CAUSAL, bool DQ, bool VARLEN = false, int DV = D>
__global__ void __launch_bounds__(pw90::bwd::THREADS, 1)
    pw90_bwd(const __grid_constant__ pw90::TmaDesc tq1, const __grid_constant__ pw90::TmaDesc tq2,
             const __grid_constant__ pw90::TmaDesc tdo, const __grid_constant__ pw90::TmaDesc tk1,
             const __grid_constant__ pw90::TmaDesc tk2, const __grid_constant__ pw90::TmaDesc tv,
             const pw90::bwd::BwdParams p) {
  using namespace pw90;
  using namespace pw90::bwd;
  using S = Smem<D>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 kbar = base + S::BARS, full0 = kbar + 8, empty0 = kbar + 8 + 8 * STAGES;
  const int n0 = blockIdx.x * BN, hk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  BwdSeq sq = bwd_seq<VARLEN>(p, b);
  bwd_keys<VARLEN>(p, b, sq);
  if (VARLEN && n0 >= sq.N) return;  // uniform over the CTA, before any barrier is used

  if (threadIdx.x == 0) {
    mbar_init(kbar, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);           // the producer's arrive.expect_tx
      mbar_init(empty0 + 8 * s, CONSUMERS);  // every consumer thread
    }
#if PW90_BWD_DQ_WRITER
    for (int w = 0; w < 2; ++w) {
      mbar_init(base + S::DQBARS + 8 * w, CONSUMERS / 2);  // dq_full: the warpgroup's threads
      mbar_init(base + S::DQBARS + 16 + 8 * w, 1);         // dq_empty: the writer
    }
#endif
    mbar_init_fence();
  }
  __syncthreads();

  if (warp < 4) {  // ---------------------------------------------------------------- producer
    regs_dec<PRODUCER_REGS>();
    if (warp == 0 && lane == 0) {
      tma_prefetch_desc(&tq1);
      tma_prefetch_desc(&tq2);
      tma_prefetch_desc(&tdo);
      producer<D, CAUSAL>(p, &tq1, &tq2, &tdo, &tk1, &tk2, &tv, base, kbar, full0, empty0, n0, hk, sq);
    }
#if PW90_BWD_DQ_WRITER
    // else-if: no value of the writer's stays live through the producer's code
    else if (DQ && warp == 1 && lane == 0) dq_writer<D>(base);
#endif
  } else {  // ------------------------------------------------------------------------ consumers
    regs_inc<CONSUMER_REGS>();
    consumer<T, D, CAUSAL, DQ, VARLEN, DV>(p, base, kbar, full0, empty0, n0, hk, b, sq);
  }
}
