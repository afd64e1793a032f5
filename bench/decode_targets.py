"""Issue 13's three decode targets, per shape, from a ``bench/kvcache_decode.py --out`` JSON.

    python3 bench/decode_targets.py RESULTS.json [--paged 64]

Per (dtype, D, B, H, Hkv, N) row, for the contiguous Hopper decode (``piecewise_kvcache``):

- its share of the run's device copy bandwidth, and whether it reaches 90% where the target
  applies (B·H >= 32 and N >= 32768; "-" elsewhere);
- its effective bandwidth over SDPA cuDNN's on the same shape, same run (target >= 1.0);
- the paged form's over the contiguous one's (``piecewise_kvcache_paged<bs>``, target >= 0.95
  at block size >= 64).

Then how many rows meet each target, and the shortfall of the worst row. Effective bytes are
the bench's (one key projection plus v per cached key, the queries, the output)."""

from __future__ import annotations

import argparse
import json
import sys

COPY_SHARE, VS_CUDNN, PAGED = 0.90, 1.0, 0.95


def rows_of(results: dict, paged: int) -> list[dict]:
    """One dict per shape: the contiguous row's figures and the paged row's ratio."""
    by_shape: dict = {}
    for r in results["decode"]:
        key = (r["dtype"], r["D"], r["B"], r["H"], r["Hkv"], r["N"])
        by_shape.setdefault(key, {})[r["provider"]] = r
    out = []
    for (dtype, D, B, H, Hkv, N), prov in by_shape.items():
        ours = prov.get("piecewise_kvcache")
        if ours is None or not ours.get("gbps"):
            continue
        pg = prov.get(f"piecewise_kvcache_paged{paged}")
        share = ours["pct_of_copy_bw" if "pct_of_copy_bw" in ours else "pct_of_copy"] / 100
        out.append(dict(dtype=dtype, D=D, B=B, H=H, Hkv=Hkv, N=N, gbps=ours["gbps"],
                        share=share, copy_applies=B * H >= 32 and N >= 32768,
                        vs_cudnn=ours.get("vs_cudnn"),
                        paged=pg["vs_contiguous"] if pg and pg.get("gbps") else None))
    return out


def table(rows: list[dict], paged: int) -> str:
    """Markdown: a line per shape, then the counts."""
    yes = lambda ok: "met" if ok else "missed"  # noqa: E731
    lines = [f"| dtype | D | B | H/Hkv | N | GB/s | % of copy (>= 90) | x cuDNN (>= 1.0) "
             f"| paged{paged} / contiguous (>= {PAGED}) |", "|" + "---|" * 9]
    for r in rows:
        copy = (f"{100 * r['share']:.1f} {yes(r['share'] >= COPY_SHARE)}" if r["copy_applies"]
                else f"{100 * r['share']:.1f} -")
        cudnn = f"{r['vs_cudnn']:.3f} {yes(r['vs_cudnn'] >= VS_CUDNN)}" if r["vs_cudnn"] else "-"
        pg = f"{r['paged']:.3f} {yes(r['paged'] >= PAGED)}" if r["paged"] else "-"
        lines.append(f"| {r['dtype']} | {r['D']} | {r['B']} | {r['H']}/{r['Hkv']} | {r['N']} "
                     f"| {r['gbps']:.0f} | {copy} | {cudnn} | {pg} |")
    lines.append("")
    for name, key, thr, applies in (
            ("% of copy >= 90", "share", COPY_SHARE, lambda r: r["copy_applies"]),
            ("x cuDNN >= 1.0", "vs_cudnn", VS_CUDNN, lambda r: r["vs_cudnn"] is not None),
            (f"paged{paged} >= {PAGED}", "paged", PAGED, lambda r: r["paged"] is not None)):
        sel = [r[key] for r in rows if applies(r)]
        if sel:
            met = sum(v >= thr for v in sel)
            lines.append(f"- {name}: met on {met} of {len(sel)} rows; range "
                         f"{min(sel):.3f}-{max(sel):.3f}"
                         + (f", worst {100 * (1 - min(sel) / thr):.1f}% short" if met < len(sel)
                            else ""))
    return "\n".join(lines)


def side_by_side(first: dict, second: dict, names: tuple[str, str], paged: int = 64) -> str:
    """Two decode tables of one machine (``kvcache_decode.py --paged <paged> --out`` JSONs,
    e.g. two builds a few minutes apart) as one markdown table, row by row: each build's
    contiguous decode over SDPA cuDNN's of its own run, each one's paged over contiguous, the
    second's bandwidth over the first's (contiguous and paged) and cuDNN's own second over
    first, which shows the drift between the runs."""
    def gbps(results):
        return {(r["dtype"], r["D"], r["B"], r["Hkv"], r["N"], r["provider"]): r["gbps"]
                for r in results["decode"] if r.get("status", "ok") == "ok" and r.get("gbps")}

    a, b = gbps(first), gbps(second)
    n1, n2 = names
    lines = [f"| dtype | D | B | Hkv | N | {n1} x cuDNN | {n2} x cuDNN | {n1} paged{paged}/contig "
             f"| {n2} paged{paged}/contig | contig {n2}/{n1} | paged {n2}/{n1} | cuDNN run2/run1 |",
             "|" + "---|" * 12]
    for k in sorted({k[:5] for k in a}):
        c, p, cu = (k + ("piecewise_kvcache",), k + (f"piecewise_kvcache_paged{paged}",),
                    k + ("sdpa_cudnn",))
        lines.append(f"| {' | '.join(map(str, k))} | {a[c] / a[cu]:.3f} | {b[c] / b[cu]:.3f} "
                     f"| {a[p] / a[c]:.3f} | {b[p] / b[c]:.3f} | {b[c] / a[c]:.3f} "
                     f"| {b[p] / a[p]:.3f} | {b[cu] / a[cu]:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="bench/kvcache_decode.py --out JSON")
    ap.add_argument("--paged", type=int, default=64, help="block size of the paged rows to judge")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    h = results.get("header", {})
    print(f"{h.get('gpu', '?')}, {h.get('date', '?')}: `{h.get('command', '?')}`; device copy "
          f"{results['copy_bandwidth']['gbps']:.0f} GB/s\n")
    print(table(rows_of(results, args.paged), args.paged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
