"""The shared-memory layout has one source per kernel: the traits structs of
``kernels_cu/traits.cuh``. The launch passes ``capability.shared_bytes`` as the dynamic
shared-memory size, so the two must agree for every variant the tile table can select.

For each listed architecture and each kernel source file, one NVRTC program is the kernel
source (``compile.source``) followed by a ``static_assert(XTraits<D, BM, BN, WARPS>::smem_bytes
== <Python figure>)`` per distinct (traits, head dim, tiles) the table can select there. No
kernel is instantiated (no name expressions), so this is front-end work only, no GPU needed.

Needs NVRTC (the ``nvidia-cuda-nvrtc`` wheel in the ``test`` extra, loaded through CuPy);
where it cannot be loaded the tests are skipped with the reason.
"""
from __future__ import annotations

import re
import time

import pytest

from cupy_piecewise import capability
from cupy_piecewise.compile import BASE_OPTIONS, SOURCE_FILE, source

#: traits struct per tiled phase (kernels_cu/traits.cuh); fwd_decode runs pw_forward.
TRAITS = {"fwd": "FwdTraits", "fwd_decode": "FwdTraits", "bwd_dq": "BwdDqTraits",
          "bwd_dkv": "BwdDkvTraits", "bwd_fused": "BwdDkvTraits", "bwd_grid": "BwdGridTraits",
          "kvcache": "KvTraits",
          "kvdecode": "KvTraits"}
_TAG = re.compile(r"error: static assertion failed.*pw-traits#(\d+)")
_FINAL = re.compile(r"final comparison was (-?\d+) == (-?\d+)")  # NVRTC's note on a failed ==


def _arch(cc) -> str:
    return f"sm_{cc[0]}{cc[1]}"


def _checks(cc) -> dict[str, dict[tuple[str, int], list[str]]]:
    """{source file: {(traits expression, Python figure): [variants it stands for]}}."""
    out: dict[str, dict[tuple[str, int], list[str]]] = {}
    for phase, head_dim, dtype, causal, t in sorted(capability.selectable_configs(cc), key=str):
        # the kernels instantiate the traits with the row width in 16-bit units (float32: 2D)
        width = capability.elem_bytes(dtype) // 2
        # the KV-cache kernel: its ring depth and key slots (two, or one when decoding); the
        # fused backward: the dk/dv layout with its dS tile (FUSED); the forward: its key
        # slots by the kernel's own rule (traits.cuh fwd_one_key_slot), so a disagreement
        # with capability.fwd_one_key_slot fails the size check
        # (and its three rotating slots by fwd_q_rotate, PW_FWD_Q_ROTATE on by default:
        # FwdLayoutBytes)
        one_k = (f", fwd_one_key_slot({width}, {head_dim}, {t.block_m}, {t.block_n}, "
                 f"{t.num_warps}), "
                 f"fwd_q_rotate({width}, {head_dim}, {t.block_m}, {t.block_n}, {t.num_warps})")
        stages = {"kvcache": f", {t.stages}, 2", "kvdecode": f", {t.stages}, 1",
                  "bwd_fused": ", true", "fwd": one_k, "fwd_decode": one_k}.get(phase, "")
        struct = "FwdLayoutBytes" if phase in ("fwd", "fwd_decode") else TRAITS[phase]
        expr = (f"{struct}<{head_dim * width}, {t.block_m}, {t.block_n}, "
                f"{t.num_warps}{stages}>")
        figure = capability.shared_bytes(phase, head_dim, t, capability.elem_bytes(dtype))
        label = f"{phase} D={head_dim} tiles {t} {dtype} causal={causal} on {_arch(cc)}"
        out.setdefault(SOURCE_FILE[phase], {}).setdefault((expr, figure), []).append(label)
    return out


def _assert_lines(checks: list[tuple[str, int, str]]) -> str:
    lines = ["", "// ---- tests/test_traits_cpu.py: kernel layout == capability.shared_bytes"]
    for i, (expr, figure, label) in enumerate(checks):
        msg = f"pw-traits#{i}: {expr}::smem_bytes != capability.shared_bytes = {figure} ({label})"
        lines.append(f'static_assert({expr}::smem_bytes == {figure}, "{msg}");')
    return "\n".join(lines) + "\n"


