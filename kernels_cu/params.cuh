// Kernel arguments: one plain struct passed by value, packed on the host by
// cupy_piecewise/launch.py (PARAM_FIELDS there mirrors this layout field by field: all
// members are 8 bytes, so there is no padding to keep in step).
#pragma once
#include "common.cuh"

struct Tensor {  // a (B, heads, rows, D) view with unit stride along D
  const u16* ptr;
  // Batch, head and row strides in 16-bit units: elements of float16 and bfloat16, twice
  // the element strides of float32 (launch._pack doubles them; common.cuh, Elem::width).
  i64 sb, sh, sr;
  // Row `row0` of head h of batch entry b (row0: a packed sequence's first row, else 0).
  PW_DEVICE const u16* at(i64 b, i64 h, i64 row0 = 0) const {
    return ptr + b * sb + h * sh + row0 * sr;
  }
  PW_DEVICE u16* mut(i64 b, i64 h, i64 row0 = 0) const { return const_cast<u16*>(at(b, h, row0)); }
};

struct Params {
  Tensor q1, k1, q2, k2, v, o, dout, dq1, dk1, dq2, dk2, dv;
  float* lse;    // (B, H, M) contiguous, natural log; null: the forward does not store it
  float* delta;  // (B, H, M) contiguous, rowsum(dO * O)
  i64 H, group, M, N, w;  // group = H / Hkv; w already clamped to [-(M+N+1), M+N+1]
  float scale_log2;       // sm_scale * log2(e)
  float sm_scale;
  // Split-KV forward (few query tiles, long keys): blockIdx.x enumerates (query tile, split);
  // split s covers key tiles [s*split_tiles, (s+1)*split_tiles) and writes its normalised
  // partial output and log-sum-exp, which pw_forward_combine merges. nsplit == 1: no split.
  i64 nsplit, split_tiles;
  // The split-KV forward's partial results; the fused backward's float32 dQ accumulators
  // (pw_backward_dkv with FUSED: dq_acc1, dq_acc2, each (B, H, M, D), or (H, total_q, D)
  // packed; zeroed by pw_backward_delta, read by pw_backward_dq_convert). The host fills
  // both from one workspace pointer (launch.Launches.run).
  union {
    float* o_part;  // (nsplit, B, H, M, D) float32
    float* dq_acc1;
  };
  union {
    float* lse_part;  // (nsplit, B, H, M) float32, natural log
    float* dq_acc2;
  };
  // Position shift P of d(i, j) = i + P - j: N - M by default, q_offset - k_offset with
  // position offsets (clamped by the host to [-M, N], with w to match).
  i64 shift;
  const float* dlse;  // (B, H, M) contiguous gradient of lse, or null: delta -= dlse
  // Packed variable-length batch (attention_varlen; kernels built with VARLEN), else null:
  // B + 1 running totals of the query and key rows. The views then have batch stride 0 and rows strided
  // through the packed (total, heads, D) arrays, M and N hold total_q and total_k, and lse
  // and delta are (H, total_q).
  const int* cu_q;
  const int* cu_k;
};

// The rows one block works on: batch entry b of a dense call, or sequence b of a packed one.
// A packed kernel keeps these in 32-bit registers for its whole life (lengths stay below
// 2^30, GPU_MAX_LENGTH, and packed totals below 2^31, int32 running totals); a dense one
// reads 64-bit parameters, exactly the code it had before packed batches existed.
template <typename I> struct SeqT {
  I q0, k0;  // its first query / key row in the (packed) arrays; 0 when dense
  I M, N, P;  // its query and key counts and position shift (d = i + P - j)
};
template <bool VARLEN> struct SeqIdx { typedef i64 type; };
template <> struct SeqIdx<true> { typedef int type; };
template <bool VARLEN> using Seq = SeqT<typename SeqIdx<VARLEN>::type>;

// VARLEN is a template flag of the kernels rather than a test of p.cu_q: a dense variant then
// folds q0 = k0 = 0 away and keeps the registers it had before packed batches existed.
template <bool VARLEN> PW_DEVICE Seq<VARLEN> seq_of(const Params& p, i64 b) {
  Seq<VARLEN> s;
  if constexpr (!VARLEN) {
    s.q0 = s.k0 = 0;
    s.M = p.M, s.N = p.N, s.P = p.shift;
  } else {  // each sequence's queries are aligned to the end of its own keys
    s.q0 = p.cu_q[b], s.k0 = p.cu_k[b];
    s.M = p.cu_q[b + 1] - s.q0, s.N = p.cu_k[b + 1] - s.k0, s.P = s.N - s.M;
  }
  return s;
}

// seq_of again at the end of a kernel: the packed case re-reads the running totals through
// volatile loads so that the compiler cannot keep the first read's values in registers
// across the tile loop (they are L1/L2 hits; at head dim 256 the registers are not spare).
template <bool VARLEN> PW_DEVICE Seq<VARLEN> seq_again(const Params& p, i64 b) {
  if constexpr (!VARLEN) {
    return seq_of<false>(p, b);
  } else {
    int q0, q1, k0, k1;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(q0) : "l"(p.cu_q + b));
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(q1) : "l"(p.cu_q + b + 1));
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(k0) : "l"(p.cu_k + b));
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(k1) : "l"(p.cu_k + b + 1));
    Seq<true> s;
    s.q0 = q0, s.k0 = k0, s.M = q1 - q0, s.N = k1 - k0, s.P = s.N - s.M;
    return s;
  }
}

// Index of row 0 of (b, h) in lse and delta: (B, H, M) dense, (H, total_q) packed. A dense
// kernel recomputes it from b and h where needed rather than keep a 64-bit base live.
template <bool VARLEN>
PW_DEVICE i64 stat_row0(const Params& p, const Seq<VARLEN>& s, i64 b, i64 h) {
  return VARLEN ? h * p.M + s.q0 : (b * p.H + h) * p.M;
}
