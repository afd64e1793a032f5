"""CPU checks of the benchmark's new providers (bench/flex_composite.py, bench/providers.py).

- flex_composite's math without FlexAttention: the two halves (d < w on q1, k1; d >= w on
  q2, k2; d >= 0 when causal) computed densely in float64 with the provider's own mask
  predicates, merged by bench/flex_composite.lse_merge, against the float64 reference
  (cupy_piecewise.reference.forward / backward): outputs, lse, and the gradients autograd
  takes through the merge, empty rows included.
- The provider list and CLI accept piecewise_mma and flex_composite; piecewise_mma's path
  switch sets CUPY_PIECEWISE_PATH=mma for the measurement and restores it.
- The full provider on a tiny shape on CPU where torch's FlexAttention can run there
  (torch 2.13 CPU: the uncompiled forward runs; torch.compile with lse and the backward are
  refused on CPU, those tests skip with torch's message).
"""
from __future__ import annotations

import importlib.util
import inspect
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "bench")
BENCH = os.path.join(BENCH_DIR, "bench.py")


def _load_bench():
    spec = importlib.util.spec_from_file_location("cupy_piecewise_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # puts bench/ on sys.path for the modules beside it
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load_bench()


@pytest.fixture(scope="module")
def fc(bench):
    import flex_composite
    return flex_composite


@pytest.fixture(scope="module")
def ref():
    from cupy_piecewise import reference
    return reference


# ----------------------------------------------------------------------------- dense halves
def dense_part(q, k, v, mask, scale):
    """Softmax attention of q on the keys where mask (M, N) holds, float64, with its lse
    (-inf and o = 0 for a row without keys). GQA: k, v expanded to q's heads."""
    H, Hkv = q.shape[1], k.shape[1]
    if H != Hkv:
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe.unsqueeze(-1))
    return p @ v, lse


def dense_composite(fc, q1, k1, q2, k2, v, w, causal, scale=None, return_lse=False):
    M, N, D = q1.shape[-2], k1.shape[-2], q1.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    near = fc.dense_mask(fc.near_mask_mod(N - M, w, causal), M, N)
    far = fc.dense_mask(fc.far_mask_mod(N - M, w, causal), M, N)
    o1, lse1 = dense_part(q1, k1, v, near, scale)
    o2, lse2 = dense_part(q2, k2, v, far, scale)
    return fc.lse_merge(o1, lse1, o2, lse2, return_lse=return_lse)


