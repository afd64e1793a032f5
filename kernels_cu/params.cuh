// Kernel arguments: one plain struct passed by value, packed on the host by
// cupy_piecewise/launch.py (PARAM_FIELDS there mirrors this layout field by field: all
// members are 8 bytes, so there is no padding to keep in step).
#pragma once
#include "common.cuh"

struct Tensor {  // a (B, heads, rows, D) view with unit stride along D
  const u16* ptr;
  i64 sb, sh, sr;  // batch, head and row strides in elements
  PW_DEVICE const u16* at(i64 b, i64 h) const { return ptr + b * sb + h * sh; }
  PW_DEVICE u16* mut(i64 b, i64 h) const { return const_cast<u16*>(ptr) + b * sb + h * sh; }
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
  float* o_part;    // (nsplit, B, H, M, D) float32
  float* lse_part;  // (nsplit, B, H, M) float32, natural log
  // Position shift P of d(i, j) = i + P - j: N - M by default, q_offset - k_offset with
  // position offsets (clamped by the host to [-M, N], with w to match).
  i64 shift;
  const float* dlse;  // (B, H, M) contiguous gradient of lse, or null: delta -= dlse
};
