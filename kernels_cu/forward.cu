// Forward pass: o = softmax(s) v and lse, FlashAttention-2 style. One block per
// (query tile, head, batch); each warp owns 16*MW query rows of the tile; key tiles stream
// through shared memory double-buffered with cp.async; scores never leave registers.
#include "params.cuh"
#include "traits.cuh"

// How the forward meets a tile that straddles d = w, where both products are needed.
//  - Merged (VisitPairs false): one visit; the second product goes 16 columns at a time into
//    a temporary and is selected per element into the score tile (score_tile). One softmax
//    and P·V per tile, but the mask test is if-converted: every tile runs it.
//  - Visits (VisitPairs true): a tile is visited once per pair it needs, one product each
//    (score_pair), so a straddling tile pays a second softmax and P·V; tiles that need no
//    mask run a copy of the product without mask code.
// Causal masking makes the per-tile mask test dear: with it the visits body is 3-15% faster
// on every causal shape measured (H200, 2026-12-02, bf16/fp16, D 64 and 128, L 2048-16384;
// bench/results/2026-12-02-h200-mma-fwd-visits). Without it the merged body is as fast or
// faster (the second visit cost 4-8% at L = 2048, D = 64). float32 (TF32) keeps the merged
// body: not measured with visits. PW_FWD_VISITS=0 / =1 forces one or the other (A/B runs),
// except where the layout has one key slot per stage, which always visits (below).
#ifndef PW_FWD_VISITS
#define PW_FWD_VISITS -1
#endif
template <typename T, bool CAUSAL, bool ONE_K> struct VisitPairs {
  static constexpr bool value =
      ONE_K || (PW_FWD_VISITS >= 0 ? PW_FWD_VISITS == 1 : (CAUSAL && Elem<T>::width == 1));
};
// One key slot per pipeline stage (traits.cuh fwd_one_key_slot) needs the visits body: a
// straddling tile is loaded with its first projection, and the second replaces it in the
// slot between the two visits (the block waits for that copy, on a few tiles per query
// tile; the second block on the SM runs meanwhile).

// Online softmax over one tile's log2-domain scores s (in place: s becomes the unnormalised
// probabilities), rescaling the output accumulator. A row's running max is shared by the
// four lanes that hold it.
// Lazy rescale: the accumulator is rescaled only when some row of the warp has a rescale
// factor other than exactly 1 (its running max grew, by more than ex2 resolves; ex2 of +-0 is
// exactly 1, so a skipped multiply by 1 changes no bit). With independent random scores some
// row of a 32-row warp raises its max on at most about 32 + 32 ln(T / 32) of T tiles (union
// bound; 98 of 256 at L = 8192, BN = 32); the rescale it skips is MW * D / 2 multiplies per
// thread per tile (128 at D = 128, 32 rows per warp), beside 32 exponentials.
// PW_FWD_LAZY_RESCALE: -1 (default) lazy at head dim 128, 0 never, 1 always. On the H200
// with the mma.sync path forced it gained 2-6% at D = 128 (bf16, L 2048-16384, 5 rounds;
// 0.7-2.8% at L = 8192 in a 2-round run whose L = 2048 rows lost 4%), and lost 4-10% at
// D = 64, where the 128x64x4 non-causal entry spills with it
// (bench/results/2026-12-04-h200-fixed-p-lazy-rescale). D = 256 was not timed, and its
// sm_80 causal 16x32x1 entry spills 16 bytes with it (NVRTC 13.5), so it stays eager too.
#ifndef PW_FWD_LAZY_RESCALE
#define PW_FWD_LAZY_RESCALE -1
#endif
// Raw scores in the visits bodies (the rotating-slot visit and the visits body): the score
// tile stays unscaled (score_tile and score_pair get a scale of exactly 1, which folds their
// multiply away), the row max is taken over raw scores and scaled once per row, and each
// probability is exp2(fma(s, scale_log2, -max)): one fma per score where the scaled form
// pays a multiply in the score tile and a subtraction here (FlashAttention-2's form). It needs
// scale_log2 > 0, which validation guarantees (sm_scale is finite and positive), so that the
// max commutes with the scaling; masked scores stay -inf through the fma. Measured on the
// H200 with the mma.sync path forced (mma_fwd_probe, four runs, bf16 and fp16, L 2048-16384;
// bench/results/2026-12-04-h200-mma-vs-flag-attn and 2026-12-04-h200-staged-defaults): the
// visits body gains at D = 64 causal (+1.2-6.4% at L >= 8192) and +1.3-2.7% at D = 128 on 7
// of 8 rows of the last run, while the merged body (D = 64 non-causal) lost 1.3-3.2% with
// it, so the merged body keeps scaled scores. The A/B macro of that comparison
// (PW_FWD_RAW_MAX) was removed on 2026-12-07: its scaled form had come to spill 40 bytes at
// the rotating-slot entry once the straddle split became that entry's sweep.
// RAW: s holds raw scores and scale is scale_log2 (above); otherwise s is in the
// log2 domain already and scale is unused.
template <int D, int BN, int MW, bool RAW = false>
PW_DEVICE void online_softmax(float s[MW][BN / 8][4], float acc[MW][D / 8][4],
                              float row_max[MW][2], float row_sum[MW][2], float scale = 1.f) {
  constexpr bool LAZY = PW_FWD_LAZY_RESCALE > 0 || (PW_FWD_LAZY_RESCALE < 0 && D == 128);
  float alpha[MW][2];
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = RAW ? PW_NEG_INF : row_max[mi][hh];
#pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb)
        mx = fmaxf(mx, fmaxf(s[mi][nb][2 * hh], s[mi][nb][2 * hh + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if constexpr (RAW) mx = fmaxf(row_max[mi][hh], mx * scale);  // scale > 0: max commutes
      // A row that has seen only masked keys keeps max -inf; subtracting 0 keeps exp2 at 0.
      const float base = mx == PW_NEG_INF ? 0.f : mx;
      const float a = fast_exp2(row_max[mi][hh] - base);
      alpha[mi][hh] = a;
      row_max[mi][hh] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb) {
        if constexpr (RAW) {
          s[mi][nb][2 * hh] = fast_exp2(fmaf(s[mi][nb][2 * hh], scale, -base));
          s[mi][nb][2 * hh + 1] = fast_exp2(fmaf(s[mi][nb][2 * hh + 1], scale, -base));
        } else {
          s[mi][nb][2 * hh] = fast_exp2(s[mi][nb][2 * hh] - base);
          s[mi][nb][2 * hh + 1] = fast_exp2(s[mi][nb][2 * hh + 1] - base);
        }
        sum += s[mi][nb][2 * hh] + s[mi][nb][2 * hh + 1];
      }
      row_sum[mi][hh] = row_sum[mi][hh] * a + sum;
      if constexpr (!LAZY) {
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb) {
          acc[mi][nb][2 * hh] *= a;
          acc[mi][nb][2 * hh + 1] *= a;
        }
      }
    }
  if constexpr (LAZY) {
    bool grew = false;
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) grew |= (alpha[mi][0] != 1.f) | (alpha[mi][1] != 1.f);
    if (__any_sync(0xffffffffu, grew)) {  // warp-uniform: the loop below stays unrolled
#pragma unroll
      for (int mi = 0; mi < MW; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int nb = 0; nb < D / 8; ++nb) {
            acc[mi][nb][2 * hh] *= alpha[mi][hh];
            acc[mi][nb][2 * hh + 1] *= alpha[mi][hh];
          }
    }
  }
}

