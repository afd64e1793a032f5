"""Reporting: ratios between providers, the markdown tables (results.md), the stdout summary,
merging several results.json files and the plots (bench/plot.py)."""
from __future__ import annotations

import json
import os

from common import PROVIDERS, RATIO_PROVIDERS, _err_text, _f

#: Optional summary columns: (provider, short label), shown when the run has rows of it.
SUMMARY_EXTRA = (("piecewise_mma", "mma"), ("flex_composite", "flex"), ("sdpa_efficient", "eff"),
                 ("flag_attn", "flag"))


def annotate_ratios(rows):
    """ratio_vs_<ref> = tflops / tflops(ref) on the same shape and phase (> 1: faster than ref), for
    every ref in RATIO_PROVIDERS (SDPA flash and cuDNN, flex_composite, piecewise_mma, flag_attn)."""
    def key(r):
        return (r["dtype"], r["B"], r["H"], r["M"], r["N"], r["D"], r["causal"], r["phase"])
    ref = {}
    for r in rows:
        if r["provider"] in RATIO_PROVIDERS and r.get("status") == "ok" and r.get("ms"):
            ref[(r["provider"],) + key(r)] = r["ms"]
    for r in rows:
        for p in RATIO_PROVIDERS:
            m = ref.get((p,) + key(r))
            r[f"ratio_vs_{p}"] = (m / r["ms"]) if (m and r.get("status") == "ok" and r.get("ms")) else None


def _cell(r, value_key="tflops", nd=1):
    if r is None:
        return ""
    st = r.get("status")
    if st == "ok":
        x = r.get(value_key)
        if x is not None and 0 < abs(x) < 10 ** -nd * 10:  # tiny dry-run numbers: keep 2 significant digits
            return f"{x:.2g}"
        return _f(x, nd)
    err = r.get("error") or ""
    if st == "not installed":
        return "n/i"
    if st == "skipped":
        if "memory" in err:
            return "skip:mem"
        if "budget" in err:
            return "skip:time"
        return "skip"
    return "err"


