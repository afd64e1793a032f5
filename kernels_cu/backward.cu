// Backward pass, two schemes sharing the delta pre-pass and the dk/dv kernel (and, for dense
// 16-bit batches where the table says so, the warp-grid one-kernel backward at the end of
// this file, pw_backward_grid, which replaces the FUSED dk/dv kernel below):
//
// Deterministic (two kernels that each own one side of the score matrix and recompute
// scores from the saved log-sum-exp; no atomics, bitwise reproducible):
//   pw_backward_dq:  one block per (query tile, head, batch)  -> dq1, dq2
//   pw_backward_dkv: one block per (key tile, kv head, batch)  -> dk1, dk2, dv, summing the
//                    query heads of its grouped-query group on chip.
// Fused (the default for 16-bit inputs; FlashAttention-2's scheme): pw_backward_dkv built
// with FUSED also computes, per streamed query tile, dQ_pair += dS_pair K_pair and adds it to
// a float32 accumulator in global memory with atomics (red.global.add); the pre-pass zeroes
// the accumulator and pw_backward_dq_convert turns it into dq1, dq2. Five products per tile
// visit (S, dP, dV, dK, dQ) instead of the two kernels' seven (the dq kernel recomputes S and
// dP), at the price of float32 reductions in L2 and of run-to-run bit differences in dq.
//
// A row of dq (a row of dk) receives pair-2 terms from the keys (queries) on one side of the
// d = w line and pair-1 terms from the other side, overlapping only in the few tiles that
// straddle it. Rather than hold two D-wide accumulators, each kernel makes two passes: one
// over the tiles that touch pair 1, one over those that touch pair 2, recomputing only the
// straddling tiles twice.
#include "params.cuh"
#include "traits.cuh"

// The fused backward's dQ reductions on sm_90: 16-byte (1, default) or 8-byte (0) (add_dq).
#ifndef PW_DQ_RED4
#define PW_DQ_RED4 1
#endif
// PW_DQ_PERM (1, the default since 2026-12-07; 0, the natural order, an A/B build): the one-kernel backwards' float32 dQ
// accumulator in a permuted column order, so that red_block16 needs no lane swap: inside each
// 16-column group, columns 2t, 2t + 1, 8 + 2t, 9 + 2t (thread t = lane % 4's two accumulator
// pairs of a row) sit at 4t .. 4t + 3, one 16-byte reduction per row as they are. The swap
// (PW_DQ_RED4) costs 4 selects, 4 shuffles and about 10 moves per 16 x 16 block (SASS: some
// 130 instructions per tile of the D = 64 warp-grid backward, whose loop is about 1400).
// pw_backward_dq_convert reads the permuted order back; nothing else reads the accumulator
// (a caller's, core.SharedRows, reaches dq only through that conversion).
#ifndef PW_DQ_PERM
#define PW_DQ_PERM 1
#endif

// float16's P in the dk/dv kernel takes a fixed factor 2^14 (PW_BWD_P_FIXED=1, the default)
// instead of fit_rows' per-row scale. P = 2^(s - lse2) is at most 1 (up to rounding) when lse
// is the forward's, so P * 2^14 stays below float16's 65504, and values down to 2^-28 stay
// normal (below that they lose bits as float16 subnormals, which the per-row scale avoids for
// keys whose every P is that small; their absolute error stays under 2^-39 |dO|, far inside
// SPEC's max-error term). The 14 enters as the bias of score_tile's scaling fma (common.cuh,
// scale_mask), so it costs no instruction; its rounding happens at magnitudes up to 14 larger,
// a relative change in P of order 2^-24 (|s| + 14), far below float16's 2^-11. It drops a
// max-abs reduction, two shuffles, 16 multiplies and dV's rescale branch per tile. On the
// H200 with the mma.sync path forced, float16 forward+backward gained 3-8% (deterministic)
// and 2-12% (one-kernel entries): bench/results/2026-12-04-h200-fixed-p-lazy-rescale.
// An lse below the row's true log-sum-exp (not the forward's) would overflow P to inf where
// the per-row scale copes.
// PW_BWD_P_FIXED=0 builds the per-row scale in the dq and dk/dv kernels, for A/B runs (the
// warp-grid kernel, pw_backward_grid, has no per-row path: it then rounds P unscaled).
// KEEP_ROW_SCALE exempts one entry: the sm_90 row's one-kernel D = 128 causal backward (BM = 32)
// spills 16 bytes with the fixed factor (NVRTC 13.5, 2026-12-04; 245 registers without), and
// the build check refuses spills (cupy_piecewise/build_check.py). The spill is four
// loop-invariant address terms, stored before the tile loop and reloaded once each per tile
// (4 LDL in a loop of about 1600 instructions, SASS); forming dS by one fma did not remove it.
// -DPW_BWD_P_FIXED_EXEMPT=0 builds that entry with the fixed factor anyway: 1.036-1.053x
// faster on the H200 with the spill (float16 causal D = 128, L 2048/8192), and spill-free
// with PW_BWD_TID_RELOAD=2 (below) in its dense form; its packed-batch (varlen) form still
// spills 8 bytes with both, so the default, 2, exempts that form alone (1, the earlier
// default: both forms).
#ifndef PW_BWD_P_FIXED
#define PW_BWD_P_FIXED 1
#endif
// PW_BWD_TID_RELOAD (2, the default; 0: off): the dk/dv tile loop re-reads threadIdx.x each
// tile (tid_reload, common.cuh) and derives lane and warp from it there, so ptxas recomputes
// the lane- and warp-derived shared-memory offsets inside the loop instead of holding them
// across it. 1: every dk/dv entry; 2: only the exempt entry below where it takes the fixed P
// scale, which then builds in 254 registers and no spill (sm_90 32x64x4 float16 causal
// D = 128; NVRTC 13.5, 2026-12-04). Measured on the H200 (scripts/mma_bwd_ab.py,
// bench/results/2026-12-04-h200-mma-vs-flag-attn): 1 is 0.6-2.3% slower on every entry
// although its loops are 1-8% shorter (static), while 1 with PW_BWD_P_FIXED_EXEMPT=0 runs the
// exempt entry 1.041x faster, as the fixed scale with its spill did (1.036-1.053x). So 2 with
// PW_BWD_P_FIXED_EXEMPT=2 is the spill-free form of that gain (the packed-batch form keeps
// the per-row scale: it spills either way): 1.045-1.049x on that entry (float16 causal
// D = 128, L 2048/8192), the other D = 128 entries 0.998-1.016x (bench/results/
// 2026-12-04-h200-staged-defaults). The GPU suite, memcheck and racecheck ran on it before
// it became the default.
#ifndef PW_BWD_TID_RELOAD
#define PW_BWD_TID_RELOAD 2
#endif
#ifndef PW_BWD_P_FIXED_EXEMPT
#define PW_BWD_P_FIXED_EXEMPT 2
#endif
template <typename T, bool KEEP_ROW_SCALE = false> struct FixedP {
  static constexpr bool on = PW_BWD_P_FIXED != 0 && RowScale<T>::active && !KEEP_ROW_SCALE;
  static constexpr int ex = 14;  // P carries 2^ex
  // added to the log2 scores by score_tile's scaling fma; 0 (a plain multiply) otherwise
  static constexpr int bias = on ? ex : 0;
};