// PW_FWD_WARP_SKIP (1, the default since 2026-12-07; 0 and 2 A/B builds): in the
// rotating-slot forward (PW_FWD_Q_ROTATE), a warp skips a masked visit (score product,
// online softmax, P·V) in which none of its 16 MW rows has an admissible key
// (warp_visit_empty): in a straddling tile some warps' pair-1 or pair-2 visit is empty, and
// so is a causal diagonal tile's visit for warps whose rows all come before its keys. A
// visit whose scores are all -inf leaves row_max, row_sum and acc as they were
// (online_softmax: alpha 1 on a row with a finite max, 0 times an acc of 0 on a row still
// at -inf; P·V adds products of 0), so the output bits are the same for finite inputs (an
// inf or NaN in a masked key's v, which the full visit turns into NaN by 0 * inf, and the
// sign of an accumulator that underflowed to -0 aside). The visit is a pipelined_tiles body,
// whose barriers are outside it: a warp that returns early still reaches every one. The
// test is in the masked branch only, so unmasked visits run no extra code. 1: both phases;
// 2: the near phase only. Forms that build without spills (ptxas, sm_90, D = 128 128x64x4,
// bf16 and fp16, causal or not): the far phase a plain branch, the near phase a warp vote
// (__all_sync). The plain branch in the near loop spilled 68-144 bytes, the vote in the far
// loop 136 bytes. Cost offline: +1 SASS instruction on every far-loop path (its loop counter
// leaves the uniform registers), +4-5 on a near-loop masked visit, none on near unmasked.
// Timed against the default and a control build (mma_fwd_probe, gpu_run.sh fwd_ab, H100,
// 2026-12-07, D = 128 L = 2048, bf16/fp16, causal or not, w = L / 4 and L): 1 ran
// 1.020-1.078x, 2 0.986-1.036x, the control 0.976-1.016x. 1 is faster at w = L too, where
// it skips only causal diagonal visits: the far loop's code changed shape (not analysed).
#ifndef PW_FWD_WARP_SKIP
#define PW_FWD_WARP_SKIP 1
#endif
// PW_FWD_COL_RANGE (2, CH, the default; 4 an A/B build; 0 builds the full masked visit): in
// the visits body of dense (not varlen) 16-bit non-causal kernels at D = 64 with 128-key
// tiles (the shape it was timed in: sm_90's D = 64 entry, 128x128x4 with one key slot), a
// masked visit runs its two products (scores and P·V) only over the chunks of
// PW_FWD_COL_RANGE 16-key groups that meet the groups holding an admissible element of the
// warp's rows (pair_groups, common.cuh). The rest of its scores are -inf under the mask
// whether computed or not, and their probabilities 0, so the result is the same for finite
// v (the full visit turns an inf or NaN in a masked key's v into NaN by 0 * inf, a skipped
// chunk does not). At 128x128x4 (32 rows per warp) with w a multiple of 128, a straddling
// tile's two visits then cost each warp 10 of 16 groups instead of 16: 40 of 64 over the
// block, which chunks of 2 meet exactly (chunks of 4: 48; scripts/col_range_model.py). The
// masked visit is a function of its own (visit_masked_groups) with its own softmax and P·V,
// so unmasked visits run the default's code (the loop's static size grows by that copy:
// 1876 -> 3022 SASS instructions at sm_90 D = 64 128x128x4); the range is held across its
// softmax (one pair of registers). Forms that spilled at that entry: plain branches on the
// range (76-148 bytes: chunk_in), the ranged products inside the default's shared softmax
// and P·V (12-76 bytes), per-group branches (36). Other shapes are left out because they
// were not timed and some spill with it (non-causal D = 128 128x32x4, a tile override:
// 64/68 bytes against none). Timed against the full visit and a control build
// (mma_fwd_probe, H100, 2026-12-07, D = 64 128x128x4, w = L / 4, bf16/fp16, chunks of 2,
// two runs; bench/results/2026-12-07-h100-col-range): non-causal 1.007-1.024x the control
// at L = 2048 and 1.003-1.029x at L = 8192. The causal form (pair_groups takes CAUSAL; warp
// k's diagonal visit then costs 2k + 2 of 8 groups, 20 of 32 over the block, chunks of 4:
// 24; with 4 it spilled 4 bytes) ran 0.921-0.961x the control at L = 2048, where the
// counted saving is larger (10.1% of the tensor work against 3.4%): the grouped body loses
// more than it saves there (not analysed), so causal kernels keep the full masked visit.
#ifndef PW_FWD_COL_RANGE
#define PW_FWD_COL_RANGE 2
#endif
static_assert(PW_FWD_COL_RANGE == 0 || PW_FWD_COL_RANGE == 1 || PW_FWD_COL_RANGE == 2 ||
                  PW_FWD_COL_RANGE == 4,
              "PW_FWD_COL_RANGE: 0 (off) or a chunk of 1, 2 or 4 16-key groups");