def _inputs(B, H, Hkv, M, N, D, seed, dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, n: torch.randn(B, h, n, D, generator=g, dtype=dtype).requires_grad_(requires_grad)  # noqa: E731
    return mk(H, M), mk(Hkv, N), mk(H, M), mk(Hkv, N), mk(Hkv, N)


# (B, H, Hkv, M, N, D, w, causal): square, M < N, M > N (empty causal rows), GQA, w at the edges
CASES = [
    (1, 2, 2, 16, 16, 8, 4, False),
    (1, 2, 2, 16, 16, 8, 4, True),
    (2, 4, 2, 8, 24, 8, 5, True),     # M < N, GQA
    (1, 2, 1, 24, 8, 8, 3, True),     # M > N: the first rows have no key at all
    (1, 2, 1, 24, 8, 8, 3, False),
    (1, 2, 2, 16, 16, 8, 0, True),    # near half empty everywhere
    (1, 2, 2, 16, 16, 8, 100, False),  # far half empty everywhere: standard attention on q1, k1
    (1, 2, 2, 16, 16, 8, -3, False),  # negative w: keys after the query use q2, k2
    (1, 1, 1, 1, 32, 8, 8, False),    # decode-like
]


@pytest.mark.parametrize("B,H,Hkv,M,N,D,w,causal", CASES)
def test_merge_of_dense_halves_matches_reference_forward(fc, ref, B, H, Hkv, M, N, D, w, causal):
    q1, k1, q2, k2, v = _inputs(B, H, Hkv, M, N, D, seed=M * 31 + N + w)
    o, lse = dense_composite(fc, q1, k1, q2, k2, v, w, causal, return_lse=True)
    o_ref, lse_ref = ref.forward(*(t.numpy() for t in (q1, k1, q2, k2, v)), w, causal)
    np.testing.assert_allclose(o.numpy(), o_ref, rtol=1e-10, atol=1e-12)
    assert np.array_equal(np.isinf(lse.numpy()), np.isinf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse.numpy()[fin], lse_ref[fin], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("B,H,Hkv,M,N,D,w,causal", CASES)
def test_autograd_through_merge_matches_reference_backward(fc, ref, B, H, Hkv, M, N, D, w, causal):
    ins = _inputs(B, H, Hkv, M, N, D, seed=M * 17 + N + w, requires_grad=True)
    o = dense_composite(fc, *ins, w, causal)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = torch.autograd.grad(o, ins, do)
    arrs = [t.detach().numpy() for t in ins]
    o_ref, lse_ref = ref.forward(*arrs, w, causal)
    want = ref.backward(*arrs, o_ref, lse_ref, do.numpy(), w, causal)
    for name, g, r in zip(("dq1", "dk1", "dq2", "dk2", "dv"), grads, want):
        assert torch.isfinite(g).all(), name
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-9, atol=1e-11, err_msg=name)


def test_lse_merge_rows_without_keys(fc):
    """One part empty: the other part unchanged; both empty: o = 0, lse = -inf; no nan anywhere,
    forward or backward (lse and o of the empty part get zero gradient)."""
    ninf = float("-inf")
    o1 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    o2 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    lse1 = torch.tensor([0.5, ninf, ninf], dtype=torch.float64, requires_grad=True)
    lse2 = torch.tensor([ninf, 1.5, ninf], dtype=torch.float64, requires_grad=True)
    o, lse = fc.lse_merge(o1, lse1, o2, lse2, return_lse=True)
    assert torch.equal(o[0], o1[0]) and torch.equal(o[1], o2[1]) and torch.equal(o[2], torch.zeros(4, dtype=o.dtype))
    assert lse[0] == 0.5 and lse[1] == 1.5 and lse[2] == ninf
    g = torch.autograd.grad(o.sum(), (o1, lse1, o2, lse2))
    assert all(torch.isfinite(x).all() for x in g)
    assert torch.equal(g[0][1:], torch.zeros(2, 4, dtype=torch.float64))   # o1 rows 1, 2 unused
    assert g[1][1] == 0 and g[1][2] == 0 and g[3][0] == 0 and g[3][2] == 0


def test_lse_merge_keeps_low_precision_output_dtype(fc):
    o1 = torch.randn(2, 5, 8).to(torch.bfloat16)
    o2 = torch.randn(2, 5, 8).to(torch.bfloat16)
    lse1, lse2 = torch.randn(2, 5), torch.randn(2, 5)
    o = fc.lse_merge(o1, lse1, o2, lse2)
    assert o.dtype == torch.bfloat16
    a1, a2 = lse1.exp().unsqueeze(-1), lse2.exp().unsqueeze(-1)
    want = (a1 * o1.float() + a2 * o2.float()) / (a1 + a2)
    torch.testing.assert_close(o.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("M,N,w,causal", [(16, 16, 4, False), (16, 16, 4, True), (8, 24, -2, False),
                                          (24, 8, 3, True)])
def test_masks_split_the_admissible_keys(fc, M, N, w, causal):
    near = fc.dense_mask(fc.near_mask_mod(N - M, w, causal), M, N)
    far = fc.dense_mask(fc.far_mask_mod(N - M, w, causal), M, N)
    d = torch.arange(M)[:, None] + (N - M) - torch.arange(N)[None, :]
    assert not (near & far).any()
    allowed = (d >= 0) if causal else torch.ones(M, N, dtype=torch.bool)
    assert torch.equal(near | far, allowed)
    assert torch.equal(far, (d >= w) & allowed)  # the tie d == w goes to the second pair


# ----------------------------------------------------------------------------- provider list / CLI
NEW = ["piecewise", "piecewise_mma", "flex_composite", "sdpa_flash", "sdpa_cudnn"]


def test_cli_accepts_new_provider_names(bench):
    a = bench.parse_args(["--quick", "--providers", ",".join(NEW), "--lengths", "2048,8192", "--sections", "main"])
    assert a.providers == NEW and a.lengths == [2048, 8192] and a.sections == ["main"]
    assert {"piecewise_mma", "flex_composite"} <= set(bench.parse_args([]).providers)
    assert {"piecewise_mma", "flex_composite"} <= set(bench.PROVIDERS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--providers", "flex"])


def test_make_providers_builds_the_new_names(bench):
    env = bench.Env(dry_run=True)
    provs = bench.make_providers(NEW, env, 1e9)
    assert list(provs) == NEW
    assert all(p.name == n for n, p in provs.items())
    assert isinstance(provs["piecewise_mma"], bench.PiecewiseMma)
    assert isinstance(provs["flex_composite"], bench.FlexComposite)
    assert provs["flex_composite"].compile is False  # no compile on the CPU (dry run)


def test_piecewise_mma_forces_and_restores_the_path(bench):
    capability = pytest.importorskip("cupy_piecewise.capability")
    var = capability.PATH_VAR
    saved = os.environ.get(var)
    try:
        for before in (None, "auto"):
            if before is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = before
            capability.refresh_env_override()
            prov = bench.PiecewiseMma(bench.Env(dry_run=True), 0)
            assert prov.unavailable() is None, prov.unavailable()
            with prov.context():
                assert os.environ[var] == "mma" and capability.path_override() == "mma"
            assert os.environ.get(var) == before
            assert capability.path_override() == "auto"
    finally:
        if saved is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = saved
        capability.refresh_env_override()


def test_piecewise_mma_context_restores_after_an_error(bench):
    capability = pytest.importorskip("cupy_piecewise.capability")
    var = capability.PATH_VAR
    saved = os.environ.get(var)
    try:
        with pytest.raises(RuntimeError):
            with bench.forced_path(capability, "mma"):
                raise RuntimeError("provider failed")
        assert os.environ.get(var) == saved
    finally:
        capability.refresh_env_override()


def test_flex_provider_failure_is_not_retried_and_disables(bench, fc, monkeypatch):
    """A failing first call (e.g. a compile error) is remembered per shape and grad mode, and after
    MAX_FAILED_SHAPES shapes without any success the provider reports itself unavailable."""
    _flex_or_skip(fc)
    calls = []

    def broken(sm_scale, compile=True, **kw):
        def f(*args):
            calls.append(1)
            raise RuntimeError("compile failed")
        return f
    monkeypatch.setattr(fc, "make_composite", broken)
    prov = bench.FlexComposite(bench.Env(dry_run=True), 0, compile=False)
    n = prov.MAX_FAILED_SHAPES
    for i in range(n):
        s = _Set(*_inputs(1, 1, 1, 16 + 16 * i, 16 + 16 * i, 8, seed=i, dtype=torch.float32))
        assert prov.unavailable() is None
        for _ in range(2):
            with torch.no_grad(), pytest.raises(RuntimeError, match="compile failed"):
                prov.forward(s, 4, False, 0.3)
    assert len(calls) == n  # the second call of each shape re-raised without calling again
    assert "disabled" in prov.unavailable() and "compile failed" in prov.unavailable()


# ----------------------------------------------------------------------------- the provider on CPU
def _flex_or_skip(fc):
    why = fc.flex_available()
    if why:
        pytest.skip(f"torch.nn.attention.flex_attention not importable: {why}")


class _Set:
    def __init__(self, q1, k1, q2, k2, v):
        self.q1, self.k1, self.q2, self.k2, self.v = q1, k1, q2, k2, v


def _run_or_skip(fn, what):
    try:
        return fn()
    except (NotImplementedError, RuntimeError) as e:
        msg = " ".join(str(e).split())[:300]
        if "CPU" in msg or "cpu" in msg or isinstance(e, NotImplementedError):
            pytest.skip(f"{what} does not run on CPU in torch {torch.__version__}: {type(e).__name__}: {msg}")
        raise


@pytest.mark.parametrize("B,H,Hkv,M,N,D,w,causal", [
    (1, 2, 2, 64, 64, 16, 16, False),
    (1, 2, 2, 64, 64, 16, 16, True),
    (1, 4, 2, 32, 96, 16, 40, True),   # GQA, M < N
])
def test_flex_provider_forward_on_cpu(bench, fc, ref, B, H, Hkv, M, N, D, w, causal):
    """The provider's own code path (block masks, two flex calls with lse, merge), uncompiled."""
    _flex_or_skip(fc)
    prov = bench.FlexComposite(bench.Env(dry_run=True), 0, compile=False)
    assert prov.unavailable() is None
    ins = _inputs(B, H, Hkv, M, N, D, seed=5, dtype=torch.float32)
    sm = 1.0 / math.sqrt(D)
    with torch.no_grad():
        o = _run_or_skip(lambda: prov.forward(_Set(*ins), w, causal, sm), "flex_attention (eager)")
    o_ref, _ = ref.forward(*(t.numpy() for t in ins), w, causal)
    np.testing.assert_allclose(o.double().numpy(), o_ref, atol=2e-5, rtol=1e-4)


def test_flex_lse_of_rows_without_keys_is_minus_inf_on_cpu(fc):
    """What the merge relies on: flex returns lse = -inf (and o = 0) for a row whose block mask
    admits no key (the far half's first w rows)."""
    _flex_or_skip(fc)
    M = N = 64
    w = 20
    q1, k1, q2, k2, v = _inputs(1, 1, 1, M, N, 16, seed=9, dtype=torch.float32)
    near, far = fc.block_masks(M, N, w, True, "cpu")
    from torch.nn.attention import flex_attention as fa

    def call():
        if "return_aux" in inspect.signature(fa.flex_attention).parameters:
            o, aux = fa.flex_attention(q2, k2, v, block_mask=far, return_aux=fa.AuxRequest(lse=True))
            return o, aux.lse
        return fa.flex_attention(q2, k2, v, block_mask=far, return_lse=True)
    o, lse = _run_or_skip(call, "flex_attention (eager)")
    assert torch.isneginf(lse[0, 0, :w]).all(), lse[0, 0, :w]
    assert torch.isfinite(lse[0, 0, w:]).all()
    assert torch.equal(o[0, 0, :w], torch.zeros_like(o[0, 0, :w]))


def test_composite_traces_as_one_graph(fc, ref):
    """torch.compile(fullgraph=True) of the composite (both flex calls with lse and the merge)
    traces without a graph break; backend aot_eager runs the traced graph unfused on CPU, so
    this checks dynamo's capture of exactly the function the GPU run compiles with inductor."""
    _flex_or_skip(fc)
    torch._dynamo.reset()
    ins = _inputs(1, 2, 2, 64, 64, 16, seed=8, dtype=torch.float32)
    near, far = fc.block_masks(64, 64, 16, True, "cpu")
    f = fc.make_composite(0.25, compile=True, fullgraph=True, backend="aot_eager")
    try:
        with torch.no_grad():
            o = _run_or_skip(lambda: f(*ins, near, far), "flex_attention under torch.compile(aot_eager)")
    finally:
        torch._dynamo.reset()
    o_ref, _ = ref.forward(*(t.numpy() for t in ins), 16, True, 0.25)
    np.testing.assert_allclose(o.double().numpy(), o_ref, atol=2e-5, rtol=1e-4)


def test_flex_provider_compile_path_over_several_shapes(bench, fc, ref):
    """The provider's compiled path (torch.compile, fullgraph, static shapes, one function per
    shape after torch._dynamo.reset()) with backend aot_eager, so that it runs on CPU: more shapes
    than dynamo's recompile limit would allow on one function, each against the reference."""
    _flex_or_skip(fc)
    prov = bench.FlexComposite(bench.Env(dry_run=True), 0, compile=True, backend="aot_eager")
    limit = getattr(torch._dynamo.config, "recompile_limit", getattr(torch._dynamo.config, "cache_size_limit", 8))
    shapes = [(32 + 16 * i, 16, 8 + i, i % 2 == 1) for i in range(min(limit, 8) + 1)]
    try:
        for L, D, w, causal in shapes:
            ins = _inputs(1, 2, 2, L, L, D, seed=L, dtype=torch.float32)
            with torch.no_grad():
                o = _run_or_skip(lambda: prov.forward(_Set(*ins), w, causal, D ** -0.5),
                                 "flex_attention under torch.compile(aot_eager)")
            o_ref, _ = ref.forward(*(t.numpy() for t in ins), w, causal)
            np.testing.assert_allclose(o.double().numpy(), o_ref, atol=2e-5, rtol=1e-4, err_msg=str((L, w, causal)))
    finally:
        torch._dynamo.reset()


def test_flex_provider_compiled_on_cpu(bench, fc, ref):
    """torch.compile'd composite (as on the GPU); torch 2.13's CPU inductor refuses flex with lse."""
    _flex_or_skip(fc)
    torch._dynamo.reset()
    prov = bench.FlexComposite(bench.Env(dry_run=True), 0, compile=True)
    ins = _inputs(1, 2, 2, 64, 64, 16, seed=6, dtype=torch.float32)
    try:
        with torch.no_grad():
            o = prov.forward(_Set(*ins), 16, True, 0.25)
    except Exception as e:  # inductor wraps the lowering error in its own exception types
        msg = " ".join(str(e).split())[:300]
        pytest.skip(f"compiled flex_attention does not run on CPU in torch {torch.__version__}: "
                    f"{type(e).__name__}: {msg}")
    finally:
        torch._dynamo.reset()
    o_ref, _ = ref.forward(*(t.numpy() for t in ins), 16, True, 0.25)
    np.testing.assert_allclose(o.double().numpy(), o_ref, atol=2e-5, rtol=1e-4)


def test_flex_provider_backward_on_cpu(bench, fc, ref):
    """Gradients of the provider (autograd through both flex calls and the merge)."""
    _flex_or_skip(fc)
    prov = bench.FlexComposite(bench.Env(dry_run=True), 0, compile=False)
    ins = _inputs(1, 2, 2, 32, 32, 16, seed=7, dtype=torch.float32, requires_grad=True)
    w, causal = 8, True

    def run():
        o = prov.forward(_Set(*ins), w, causal, 0.25)
        return o, torch.autograd.grad(o, ins, torch.ones_like(o))
    o, grads = _run_or_skip(run, "flex_attention backward")
    arrs = [t.detach().numpy() for t in ins]
    o_ref, lse_ref = ref.forward(*arrs, w, causal, 0.25)
    want = ref.backward(*arrs, o_ref, lse_ref, np.ones_like(o_ref), w, causal, 0.25)
    for g, r in zip(grads, want):
        np.testing.assert_allclose(g.double().numpy(), r, atol=1e-4, rtol=1e-3)


def test_bench_modules_beside_entry_point():
    """bench/bench.py is the thin entry point; the jobs live in modules beside it."""
    for m in ("common", "timing", "inputs", "providers", "flex_composite", "runner", "reporting", "cli"):
        assert os.path.isfile(os.path.join(BENCH_DIR, m + ".py")), m
    with open(BENCH) as f:
        n = sum(1 for _ in f)
    assert n < 150, n