// PW_BWD_DS_PRESCALE=1 (the default): float16's dS leaves its product already at the row's
// current scale 2^e, in both deterministic kernels, so fit_scaled_rows (common.cuh) only
// checks it against float16's range (a warp vote per 16-row block) instead of fit_rows' per-row
// max-abs reduction, shuffles and per-element multiply. In the dq kernel the scale rides on
// the subtraction, fma(dp, 2^e, -delta 2^e); in the dk/dv kernel it joins P's 2^-14 in one
// factor 2^(e - 14). At PW_FIT_HEADROOM=0 (common.cuh; the default is 4, which rescales to a
// lower target and changes subnormal bits) the result is bitwise fit_rows' result: every
// changed product is by a power of two, exact in float32's normal range. With float16 inputs
// |dp - delta| < 2^41 (D = 256), so dS times the first tile's scale (2^60 in dq,
// PW_SCALE_INIT; 2^46 in dk/dv) stays finite unless a dlse beyond about 2^67 (dq) or 2^80
// enters delta; then the float16 gradients overflow in both builds, but the bits differ.
// The one-kernel backward keeps fit_rows: it stashes dS for dQ before dK's scale is applied
// (fitting its dK rows by the vote instead, PW_BWD_FUSED_VOTE, timed 0.98-1.02x on the H200
// and removed: bench/NOTES.md, twenty-fourth session). PW_BWD_DS_PRESCALE=0 builds the
// per-row fit in both kernels, for A/B runs.
#ifndef PW_BWD_DS_PRESCALE
#define PW_BWD_DS_PRESCALE 1
#endif

// PW_GRID_GROUP1 (1, the default; 0 for A/B): the warp-grid backward skips the integer
// division that maps a pass's tile index to (query head, tile) when there is no GQA
// (pw_backward_grid, tile_of).
// PW_GRID_TID_RELOAD (2, the default since 2026-12-06): the warp-grid backward's tile body
// re-reads threadIdx.x (tid_reload) for its lane- and warp-derived offsets at D > 64, which
// ptxas then recomputes every tile instead of holding them across the loop: at D = 128
// (64x128x8) the held form spills 84-92 bytes. 1: re-read at every D (the default before);
// 0: never re-read. At D = 64 (64x64x4) the held form builds in 244-246 registers
// without spills and its tile loop is 7% shorter (1546 -> 1437 instructions non-causal,
// 1604 -> 1488 causal; bf16, NVRTC 13.5 PTX through ptxas 13.0, scripts/offline_sass.py,
// 2026-12-06). At D = 64 time follows the instruction count more closely than at D = 128
// (bench/NOTES.md, thirty-third section: 4.57 G instructions against FlashAttention-2's
// 2.88 G for 1.29x its time), which is the reason it was timed: on an H100 the backward alone
// gained 1-3% at D = 64 (bench/results/2026-12-06-h100-one-barrier).
#ifndef PW_GRID_TID_RELOAD
#define PW_GRID_TID_RELOAD 2
#endif
#ifndef PW_GRID_GROUP1
#define PW_GRID_GROUP1 1
#endif
// PW_GRID_STASH_PLAIN (1, the default since 2026-12-07; 0 an A/B build): the warp-grid backward
// stashes Pᵀ without stash_ds's per-row key check. The check zeroes the rows of keys past N,
// a zeroing move beside each predicated pack (16 IMAD.MOV.U32 per stash at D = 64); Pᵀ's rows
// feed only dV's rows of the same keys (Pᵀ·dO), and the rows of keys past N are never stored,
// so what they hold does not matter. dSᵀ keeps the check: its rows reach dQ (dS·K, where a
// key past N has a zero row of K and an infinite P would make 0 · inf = NaN). Offline
// (scripts/offline_sass.py, bf16, 2026-12-07): the tile loop 1435 -> 1412 instructions at
// D = 64 non-causal (1487 -> 1456 causal), 2547 -> 2524 at D = 128 (fp16), no spills.
#ifndef PW_GRID_STASH_PLAIN
#define PW_GRID_STASH_PLAIN 1
#endif
// PW_GRID_GEOM32 (1, the default since 2026-12-07; 0 an A/B build): the warp-grid backward's
// per-tile geometry (the tile's mode, whether it needs the mask, the warp's Geom) in 32-bit
// integers instead of tile_mode / tile_needs_mask / make_geom's 64-bit ones, as the
// rotating-slot forward does. Every operand fits: lengths are below 2^30, the shift P lies in
// [-M, N] and w in [-(M + N + 1), M + N + 1] (core.plan.clamp_w), so m0 + P - n0 and the
// like stay inside +-2^31; Geom's clamps to +-2^30 are kept.
#ifndef PW_GRID_GEOM32
#define PW_GRID_GEOM32 1
#endif
// PW_GRID_FMA_EXP (1, the default since 2026-12-07; 0 an A/B build): the warp-grid backward takes
// raw scores from score_tile (scale 1, the multiply folded away, as the forward's RAW form)
// and scales them inside the exponent's fma, exp2(fma(s, scale_log2, bias - lse2)), instead
// of a multiply in score_tile and a subtraction here: one instruction fewer per element
// (32 per tile and thread), the per-column term (bias - lse2: FixedP's 2^bias rides there)
// computed once per column. Masked elements stay -inf (fma(-inf, scale > 0, finite) = -inf;
// a row with no admissible key has lse2 = +inf, as before: -inf, then 0). The four warp-grid
// macros (STASH_PLAIN, GEOM32, FMA_EXP and PW_DQ_PERM) took the tile loop from 1435 to 1267
// SASS instructions at D = 64 bf16 (1976 -> 1810 at D = 128). Timed together, the backward
// alone against the earlier default (scripts/mma_bwd_ab.py, two runs, H100, 2026-12-07,
// bench/results/2026-12-07-h100-bwd-macros): median 1.019x at D = 64 (0.939-1.085, the low
// end a 11%-spread row that ran 1.084 in the other run), 1.007x at D = 128 (0.977-1.030). The
// GPU suite, memcheck and racecheck ran under the four before they became the default.
#ifndef PW_GRID_FMA_EXP
#define PW_GRID_FMA_EXP 1
#endif
// PW_GRID_STAGGER (0, the default; 1 an A/B build, D = 64 only): the warp-grid backward's
// blocks of one head sweep each pass's query tiles starting at tile (key tile index mod the
// pass's count) instead of all at its first, so the blocks resident together add their dQ
// rows into different rows of the float32 accumulator at a time rather than the same ones
// (the reductions of every key tile of a head meet in the same L2 lines when they start
// together; ncu put the D = 64 kernel's L2 throughput at 68% against FlashAttention-2's 32%,
// bench/results/2026-12-05-h100-grid-diet). The sum's order per element changes (float32
// atomics are unordered anyway).
#ifndef PW_GRID_STAGGER
#define PW_GRID_STAGGER 0
#endif
// PW_GRID_DQ_FIRST (0, the default; 1 an A/B build, D = 64 only): the warp-grid backward forms
// dQ's product and issues its reductions before dK's product instead of after it, so the
// reductions' trip to L2 overlaps dK's tensor work rather than the next tile's wait and barrier.
#ifndef PW_GRID_DQ_FIRST
#define PW_GRID_DQ_FIRST 0
#endif