// Whether a visits-body kernel takes the column-range masked visit: the timed shape only.
template <typename T, int D, int BN, bool CAUSAL, bool VARLEN>
__host__ __device__ constexpr bool fwd_col_range() {
  return PW_FWD_COL_RANGE && !CAUSAL && !VARLEN && Elem<T>::width == 1 && D == 64 && BN == 128;
}
// A masked visit of the visits body over its warp's column groups, in chunks of CH groups
// (PW_FWD_COL_RANGE): score product, mask, online softmax and P·V.
template <typename T, int D, int BN, int MW, int CH, bool CAUSAL>
PW_DEVICE void visit_masked_groups(float s[MW][BN / 8][4], float acc[MW][D / 8][4],
                                   float row_max[MW][2], float row_sum[MW][2], u32 sA, u32 sB,
                                   u32 sV, const Geom& g, int pair, float scale_log2, int lane) {
  int glo, ghi;
  pair_groups<16 * MW, BN, CAUSAL>(g, pair, glo, ghi);
  mma_abt_groups<T, D, BN, MW, CH>(s, sA, sB, lane, glo, ghi);
  scale_in_window<BN, MW, true>(s, pair_window<MW, CAUSAL>(g, pair, lane), 1.f);  // raw scores
  online_softmax<D, BN, MW, true>(s, acc, row_max, row_sum, scale_log2);
  mma_xb_groups<T, D, BN, MW, CH>(acc, s, sV, lane, glo, ghi);
}

// True when no element of a warp's ROWS x BN visit of projection pair PAIR is admissible
// (pair_window, common.cuh): base is the distance of its (row 0, column 0) element, so its
// distances span [base - (BN - 1), base + ROWS - 1]. Pair 1 keeps d < w, pair 2 d >= w;
// CAUSAL also drops d < 0. (Columns past N would empty a visit too, but every visited tile
// starts below N.) |base| <= 2^30 (Geom): base - (BN - 1) and base + ROWS - 1 fit an int.
template <int PAIR, bool CAUSAL, int ROWS, int BN>
PW_DEVICE bool warp_visit_empty(int base, int w) {
  const int dmax = base + (ROWS - 1);
  if constexpr (PAIR == 1) return base - (BN - 1) >= w || (CAUSAL && dmax < 0);
  else return dmax < w || (CAUSAL && dmax < 0);
}