def _failed_asserts(nvrtc, cc, filename: str, checks: list[tuple[str, int, str]]) -> tuple[list[str], str]:
    """Compiles ``filename`` plus one static_assert per check for ``cc``. Returns one line per
    check that fired (empty when all hold: both figures and the variant) and the compiler log."""
    prog = nvrtc.createProgram(source(filename) + _assert_lines(checks), filename, [], [])
    try:
        opts = list(BASE_OPTIONS) + [f"-arch=compute_{cc[0]}{cc[1]}"]  # PTX only: no ptxas
        try:
            nvrtc.compileProgram(prog, opts)
            return [], nvrtc.getProgramLog(prog)
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    kernel: dict[int, str] = {}  # check index -> the traits' figure, when NVRTC prints it
    current = None
    for line in log.splitlines():
        m = _TAG.search(line)
        if m:
            current = int(m.group(1))
            kernel.setdefault(current, "?")
        elif current is not None and (f := _FINAL.search(line)):
            kernel[current] = f.group(1)
            current = None
    if not kernel:  # some other compile error: report it whole
        raise AssertionError(f"NVRTC failed for {filename} on {_arch(cc)} (not a traits check):\n{log}")
    return [f"{checks[i][0]}::smem_bytes = {kernel[i]} but capability.shared_bytes = {checks[i][1]}, "
            f"for {checks[i][2]}" for i in sorted(kernel)], log


def test_every_tiled_phase_has_traits():
    assert set(TRAITS) == set(capability.PHASES)


@pytest.mark.parametrize("filename", sorted(set(SOURCE_FILE[p] for p in TRAITS)))
@pytest.mark.parametrize("cc", capability.LISTED_ARCHS, ids=_arch)
def test_kernel_traits_match_python_shared_bytes(nvrtc, cc, filename):
    t0 = time.perf_counter()
    by_expr = _checks(cc)[filename]
    assert by_expr, f"no selectable variant uses {filename} on {_arch(cc)}"
    # One assert per distinct (traits, figure); its label names the first variant and the count.
    checks = [(expr, figure, labels[0] + (f" and {len(labels) - 1} more" if len(labels) > 1 else ""))
              for (expr, figure), labels in sorted(by_expr.items())]
    fired, log = _failed_asserts(nvrtc, cc, filename, checks)
    assert not fired, (
        f"kernels_cu/traits.cuh and capability.shared_bytes disagree for {len(fired)} variant(s) "
        f"of {filename} on {_arch(cc)}:\n  " + "\n  ".join(fired)
        + "\n(the launch passes shared_bytes; the kernel carves smem with the traits: change both)")
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, f"front-end compile of {filename} took {elapsed:.1f} s"