// delta[b, h, i] = sum_d dO[i, d] * O[i, d], one warp per row, 16-byte loads.
template <typename T, int D>
__global__ void __launch_bounds__(256) pw_backward_delta(const Params p) {
  const i64 row = (i64)blockIdx.x * 8 + threadIdx.x / 32;  // over H * M; blockIdx.y = batch
  const int lane = threadIdx.x % 32;
  if (row >= p.M * p.H) return;
  const i64 b = blockIdx.y, h = row / p.M, i = row % p.M;
  const u16* o = p.o.at(b, h) + i * p.o.sr;
  const u16* d = p.dout.at(b, h) + i * p.dout.sr;
  float acc = 0.f;
  if constexpr (Elem<T>::width == 2) {  // float32: four elements per 16-byte load
    for (int c = lane; c < D / 4; c += 32) {
      const float4 ov = reinterpret_cast<const float4*>(o)[c];
      const float4 dv = reinterpret_cast<const float4*>(d)[c];
      acc += ov.x * dv.x + ov.y * dv.y + ov.z * dv.z + ov.w * dv.w;
    }
  } else {
    for (int c = lane; c < D / 8; c += 32) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + 8 * c);
      const uint4 dv = *reinterpret_cast<const uint4*>(d + 8 * c);
      const u32 ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        acc += Elem<T>::to_float((u16)(ow[k] & 0xffff)) * Elem<T>::to_float((u16)(dw[k] & 0xffff));
        acc += Elem<T>::to_float((u16)(ow[k] >> 16)) * Elem<T>::to_float((u16)(dw[k] >> 16));
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  const i64 idx = (b * p.H + h) * p.M + i;
  if (lane == 0) {
    // A gradient into lse enters as ds = p * (dp - delta + dlse): subtract it here. A row
    // with lse = -inf (no admissible key) has p = 0 and takes none (dlse may be anything).
    if (p.dlse != nullptr && p.lse[idx] != PW_NEG_INF) acc -= p.dlse[idx];
    p.delta[idx] = acc;
  }
  if (p.dq_acc1 != nullptr) {  // the fused backward's dQ accumulators: this row of both
    float4* a1 = reinterpret_cast<float4*>(p.dq_acc1 + idx * D);
    float4* a2 = reinterpret_cast<float4*>(p.dq_acc2 + idx * D);
    for (int c = lane; c < D / 4; c += 32) a1[c] = a2[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// dq_pair = sm_scale * dq_acc_pair: the fused backward's float32 sums (pw_backward_dkv with
// FUSED) in the input dtype, after that kernel. The grid of the delta pre-pass: a warp per
// row over H * M rows (blockIdx.y = batch; a packed batch is one entry of H * total_q rows),
// each lane converting runs of eight elements (two float4 loads, one 16-byte store).
template <typename T, int D>
__global__ void __launch_bounds__(256) pw_backward_dq_convert(const Params p) {
  static_assert(Elem<T>::width == 1, "the fused backward is built for 16-bit inputs only");
  const i64 row = (i64)blockIdx.x * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.M * p.H) return;
  const i64 b = blockIdx.y, h = row / p.M, i = row % p.M;
  const i64 idx = (b * p.H + h) * p.M + i;
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    const float4* src = reinterpret_cast<const float4*>((pair ? p.dq_acc2 : p.dq_acc1) + idx * D);
    const Tensor& out = pair ? p.dq2 : p.dq1;
    u16* dst = out.mut(b, h) + i * out.sr;
    for (int c = lane; c < D / 8; c += 32) {
#if PW_DQ_PERM
      // columns 16j + 8h .. + 7 (j = c / 2, h = c % 2) from the permuted order (PW_DQ_PERM):
      // column 16j + 8h + 2t + e sits at 16j + 4t + 2h + e
      const float* g = reinterpret_cast<const float*>(src) + 16 * (c / 2) + 2 * (c % 2);
      const float2 a0 = *reinterpret_cast<const float2*>(g), a1 = *reinterpret_cast<const float2*>(g + 4);
      const float2 a2 = *reinterpret_cast<const float2*>(g + 8), a3 = *reinterpret_cast<const float2*>(g + 12);
      const float4 x = make_float4(a0.x, a0.y, a1.x, a1.y), y = make_float4(a2.x, a2.y, a3.x, a3.y);
#else
      const float4 x = src[2 * c], y = src[2 * c + 1];
#endif
      const float s = p.sm_scale;
      uint4 v;
      v.x = Elem<T>::pack(x.x * s, x.y * s);
      v.y = Elem<T>::pack(x.z * s, x.w * s);
      v.z = Elem<T>::pack(y.x * s, y.y * s);
      v.w = Elem<T>::pack(y.z * s, y.w * s);
      *reinterpret_cast<uint4*>(dst + 8 * c) = v;
    }
  }
}

// ---------------------------------------------------------------- fused dQ (FUSED builds)
PW_DEVICE void sts32(u32 addr, u32 v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// Two adjacent float32 sums into global memory, without a return value (red: the L2 adds).
PW_DEVICE void red_add2(float* at, float x0, float x1) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(at), "f"(x0), "f"(x1) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(at), "f"(x0) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(at + 1), "f"(x1) : "memory");
#endif
}

// The warp's dSᵀ fragments (its 16MW keys x the tile's BM queries), rounded to T, into the
// block's key-major dS buffer (BwdDkvTraits: BN rows, pitch PB bytes); sDS is the warp's
// first row. Rows at or past `keys` (keys past the end of K) are stored as zeros: their
// scores are 0 rather than masked, so their P = 2^-lse2 can be huge or infinite, and a
// zero row of K would turn that into NaN (the dk/dv kernel never stores such rows).
// Unscaled: the float16 range concern of fit_rows is met the way the Hopper backward meets
// it, by the caller's loss scaling (tolerance.float16_loss_scale).
template <typename T, int BM, int MW, int PB>
PW_DEVICE void stash_ds(u32 sDS, const float x[MW][BM / 8][4], int keys, int lane) {
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
    const bool lo = mi * 16 + lane / 4 < keys, hi = mi * 16 + lane / 4 + 8 < keys;
#pragma unroll
    for (int nb = 0; nb < BM / 8; ++nb) {
      const u32 at = sDS + (mi * 16 + lane / 4) * PB + (nb * 8 + 2 * (lane % 4)) * 2;
      sts32(at, lo ? Elem<T>::pack(x[mi][nb][0], x[mi][nb][1]) : 0u);
      sts32(at + 8 * PB, hi ? Elem<T>::pack(x[mi][nb][2], x[mi][nb][3]) : 0u);
    }
  }
}

// Adds a warp's 16 x 16 float32 block c (two m16n8 accumulators: columns 0-7 and 8-15) to
// rows g (lo) and g + 8 (hi) of a float32 accumulator in global memory, g = lane / 4:
// row_lo and row_hi point at column 2t of those rows (t = lane % 4), col is the block's first
// column; ok_lo and ok_hi say whether each row exists. One v2 reduction per accumulator
// pair, or (sm_90, PW_DQ_RED4) one v4 per row. (The pointer sums keep add_dq's order from
// before this helper existed, so its PTX did not change.)
template <bool FRESH_T = false>
PW_DEVICE void red_block16(float* row_lo, float* row_hi, int col, const float c[2][4],
                           bool ok_lo, bool ok_hi, int lane) {
#if PW_DQ_PERM
  // the permuted order (PW_DQ_PERM above): row_lo + 2t is the group's column 4t. FRESH_T
  // (add_dq): t from a fresh threadIdx.x read, as the lane's spilled 4 bytes in the packed
  // causal float16 D = 128 one-kernel entry; the warp-grid backward keeps the lane's (12
  // instructions fewer per tile)
  const int t2 = 2 * ((FRESH_T ? tid_reload() : lane) % 4);
  float* lo = row_lo + col + t2;
  float* hi = row_hi + col + t2;
#if __CUDA_ARCH__ >= 900
  if (ok_lo)
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(lo), "f"(c[0][0]),
                 "f"(c[0][1]), "f"(c[1][0]), "f"(c[1][1]) : "memory");
  if (ok_hi)
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(hi), "f"(c[0][2]),
                 "f"(c[0][3]), "f"(c[1][2]), "f"(c[1][3]) : "memory");
#else
  if (ok_lo) red_add2(lo, c[0][0], c[0][1]), red_add2(lo + 2, c[1][0], c[1][1]);
  if (ok_hi) red_add2(hi, c[0][2], c[0][3]), red_add2(hi + 2, c[1][2], c[1][3]);
#endif
#elif PW_DQ_RED4 && __CUDA_ARCH__ >= 900
  // Lanes t and t^1 swap halves so that each adds four contiguous floats of one row
  // (even t: block 0, columns 2t..2t+3; odd t: block 1, columns 8 + 2(t-1)..): half the
  // reduction instructions, +1.5-6% forward+backward on an H200 (bench/NOTES.md;
  // -DPW_DQ_RED4=0 builds the 8-byte form, the only one below sm_90).
  const bool odd = lane & 1;
  float x[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) x[e] = __shfl_xor_sync(0xffffffffu, odd ? c[0][e] : c[1][e], 1);
  // lo/hi point at column 2t: even t adds at 2t, odd t at 8 + 2(t - 1) = 2t + 6
  const float4 vlo = odd ? make_float4(x[0], x[1], c[1][0], c[1][1])
                         : make_float4(c[0][0], c[0][1], x[0], x[1]);
  const float4 vhi = odd ? make_float4(x[2], x[3], c[1][2], c[1][3])
                         : make_float4(c[0][2], c[0][3], x[2], x[3]);
  float* lo = row_lo + col + (odd ? 6 : 0);
  float* hi = row_hi + col + (odd ? 6 : 0);
  if (ok_lo)
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(lo), "f"(vlo.x),
                 "f"(vlo.y), "f"(vlo.z), "f"(vlo.w) : "memory");
  if (ok_hi)
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(hi), "f"(vhi.x),
                 "f"(vhi.y), "f"(vhi.z), "f"(vhi.w) : "memory");