template <typename T, int D, int BM, int BN, int WARPS, bool CAUSAL, bool VARLEN = false>
__global__ void __launch_bounds__(WARPS * 32, 1) pw_forward(const Params p) {
  constexpr int DS = D * Elem<T>::width;   // a row in 16-bit units (common.cuh, Elem)
  constexpr bool ONE_K = fwd_one_key_slot(Elem<T>::width, D, BM, BN, WARPS);
  using L = FwdTraits<DS, BM, BN, WARPS, ONE_K>;  // shared-memory layout, warp split (traits.cuh)
  constexpr int MW = L::MW;                // 16-row blocks per warp (1 or 2, checked there)
  constexpr int THREADS = L::threads;
  extern __shared__ __align__(16) unsigned char smem[];
  u16* sQ1 = reinterpret_cast<u16*>(smem + L::q1_offset);
  u16* sQ2 = reinterpret_cast<u16*>(smem + L::q2_offset);
  u16* sKV = reinterpret_cast<u16*>(smem + L::kv_offset);  // per stage: K1, K2, V

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const i64 split = blockIdx.x % p.nsplit, mtiles = gridDim.x / p.nsplit;
  // Heavier causal tiles (later queries) launch first, evening out the tail of the grid.
  const i64 mt = CAUSAL ? (mtiles - 1 - blockIdx.x / p.nsplit) : blockIdx.x / p.nsplit;
  const i64 h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const Seq<VARLEN> sq = seq_of<VARLEN>(p, b);
  const i64 M = sq.M, N = sq.N, P = sq.P, m0 = mt * BM;
  if (VARLEN && m0 >= M) return;  // a packed batch's grid covers its longest sequence

  const u16* k1 = p.k1.at(b, hk, sq.k0);
  const u16* k2 = p.k2.at(b, hk, sq.k0);
  const u16* vv = p.v.at(b, hk, sq.k0);

  // Keys past the last query's diagonal are masked for every row of the tile.
  const i64 n_end = CAUSAL ? clamp64(m0 + BM + P, 0, N) : N;
  const int all_tiles = (int)((n_end + BN - 1) / BN);
  const int t_begin = (int)min((i64)all_tiles, split * p.split_tiles);
  const int ntiles = (int)min((i64)all_tiles, (split + 1) * p.split_tiles);

  // PW_FWD_Q_ROTATE (traits.cuh): three rotating slots, Q loaded when its phase starts (below)
  constexpr bool QROT = fwd_q_rotate(Elem<T>::width, D, BM, BN, WARPS);
  if constexpr (!QROT) {
    load_rows<BM, DS, THREADS>(smem_addr(sQ1), p.q1.at(b, h, sq.q0), p.q1.sr, m0, M);
    load_rows<BM, DS, THREADS>(smem_addr(sQ2), p.q2.at(b, h, sq.q0), p.q2.sr, m0, M);
  }

  auto issue = [&](int t, int stage) {
    const i64 n0 = (i64)t * BN;
    const int mode = tile_mode(m0, BM, n0, BN, P, p.w);
    u16* st = sKV + stage * L::stage_elems;
    if (mode & 1) load_rows<BN, DS, THREADS>(smem_addr(st + L::k1_in_stage), k1, p.k1.sr, n0, N);
    // ONE_K: a straddling tile's k2 comes after its first visit (below)
    if ((mode & 2) && !(ONE_K && (mode & 1)))
      load_rows<BN, DS, THREADS>(smem_addr(st + L::k2_in_stage), k2, p.k2.sr, n0, N);
    load_rows<BN, DS, THREADS>(smem_addr(st + L::v_in_stage), vv, p.v.sr, n0, N);
  };

  float acc[MW][D / 8][4];
  zero_n<MW * D / 2>(&acc[0][0][0]);
  float row_max[MW][2], row_sum[MW][2];
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
    row_max[mi][0] = row_max[mi][1] = PW_NEG_INF, row_sum[mi][0] = row_sum[mi][1] = 0.f;
  const i64 row0 = m0 + warp * 16 * MW;
  const u32 aQ1 = smem_addr(sQ1 + warp * L::warp_rows * L::pitch);
  const u32 aQ2 = smem_addr(sQ2 + warp * L::warp_rows * L::pitch);

  if constexpr (QROT) {
    static_assert(ONE_K && L::stage_elems == L::q_tile_elems, "a key stage fills one Q slot");
    // Slots of one Q tile each. Far phase: [q2 | stage 0 | stage 1]; near phase:
    // [stage 0 | stage 1 | q1]. A straddling tile (some d < w, some d >= w) is visited in
    // both: its q2·k2 visit ends the far phase (k2 and v in a far stage), its q1·k1 visit
    // starts the near phase (k1 and v in a near stage), both masked. Online softmax does not
    // depend on the order of a row's visits. The price is a second load of the straddling
    // tiles' v, in flight behind a visit like every other load; what it replaced, a
    // single-buffered straddle phase between the two, exposed its loads' waits (k1 and v,
    // then k2, per straddling tile) and four barriers per tile: +3.0-5.9% at L = 2048 causal,
    // D = 128, neutral elsewhere (H100, bench/results/2026-12-07-h100-fwd-w-split).
    u16* const slot0 = reinterpret_cast<u16*>(smem);
    u16* const slot1 = slot0 + L::q_tile_elems;
    u16* const slot2 = slot1 + L::q_tile_elems;
    const u32 aQ2r = smem_addr(slot0 + warp * L::warp_rows * L::pitch);
    // Key tiles in sweep order have modes 2 (far), then 3 (straddling), then 1 (near); a far
    // or near tile needs the mask from tile t_mask on (traits.cuh fwd_rotate_phases).
    const RotatePhases ph = fwd_rotate_phases(m0, BM, BN, P, p.w, N, t_begin, ntiles, CAUSAL);
    const int tA = ph.far_end, tC = ph.near_begin, t_mask = ph.mask_begin;
    // The visits' geometry is in 32-bit form: row_p and key indices stay below 2^31
    // (lengths below 2^30; P within [-M, N]: core.plan.clamp_w). Lane- and warp-derived
    // values are recomputed per visit from a fresh threadIdx.x read (tid_reload): held across
    // the sweep they cost eight registers, and this layout spilled (q1's warp address and
    // row_p too: 28 bytes non-causal, 36 varlen causal).
    const int n_keys = (int)N;
    // Far tiles and a straddling tile's far visit read k2; near tiles and its near visit k1.
    auto issue_at = [&](int t, u16* st, auto far) {
      const i64 n0 = (i64)t * BN;
      if constexpr (decltype(far)::value)
        load_rows<BN, DS, THREADS>(smem_addr(st + L::k2_in_stage), k2, p.k2.sr, n0, N);
      else
        load_rows<BN, DS, THREADS>(smem_addr(st + L::k1_in_stage), k1, p.k1.sr, n0, N);
      load_rows<BN, DS, THREADS>(smem_addr(st + L::v_in_stage), vv, p.v.sr, n0, N);
    };
    // One visit of tile t: projection pair PAIR (1 near, 2 far), its key slot in stage st.
    // The visits body's steps (below), but with the mask window computed after the product
    // (score_pair_window_after), which this layout needs to build without spills and which
    // the visits body does not gain from (bench/NOTES.md, twenty-seventh).
    auto visit = [&](int t, u16* st, auto pair_c, bool masked) {
      constexpr int PAIR = decltype(pair_c)::value;
      const int lane = tid_reload() % 32;  // shadows the kernel's lane on purpose (above)
      const int n0 = t * BN;
      float s[MW][BN / 8][4];
      const u32 sA = PAIR == 1
          ? smem_addr(slot2) + (tid_reload() >> 5) * (L::warp_rows * L::pitch * 2) : aQ2r;
      const u32 sB = smem_addr(st + L::k1_in_stage);  // one slot: k1 or k2
      const float sc = 1.f;  // raw scores (above online_softmax)
      if (masked) {
        // the geometry in the masked branch: the 64-bit make_geom, hoisted above the branch,
        // cost 34 instructions per unmasked visit (SASS; ncu at w = L: +3.5%)
        Geom g;
        const int row_p = (int)(m0 + P) + (tid_reload() >> 5) * (16 * MW);  // the warp's row 0
        g.base = min(max(row_p - n0, -(1 << 30)), 1 << 30);
        g.w = (int)p.w;
        g.cols_left = min(max(n_keys - n0, -1), 1 << 30);
#if PW_FWD_WARP_SKIP
        // warp-uniform: row_p and the tile are the warp's (forms: PW_FWD_WARP_SKIP above)
        const bool empty = warp_visit_empty<PAIR, CAUSAL, 16 * MW, BN>(g.base, g.w);
        if constexpr (PAIR == 2) {
          if (PW_FWD_WARP_SKIP == 1 && empty) return;
        } else {
          if (__all_sync(0xffffffffu, empty)) return;
        }
#endif
        score_pair_window_after<T, D, BN, MW, CAUSAL>(s, sA, sB, g, PAIR, sc, lane);
      } else {
        score_pair<T, D, BN, MW, false>(s, sA, sB, PairWindow<MW>{}, sc, lane);
      }
      online_softmax<D, BN, MW, true>(s, acc, row_max, row_sum, p.scale_log2);
      mma_xb<T, D, BN, MW>(acc, s, smem_addr(st + L::v_in_stage), lane);
    };
    using Far = IntConst<1>;
    using NotFar = IntConst<0>;
    // far phase: far tiles, then the straddling tiles' q2·k2 visits (masked from
    // min(tA, t_mask) on); q2 in slot 0, stages in slots 1 and 2
    if (t_begin < tC) load_rows<BM, DS, THREADS>(smem_addr(slot0), p.q2.at(b, h, sq.q0), p.q2.sr, m0, M);
    const int far_plain_end = min(tA, t_mask);
    pipelined_tiles(
        t_begin, tC, [&](int t, int stage) { issue_at(t, slot1 + stage * L::stage_elems, Far{}); },
        [&](int t, int stage) {
          visit(t, slot1 + stage * L::stage_elems, IntConst<2>{}, t >= far_plain_end);
        });
    // slot 2 is free after the far phase's last barrier; q1 waits with the first near tile
    if (tA < ntiles) load_rows<BM, DS, THREADS>(smem_addr(slot2), p.q1.at(b, h, sq.q0), p.q1.sr, m0, M);
    // near phase: the straddling tiles' q1·k1 visits, then near tiles; q2's slot and slot 1
    // are the stages. Unmasked exactly when tC <= t < t_mask, one unsigned compare (two held
    // bounds spilled: the non-causal build 12-20 bytes, or the causal one 28-56)
    const unsigned near_plain = (unsigned)max(t_mask - tC, 0);
    pipelined_tiles(
        tA, ntiles, [&](int t, int stage) { issue_at(t, slot0 + stage * L::stage_elems, NotFar{}); },
        [&](int t, int stage) {
          visit(t, slot0 + stage * L::stage_elems, IntConst<1>{}, (unsigned)(t - tC) >= near_plain);
        });
  } else if constexpr (!VisitPairs<T, CAUSAL, ONE_K>::value) {
    // One visit per tile; a straddling tile's two products go into one score tile.
    pipelined_tiles(t_begin, ntiles, issue, [&](int t, int stage) {
      const i64 n0 = (i64)t * BN;
      const int mode = tile_mode(m0, BM, n0, BN, P, p.w);
      const bool masked = tile_needs_mask<CAUSAL>(tile_dmin(m0, n0, BN, P), n0 + BN, N);
      const u16* st = sKV + stage * L::stage_elems;
      const Geom g = make_geom<false>(row0, n0, P, p.w, N);
      float s[MW][BN / 8][4];
      // D = 64 keeps the one-body mask (SPLIT 0): form 2 spills 8 bytes at its 128x64x4
      // table entry, and the build check allows no spill.
      score_tile<PW_MASK_SPLIT_OR(D >= 128 ? 2 : 0), T, D, BN, MW, CAUSAL, false>(
          s, aQ1, aQ2, smem_addr(st + L::k1_in_stage), smem_addr(st + L::k2_in_stage), mode,
          masked, g, p.scale_log2, lane);  // scaled scores (above online_softmax)
      online_softmax<D, BN, MW, false>(s, acc, row_max, row_sum, p.scale_log2);
      mma_xb<T, D, BN, MW>(acc, s, smem_addr(st + L::v_in_stage), lane);
    });
  } else {
    // One visit per projection pair a tile needs (two on a straddling tile), each one
    // product (score_pair). Tiles that need no mask take a copy of the product without
    // any mask code. (Re-reading threadIdx.x per tile here, as the rotating-slot visit
    // does, shortened the loop offline but timed 0.96-1.03x on an H200, 2026-12-05: noise,
    // so that A/B build, PW_FWD_VISIT_RELOAD, was removed.)
    pipelined_tiles(t_begin, ntiles, issue, [&](int t, int stage) {
      const i64 n0 = (i64)t * BN;
      const int mode = tile_mode(m0, BM, n0, BN, P, p.w);
      const bool masked =
          mode == 3 || tile_needs_mask<CAUSAL>(tile_dmin(m0, n0, BN, P), n0 + BN, N);
      const u16* st = sKV + stage * L::stage_elems;
      const Geom g = make_geom<false>(row0, n0, P, p.w, N);
#pragma unroll 1
      for (int pair = (mode & 1) ? 1 : 2; pair <= ((mode & 2) ? 2 : 1); ++pair) {
        if (ONE_K && pair == 2 && mode == 3) {  // k1 read by every warp: k2 replaces it
          __syncthreads();
          load_rows<BN, DS, THREADS>(smem_addr(st + L::k2_in_stage), k2, p.k2.sr, n0, N);
          cp_async_commit();
          cp_async_wait<0>();  // with the next tile's loads, issued before this body
          __syncthreads();
        }
        float s[MW][BN / 8][4];
        const u32 sA = pair == 1 ? aQ1 : aQ2;
        // k2 follows k1 in a stage (traits.cuh), or shares its slot (ONE_K). Written as an
        // offset times (pair - 1): a select here changed the PTX of every causal variant.
        constexpr int k2_off = L::k2_in_stage - L::k1_in_stage;
        const u32 sB = smem_addr(st + L::k1_in_stage + (pair - 1) * k2_off);
        const float sc = 1.f;  // raw scores: a 1 folds the multiply away
#if PW_FWD_COL_RANGE
        if constexpr (fwd_col_range<T, D, BN, CAUSAL, VARLEN>()) {
          if (masked) {  // (PW_FWD_COL_RANGE above)
            visit_masked_groups<T, D, BN, MW, PW_FWD_COL_RANGE, CAUSAL>(
                s, acc, row_max, row_sum, sA, sB, smem_addr(st + L::v_in_stage), g, pair,
                p.scale_log2, lane);
            continue;
          }
        }
#endif
        if (masked)
          score_pair<T, D, BN, MW, true>(s, sA, sB, pair_window<MW, CAUSAL>(g, pair, lane), sc,
                                         lane);
        else
          score_pair<T, D, BN, MW, false>(s, sA, sB, PairWindow<MW>{}, sc, lane);
        online_softmax<D, BN, MW, true>(s, acc, row_max, row_sum, p.scale_log2);
        mma_xb<T, D, BN, MW>(acc, s, smem_addr(st + L::v_in_stage), lane);
      }
    });
  }

  float inv[MW][2];
  const Seq<VARLEN> end = seq_again<VARLEN>(p, b);
  const i64 row_base = stat_row0<VARLEN>(p, end, b, h);  // row 0 of (b, h) in lse (and lse_part)
  const i64 part = split * p.H * p.M * (i64)gridDim.z;  // gridDim.z = batch (dense only)
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float l = row_sum[mi][hh];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      inv[mi][hh] = l > 0.f ? 1.f / l : 0.f;  // a row with no admissible key gives o = 0
      const i64 r = row0 + mi * 16 + lane / 4 + 8 * hh;
      const float lse = l > 0.f ? (row_max[mi][hh] + __log2f(l)) * PW_LN2 : PW_NEG_INF;
      if (lane % 4 == 0 && r < end.M) {
        if (p.nsplit > 1) p.lse_part[part + row_base + r] = lse;
        else if (p.lse) p.lse[row_base + r] = lse;
      }
    }
  if (p.nsplit == 1) {
    store_rows<T, D, MW>(p.o.mut(b, h, end.q0), p.o.sr, row0, end.M, acc, inv, lane);
    return;
  }
  // Partial result of this key split, normalised by its own row sums, in float32.
  float* op = p.o_part + (part + row_base) * D;
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const i64 r = row0 + mi * 16 + lane / 4 + 8 * hh;
      if (r < end.M)
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb)
          *reinterpret_cast<float2*>(op + r * D + nb * 8 + 2 * (lane % 4)) =
              make_float2(acc[mi][nb][2 * hh] * inv[mi][hh], acc[mi][nb][2 * hh + 1] * inv[mi][hh]);
    }
}

