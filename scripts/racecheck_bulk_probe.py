"""Does compute-sanitizer racecheck credit an mbarrier with ordering a bulk copy after reads?

The staged rotary decode (kernels_cu/sm90/kvdecode.cu, TAB) drew racecheck errors on an
H200 (2026-12-06, bench/NOTES.md): a write at the producer's table copies
(cp.async.bulk ... mbarrier::complete_tx) against the consumers' shared-memory reads of the
same stage, when the ring wraps. Those copies are ordered after the reads the way every
TMA ring orders its refills: the consumers read, then arrive on the stage's empty barrier;
the producer waits on that barrier, then issues the copy.

This probe runs that pattern alone, in one kernel of two warps and a one-slot ring: warp 1
reads the slot (plain loads), then its lane 0 arrives on `empty`; warp 0 waits on `empty`,
then refills the slot with cp.async.bulk, completing on `full`, which warp 1 waits on. With
``--barrier bar`` a block-wide bar.sync orders the reads before the refill as well (the
control). Run it under racecheck for each form:

    compute-sanitizer --tool racecheck python3 scripts/racecheck_bulk_probe.py --barrier mbar
    compute-sanitizer --tool racecheck python3 scripts/racecheck_bulk_probe.py --barrier bar

A hazard reported for ``mbar`` and none for ``bar`` means racecheck does not take the
mbarrier's ordering of a bulk copy into account. The probe checks its own sums either way
(exit 1 on a wrong one). Needs an sm_90 GPU and CuPy."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SOURCE = r"""
#include "common.cuh"
#include "sm90/hopper.cuh"
// ROUNDS refills of one 1 KB slot; BAR 1: a block-wide barrier after the reads too
extern "C" __global__ void __launch_bounds__(64) ring(const float* src, float* out) {
  __shared__ __align__(128) float slot[256];
  __shared__ __align__(8) unsigned long long bars[2];
  const u32 s = smem_addr(slot), full = smem_addr(&bars[0]), empty = smem_addr(&bars[1]);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    pw90::mbar_init(full, 1);
    pw90::mbar_init(empty, 1);
    pw90::mbar_init_fence();
  }
  __syncthreads();
  float acc = 0.f;
  for (int i = 0; i < ROUNDS; ++i) {
    if (warp == 0 && lane == 0) {
      pw90::mbar_wait(empty, (i & 1) ^ 1);  // a fresh barrier passes at once
      pw90::mbar_expect_tx(full, 1024u);
      pw90::bulk_load(s, src + 256 * i, 1024u, full);
    }
    if (warp == 1) {
      pw90::mbar_wait(full, i & 1);
      for (int k = lane; k < 256; k += 32) acc += slot[k];
      __syncwarp();
      if (lane == 0) pw90::mbar_arrive(empty);
    }
#if BAR
    __syncthreads();
#endif
  }
  if (warp == 1) out[lane] = acc;
}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--barrier", choices=("mbar", "bar"), default="mbar",
                    help="mbar: the mbarrier alone orders the reads before the refill; "
                         "bar: a block-wide bar.sync too (the control)")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: at least 1, got {args.rounds}")
    import cupy

    opts = ("-std=c++17", f"-I{os.path.join(ROOT, 'kernels_cu')}", "-arch=sm_90a",
            f"-DROUNDS={args.rounds}", f"-DBAR={int(args.barrier == 'bar')}")
    mod = cupy.RawModule(code=SOURCE, options=opts, backend="nvrtc")
    fn = mod.get_function("ring")
    rng = np.random.default_rng()
    host = rng.integers(-8, 8, (args.rounds, 256)).astype(np.float32)  # exact sums
    src = cupy.asarray(host)
    out = cupy.full(32, np.nan, np.float32)
    fn((1,), (64,), (src, out))
    got = cupy.asnumpy(out)
    want = host.reshape(args.rounds, 8, 32).sum(axis=(0, 1))
    ok = np.array_equal(got, want)
    print(f"barrier={args.barrier} rounds={args.rounds}: sums {'match' if ok else 'DIFFER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
