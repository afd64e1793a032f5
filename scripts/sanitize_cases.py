"""Forward and backward once for every kernel variant the capability table can select on
this GPU (every head dim, dtype and causal flag of its row, the decode split-KV kernel and
its combine, the row kernels), on the mma.sync path and on the Hopper path (forward and
backward, fused dQ and deterministic mode on both), at sizes that are not tile multiples, with
position offsets and a gradient into lse; the KV-cache kernels; the packed-batch (varlen)
kernels; then torch tensors through the memoised path.

Run under compute-sanitizer (memcheck, racecheck, synccheck, initcheck) by
scripts/gpu_run.sh; each case is also checked against the reference, so a clean report is
a report on correct runs. It ends by listing the selectable variants no case launched and
exits 1 if there are any (coverage is part of the result).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_kernels_gpu import run_case  # noqa: E402

from cupy_piecewise import build_check, capability, compile as comp, launch  # noqa: E402

# PW_TEST_MACROS: an A/B build's kernels (with its host mirrors, e.g. PW_FWD_Q_ROTATE=0's
# shared-memory size, and its MACRO_TABLE tiles if it has any; none now) under the
# sanitizers, as tests/conftest.py does for the suite
print("PW_TEST_MACROS:", " ".join(comp.apply_test_macros()) or "(none: the default kernels)",
      flush=True)

launched = set()
_kernel = launch._kernel


def _recording_kernel(device, variant):
    launched.add(variant)
    return _kernel(device, variant)


launch._kernel = _recording_kernel  # every launch plan asks for its kernels through here

cc = launch._compute_capability(0)
hopper = cc == (9, 0)
# SANITIZE_DIMS=80,96,256 narrows every head-dim loop (a partial run: the coverage check
# below then lists what it left out but does not fail); SANITIZE_SKIP=dense,kvcache,
# rotary,varlen,torch leaves out whole groups; SANITIZE_PATHS=hopper (or mma) runs the dense cases of that
# path only (with compute-sanitizer's --kernel-name, a run on one kernel family).
_only = {int(d) for d in os.environ.get("SANITIZE_DIMS", "").split(",") if d.strip()}
_skip = {g.strip() for g in os.environ.get("SANITIZE_SKIP", "").split(",") if g.strip()}
_paths = {g.strip() for g in os.environ.get("SANITIZE_PATHS", "").split(",") if g.strip()}
if _paths - {"mma", "hopper"}:  # a misspelt path would silently run no dense case
    sys.exit(f"SANITIZE_PATHS={os.environ['SANITIZE_PATHS']!r}: expected mma and/or hopper")
partial = bool(_only or _skip or _paths)


def _dims(dims):
    return [d for d in dims if not _only or d in _only]


def _dtypes(path, D):
    """float16 and bfloat16; float32 (TF32) too on the mma.sync path where the table has
    float32 tiles of head dim D (capability.TF32_TABLE)."""
    out = ["float16", "bfloat16"]
    if path == "mma" and capability.has_float32_kernels(cc, D):
        out.append("float32")
    return out


for path in (("mma", "hopper") if hopper else ("mma",)) if "dense" not in _skip else ():
    if _paths and path not in _paths:
        continue
    os.environ[capability.PATH_VAR] = path
    capability.refresh_env_override()
    dims = _dims(capability.HOPPER_HEAD_DIMS if path == "hopper" else capability.head_dims(cc))
    for D in dims:
        for dtype in _dtypes(path, D):
            for causal in (False, True):
                # both backward schemes: dQ by float32 atomics (the Hopper kernel, or the
                # mma.sync one-kernel backward where the table has it) and deterministic
                for det in (False, True):
                    # position offsets (P = 40, not N - M = 51) and a gradient into lse
                    run_case(D=D, dtype=dtype, causal=causal, M=150, N=201, w=40, group=2,
                             transposed=(D == 128), deterministic=det, q_offset=40, k_offset=0,
                             with_dlse=True)
                    if path == "mma":  # a decode shape: the split-KV kernel and its combine
                        run_case(D=D, dtype=dtype, causal=causal, M=3, N=700, w=300, group=2,
                                 transposed=False)
                    print(f"ok {path} {dtype} causal={causal} D={D} deterministic={det}",
                          flush=True)
os.environ.pop(capability.PATH_VAR, None)
capability.refresh_env_override()

# KV-cache attention: contiguous and paged caches, keys appended in place, a sequence with
# no keys, every head dim, dtype and causal flag (checked against the reference)
import cupy  # noqa: E402
import numpy as np  # noqa: E402
from test_kvcache_gpu import _expected, _np_dtype  # noqa: E402

from cupy_piecewise import kvcache, tolerance  # noqa: E402
from cupy_piecewise.gpu_arrays import round_to  # noqa: E402

rng = np.random.default_rng(0)


def kv_case(D, dtype, causal, M, paths):
    """One KV-cache call per path in ``paths`` and cache layout (contiguous, paged), new
    keys appended, against the float64 reference."""
    B, H, Hkv, N, bs = 2, 4, 2, 192, 64
    nd = _np_dtype(dtype)
    seq = np.array([0, 150], np.int32)
    q1, q2 = (round_to(rng.standard_normal((B, H, M, D)).astype(np.float32), dtype) for _ in range(2))
    host = [round_to(rng.standard_normal((B, Hkv, N, D)).astype(np.float32), dtype) for _ in range(3)]
    new = [round_to(rng.standard_normal((B, Hkv, M, D)).astype(np.float32), dtype) for _ in range(3)]
    full = [c.copy() for c in host]
    for c, n in zip(full, new):
        for b in range(B):
            c[b, :, seq[b]:seq[b] + M] = n[b]
    ref, low = _expected(q1, q2, full, 40, seq, M, True, causal, 1 / np.sqrt(D), dtype)
    table = np.arange(B * N // bs, dtype=np.int32)[::-1].reshape(B, N // bs).copy()
    for path in paths:
        os.environ[capability.PATH_VAR] = path
        capability.refresh_env_override()
        for paged in (False, True):
            caches = [cupy.asarray(c.astype(nd)) for c in host]
            if paged:  # page p of sequence b is table[b, p]: the rows moved there
                caches = [cupy.asarray(np.stack([c[b, :, j * bs:(j + 1) * bs]
                                                 for b in range(B) for j in range(N // bs)])
                                       [np.argsort(table.ravel())].astype(nd)) for c in host]
            o, lse = kvcache.attention_with_kvcache(
                cupy.asarray(q1.astype(nd)), cupy.asarray(q2.astype(nd)), *caches, 40,
                cache_seqlens=cupy.asarray(seq), causal=causal, return_lse=True,
                block_table=cupy.asarray(table) if paged else None,
                k1_new=cupy.asarray(new[0].astype(nd)), k2_new=cupy.asarray(new[1].astype(nd)),
                v_new=cupy.asarray(new[2].astype(nd)))
            for name, g, r, lw in zip(("o", "lse"), (cupy.asnumpy(o), cupy.asnumpy(lse)), ref, low):
                tolerance.assert_close(name, np.asarray(g, np.float64), r, lw, dtype)
    os.environ.pop(capability.PATH_VAR)
    capability.refresh_env_override()


for D in _dims(kvcache.KV_HEAD_DIMS) if "kvcache" not in _skip else ():
    for dtype in ("float16", "bfloat16"):
        # M = 1 runs kvdecode (one token: one key slot per stage), M = 3 kvcache; on Hopper
        # M = 1 runs the TMA decode (kernels_cu/sm90/kvdecode.cu), and the cp.async decode
        # it replaces there is forced once too (three splits of 64 keys and their merge)
        for causal, M in [(c, m) for c in (False, True) for m in (1, 3)]:
            kv_case(D, dtype, causal, M, ("auto", "mma") if hopper and M == 1 else ("auto",))
            print(f"ok kvcache {dtype} causal={causal} D={D} M={M} (contiguous, paged)", flush=True)
    if hopper and D in capability.KV90_HEAD_DIMS:
        # the TMA decode's splits (one 64-key tile each, three of them), merged by
        # pw_forward_combine and inside a cluster of three
        from cupy_piecewise import kvcache_launch

        saved = capability.KV90_MIN_TILES[D], capability.KV90_MAX_CLUSTER
        capability.KV90_MIN_TILES[D] = 1
        for most in (1, 4):
            capability.KV90_MAX_CLUSTER = most
            kvcache_launch._plans._data.clear()
            kv_case(D, "bfloat16", True, 1, ("auto",))
            print(f"ok kvdecode split D={D} clusters<={most}", flush=True)
        capability.KV90_MIN_TILES[D], capability.KV90_MAX_CLUSTER = saved
        kvcache_launch._plans._data.clear()

# Rotary inside the KV-cache kernel (ROT = 1 halves, 2 interleaved): raw keys rotated in
# shared memory, appended, contiguous and paged, one token (kvdecode) and three (kvcache)
from test_kvcache_rotary_gpu import _lowp, _tables, long_cache_case  # noqa: E402

from cupy_piecewise import kvcache_rotary  # noqa: E402

for D in _dims(kvcache.KV_HEAD_DIMS) if "rotary" not in _skip else ():
    for dtype in ("float16", "bfloat16"):
        # every (phase, layout, causal flag): the build check compiles each of them
        for M, interleaved, causal in [(m, i, c) for m in (1, 3) for i in (False, True)
                                       for c in (False, True)]:
            B, H, Hkv, N, bs = 2, 4, 2, 192, 64
            nd = _np_dtype(dtype)
            seq = np.array([0, 150], np.int32)
            groups = (1, None) if interleaved else (1, 8)
            cos, sin = _tables(N, D)
            q1, q2 = (round_to(rng.standard_normal((B, H, M, D)).astype(np.float32), dtype)
                      for _ in range(2))
            host = [round_to(rng.standard_normal((B, Hkv, N, D)).astype(np.float32), dtype)
                    for _ in range(2)]
            new = [round_to(rng.standard_normal((B, Hkv, M, D)).astype(np.float32), dtype)
                   for _ in range(2)]
            full = [c.copy() for c in host]
            for c, n in zip(full, new):
                for b in range(B):
                    c[b, :, seq[b]:seq[b] + M] = n[b]
            lengths = seq + M
            kw = dict(k1_group_size=groups[0], k2_group_size=groups[1], interleaved=interleaved,
                      causal=causal, sm_scale=1 / np.sqrt(D))
            ref = kvcache_rotary.reference_with_rotary_kvcache(q1, q2, full[0], full[1], 40, cos,
                                                               sin, lengths, **kw)
            low = _lowp(q1, q2, full[0], full[1], cos, sin, [g or 0 for g in groups],
                        interleaved, 40, lengths, M, causal, 1 / np.sqrt(D), dtype)
            table = np.arange(B * N // bs, dtype=np.int32)[::-1].reshape(B, N // bs).copy()
            # one token on an H200: the TMA decode (auto) and the cp.async one (mma)
            for path, paged in [(pa, pg) for pa in (("auto", "mma") if hopper and M == 1
                                                    else ("auto",)) for pg in (False, True)]:
                os.environ[capability.PATH_VAR] = path
                capability.refresh_env_override()
                caches = [cupy.asarray(c.astype(nd)) for c in host]
                if paged:
                    caches = [cupy.asarray(np.stack([c[b, :, j * bs:(j + 1) * bs]
                                                     for b in range(B) for j in range(N // bs)])
                                           [np.argsort(table.ravel())].astype(nd)) for c in host]
                o, lse = kvcache_rotary.attention_with_rotary_kvcache(
                    cupy.asarray(q1.astype(nd)), cupy.asarray(q2.astype(nd)), *caches, 40,
                    cos=cupy.asarray(cos), sin=cupy.asarray(sin), cache_seqlens=cupy.asarray(seq),
                    block_table=cupy.asarray(table) if paged else None,
                    k_new=cupy.asarray(new[0].astype(nd)), v_new=cupy.asarray(new[1].astype(nd)),
                    return_lse=True, **kw)
                for name, g, r, lw in zip(("o", "lse"), (cupy.asnumpy(o), cupy.asnumpy(lse)),
                                          ref, low):
                    tolerance.assert_close(name, np.asarray(g, np.float64), r, lw, dtype)
            os.environ.pop(capability.PATH_VAR)
            capability.refresh_env_override()
            print(f"ok rotary kvcache {dtype} D={D} M={M} interleaved={interleaved} "
                  f"causal={causal} (contiguous, paged)", flush=True)
    # a long cache the planner splits (more splits than a Hopper cluster holds at D = 128:
    # merged by pw_forward_combine), the rotary forms' strided key splits
    if D in (64, 128):
        inter = D == 64
        nsplit = long_cache_case(D, inter, (1, 8) if inter else (1, None), int(rng.integers(1 << 30)))
        print(f"ok rotary kvcache long cache D={D} interleaved={inter} nsplit={nsplit}",
              flush=True)

# Packed variable-length batches (the VARLEN kernels): empty sequences, tile edges, every
# head dim, dtype and causal flag, forward and backward with a gradient into lse
from test_varlen_gpu import run_packed  # noqa: E402

for D in _dims(capability.head_dims(cc)) if "varlen" not in _skip else ():
    for dtype in _dtypes("mma", D):
        for causal in (False, True):
            for det in (False, True):  # the one-kernel backward where the table has it; two kernels
                run_packed([65, 0, 3], [40, 9, 129], D=D, dtype=dtype, causal=causal, w=20,
                           deterministic=det)
            if hopper and D in capability.HOPPER_HEAD_DIMS and dtype != "float32":  # the Hopper packed kernels
                os.environ[capability.PATH_VAR] = "hopper"
                capability.refresh_env_override()
                for det in (False, True):  # dQ by atomics; dQ by the mma.sync dq kernel
                    run_packed([130, 0, 17, 200], [140, 9, 129, 150], D=D, dtype=dtype,
                               causal=causal, w=20, deterministic=det)
                os.environ.pop(capability.PATH_VAR)
                capability.refresh_env_override()
            print(f"ok varlen {dtype} causal={causal} D={D}", flush=True)

missing = set(build_check.install_variants(cc)) - launched
print(f"{len(launched)} kernel variants launched; {len(missing)} selectable on "
      f"sm_{cc[0]}{cc[1]} not launched", flush=True)
for v in sorted(missing, key=lambda v: v.name_expression):
    print("  not launched:", v.name_expression)

# torch tensors through the memoised fast path: without lse (a null pointer the kernels
# skip), with it, and a decode shape that splits the keys and merges the splits.
import torch  # noqa: E402

from cupy_piecewise import torch_ops  # noqa: E402

for M, N in ((150, 201), (1, 5000)) if "torch" not in _skip else ():
    g = torch.Generator(device="cuda").manual_seed(M + N)
    q1, q2 = (torch.randn(1, 4, M, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k1, k2, v = (torch.randn(1, 2, N, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    for _ in range(2):  # the second call hits the memo
        o = torch_ops.attention(q1, k1, q2, k2, v, 40)
        o2, lse = torch_ops.attention(q1, k1, q2, k2, v, 40, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(o, o2) and not torch.isnan(lse).any()
    print(f"ok torch M={M} N={N}", flush=True)

if partial:
    print(f"partial run (SANITIZE_DIMS={sorted(_only)}, SANITIZE_SKIP={sorted(_skip)}, "
          f"SANITIZE_PATHS={sorted(_paths)}): the "
          "variants not launched above were left out on purpose", flush=True)
sys.exit(1 if missing and not partial else 0)