#else
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int cj = col + j * 8;
    if (ok_lo) red_add2(row_lo + cj, c[j][0], c[j][1]);
    if (ok_hi) red_add2(row_hi + cj, c[j][2], c[j][3]);
  }
#endif
}

// acc[query row, :] += dS (BM x BN: the block's buffer, read transposed) · K (BN x D: the
// block's key tile of the pass's projection), for the tile's rows below `nvalid`; acc points
// at the float32 accumulator row of the tile's first query (D floats a row).
// The warps split the product into (16-row block, 16-column pair) units: with R = BM/16 row
// blocks and W warps, each warp takes R/W row blocks whole (R >= W), or one row block and
// every (W/R)-th column pair (R < W).
// A thread's accumulator fragment gives (row g, columns 2t, 2t+1): one v2 reduction each.
template <typename T, int D, int BM, int BN, int WARPS, int PB>
PW_DEVICE void add_dq(float* acc, int nvalid, u32 sDS, u32 sK, int warp, int lane) {
  constexpr int R = BM / 16, CP = D / 16;
  static_assert(R % WARPS == 0 || WARPS % R == 0, "warps split the row blocks evenly");
  constexpr int RPW = R >= WARPS ? R / WARPS : 1;  // row blocks per warp
  constexpr int WPR = R >= WARPS ? 1 : WARPS / R;  // warps per row block
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int rb = R >= WARPS ? warp * RPW + i : warp / WPR;
    // A(query, key) from the key-major buffer, k-step kk at a_row + kk * 16 rows
    const u32 a_row = sDS + ((lane & 7) + 8 * (lane >> 4)) * PB + (rb * 16 + 8 * ((lane >> 3) & 1)) * 2;
    const int r = rb * 16 + lane / 4;
    float* row_lo = acc + (i64)r * D + 2 * (lane % 4);
    float* row_hi = row_lo + 8 * D;
#pragma unroll 1
    for (int cp = WPR > 1 ? warp % WPR : 0; cp < CP; cp += WPR) {
      float c[2][4];
      zero_n<8>(&c[0][0]);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        // A is re-read per column pair rather than held (BN/4 registers): the dk/dv
        // accumulators leave none to spare at D = 128 or with 32-row warps
        u32 a[4], b[4];
        ldsm_x4_trans(a, a_row + kk * 16 * PB);
        ldsm_x4_trans(b, sK + (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * Pitch<D>::bytes +
                             (cp * 16 + (lane / 16) * 8) * 2);
        Elem<T>::mma(c[0], a, b[0], b[1]);
        Elem<T>::mma(c[1], a, b[2], b[3]);
      }
      red_block16<true>(row_lo, row_hi, cp * 16, c, r < nvalid, r + 8 < nvalid, lane);
    }
  }
}

template <typename T, int D, int BM, int BN, int WARPS, bool CAUSAL, bool VARLEN = false>
__global__ void __launch_bounds__(WARPS * 32, 1) pw_backward_dq(const Params p) {
  constexpr int DS = D * Elem<T>::width;  // a row in 16-bit units (common.cuh, Elem)
  using L = BwdDqTraits<DS, BM, BN, WARPS>;  // shared-memory layout and warp split (traits.cuh)
  constexpr int MW = L::MW;                 // 16-row blocks per warp (1 or 2, checked there)
  constexpr int THREADS = L::threads;
  extern __shared__ __align__(16) unsigned char smem[];
  u16* sQ1 = reinterpret_cast<u16*>(smem + L::q1_offset);
  u16* sQ2 = reinterpret_cast<u16*>(smem + L::q2_offset);
  u16* sDO = reinterpret_cast<u16*>(smem + L::do_offset);
  u16* sKV = reinterpret_cast<u16*>(smem + L::kv_offset);  // per stage: K1, K2, V

  // dS at the row's current float16 scale (PW_BWD_DS_PRESCALE)
  constexpr bool PRESCALE = PW_BWD_DS_PRESCALE != 0 && RowScale<T>::active;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const i64 mt = CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const i64 h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const Seq<VARLEN> sq = seq_of<VARLEN>(p, b);
  const i64 M = sq.M, N = sq.N, P = sq.P, m0 = mt * BM;
  if (VARLEN && m0 >= M) return;  // a packed batch's grid covers its longest sequence
  const i64 row0 = m0 + warp * 16 * MW;

  const u16* k1 = p.k1.at(b, hk, sq.k0);
  const u16* k2 = p.k2.at(b, hk, sq.k0);
  const u16* vv = p.v.at(b, hk, sq.k0);

  load_rows<BM, DS, THREADS>(smem_addr(sQ1), p.q1.at(b, h, sq.q0), p.q1.sr, m0, M);
  load_rows<BM, DS, THREADS>(smem_addr(sQ2), p.q2.at(b, h, sq.q0), p.q2.sr, m0, M);
  load_rows<BM, DS, THREADS>(smem_addr(sDO), p.dout.at(b, h, sq.q0), p.dout.sr, m0, M);

  float lse2[MW][2], delta[MW][2];
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const i64 r = row0 + mi * 16 + lane / 4 + 8 * hh;
      const i64 idx = stat_row0<VARLEN>(p, sq, b, h) + r;
      lse2[mi][hh] = r < M ? lse_to_log2(p.lse[idx]) : PW_POS_INF;
      delta[mi][hh] = r < M ? p.delta[idx] : 0.f;
    }

  const i64 n_end = CAUSAL ? clamp64(m0 + BM + P, 0, N) : N;
  const int ntiles = (int)((n_end + BN - 1) / BN);
  // Key tiles touching pair 1 (some d < w) form a suffix, those touching pair 2 a prefix.
  const int first1 = (int)clamp64(floor_div(m0 + P - p.w - BN + 1, BN) + 1, 0, ntiles);
  const int end2 = (int)clamp64(floor_div(m0 + BM - 1 + P - p.w, BN) + 1, 0, ntiles);

  auto issue = [&](int t, int stage) {
    const i64 n0 = (i64)t * BN;
    const int mode = tile_mode(m0, BM, n0, BN, P, p.w);
    u16* st = sKV + stage * L::stage_elems;
    if (mode & 1) load_rows<BN, DS, THREADS>(smem_addr(st + L::k1_in_stage), k1, p.k1.sr, n0, N);
    if (mode & 2) load_rows<BN, DS, THREADS>(smem_addr(st + L::k2_in_stage), k2, p.k2.sr, n0, N);
    load_rows<BN, DS, THREADS>(smem_addr(st + L::v_in_stage), vv, p.v.sr, n0, N);
  };
  const int warp_off = warp * L::warp_rows * L::pitch;
  const u32 aQ1 = smem_addr(sQ1 + warp_off), aQ2 = smem_addr(sQ2 + warp_off);
  const u32 aDO = smem_addr(sDO + warp_off);

