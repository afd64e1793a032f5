"""``python -m cupy_piecewise SUBCOMMAND [ARGS]``.

Subcommands:

- ``info``: versions, GPU and NVRTC found or not, the tile sizes the table picks.
- ``build``: compile every kernel variant the tile table can select, for each
  listed GPU architecture, with NVRTC (no GPU needed).
- ``check``: run the correctness checks on this machine's GPU.
"""

from __future__ import annotations

import importlib
import sys

_SUBCOMMANDS = {
    "info": ("cupy_piecewise.info", "versions, GPU / NVRTC found or not, tile sizes in use"),
    "build": ("cupy_piecewise.build_check", "compile every kernel variant with NVRTC (no GPU needed)"),
    "check": ("cupy_piecewise.check", "check the kernels against the reference on this GPU"),
}


def _usage() -> str:
    lines = ["usage: python -m cupy_piecewise SUBCOMMAND [ARGS]", "", "subcommands:"]
    lines += [f"  {name:<6} {help_}" for name, (_, help_) in _SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _SUBCOMMANDS:
        print(f"unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = _SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # a missing dependency inside the module: show it as it is
        print(f"'{name}' is not available: module {module_name} is not part of this installation", file=sys.stderr)
        return 2
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
