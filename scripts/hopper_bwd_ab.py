#!/usr/bin/env python3
"""Same-machine A/B of compile-time variants of the Hopper backward (kernels_cu/sm90/backward.cu).

    PYTHONPATH=$PWD python3 scripts/hopper_bwd_ab.py --out $OUT/ab \\
        --variants "PW90_BWD_DQ_WRITER=1;PW90_BWD_STAGES=3" --rounds 2

For the default build and each variant (its macros as -D options, variants separated by ';'):
one run of scripts/hopper_bwd_probe.py's build and check phases (the 104 reference checks),
then ``--rounds`` timing runs (``--phases time --ours-only``: the prototype's fused backward,
forward+backward and dK/dV-only build; bf16, L 2048 and 8192, D 64 and 128, causal or not),
interleaved build by build so that drift over the call falls on every build alike. Prints and
writes (``--out``/summary.md) per build the median backward time of each cell over the rounds
with its spread, and the speed ratio default / variant; every probe's output is kept under
``--out``. The ratios are only as good as the spreads: the default's own cells moved by up
to 8% between runs of one call on an H200 (bench/results/2026-12-02-h200-hopper-bwd-dq-variants).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(HERE, "hopper_bwd_probe.py")
TIME_LINE = re.compile(r"TIME L=(\d+) D=(\d+) causal=(\d) \| (.+?)\s*\| (\w+)\s*\|\s+([\d.]+) ms")
CHECK_LINE = re.compile(r"check done in this worker: (\d+) pass, (\d+) fail")


def parse_times(text: str) -> dict:
    """{(L, D, causal, provider, phase): ms} from a probe's TIME lines (errors skipped)."""
    out = {}
    for m in TIME_LINE.finditer(text):
        out[(int(m[1]), int(m[2]), m[3] == "1", m[4].strip(), m[5])] = float(m[6])
    return out


def parse_checks(text: str) -> tuple[int, int] | None:
    """(passed, failed) summed over the check workers' lines, or None without any."""
    found = CHECK_LINE.findall(text)
    if not found:
        return None
    return sum(int(p) for p, _ in found), sum(int(f) for _, f in found)


def _cell(key) -> str:
    L, D, causal = key
    return f"L{L // 1024}k D{D}{'c' if causal else ''}"


def summary(builds: list[str], runs: dict, checks: dict, provider="pw90 fused", phase="bwd") -> str:
    """Markdown: median ms (spread %) per build and cell over its rounds, then speed ratios
    (default time / variant time) against builds[0]. ``runs[build]``: a list of parse_times
    dicts, one per round; ``checks[build]``: parse_checks of its check run."""
    cells = sorted({k[:3] for b in builds for r in runs.get(b, []) for k in r
                    if k[3] == provider and k[4] == phase})
    if not cells:
        ck = ", ".join(f"{b}: {f'{c[0]} pass, {c[1]} fail' if c else 'not run'}"
                       for b, c in ((b, checks.get(b)) for b in builds))
        return f"{provider}, {phase}: no timings parsed (see the probe outputs); checks: {ck}"
    med, lines = {}, []
    head = "| build | check | " + " | ".join(_cell(c) for c in cells) + " |"
    lines += [f"{provider}, {phase}: median ms over the rounds (spread = (max - min) / median)", "",
              head, "| --- | --- |" + " --- |" * len(cells)]
    for b in builds:
        row = []
        for c in cells:
            vals = [r[c + (provider, phase)] for r in runs.get(b, []) if c + (provider, phase) in r]
            if not vals:
                row.append("-")
                continue
            m = statistics.median(vals)
            med[(b, c)] = m
            row.append(f"{m:.3f} ({100 * (max(vals) - min(vals)) / m:.1f}%, n={len(vals)})")
        ck = checks.get(b)
        lines.append(f"| {b} | {f'{ck[0]} pass, {ck[1]} fail' if ck else 'not run'} | " + " | ".join(row) + " |")
    lines += ["", f"speed ratio against {builds[0]} (its median time / the variant's):", "",
              "| build | " + " | ".join(_cell(c) for c in cells) + " |", "| --- |" + " --- |" * len(cells)]
    for b in builds[1:]:
        lines.append(f"| {b} | " + " | ".join(
            f"{med[(builds[0], c)] / med[(b, c)]:.3f}" if (builds[0], c) in med and (b, c) in med else "-"
            for c in cells) + " |")
    return "\n".join(lines)


def _tag(build: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", build).strip("_")[:60] or "default"


def _run(args: list[str], path: str, timeout: float) -> str:
    t = time.time()
    try:
        p = subprocess.run([sys.executable, PROBE] + args, capture_output=True, text=True, timeout=timeout)
        text = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += f"\n[timed out after {timeout:.0f} s]"
    with open(path, "w") as f:
        f.write(text)
    print(f"  {' '.join(args)[:100]}: {time.time() - t:.0f} s", flush=True)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", required=True,
                    help="';'-separated builds, each space-separated macros, e.g. 'PW90_BWD_DQ_WRITER=1'")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="hopper_bwd_ab")
    ap.add_argument("--no-check", action="store_true", help="skip the build/check runs (timing only)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per probe run")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    builds = ["default"] + [v.strip() for v in args.variants.split(";") if v.strip()]
    opts = {b: [] if b == "default" else [f"--opt=-D{m}" for m in b.split()] for b in builds}
    os.makedirs(args.out, exist_ok=True)
    checks, runs = {}, {b: [] for b in builds}
    if not args.no_check:
        print("check runs", flush=True)
        for b in builds:
            text = _run(["--phases", "build,check"] + opts[b], os.path.join(args.out, f"check_{_tag(b)}.txt"),
                        args.timeout)
            checks[b] = parse_checks(text)
    for r in range(args.rounds):
        print(f"round {r + 1}", flush=True)
        for b in builds:
            text = _run(["--phases", "time", "--ours-only"] + opts[b],
                        os.path.join(args.out, f"time_{_tag(b)}_r{r + 1}.txt"), args.timeout)
            runs[b].append(parse_times(text))
    text = "\n\n".join(summary(builds, runs, checks, phase=ph) for ph in ("bwd", "fwd_bwd"))
    print(text)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(f"hopper_bwd_ab {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv[1:])}\n\n{text}\n")
    bad = [b for b in builds if checks.get(b) and checks[b][1]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
