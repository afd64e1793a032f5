// Hopper (sm_90a) building blocks for the piecewise-attention prototype: element types, TMA
// (cp.async.bulk.tensor), mbarriers, wgmma descriptors and fences, register reallocation.
//
// Self-contained inline PTX: NVRTC has no CUDA headers here. Everything lives in namespace
// pw90 so this file can later sit beside kernels_cu/common.cuh in one translation unit.
// Compile with -arch=sm_90a (wgmma and setmaxnreg are rejected on plain sm_90).
#pragma once

namespace pw90 {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define PW90 __device__ __forceinline__
#define PW90_LOG2E 1.4426950408889634f
#define PW90_LN2 0.6931471805599453f
#define PW90_NEG_INF (-__int_as_float(0x7f800000))

struct f16 {};   // IEEE binary16 (raw 16-bit patterns in memory)
struct bf16 {};  // bfloat16

template <typename T> struct Cvt;
template <> struct Cvt<f16> {
  // cvt.*x2 puts its first source in the upper half: pass (hi, lo).
  static PW90 u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};
template <> struct Cvt<bf16> {
  static PW90 u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

PW90 float exp2f_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
PW90 float log2f_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

PW90 u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// ---------------------------------------------------------------- tensor maps (TMA)
// A CUtensorMap built on the host (cupy_piecewise/tma.py), passed by value as a
// `const __grid_constant__` kernel parameter: 128 bytes, 64-byte aligned.
struct __align__(64) TmaDesc {
  u64 opaque[16];
};

PW90 void tma_prefetch_desc(const TmaDesc* d) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(d)) : "memory");
}

// 4-D tiled load {c0 innermost (elements along D), c1 rows, c2 head, c3 batch} into shared
// memory at `dst`, completing `bytes` on the mbarrier `bar` (the caller's expect_tx counts
// them). Out-of-range rows are filled with zeros.
PW90 void tma_load_4d(u32 dst, const TmaDesc* d, int c0, int c1, int c2, int c3, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
      "l"(reinterpret_cast<u64>(d)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// 5-D tiled load {c0 .. c4, innermost first}, as tma_load_4d (the Hopper decode's row boxes,
// KV90_ROW_BOX: {column in a 64-column panel, panel, row, head, batch or page}).
PW90 void tma_load_5d(u32 dst, const TmaDesc* d, int c0, int c1, int c2, int c3, int c4,
                      u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];" ::"r"(dst),
      "l"(reinterpret_cast<u64>(d)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}

// Plain (non-tensor) bulk copy of `bytes` contiguous bytes from global `src` into shared
// memory at `dst`, completing on the mbarrier `bar` as tma_load_4d does. Both addresses and
// `bytes` are multiples of 16.
PW90 void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(reinterpret_cast<u64>(src)), "r"(bytes), "r"(bar)
      : "memory");
}

// ---------------------------------------------------------------- mbarriers
PW90 void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
PW90 void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
PW90 void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
PW90 void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Waits until the phase with parity `parity` has completed. On a freshly initialised
// barrier (phase 0 in progress) waiting for parity 1 returns at once: producers start there.
// Debug builds (-DPW90_WAIT_SPIN_LIMIT=N) trap after N unsuccessful polls (each try_wait may
// also suspend the thread for a while), turning a pipeline deadlock into a launch error
// instead of a hung GPU.
#ifndef PW90_WAIT_SPIN_LIMIT
#define PW90_WAIT_SPIN_LIMIT 0
#endif
PW90 void mbar_wait(u32 bar, u32 parity) {
  u32 done;
#if PW90_WAIT_SPIN_LIMIT
  u32 spins = 0;
#endif
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
        " selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
#if PW90_WAIT_SPIN_LIMIT
    if (!done && ++spins > (u32)(PW90_WAIT_SPIN_LIMIT)) asm volatile("trap;");
#endif
  } while (!done);
}

// ---------------------------------------------------------------- wgmma
// Shared-memory matrix descriptor, 128-byte swizzle (layout type 1 in bits 62-63).
// K-major tiles (Q, K: rows of 128 bytes = 64 elements): SBO = 1024 (8 rows x 128 B), LBO
// unused (1). MN-major tiles (V as keys x D, read as B with imm-trans-b = 1): SBO = 1024
// (8 keys x 128 B), LBO = byte stride between 64-column panels of D.
// Tiles must start 1024-byte aligned; a k16 step inside a K-major row adds 32 bytes.
PW90 u64 smem_desc(u32 addr, u32 lbo_bytes, u32 sbo_bytes) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo_bytes >> 4) & 0x3FFF) << 16) |
         ((u64)((sbo_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// The descriptor of smem_desc(addr + bytes, lbo, sbo) from that of smem_desc(addr, lbo, sbo):
// the address field holds addr / 16 in its low 14 bits, and shared addresses stay below 2^18,
// so adding bytes / 16 (bytes a multiple of 16) never carries out of it. One 64-bit add per
// k-step instead of building the descriptor again (mask, shift and an or per field).
PW90 u64 desc_at(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

// A bool as a type: a generic lambda called with BoolC<true>{} or BoolC<false>{} is two
// instantiations, so a warpgroup-uniform run-time branch picks between two compiled bodies.
template <bool B> struct BoolC { static constexpr bool value = B; };

PW90 void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
PW90 void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> PW90 void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pins accumulator registers in program order relative to the (volatile) wgmma asm: the
// compiler may not move their reads or writes across this point.
template <int N> PW90 void reg_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N> PW90 void reg_fence(u32 (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// ---------------------------------------------------------------- register reallocation
template <int R> PW90 void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R)); }
template <int R> PW90 void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R)); }

}  // namespace pw90
