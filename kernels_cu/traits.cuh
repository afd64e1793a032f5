// Shared-memory layout of the tiled kernels: one traits struct per kernel family, the one
// place in the CUDA sources where tile sizes, warps, pipeline stages and buffer offsets are
// worked out. The kernels carve `extern __shared__ smem[]` with these offsets only.
//
// The launch passes cupy_piecewise/capability.py `shared_bytes(phase, D, tiles)` as the dynamic
// shared-memory size; `smem_bytes` below must equal it for every variant the tile table can
// select (tests/test_traits_cpu.py compiles a static_assert per variant with NVRTC, no GPU).
//
// Units: `*_offset` and `*_bytes` are bytes (offsets from the start of dynamic shared memory),
// `*_elems` 16-bit elements, `*_floats` float32 entries. Positions inside a pipeline stage
// (`*_in_stage`) count elements of the stage's type (u16 tiles; floats for lse and delta)
// because the kernels step through stages with typed pointers, as they always have: the same
// pointer arithmetic keeps the generated code, and so ptxas's register counts, unchanged.
// Every buffer starts on a 16-byte boundary: cp.async.cg copies 16 bytes and ldmatrix reads
// 16-byte rows, both aligned.
#pragma once
#include "common.cuh"

// Threads per warp.
constexpr int PW_WARP_SIZE = 32;
// Rows of one m16n8k16 row block: a warp owns PW_MMA_ROWS * MW rows of its tile.
constexpr int PW_MMA_ROWS = 16;
// Most row blocks a warp owns: MW = 2 makes each shared-memory B fragment feed two mma.
constexpr int PW_MAX_MW = 2;
// cp.async pipeline depth: pipelined_tiles (common.cuh) alternates two stages (stage ^ 1).
constexpr int PW_STAGES = 2;
// Bytes of a tile unit in shared memory: float16 and bfloat16 travel as raw u16, float32 as
// pairs of them (the traits take D in 16-bit units: 2 * D for float32; common.cuh, Elem).
constexpr int PW_ELEM_BYTES = (int)sizeof(u16);
// Float32 row statistics staged per query row: the log-sum-exp and delta = rowsum(dO * O).
constexpr int PW_STATS_PER_ROW = 2;
// Alignment every buffer keeps (cp.async 16-byte copies, ldmatrix 16-byte rows).
constexpr int PW_SMEM_ALIGN = 16;

// What all three families share: the warp split of the tile whose rows the warps own
// (OWN_ROWS: query rows in the forward and dq kernels, key rows in the dk/dv kernel) and the
// row geometry of an (ROWS x D) tile. Rows are padded to Pitch<D> (common.cuh: D + 8 elements,
// so the eight 16-byte rows an ldmatrix phase reads fall in distinct banks).
template <int D, int OWN_ROWS, int WARPS> struct TileTraitsBase {
  static constexpr int warps = WARPS;
  static constexpr int threads = WARPS * PW_WARP_SIZE;
  static constexpr int MW = OWN_ROWS / (PW_MMA_ROWS * WARPS);  // 16-row blocks per warp
  static_assert(OWN_ROWS == PW_MMA_ROWS * MW * WARPS && MW >= 1 && MW <= PW_MAX_MW,
                "warps own 16 or 32 rows of the tile");
  static constexpr int warp_rows = PW_MMA_ROWS * MW;    // rows of the tile one warp owns
  static constexpr int stages = PW_STAGES;
  static constexpr int pitch = Pitch<D>::elems;          // padded row, elements
  static constexpr int row_bytes = Pitch<D>::bytes;      // padded row, bytes
  static_assert(row_bytes == pitch * PW_ELEM_BYTES, "Pitch<D> counts 2-byte elements");
  static_assert(row_bytes % PW_SMEM_ALIGN == 0, "padded rows keep 16-byte alignment");
  // A warp's rows start at element warp * warp_rows * pitch of the tile it owns.
};