@pytest.mark.parametrize("cc", capability.LISTED_ARCHS, ids=_arch)
def test_grid_backward_layouts_match_python_shared_bytes(nvrtc, cc):
    """BwdGridTraits (pw_backward_grid) against capability.shared_bytes for every shape
    check_config admits at head dims 64 and 128, whether or not the table selects it (a tile
    override can, and the layout differs with grid_two_ds_buffers), and the kernel's
    grid_two_ds_buffers against the host's."""
    cfgs = [(d, capability.TileConfig(64, 16 * w, w)) for d in (64, 128) for w in (4, 8)]
    checks = [(f"BwdGridTraits<{d}, 64, {t.block_n}, {t.num_warps}>",
               capability.shared_bytes("bwd_grid", d, t), f"bwd_grid D={d} {t}") for d, t in cfgs]
    fired, log = _failed_asserts(nvrtc, cc, "backward.cu", checks)
    assert not fired, "\n".join(fired)
    # check_config admits exactly the head dims whose traits compile (its dQ tile rule)
    for d in (16, 32, 64, 80, 96, 128, 256):
        for w in (4, 8):
            t = capability.TileConfig(64, 16 * w, w)
            ok = not any("dQ warp tiles" in e for e in capability.check_config("bwd_grid", d, t, cc))
            prog = nvrtc.createProgram(source("backward.cu") + f"\nstatic_assert(BwdGridTraits<{d}, "
                                       f"64, {16 * w}, {w}>::smem_bytes > 0, \"\");\n",
                                       "backward.cu", [], [])
            try:
                nvrtc.compileProgram(prog, list(BASE_OPTIONS) + [f"-arch=compute_{cc[0]}{cc[1]}"])
                compiles = True
            except nvrtc.NVRTCError:
                compiles = False
            finally:
                nvrtc.destroyProgram(prog)
            assert ok == compiles, (d, w, ok, compiles)
    rules = "".join(
        f"static_assert(grid_two_ds_buffers({d}, {t.num_warps}) == "
        f"{'true' if capability.grid_two_ds_buffers(d, t) else 'false'}, \"D={d} {t}\");\n"
        for d, t in cfgs)
    prog = nvrtc.createProgram(source("backward.cu") + "\n" + rules, "backward.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(BASE_OPTIONS) + [f"-arch=compute_{cc[0]}{cc[1]}"])
    except nvrtc.NVRTCError:
        raise AssertionError(nvrtc.getProgramLog(prog)) from None
    finally:
        nvrtc.destroyProgram(prog)


def test_a_wrong_figure_fails_to_compile_and_names_the_variant(nvrtc):
    cc = (9, 0)
    (expr, figure), labels = sorted(_checks(cc)["backward.cu"].items())[0]
    checks = [(expr, figure, "right figure"), (expr, figure + 16, "wrong figure on purpose")]
    fired, log = _failed_asserts(nvrtc, cc, "backward.cu", checks)
    assert len(fired) == 1 and "wrong figure on purpose" in fired[0], (fired, log)
    assert f"smem_bytes = {figure} but capability.shared_bytes = {figure + 16}" in fired[0], fired
    assert "static assert" in log.lower() or "static_assert" in log.lower(), log


@pytest.mark.parametrize("filename, struct, figure", [
    ("sm90/forward.cu", "pw90::FwdSmem", "hopper_shared_bytes"),
    ("sm90/backward.cu", "pw90::bwd::Smem", "hopper_bwd_shared_bytes"),
])
def test_hopper_shared_bytes_match_the_kernel(nvrtc, filename, struct, figure):
    """capability.hopper_shared_bytes / hopper_bwd_shared_bytes (what the launch asks for)
    equal the Hopper kernels' own Smem<D>::BYTES for every head dim they are built for (80
    and 96: the D = 128 kernel's)."""
    fn = getattr(capability, figure)
    src = source(filename) + "".join(
        f"\nstatic_assert({struct}<{capability.hopper_compute_dim(d)}>::BYTES == {fn(d)}, "
        f"\"{struct}<{capability.hopper_compute_dim(d)}>::BYTES != capability.{figure}({d})\");"
        for d in (capability.HOPPER_HEAD_DIMS if figure == "hopper_shared_bytes"
                  else capability.HOPPER_BWD_HEAD_DIMS))
    _compile_sm90a(nvrtc, src)


def test_hopper_forward_tiles_match_the_kernel(nvrtc):
    """capability.HOPPER_BLOCK_M and HOPPER_BLOCK_N (the TMA boxes of Q and of K, V; the
    grids), HOPPER_FWD_SLOTS, HOPPER_CAUSAL_PAIRS (which causal grids the launcher makes
    persistent) and hopper_fwd_threads (the block the launcher asks for) are the Hopper
    forward's own FwdCfg<D> / FwdWarps<D> for every compute head dim."""
    src = source("sm90/forward.cu")
    for d, bn in capability.HOPPER_BLOCK_N.items():
        ks, vs = capability.HOPPER_FWD_SLOTS[d]
        pairs = "true" if capability.HOPPER_CAUSAL_PAIRS[d] else "false"
        bm, threads = capability.HOPPER_BLOCK_M[d], capability.hopper_fwd_threads(d)
        src += (f"\nstatic_assert(pw90::FwdCfg<{d}>::BN == {bn} && pw90::FwdCfg<{d}>::KSLOTS == {ks}"
                f" && pw90::FwdCfg<{d}>::VSLOTS == {vs} && pw90::FwdCfg<{d}>::PAIRS == {pairs}"
                f" && pw90::FwdCfg<{d}>::BM == {bm} && pw90::FwdWarps<{d}>::THREADS == {threads},"
                f" \"FwdCfg<{d}> != capability\");")
    want = sorted({capability.hopper_compute_dim(d) for d in capability.HOPPER_HEAD_DIMS})
    assert (sorted(capability.HOPPER_BLOCK_N) == sorted(capability.HOPPER_CAUSAL_PAIRS)
            == sorted(capability.HOPPER_BLOCK_M) == want)
    # the three consumer warpgroups of D = 64 (and 512 threads); two elsewhere
    assert [capability.hopper_fwd_threads(d) for d in (64, 80, 128, 256)] == [512, 384, 384, 384]
    _compile_sm90a(nvrtc, src)


def test_hopper_shared_bytes_follow_the_tile_macros(nvrtc):
    """hopper_shared_bytes with block_n / slots / block_m (what scripts/hopper_probe.py asks
    for a --variants build) equals FwdSmem<D>::BYTES built with the matching macros."""
    src = ("#define PW90_BN128 96\n#define PW90_KSLOTS128 4\n#define PW90_KSLOTS64 2\n"
           "#define PW90_BM64 128\n" + source("sm90/forward.cu"))
    for d, bn, slots, bm in ((128, 96, (4, 2), None), (64, 128, (2, 2), 128)):
        figure = capability.hopper_shared_bytes(d, block_n=bn, slots=slots, block_m=bm)
        assert figure != capability.hopper_shared_bytes(d)  # the override is not the default
        src += (f"\nstatic_assert(pw90::FwdSmem<{d}>::BYTES == {figure}, "
                f"\"FwdSmem<{d}> != capability.hopper_shared_bytes override\");")
    _compile_sm90a(nvrtc, src)


@pytest.mark.parametrize("stages", [None, 2, 4])
def test_hopper_decode_shared_bytes_match_the_kernel(nvrtc, monkeypatch, stages):
    """capability.kv90_shared_bytes (what kvcache_launch asks for) equals the Hopper decode's
    own pw90kv::Smem<D, STAGES, TAB>::BYTES for every head dim it is built for, at the table's
    ring depth and at the depths a tuning run may try: the default forms, and the rotary
    forms with the staged table rows (KV90_ROT_STAGE's mirror on: TAB), which fit sm_90's
    227 KB at the table's depth; with the mirror off a rotary form's size is the default's."""
    checks = []
    for d in capability.KV90_HEAD_DIMS:
        st = stages or capability.kv90_tiles(d).stages
        monkeypatch.setattr(capability, "KV90_ROT_STAGE", False)
        plain = capability.kv90_shared_bytes(d, st)
        assert capability.kv90_shared_bytes(d, st, rotary=True) == plain
        # a staged form asked for by name (Variant.rot_stage) carves what the macro's does
        by_name = capability.kv90_shared_bytes(d, st, rotary=True, staged=True)
        assert capability.kv90_shared_bytes(d, st, rotary=False, staged=True) == plain
        monkeypatch.setattr(capability, "KV90_ROT_STAGE", True)
        staged = capability.kv90_shared_bytes(d, st, rotary=True)
        assert by_name == staged
        assert staged - plain == (st * 4 + 1) * 2 * 16 * (d // 2) * 4
        if stages is None:
            assert staged <= capability.SHARED_LIMIT[(9, 0)], (d, staged)
        checks.append(f"\nstatic_assert(pw90kv::Smem<{d}, {st}>::BYTES == {plain}, "
                      f"\"kv90_shared_bytes({d}, {st})\");"
                      f"\nstatic_assert(pw90kv::Smem<{d}, {st}, true>::BYTES == {staged}, "
                      f"\"kv90_shared_bytes({d}, {st}, rotary) with KV90_ROT_STAGE\");")
    _compile_sm90a(nvrtc, source("sm90/kvdecode.cu") + "".join(checks))


def _compile_sm90a(nvrtc, src: str) -> None:
    """Front end + PTX of ``src`` for sm_90a; a failed static_assert fails the test with
    NVRTC's log."""
    prog = nvrtc.createProgram(src, "sm90_traits.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", "-arch=sm_90a"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


#: BASE_OPTIONS without the -DPW_... options PW_TEST_MACROS may have added (tests/conftest.py):
#: the staged-layout tests below define their macros in the source they compile
_OWN_MACROS_ONLY = [o for o in BASE_OPTIONS if not o.startswith("-DPW_")]


def _compile_front(nvrtc, src: str) -> None:
    """PTX of ``src`` (a kernel source with asserts appended) for compute_90 with
    :data:`_OWN_MACROS_ONLY`; a failed static_assert fails the test with NVRTC's log."""
    prog = nvrtc.createProgram(src, "forward.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, _OWN_MACROS_ONLY + ["-arch=compute_90"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def _tile_mode(q0, qn, k0, kn, P, w):
    """kernels_cu/common.cuh tile_mode: bit 0 some pair has d < w, bit 1 some d >= w."""
    dmin, dmax = q0 + P - (k0 + kn - 1), q0 + qn - 1 + P - k0
    return (1 if dmin < w else 0) | (2 if dmax >= w else 0)


def _rotate_geometries(rng, count):
    """Random query-tile geometries for the rotating-slot forward's phases: tile sizes, lengths
    up to 3000 and some near 2^30 (the kernels' limit), P anywhere in [-M, N] (what
    core.plan.clamp_w leaves), w beyond both ends, split ranges."""
    for i in range(count):
        BN = rng.choice((16, 32, 64, 128))
        BM = rng.choice((BN, 2 * BN, 4 * BN))
        top = (1 << 30) - 1 if i % 8 == 0 else 3000
        M, N = rng.randint(1, top), rng.randint(1, top)
        P = rng.choice((N - M, -M, N, rng.randint(-M, N)))
        w = rng.randint(-(M + N + 1), M + N + 1)
        m0 = BM * rng.randint(0, (M - 1) // BM)
        nt = (N + BN - 1) // BN
        t_begin = rng.randint(0, nt)
        yield BN, BM, M, N, P, w, m0, t_begin, rng.randint(t_begin, min(nt, t_begin + 400))


def _rotate_phases_by_definition(BN, BM, N, P, w, m0, t_begin, ntiles, causal):
    """(far_end, near_begin, first masked tile) from tile_mode's and tile_needs_mask's
    definitions, tile by tile: the phases must be contiguous runs of modes 2, 3, 1, and the
    tiles that need the mask a suffix of the range (else None)."""
    modes = [_tile_mode(m0, BM, t * BN, BN, P, w) for t in range(t_begin, ntiles)]
    runs = [m for i, m in enumerate(modes) if i == 0 or m != modes[i - 1]]
    if runs not in ([2, 3, 1][i:j] for i in range(4) for j in range(i, 4)):
        return None
    far_end = t_begin + sum(m == 2 for m in modes)
    near_begin = far_end + sum(m == 3 for m in modes)
    needs = [t * BN + BN > N or (causal and m0 + P - (t * BN + BN - 1) < 0)
             for t in range(t_begin, ntiles)]
    first = next((t_begin + i for i, x in enumerate(needs) if x), ntiles)
    if not all(needs[first - t_begin:]):
        return None
    return far_end, near_begin, first


def test_q_rotate_phases_follow_their_definitions(nvrtc):
    """traits.cuh fwd_rotate_phases, which the rotating-slot forward (PW_FWD_Q_ROTATE) uses:
    its far_end and near_begin split a key range into far tiles (mode 2: q2 alone, the only
    Q loaded then), straddling tiles (mode 3) and near tiles (mode 1: q1 alone) exactly as
    tile_mode classifies them, and a far or near tile needs the mask (a column past N, or
    causal, a key after some query) exactly from mask_begin on. The C++ function itself is
    evaluated, by static_asserts NVRTC compiles, on random geometries (negative and
    out-of-range w, P across [-M, N], lengths near 2^30, split ranges)."""
    import random

    rng = random.Random(20261204)
    asserts = []
    for BN, BM, M, N, P, w, m0, t_begin, ntiles in _rotate_geometries(rng, 600):
        for causal in (False, True):
            want = _rotate_phases_by_definition(BN, BM, N, P, w, m0, t_begin, ntiles, causal)
            assert want is not None, ("phases not contiguous", BN, BM, N, P, w, m0, t_begin, ntiles)
            call = (f"fwd_rotate_phases({m0}ll, {BM}, {BN}, {P}ll, {w}ll, {N}ll, {t_begin}, "
                    f"{ntiles}, {'true' if causal else 'false'})")
            asserts.append(f"static_assert({call}.far_end == {want[0]} && {call}.near_begin == "
                           f"{want[1]} && clamp64({call}.mask_begin, {t_begin}, {ntiles}) == "
                           f"{want[2]}, \"fwd_rotate_phases({BN}, {BM}, {N}, {P}, {w}, {m0}, "
                           f"{t_begin}, {ntiles}, {int(causal)})\");")
    _compile_front(nvrtc, source("forward.cu") + "\n" + "\n".join(asserts) + "\n")


def test_q_rotate_build_and_its_host_mirror_agree(nvrtc, monkeypatch):
    """PW_FWD_Q_ROTATE (kernels_cu/traits.cuh; 1, the default since 2026-12-05): a
    one-key-slot forward tile with BM == 2 * BN keeps three Q-sized slots, and the host
    mirror capability.FWD_Q_ROTATE is on by default, so shared_bytes gives 3 * BM padded rows
    (128x64x4 at D = 128: 104448 bytes, two blocks per sm_90 SM). With -DPW_FWD_Q_ROTATE=0
    capability.apply_kernel_macros turns the mirror off and the same tile keeps q1, q2 and two
    stages (139264 bytes, one block per SM). Other tiles do not change. The kernels' rule and
    sizes are checked both ways, with the macro unset (the default) and set to 0."""
    t = capability.TileConfig(128, 64, 4, 2)
    others = [(128, capability.TileConfig(128, 32, 4, 2)), (64, capability.TileConfig(128, 64, 4, 2)),
              (128, capability.TileConfig(64, 32, 4, 2))]
    assert capability._MIRROR_DEFAULTS["FWD_Q_ROTATE"] is True
    # the default, whatever PW_TEST_MACROS set
    monkeypatch.setattr(capability, "FWD_Q_ROTATE", True)
    monkeypatch.setattr(capability, "FWD_ONE_K_D64", False)
    assert capability.fwd_q_rotate(128, t)
    assert not capability.fwd_q_rotate(128, capability.TileConfig(128, 32, 4, 2))
    assert not capability.fwd_q_rotate(64, capability.TileConfig(128, 64, 4, 2))  # two slots
    assert not capability.fwd_q_rotate(128, t, elem_bytes=4)  # float32: not one key slot
    default = capability.shared_bytes("fwd", 128, t)
    before = [capability.shared_bytes("fwd", d, c) for d, c in others]
    capability.apply_kernel_macros(["PW_FWD_Q_ROTATE=0"])
    assert not capability.FWD_Q_ROTATE and not capability.fwd_q_rotate(128, t)
    four_slots = capability.shared_bytes("fwd", 128, t)
    assert (default, four_slots) == (104448, 139264)
    assert 2 * (default + 1024) <= 228 * 1024 < 2 * (four_slots + 1024)
    assert [capability.shared_bytes("fwd", d, c) for d, c in others] == before
    capability.apply_kernel_macros(["PW_FWD_Q_ROTATE=1"])
    assert capability.FWD_Q_ROTATE and capability.shared_bytes("fwd", 128, t) == default
    # the kernels' side, with the macro unset (the default) and set to 0: the rule, and the
    # size the forward carves by it (FwdLayoutBytes, as the size check above instantiates it)
    for define, figure in (("", default), ("#define PW_FWD_Q_ROTATE 0\n", four_slots)):
        rule = "" if figure == default else "!"
        src = (define + source("forward.cu")
               + f"\nstatic_assert({rule}fwd_q_rotate(1, 128, 128, 64, 4)"
                 " && !fwd_q_rotate(1, 128, 128, 32, 4) && !fwd_q_rotate(2, 128, 128, 64, 4),"
                 " \"rule\");"
               + "\nstatic_assert(FwdLayoutBytes<128, 128, 64, 4, fwd_one_key_slot(1, 128, 128, 64, 4),"
                 f" fwd_q_rotate(1, 128, 128, 64, 4)>::smem_bytes == {figure},"
                 " \"FwdLayoutBytes != capability.shared_bytes\");")
        _compile_front(nvrtc, src)
    with pytest.raises(ValueError, match="PW_FWD_Q_ROTATE=x"):
        capability.apply_kernel_macros(["PW_FWD_Q_ROTATE=x"])


def test_one_key_slot_d64_build_and_its_host_mirror_agree(nvrtc, monkeypatch):
    """PW_FWD_ONE_K_D64 (kernels_cu/traits.cuh; 1, the default since 2026-12-05): the
    one-key-slot forward at D = 64 with 128-key tiles, capability.FWD_ONE_K_D64 its host
    mirror, so that FlashAttention-2's D = 64 tile, 128x128x4 (TABLE's sm_90 entry), needs
    110592 bytes (two blocks per SM) instead of 147456; other D = 64 tiles (the 128x64x4 entry
    of sm_80/86/89) keep two slots. With -DPW_FWD_ONE_K_D64=0 apply_kernel_macros turns the
    mirror off and 128x128x4 keeps two slots. Kernel and host rules and sizes are checked
    both ways (the macro unset, the default, and set to 0)."""
    big, table = capability.TileConfig(128, 128, 4, 2), capability.TileConfig(128, 64, 4, 2)
    assert capability._MIRROR_DEFAULTS["FWD_ONE_K_D64"] is True
    assert capability.TABLE[(9, 0)]["fwd"][64] == capability.TileConfig(128, 128, 4)
    monkeypatch.setattr(capability, "FWD_Q_ROTATE", True)
    monkeypatch.setattr(capability, "FWD_ONE_K_D64", True)  # the default, whatever PW_TEST_MACROS set
    on = (capability.shared_bytes("fwd", 64, big), capability.shared_bytes("fwd", 64, table))
    assert on == ((2 * 128 + 2 * 2 * 128) * 144, (2 * 128 + 3 * 2 * 64) * 144) == (110592, 92160)
    assert capability.fwd_one_key_slot(64, big) and not capability.fwd_one_key_slot(64, table)
    assert not capability.fwd_one_key_slot(64, big, elem_bytes=4)  # float32: two slots
    assert not capability.fwd_q_rotate(64, big) and not capability.fwd_q_rotate(64, table)
    d128 = capability.shared_bytes("fwd", 128, table)
    capability.apply_kernel_macros(["PW_FWD_ONE_K_D64=0"])
    assert not capability.FWD_ONE_K_D64 and not capability.fwd_one_key_slot(64, big)
    off = (capability.shared_bytes("fwd", 64, big), capability.shared_bytes("fwd", 64, table))
    assert off == ((2 * 128 + 3 * 2 * 128) * 144, on[1]) == (147456, 92160)
    assert 2 * (on[0] + 1024) <= 233472 < 2 * (off[0] + 1024)  # two blocks per SM with it
    assert capability.shared_bytes("fwd", 128, table) == d128
    capability.apply_kernel_macros(["PW_FWD_ONE_K_D64=1"])
    assert capability.FWD_ONE_K_D64 and capability.check_config("fwd", 64, big, (9, 0)) == []
    for define, sizes, rule in (("", on, ""), ("#define PW_FWD_ONE_K_D64 0\n", off, "!")):
        src = define + source("forward.cu") + (
            f"\nstatic_assert({rule}fwd_one_key_slot(1, 64, 128, 128, 4)"
            " && !fwd_one_key_slot(1, 64, 128, 64, 4) && fwd_one_key_slot(1, 128, 128, 64, 4)"
            " && !fwd_one_key_slot(2, 64, 128, 128, 4), \"rule\");"
            f"\nstatic_assert(FwdLayoutBytes<64, 128, 128, 4, fwd_one_key_slot(1, 64, 128, 128, 4),"
            f" fwd_q_rotate(1, 64, 128, 128, 4)>::smem_bytes == {sizes[0]}, \"128x128x4\");"
            f"\nstatic_assert(FwdLayoutBytes<64, 128, 64, 4, fwd_one_key_slot(1, 64, 128, 64, 4),"
            f" fwd_q_rotate(1, 64, 128, 64, 4)>::smem_bytes == {sizes[1]}, \"128x64x4\");")
        _compile_front(nvrtc, src)


def test_apply_test_macros_reaches_options_and_mirrors(monkeypatch):
    """compile.apply_test_macros (tests/conftest.py and scripts/sanitize_cases.py call it):
    PW_TEST_MACROS's NAME=VALUE words become -D options of every later compile and set the
    host mirrors (PW_FWD_Q_ROTATE=0: the earlier four-slot forward layout, and its shared-memory
    size), and the staged tiles of capability.MACRO_TABLE become selectable; unset, it
    changes nothing."""
    from cupy_piecewise import compile as comp

    monkeypatch.setattr(comp, "BASE_OPTIONS", ("-std=c++17",))
    monkeypatch.setattr(capability, "FWD_Q_ROTATE", True)
    monkeypatch.setattr(capability, "FWD_ONE_K_D64", False)  # whatever PW_TEST_MACROS set
    monkeypatch.delenv("PW_TEST_MACROS", raising=False)
    assert comp.apply_test_macros() == () and comp.BASE_OPTIONS == ("-std=c++17",)
    assert capability.FWD_Q_ROTATE
    t = capability.TileConfig(128, 64, 4)
    assert capability.lookup((9, 0), "fwd", 128, "bfloat16", False) == t
    assert capability.shared_bytes("fwd", 128, t) == 104448
    monkeypatch.setenv("PW_TEST_MACROS", " PW_FWD_Q_ROTATE=0  PW_GRID_FMA_EXP=0 ")
    assert comp.apply_test_macros() == ("-DPW_FWD_Q_ROTATE=0", "-DPW_GRID_FMA_EXP=0")
    assert comp.BASE_OPTIONS == ("-std=c++17", "-DPW_FWD_Q_ROTATE=0", "-DPW_GRID_FMA_EXP=0")
    assert comp.arch_options((9, 0))[1:3] == ("-DPW_FWD_Q_ROTATE=0", "-DPW_GRID_FMA_EXP=0")
    assert not capability.FWD_Q_ROTATE
    assert capability.lookup((9, 0), "fwd", 128, "bfloat16", False) == t
    assert capability.shared_bytes("fwd", 128, t) == 139264
    comp.apply_test_macros()  # a second call adds nothing twice
    assert comp.BASE_OPTIONS.count("-DPW_FWD_Q_ROTATE=0") == 1
    # a staged entry (capability.MACRO_TABLE) becomes selectable with its mirror
    staged = capability.TileConfig(64, 64, 4)
    monkeypatch.setitem(capability.MACRO_TABLE, "FWD_Q_ROTATE", {(9, 0): {"fwd": {64: staged}}})
    assert capability.lookup((9, 0), "fwd", 64, "bfloat16", False) == capability.TABLE[(9, 0)][
        "fwd"][64] != staged
    monkeypatch.setattr(comp, "BASE_OPTIONS", ("-std=c++17",))
    monkeypatch.setenv("PW_TEST_MACROS", "PW_FWD_Q_ROTATE=1")
    assert comp.apply_test_macros() == ("-DPW_FWD_Q_ROTATE=1",)
    assert comp.BASE_OPTIONS == ("-std=c++17", "-DPW_FWD_Q_ROTATE=1")
    assert capability.FWD_Q_ROTATE
    assert capability.lookup((9, 0), "fwd", 64, "bfloat16", False) == staged


def test_grid_two_ds_macro_layout_matches_its_mirror(nvrtc, monkeypatch):
    """-DPW_GRID_TWO_DS=1 (an A/B build, kernels_cu/traits.cuh) gives the 4-warp D = 64 grid
    backward two Pᵀ/dSᵀ buffers; capability.GRID_TWO_DS_D64, set by apply_kernel_macros,
    sizes the launch the same way (102400 bytes), and the 8-warp and D = 128 layouts do not
    move. check_config then refuses the 4-warp D = 64 entry on sm_86 (99 KiB a block)."""
    monkeypatch.setattr(capability, "GRID_TWO_DS_D64", False)
    capability.apply_kernel_macros(["PW_GRID_TWO_DS=1"])
    assert capability.GRID_TWO_DS_D64 is True
    cfgs = [(d, capability.TileConfig(64, 16 * w, w)) for d in (64, 128) for w in (4, 8)]
    lines = "".join(
        f"static_assert(BwdGridTraits<{d}, 64, {t.block_n}, {t.num_warps}>::smem_bytes == "
        f"{capability.shared_bytes('bwd_grid', d, t)}, \"D={d} {t}\");\n" for d, t in cfgs)
    assert capability.shared_bytes("bwd_grid", 64, capability.TileConfig(64, 64, 4)) == 102400
    prog = nvrtc.createProgram(source("backward.cu") + "\n" + lines, "backward.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(BASE_OPTIONS) + ["-DPW_GRID_TWO_DS=1", "-arch=compute_90"])
    except nvrtc.NVRTCError:
        raise AssertionError(nvrtc.getProgramLog(prog)) from None
    finally:
        nvrtc.destroyProgram(prog)
    assert capability.check_config("bwd_grid", 64, capability.TileConfig(64, 64, 4), (8, 6))
    assert not capability.check_config("bwd_grid", 64, capability.TileConfig(64, 64, 4), (9, 0))