// One warp merges query row `row` of a split-KV forward: nsplit partial results, each
// normalised by its own row sum, at lse_part[s * rows_all + row] (natural log, -inf: the
// split saw no admissible key) and o_part[(s * rows_all + row) * D ...]. Writes
// o = sum_s exp(lse_s - lse) o_s to o_row (D elements, unit stride) and, when lse_out is not
// null, lse = log sum_s exp(lse_s) (o = 0, lse = -inf when no split saw a key). o_row
// counts 16-bit units (a float32 element is two). Latency is
// what it costs (a few rows, a few splits), so the lanes load 32 splits' lse at a time and
// share the weights by shuffles, and each lane's loads of o for successive splits do not
// wait for one another (the loop it replaced waited on one L2 round trip per split, twice).
// Loads bypass L1 (ld.global.cg): nothing is reused from it. pw_forward_combine's warps call
// this, one row each.
// PW_COMBINE_PREFETCH=1 (the default since 2026-12-05; 0 builds the earlier form for A/B):
// with at most PW_COMBINE_PREFETCH_SPLITS splits (8: the Hopper decode merges up to 4 in a
// cluster and sends 5 to 8 here) a row's lse and all its partial outputs are loaded at
// once, before the max is known, so the merge waits on one round trip to memory instead of
// three (lse for the max, lse again, then the outputs). The merge is on the critical path
// of every split decode step after the last split's block ends. Same summation order as
// the loop below (terms j >= nsplit add 0 * 0), so the bits are the same. Measured (H100,
// scripts/kvdecode_probe.py, bench/results/2026-12-05-h100-combine-prefetch): D = 64,
// B·H = 32, N = 4096 (8 splits, this merge) 0.948x -> 1.035x cuDNN; the other split rows
// +0.2-1%, the unsplit rows unchanged.
#ifndef PW_COMBINE_PREFETCH
#define PW_COMBINE_PREFETCH 1
#endif
#ifndef PW_COMBINE_PREFETCH_SPLITS
#define PW_COMBINE_PREFETCH_SPLITS 8
#endif
template <typename T, int D>
PW_DEVICE void merge_split_row(const float* lse_part, const float* o_part, i64 rows_all, i64 row,
                               int nsplit, int lane, u16* o_row, float* lse_out) {
  constexpr int PER_LANE = (D + 31) / 32;
  if constexpr (PW_COMBINE_PREFETCH != 0) {
    constexpr int S = PW_COMBINE_PREFETCH_SPLITS;
    static_assert(S >= 1 && S <= 32, "one split per lane");
    if (nsplit <= S) {  // uniform over the grid: the split count is the launch's
      const float l = lane < nsplit ? __ldcg(lse_part + lane * rows_all + row) : PW_NEG_INF;
      float ov[S][PER_LANE];
#pragma unroll
      for (int j = 0; j < S; ++j)
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k)
          ov[j][k] = j < nsplit && lane + 32 * k < D
                         ? __ldcg(o_part + (j * rows_all + row) * D + lane + 32 * k)
                         : 0.f;
      float mx = l;
#pragma unroll
      for (int k = 16; k >= 1; k /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, k));
      // no admissible key in any split: o = 0, lse = -inf (exp2 of -inf - -inf is NaN)
      const float wl = mx == PW_NEG_INF ? 0.f : fast_exp2((l - mx) * PW_LOG2E);
      float total = wl;
#pragma unroll
      for (int k = 16; k >= 1; k /= 2) total += __shfl_xor_sync(0xffffffffu, total, k);
      float acc[PER_LANE];
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) acc[k] = 0.f;
#pragma unroll
      for (int j = 0; j < S; ++j) {
        const float wgt = __shfl_sync(0xffffffffu, wl, j);  // 0 for j >= nsplit
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) acc[k] += wgt * ov[j][k];
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k)
        if (lane + 32 * k < D) store1<T>(o_row, lane + 32 * k, acc[k] * inv);
      if (lane == 0 && lse_out) *lse_out = total > 0.f ? mx + __logf(total) : PW_NEG_INF;
      return;
    }
  }
  float mx = PW_NEG_INF;
  for (int s0 = 0; s0 < nsplit; s0 += 32)
    if (s0 + lane < nsplit) mx = fmaxf(mx, __ldcg(lse_part + (s0 + lane) * rows_all + row));