// pw_forward (phases fwd and fwd_decode; forward.cu). Rows of the block are queries.
//   [q1 tile | q2 tile | stage 0: k1, k2, v | stage 1: k1, k2, v]
// ONE_K: one key slot per stage, [q1 | q2 | stage 0: k, v | stage 1: k, v]; a straddling
// tile's second projection is loaded into the slot between its two visits (forward.cu).
template <int D, int BM, int BN, int WARPS, bool ONE_K = false>
struct FwdTraits : TileTraitsBase<D, BM, WARPS> {
  using Base = TileTraitsBase<D, BM, WARPS>;
  static constexpr int block_m = BM, block_n = BN;
  static constexpr int q_tile_elems = BM * Base::pitch;   // one (BM x D) query-side tile
  static constexpr int k_tile_elems = BN * Base::pitch;   // one (BN x D) key-side tile
  static constexpr int q_tile_bytes = q_tile_elems * PW_ELEM_BYTES;
  static constexpr int k_tile_bytes = k_tile_elems * PW_ELEM_BYTES;
  static constexpr int q1_offset = 0;
  static constexpr int q2_offset = q1_offset + q_tile_bytes;
  static constexpr int kv_offset = q2_offset + q_tile_bytes;  // stage 0 of the key tiles
  // Within a stage (elements from the stage's start): k1, k2, v.
  static constexpr int k1_in_stage = 0;
  static constexpr int k2_in_stage = k1_in_stage + (ONE_K ? 0 : k_tile_elems);
  static constexpr int v_in_stage = k2_in_stage + k_tile_elems;
  static constexpr int stage_elems = v_in_stage + k_tile_elems;
  static constexpr int stage_bytes = stage_elems * PW_ELEM_BYTES;
  static constexpr int smem_bytes = kv_offset + Base::stages * stage_bytes;
  static_assert(kv_offset % PW_SMEM_ALIGN == 0 && stage_bytes % PW_SMEM_ALIGN == 0,
                "buffers start on 16-byte boundaries");
  // PW_FWD_Q_ROTATE's layout (fwd_q_rotate below): three slots of one Q tile each, whose
  // roles rotate over the key sweep
  static constexpr int q_rotate_smem_bytes = 3 * q_tile_bytes;
};

// Whether pw_forward keeps one key slot per stage (FwdTraits' ONE_K; capability.py
// fwd_one_key_slot says the same for the launch's shared-memory size): 16-bit inputs
// (width 1), D >= 128 and 32 query rows per warp. There the two Q tiles are 70 KB at BM = 128,
// and dropping the second key slot takes 128x32x4 from 122 KB to 104 KB, so two blocks share
// an SM (255 registers per thread still allow two 4-warp blocks): 1.12-1.21x the forward
// of the 128x64x8 table entry before on an H200 (bench/results/2026-12-04-h200-fwd-one-key-slot).
// PW_FWD_ONE_K_D64 (1, the default since 2026-12-05; host mirror capability.FWD_ONE_K_D64;
// 0 builds the earlier two-slot layout): D = 64 at BN = 128 too, FlashAttention-2's D = 64
// forward tile 128x128x4, which then needs 110592 bytes (two blocks per SM; 147456 and one
// with two key slots, where the merged body also spills 164 bytes). On an H100 it ran
// 1.07-1.12x the 128x64x4 entry before it (scripts/mma_fwd_probe.py, bf16 and fp16, causal
// and not, L 2048 and 8192, 24/24 reference checks; bench/NOTES.md, thirty-fourth section).
// Other D = 64 tiles keep two slots (at 128x64x4 one slot timed 0.97-1.06x: not taken).
#ifndef PW_FWD_ONE_K_D64
#define PW_FWD_ONE_K_D64 1
#endif
__host__ __device__ constexpr bool fwd_one_key_slot(int width, int D, int BM, int BN, int WARPS) {
  return width == 1 && (D >= 128 || (PW_FWD_ONE_K_D64 && D == 64 && BN == 128)) &&
         BM == 2 * PW_MMA_ROWS * WARPS;
}
// PW_FWD_Q_ROTATE (1, the default since 2026-12-05; 0 builds the earlier four-slot layout,
// kept for A/B builds): a one-key-slot forward tile whose key stage (k and v of BN keys) is
// as large as one Q tile (BM == 2 * BN) keeps three such slots instead of four (q1, q2, two
// stages), and their roles rotate as the block sweeps its key tiles in order. Far tiles
// (every pair d >= w: q2·k2 only) come first: [q2 | stage | stage], and the straddling tiles'
// q2·k2 visits end that phase; then q1 goes into the third slot and the straddling tiles'
// q1·k1 visits start the near phase (q1·k1 only), which reuses q2's slot: [stage | stage | q1]
// (the straddle split, the default since 2026-12-07: forward.cu; before it the straddling
// tiles ran single-buffered between the two phases, [q2 | stage | q1]).
// That takes 128x64x4 at D = 128, FlashAttention-2's D = 128 shape on sm_90 (32 rows x 64
// keys per warp: 16 score accumulators, twice 128x32x4's), from 139 KB to 104 KB (139264
// and 104448 bytes), so two blocks share an SM; its dense forms build without spills. It
// became the default, with 128x64x4 as the sm_90 D = 128 forward entry (capability.TABLE),
// on an H200 measurement (2026-12-05, scripts/mma_fwd_probe.py, 36/36 reference checks per
// build): 1.08-1.16x the table's 128x32x4 before on all 12 rows (bf16/fp16, causal and not,
// L 2048/8192/16384), 0.85-0.93x SDPA flash at L 2048 and 0.95-0.99x at L 8192-16384. (Its
// first build, which spilled, ran 1.03-1.10x: bench/NOTES.md, twenty-seventh section.) With
// 0, 128x64x4 at D = 128 keeps q1, q2 and two stages (139264 bytes: one block per SM). The
// host mirrors the macro in capability.FWD_Q_ROTATE (capability.apply_kernel_macros).
#ifndef PW_FWD_Q_ROTATE
#define PW_FWD_Q_ROTATE 1
#endif
__host__ __device__ constexpr bool fwd_q_rotate(int width, int D, int BM, int BN, int WARPS) {
  return PW_FWD_Q_ROTATE && fwd_one_key_slot(width, D, BM, BN, WARPS) && BM == 2 * BN;
}

