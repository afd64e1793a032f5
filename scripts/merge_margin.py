"""How close test_merge_of_complementary_key_ranges runs to its bounds, per gradient, over
a list of seeds: the worst max|impl-ref| / bound of each output (and the relative error
over its bound), so that a build A/B (PW_TEST_MACROS) compares margins on the same inputs
rather than one pass/fail draw. GPU only; run from the repository root:

    PYTHONPATH=$PWD CUPY_PIECEWISE_PATH=mma python3 scripts/merge_margin.py --seeds 1-24 \\
        --dims 64 --causal 1 [--extra-seed 6361391436627382716]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def parse_seeds(text: str) -> list[int]:
    """'1-24' or '3,9,12' (or both, comma-separated) as a list of ints."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
        except ValueError:
            raise ValueError(f"--seeds: {part!r} is not N or N-M") from None
    return out


def summarise(rows: list[dict]) -> tuple[dict, dict]:
    """Each output's largest and mean ratio to its bound, over the rows that compared it (a
    failing case stops at its first failed compare, so its later outputs are missing)."""
    names = sorted({n for r in rows for n in r["ratios"]})
    have = {n: [r["ratios"][n] for r in rows if n in r["ratios"]] for n in names}
    return ({n: round(max(v), 4) for n, v in have.items()},
            {n: round(sum(v) / len(v), 4) for n, v in have.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1-24")
    ap.add_argument("--extra-seed", type=int, action="append", default=[])
    ap.add_argument("--dims", default="64")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import pytest

    from cupy_piecewise import tolerance

    import test_kernels_gpu as t

    seen: list = []
    real = tolerance.compare

    def spy(name, got, ref, low, kind):
        v = real(name, got, ref, low, kind)
        if v.bound and v.max_err > v.bound:  # where the worst element lies, and its yardstick
            import numpy as np
            g, r, lw = (np.asarray(x, np.float64) for x in (got, ref, low))
            i = np.unravel_index(int(np.argmax(np.abs(g - r))), g.shape)
            print(f"  {name} over its bound at {tuple(map(int, i))} of {g.shape}: impl {g[i]:.6g} "
                  f"ref {r[i]:.6g} low {lw[i]:.6g}; max|low-ref| {np.abs(lw - r).max():.4g} "
                  f"at {tuple(map(int, np.unravel_index(int(np.argmax(np.abs(lw - r))), g.shape)))}; "
                  f"|ref| max {np.abs(r).max():.4g}", flush=True)
        seen.append((name, v.max_err / v.bound if v.bound else 0.0,
                     v.rel_err / v.rel_bound if v.rel_bound else 0.0, v.passed))
        return v

    t.tolerance.compare = spy
    rows = []
    for seed in args.extra_seed + parse_seeds(args.seeds):
        os.environ["PW_TEST_SEED"] = str(seed)
        for d in map(int, args.dims.split(",")):
            for c in map(int, args.causal.split(",")):
                seen.clear()
                try:
                    t.test_merge_of_complementary_key_ranges("mma", bool(c), d)
                    ok = True
                except AssertionError:  # a failed compare (the test stops at the first)
                    ok = False
                except pytest.skip.Exception as e:  # no GPU, no torch: nothing to replay
                    print(f"skipped: {e}")
                    return 2
                rows.append(dict(seed=seed, D=d, causal=c, passed=ok,
                                 ratios={n: round(r, 4) for n, r, _, _ in seen},
                                 rel={n: round(r, 4) for n, _, r, _ in seen}))
                if not seen:
                    print(f"seed {seed} D {d} causal {c}: FAIL before any compare", flush=True)
                    continue
                worst = max(seen, key=lambda x: x[1])
                dk1 = dict((n, r) for n, r, _, _ in seen).get("dk1", float("nan"))
                print(f"seed {seed} D {d} causal {c}: {'pass' if ok else 'FAIL'}; worst "
                      f"{worst[0]} {worst[1]:.3f} of its bound; dk1 {dk1:.3f}", flush=True)
    fails = sum(not r["passed"] for r in rows)
    summary, means = summarise(rows)
    print(f"macros {os.environ.get('PW_TEST_MACROS', '')!r}: {fails} of {len(rows)} failed; "
          f"max ratio {summary}; mean ratio {means}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(macros=os.environ.get("PW_TEST_MACROS", ""), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