#pragma unroll
  for (int k = 16; k >= 1; k /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, k));
  float acc[PER_LANE], total = 0.f;
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) acc[k] = 0.f;
  if (mx != PW_NEG_INF) {
    for (int s0 = 0; s0 < nsplit; s0 += 32) {
      const float l = s0 + lane < nsplit ? __ldcg(lse_part + (s0 + lane) * rows_all + row)
                                         : PW_NEG_INF;
      const float wl = fast_exp2((l - mx) * PW_LOG2E);  // exp2(-inf) = 0
      total += wl;
      const int count = nsplit - s0 < 32 ? nsplit - s0 : 32;
      const float* op = o_part + (s0 * rows_all + row) * D;
#pragma unroll 8
      for (int j = 0; j < count; ++j) {
        const float wgt = __shfl_sync(0xffffffffu, wl, j);
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k)
          if (lane + 32 * k < D) acc[k] += wgt * __ldcg(op + j * rows_all * D + lane + 32 * k);
      }
    }
  }
#pragma unroll
  for (int k = 16; k >= 1; k /= 2) total += __shfl_xor_sync(0xffffffffu, total, k);
  const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k)
    if (lane + 32 * k < D) store1<T>(o_row, lane + 32 * k, acc[k] * inv);
  if (lane == 0 && lse_out) *lse_out = total > 0.f ? mx + __logf(total) : PW_NEG_INF;
}

