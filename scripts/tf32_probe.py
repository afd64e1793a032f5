"""TF32 operand rounding on this GPU: what the tensor cores do with a float32 operand's low
13 bits, and the accuracy of the float32 kernels built with each rounding form (the
default cvt.rna.tf32.f32, or with --add the -DPW_TF32_ADD=1 build: bits + 0x1000).

    PYTHONPATH=$PWD python3 scripts/tf32_probe.py [--seeds 12] [--add]

Part 1 runs one m16n8k8 TF32 mma.sync with A = x (every element), B = 1 (k = 8): C = 8 x as
the hardware reads x. Part 2 (in this process: the default build, or with --add the
-DPW_TF32_ADD=1 build of kernels_cu/common.cuh) runs float32 cases through the public API
and prints each output's relative L2 error against the float64 reference beside the "tf32"
yardstick's (reference.lowp_*), for fresh seeds. Writes nothing; prints a table.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

sys.path.insert(0, "tests")

KERNEL = r"""
extern "C" __global__ void tf32_mma(const unsigned* a_bits, float* c_out) {
  unsigned a = a_bits[0], b = 0x3f800000u;  // B = 1.0
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a), "r"(a), "r"(a), "r"(a), "r"(b), "r"(b));
  if (threadIdx.x == 0) c_out[0] = c[0];
}
"""


def hardware_reading():
    import cupy

    fn = cupy.RawKernel(KERNEL, "tf32_mma")
    print("x (bits)            8 x as read by the mma    read as")
    for x in (1.0 + 0.75 * 2**-10, 1.0 + 0.5 * 2**-10, 1.0 + 0.25 * 2**-10, 1.0 + 2**-10):
        bits = np.array([np.float32(x).view(np.uint32)], np.uint32)
        out = cupy.zeros(1, cupy.float32)
        fn((1,), (32,), (cupy.asarray(bits), out))
        got = float(out.get()[0]) / 8
        print(f"{x:.10f} ({bits[0]:#010x})  {8 * got:.8f}  {got:.10f}")


def accuracy(seeds: int):
    import cupy

    import cupy_piecewise
    from cupy_piecewise import reference, tolerance

    cases = [dict(M=3, N=700, w=300, D=64, causal=True), dict(M=150, N=201, w=40, D=64, causal=False),
             dict(M=700, N=700, w=128, D=128, causal=True)]
    names = ("o", "dq1", "dk1", "dq2", "dk2", "dv")
    for c in cases:
        worst_k, worst_l = {n: 0.0 for n in names}, {n: 0.0 for n in names}
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            B, H, Hkv = 2, 2, 1
            shapes = [(B, H, c["M"], c["D"]), (B, Hkv, c["N"], c["D"])] * 2 + [(B, Hkv, c["N"], c["D"])]
            host = [(rng.standard_normal(s) * 1.5).astype(np.float32) for s in shapes]
            do = rng.standard_normal(shapes[0]).astype(np.float32)
            sm = 1 / np.sqrt(c["D"])
            dev = [cupy.asarray(x) for x in host]
            o, lse = cupy_piecewise.attention(*dev, c["w"], causal=c["causal"], sm_scale=sm, return_lse=True)
            g = cupy_piecewise.attention_backward(cupy.asarray(do), *dev, o, lse, c["w"], causal=c["causal"],
                                                  sm_scale=sm)
            ok, lk = cupy.asnumpy(o), cupy.asnumpy(lse)
            o_ref, _ = reference.forward(*host, c["w"], c["causal"], sm)
            o_low, _ = reference.lowp_forward(*host, c["w"], c["causal"], sm, dtype="tf32")
            ref = reference.backward(*host, ok, lk, do, c["w"], c["causal"], sm)
            low = reference.lowp_backward(*host, ok, lk, do, c["w"], c["causal"], sm, dtype="tf32")
            pairs = [("o", ok, o_ref, o_low)] + list(zip(names[1:], [cupy.asnumpy(x) for x in g], ref, low))
            for n, k, r, lw in pairs:
                worst_k[n] = max(worst_k[n], tolerance.compare(n, k, r, lw, "tf32").rel_err)
                worst_l[n] = max(worst_l[n], tolerance.compare(n, lw, r, lw, "tf32").rel_err)
        print(f"{c}: worst relative L2 error over {seeds} seeds, kernel / yardstick")
        print("   " + "  ".join(f"{n} {worst_k[n]:.2e} / {worst_l[n]:.2e}" for n in names))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--add", action="store_true", help="build the kernels with -DPW_TF32_ADD=1")
    a = ap.parse_args()
    if a.add:
        from cupy_piecewise import compile as C

        C.BASE_OPTIONS = C.BASE_OPTIONS + ("-DPW_TF32_ADD=1",)
    else:
        hardware_reading()
    print("rounding:", "bits + 0x1000 (-DPW_TF32_ADD=1)" if a.add else "cvt.rna.tf32.f32 (default)")
    accuracy(a.seeds)
