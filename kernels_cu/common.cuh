// Shared building blocks for the piecewise-attention kernels.
//
// The kernels are compiled at run time by NVRTC, which has no default include path, so this
// header depends on nothing: element types are raw 16-bit patterns and every conversion and
// tensor-core operation is inline PTX. The Python loader splices this file into each kernel
// source, so its text is part of what the compile cache hashes.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define PW_DEVICE __device__ __forceinline__

// ---------------------------------------------------------------- element types
struct half_t {};  // IEEE binary16
struct bf16_t {};  // bfloat16
struct tf32_t {};  // float32 inputs and outputs, products on tensor cores in TF32

// Elem<T>::width is an element's size in 16-bit units. Tiles, row pitches and the strides the
// kernels receive all count 16-bit units, so a float32 row of D elements is stored and copied
// as a row of 2D units: the loaders and the shared-memory layout serve every type unchanged.
template <typename T> struct Elem;

template <> struct Elem<half_t> {
  static constexpr int width = 1;
  // cvt.*x2 puts its first source in the upper half: pass (hi, lo).
  static PW_DEVICE u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static PW_DEVICE float to_float(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
  }
  static PW_DEVICE u16 from_float(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
  static PW_DEVICE void mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <> struct Elem<bf16_t> {
  static constexpr int width = 1;
  static PW_DEVICE u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  // bfloat16 is the top half of a float32: widening is a shift (cvt.f32.bf16 needs sm_90).
  static PW_DEVICE float to_float(u16 x) { return __uint_as_float(((u32)x) << 16); }
  static PW_DEVICE u16 from_float(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
  static PW_DEVICE void mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// float32 inputs: each product runs as m16n8k8 TF32 mma (float32 accumulation). The tensor
// cores read only the upper 19 bits of a TF32 operand: they truncate (measured on an H200,
// scripts/tf32_probe.py). Operands are rounded to nearest first (cvt.rna.tf32.f32: ties away
// from zero), which halves the error and removes truncation's bias toward zero. Every
// fragment read from shared memory passes through `frag` (a no-op for the 16-bit types).
//
// -DPW_TF32_ADD=1 builds the faster form instead: half a TF32 ulp (bit 12) added to the bit
// pattern, the hardware's truncation doing the rest (CUTLASS's round_half_ulp_truncate).
// It rounds every finite value exactly as cvt.rna does, in one integer add where cvt.rna
// compiles to a compare-and-select sequence (D = 128 forward: 3832 instructions against
// 4744, 320 mma each; 7-22% faster on an H200, bench/NOTES.md), but a NaN whose payload sits
// at the top of its range, such as the GPU's canonical NaN 0x7fffffff, carries into the sign
// bit and reads as zero: NaN inputs would give finite outputs. Guarding the add costs more
// than cvt.rna, so the default keeps cvt.rna; rounding once per tile in shared memory
// instead of once per fragment per warp is the way to get the speed back (NOTES).
#ifndef PW_TF32_ADD
#define PW_TF32_ADD 0
#endif
template <> struct Elem<tf32_t> {
  static constexpr int width = 2;
  static PW_DEVICE u32 round_bits(u32 x) {
#if PW_TF32_ADD
    return x + 0x1000u;  // half of TF32's last mantissa bit (bit 13)
#else
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(__uint_as_float(x)));
    return r;
#endif
  }
  static PW_DEVICE u32 round(float x) { return round_bits(__float_as_uint(x)); }
  template <int N> static PW_DEVICE void frag(u32 (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = round_bits(r[i]);
  }
  // Fragment layout (PTX ISA, m16n8k8 .tf32): a thread holds A at rows g, g+8 (g = lane/4)
  // and columns t, t+4 (t = lane%4) as a[0] (g,t), a[1] (g+8,t), a[2] (g,t+4), a[3] (g+8,t+4);
  // B at rows (k) t, t+4 of column g; the accumulator as for m16n8k16.
  static PW_DEVICE void mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Stores of output elements (pointers count 16-bit units): `store2` writes two adjacent
// elements at `at`, `store1` element c of the row at `row`.
template <typename T> PW_DEVICE void store2(u16* at, float x0, float x1) {
  if constexpr (Elem<T>::width == 2)
    *reinterpret_cast<float2*>(at) = make_float2(x0, x1);
  else
    *reinterpret_cast<u32*>(at) = Elem<T>::pack(x0, x1);
}
template <typename T> PW_DEVICE void store1(u16* row, int c, float x) {
  if constexpr (Elem<T>::width == 2)
    reinterpret_cast<float*>(row)[c] = x;
  else
    row[c] = Elem<T>::from_float(x);
}
// Fragments read from shared memory, made ready for the element type's mma (TF32 rounding).
template <typename T, int N> PW_DEVICE void ready(u32 (&r)[N]) {
  if constexpr (Elem<T>::width == 2) Elem<T>::frag(r);
}

// ---------------------------------------------------------------- small math
#define PW_LOG2E 1.4426950408889634f
#define PW_LN2 0.6931471805599453f
#define PW_NEG_INF (-__int_as_float(0x7f800000))
#define PW_POS_INF (__int_as_float(0x7f800000))

PW_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Programmatic dependent launch (sm_90 and later; no-ops below). A kernel launched with the
// programmatic-stream-serialization attribute may start while the kernel before it on the
// stream still runs, once every block of that one has called grid_launch_dependents() (or
// exited); grid_dependency_wait() then blocks until that kernel has completed and its memory
// writes are visible. Without the attribute the wait returns at once. The KV-cache decode and
// its split merge use it so that the merge's launch and block start-up overlap the decode.
PW_DEVICE void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
PW_DEVICE void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Floor and ceiling division for possibly negative numerators (positive divisor). constexpr
// and host-callable so that compile-time checks can evaluate the rules built on them
// (traits.cuh fwd_rotate_phases; tests/test_traits_cpu.py).
__host__ __device__ __forceinline__ constexpr i64 floor_div(i64 a, i64 b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}
__host__ __device__ __forceinline__ constexpr i64 ceil_div(i64 a, i64 b) { return -floor_div(-a, b); }
__host__ __device__ __forceinline__ constexpr i64 clamp64(i64 x, i64 lo, i64 hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// A compile-time int carried by a value (a generic lambda's argument selects its
// instantiation: forward.cu's PW_FWD_Q_ROTATE visits).
template <int V> struct IntConst {
  static constexpr int value = V;
};

// threadIdx.x read by a volatile move, which the compiler may not hoist out of a loop: values
// derived from it inside a loop body are recomputed there each iteration rather than held in
// registers across the loop (backward.cu, PW_BWD_TID_RELOAD).
PW_DEVICE int tid_reload() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// ---------------------------------------------------------------- shared memory access
PW_DEVICE u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

PW_DEVICE void ldsm_x4(u32 r[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

PW_DEVICE u32 lds32(u32 addr) {
  u32 r;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(r) : "r"(addr));
  return r;
}

PW_DEVICE void ldsm_x4_trans(u32 r[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// ---------------------------------------------------------------- asynchronous copies
// A zero source size fills the destination with zeros: rows past the end of a tensor read as 0.
PW_DEVICE void cp_async16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
PW_DEVICE void cp_async4(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}
PW_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> PW_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Tiles live in shared memory as ROWS x D elements with rows padded by 16 bytes: with a row
// pitch of D+8 elements the eight 16-byte rows an ldmatrix phase reads fall in distinct banks
// for every supported head dim, and 16-byte cp.async stores stay aligned.
template <int D> struct Pitch {
  static constexpr int elems = D + 8;
  static constexpr int bytes = (D + 8) * 2;
};

// Copies rows [row0, row0+ROWS) of an (L, D) matrix of 16-bit units (row stride `rs` units;
// a float32 row of D elements is 2D units: common.cuh, Elem::width), unit column
// stride) into a shared tile; rows at or beyond `nvalid` become zeros. When the block's
// threads divide evenly into a row's 16-byte chunks (head dims 16, 32, 64, 128, 256), each
// thread keeps one chunk column and walks rows with a running pointer: precomputed per-row
// addresses would otherwise be hoisted out of the tile loop and pin dozens of registers.
// Head dims such as 80 and 96 (10 and 12 chunks a row) walk the tile's chunks in order
// instead, each thread recomputing its row and column per copy.
// PW_LOAD_TID_RELOAD=1 (staged; 0, the default, keeps every entry's PTX): the copy re-reads
// threadIdx.x (tid_reload) instead of sharing the kernel's, so ptxas recomputes the thread's
// row and chunk per copy rather than holding them across the tile loop. At the D = 64
// forward's 128x128x4 tile with two key slots and the visits body (-DPW_FWD_VISITS=1) the
// held 64-bit chunk offset is the one spilled value (8 bytes; NOTES, thirty-fourth section).
#ifndef PW_LOAD_TID_RELOAD
#define PW_LOAD_TID_RELOAD 0
#endif
template <int ROWS, int D, int THREADS>
PW_DEVICE void load_rows(u32 dst, const u16* src, i64 rs, i64 row0, i64 nvalid) {
  constexpr int CPR = D / 8;  // 16-byte chunks per row
  static_assert(D % 16 == 0, "head dims are multiples of 16");
  if constexpr (THREADS % CPR == 0) {
    constexpr int RSTEP = THREADS / CPR;
    const int tid = PW_LOAD_TID_RELOAD ? tid_reload() : (int)threadIdx.x;
    const int r = tid / CPR, ch = tid % CPR;
    i64 gr = row0 + r;
    const u16* g = src + gr * rs + ch * 8;
    u32 d = dst + r * Pitch<D>::bytes + ch * 16;
#pragma unroll
    for (int it = 0; it < (ROWS + RSTEP - 1) / RSTEP; ++it) {
      if (ROWS % RSTEP == 0 || r + it * RSTEP < ROWS) {
        const bool ok = gr < nvalid;
        cp_async16(d, ok ? g : src, ok);
      }
      gr += RSTEP;
      g += RSTEP * rs;
      d += RSTEP * Pitch<D>::bytes;
    }
  } else {
    constexpr int CHUNKS = ROWS * CPR;
#pragma unroll
    for (int it = 0; it < (CHUNKS + THREADS - 1) / THREADS; ++it) {
      const int c = it * THREADS + (int)threadIdx.x;
      if (CHUNKS % THREADS == 0 || c < CHUNKS) {
        const int r = c / CPR, ch = c % CPR;
        const i64 gr = row0 + r;
        const bool ok = gr < nvalid;
        cp_async16(dst + r * Pitch<D>::bytes + ch * 16, ok ? src + gr * rs + ch * 8 : src, ok);
      }
    }
  }
}

// Copies COUNT consecutive floats starting at index i0 (entries at or past nvalid become 0).
template <int COUNT, int THREADS>
PW_DEVICE void load_f32(u32 dst, const float* src, i64 i0, i64 nvalid) {
#pragma unroll
  for (int it = 0; it < (COUNT + THREADS - 1) / THREADS; ++it) {
    const int c = it * THREADS + (int)threadIdx.x;
    if (COUNT % THREADS == 0 || c < COUNT) {
      const bool ok = i0 + c < nvalid;
      cp_async4(dst + 4 * c, ok ? src + i0 + c : src, ok);
    }
  }
}

// ---------------------------------------------------------------- warp-level products
// Fragment layout (m16n8k16 accumulator): a thread holds rows lane/4 and lane/4+8 of each 8-column
// block, columns 2*(lane%4) and 2*(lane%4)+1, as c[0],c[1] (upper row) and c[2],c[3] (lower row).
//
// A warp owns MW blocks of 16 rows (MW = 1 or 2). Every B fragment read from shared memory
// feeds MW row blocks: with MW = 2 each ldmatrix serves four mma instead of two, which halves
// the shared-memory traffic per tensor-core operation (the limit at MW = 1).

template <int N> PW_DEVICE void zero_n(float* f) {
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = 0.f;
}

template <int D, int MW>
PW_DEVICE void load_a(u32 a[MW][4], u32 sA, int k, int lane) {
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
    ldsm_x4(a[mi], sA + (mi * 16 + lane % 16) * Pitch<D>::bytes + (k * 16 + (lane / 16) * 8) * 2);
}

// B fragments of the 16 rows np*16.. of a row-major (rows x D) tile, k-slice k: the two
// 8-row halves in b[0..1] and b[2..3].
template <int D> PW_DEVICE void load_b(u32 b[4], u32 sB, int np, int k, int lane) {
  ldsm_x4(b, sB + (np * 16 + (lane % 8) + (lane / 16) * 8) * Pitch<D>::bytes +
                 (k * 16 + ((lane / 8) % 2) * 8) * 2);
}

// The products below take the head dim D in elements; tiles in shared memory are rows of
// DS = D * Elem<T>::width 16-bit units (Pitch<DS>). One k-step reads 32 bytes of each row:
// 16 elements of a 16-bit type (m16n8k16), 8 floats for TF32 (m16n8k8). ldmatrix hands each
// thread 32-bit words at (row lane/4, word lane%4) of each 8 x 16-byte matrix, which is the
// TF32 A and B fragment layout as well, so the same loads serve both.

// acc(16MW x 16, column block np of the tile) += A(16MW x D) * B(16 rows np*16.., D)^T.
template <typename T, int D, int MW>
PW_DEVICE void mma_abt_block(float acc[MW][2][4], u32 sA, u32 sB, int np, int lane) {
  constexpr int DS = D * Elem<T>::width;
#pragma unroll
  for (int k = 0; k < DS / 16; ++k) {
    u32 a[MW][4], b[4];
    load_a<DS, MW>(a, sA, k, lane);
    load_b<DS>(b, sB, np, k, lane);
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) ready<T>(a[mi]);
    ready<T>(b);
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
      Elem<T>::mma(acc[mi][0], a[mi], b[0], b[1]);
      Elem<T>::mma(acc[mi][1], a[mi], b[2], b[3]);
    }
  }
}

// acc(16MW x BN) += A(16MW x D) * B(BN x D)^T, both operands row-major tiles in shared
// memory (A: the warp's rows). Scores, dP and their transposes all take this form.
// One k step of mma_abt for the 16-column group np: B's fragment from shared memory, two
// mma per 16-row block.
template <typename T, int DS, int BN, int MW>
PW_DEVICE void mma_abt_step(float acc[MW][BN / 8][4], const u32 a[MW][4], u32 sB, int np, int k,
                            int lane) {
  u32 b[4];
  load_b<DS>(b, sB, np, k, lane);
  ready<T>(b);
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
    Elem<T>::mma(acc[mi][2 * np], a[mi], b[0], b[1]);
    Elem<T>::mma(acc[mi][2 * np + 1], a[mi], b[2], b[3]);
  }
}

// mma_abt over acc's 16-column groups np0 <= np < np1 (constants once inlined and unrolled).
template <typename T, int D, int BN, int MW>
PW_DEVICE void mma_abt_cols(float acc[MW][BN / 8][4], u32 sA, u32 sB, int lane, int np0,
                            int np1) {
  constexpr int DS = D * Elem<T>::width;
#pragma unroll
  for (int k = 0; k < DS / 16; ++k) {
    u32 a[MW][4];
    load_a<DS, MW>(a, sA, k, lane);
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) ready<T>(a[mi]);
#pragma unroll
    for (int np = np0; np < np1; ++np) mma_abt_step<T, DS, BN, MW>(acc, a, sB, np, k, lane);
  }
}

template <typename T, int D, int BN, int MW>
PW_DEVICE void mma_abt(float acc[MW][BN / 8][4], u32 sA, u32 sB, int lane) {
  mma_abt_cols<T, D, BN, MW>(acc, sA, sB, lane, 0, BN / 16);
}

// One 16-column group kk of mma_xb for 16-bit types: x's two 8-column blocks packed as the
// A fragment, B's rows kk * 16 .. + 15 read transposed by ldmatrix.
template <typename T, int D, int BN, int MW>
PW_DEVICE void mma_xb_step16(float acc[MW][D / 8][4], const float x[MW][BN / 8][4], u32 sB, int kk,
                             int lane) {
  u32 a[MW][4];
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
    a[mi][0] = Elem<T>::pack(x[mi][2 * kk][0], x[mi][2 * kk][1]);
    a[mi][1] = Elem<T>::pack(x[mi][2 * kk][2], x[mi][2 * kk][3]);
    a[mi][2] = Elem<T>::pack(x[mi][2 * kk + 1][0], x[mi][2 * kk + 1][1]);
    a[mi][3] = Elem<T>::pack(x[mi][2 * kk + 1][2], x[mi][2 * kk + 1][3]);
  }
#pragma unroll
  for (int dp = 0; dp < D / 16; ++dp) {
    u32 b[4];
    ldsm_x4_trans(b, sB + (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * Pitch<D>::bytes +
                         (dp * 16 + (lane / 16) * 8) * 2);
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
      Elem<T>::mma(acc[mi][2 * dp], a[mi], b[0], b[1]);
      Elem<T>::mma(acc[mi][2 * dp + 1], a[mi], b[2], b[3]);
    }
  }
}

// acc(16MW x D) += X(16MW x BN, float accumulator fragments rounded to T) * B(BN x D), B
// row-major in shared memory and read transposed by ldmatrix. P·V, dS·K, Pᵀ·dO and dSᵀ·Q take
// this form: the accumulator layout of two adjacent 8-column blocks is an m16n8k16 A fragment.
//
// TF32: each 8-column block of x is one k8 step. The accumulator gives a thread columns 2t and
// 2t+1 of rows g, g+8 (t = lane%4, g = lane/4), an A fragment wants k-slots t and t+4; the
// step's k order is free, so slot t takes column 2t and slot t+4 column 2t+1, and B's rows
// follow: b0 = B[2t][g], b1 = B[2t+1][g] of each 8-column block, read word by word (no
// transposing ldmatrix for 32-bit data). With the row pitch of (D + 4) words those 32 reads
// hit 32 distinct banks for every D that is a multiple of 16.
template <typename T, int D, int BN, int MW>
PW_DEVICE void mma_xb(float acc[MW][D / 8][4], const float x[MW][BN / 8][4], u32 sB, int lane) {
  if constexpr (Elem<T>::width == 2) {
    constexpr int RB = Pitch<2 * D>::bytes;
#pragma unroll
    for (int kb = 0; kb < BN / 8; ++kb) {
      u32 a[MW][4];
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        a[mi][0] = Elem<T>::round(x[mi][kb][0]);
        a[mi][1] = Elem<T>::round(x[mi][kb][2]);
        a[mi][2] = Elem<T>::round(x[mi][kb][1]);
        a[mi][3] = Elem<T>::round(x[mi][kb][3]);
      }
      const u32 row = sB + (kb * 8 + 2 * (lane % 4)) * RB + (lane / 4) * 4;
#pragma unroll
      for (int dp = 0; dp < D / 8; ++dp) {
        u32 b[2];
        b[0] = lds32(row + dp * 32);
        b[1] = lds32(row + RB + dp * 32);
        ready<T>(b);
#pragma unroll
        for (int mi = 0; mi < MW; ++mi) Elem<T>::mma(acc[mi][dp], a[mi], b[0], b[1]);
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) mma_xb_step16<T, D, BN, MW>(acc, x, sB, kk, lane);
  }
}

// acc(16MW x 16NP) += A(16MW x 16K16) * B(16K16 x 16NP), both operands in shared memory,
// 16-bit types only (the warp-grid backward, backward.cu pw_backward_grid, whose Pᵀ and dSᵀ go
// through shared memory). A is row-major at pitch PA bytes (element (r, k) at sA + r PA + 2k),
// or with ATRANS stored k-major (element (r, k) at sA + k PA + 2r: dS read out of the dSᵀ
// buffer), and read transposed by ldmatrix; B is stored k-major (element (k, n) at
// sB + k PB + 2n: a row-major tile whose rows are the k index) and read transposed, as
// mma_xb reads its B. Each A fragment feeds 2NP mma, each B fragment MW x 2.
template <typename T, int K16, int NP, int MW, int PA, int PB, bool ATRANS>
PW_DEVICE void mma_ss(float acc[MW][2 * NP][4], u32 sA, u32 sB, int lane) {
  static_assert(Elem<T>::width == 1, "mma_ss: 16-bit operands");
#pragma unroll
  for (int kk = 0; kk < K16; ++kk) {
    u32 a[MW][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
      if constexpr (ATRANS)
        ldsm_x4_trans(a[mi], sA + (kk * 16 + (lane & 7) + 8 * (lane >> 4)) * PA +
                                 (mi * 16 + 8 * ((lane >> 3) & 1)) * 2);
      else
        ldsm_x4(a[mi], sA + (mi * 16 + lane % 16) * PA + (kk * 16 + (lane / 16) * 8) * 2);
    }
#pragma unroll
    for (int np = 0; np < NP; ++np) {
      u32 b[4];
      ldsm_x4_trans(b, sB + (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * PB +
                           (np * 16 + (lane / 16) * 8) * 2);
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        Elem<T>::mma(acc[mi][2 * np], a[mi], b[0], b[1]);
        Elem<T>::mma(acc[mi][2 * np + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// Row (0..16MW-1) and column (0..BN-1) of fragment element e of block (mi, nb).
PW_DEVICE int frag_row(int mi, int e, int lane) { return mi * 16 + lane / 4 + (e / 2) * 8; }
PW_DEVICE int frag_col(int nb, int e, int lane) { return nb * 8 + 2 * (lane % 4) + (e % 2); }

// ---------------------------------------------------------------- piecewise geometry
// Signed distance of query i to key j is d = i + P - j. A tile pairs a range of rows with a
// range of columns; `Trans` says the rows are keys (the dK/dV kernel) instead of queries.
//   bit 0 of a tile mode: some pair has d < w  (q1·k1 needed)
//   bit 1:                some pair has d >= w (q2·k2 needed)
// Only tiles that straddle d = w compute both products.
PW_DEVICE int tile_mode(i64 q0, int qn, i64 k0, int kn, i64 P, i64 w) {
  const i64 dmin = q0 + P - (k0 + kn - 1);
  const i64 dmax = q0 + qn - 1 + P - k0;
  return (dmin < w ? 1 : 0) | (dmax >= w ? 2 : 0);
}

// True when some element of a tile is masked: a column past the end of its tensor or, with
// causal, a key after its query (dmin, the tile's smallest distance, is negative).
template <bool CAUSAL> PW_DEVICE bool tile_needs_mask(i64 dmin, i64 col_end, i64 ncols) {
  return col_end > ncols || (CAUSAL && dmin < 0);
}
PW_DEVICE i64 tile_dmin(i64 q0, i64 k0, int kn, i64 P) { return q0 + P - (k0 + kn - 1); }

// Per-warp tile geometry in 32-bit form. Lengths are below 2^30 and w arrives clamped to
// [-(M+N+1), M+N+1], so clamping the base distance to +-2^30 changes no comparison.
struct Geom {
  int base;       // distance of the warp's (row 0, column 0) element
  int w;          // distance threshold
  int cols_left;  // valid columns from the tile's first column on
};

template <bool Trans>
PW_DEVICE Geom make_geom(i64 row0, i64 col0, i64 P, i64 w, i64 ncols) {
  Geom g;
  const i64 base = Trans ? col0 + P - row0 : row0 + P - col0;
  g.base = (int)clamp64(base, -(1ll << 30), 1ll << 30);
  g.w = (int)w;
  g.cols_left = (int)clamp64(ncols - col0, -1, 1 << 30);
  return g;
}

// Distance of the element at row offset r (from the warp's first row) and tile column c.
template <bool Trans> PW_DEVICE int elem_dist(const Geom& g, int r, int c) {
  return Trans ? g.base + c - r : g.base + r - c;
}

// Scale to the log2 domain and apply the mask: MASK 1 always tests, 0 never, -1 tests per
// element when `masked` (a run-time flag the compiler if-converts into every element).
// BIAS (an integer, usually 0) is added to every unmasked score in the same instruction
// (fma instead of mul), so exp2 of the result carries a factor 2^BIAS at no cost (the
// float16 dk/dv kernel's fixed P scale, backward.cu's FixedP).
template <int BN, int MW, bool CAUSAL, bool Trans, int MASK, int BIAS = 0>
PW_DEVICE void scale_mask(float s[MW][BN / 8][4], bool masked, const Geom& g, float scale_log2,
                          int lane) {
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = BIAS ? fmaf(s[mi][nb][e], scale_log2, (float)BIAS)  // one fma, as the mul
                       : s[mi][nb][e] * scale_log2;
        if (MASK == 1 || (MASK < 0 && masked)) {
          const int r = frag_row(mi, e, lane), c = frag_col(nb, e, lane);
          if (c >= g.cols_left || (CAUSAL && elem_dist<Trans>(g, r, c) < 0)) x = PW_NEG_INF;
        }
        s[mi][nb][e] = x;
      }
}

// Scores of one warp's 16MW rows against a BN-column tile, in the log2 domain (scaled by
// sm_scale*log2 e). mode selects the products; masked elements become -inf. MASK says how
// the mask test is built: -1 tests `masked` per element inside one body (the compiler
// if-converts that test, so every tile pays for it); 0 / 1 build a body without / with the
// mask; -2 runs the products once and then picks the scale loop with or without the mask by
// a branch on `masked` (score_tile chooses among these, see SPLIT there).
template <typename T, int D, int BN, int MW, bool CAUSAL, bool Trans, int MASK, int BIAS = 0>
PW_DEVICE void score_tile_as(float s[MW][BN / 8][4], u32 sA1, u32 sA2, u32 sB1, u32 sB2,
                             int mode, bool masked, const Geom& g, float scale_log2, int lane) {
  zero_n<MW * BN / 2>(&s[0][0][0]);
  if (mode == 3) {
    // Straddling tile: the second product goes 16 columns at a time through a small
    // temporary, so the mixed path costs 16 extra registers, not a second score tile.
    mma_abt<T, D, BN, MW>(s, sA1, sB1, lane);
#pragma unroll
    for (int np = 0; np < BN / 16; ++np) {
      float t[MW][2][4];
      zero_n<MW * 8>(&t[0][0][0]);
      mma_abt_block<T, D, MW>(t, sA2, sB2, np, lane);
#pragma unroll
      for (int mi = 0; mi < MW; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (elem_dist<Trans>(g, frag_row(mi, e, lane), frag_col(2 * np + h, e, lane)) >= g.w)
              s[mi][2 * np + h][e] = t[mi][h][e];
    }
  } else if (mode == 1) {
    mma_abt<T, D, BN, MW>(s, sA1, sB1, lane);
  } else {
    mma_abt<T, D, BN, MW>(s, sA2, sB2, lane);
  }
  if constexpr (MASK == -2) {
    // The branch is warp-uniform (one tile, one flag), so only the taken loop issues.
    if (masked) scale_mask<BN, MW, CAUSAL, Trans, 1, BIAS>(s, masked, g, scale_log2, lane);
    else scale_mask<BN, MW, CAUSAL, Trans, 0, BIAS>(s, masked, g, scale_log2, lane);
  } else {
    scale_mask<BN, MW, CAUSAL, Trans, MASK, BIAS>(s, masked, g, scale_log2, lane);
  }
}

// score_tile: how a kernel's call site builds the mask (SPLIT, a compile-time choice per site):
//   0: one body with the per-element test of `masked` (MASK -1 above);
//   1: two copies of products and mask, one per tile kind (+3-5% in the forward's merged
//      body, but the duplicated products spill in 9 entries: the build check refuses);
//   2: products once, then the scale loop with or without the mask (MASK -2): spill-free in
//      the entries that use it; forward +4-5%, backward up to +6% on the H200
//      (bench/results/2026-12-03-h200-score-mask-split).
// -DPW_SCORE_MASK_SPLIT=n overrides every site's choice, for A/B runs of the probes
// (scripts/mma_fwd_probe.py --variants, scripts/mma_bwd_probe.py --macros).
#ifdef PW_SCORE_MASK_SPLIT
#define PW_MASK_SPLIT_OR(site_default) (PW_SCORE_MASK_SPLIT)
#else
#define PW_MASK_SPLIT_OR(site_default) (site_default)
#endif
template <int SPLIT, typename T, int D, int BN, int MW, bool CAUSAL, bool Trans, int BIAS = 0>
PW_DEVICE void score_tile(float s[MW][BN / 8][4], u32 sA1, u32 sA2, u32 sB1, u32 sB2, int mode,
                          bool masked, const Geom& g, float scale_log2, int lane) {
  static_assert(SPLIT >= 0 && SPLIT <= 2, "score_tile: SPLIT is 0, 1 or 2");
  if constexpr (SPLIT == 2) {
    score_tile_as<T, D, BN, MW, CAUSAL, Trans, -2, BIAS>(s, sA1, sA2, sB1, sB2, mode, masked, g,
                                                   scale_log2, lane);
  } else if constexpr (SPLIT == 1) {
    if (masked)
      score_tile_as<T, D, BN, MW, CAUSAL, Trans, 1, BIAS>(s, sA1, sA2, sB1, sB2, mode, masked, g,
                                                    scale_log2, lane);
    else
      score_tile_as<T, D, BN, MW, CAUSAL, Trans, 0, BIAS>(s, sA1, sA2, sB1, sB2, mode, masked, g,
                                                    scale_log2, lane);
  } else {
    score_tile_as<T, D, BN, MW, CAUSAL, Trans, -1, BIAS>(s, sA1, sA2, sB1, sB2, mode, masked, g,
                                                   scale_log2, lane);
  }
}

// a - b saturated to the int range (sub.sat.s32).
PW_DEVICE int sub_sat(int a, int b) {
  int r;
  asm("sub.sat.s32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// One projection pair's visit of a tile (the forward's tile body): the columns each row keeps.
// An element at distance d belongs to the visit when lo <= d < hi (pair 1: d < w; pair 2:
// d >= w; CAUSAL raises lo to 0) and its column is below cols_left. For the row at distance
// rb from column 0 that is cmin <= c - c0 <= cmax, c0 the lane's first column, so each
// fragment element compares its compile-time column offset with two registers of its row.
// Saturating arithmetic keeps the bounds exact: a bound pushed past the int range lies
// beyond every column either way.
template <int MW> struct PairWindow {
  int cmin[MW][2], cmax[MW][2];
};

// The distances projection pair `pair` keeps: lo <= d < hi (pair 1: d < w; pair 2: d >= w;
// CAUSAL raises lo to 0; 0x7fffffff and its negation: no bound on that side).
template <bool CAUSAL> PW_DEVICE void pair_bounds(const Geom& g, int pair, int& lo, int& hi) {
  constexpr int NONE = 0x7fffffff;
  const int w = g.w;  // the boundary (tests/test_selection_gpu.py moves it by one here)
  lo = pair == 1 ? (CAUSAL ? 0 : -NONE) : (CAUSAL ? max(0, w) : w);
  hi = pair == 1 ? w : NONE;
}

template <int MW, bool CAUSAL>
PW_DEVICE PairWindow<MW> pair_window(const Geom& g, int pair, int lane) {
  int lo, hi;
  pair_bounds<CAUSAL>(g, pair, lo, hi);
  const int c0 = 2 * (lane % 4);
  PairWindow<MW> win;
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int rb = g.base + mi * 16 + lane / 4 + 8 * hh;  // |rb| <= 2^30 + 32: no overflow
      // d < hi  <=>  c > rb - hi;   d >= lo  <=>  c <= rb - lo
      win.cmin[mi][hh] = sub_sat(sub_sat(rb, hi), c0 - 1);
      win.cmax[mi][hh] = sub_sat(min(sub_sat(rb, lo), g.cols_left - 1), c0);
    }
  return win;
}

// Scales a tile of raw scores and, MASKED, sets the elements outside win to -inf
// (score_pair's second step).
template <int BN, int MW, bool MASKED>
PW_DEVICE void scale_in_window(float s[MW][BN / 8][4], const PairWindow<MW>& win, float scale_log2) {
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[mi][nb][e] * scale_log2;
        if constexpr (MASKED) {
          const int c = nb * 8 + (e % 2);  // column minus the lane's first column
          if (c < win.cmin[mi][e / 2] || c > win.cmax[mi][e / 2]) x = PW_NEG_INF;
        }
        s[mi][nb][e] = x;
      }
}

// Scores of one warp's 16MW rows against a BN-column tile for one projection pair (sA, sB:
// that pair's query and key tiles), in the log2 domain. MASKED (a straddling, causal
// diagonal or last tile): elements outside the pair's window (pair_window) become -inf.
// The caller picks the instantiation with a branch, so unmasked tiles run no mask code (a
// runtime flag inside one body gets if-converted: every tile then paid for the mask).
template <typename T, int D, int BN, int MW, bool MASKED>
PW_DEVICE void score_pair(float s[MW][BN / 8][4], u32 sA, u32 sB, const PairWindow<MW>& win,
                          float scale_log2, int lane) {
  zero_n<MW * BN / 2>(&s[0][0][0]);
  mma_abt<T, D, BN, MW>(s, sA, sB, lane);
  scale_in_window<BN, MW, MASKED>(s, win, scale_log2);
}

// score_pair with the window computed after the product, from a fresh threadIdx.x read
// (tid_reload): its 4 * MW registers are then not live across the product, where the
// rotating-slot forward (forward.cu, PW_FWD_Q_ROTATE) peaks at the register limit.
template <typename T, int D, int BN, int MW, bool CAUSAL>
PW_DEVICE void score_pair_window_after(float s[MW][BN / 8][4], u32 sA, u32 sB, const Geom& g,
                                       int pair, float scale_log2, int lane) {
  zero_n<MW * BN / 2>(&s[0][0][0]);
  mma_abt<T, D, BN, MW>(s, sA, sB, lane);
  scale_in_window<BN, MW, true>(s, pair_window<MW, CAUSAL>(g, pair, tid_reload() % 32), scale_log2);
}

// ---------------------------------------------------------------- column groups of a visit
// (forward.cu, PW_FWD_COL_RANGE)
// [glo, ghi): the 16-column groups of a warp's ROWS x BN visit of projection pair `pair`
// that hold an admissible element of some row (pair_window's bounds taken over the warp's
// rows: the first column is past base - hi, the last at most base + ROWS - 1 - lo and below
// cols_left). ghi <= glo when none does. Every column outside gets -inf from pair_window's
// mask in every row of the warp (scripts/col_range_model.py checks it).
template <int ROWS, int BN, bool CAUSAL>
PW_DEVICE void pair_groups(const Geom& g, int pair, int& glo, int& ghi) {
  int lo, hi;
  pair_bounds<CAUSAL>(g, pair, lo, hi);
  const int first = max(sub_sat(sub_sat(g.base, hi), -1), 0);
  const int last = min(sub_sat(g.base + (ROWS - 1), lo), min(g.cols_left, BN) - 1);
  glo = first >> 4;
  ghi = first <= last ? (last >> 4) + 1 : 0;
}

// Whether chunk c of CH 16-column groups (groups c CH .. c CH + CH - 1) meets [glo, ghi).
// glo and ghi are the warp's, but ptxas cannot tell: a plain branch on them is taken as
// divergent, and the mma.sync products behind it (convergence barriers around every chunk)
// spilled 76-148 bytes at the D = 64 128x128x4 forward. A vote makes the branch uniform.
template <int CH> PW_DEVICE bool chunk_in(int c, int glo, int ghi) {
  return __any_sync(0xffffffffu, c * CH < ghi && (c + 1) * CH > glo);
}

// score_pair's product over the chunks of CH 16-column groups that meet [glo, ghi) only (a
// branch per chunk; chunk_in); the other chunks' scores are set to -inf (in their branch:
// zeroing the whole tile up front kept the zero stores on the computed chunks too, where
// the first mma otherwise takes a zero accumulator for free).
template <typename T, int D, int BN, int MW, int CH>
PW_DEVICE void mma_abt_groups(float acc[MW][BN / 8][4], u32 sA, u32 sB, int lane, int glo,
                              int ghi) {
  static_assert((BN / 16) % CH == 0, "mma_abt_groups: CH divides BN / 16");
#pragma unroll
  for (int c = 0; c < BN / 16 / CH; ++c) {
    if (!chunk_in<CH>(c, glo, ghi)) {
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
        for (int i = 0; i < CH * 8; ++i) (&acc[mi][2 * c * CH][0])[i] = PW_NEG_INF;
      }
      continue;
    }
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) zero_n<CH * 8>(&acc[mi][2 * c * CH][0]);
    mma_abt_cols<T, D, BN, MW>(acc, sA, sB, lane, c * CH, (c + 1) * CH);
  }
}

// mma_xb (16-bit types) over the chunks of CH 16-column groups of x that meet [glo, ghi)
// only: x is 0 in the others.
template <typename T, int D, int BN, int MW, int CH>
PW_DEVICE void mma_xb_groups(float acc[MW][D / 8][4], const float x[MW][BN / 8][4], u32 sB,
                             int lane, int glo, int ghi) {
  static_assert(Elem<T>::width == 1, "mma_xb_groups: 16-bit types");
  static_assert((BN / 16) % CH == 0, "mma_xb_groups: CH divides BN / 16");
#pragma unroll
  for (int c = 0; c < BN / 16 / CH; ++c) {
    if (!chunk_in<CH>(c, glo, ghi)) continue;
#pragma unroll
    for (int kk = c * CH; kk < (c + 1) * CH; ++kk)
      mma_xb_step16<T, D, BN, MW>(acc, x, sB, kk, lane);
  }
}

// Zeroes the entries of a (dS) fragment that belong to the other projection pair: the
// pass for pair 1 keeps d < w, the pass for pair 2 keeps d >= w.
template <int BN, int MW, bool Trans>
PW_DEVICE void keep_pair(float x[MW][BN / 8][4], int pair, const Geom& g, int lane) {
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool second =
            elem_dist<Trans>(g, frag_row(mi, e, lane), frag_col(nb, e, lane)) >= g.w;
        if (second != (pair == 2)) x[mi][nb][e] = 0.f;
      }
}

// Writes a warp's 16MW x D float fragment to a row-major (L, D) output of type T (row stride
// `rs` in 16-bit units), row block
// mi's half h scaled by scale[mi][h], skipping rows at or past nvalid.
template <typename T, int D, int MW>
PW_DEVICE void store_rows(u16* dst, i64 rs, i64 row0, i64 nvalid, const float acc[MW][D / 8][4],
                          const float scale[MW][2], int lane) {
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const i64 r = row0 + mi * 16 + lane / 4 + 8 * h;
      if (r < nvalid) {
        constexpr int W = Elem<T>::width;
        u16* p = dst + r * rs + 2 * (lane % 4) * W;
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb)
          store2<T>(p + nb * 8 * W, acc[mi][nb][2 * h] * scale[mi][h],
                    acc[mi][nb][2 * h + 1] * scale[mi][h]);
      }
    }
}

// ---------------------------------------------------------------- float16 range for dS and P
// The backward rounds dS (and P for dV) to T before the tensor-core products. These values
// scale with the probabilities, which can be tiny (1e-5 and below), and float16 has only
// 2^-24 of absolute resolution there (subnormals), so a row made of such entries would lose
// most of its bits. Each row therefore carries a power-of-two scale 2^e, chosen so that the
// row's largest entry seen so far lands near 2^14 before rounding; when a later tile needs a
// smaller scale the row's accumulator is rescaled (exactly: powers of two), as an online
// softmax rescales by its running max. bfloat16 has float32's exponent range: no scaling.
template <typename T> struct RowScale {
  static constexpr bool active = false;
};
template <> struct RowScale<half_t> {
  static constexpr bool active = true;
};
#define PW_SCALE_INIT 60  // exponent before any entry is seen (finite in float32)
// fit_scaled_rows' target when it rescales: a row's largest |x| lands in [2^(14-H), 2^(15-H))
// for headroom H, while it still rescales only at 2^15, so the row's largest may grow 2^H-fold
// before the next rescale. Default 4, measured on the H200 (2026-12-04, scripts/mma_bwd_ab.py,
// deterministic backward, one process): float16 1.02-1.09x faster than H = 0 at L 2048 and
// 8192, D 64 and 128 (H = 2: 1.00-1.05x). A CPU model of the same inputs
// (scripts/fit_vote_model.py) says why: at L = 2048, H = 0 sends 30-42% (dq) and 38-46%
// (dk/dv) of the 16-row blocks of a tile down the per-row path, H = 4 2-8% (a row's first tile
// always goes). Scaling by powers of two leaves float16's rounding unchanged except for
// entries between 2^(28-H) and 2^28 below the row's largest, which H moves into float16's
// subnormals (bits change there, by far less than the rounding of the row's large entries).
// -DPW_FIT_HEADROOM=0 builds the previous default (fit_rows' target, its bits) for A/B runs.
#ifndef PW_FIT_HEADROOM
#define PW_FIT_HEADROOM 4
#endif

PW_DEVICE float pow2f(int e) { return __int_as_float((127 + e) << 23); }  // e in [-126, 127]

// The largest |x| of one row of the warp (16-row block mi, half hh), over the four lanes
// that hold it.
template <int NB, int MW>
PW_DEVICE float row_absmax(const float x[MW][NB][4], int mi, int hh) {
  float mx = 0.f;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
    mx = fmaxf(mx, fmaxf(fabsf(x[mi][nb][2 * hh]), fabsf(x[mi][nb][2 * hh + 1])));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
}

// Multiplies one row of the warp (block mi, half hh) of an N-column fragment array by f.
template <int N, int MW>
PW_DEVICE void scale_row(float a[MW][N][4], int mi, int hh, float f) {
#pragma unroll
  for (int nb = 0; nb < N; ++nb) {
    a[mi][nb][2 * hh] *= f;
    a[mi][nb][2 * hh + 1] *= f;
  }
}

// Scales x (rows of the warp) by each row's 2^e, first lowering e (and rescaling acc by the
// same power of two) where this tile's largest |x| needs it.
template <typename T, int NB, int NA, int MW>
PW_DEVICE void fit_rows(float x[MW][NB][4], float acc[MW][NA][4], int ex[MW][2]) {
  if (!RowScale<T>::active) return;
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float mx = row_absmax<NB, MW>(x, mi, hh);
      if (mx > 0.f) {  // mx in [2^m, 2^(m+1)): after scaling by 2^(14-m) it is below 2^15
        const int m = ((__float_as_int(mx) >> 23) & 0xff) - 127;
        const int want = max(-100, 14 - m);
        if (want < ex[mi][hh]) {
          scale_row<NA, MW>(acc, mi, hh, pow2f(max(-126, want - ex[mi][hh])));
          ex[mi][hh] = want;
        }
      }
      scale_row<NB, MW>(x, mi, hh, pow2f(ex[mi][hh]));
    }
}

// fit_rows for x that already carries its rows' current 2^e: e is lowered (acc and x rescaled
// by the same power of two) only where this tile's largest |x| reaches 2^15. A warp vote per
// 16-row block on each thread's largest |x| comes first, so a tile where no row of the block
// reached 2^15 costs the thread's max-abs chain, a compare and a vote: no shuffles, no
// per-row branches, no multiply (how often a block votes: PW_FIT_HEADROOM's note above).
// The vote is warp-uniform, so the per-row path's quad shuffles see every lane. (One vote
// over all blocks spilled 8-44 bytes in the sm_90 causal D = 64 dk/dv entry, 32x128x4; one
// per block spills nowhere, NVRTC 13.5.)
// At PW_FIT_HEADROOM = 0 the result is bitwise fit_rows' on the unscaled x: the exponent of
// the scaled maximum is the unscaled one plus e (powers of two are exact in float32's normal
// range), and an infinite maximum lowers e to -100 as fit_rows does; fmaxf drops NaN in both.
template <typename T, int NB, int NA, int MW>
PW_DEVICE void fit_scaled_rows(float x[MW][NB][4], float acc[MW][NA][4], int ex[MW][2]) {
  if (!RowScale<T>::active) return;
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
    float any = 0.f;  // the thread's largest |x| of block mi (fmaxf drops NaN)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) any = fmaxf(any, fabsf(x[mi][nb][e]));
    if (!__any_sync(0xffffffffu, any >= 32768.f)) continue;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float mx = row_absmax<NB, MW>(x, mi, hh);
      const int m = ((__float_as_int(mx) >> 23) & 0xff) - 127;  // mx in [2^m, 2^(m+1))
      if (m > 14 && ex[mi][hh] > -100) {  // as fit_rows: want = max(-100, 14 - unscaled m)
        const int want =
            m == 128 ? -100 : max(-100, ex[mi][hh] - (m - 14) - PW_FIT_HEADROOM);
        const float f = pow2f(max(-126, want - ex[mi][hh]));
        scale_row<NA, MW>(acc, mi, hh, f);
        scale_row<NB, MW>(x, mi, hh, f);
        ex[mi][hh] = want;
      }
    }
  }
}

template <typename T, int MW> PW_DEVICE void init_rows(int ex[MW][2]) {
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) ex[mi][0] = ex[mi][1] = RowScale<T>::active ? PW_SCALE_INIT : 0;
}

// Output scale for a row: the kernel's factor divided by the row's 2^e.
template <int MW>
PW_DEVICE void unscale_rows(float out[MW][2], const int ex[MW][2], float factor) {
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      // 2^-e may leave float32's normal range (e up to 60): apply it in two halves.
      const int e = ex[mi][hh];
      out[mi][hh] = factor * pow2f(-(e / 2)) * pow2f(-(e - e / 2));
    }
}