// The rotating-slot forward's key-tile phases (forward.cu, PW_FWD_Q_ROTATE) for the query
// tile at m0 (BM rows) over its key tiles t (BN keys each) in [t_begin, ntiles): far tiles
// (every d >= w: tile_mode 2) are [t_begin, far_end), straddling ones (mode 3)
// [far_end, near_begin), near ones (every d < w: mode 1) [near_begin, ntiles); and a far or
// near tile needs the mask exactly when t >= mask_begin (its last key is past N or, causal,
// after some query of the tile: tile_needs_mask). Closed forms of those definitions, which
// tile_mode's distances make monotone in t; tests/test_traits_cpu.py checks them with
// static_asserts against the definitions on random geometries.
struct RotatePhases {
  int far_end, near_begin, mask_begin;
};
__host__ __device__ constexpr RotatePhases fwd_rotate_phases(i64 m0, int BM, int BN, i64 P, i64 w,
                                                             i64 N, int t_begin, int ntiles,
                                                             bool causal) {
  // far_end: the first tile with some d < w (n0 >= m0 + P - w - BN + 2); near_begin: the
  // first with no d >= w (n0 > m0 + BM - 1 + P - w)
  const int far_end = (int)clamp64(ceil_div(m0 + P - w - BN + 2, BN), t_begin, ntiles);
  const int near_begin = (int)clamp64(floor_div(m0 + BM - 1 + P - w, BN) + 1, far_end, ntiles);
  const i64 past_n = N / BN;                        // n0 + BN > N
  const i64 diagonal = floor_div(m0 + P + 1, BN);  // (causal) some key after its query
  return {far_end, near_begin, (int)(causal && diagonal < past_n ? diagonal : past_n)};
}

// pw_forward's dynamic shared memory with both rules applied (what capability.shared_bytes
// gives; tests/test_traits_cpu.py compares the two per selectable variant, macros included)
template <int DS, int BM, int BN, int WARPS, bool ONE_K, bool QROT> struct FwdLayoutBytes {
  using L = FwdTraits<DS, BM, BN, WARPS, ONE_K>;
  static constexpr int smem_bytes = QROT ? L::q_rotate_smem_bytes : L::smem_bytes;
};