// Merges the key splits of a split-KV forward (merge_split_row): lse = log sum_s exp(lse_s)
// and o = sum_s exp(lse_s - lse) o_s. One warp per query row; splits with no admissible key
// (lse_s = -inf) weigh nothing, and a row with none at all gives o = 0, lse = -inf.
// Min-blocks 1: with no min-blocks hint ptxas capped this kernel at 32-48 registers and
// spilled (bench/results/2026-12-01-h200-kvdecode-merge/ptxas_combine.txt); a merge is a
// few rows, latency-bound, not occupancy-bound.
template <typename T, int D>
__global__ void __launch_bounds__(256, 1) pw_forward_combine(const Params p) {
  grid_dependency_wait();  // the partials' writer may still run (a programmatic launch)
  const i64 row = (i64)blockIdx.x * 8 + threadIdx.x / 32;  // over H * M
  if (row >= p.H * p.M) return;
  const i64 b = blockIdx.y, h = row / p.M, i = row % p.M;
  const i64 rows_all = p.H * p.M * (i64)gridDim.y;  // B * H * M
  const i64 idx = b * p.H * p.M + row;
  merge_split_row<T, D>(p.lse_part, p.o_part, rows_all, idx, (int)p.nsplit, threadIdx.x % 32,
                        p.o.mut(b, h) + i * p.o.sr, p.lse ? p.lse + idx : nullptr);
}
