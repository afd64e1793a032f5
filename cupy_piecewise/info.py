"""``python -m cupy_piecewise info``: what this machine offers the package.

Prints versions (Python, NumPy, CuPy, torch, this package), whether CuPy sees
a CUDA GPU, whether NVRTC loads, where the kernel sources are, and the tile
sizes the capability table picks for each GPU found (or for every listed
architecture when there is none). ``--json`` prints the same as one JSON object.
Never fails for a missing GPU, CuPy or torch: it says so instead.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys


def _version(module_name: str) -> str | None:
    try:
        module = __import__(module_name)
    except Exception as exc:  # not installed, or broken: say which
        return None if isinstance(exc, ModuleNotFoundError) else f"import failed: {exc}"
    return str(getattr(module, "__version__", "unknown"))


def _gpus() -> tuple[list[dict], str | None]:
    """-> (devices, reason none were found)."""
    try:
        import cupy
    except Exception as exc:
        return [], f"CuPy not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return [], f"{type(exc).__name__}: {exc}"
    if count == 0:
        return [], "CuPy reports 0 CUDA devices"
    devices = []
    for i in range(count):
        entry: dict = {"index": i}
        try:
            dev = cupy.cuda.Device(i)
            cc = dev.compute_capability  # e.g. '90'
            entry["cc"] = (int(cc[:-1]), int(cc[-1]))
            entry["name"] = cupy.cuda.runtime.getDeviceProperties(i)["name"].decode(errors="replace")
            entry["max_shared_optin"] = int(dev.attributes.get("MaxSharedMemoryPerBlockOptin", 0)) or None
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        devices.append(entry)
    return devices, None


def _nvrtc() -> tuple[str | None, str | None]:
    try:
        from cupy_backends.cuda.libs import nvrtc

        major, minor = nvrtc.getVersion()
        return f"{major}.{minor}", None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _kernel_dir() -> tuple[str | None, list[str], str | None]:
    from .kernel_sources import kernel_dir, kernel_files

    try:
        root = kernel_dir()
        return str(root), [p.relative_to(root).as_posix() for p in kernel_files()], None
    except Exception as exc:
        return None, [], f"{type(exc).__name__}: {exc}"


def _tiles(cc: tuple[int, int], max_shared: int | None = None) -> dict:
    """{phase: {head_dim: 'BMxBNxWARPSxSTAGES'}} for float16, non-causal, or an error."""
    from . import capability

    def row(arch, phase: str, dtype: str) -> dict:
        # each phase's own head dims (the KV-cache phases and bwd_fused have fewer than the
        # forward); "none" where the variant shown has no kernel (TF32_TABLE's None for
        # float32, bwd_fused refined to None)
        out = {}
        for d in capability.head_dims(cc):
            if d in capability.TABLE[arch][phase]:
                try:
                    out[d] = str(capability.lookup(cc, phase, d, dtype, False,
                                                   max_shared=max_shared))
                except ValueError:
                    out[d] = "none"
        return out

    try:
        arch = capability.resolve_arch(cc, max_shared)
        table = {phase: row(arch, phase, "float16") for phase in capability.PHASES}
        # float32 (TF32) tiles of the attention phases
        f32 = {phase: row(arch, phase, "float32") for phase in capability.PHASES
               if phase not in capability.HALF_ONLY_PHASES}
        return {"table_arch": f"sm_{arch[0]}{arch[1]}", "tiles": table, "tiles_float32": f32,
                "forward_path": _forward_path(cc), "backward_path": _backward_path(cc),
                "decode_path": _decode_path(cc)}
    except ValueError as exc:
        return {"error": str(exc)}


def _mma_only(cc: tuple[int, int]):
    """The words for a GPU that runs only the mma.sync kernels (not compute capability 9.0,
    or CUPY_PIECEWISE_PATH=mma), the error text of a bad CUPY_PIECEWISE_PATH, or None when
    the Hopper kernels apply."""
    from . import capability

    try:
        path = capability.path_override()
    except ValueError as exc:
        return str(exc)
    if tuple(cc) != (9, 0) or path == "mma":
        why = " (CUPY_PIECEWISE_PATH=mma)" if tuple(cc) == (9, 0) else ""
        return f"mma.sync kernels{why}"
    return None


def _forward_path(cc: tuple[int, int]) -> str:
    """Which forward kernels a GPU of compute capability ``cc`` runs, in words."""
    from . import capability

    words = _mma_only(cc)
    if words is not None:
        return words
    dims = "/".join(str(d) for d in capability.HOPPER_HEAD_DIMS)
    small = "every grid" if capability.path_override() == "hopper" else "grids of at least one block per SM"
    # query rows x key rows per tile, K + V ring slots, per compute head dim
    tiles = "  ".join(
        f"D{d}={capability.HOPPER_BLOCK_M[d]}x{bn} {'+'.join(map(str, capability.HOPPER_FWD_SLOTS[d]))} slots"
        for d, bn in sorted(capability.HOPPER_BLOCK_N.items()))
    pairs = "/".join(str(d) for d in capability.HOPPER_HEAD_DIMS
                     if capability.HOPPER_CAUSAL_PAIRS[capability.hopper_compute_dim(d)])
    return (f"Hopper wgmma + TMA kernel (sm_90a) for float16/bfloat16, head dims {dims} "
            f"({tiles}; persistent grid: non-causal, and causal at D {pairs or 'none'} in "
            f"pairs of query tiles), more than 16 query rows, {small}; mma.sync kernels "
            f"otherwise (float32 inputs always, in TF32)")


def _backward_path(cc: tuple[int, int]) -> str:
    """Which backward kernels a GPU of compute capability ``cc`` runs, in words."""
    from . import capability

    words = _mma_only(cc)
    if words is not None:
        return words
    dims = "/".join(str(d) for d in capability.HOPPER_BWD_HEAD_DIMS)
    return (f"Hopper wgmma + TMA kernel (sm_90a) for float16/bfloat16, head dims {dims} (dQ by "
            f"float32 atomics; deterministic=True: dQ by the mma.sync kernel); mma.sync kernels "
            f"otherwise (float32 inputs always, in TF32)")


def _decode_path(cc: tuple[int, int]) -> str:
    """Which KV-cache decode kernel (attention_with_kvcache, one new token) a GPU of compute
    capability ``cc`` runs, in words."""
    from . import capability

    words = _mma_only(cc)
    if words is not None:
        return "cp.async kernel" + (words[len("mma.sync kernels"):]
                                    if words.startswith("mma.sync kernels") else f" ({words})")
    tiles = "  ".join(f"D{d}={capability.kv90_tiles(d)}" for d in capability.KV90_HEAD_DIMS)
    return (f"Hopper TMA kernel (sm_90a) for float16/bfloat16, head dims "
            f"{'/'.join(map(str, capability.KV90_HEAD_DIMS))} ({tiles}; up to "
            f"{capability.KV90_MAX_CLUSTER} key splits merged in a cluster); cp.async kernel "
            f"otherwise")


def collect() -> dict:
    """Everything ``info`` reports, as a dict."""
    from . import __version__, capability

    gpus, gpu_reason = _gpus()
    nvrtc_version, nvrtc_reason = _nvrtc()
    kdir, kfiles, kreason = _kernel_dir()
    info = {
        "versions": {
            "python": platform.python_version(),
            "numpy": _version("numpy"),
            "cupy": _version("cupy"),
            "torch": _version("torch"),
            "cupy_piecewise": __version__,
        },
        "gpus": gpus,
        "gpu_missing_reason": gpu_reason,
        "nvrtc": nvrtc_version,
        "nvrtc_missing_reason": nvrtc_reason,
        "kernel_dir": kdir,
        "kernel_files": kfiles,
        "kernel_dir_error": kreason,
        "tile_override": capability.env_override() or None,
        "path_override": __import__("os").environ.get(capability.PATH_VAR) or None,
    }
    if gpus:
        for g in gpus:
            if "cc" in g:
                g.update(_tiles(g["cc"], g.get("max_shared_optin")))
    else:
        info["listed_arch_tiles"] = {f"sm_{a}{b}": _tiles((a, b)) for a, b in capability.LISTED_ARCHS}
    return info


def _print_tiles(entry: dict, indent: str) -> None:
    if "error" in entry:
        print(f"{indent}tiles: {entry['error']}")
        return
    print(f"{indent}forward: {entry['forward_path']}")
    print(f"{indent}backward: {entry['backward_path']}")
    print(f"{indent}KV-cache decode: {entry['decode_path']}")
    print(f"{indent}tile table {entry['table_arch']} (float16, non-causal; BMxBNxWARPSxSTAGES):")
    for phase, row in entry["tiles"].items():
        cells = "  ".join(f"D{d}={cfg}" for d, cfg in row.items())
        print(f"{indent}  {phase:<10} {cells}")
    print(f"{indent}float32 (TF32) tiles, non-causal (none: no float32 kernel at that head dim):")
    for phase, row in entry.get("tiles_float32", {}).items():
        cells = "  ".join(f"D{d}={cfg}" for d, cfg in row.items())
        print(f"{indent}  {phase:<10} {cells}")


def _print(info: dict) -> None:
    v = info["versions"]
    print(f"cupy-piecewise {v['cupy_piecewise']}")
    for name in ("python", "numpy", "cupy", "torch"):
        print(f"  {name:<7} {v[name] or 'not installed'}")
    if info["nvrtc"]:
        print(f"NVRTC: found, version {info['nvrtc']}")
    else:
        print(f"NVRTC: not found ({info['nvrtc_missing_reason']})")
    if info["kernel_dir"]:
        files = ", ".join(info["kernel_files"]) or "no .cu/.cuh files"
        print(f"kernel sources: {info['kernel_dir']} ({files})")
    else:
        print(f"kernel sources: not found ({info['kernel_dir_error']})")
    if info["tile_override"]:
        print(f"tile override {info['tile_override']!r} (CUPY_PIECEWISE_TILES) applies to the tables below")
    if info["path_override"]:
        print(f"kernel path {info['path_override']!r} (CUPY_PIECEWISE_PATH)")
    if info["gpus"]:
        print(f"GPU: {len(info['gpus'])} found")
        for g in info["gpus"]:
            if "error" in g:
                print(f"  [{g['index']}] {g['error']}")
                continue
            cc = g["cc"]
            print(f"  [{g['index']}] {g['name']}, sm_{cc[0]}{cc[1]}, {g['max_shared_optin']} B shared/block")
            _print_tiles(g, "      ")
    else:
        print(f"GPU: none found ({info['gpu_missing_reason']})")
        print("tile tables per listed architecture:")
        for arch, entry in info["listed_arch_tiles"].items():
            print(f"  {arch}")
            _print_tiles(entry, "    ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_piecewise info", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    info = collect()
    if args.json:
        json.dump(info, sys.stdout, indent=2, default=str)
        print()
    else:
        _print(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