#pragma unroll 1
  for (int pair = 1; pair <= 2; ++pair) {
    float acc[MW][D / 8][4];
    zero_n<MW * D / 2>(&acc[0][0][0]);
    int ex[MW][2];
    init_rows<T, MW>(ex);
    pipelined_tiles(pair == 1 ? first1 : 0, pair == 1 ? ntiles : end2, issue,
                    [&](int t, int stage) {
      const i64 n0 = (i64)t * BN;
      const int mode = tile_mode(m0, BM, n0, BN, P, p.w);
      const bool masked = tile_needs_mask<CAUSAL>(tile_dmin(m0, n0, BN, P), n0 + BN, N);
      const u16* st = sKV + stage * L::stage_elems;
      const Geom g = make_geom<false>(row0, n0, P, p.w, N);

      float s[MW][BN / 8][4];
      score_tile<PW_MASK_SPLIT_OR(2), T, D, BN, MW, CAUSAL, false>(
          s, aQ1, aQ2, smem_addr(st + L::k1_in_stage), smem_addr(st + L::k2_in_stage), mode,
          masked, g, p.scale_log2, lane);
      float dp[MW][BN / 8][4];
      zero_n<MW * BN / 2>(&dp[0][0][0]);
      mma_abt<T, D, BN, MW>(dp, aDO, smem_addr(st + L::v_in_stage), lane);
      // dS, at the row's current 2^e when PRESCALE: (dp - delta) 2^e as one fma, exact
      float c[MW][2], dc[MW][2];
#pragma unroll
      for (int mi = 0; mi < MW; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          c[mi][hh] = PRESCALE ? pow2f(ex[mi][hh]) : 1.f;
          dc[mi][hh] = delta[mi][hh] * c[mi][hh];
        }
#pragma unroll
      for (int mi = 0; mi < MW; ++mi)
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float pr = fast_exp2(s[mi][nb][e] - lse2[mi][e / 2]);
            s[mi][nb][e] = pr * (PRESCALE ? fmaf(dp[mi][nb][e], c[mi][e / 2], -dc[mi][e / 2])
                                          : dp[mi][nb][e] - delta[mi][e / 2]);
          }
      if (mode == 3) keep_pair<BN, MW, false>(s, pair, g, lane);
      if constexpr (PRESCALE) fit_scaled_rows<T, BN / 8, D / 8, MW>(s, acc, ex);
      else fit_rows<T, BN / 8, D / 8, MW>(s, acc, ex);
      // dq_pair = dS_pair k_pair: k2 follows k1 in a stage (traits.cuh).
      mma_xb<T, D, BN, MW>(acc, s, smem_addr(st + L::k1_in_stage + (pair - 1) * L::k_tile_elems),
                           lane);
    });
    float scale[MW][2];
    unscale_rows<MW>(scale, ex, p.sm_scale);
    const Tensor& out = pair == 1 ? p.dq1 : p.dq2;
    const Seq<VARLEN> end = seq_again<VARLEN>(p, b);
    store_rows<T, D, MW>(out.mut(b, h, end.q0), out.sr, row0, end.M, acc, scale, lane);
  }
}

template <typename T, int D, int BM, int BN, int WARPS, bool CAUSAL, bool VARLEN = false,
          bool FUSED = false>