def _table(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def _configs(rows):
    seen = []
    for r in rows:
        k = (r["dtype"], r["D"], r["causal"])
        if k not in seen:
            seen.append(k)
    return seen


def _ours(rows):
    """The provider the tables call "ours": piecewise (the default path) when the run has it,
    else piecewise_mma (a run of the forced mma.sync path alone, issue 15's table)."""
    present = {r["provider"] for r in rows}
    return "piecewise" if "piecewise" in present or "piecewise_mma" not in present else "piecewise_mma"


def _extras(rows):
    present, ours = {r["provider"] for r in rows}, _ours(rows)
    return [(p, lbl) for p, lbl in SUMMARY_EXTRA if p in present and p != ours]


def render_summary(res):
    """Compact table: one line per shape (what the lead reads at the end of stdout). Columns for
    piecewise_mma, flex_composite, sdpa_efficient and flag_attn (and ours/their ratios) appear when
    the run has them; "ours" is piecewise_mma when the run has no piecewise rows (:func:`_ours`)."""
    rows = res["main"]
    idx = {(r["dtype"], r["D"], r["causal"], r["L"], r["provider"], r["phase"]): r for r in rows}
    shapes = []
    for r in rows:
        k = (r["dtype"], r["D"], r["causal"], r["L"])
        if k not in shapes:
            shapes.append(k)
    if not shapes:
        return "(no main-sweep measurements)"
    extras, me = _extras(rows), _ours(rows)
    hdr = ["dtype", "D", "causal", "L", "ours fwd", "ours bwd", "ours f+b"]
    for _, lbl in extras:
        hdr += [f"{lbl} fwd", f"{lbl} f+b"]
    hdr += ["flash fwd", "flash f+b", "cudnn fwd", "cudnn f+b", "ours/flash fwd", "ours/flash f+b",
            "ours/cudnn fwd", "ours/cudnn f+b"]
    for _, lbl in extras:
        hdr += [f"ours/{lbl} fwd", f"ours/{lbl} f+b"]
    out = []
    for (dt, D, c, L) in shapes:
        g = lambda p, ph: idx.get((dt, D, c, L, p, ph))  # noqa: E731
        ours_f, ours_fb = g(me, "fwd"), g(me, "fwd_bwd")
        line = [dt, D, "yes" if c else "no", L,
                _cell(ours_f), _cell(g(me, "bwd")), _cell(ours_fb)]
        for p, _ in extras:
            line += [_cell(g(p, "fwd")), _cell(g(p, "fwd_bwd"))]
        line += [_cell(g("sdpa_flash", "fwd")), _cell(g("sdpa_flash", "fwd_bwd")),
                 _cell(g("sdpa_cudnn", "fwd")), _cell(g("sdpa_cudnn", "fwd_bwd")),
                 _f((ours_f or {}).get("ratio_vs_sdpa_flash"), 2),
                 _f((ours_fb or {}).get("ratio_vs_sdpa_flash"), 2),
                 _f((ours_f or {}).get("ratio_vs_sdpa_cudnn"), 2),
                 _f((ours_fb or {}).get("ratio_vs_sdpa_cudnn"), 2)]
        for p, _ in extras:
            line += [_f((ours_f or {}).get(f"ratio_vs_{p}"), 2), _f((ours_fb or {}).get(f"ratio_vs_{p}"), 2)]
        out.append(line)
    note = "" if me == "piecewise" else f"(ours = {me}: the run has no piecewise rows)\n\n"
    return note + _table(hdr, out)


def render_wsweep(res):
    if not res["w_sweep"]:
        return "(w sweep not run)"
    r0 = res["w_sweep"][0]
    ws = []
    for r in res["w_sweep"]:
        if r["w"] not in ws:
            ws.append(r["w"])
    hdr = ["causal", "phase"] + [f"w={w} ms (TFLOP/s)" for w in ws] + ["mean ms", "max dev from mean %"]
    out = []
    for s in res["w_sweep_summary"]:
        cells = []
        for w in ws:
            r = next((x for x in res["w_sweep"] if x["w"] == w and x["causal"] == s["causal"]
                      and x["phase"] == s["phase"]), None)
            cells.append(f"{_f(r['ms'], 3)} ({_f(r['tflops'], 1)})" if r and r["status"] == "ok" else _cell(r))
        out.append(["yes" if s["causal"] else "no", s["phase"]] + cells + [_f(s["mean_ms"], 3), _f(s["max_dev_pct"], 1)])
    title = (f"piecewise, {r0['dtype']}, L={r0['L']}, D={r0['D']}, B={r0['B']}, H={r0['H']}; "
             f"max deviation = max over w of |ms - mean| / mean")
    return title + "\n\n" + _table(hdr, out)


def render_decode(res):
    if not res["decode"]:
        return "(decode section not run)"
    cb = res.get("copy_bandwidth") or {}
    provs = []
    for r in res["decode"]:
        if r["provider"] not in provs:
            provs.append(r["provider"])
    idx = {(r["M"], r["N"], r["H"], r["provider"]): r for r in res["decode"]}
    cases = []
    for r in res["decode"]:
        k = (r["M"], r["N"], r["H"])
        if k not in cases:
            cases.append(k)
    hdr = ["M", "N", "B*H"] + [f"{p} GB/s (% copy)" for p in provs] + ["ours us"]
    out = []
    for (M, N, BH) in cases:
        cells = []
        for p in provs:
            r = idx.get((M, N, BH, p))
            if r and r["status"] == "ok":
                pct = f" ({_f(r['pct_of_copy_bw'], 0)}%)" if r.get("pct_of_copy_bw") is not None else ""
                cells.append(_f(r["gbps"], 0) + pct)
            else:
                cells.append(_cell(r))
        ours = idx.get((M, N, BH, "piecewise"))
        us = _f(ours["ms"] * 1e3, 1) if ours and ours.get("ms") else "-"
        out.append([M, N, BH] + cells + [us])
    d0 = res["decode"][0]
    head = (f"{d0['dtype']}, D={d0['D']}, B=1, not causal, w=N/4; bytes = (one of k1/k2 + v) per key + queries + o; "
            f"device copy bandwidth {_f(cb.get('gbps'), 0)} GB/s ({cb.get('method', cb.get('error', ''))})")
    return head + "\n\n" + _table(hdr, out)


def render_memory(res):
    if not res["memory"]:
        return "(memory section not run)"
    provs = []
    for r in res["memory"]:
        if r["provider"] not in provs:
            provs.append(r["provider"])
    Ls = []
    for r in res["memory"]:
        if r["L"] not in Ls:
            Ls.append(r["L"])
    idx = {(r["L"], r["provider"]): r for r in res["memory"]}
    hdr = ["L", "B", "H"] + [f"{p} peak GB (extra GB)" for p in provs]
    out = []
    for L in Ls:
        any_r = next(r for r in res["memory"] if r["L"] == L)
        cells = []
        for p in provs:
            r = idx.get((L, p))
            if r and r["status"] == "ok" and r.get("peak_bytes") is not None:
                cells.append(f"{r['peak_bytes'] / 1e9:.2f} ({r['extra_bytes'] / 1e9:.2f})")
            elif r and r["status"] == "ok":
                cells.append("n/a (cpu)")
            else:
                cells.append(_cell(r))
        out.append([L, any_r["B"], any_r["H"]] + cells)
    r0 = res["memory"][0]
    head = (f"forward+backward, {r0['dtype']}, D={r0['D']}, not causal, w=L/4. peak = "
            f"torch.cuda.max_memory_allocated after reset_peak_memory_stats (inputs and do included); "
            f"extra = peak minus memory allocated before the call")
    return head + "\n\n" + _table(hdr, out)


def render_main_detail(res):
    rows = res["main"]
    if not rows:
        return "(main sweep not run)"
    provs = sorted({r["provider"] for r in rows}, key=lambda p: PROVIDERS.index(p) if p in PROVIDERS else 99)
    idx = {(r["dtype"], r["D"], r["causal"], r["L"], r["provider"], r["phase"]): r for r in rows}
    parts = []
    for (dt, D, c) in _configs(rows):
        Ls, phases = [], []
        for r in rows:
            if (r["dtype"], r["D"], r["causal"]) == (dt, D, c):
                if r["L"] not in Ls:
                    Ls.append(r["L"])
                if r["phase"] not in phases:
                    phases.append(r["phase"])
        extras = _extras(rows)
        hdr = (["L", "B x H", "phase"] + provs + ["ours/flash", "ours/cudnn"]
               + [f"ours/{lbl}" for _, lbl in extras] + ["ours ms"])
        out = []
        for L in Ls:
            for ph in phases:
                cells = [_cell(idx.get((dt, D, c, L, p, ph))) for p in provs]
                ours = idx.get((dt, D, c, L, _ours(rows), ph)) or {}
                any_r = next(r for r in rows if (r["dtype"], r["D"], r["causal"], r["L"]) == (dt, D, c, L))
                out.append([L, f"{any_r['B']} x {any_r['H']}", ph] + cells +
                           [_f(ours.get("ratio_vs_sdpa_flash"), 2), _f(ours.get("ratio_vs_sdpa_cudnn"), 2)] +
                           [_f(ours.get(f"ratio_vs_{p}"), 2) for p, _ in extras] +
                           [_f(ours.get("ms"), 3)])
        parts.append(f"#### {dt}, D={D}, {'causal' if c else 'not causal'} (TFLOP/s; w = L/4)\n\n" + _table(hdr, out))
    return "\n\n".join(parts)


def _vs_ours_text(r, nd=5):
    vs = r.get("vs_ours") or {}
    return ", ".join(f"{p} {v if isinstance(v, str) else _f(v, nd)}" for p, v in vs.items())


def render_checks(res):
    if not res["spot_checks"]:
        return "(no spot checks)"
    others = any(r.get("vs_ours") for r in res["spot_checks"])
    hdr = ["dtype", "D", "causal", "L", "max|ours - sdpa| (w=N)", "reference", "max|ref|",
           "max|ours - fp32 plain| (w=L/4, slice)"] + (["max|other - ours| (w=L/4)"] if others else []) + ["status"]
    out = []
    for r in res["spot_checks"]:
        out.append([r["dtype"], r["D"], "yes" if r["causal"] else "no", r["L"],
                    _f(r.get("max_abs_diff_vs_sdpa"), 5), r.get("reference", "-"), _f(r.get("ref_max_abs"), 3),
                    _f(r.get("max_abs_diff_vs_plain_fp32"), 5)] + ([_vs_ours_text(r)[:200] or "-"] if others else []) +
                   [r["status"] + (f": {r['error'][:80]}" if r.get("error") else "")])
    return _table(hdr, out)


def render_errors(res):
    msgs = {}
    for sec in ("main", "w_sweep", "decode", "memory", "spot_checks"):
        for r in res.get(sec) or []:
            if r.get("status") in ("error", "skipped", "not installed") and r.get("error"):
                k = (sec, r.get("provider", "piecewise"), r["error"][:300])
                msgs[k] = msgs.get(k, 0) + 1
    if not msgs:
        return "none"
    return "\n".join(f"- [{sec}] {p} (x{n}): {m}" for (sec, p, m), n in msgs.items())


def render_header(res):
    h = res["header"]
    return "\n".join([
        f"- date: {h['date_utc']}",
        f"- GPU: {h['gpu']}",
        f"- torch {h['torch']}, cupy {h['cupy']}, triton {h['triton']}, numpy {h['numpy']}, CUDA {h['cuda_runtime']}",
        f"- command: `{h['command']}`",
        f"- git commit: {h.get('git_commit')}",
        *[f"- {n}: {o}" for n, o in (h.get("provider_origins") or {}).items()],
        f"- timer: {h['timer']}",
        f"- phases: {h['phases_note']}",
        f"- FLOPs: {h['flop_convention']}",
        f"- elapsed: {h.get('elapsed_s')} s" + ("  **DRY RUN: tiny CPU sizes, numbers mean nothing**" if h["dry_run"] else ""),
    ])


LEGEND = ("Cells: TFLOP/s (effective, FlashAttention's FLOP count). `n/i` not installed, `skip:mem` plain PyTorch would "
          "need too much memory, `skip:time` time budget spent, `err` the provider failed (see Errors). "
          "ours/flash, ours/cudnn = time of SDPA / time of ours on the same shape and phase (> 1: ours faster); "
          "ours/flex, ours/mma, ours/eff, ours/flag likewise against flex_composite, piecewise_mma, "
          "sdpa_efficient and flag_attn, where those ran. \"ours\" is piecewise, or piecewise_mma in a "
          "run without piecewise.")


def render_markdown(res):
    return "\n\n".join([
        "# cupy-piecewise benchmark results",
        render_header(res),
        LEGEND,
        "## Summary (TFLOP/s)",
        render_summary(res),
        "## Main sweep, all providers",
        render_main_detail(res),
        "## Spot checks",
        render_checks(res),
        "## w sweep",
        render_wsweep(res),
        "## Decode",
        render_decode(res),
        "## Peak memory",
        render_memory(res),
        "## Plots",
        "\n".join(f"- {os.path.basename(p)}" for p in res.get("plots") or []) or "(none)",
        "## Errors and skips",
        render_errors(res),
        "## Notes",
        "\n".join(f"- {n}" for n in res.get("notes") or []) or "none",
    ]) + "\n"


def render_checks_line(res):
    cs = res.get("spot_checks") or []
    ok = [c for c in cs if c.get("status") == "ok"]
    if not cs:
        return "spot checks: none"
    line = f"spot checks: {len(ok)}/{len(cs)} ran"
    for key, label in (("max_abs_diff_vs_sdpa", "max|ours - sdpa| (w=N)"),
                       ("max_abs_diff_vs_plain_fp32", "max|ours - fp32 plain| (w=L/4)")):
        vals = [c for c in ok if c.get(key) is not None]
        if vals:
            worst = max(vals, key=lambda c: c[key])
            line += (f"; {label} = {worst[key]:.3g} at {worst['dtype']} D={worst['D']} "
                     f"causal={worst['causal']} L={worst['L']}")
    worst_other = {}
    for c in ok:
        for p, v in (c.get("vs_ours") or {}).items():
            if isinstance(v, str):
                worst_other.setdefault(p, v[:80])
            elif not isinstance(worst_other.get(p), str) and v > worst_other.get(p, -1.0):
                worst_other[p] = v
    for p, v in worst_other.items():
        line += f"; max|{p} - ours| (w=L/4) = " + (v if isinstance(v, str) else f"{v:.3g}")
    bad = [c for c in cs if c.get("status") != "ok"]
    if bad:
        line += f"; not run: {bad[0].get('error', '')[:160]}"
    return line


def render_stdout(res, out_dir):
    """Most important last: the caller reads the tail of stdout."""
    h = res["header"]
    return "\n\n".join([
        "Errors and skips:",
        render_errors(res)[:2500],
        "w sweep:",
        render_wsweep(res),
        "Decode:",
        render_decode(res),
        "Peak memory:",
        render_memory(res),
        f"=== cupy-piecewise bench: {h['date_utc']} | {h['gpu']} | torch {h['torch']} cupy {h['cupy']} "
        f"triton {h['triton']} | {h.get('elapsed_s')} s ===\ncommand: {h['command']}\n" + render_checks_line(res),
        "Summary (TFLOP/s; ratio = SDPA time / ours, > 1: ours faster):",
        render_summary(res),
        f"Full tables: {os.path.join(out_dir, 'results.md')}; data: {os.path.join(out_dir, 'results.json')}; "
        f"plots: {len(res.get('plots') or [])} PNG",
    ])


def merge_results(paths):
    """Concatenate the measurement lists of several results.json files (header of the first,
    with every command kept)."""
    merged = None
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        if merged is None:
            merged = r
            merged["header"]["commands"] = [r["header"].get("command")]
            continue
        merged["header"]["commands"].append(r["header"].get("command"))
        for k in ("main", "spot_checks", "w_sweep", "w_sweep_summary", "decode", "memory", "notes"):
            merged[k] = (merged.get(k) or []) + (r.get(k) or [])
        if not merged.get("copy_bandwidth"):
            merged["copy_bandwidth"] = r.get("copy_bandwidth")
    if len(paths) > 1:
        merged["header"]["command"] = " ; ".join(str(c) for c in merged["header"]["commands"])
    annotate_ratios(merged["main"])
    return merged


def make_plots(res, out_dir):
    try:
        import plot as _plot
    except Exception:
        try:
            from bench import plot as _plot
        except Exception as e:
            res["notes"].append(f"plots skipped: cannot import bench/plot.py ({_err_text(e)})")
            return []
    try:
        return _plot.plot_main(res, out_dir)
    except ImportError as e:
        res["notes"].append(f"plots skipped: {e}")
        return []
    except Exception as e:
        res["notes"].append(f"plots failed: {_err_text(e)}")
        return []