// pw_backward_dq (phase bwd_dq; backward.cu). Rows of the block are queries.
//   [q1 | q2 | dO | stage 0: k1, k2, v | stage 1: k1, k2, v | lse, delta (reserved)]
// The last region (PW_STATS_PER_ROW floats per query row) is part of the launch size that
// capability.shared_bytes has always given this kernel, but the kernel reads each thread's
// lse and delta from global memory straight into registers and never touches it. It is kept
// so the layout and launch size stay as they were; drop it here and in shared_bytes together.
template <int D, int BM, int BN, int WARPS> struct BwdDqTraits : TileTraitsBase<D, BM, WARPS> {
  using Base = TileTraitsBase<D, BM, WARPS>;
  static constexpr int block_m = BM, block_n = BN;
  static constexpr int q_tile_elems = BM * Base::pitch;
  static constexpr int k_tile_elems = BN * Base::pitch;
  static constexpr int q_tile_bytes = q_tile_elems * PW_ELEM_BYTES;
  static constexpr int k_tile_bytes = k_tile_elems * PW_ELEM_BYTES;
  static constexpr int q1_offset = 0;
  static constexpr int q2_offset = q1_offset + q_tile_bytes;
  static constexpr int do_offset = q2_offset + q_tile_bytes;
  static constexpr int kv_offset = do_offset + q_tile_bytes;  // stage 0 of the key tiles
  // Within a stage (elements from the stage's start): k1, k2, v. Pass `pair` of the kernel
  // reads k_pair at k1_in_stage + (pair - 1) * k_tile_elems.
  static constexpr int k1_in_stage = 0;
  static constexpr int k2_in_stage = k1_in_stage + k_tile_elems;
  static constexpr int v_in_stage = k2_in_stage + k_tile_elems;
  static constexpr int stage_elems = v_in_stage + k_tile_elems;
  static constexpr int stage_bytes = stage_elems * PW_ELEM_BYTES;
  static constexpr int stats_offset = kv_offset + Base::stages * stage_bytes;  // reserved
  static constexpr int stats_bytes = PW_STATS_PER_ROW * BM * (int)sizeof(float);
  static constexpr int smem_bytes = stats_offset + stats_bytes;
  static_assert(kv_offset % PW_SMEM_ALIGN == 0 && stage_bytes % PW_SMEM_ALIGN == 0 &&
                    stats_offset % PW_SMEM_ALIGN == 0,
                "buffers start on 16-byte boundaries");
};

// pw_backward_dkv (phase bwd_dkv; backward.cu). Rows of the block are keys; query tiles and
// their row statistics stream through the stages.
//   [k1 | k2 | v | stage 0: q1, q2, dO | stage 1: q1, q2, dO | stage 0: lse, delta | stage 1: ...]
// FUSED (the one-kernel backward, dQ by float32 atomics) appends one buffer:
//   [... | dS of the current tile, key-major: BN rows of BM 16-bit entries, pitch BM + 8]
// The pitch of BM + 8 puts the eight 16-byte rows an ldmatrix phase reads, and the 32-bit
// stores of one fragment row, in distinct banks for every BM in {16, 32, 64, 128}.
template <int D, int BM, int BN, int WARPS, bool FUSED = false>
struct BwdDkvTraits : TileTraitsBase<D, BN, WARPS> {
  using Base = TileTraitsBase<D, BN, WARPS>;
  static constexpr int block_m = BM, block_n = BN;
  static constexpr int k_tile_elems = BN * Base::pitch;
  static constexpr int q_tile_elems = BM * Base::pitch;
  static constexpr int k_tile_bytes = k_tile_elems * PW_ELEM_BYTES;
  static constexpr int q_tile_bytes = q_tile_elems * PW_ELEM_BYTES;
  static constexpr int k1_offset = 0;
  static constexpr int k2_offset = k1_offset + k_tile_bytes;
  static constexpr int v_offset = k2_offset + k_tile_bytes;
  static constexpr int q_offset = v_offset + k_tile_bytes;  // stage 0 of the query-side tiles
  // Within a stage (elements from the stage's start): q1, q2, dO. Pass `pair` of the kernel
  // reads q_pair at q1_in_stage + (pair - 1) * q_tile_elems.
  static constexpr int q1_in_stage = 0;
  static constexpr int q2_in_stage = q1_in_stage + q_tile_elems;
  static constexpr int do_in_stage = q2_in_stage + q_tile_elems;
  static constexpr int stage_elems = do_in_stage + q_tile_elems;
  static constexpr int stage_bytes = stage_elems * PW_ELEM_BYTES;
  // Row statistics of the streamed query tile, float32, per stage: lse[BM] then delta[BM].
  static constexpr int stats_offset = q_offset + Base::stages * stage_bytes;
  static constexpr int lse_in_stage = 0;     // floats: lse of the tile's BM rows
  static constexpr int delta_in_stage = BM;  // floats: delta of the tile's BM rows
  static constexpr int stats_stage_floats = PW_STATS_PER_ROW * BM;
  static constexpr int stats_stage_bytes = stats_stage_floats * (int)sizeof(float);
  static constexpr int ds_offset = stats_offset + Base::stages * stats_stage_bytes;
  static constexpr int ds_pitch = BM + 8;  // elements (always 16-bit: FUSED is 16-bit only)
  static constexpr int ds_pitch_bytes = ds_pitch * PW_ELEM_BYTES;
  static constexpr int ds_bytes = FUSED ? BN * ds_pitch_bytes : 0;
  static constexpr int smem_bytes = ds_offset + ds_bytes;
  static_assert(q_offset % PW_SMEM_ALIGN == 0 && stage_bytes % PW_SMEM_ALIGN == 0 &&
                    stats_offset % PW_SMEM_ALIGN == 0 && stats_stage_bytes % PW_SMEM_ALIGN == 0 &&
                    ds_offset % PW_SMEM_ALIGN == 0 && ds_pitch_bytes % PW_SMEM_ALIGN == 0,
                "buffers start on 16-byte boundaries");
};