// ---------------------------------------------------------------- double-buffered tile loop
// Runs body(t, stage) for t in [t0, t1) while the loads of tile t+1 (issued by
// issue(t, stage)) are in flight. Loads issued before the call join the first group.
// The trailing barrier frees a stage before the next iteration overwrites it.
// PW_ONE_BARRIER=1 (the default since 2026-12-06; 0: the earlier two-barrier loop): one
// barrier per tile instead of two. On an H100 (bench/results/2026-12-06-h100-one-barrier) the
// backward alone ran at 0.96-1.06x the two-barrier loop's speed at D = 128 (7 of 8 rows faster),
// 0.96-1.01x at D = 64. Each iteration waits for tile t's loads, then the
// barrier (tile t visible to every thread, and every thread done with body t - 1, which read
// the stage and the shared buffers that issue(t + 1) and body t are about to overwrite), then
// issues tile t + 1 and runs body t. Tile t + 1's copies still overlap body t; they start
// after tile t's wait instead of just before it, which costs nothing when tile t landed
// during body t - 1. Every hazard the trailing barrier covered is covered by the next
// iteration's leading one; the last body's shared-memory reads are followed by the caller's
// own barriers (the kernels sync before reusing shared memory after the loop).
#ifndef PW_ONE_BARRIER
#define PW_ONE_BARRIER 1
#endif
template <class Issue, class Body>
PW_DEVICE void pipelined_tiles(int t0, int t1, Issue issue, Body body) {
  if (t0 < t1) issue(t0, 0);
  cp_async_commit();
  if constexpr (PW_ONE_BARRIER != 0) {
    for (int t = t0; t < t1; ++t) {
      const int stage = (t - t0) & 1;
      cp_async_wait<0>();
      __syncthreads();
      if (t + 1 < t1) issue(t + 1, stage ^ 1);
      cp_async_commit();
      body(t, stage);
    }
    cp_async_wait<0>();
    __syncthreads();  // the last body's reads end before the caller reuses shared memory
    return;
  }
  for (int t = t0; t < t1; ++t) {
    const int stage = (t - t0) & 1;
    if (t + 1 < t1) {
      issue(t + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    body(t, stage);
    __syncthreads();
  }
  cp_async_wait<0>();  // an empty range still committed the caller's loads
}

// Turns log2-domain scores into probabilities given each row's (log2-domain) log-sum-exp.
// lse2 = +inf marks a row with no admissible key: its probabilities are 0, not NaN.
PW_DEVICE float lse_to_log2(float lse) { return lse == PW_NEG_INF ? PW_POS_INF : lse * PW_LOG2E; }