__global__ void __launch_bounds__(WARPS * 32, 1) pw_backward_dkv(const Params p) {
  static_assert(!FUSED || Elem<T>::width == 1, "the fused backward is built for 16-bit inputs");
  constexpr int DS = D * Elem<T>::width;  // a row in 16-bit units (common.cuh, Elem)
  // shared-memory layout and warp split (traits.cuh)
  using L = BwdDkvTraits<DS, BM, BN, WARPS, FUSED>;
  constexpr int MW = L::MW;                  // 16-row (key) blocks per warp (1 or 2)
  constexpr int THREADS = L::threads;
  // the one entry that spills with the fixed P scale unless it reloads threadIdx (above)
  constexpr bool EXEMPT_SHAPE = FUSED && CAUSAL && D == 128 && BM == 32;
  using FP = FixedP<T, (PW_BWD_P_FIXED_EXEMPT == 1 || (PW_BWD_P_FIXED_EXEMPT == 2 && VARLEN)) &&
                         EXEMPT_SHAPE>;
  // dS leaves its product already at dK's row scale (PW_BWD_DS_PRESCALE); not in the fused
  // kernel, which stashes dS unscaled for dQ
  constexpr bool DS_PRESCALE = PW_BWD_DS_PRESCALE != 0 && FP::on && !FUSED;
  extern __shared__ __align__(16) unsigned char smem[];
  u16* sK1 = reinterpret_cast<u16*>(smem + L::k1_offset);
  u16* sK2 = reinterpret_cast<u16*>(smem + L::k2_offset);
  u16* sV = reinterpret_cast<u16*>(smem + L::v_offset);
  u16* sQ = reinterpret_cast<u16*>(smem + L::q_offset);  // per stage: Q1, Q2, dO
  float* sStat = reinterpret_cast<float*>(smem + L::stats_offset);  // per stage: lse, delta

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#if PW_BWD_TID_RELOAD  // (0 keeps this text out: the earlier default's PTX)
  // 2: where the exempt shape takes the fixed P scale (float16; its dense form only with
  // PW_BWD_P_FIXED_EXEMPT=2), the one place the reload pays
  constexpr bool RELOAD =
      PW_BWD_TID_RELOAD == 1 || (PW_BWD_TID_RELOAD == 2 && EXEMPT_SHAPE && FP::on);
  const int lane0 = lane, warp0 = warp;
#endif
  const i64 nt = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const Seq<VARLEN> sq = seq_of<VARLEN>(p, b);
  const i64 M = sq.M, N = sq.N, P = sq.P, n0 = nt * BN;
  if (VARLEN && n0 >= N) return;  // a packed batch's grid covers its longest sequence
  const i64 row0 = n0 + warp * 16 * MW;  // rows are keys here

  load_rows<BN, DS, THREADS>(smem_addr(sK1), p.k1.at(b, hk, sq.k0), p.k1.sr, n0, N);
  load_rows<BN, DS, THREADS>(smem_addr(sK2), p.k2.at(b, hk, sq.k0), p.k2.sr, n0, N);
  load_rows<BN, DS, THREADS>(smem_addr(sV), p.v.at(b, hk, sq.k0), p.v.sr, n0, N);

  // Query tiles that can see this key tile at all, then the sub-ranges touching each pair:
  // pair 1 (some d < w) is a prefix of them, pair 2 (some d >= w) a suffix.
  const int t_hi = (int)((M + BM - 1) / BM);
  const int t_lo = CAUSAL ? (int)clamp64(floor_div(n0 - P, BM), 0, t_hi) : 0;
  const int end1 = (int)clamp64(ceil_div(p.w - P + n0 + BN - 1, BM), t_lo, t_hi);
  const int first2 = (int)clamp64(ceil_div(p.w - P + n0 - BM + 1, BM), t_lo, t_hi);
  const int group = (int)p.group;

  const int warp_off = warp * L::warp_rows * L::pitch;
  const u32 aK1 = smem_addr(sK1 + warp_off), aK2 = smem_addr(sK2 + warp_off);
  const u32 aV = smem_addr(sV + warp_off);

  // Stream iteration `it` over the (query head of the group, query tile) pairs of tiles
  // [lo, lo + per_head) -- one pipelined stream for the whole group -- and its loads.
  auto tile_of = [&](int lo, int per_head, int it, i64& h, i64& m0) {
    h = hk * group + it / per_head;
    m0 = (i64)(lo + it % per_head) * BM;
  };
  auto issue_tile = [&](i64 h, i64 m0, int stage) {
    const int mode = tile_mode(m0, BM, n0, BN, P, p.w);
    u16* st = sQ + stage * L::stage_elems;
    if (mode & 1)
      load_rows<BM, DS, THREADS>(smem_addr(st + L::q1_in_stage), p.q1.at(b, h, sq.q0), p.q1.sr,
                                m0, M);
    if (mode & 2)
      load_rows<BM, DS, THREADS>(smem_addr(st + L::q2_in_stage), p.q2.at(b, h, sq.q0), p.q2.sr,
                                m0, M);
    load_rows<BM, DS, THREADS>(smem_addr(st + L::do_in_stage), p.dout.at(b, h, sq.q0), p.dout.sr,
                              m0, M);
    const i64 base = stat_row0<VARLEN>(p, sq, b, h);
    float* ss = sStat + stage * L::stats_stage_floats;
    load_f32<BM, THREADS>(smem_addr(ss + L::lse_in_stage), p.lse + base, m0, M);
    load_f32<BM, THREADS>(smem_addr(ss + L::delta_in_stage), p.delta + base, m0, M);
  };
  // Probabilities of the warp's keys (rows of s) against the streamed query tile of `stage`
  // (tile mode, mask flag and geometry computed by the caller).
  auto probabilities = [&](float s[MW][BM / 8][4], int mode, bool masked, int stage,
                           const Geom& g) {
#if PW_BWD_TID_RELOAD
    const int lane = RELOAD ? tid_reload() % 32 : lane0;
#endif
    const u16* st = sQ + stage * L::stage_elems;
    const float* ss = sStat + stage * L::stats_stage_floats;
    score_tile<PW_MASK_SPLIT_OR(2), T, D, BM, MW, CAUSAL, true, FP::bias>(
        s, aK1, aK2, smem_addr(st + L::q1_in_stage), smem_addr(st + L::q2_in_stage), mode,
        masked, g, p.scale_log2, lane);
#pragma unroll
    for (int mi = 0; mi < MW; ++mi)
#pragma unroll
      for (int nb = 0; nb < BM / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[mi][nb][e] =
              fast_exp2(s[mi][nb][e] - lse_to_log2(ss[L::lse_in_stage + frag_col(nb, e, lane)]));
  };

  // Above head dim 128 a dV and a dK accumulator (2 x D/2 registers per row block) do not
  // fit in registers together: dV then takes a pass of its own over every visible tile,
  // before the two dK passes, which leave it alone. Up to 128 dV rides along with them.
  constexpr bool SPLIT_DV = D > 128;
  float dv[MW][D / 8][4];
  zero_n<MW * D / 2>(&dv[0][0][0]);
  int ex_v[MW][2];
  init_rows<T, MW>(ex_v);
  if constexpr (FP::on)  // P arrives scaled by 2^ex: dV is unscaled by it at the end
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) ex_v[mi][0] = ex_v[mi][1] = FP::ex;
  if constexpr (SPLIT_DV) {
    const int per_head = t_hi - t_lo;
    auto issue = [&](int it, int stage) {
      i64 h, m0;
      tile_of(t_lo, per_head, it, h, m0);
      issue_tile(h, m0, stage);
    };
    pipelined_tiles(0, per_head > 0 ? per_head * group : 0, issue, [&](int it, int stage) {
      i64 h, m0;
      tile_of(t_lo, per_head, it, h, m0);
      float s[MW][BM / 8][4];
      probabilities(s, tile_mode(m0, BM, n0, BN, P, p.w),
                    tile_needs_mask<CAUSAL>(tile_dmin(m0, n0, BN, P), m0 + BM, M), stage,
                    make_geom<true>(row0, m0, P, p.w, M));
      if constexpr (!FP::on) fit_rows<T, BM / 8, D / 8, MW>(s, dv, ex_v);
      mma_xb<T, D, BM, MW>(dv, s, smem_addr(sQ + stage * L::stage_elems + L::do_in_stage), lane);
    });
    float one[MW][2];
    unscale_rows<MW>(one, ex_v, 1.f);
    const Seq<VARLEN> end = seq_again<VARLEN>(p, b);
    store_rows<T, D, MW>(p.dv.mut(b, hk, end.k0), p.dv.sr, row0, end.N, dv, one, lane);
  }

#pragma unroll 1
  for (int pair = 1; pair <= 2; ++pair) {
    const int lo = pair == 1 ? t_lo : first2, hi = pair == 1 ? end1 : t_hi;
    const int per_head = hi - lo;

    float dk[MW][D / 8][4];
    zero_n<MW * D / 2>(&dk[0][0][0]);
    int ex_k[MW][2];
    init_rows<T, MW>(ex_k);
    auto issue = [&](int it, int stage) {
      i64 h, m0;
      tile_of(lo, per_head, it, h, m0);
      issue_tile(h, m0, stage);
    };
    pipelined_tiles(0, per_head > 0 ? per_head * group : 0, issue, [&](int it, int stage) {
#if PW_BWD_TID_RELOAD  // lane- and warp-derived offsets recomputed per tile
      const int lane = RELOAD ? tid_reload() % 32 : lane0;
      const int warp = RELOAD ? tid_reload() / 32 : warp0;
#endif
      i64 h, m0;
      tile_of(lo, per_head, it, h, m0);
      const int t = (int)(m0 / BM);
      const int mode = tile_mode(m0, BM, n0, BN, P, p.w);
      const bool masked = tile_needs_mask<CAUSAL>(tile_dmin(m0, n0, BN, P), m0 + BM, M);
      const u16* st = sQ + stage * L::stage_elems;
      const float* ss = sStat + stage * L::stats_stage_floats;
      const Geom g = make_geom<true>(row0, m0, P, p.w, M);

      float s[MW][BM / 8][4];
      probabilities(s, mode, masked, stage, g);
      float dp[MW][BM / 8][4];
      zero_n<MW * BM / 2>(&dp[0][0][0]);
      mma_abt<T, D, BM, MW>(dp, aV, smem_addr(st + L::do_in_stage), lane);
      // dV takes every tile once: pass 2 skips the straddling tiles pass 1 already counted.
      // float16's P carries 2^14 (FixedP) or, in the exempt entry, a per-row scale that
      // fit_rows sets here; either is unscaled exactly for dS below.
      const bool count_dv = !SPLIT_DV && (pair == 1 || t >= end1);
      if (count_dv) {
        if constexpr (!FP::on) fit_rows<T, BM / 8, D / 8, MW>(s, dv, ex_v);
        mma_xb<T, D, BM, MW>(dv, s, smem_addr(st + L::do_in_stage), lane);
      }
      float unscale[MW][2];
#pragma unroll
      for (int mi = 0; mi < MW; ++mi)
        if constexpr (DS_PRESCALE)  // P's 2^-ex and dK's current row scale in one factor
          unscale[mi][0] = pow2f(ex_k[mi][0] - FP::ex),
          unscale[mi][1] = pow2f(ex_k[mi][1] - FP::ex);
        else if constexpr (FP::on)  // every tile's P carries the fixed factor
          unscale[mi][0] = unscale[mi][1] = pow2f(-FP::ex);
        else
          unscale[mi][0] = count_dv ? pow2f(-ex_v[mi][0]) : 1.f,
          unscale[mi][1] = count_dv ? pow2f(-ex_v[mi][1]) : 1.f;
#pragma unroll
      for (int mi = 0; mi < MW; ++mi)
#pragma unroll
        for (int nb = 0; nb < BM / 8; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[mi][nb][e] *= unscale[mi][e / 2] *
                            (dp[mi][nb][e] - ss[L::delta_in_stage + frag_col(nb, e, lane)]);
      if (mode == 3) keep_pair<BM, MW, true>(s, pair, g, lane);
      if constexpr (FUSED)
        stash_ds<T, BM, MW, L::ds_pitch_bytes>(
            smem_addr(smem + L::ds_offset + warp * L::warp_rows * L::ds_pitch_bytes), s,
            (int)clamp64(N - row0, 0, L::warp_rows), lane);
      if constexpr (DS_PRESCALE) fit_scaled_rows<T, BM / 8, D / 8, MW>(s, dk, ex_k);
      else fit_rows<T, BM / 8, D / 8, MW>(s, dk, ex_k);
      // dk_pair = dS_pair^T q_pair: q2 follows q1 in a stage (traits.cuh).
      mma_xb<T, D, BM, MW>(dk, s, smem_addr(st + L::q1_in_stage + (pair - 1) * L::q_tile_elems),
                           lane);
      if constexpr (FUSED) {
        __syncthreads();  // every warp's dS rows are in the buffer
        // dq_pair rows [m0, m0 + BM) of head h += dS_pair k_pair (k2 follows k1, traits.cuh)
        float* acc = (pair == 1 ? p.dq_acc1 : p.dq_acc2) +
                     (stat_row0<VARLEN>(p, sq, b, h) + m0) * D;
        add_dq<T, D, BM, BN, WARPS, L::ds_pitch_bytes>(
            acc, (int)min((i64)BM, M - m0), smem_addr(smem + L::ds_offset),
            smem_addr(smem + L::k1_offset + (pair - 1) * L::k_tile_bytes), warp, lane);
      }
    });
    float scale[MW][2];
    unscale_rows<MW>(scale, ex_k, p.sm_scale);
    const Tensor& out = pair == 1 ? p.dk1 : p.dk2;
    const Seq<VARLEN> end = seq_again<VARLEN>(p, b);
    store_rows<T, D, MW>(out.mut(b, hk, end.k0), out.sr, row0, end.N, dk, scale, lane);
  }
  if constexpr (!SPLIT_DV) {
    float one[MW][2];
    unscale_rows<MW>(one, ex_v, 1.f);
    const Seq<VARLEN> end = seq_again<VARLEN>(p, b);
    store_rows<T, D, MW>(p.dv.mut(b, hk, end.k0), p.dv.sr, row0, end.N, dv, one, lane);
  }
}

// ---------------------------------------------------------------- the warp-grid backward
// pw_backward_grid (phase bwd_grid, 16-bit inputs, dense batches): the one-kernel backward of
// pw_backward_dkv with FUSED, rebuilt on FlashAttention-2's decomposition. One block per
// (key tile of BN keys, kv head, batch entry); 64-query tiles of every head of the group
// stream through two stages. The warps form a (BN / 32) x 2 grid:
//   Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: warp (wk, wq) computes keys 32 wk.. x queries 32 wq..;
//   Pᵀ and dSᵀ go to shared memory (16-bit, key-major);
//   dV += Pᵀ dO and dK_pair += dSᵀ Q_pair: warp (wk, wq) owns keys 32 wk.. x columns
//   wq D/2.., reading its keys' Pᵀ / dSᵀ rows over all 64 queries;
//   dQ_pair += dS K_pair: warp tiles of 32 queries x dq_cols columns over the block's 64 x D,
//   added to the float32 accumulator with reductions (red_block16).
// Every operand fragment a warp reads from shared memory then feeds two 16-row blocks: about
// 240 bytes of ldmatrix per mma against pw_backward_dkv's 300-500 (bench/NOTES.md, 2026-12-05
// thirty-first section), the bound that kept that kernel at 0.64x FlashAttention-2.
// dK1 and dK2 are not held together (64 + 64 + 64 accumulators with dV): as pw_backward_dkv,
// the kernel makes one pass over the query tiles touching pair 1 (d < w) and one over those
// touching pair 2, recomputing only the straddling tiles; dV counts every tile once.
// float16: P carries the fixed factor 2^14 (FixedP) into Pᵀ and dV, and dS is rounded
// unscaled for both dK and dQ, its range kept by the caller's loss scaling as in the Hopper
// backward (tolerance.float16_loss_scale).
template <typename T, int D, int BM, int BN, int WARPS, bool CAUSAL>
__global__ void __launch_bounds__(WARPS * 32, 1) pw_backward_grid(const Params p) {
  static_assert(Elem<T>::width == 1, "the warp-grid backward is built for 16-bit inputs");
  using L = BwdGridTraits<D, BM, BN, WARPS>;
  using FP = FixedP<T>;
  constexpr int WK = L::warps_k, KC = L::kv_cols, QC = L::dq_cols;
  constexpr int RB = L::row_bytes, TB = L::pt_pitch_bytes;
  constexpr int THREADS = L::threads;
  extern __shared__ __align__(16) unsigned char smem[];
  const u32 s0 = smem_addr(smem);
  const float* sStat = reinterpret_cast<const float*>(smem + L::stats_offset);

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int wk = warp % WK, wq = warp / WK;
  const i64 nt = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const i64 M = p.M, N = p.N, P = p.shift, n0 = nt * BN;
  const i64 krow0 = n0 + wk * 32;  // the warp's first key

  load_rows<BN, D, THREADS>(s0 + L::k1_offset, p.k1.at(b, hk), p.k1.sr, n0, N);
  load_rows<BN, D, THREADS>(s0 + L::k2_offset, p.k2.at(b, hk), p.k2.sr, n0, N);
  load_rows<BN, D, THREADS>(s0 + L::v_offset, p.v.at(b, hk), p.v.sr, n0, N);

  // query tiles that see this key tile, and the sub-ranges touching each pair (as dkv)
  const int t_hi = (int)((M + BM - 1) / BM);
  const int t_lo = CAUSAL ? (int)clamp64(floor_div(n0 - P, BM), 0, t_hi) : 0;
  const int end1 = (int)clamp64(ceil_div(p.w - P + n0 + BN - 1, BM), t_lo, t_hi);
  const int first2 = (int)clamp64(ceil_div(p.w - P + n0 - BM + 1, BM), t_lo, t_hi);
  const int group = (int)p.group;

  // tile `it` of a pass: query head hk group + it / per_head, tile lo + it % per_head. The
  // integer division costs about 20 instructions (I2F, MUFU.RCP, fix-ups) and runs twice per
  // tile (issue and body), so without GQA (group 1, uniform) it is skipped: backward
  // 0.999-1.036x on all 16 rows of an H100 A/B (PW_GRID_GROUP1=0 builds the division always;
  // bench/results/2026-12-05-h100-grid-diet).
  auto tile_of = [&](int lo, int per_head, int it, i64& h, i64& m0) {
#if PW_GRID_GROUP1
    int hq = 0, r = it;
    if (group > 1) hq = it / per_head, r = it - hq * per_head;
#else
    const int hq = it / per_head, r = it % per_head;
#endif
    h = hk * group + hq;
    m0 = (i64)(lo + r) * BM;
  };
  auto issue_tile = [&](i64 h, i64 m0, int stage) {
    const int mode = tile_mode(m0, BM, n0, BN, P, p.w);
    const u32 st = s0 + L::q_offset + stage * L::stage_bytes;
    if (mode & 1) load_rows<BM, D, THREADS>(st + L::q1_in_stage, p.q1.at(b, h), p.q1.sr, m0, M);
    if (mode & 2) load_rows<BM, D, THREADS>(st + L::q2_in_stage, p.q2.at(b, h), p.q2.sr, m0, M);
    load_rows<BM, D, THREADS>(st + L::do_in_stage, p.dout.at(b, h), p.dout.sr, m0, M);
    const i64 base = (b * p.H + h) * M;
    const u32 ss = s0 + L::stats_offset + stage * L::stats_stage_bytes;
    load_f32<BM, THREADS>(ss + 4 * L::lse_in_stage, p.lse + base, m0, M);
    load_f32<BM, THREADS>(ss + 4 * L::delta_in_stage, p.delta + base, m0, M);
  };

  float dv[2][KC / 8][4];
  zero_n<KC>(&dv[0][0][0]);
#pragma unroll 1
  for (int pair = 1; pair <= 2; ++pair) {
    const int lo = pair == 1 ? t_lo : first2, hi = pair == 1 ? end1 : t_hi;
    const int per_head = hi - lo;
    float dk[2][KC / 8][4];
    zero_n<KC>(&dk[0][0][0]);
    const int count = per_head > 0 ? per_head * group : 0;
    // PW_GRID_STAGGER: the pass starts at its tile (key tile mod count), wrapping around
    constexpr bool STAGGER = PW_GRID_STAGGER && D == 64;
    const int rot = (STAGGER && count > 0) ? (int)(nt % count) : 0;
    auto rotated = [&](int it) {
      if constexpr (STAGGER) {
        it += rot;
        if (it >= count) it -= count;
      }
      return it;
    };
    auto issue = [&](int it, int stage) {
      i64 h, m0;
      tile_of(lo, per_head, rotated(it), h, m0);
      issue_tile(h, m0, stage);
    };
    pipelined_tiles(0, count, issue, [&](int it, int stage) {
      // lane- and warp-derived offsets recomputed per tile from a fresh threadIdx read
      // (tid_reload): held across the loop they spill about 210 bytes at D = 128 (ptxas,
      // NVRTC 13.5); recomputed, every entry builds without spills (PW_GRID_TID_RELOAD)
      constexpr bool RELOAD = PW_GRID_TID_RELOAD == 1 || (PW_GRID_TID_RELOAD == 2 && D > 64);
      const int lane = (RELOAD ? tid_reload() : (int)threadIdx.x) % 32,
                warp = (RELOAD ? tid_reload() : (int)threadIdx.x) / 32;
      const int wk = warp % WK, wq = warp / WK;
      const i64 krow0 = n0 + wk * 32;
      const int keys = (int)clamp64(N - krow0, 0, 32);  // the warp's keys inside K
      i64 h, m0;
      tile_of(lo, per_head, rotated(it), h, m0);
#if PW_GRID_GEOM32
      // the tile's geometry in 32-bit form (PW_GRID_GEOM32 above), lengths and shift read
      // from the parameters again rather than held
      const int Mi = (int)p.M, Pi = (int)p.shift, wi = (int)p.w;
      const int m0i = (int)m0, n0i = (int)blockIdx.x * BN;
      const int t = m0i / BM;  // a shift: m0 >= 0
      const int dmin = m0i + Pi - (n0i + BN - 1);
      const int mode = (dmin < wi ? 1 : 0) | (m0i + (BM - 1) + Pi - n0i >= wi ? 2 : 0);
      const bool masked = m0i + BM > Mi || (CAUSAL && dmin < 0);
#else
      const int t = (int)(m0 / BM);
      const int mode = tile_mode(m0, BM, n0, BN, P, p.w);
      const bool masked = tile_needs_mask<CAUSAL>(tile_dmin(m0, n0, BN, P), m0 + BM, M);
#endif
      const u32 st = s0 + L::q_offset + stage * L::stage_bytes;
      const float* ss = sStat + stage * L::stats_stage_floats;
#if PW_GRID_GEOM32
      Geom g;  // make_geom<true>'s clamps, in 32 bits
      {
        const int q0 = m0i + wq * 32;
        g.base = min(max(q0 + Pi - (n0i + wk * 32), -(1 << 30)), 1 << 30);
        g.w = wi;
        g.cols_left = min(max(Mi - q0, -1), 1 << 30);
      }
#else
      const Geom g = make_geom<true>(krow0, m0 + wq * 32, P, p.w, M);
#endif
      const u32 aK1 = s0 + L::k1_offset + wk * 32 * RB;

      // Sᵀ and P of the warp's 32 keys x 32 queries
      float s[2][4][4];
      constexpr bool FMA_EXP = PW_GRID_FMA_EXP != 0;
      score_tile<PW_MASK_SPLIT_OR(2), T, D, 32, 2, CAUSAL, true, FMA_EXP ? 0 : FP::bias>(
          s, aK1, aK1 + (L::k2_offset - L::k1_offset), st + L::q1_in_stage + wq * 32 * RB,
          st + L::q2_in_stage + wq * 32 * RB, mode, masked, g, FMA_EXP ? 1.f : p.scale_log2,
          lane);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nb = 0; nb < 4; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float lse2 = lse_to_log2(ss[L::lse_in_stage + wq * 32 + frag_col(nb, e, lane)]);
            s[mi][nb][e] = FMA_EXP
                ? fast_exp2(fmaf(s[mi][nb][e], p.scale_log2, (float)FP::bias - lse2))
                : fast_exp2(s[mi][nb][e] - lse2);
          }
      float dp[2][4][4];
      zero_n<32>(&dp[0][0][0]);
      mma_abt<T, D, 32, 2>(dp, s0 + L::v_offset + wk * 32 * RB,
                           st + L::do_in_stage + wq * 32 * RB, lane);
      // dV takes every tile once: pass 2 skips the straddling tiles pass 1 counted
      const bool count_dv = pair == 1 || t >= end1;
      const u32 tPT = s0 + L::pt_offset + wk * 32 * TB;  // the warp's key rows of Pᵀ
      const u32 tDS = s0 + L::ds_offset + wk * 32 * TB;  // and of dSᵀ
      if (count_dv)
        stash_ds<T, 32, 2, TB>(tPT + wq * 32 * 2, s, PW_GRID_STASH_PLAIN >= 1 ? 32 : keys, lane);
      // dS = P (dP - delta), P's fixed factor removed (exact: a power of two)
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nb = 0; nb < 4; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[mi][nb][e] *= (FP::on ? pow2f(-FP::ex) : 1.f) *
                            (dp[mi][nb][e] - ss[L::delta_in_stage + wq * 32 + frag_col(nb, e, lane)]);
      if (mode == 3) keep_pair<32, 2, true>(s, pair, g, lane);
      const u32 sDOc = st + L::do_in_stage + wq * KC * 2;  // dO columns wq D/2..
      if constexpr (L::two_buffers) {
        stash_ds<T, 32, 2, TB>(tDS + wq * 32 * 2, s, keys, lane);
        __syncthreads();  // every warp's Pᵀ and dSᵀ
        if (count_dv) mma_ss<T, BM / 16, KC / 16, 2, TB, RB, false>(dv, tPT, sDOc, lane);
      } else {
        __syncthreads();  // every warp's Pᵀ
        if (count_dv) {  // block-uniform
          mma_ss<T, BM / 16, KC / 16, 2, TB, RB, false>(dv, tPT, sDOc, lane);
          __syncthreads();  // Pᵀ read by all: dSᵀ takes its place
        }
        stash_ds<T, 32, 2, TB>(tDS + wq * 32 * 2, s, keys, lane);
        __syncthreads();
      }
      // dK_pair += dSᵀ Q_pair (q2 follows q1 in a stage)
      auto dk_product = [&]() {
        mma_ss<T, BM / 16, KC / 16, 2, TB, RB, false>(
            dk, tDS, st + L::q1_in_stage + (pair - 1) * L::q_tile_bytes + wq * KC * 2, lane);
      };
      auto dq_product = [&]() {
        // dQ_pair rows [m0, m0 + BM) of head h += dS K_pair (k2 follows k1)
        float* acc = (pair == 1 ? p.dq_acc1 : p.dq_acc2) + ((b * p.H + h) * M + m0) * D;
        const int nvalid = (int)min((i64)BM, M - m0);
#pragma unroll
        for (int j = 0; j < L::dq_tiles; ++j) {
          const int id = warp + j * WARPS, qq = id & 1, cc = id >> 1;
          float c[2][QC / 8][4];
          zero_n<QC>(&c[0][0][0]);
          mma_ss<T, BN / 16, QC / 16, 2, TB, RB, true>(
              c, s0 + L::ds_offset + qq * 32 * 2,
              s0 + L::k1_offset + (pair - 1) * L::k_tile_bytes + cc * QC * 2, lane);
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            const int r = qq * 32 + mi * 16 + lane / 4;
            float* row = acc + (i64)r * D + cc * QC + 2 * (lane % 4);
#pragma unroll
            for (int np = 0; np < QC / 16; ++np) {
              const float blk[2][4] = {{c[mi][2 * np][0], c[mi][2 * np][1], c[mi][2 * np][2],
                                        c[mi][2 * np][3]},
                                       {c[mi][2 * np + 1][0], c[mi][2 * np + 1][1],
                                        c[mi][2 * np + 1][2], c[mi][2 * np + 1][3]}};
              red_block16(row, row + 8 * D, np * 16, blk, r < nvalid, r + 8 < nvalid, lane);
            }
          }
        }
      };
      if constexpr (PW_GRID_DQ_FIRST && D == 64) {
        dq_product();
        dk_product();
      } else {
        dk_product();
        dq_product();
      }
    });
    const float scale[2][2] = {{p.sm_scale, p.sm_scale}, {p.sm_scale, p.sm_scale}};
    const Tensor& out = pair == 1 ? p.dk1 : p.dk2;
    store_rows<T, KC, 2>(out.mut(b, hk) + wq * KC, out.sr, krow0, N, dk, scale, lane);
  }
  const float f = FP::on ? pow2f(-FP::ex) : 1.f;
  const float one[2][2] = {{f, f}, {f, f}};
  store_rows<T, KC, 2>(p.dv.mut(b, hk) + wq * KC, p.dv.sr, krow0, N, dv, one, lane);
}