// pw_backward_grid (phase bwd_grid; backward.cu): the one-kernel backward on a 2-D warp grid
// (FlashAttention-2's decomposition). Rows of the block are BN keys (32 per warp row of the
// grid), BM = 64 queries stream through the stages; Pᵀ and dSᵀ pass through shared memory.
//   [k1 | k2 | v | stage 0: q1, q2, dO | stage 1: q1, q2, dO | stage 0: lse, delta |
//    stage 1: lse, delta | Pᵀ (then dSᵀ) | dSᵀ (grid_two_ds_buffers only)]
// Pᵀ/dSᵀ: BN rows (keys) of BM 16-bit entries at a pitch of BM + 8 (distinct banks for the
// eight 16-byte rows of an ldmatrix phase). Offsets here are all bytes.
// Whether Pᵀ and dSᵀ get a buffer each (else dSᵀ overwrites Pᵀ after dV's product, one
// barrier more per tile): where the second buffer fits every listed architecture the entry
// serves: D <= 64 with 8 warps (148480 bytes with two; the 4-warp D = 64 layout needs 102400
// with two, over sm_86/89's 101376). At D = 128 one buffer takes 8 warps to 228352 bytes
// (sm_90 only) and 4 warps to 166912, an A100's whole 163 KiB. capability.grid_two_ds_buffers
// mirrors it.
// PW_GRID_TWO_DS=1 (an A/B build; host mirror capability.GRID_TWO_DS_D64; on an H100 its
// share of the backward's time was inside the probe's noise, bench/results/
// 2026-12-06-h100-one-barrier): two buffers at D <= 64 with 4 warps as well, which saves the
// tile's third barrier (dSᵀ waiting for every warp's dV product to finish reading Pᵀ). The
// 4-warp D = 64 layout then takes 102400 bytes: two blocks per SM on sm_80 (163 KiB) and
// sm_90 (227 KiB), but over sm_86/89's 99 KiB per block, so a default made of it would have
// to depend on the architecture.
#ifndef PW_GRID_TWO_DS
#define PW_GRID_TWO_DS 0
#endif
__host__ __device__ constexpr bool grid_two_ds_buffers(int D, int WARPS) {
  return D <= 64 && (WARPS == 8 || (PW_GRID_TWO_DS && WARPS == 4));
}
template <int D, int BM, int BN, int WARPS> struct BwdGridTraits {
  static_assert(BM == 64 && (WARPS == 4 || WARPS == 8) && BN == 16 * WARPS,
                "64 queries a step; 2 x (BN / 32) warps, each 32 keys x 32 queries of the scores");
  static constexpr int warps = WARPS;
  static constexpr int threads = WARPS * PW_WARP_SIZE;
  static constexpr int block_m = BM, block_n = BN;
  static constexpr int warps_k = BN / 32;  // warps along the keys; 2 along queries / columns
  static constexpr int kv_cols = D / 2;    // dK, dV columns each warp accumulates
  // dQ (BM x D) in warp tiles of 32 queries x dq_cols columns, dq_tiles of them per warp
  static constexpr int dq_cols = 2 * D / WARPS < 32 ? 2 * D / WARPS : 32;
  static constexpr int dq_tiles = 2 * D / dq_cols / WARPS;
  static_assert(dq_cols % 16 == 0 && dq_tiles * dq_cols * WARPS == 2 * D, "dQ tiles cover D");
  static constexpr int row_bytes = Pitch<D>::bytes;
  static constexpr int k_tile_bytes = BN * row_bytes;
  static constexpr int q_tile_bytes = BM * row_bytes;
  static constexpr int k1_offset = 0;
  static constexpr int k2_offset = k1_offset + k_tile_bytes;
  static constexpr int v_offset = k2_offset + k_tile_bytes;
  static constexpr int q_offset = v_offset + k_tile_bytes;  // stage 0 of the query-side tiles
  static constexpr int q1_in_stage = 0;  // bytes from the stage's start; q2 follows q1
  static constexpr int q2_in_stage = q1_in_stage + q_tile_bytes;
  static constexpr int do_in_stage = q2_in_stage + q_tile_bytes;
  static constexpr int stage_bytes = do_in_stage + q_tile_bytes;
  static constexpr int stats_offset = q_offset + PW_STAGES * stage_bytes;
  static constexpr int lse_in_stage = 0;     // floats
  static constexpr int delta_in_stage = BM;  // floats
  static constexpr int stats_stage_floats = PW_STATS_PER_ROW * BM;
  static constexpr int stats_stage_bytes = stats_stage_floats * (int)sizeof(float);
  static constexpr int pt_offset = stats_offset + PW_STAGES * stats_stage_bytes;
  static constexpr int pt_pitch_bytes = (BM + 8) * PW_ELEM_BYTES;
  static constexpr int pt_bytes = BN * pt_pitch_bytes;
  static constexpr bool two_buffers = grid_two_ds_buffers(D, WARPS);
  static constexpr int ds_offset = pt_offset + (two_buffers ? pt_bytes : 0);
  static constexpr int smem_bytes = ds_offset + pt_bytes;
  static_assert(q_offset % PW_SMEM_ALIGN == 0 && stage_bytes % PW_SMEM_ALIGN == 0 &&
                    stats_offset % PW_SMEM_ALIGN == 0 && pt_offset % PW_SMEM_ALIGN == 0 &&
                    pt_pitch_bytes % PW_SMEM_ALIGN == 0,
                "buffers start on 16-byte boundaries");
};

// pw_kvcache (phases kvcache, KSLOTS = 2, and kvdecode, KSLOTS = 1; kvcache.cu). Rows of the
// block are BM = 16 packed query rows (the heads of a key/value group times the new tokens);
// key tiles of BN rows stream through a STAGES-deep ring and each warp owns 16 keys of a
// tile. kvdecode's single key slot holds, row by row, whichever projection the key needs.
//   [q1 tile | q2 tile | stage 0: k1, k2, v | ... | stage STAGES-1: k1, k2, v]   (KSLOTS 2)
//   [q1 tile | q2 tile | stage 0: k, v | ... | stage STAGES-1: k, v]             (KSLOTS 1)
// After the loop the ring holds the warps' merge scratch: their unnormalised outputs
// (WARPS x BM x D float32), then their rows' max and sum (WARPS x BM float32 each).
template <int D, int BM, int BN, int WARPS, int STAGES, int KSLOTS> struct KvTraits {
  static_assert(BM == PW_MMA_ROWS && BN == PW_MMA_ROWS * WARPS,
                "one 16-row query block; 16 keys per warp");
  static_assert(STAGES >= 2, "the ring needs two stages");
  static_assert(KSLOTS == 1 || KSLOTS == 2, "one key slot (kvdecode) or two (kvcache)");
  static constexpr int threads = WARPS * PW_WARP_SIZE;
  static constexpr int pitch = Pitch<D>::elems;
  static constexpr int q_tile_elems = BM * pitch;
  static constexpr int k_tile_elems = BN * pitch;
  static constexpr int q1_offset = 0;  // elements
  static constexpr int q2_offset = q1_offset + q_tile_elems;
  static constexpr int kv_offset = q2_offset + q_tile_elems;
  static constexpr int k1_in_stage = 0;
  static constexpr int k2_in_stage = (KSLOTS - 1) * k_tile_elems;  // kvdecode: the same slot
  static constexpr int v_in_stage = KSLOTS * k_tile_elems;
  static constexpr int stage_elems = (KSLOTS + 1) * k_tile_elems;
  static constexpr int smem_bytes = (kv_offset + STAGES * stage_elems) * PW_ELEM_BYTES;
  static constexpr int merge_bytes = WARPS * BM * (D + 2) * (int)sizeof(float);
  static_assert(merge_bytes <= STAGES * stage_elems * PW_ELEM_BYTES,
                "the warps' merge scratch fits in the ring");
  static_assert((kv_offset * PW_ELEM_BYTES) % PW_SMEM_ALIGN == 0, "16-byte aligned stages");
};
