#!/usr/bin/env bash
# One call on a GPU machine: GPU tests, sanitizers, the check command, host overhead, a
# benchmark and the GPU fuzzer; logs and results to OUTDIR (logs.tgz, bench.tgz, overhead.json).
#   PYTHONPATH=$PWD bash scripts/gpu_run.sh OUTDIR [tests sanitize cold soak check overhead bench fuzz probes mma_probes mma_bench bitwise ncu ncu_mma ncu_grid ncu_grid64 ncu_fwd grid_order ncu_decode fwd_ab bwd_w mma_checks fwd_d64 kvprobe kvrot tilebox rowbox gqa gqa_ncu grid_reload grid_reload_bench one_barrier one_barrier_ab grid_barrier_ab rotary | all]
# sanitize: memcheck, racecheck, synccheck and initcheck over every selectable variant;
# cold: first-call figures before and after `build --install` (scripts/cold_start.py);
# soak: scripts/soak.py (SOAK_ARGS, e.g. --quick), figures in soak.json.
# probes (not in all): the Hopper forward and backward probes (scripts/hopper_probe.py,
# scripts/hopper_bwd_probe.py), about 4 minutes each, logs in logs/hopper_*.txt.
# rotary (not in all): the rotary-inside KV-cache kernels' first validation: their GPU tests
# and GPU fuzz (FUZZ_EXAMPLES, default 120: 60 rotary examples), memcheck, racecheck and synccheck on
# their sanitizer cases (SANITIZE_SKIP leaves the rest out), and the decode bench's quick
# shapes with --rotary; about 5-6 min.
# kvprobe (not in all): scripts/kvdecode_probe.py, the Hopper decode's A/B probe, configs from
# KVPROBE_CONFIGS (default "base;PW_COMBINE_PREFETCH=0;m=16;m=128": the split merge's earlier
# form, bench/results/2026-12-05-h100-combine-prefetch, and split counts), about 1-2 minutes
# per macro set.
# kvrot (not in all): the staged rotary decode (table rows in shared memory: the kernel's TAB,
# kernels_cu/sm90/kvdecode.cu; every rotary form with -DKV90_ROT_STAGE=1, or by name where the
# decode does not split with capability.KV90_ROT_STAGE_UNSPLIT, the probe's rsu=1): its rotary
# GPU tests and racecheck + synccheck on the rotary sanitizer cases under the macro, then
# scripts/kvdecode_probe.py, ReRoPE (rot=1) and SelfExtend (rot=8) against rsu=1 (first run:
# bench/results/2026-12-06-h100-mma-d64-decode-ncu/kvrot); about 5-7 minutes, logs in logs/kvrot_*.
# rowbox (not in all): the decode's box forms (kernels_cu/sm90/kvdecode.cu KV90_ROW_BOX; the
# default since 2026-12-06 is 2, whole rows without a cluster): KV-cache GPU tests and
# memcheck/racecheck/synccheck on the KV-cache cases under ROWBOX_MACRO (default "": the
# default build), the probe of ROWBOX_PROBE (default "base;KV90_ROW_BOX=0;KV90_ROW_BOX=1;m=8";
# "" for none), then the decode table of each "tag=macros" in ROWBOX_TABLES (default
# "default=;halfrow=KV90_ROW_BOX=0"; "" for none); about 3-5 minutes, logs in logs/rowbox_*
# and logs/decode_<tag>.* (first run: bench/results/2026-12-06-h200-rowbox-default, with
# ROWBOX_PROBE="").
# fwd_ab (not in all): scripts/mma_fwd_probe.py, FWDAB_VARIANTS (';'-separated macro sets,
# default ""; "" for none: the default alone, whose w = L rows beside
# w = L / 4 and SDPA flash split the L = 2048 gap into the kernel's and the piecewise work's,
# bench/results/2026-12-07-h100-fwd-w-split) against the default and a control build, with its reference
# checks, bf16 and fp16, causal and not, tiles FWDAB_TILES (default 128:128x64x4;64:128x128x4), lengths
# FWDAB_LENGTHS (2048,8192), thresholds FWDAB_W (0.25,1: w = L / 4 and w = L), FWDAB_ROUNDS
# (2); about 4 minutes, logs/fwd_ab.*.
# bwd_w (not in all): scripts/mma_bwd_ab.py of the default build (and of the ';'-separated
# macro sets of BWDW_VARIANTS, default none, e.g. PW_GRID_STASH_PLAIN=0) at w = L / 4 and
# w = L beside SDPA flash's backward (--flash), D 64/128 (BWDW_DIMS), L 2048/8192
# (BWDW_LENGTHS), bf16 and fp16, causal and not, BWDW_ROUNDS rounds (3), the default scheme
# (BWDW_MODES, default "default"): splits the mma.sync backward's gap to flash into the
# kernel's and the piecewise work's, as fwd_ab does for the forward; about 2 minutes alone
# (each variant adds about a minute), logs/bwd_w.*.
# mma_checks (not in all): the mma.sync GPU tests (dense and packed, and the forced fused and
# warp-grid one-kernel backwards) under MMA_MACRO (default "": the default build) beside
# memcheck and racecheck on the dense mma.sync D 64/128 sanitizer cases, about 4-5 minutes
# (up to 7 under a macro set: its kernels are not in the compile cache),
# logs/mma_checks_*.
# gqa_ncu (not in all): Nsight Compute (memory, warp state, scheduler, instructions, source
# counters) on the decode kernel, bfloat16 D = 128 N = 32768 (GQA_N), B = 1 with 32 key heads
# and 32 then 128 query heads, logs in logs/ncu_gqa_ncu_h*.txt; about 2 minutes.
# gqa (not in all): why the grouped-query decode row (B 4, H 32, Hkv 8) runs 2-4% below the
# MHA row of the same bytes (B 1, H 32, Hkv 32) against the same cuDNN: the probe on those two
# shapes, the same grid with one query head per key head (B 4, H 8, Hkv 8) and the MHA grid
# with four (B 1, H 128, Hkv 32), D 64 and 128, configs GQA_PROBE (default "base;pdl=0":
# the split merge with and without its programmatic launch), N = GQA_N (default 32768); then
# ncu's kernel times (decode and split merge apart, serialised) of the four shapes at D = 128
# beside cuDNN's; about 4-5 minutes, logs in logs/gqa_*.
# ROWBOX_CHECKS=0 leaves rowbox's tests and sanitizers out (a timing call).
# tilebox (not in all): the Hopper decode's whole-tile TMA boxes (TILEBOX_MACRO, default
# KV90_TILE_BOX=2: at D = 128 and for paged caches only; =1 everywhere, timed in
# bench/results/2026-12-06-h100-tilebox; an A/B build): scripts/racecheck_bulk_probe.py
# under racecheck (only with TILEBOX_BULK_PROBE=1), then the KV-cache GPU tests, the
# probe against the default, the decode table (paged 64 too) under the macro, and memcheck,
# racecheck and synccheck on the KV-cache cases under it (TILEBOX_SANITIZE=0: not); about
# 5-6 minutes, logs in logs/tilebox_*, logs/decode_tilebox.*, logs/racecheck_bulk_*.
# TILEBOX_MACRO=KV90_ROW_BOX=1 runs the same checks on the D = 128 boxes of whole rows in
# every plain form (kvdecode.cu); TILEBOX_PROBE="base;KV90_TILE_BOX=2;KV90_ROW_BOX=1" times
# both beside the default of the day in the probe (bench/results/2026-12-06-h100-rowbox; mode
# 2, the default since, in the rowbox step). A tile-box build takes no row boxes (kvdecode.cu).
# grid_reload (not in all): the D = 64 warp-grid backward's staged A/B build, Pᵀ and dSᵀ in
# two buffers (-DPW_GRID_TWO_DS=1, kernels_cu/traits.cuh: one barrier fewer per tile; fits
# sm_80/90, not sm_86/89). GRID_MACROS (default that one) for test_grid_backward_forced and the
# mma.sync D = 64 GPU cases of test_kernels_gpu.py, scripts/mma_bwd_ab.py of it and of the
# earlier default -DPW_GRID_TID_RELOAD=1 (offsets re-read every tile at D = 64 too) against the
# default (backward alone, D 64 and 128, the 128 rows a control the macros do not change),
# memcheck and racecheck on the D = 64 one-kernel backward under GRID_MACROS; about 6-8
# minutes, logs in logs/grid_reload_*. grid_reload_bench (not in all): issue 15's D = 64 table
# (bench.py, piecewise_mma beside sdpa_flash, sdpa_cudnn and flag_attn (carry .baselines),
# L 2048-16384) under GRID_MACROS, about 6 minutes, results in logs/grid_reload_bench (compare
# with the mma_bench step's D = 64 rows, or run both in one call).
# grid_barrier_ab (not in all): the backward alone (mma_bwd_ab.py) of the defaults before
# 2026-12-06 (-DPW_GRID_TID_RELOAD=1 -DPW_ONE_BARRIER=0), each of those alone, and the staged
# PW_GRID_TWO_DS=1, against the default; then the forward's two-barrier loop against the
# default (mma_fwd_probe.py, with a control build); about 5-6 minutes (first run, on an H100:
# bench/results/2026-12-06-h100-one-barrier); logs in logs/grid_barrier_*.
# one_barrier (not in all): the mma.sync GPU cases of test_kernels_gpu.py and the packed-batch
# mma cases, racecheck and synccheck on the dense mma.sync D 64/128 cases, under
# BARRIER_MACROS (default "PW_ONE_BARRIER=0 PW_FWD_WARP_SKIP=0": the two-barrier tile loop of
# kernels_cu/common.cuh pipelined_tiles that the default replaced on 2026-12-06, with the
# forward of its day, as two barriers with the warp skip, the default since 2026-12-07, spill
# 144 bytes at the D = 128 rotating-slot entry), about 5-6 minutes;
# one_barrier_ab (not in all): scripts/mma_fwd_probe.py (forward, with its checks and a
# control build) and scripts/mma_bwd_ab.py (backward alone, both schemes) of BARRIER_MACROS
# against the default, about 5 minutes; logs in logs/one_barrier_*.
# mma_probes (not in all): the mma.sync backward against SDPA flash (scripts/mma_bwd_probe.py,
# bfloat16 and float16), then the earlier default of the float16 causal
# D = 128 one-kernel backward (-DPW_BWD_P_FIXED_EXEMPT=1 with -DPW_BWD_TID_RELOAD=0 and
# -DPW_ONE_BARRIER=0, with which it builds without spills: the
# per-row P scale, kernels_cu/backward.cu) against the default (scripts/mma_bwd_ab.py,
# backward alone); last, the D = 128 forward's earlier four-slot layout,
# -DPW_FWD_Q_ROTATE=0 (kernels_cu/traits.cuh; the default, 1 since 2026-12-05, keeps 128x64x4
# in three rotating Q-sized slots, two blocks per SM; with 0 the same tile keeps q1, q2 and
# two stages, one block per SM), against the default at the table's 128x64x4 and at
# 128x32x4, the entry before it (which the macro does not change: those rows are a second
# control), L 2048-16384, with a control build. Its GPU suite run:
# PW_TEST_MACROS="PW_FWD_Q_ROTATE=0" with CUPY_PIECEWISE_PATH=mma.
# About 2-4 minutes each, logs in logs/mma_*.txt. Earlier A/Bs and their
# figures: bench/NOTES.md, bench/results/2026-12-04-h200-fit-headroom,
# 2026-12-04-h200-mma-vs-flag-attn and 2026-12-04-h200-staged-defaults.
# PW_TEST_MACROS (tests/conftest.py) compiles every kernel of the tests step with those -D
# options: an A/B build through the suite before it becomes the default.
# bitwise (not in all): scripts/bitwise_ab.py, the builds argued to give identical bits
# (PW_FWD_LAZY_RESCALE=0 against the default; PW_BWD_DS_PRESCALE=0 against PW_FIT_HEADROOM=0,
# since the default headroom changes float16 subnormal bits by design), and PW_BWD_P_FIXED=0
# as a control that must differ; logs in logs/bitwise_*.txt.
# ncu_mma (not in all): Nsight Compute on the mma.sync deterministic backward's dq and dk/dv
# kernels, bfloat16 against float16 (L 8192, D 64), logs in logs/ncu_mma_bwd_*.txt, and on the
# mma.sync D = 128 forward with source counters, logs/ncu_mma_fwd_d128.txt.
# ncu_grid (not in all): Nsight Compute on the warp-grid one-kernel backward (pw_backward_grid)
# beside SDPA flash's backward on the same shape (profile_case.py --peer flash): D = 128
# L 8192 with source counters, its SASS with per-instruction stall samples exported to
# logs/ncu_grid128_sass.csv (read with bench/results/2026-12-05-h100-grid-diet/sass_hotspots.py),
# D = 128 L 2048 causal and D = 64 L 8192; logs in logs/ncu_grid*.txt, logs/ncu_flash*.txt.
# ncu_fwd (not in all): Nsight Compute on the mma.sync forward (pw_forward) beside SDPA flash's
# forward on the same shape, D = 128 L 2048 causal and not (where the forward's ratio to flash
# drops from 0.96-1.0x at L 8192-16384 to 0.83-0.92x), ours also at w = L (one product per
# tile; logs *_wL.txt) and with source counters at w = L / 4, logs in logs/ncu_*fwd128*.txt.
# ncu_decode (not in all): Nsight Compute on the Hopper decode (pw90_kvdecode) beside SDPA
# cuDNN's decode on the same shape (profile_case.py --decode --peer cudnn), bfloat16 D = 128
# B = 8, N = 32768 (one split, DRAM-bound: 0.95-0.99x cuDNN) and B = 1 (8 splits), memory
# sections (and source counters for ours: which loads go through L1); logs in logs/ncu_dec*.txt.
# fwd_d64 (not in all): the D = 64 forward's earlier two-slot layout (-DPW_FWD_ONE_K_D64=0,
# kernels_cu/traits.cuh; the default, 1 since 2026-12-05, keeps one key slot at 128-key tiles so
# that 128x128x4, TABLE's sm_90 entry, fits two blocks per SM) against the default at
# 128x128x4 and at 128x64x4, the entry before (scripts/mma_fwd_probe.py with its reference
# checks and a control build, bf16 and fp16, L 2048 and 8192), about 4 minutes, logs in
# logs/fwd_d64.txt (first run: bench/results/2026-12-05-h200-mma-table/fwd_d64_h100.txt).
# mma_bench (not in all): issue 15's SPEC-format table, piecewise_mma beside sdpa_flash,
# sdpa_cudnn, flex_composite and flag_attn (carry .baselines for it: bench/README.md), about
# 8-9 minutes, results in OUTDIR/mma_bench.
# ncu (not in all): Nsight Compute on the Hopper backward kernel (scripts/profile_case.py),
# non-causal and causal, on the Hopper forward at L = 2048 (D 64 and 128) and on the KV-cache
# decode kernel, logs in logs/ncu_*.txt.
# TEST_PATHS / PYTEST_ARGS narrow the tests, BENCH_ARGS replaces the default --quick;
# on one H200 the whole suite outlasts one 10-minute device call (2026-12-04: about 570 s
# without tests/test_torch_gpu.py and test_huge_gpu.py; test_torch_gpu.py took 191 s beside
# three other processes), so run it in two calls with TEST_PATHS / PYTEST_ARGS (--ignore=...),
# one pytest process each: several pytest processes on one GPU time-slice it and finish
# fewer tests in the same time (bench/results/2026-12-04-h200-gpu-suite).
# SANITIZE_DIMS (e.g. 80,96,256) / SANITIZE_SKIP (dense,kvcache,rotary,varlen,torch) / SANITIZE_PATHS
# (hopper or mma: the dense cases of one path) narrow sanitize.
# FUZZ_EXAMPLES (default 600, about 5 min on an H200) sets the fuzz step's example count; the examples it finds
# failing are saved to logs/fuzz_db (copy them into tests/fuzz_db to make them replay).
# Runs the project from its checkout (no install), as the lent H200 machines require.
set -uo pipefail
out=${1:?usage: gpu_run.sh OUTDIR [steps...]}; shift
steps=${*:-all}
logs="$out/logs"
mkdir -p "$logs"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
has() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }
asked() { [[ " $steps " == *" $1 "* ]]; }
status=0
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import cupy, torch, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)"; } 2>&1 | tee "$logs/env.txt"
if has tests; then
  # the fuzz step runs the GPU fuzzer with more examples; the tests step leaves it out then
  skip_fuzz=""; if has fuzz; then skip_fuzz="--ignore=tests/test_fuzz_gpu.py"; fi
  timeout 900 python3 -m pytest -q -ra -m gpu -p no:cacheprovider $skip_fuzz ${TEST_PATHS:-tests} ${PYTEST_ARGS:-} 2>&1 | tee "$logs/pytest_gpu.log" | tail -25
  status=$((status | ${PIPESTATUS[0]}))
fi
if has fuzz; then
  mkdir -p "$logs/fuzz_db"
  CUPY_PIECEWISE_FUZZ_GPU_EXAMPLES=${FUZZ_EXAMPLES:-600} CUPY_PIECEWISE_FUZZ_DB="$logs/fuzz_db" \
    timeout 1200 python3 -m pytest -q -ra -m gpu -p no:cacheprovider --hypothesis-show-statistics \
    tests/test_fuzz_gpu.py 2>&1 | tee "$logs/fuzz_gpu.log" | tail -40
  status=$((status | ${PIPESTATUS[0]}))
fi
if has sanitize; then
  # the four tools at once (each its own process on the same GPU): every selectable variant
  # (scripts/sanitize_cases.py), which exits 1 if any went unlaunched
  for tool in memcheck racecheck synccheck initcheck; do
    extra=""; [[ $tool == memcheck ]] && extra="--report-api-errors no"
    timeout 900 compute-sanitizer --tool $tool $extra --error-exitcode 9 python3 scripts/sanitize_cases.py \
      > "$logs/sanitize_$tool.log" 2>&1 &
  done
  for tool in memcheck racecheck synccheck initcheck; do
    wait -n; rc=$?; status=$((status | rc))
  done
  for tool in memcheck racecheck synccheck initcheck; do
    echo "compute-sanitizer $tool:"; grep -E "ERROR SUMMARY|variants launched|not launched|Error|Traceback" "$logs/sanitize_$tool.log" | head -8
  done
fi
if has cold; then
  timeout 600 python3 scripts/cold_start.py --out "$out/cold_start.json" 2>&1 | tee "$logs/cold_start.log" | tail -4
  status=$((status | ${PIPESTATUS[0]}))
fi
if has soak; then
  timeout 900 python3 scripts/soak.py ${SOAK_ARGS:-} --out "$out/soak.json" 2>&1 | tee "$logs/soak.log" | tail -15
  status=$((status | ${PIPESTATUS[0]}))
fi
if has check; then
  timeout 300 python3 -m cupy_piecewise check 2>&1 | tee "$logs/check.log" | tail -3
  status=$((status | ${PIPESTATUS[0]}))
fi
if has overhead; then
  timeout 300 python3 bench/overhead.py --out "$out/overhead.json" 2>&1 | tee "$logs/overhead.log" | tail -15
  status=$((status | ${PIPESTATUS[0]}))
fi
if has bench; then
  timeout 900 python3 bench/bench.py ${BENCH_ARGS:---quick} --out "$out/bench" 2>&1 | tee "$logs/bench.log" | tail -45
  status=$((status | ${PIPESTATUS[0]}))
  tar czf "$out/bench.tgz" -C "$out" bench && rm -rf "$out/bench"
fi
if asked mma_bench; then
  # issue 15's table: the mma.sync path forced beside SDPA flash and cuDNN, flex_composite and
  # the original Triton design (flag_attn: needs .baselines carried, bench/README.md), SPEC
  # format; the Triton compiles come out of the budget, hence 480 s
  timeout 560 python3 bench/bench.py --lengths 2048,8192,16384 --dims 64,128 --dtypes bf16,fp16 \
    --providers piecewise_mma,sdpa_flash,sdpa_cudnn,flex_composite,flag_attn --phases fwd,fwd_bwd \
    --sections main --budget-s 480 --no-plots --out "$out/mma_bench" 2>&1 | tee "$logs/mma_bench.log" | tail -40
  status=$((status | ${PIPESTATUS[0]}))
fi
if asked ncu; then
  # the Hopper backward's main kernel at L = 8192, D = 128 (non-causal, bf16): one launch
  # after two warm-up launches, with the sections that say where its time goes
  for causal in "" "--causal"; do
    tag=pw90_bwd${causal:+_causal}
    timeout 500 ncu --clock-control none -k "regex:^pw90_bwd$" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section Occupancy \
      python3 scripts/profile_case.py --L 8192 --D 128 $causal > "$logs/ncu_$tag.txt" 2>&1
    rc=$?; echo "ncu $tag: exit $rc"; grep -E "Duration|Throughput|Stall|Issued" "$logs/ncu_$tag.txt" | head -20
    status=$((status | rc))
  done
  # the Hopper forward where it is furthest from cuDNN (L = 2048), at D = 64 (which the K/V
  # rings made 2-4% slower, bench/NOTES.md) and D = 128, non-causal (the persistent grid)
  for D in 64 128; do
    tag=pw90_forward_l2048_d$D
    timeout 300 ncu --clock-control none -k "regex:^pw90_forward$" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section Occupancy \
      python3 scripts/profile_case.py --L 2048 --D $D > "$logs/ncu_$tag.txt" 2>&1
    rc=$?; echo "ncu $tag: exit $rc"; grep -E "Duration|Throughput|Stall|Issued" "$logs/ncu_$tag.txt" | head -20
    status=$((status | rc))
  done
  # the KV-cache decode kernel (pw90_kvdecode on an H200, pw_kvcache elsewhere): one token
  # against 131072 keys per head, 32 heads
  timeout 300 ncu --clock-control none -k "regex:^pw(_kvcache|90_kvdecode)$" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats \
    python3 scripts/profile_case.py --decode --L 131072 --D 128 > "$logs/ncu_kvcache.txt" 2>&1
  rc=$?; echo "ncu kvcache: exit $rc"; grep -E "Duration|Throughput|Stall|Issued" "$logs/ncu_kvcache.txt" | head -20
  status=$((status | rc))
fi
if asked probes; then
  for probe in hopper_probe hopper_bwd_probe; do
    timeout 280 python3 scripts/$probe.py --out "$logs/$probe.txt" > "$logs/$probe.log" 2>&1
    rc=$?; echo "$probe: exit $rc"; tail -12 "$logs/$probe.log"
    status=$((status | rc))
  done
fi
if asked mma_probes; then
  for args in "mma_bwd_probe --dtypes bf16,fp16" \
              "mma_bwd_ab --modes default --dtypes fp16,bf16 --dims 128 --variants PW_BWD_P_FIXED_EXEMPT=1,PW_BWD_TID_RELOAD=0,PW_ONE_BARRIER=0" \
              "mma_fwd_probe --variants PW_FWD_Q_ROTATE=0 --tiles 128:128x64x4,128x32x4 --lengths 2048,8192,16384 --dtypes bf16,fp16 --rounds 3 --reps 30 --control"; do
    name=$(echo "$args" | tr ' =,;:' '_____' | tr -d '-' | tr -s '_' | cut -c1-60)
    read -r -a argv <<< "$args"  # the script, then its options
    timeout 300 python3 "scripts/${argv[0]}.py" "${argv[@]:1}" --out "$logs/$name.txt" > "$logs/$name.log" 2>&1
    rc=$?; echo "$args: exit $rc"; tail -12 "$logs/$name.log"
    status=$((status | rc))
  done
fi
if asked bitwise; then
  for m in PW_FWD_LAZY_RESCALE=0 "PW_BWD_DS_PRESCALE=0 --base PW_FIT_HEADROOM=0" \
           "PW_BWD_P_FIXED=0 --expect-differ"; do
    read -r -a argv <<< "$m"
    timeout 240 python3 scripts/bitwise_ab.py --macros "${argv[0]}" "${argv[@]:1}" \
      > "$logs/bitwise_${argv[0]}.txt" 2>&1
    rc=$?; echo "bitwise $m: exit $rc"; tail -1 "$logs/bitwise_${argv[0]}.txt"
    status=$((status | rc))
  done
fi
if asked ncu_mma; then
  # the mma.sync deterministic backward's two kernels (pw_backward_dq, pw_backward_dkv) in
  # bfloat16 and float16 at L = 8192, D = 64, non-causal: float16's backward runs 1.20x
  # bfloat16's there, while the loops' static counts differ by 12-13% (64x64x4 tiles; about
  # 7% runs on every tile) (bench/NOTES.md, twenty-second session); the second iteration's
  # launches, with stall and issue sections
  for dt in bfloat16 float16; do
    CUPY_PIECEWISE_PATH=mma timeout 240 ncu --clock-control none \
      -k "regex:^pw_backward_d(q|kv)$" --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
      --section WarpStateStats --section SchedulerStats --section Occupancy \
      python3 scripts/profile_case.py --L 8192 --D 64 --dtype $dt --deterministic \
      > "$logs/ncu_mma_bwd_$dt.txt" 2>&1
    rc=$?; echo "ncu mma bwd $dt: exit $rc"
    grep -E "pw_backward|Duration|Executed Ipc|Issue Slots|Stall" "$logs/ncu_mma_bwd_$dt.txt" | head -24
    status=$((status | rc))
  done
  # the mma.sync forward at D = 128 (the table's 128x64x4 in three rotating slots since
  # 2026-12-05, 0.95-0.99x FlashAttention-2 at L 8192-16384; its 128x32x4 before was
  # 0.81-0.87x), bfloat16, L 8192, non-causal: executed instructions and the source
  # counters' hot spots (which SASS lines issue most), to set against the static loop
  CUPY_PIECEWISE_PATH=mma timeout 240 ncu --clock-control none -k "regex:^pw_forward$" \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section InstructionStats \
    --section WarpStateStats --section SchedulerStats --section SourceCounters \
    python3 scripts/profile_case.py --L 8192 --D 128 > "$logs/ncu_mma_fwd_d128.txt" 2>&1
  rc=$?; echo "ncu mma fwd d128: exit $rc"
  grep -E "pw_forward|Duration|Executed Instructions|Issue Slots|Stall" "$logs/ncu_mma_fwd_d128.txt" | head -12
  status=$((status | rc))
fi
if asked ncu_grid; then
  secs="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
    --section InstructionStats --section WarpStateStats --section SchedulerStats --section Occupancy
    --section LaunchStats"
  CUPY_PIECEWISE_PATH=mma timeout 200 ncu --clock-control none -k "regex:^pw_backward_grid$" \
    --launch-skip 1 --launch-count 1 $secs --section SourceCounters --import-source no \
    -o "$logs/grid128" -f python3 scripts/profile_case.py --L 8192 --D 128 --iters 2 \
    > "$logs/ncu_grid128.log" 2>&1
  rc=$?; echo "ncu grid d128: exit $rc"; status=$((status | rc))
  ncu -i "$logs/grid128.ncu-rep" --page details > "$logs/ncu_grid128.txt" 2>&1
  ncu -i "$logs/grid128.ncu-rep" --page source --csv --print-source sass \
    > "$logs/ncu_grid128_sass.csv" 2>&1
  rm -f "$logs/grid128.ncu-rep"
  for args in "--L 8192 --D 128 --peer flash:flash128" "--L 2048 --D 128 --causal:grid128_c2048" \
              "--L 8192 --D 64:grid64" "--L 8192 --D 64 --peer flash:flash64"; do
    tag=${args##*:}; kern="regex:^pw_backward_grid$"; skip=1; count=1
    case $tag in flash*) kern="regex:flash_bwd"; skip=3; count=3;; esac
    CUPY_PIECEWISE_PATH=mma timeout 200 ncu --clock-control none -k "$kern" --launch-skip $skip \
      --launch-count $count $secs python3 scripts/profile_case.py ${args%:*} --iters 2 \
      > "$logs/ncu_$tag.txt" 2>&1
    rc=$?; echo "ncu $tag: exit $rc"; status=$((status | rc))
    grep -E "Duration|Executed Instructions  " "$logs/ncu_$tag.txt" | head -6
  done
fi
if asked ncu_grid64; then
  # the D = 64 warp-grid backward beside FlashAttention-2's (bf16, L GRID64_L, non-causal):
  # 64x64x4 (the table's) and 64x128x8 (half the dQ reductions and Q/dO loads per unit of
  # work, slower when timed on 2026-12-05), each with source counters, raw metrics (every
  # stall reason) and its SASS with per-instruction samples; FA2's likewise; with
  # GRID64_MACRO (space-separated NAME=VALUE) also 64x64x4 built with those, tag g64m
  secs="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
    --section InstructionStats --section WarpStateStats --section SchedulerStats --section Occupancy
    --section LaunchStats --section SourceCounters"
  for cfg in "64x64x4:g64" "64x128x8:g64w8" "flash:flash64" ${GRID64_MACRO:+"64x64x4:g64m"}; do
    tag=${cfg##*:}; kern="regex:^pw_backward_grid$"; tiles="bwd_grid=${cfg%:*}"; extra=""; m=""
    case $tag in flash*) kern="regex:flash_bwd_dq_dk_dv"; tiles=""; extra="--peer flash";; esac
    [[ $tag == g64m ]] && m=$GRID64_MACRO
    PW_TEST_MACROS="$m" CUPY_PIECEWISE_TILES="$tiles" CUPY_PIECEWISE_PATH=mma timeout 240 ncu \
      --clock-control none -k "$kern" --launch-skip 1 --launch-count 1 $secs \
      --import-source no -o "$logs/$tag" -f python3 scripts/profile_case.py --L ${GRID64_L:-8192} \
      --D 64 --iters 2 $extra > "$logs/ncu_$tag.log" 2>&1
    rc=$?; echo "ncu $tag: exit $rc"; status=$((status | rc))
    ncu -i "$logs/$tag.ncu-rep" --page details > "$logs/ncu_$tag.txt" 2>&1
    ncu -i "$logs/$tag.ncu-rep" --page raw --csv > "$logs/ncu_${tag}_raw.csv" 2>&1
    ncu -i "$logs/$tag.ncu-rep" --page source --csv --print-source sass \
      > "$logs/ncu_${tag}_sass.csv" 2>&1
    gzip -f "$logs/ncu_${tag}_sass.csv"
    rm -f "$logs/$tag.ncu-rep"
    grep -E "Duration|Executed Instructions  |L2 Cache Throughput|Warp Cycles Per Issued" \
      "$logs/ncu_$tag.txt" | head -6
  done
fi
if asked ncu_fwd; then
  secs="--section SpeedOfLight --section InstructionStats --section WarpStateStats --section SchedulerStats
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis"
  for causal in "" "--causal"; do
    tag=fwd128_2048${causal:+_causal}
    CUPY_PIECEWISE_PATH=mma timeout 120 ncu --clock-control none -k "regex:^pw_forward$" \
      --launch-skip 2 --launch-count 1 $secs --section SourceCounters python3 \
      scripts/profile_case.py --L 2048 --D 128 $causal > "$logs/ncu_$tag.txt" 2>&1
    rc=$?; echo "ncu $tag: exit $rc"; status=$((status | rc))
    # w = L: every key near, one product per tile (the kernel as a standard attention)
    CUPY_PIECEWISE_PATH=mma timeout 120 ncu --clock-control none -k "regex:^pw_forward$" \
      --launch-skip 2 --launch-count 1 $secs python3 scripts/profile_case.py --L 2048 --D 128 \
      --w-frac 1 $causal > "$logs/ncu_${tag}_wL.txt" 2>&1
    rc=$?; echo "ncu ${tag} w=L: exit $rc"; status=$((status | rc))
    timeout 120 ncu --clock-control none -k "regex:flash_fwd" --launch-skip 2 --launch-count 1 \
      $secs python3 scripts/profile_case.py --L 2048 --D 128 $causal --peer flash \
      > "$logs/ncu_flash_$tag.txt" 2>&1
    rc=$?; echo "ncu flash $tag: exit $rc"; status=$((status | rc))
    grep -E "Duration|Executed Instructions  " "$logs/ncu_$tag.txt" "$logs/ncu_${tag}_wL.txt" \
      "$logs/ncu_flash_$tag.txt" | head -12
  done
fi
if asked ncu_decode; then
  secs="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
    --section WarpStateStats --section Occupancy --section LaunchStats"
  for B in 8 1; do
    tag=dec128_32768_b$B
    timeout 120 ncu --clock-control none -k "regex:^pw90_kvdecode$" --launch-skip 2 --launch-count 1 \
      $secs --section SourceCounters python3 scripts/profile_case.py --decode --batch $B --L 32768 --D 128 --iters 4 \
      > "$logs/ncu_$tag.txt" 2>&1
    rc=$?; echo "ncu $tag: exit $rc"; status=$((status | rc))
    timeout 120 ncu --clock-control none -k "regex:cudnn|sdpa|fmha|flash" --launch-skip 2 \
      --launch-count 1 $secs \
      python3 scripts/profile_case.py --decode --batch $B --L 32768 --D 128 --iters 4 \
      --peer cudnn > "$logs/ncu_cudnn_$tag.txt" 2>&1
    rc=$?; echo "ncu cudnn $tag: exit $rc"; status=$((status | rc))
    grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput" "$logs/ncu_$tag.txt" \
      "$logs/ncu_cudnn_$tag.txt" | head -16
  done
fi
if asked fwd_d64; then
  timeout 420 python3 scripts/mma_fwd_probe.py --variants "PW_FWD_ONE_K_D64=0" \
    --tiles "64:128x128x4,128x64x4" --lengths 2048,8192 \
    --dtypes bf16,fp16 --rounds 2 --control --out "$logs/fwd_d64.txt" > "$logs/fwd_d64.log" 2>&1
  rc=$?; echo "fwd_d64 probe: exit $rc"; tail -24 "$logs/fwd_d64.log"
  status=$((status | rc))
fi
if asked kvprobe; then
  # the Hopper decode's A/B probe: KVPROBE_CONFIGS (';'-separated, scripts/kvdecode_probe.py)
  timeout 420 python3 scripts/kvdecode_probe.py --rounds 3 \
    --configs "${KVPROBE_CONFIGS:-base;PW_COMBINE_PREFETCH=0;m=16;m=128}" --out "$logs/kvdecode_probe.txt" \
    > "$logs/kvdecode_probe.log" 2>&1
  rc=$?; echo "kvdecode_probe: exit $rc"; tail -16 "$logs/kvdecode_probe.log"
  status=$((status | rc))
fi
if asked kvrot; then
  PW_TEST_MACROS="KV90_ROT_STAGE=1" timeout 300 python3 -m pytest -q -ra -m gpu -p no:cacheprovider \
    tests/test_kvcache_rotary_gpu.py 2>&1 | tee "$logs/kvrot_pytest.log" | tail -6
  status=$((status | ${PIPESTATUS[0]}))
  for tool in racecheck synccheck; do
    PW_TEST_MACROS="KV90_ROT_STAGE=1" SANITIZE_SKIP=dense,kvcache,varlen,torch timeout 300 \
      compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_cases.py \
      > "$logs/kvrot_sanitize_$tool.log" 2>&1 &
  done
  for tool in racecheck synccheck; do wait -n; rc=$?; status=$((status | rc)); done
  for tool in racecheck synccheck; do
    echo "compute-sanitizer $tool (staged rotary):"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Traceback" "$logs/kvrot_sanitize_$tool.log" | tail -3
  done
  timeout 300 python3 scripts/kvdecode_probe.py --rounds 2 \
    --configs "rot=1;rot=1 rsu=1;rot=8;rot=8 rsu=1" --out "$logs/kvrot_probe.txt" \
    > "$logs/kvrot_probe.log" 2>&1
  rc=$?; echo "kvrot probe: exit $rc"; tail -16 "$logs/kvrot_probe.log"
  status=$((status | rc))
fi
if asked grid_reload; then
  m=${GRID_MACROS:-"PW_GRID_TWO_DS=1"}
  PW_TEST_MACROS="$m" CUPY_PIECEWISE_PATH=mma timeout 420 python3 -m pytest -q -m gpu -x \
    tests/test_kernels_gpu.py -k "grid_backward_forced or (mma and 64 and not hopper)" \
    2>&1 | tee "$logs/grid_reload_pytest.log" | tail -3
  rc=${PIPESTATUS[0]}; echo "grid_reload tests: exit $rc"; status=$((status | rc))
  timeout 300 python3 scripts/mma_bwd_ab.py --modes default --dims 64,128 --lengths 2048,8192 \
    --dtypes bf16,fp16 --rounds 3 --reps 20 \
    --variants "PW_GRID_TID_RELOAD=1;PW_GRID_TWO_DS=1" \
    --out "$logs/grid_reload_ab.txt" > "$logs/grid_reload_ab.log" 2>&1
  rc=$?; echo "grid_reload ab: exit $rc"; tail -20 "$logs/grid_reload_ab.log"; status=$((status | rc))
  for tool in memcheck racecheck; do
    extra=""; [[ $tool == memcheck ]] && extra="--report-api-errors no"
    PW_TEST_MACROS="$m" SANITIZE_DIMS=64 SANITIZE_PATHS=mma SANITIZE_SKIP=kvcache,rotary,varlen,torch \
      timeout 240 compute-sanitizer --tool $tool $extra --kernel-name kns=pw_backward_grid \
      --error-exitcode 9 python3 scripts/sanitize_cases.py \
      > "$logs/grid_reload_sanitize_$tool.log" 2>&1
    rc=$?; echo "grid_reload $tool: exit $rc"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Traceback" "$logs/grid_reload_sanitize_$tool.log" | tail -3
    status=$((status | rc))
  done
fi
if asked grid_reload_bench; then
  PW_TEST_MACROS=${GRID_MACROS:-"PW_GRID_TWO_DS=1"} timeout 420 python3 bench/bench.py --lengths 2048,8192,16384 --dims 64 \
    --dtypes bf16,fp16 --providers piecewise_mma,sdpa_flash,sdpa_cudnn,flag_attn --phases fwd,fwd_bwd \
    --sections main --budget-s 300 --no-plots --out "$logs/grid_reload_bench" \
    > "$logs/grid_reload_bench.log" 2>&1
  rc=$?; echo "grid_reload bench: exit $rc"; status=$((status | rc))
fi
if asked one_barrier; then
  m=${BARRIER_MACROS:-"PW_ONE_BARRIER=0 PW_FWD_WARP_SKIP=0"}
  PW_TEST_MACROS="$m" CUPY_PIECEWISE_PATH=mma timeout 540 python3 -m pytest -q -m gpu -x \
    tests/test_kernels_gpu.py tests/test_varlen_gpu.py -k "mma and not hopper" \
    2>&1 | tee "$logs/one_barrier_pytest.log" | tail -3
  rc=${PIPESTATUS[0]}; echo "one_barrier tests: exit $rc"; status=$((status | rc))
  for tool in racecheck synccheck; do
    PW_TEST_MACROS="$m" SANITIZE_DIMS=64,128 SANITIZE_PATHS=mma \
      SANITIZE_SKIP=kvcache,rotary,varlen,torch timeout 300 compute-sanitizer --tool $tool \
      --error-exitcode 9 python3 scripts/sanitize_cases.py > "$logs/one_barrier_$tool.log" 2>&1 &
  done
  for tool in racecheck synccheck; do wait -n; rc=$?; status=$((status | rc)); done
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Traceback" "$logs"/one_barrier_{racecheck,synccheck}.log | tail -4
fi
if asked one_barrier_ab; then
  m=${BARRIER_MACROS:-"PW_ONE_BARRIER=0 PW_FWD_WARP_SKIP=0"}
  timeout 300 python3 scripts/mma_fwd_probe.py --variants "$m" --tiles "128:128x64x4;64:128x128x4" \
    --lengths 2048,8192 --dtypes bf16,fp16 --rounds 3 --reps 30 --control \
    --out "$logs/one_barrier_fwd.txt" > "$logs/one_barrier_fwd.log" 2>&1
  rc=$?; echo "one_barrier fwd probe: exit $rc"; tail -14 "$logs/one_barrier_fwd.log"; status=$((status | rc))
  timeout 300 python3 scripts/mma_bwd_ab.py --modes default,det --dims 64,128 --lengths 2048,8192 \
    --dtypes bf16 --rounds 3 --reps 15 --variants "$m" \
    --out "$logs/one_barrier_bwd.txt" > "$logs/one_barrier_bwd.log" 2>&1
  rc=$?; echo "one_barrier bwd ab: exit $rc"; tail -20 "$logs/one_barrier_bwd.log"; status=$((status | rc))
fi
if asked grid_barrier_ab; then
  # the backward alone: the defaults before 2026-12-06, each alone, and the staged two
  # buffers, against the default; then the forward's two-barrier loop against the default
  timeout 330 python3 scripts/mma_bwd_ab.py --modes default --dims 64,128 --lengths 2048,8192 \
    --dtypes bf16,fp16 --rounds 3 --reps 15 \
    --variants "PW_GRID_TID_RELOAD=1,PW_ONE_BARRIER=0;PW_GRID_TID_RELOAD=1;PW_ONE_BARRIER=0;PW_GRID_TWO_DS=1" \
    --out "$logs/grid_barrier_bwd.txt" > "$logs/grid_barrier_bwd.log" 2>&1
  rc=$?; echo "grid_barrier bwd ab: exit $rc"; tail -40 "$logs/grid_barrier_bwd.log"; status=$((status | rc))
  timeout 200 python3 scripts/mma_fwd_probe.py --variants "PW_ONE_BARRIER=0 PW_FWD_WARP_SKIP=0" --tiles "128:128x64x4;64:128x128x4" \
    --lengths 2048,8192 --dtypes bf16,fp16 --rounds 3 --reps 30 --control \
    --out "$logs/grid_barrier_fwd.txt" > "$logs/grid_barrier_fwd.log" 2>&1
  rc=$?; echo "grid_barrier fwd probe: exit $rc"; tail -16 "$logs/grid_barrier_fwd.log"; status=$((status | rc))
fi
if asked tilebox; then
  # the Hopper decode's whole-tile boxes (-DKV90_TILE_BOX=1, kernels_cu/sm90/kvdecode.cu): its
  # KV-cache GPU tests and memcheck, racecheck and synccheck on the KV-cache sanitizer cases
  # under the macro, the probe against the default, and the decode table (paged 64 too)
  # with and without it; first, with TILEBOX_BULK_PROBE=1, scripts/racecheck_bulk_probe.py
  # under racecheck (whether it credits an mbarrier with ordering a bulk copy after reads: the
  # staged rotary form's report; answered on an H100, bench/results/2026-12-06-h100-tilebox)
  for form in $([[ ${TILEBOX_BULK_PROBE:-0} == 1 ]] && echo mbar bar); do
    timeout 120 compute-sanitizer --tool racecheck python3 scripts/racecheck_bulk_probe.py \
      --barrier $form > "$logs/racecheck_bulk_$form.log" 2>&1
    echo "racecheck_bulk_probe $form: exit $?"; grep -E "sums|RACECHECK SUMMARY|Error" "$logs/racecheck_bulk_$form.log" | head -4
  done
  tbm=${TILEBOX_MACRO:-KV90_TILE_BOX=2}
  PW_TEST_MACROS="$tbm" timeout 240 python3 -m pytest -q -ra -m gpu -p no:cacheprovider \
    tests/test_kvcache_gpu.py 2>&1 | tee "$logs/tilebox_pytest.log" | tail -3
  status=$((status | ${PIPESTATUS[0]}))
  timeout 300 python3 scripts/kvdecode_probe.py --rounds 2 --configs "${TILEBOX_PROBE:-base;$tbm}" \
    --out "$logs/tilebox_probe.txt" > "$logs/tilebox_probe.log" 2>&1
  rc=$?; echo "tilebox probe: exit $rc"; tail -16 "$logs/tilebox_probe.log"; status=$((status | rc))
  # (the default's table: bench/results/2026-12-06-h200-decode-mma-tables/decode.json)
  PW_TEST_MACROS="$tbm" timeout 150 python3 bench/kvcache_decode.py --paged 64 \
    --out "$logs/decode_tilebox.json" > "$logs/decode_tilebox.log" 2>&1
  rc=$?; echo "kvcache_decode tilebox: exit $rc"; status=$((status | rc))
  python3 bench/decode_targets.py "$logs/decode_tilebox.json" | tail -3
  # TILEBOX_SANITIZE=0 leaves the sanitizers out (a timing call)
  for tool in $([[ ${TILEBOX_SANITIZE:-1} == 1 ]] && echo memcheck racecheck synccheck); do
    extra=""; [[ $tool == memcheck ]] && extra="--report-api-errors no"
    PW_TEST_MACROS="$tbm" SANITIZE_SKIP=dense,rotary,varlen,torch timeout 300 \
      compute-sanitizer --tool $tool $extra --error-exitcode 9 python3 scripts/sanitize_cases.py \
      > "$logs/tilebox_sanitize_$tool.log" 2>&1 &
  done
  for tool in $([[ ${TILEBOX_SANITIZE:-1} == 1 ]] && echo memcheck racecheck synccheck); do
    wait -n; rc=$?; status=$((status | rc))
  done
  for tool in $([[ ${TILEBOX_SANITIZE:-1} == 1 ]] && echo memcheck racecheck synccheck); do
    echo "compute-sanitizer $tool (tile boxes):"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Traceback" "$logs/tilebox_sanitize_$tool.log" | tail -3
  done
fi
if asked rowbox; then
  # the decode's box forms: each kernel of KV90_ROW_BOX=2 (the default) is, PTX for PTX, one
  # of =1's or the half-row form's (tests/test_build_check_cpu.py). The KV-cache GPU tests and
  # memcheck, racecheck and synccheck on the KV-cache sanitizer cases under ROWBOX_MACRO (in
  # parallel), the probe (at D = 128, m=8 is eight unclustered splits: whole rows on the row
  # that clusters), then issue 13's decode table (paged 64 too) per "tag=macros" of
  # ROWBOX_TABLES, a minute apart on one machine
  rbm=${ROWBOX_MACRO-}
  checks=$([[ ${ROWBOX_CHECKS:-1} == 1 ]] && echo memcheck racecheck synccheck)
  if [[ -n $checks ]]; then
    PW_TEST_MACROS="$rbm" timeout 150 python3 -m pytest -q -ra -m gpu -p no:cacheprovider \
      tests/test_kvcache_gpu.py > "$logs/rowbox_pytest.log" 2>&1
    rc=$?; echo "rowbox pytest (${rbm:-default}): exit $rc"; tail -2 "$logs/rowbox_pytest.log"; status=$((status | rc))
  fi
  for tool in $checks; do
    extra=""; [[ $tool == memcheck ]] && extra="--report-api-errors no"
    PW_TEST_MACROS="$rbm" SANITIZE_SKIP=dense,rotary,varlen,torch timeout 200 \
      compute-sanitizer --tool $tool $extra --error-exitcode 9 python3 scripts/sanitize_cases.py \
      > "$logs/rowbox_sanitize_$tool.log" 2>&1 &
  done
  for tool in $checks; do wait -n; rc=$?; status=$((status | rc)); done
  for tool in $checks; do
    echo "compute-sanitizer $tool (${rbm:-default}):"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Traceback" "$logs/rowbox_sanitize_$tool.log" | tail -3
  done
  probe=${ROWBOX_PROBE-base;KV90_ROW_BOX=0;KV90_ROW_BOX=1;m=8}  # "": no probe
  if [[ -n $probe ]]; then
    timeout 240 python3 scripts/kvdecode_probe.py --rounds 2 --configs "$probe" \
      --out "$logs/rowbox_probe.txt" > "$logs/rowbox_probe.log" 2>&1
    rc=$?; echo "rowbox probe: exit $rc"; tail -16 "$logs/rowbox_probe.log"; status=$((status | rc))
  fi
  IFS=';' read -ra tables <<< "${ROWBOX_TABLES-default=;halfrow=KV90_ROW_BOX=0}"
  for entry in "${tables[@]}"; do
    tag=${entry%%=*}; m=${entry#*=}
    PW_TEST_MACROS="$m" timeout 150 python3 bench/kvcache_decode.py --paged 64 \
      --out "$logs/decode_$tag.json" > "$logs/decode_$tag.log" 2>&1
    rc=$?; echo "kvcache_decode $tag (${m:-default}): exit $rc"; status=$((status | rc))
    python3 bench/decode_targets.py "$logs/decode_$tag.json" | tail -3
  done
fi
if asked gqa; then
  n=${GQA_N:-32768}
  shapes="1,32,32,$n;4,32,8,$n;4,8,8,$n;1,128,32,$n"
  timeout 300 python3 scripts/kvdecode_probe.py --rounds 3 --dims 64,128 --shapes "$shapes" \
    --configs "${GQA_PROBE:-base;pdl=0}" --out "$logs/gqa_probe.txt" > "$logs/gqa_probe.log" 2>&1
  rc=$?; echo "gqa probe: exit $rc"; tail -12 "$logs/gqa_probe.log"; status=$((status | rc))
  mets="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread,launch__waves_per_multiprocessor"
  IFS=';' read -ra list <<< "$shapes"
  for shp in "${list[@]}"; do
    IFS=',' read -r B H Hkv N <<< "$shp"
    tag=gqa_b${B}_h${H}_kv${Hkv}
    # iteration 3's decode and merge (4 iterations, 2 launches each when the decode splits)
    timeout 100 ncu --clock-control none -k "regex:^(pw90_kvdecode|pw_forward_combine)" \
      --launch-skip 4 --launch-count 2 --metrics "$mets" python3 scripts/profile_case.py \
      --decode --batch $B --heads $H --kv-heads $Hkv --L $N --D 128 --iters 4 > "$logs/ncu_$tag.txt" 2>&1
    rc=$?; echo "ncu $tag: exit $rc"; status=$((status | rc))
    grep -E "pw90_kvdecode|pw_forward_combine|gpu__time_duration|dram__throughput|launch__grid_size" "$logs/ncu_$tag.txt" | head -12
    timeout 100 ncu --clock-control none -k "regex:cudnn|sdpa|fmha|flash" --launch-skip 2 \
      --launch-count 1 --metrics "$mets" python3 scripts/profile_case.py --decode --peer cudnn \
      --batch $B --heads $H --kv-heads $Hkv --L $N --D 128 --iters 4 > "$logs/ncu_${tag}_cudnn.txt" 2>&1
    rc=$?; echo "ncu ${tag} cudnn: exit $rc"
    grep -E "gpu__time_duration|dram__throughput|launch__grid_size" "$logs/ncu_${tag}_cudnn.txt" | head -4
  done
fi
if asked fwd_ab; then
  timeout 400 python3 scripts/mma_fwd_probe.py --variants "${FWDAB_VARIANTS-}" \
    --tiles "${FWDAB_TILES:-128:128x64x4;64:128x128x4}" --lengths "${FWDAB_LENGTHS:-2048,8192}" --dtypes bf16,fp16 \
    --w-fracs "${FWDAB_W:-0.25,1}" --rounds "${FWDAB_ROUNDS:-2}" --reps 30 \
    --control --out "$logs/fwd_ab.txt" > "$logs/fwd_ab.log" 2>&1
  rc=$?; echo "fwd_ab probe: exit $rc"; tail -40 "$logs/fwd_ab.log"
  status=$((status | rc))
fi
if asked grid_order; then
  # the D = 64 warp-grid backward's order macros (kernels_cu/backward.cu PW_GRID_STAGGER,
  # PW_GRID_DQ_FIRST; D = 64 kernels only): the backward alone of each against the default
  # with SDPA flash (mma_bwd_ab.py, w = L / 4), then the mma.sync D = 64 GPU cases and the
  # forced warp-grid cases built with GRID_ORDER_CHECK (default both macros) beside memcheck
  # and racecheck on the dense mma.sync D = 64 sanitizer cases under it; about 8-9 minutes
  timeout 300 python3 scripts/mma_bwd_ab.py \
    --variants "${GRID_ORDER_VARIANTS-PW_GRID_STAGGER=1;PW_GRID_DQ_FIRST=1;PW_GRID_STAGGER=1,PW_GRID_DQ_FIRST=1}" \
    --w-fracs 0.25 --flash --modes default --dims 64 --lengths "${GRID_ORDER_LENGTHS:-2048,8192}" \
    --dtypes bf16,fp16 --rounds "${GRID_ORDER_ROUNDS:-3}" --reps 15 \
    --out "$logs/grid_order.txt" > "$logs/grid_order.log" 2>&1
  rc=$?; echo "grid_order ab: exit $rc"; tail -30 "$logs/grid_order.log"; status=$((status | rc))
  m=${GRID_ORDER_CHECK-PW_GRID_STAGGER=1 PW_GRID_DQ_FIRST=1}
  if [[ -n $m ]]; then
    for tool in memcheck racecheck; do
      extra=""; [[ $tool == memcheck ]] && extra="--report-api-errors no"
      PW_TEST_MACROS="$m" SANITIZE_DIMS=64 SANITIZE_PATHS=mma \
        SANITIZE_SKIP=kvcache,rotary,varlen,torch timeout 240 compute-sanitizer --tool $tool $extra \
        --error-exitcode 9 python3 scripts/sanitize_cases.py > "$logs/grid_order_$tool.log" 2>&1 &
    done
    PW_TEST_MACROS="$m" CUPY_PIECEWISE_PATH=mma timeout 240 python3 -m pytest -q -ra -m gpu \
      -p no:cacheprovider tests/test_kernels_gpu.py -k "(mma and not hopper and 64) or grid_backward_forced" \
      > "$logs/grid_order_pytest.log" 2>&1
    rc=$?; echo "grid_order tests ($m): exit $rc"; tail -3 "$logs/grid_order_pytest.log"; status=$((status | rc))
    for tool in memcheck racecheck; do wait -n; rc=$?; status=$((status | rc)); done
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Traceback" "$logs"/grid_order_{memcheck,racecheck}.log | tail -4
  fi
fi
if asked bwd_w; then
  timeout 480 python3 scripts/mma_bwd_ab.py --variants "${BWDW_VARIANTS-}" --w-fracs 0.25,1 --flash \
    --modes "${BWDW_MODES:-default}" \
    --dims "${BWDW_DIMS:-64,128}" --lengths "${BWDW_LENGTHS:-2048,8192}" --dtypes bf16,fp16 \
    --rounds "${BWDW_ROUNDS:-3}" --reps 15 \
    --out "$logs/bwd_w.txt" > "$logs/bwd_w.log" 2>&1
  rc=$?; echo "bwd_w probe: exit $rc"; tail -70 "$logs/bwd_w.log"
  status=$((status | rc))
fi
if asked mma_checks; then
  m=${MMA_MACRO-}
  for tool in memcheck racecheck; do
    extra=""; [[ $tool == memcheck ]] && extra="--report-api-errors no"
    PW_TEST_MACROS="$m" SANITIZE_DIMS=64,128 SANITIZE_PATHS=mma \
      SANITIZE_SKIP=kvcache,rotary,varlen,torch timeout 300 compute-sanitizer --tool $tool $extra \
      --error-exitcode 9 python3 scripts/sanitize_cases.py > "$logs/mma_checks_$tool.log" 2>&1 &
  done
  sel="(mma and not hopper) or grid_backward_forced or fused_backward_forced"
  # 420 s: under a macro set every kernel compiles afresh beside the two sanitizers (the
  # PW_FWD_COL_RANGE=2 run reached 310 of 318 tests in 300 s, H100 2026-12-07)
  PW_TEST_MACROS="$m" CUPY_PIECEWISE_PATH=mma timeout 420 python3 -m pytest -q -ra -m gpu \
    -p no:cacheprovider tests/test_kernels_gpu.py tests/test_varlen_gpu.py -k "$sel" \
    > "$logs/mma_checks_pytest.log" 2>&1
  rc=$?; echo "mma tests ($m): exit $rc"; tail -3 "$logs/mma_checks_pytest.log"; status=$((status | rc))
  for tool in memcheck racecheck; do wait -n; rc=$?; status=$((status | rc)); done
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Traceback" "$logs"/mma_checks_{memcheck,racecheck}.log | tail -4
fi
if asked gqa_ncu; then
  # where the group's 2 us go inside the decode kernel (D = 128: 183.7 us at one query head
  # per key head, 185.6-185.9 us at four, H100 2026-12-07): the MHA row against the MHA grid
  # with four query heads per key head, memory and warp-state sections and source counters
  secs="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
    --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters"
  for H in 32 128; do
    tag=gqa_ncu_h$H
    timeout 150 ncu --clock-control none -k "regex:^pw90_kvdecode$" --launch-skip 2 --launch-count 1 \
      $secs python3 scripts/profile_case.py --decode --batch 1 --heads $H --kv-heads 32 \
      --L ${GQA_N:-32768} --D 128 --iters 4 > "$logs/ncu_$tag.txt" 2>&1
    rc=$?; echo "ncu $tag: exit $rc"; status=$((status | rc))
    grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Executed Instructions  |Warp Cycles Per Issued" \
      "$logs/ncu_$tag.txt" | head -8
  done
fi
if asked rotary; then
  CUPY_PIECEWISE_FUZZ_GPU_EXAMPLES=${FUZZ_EXAMPLES:-120} timeout 420 python3 -m pytest -q -ra -m gpu \
    -p no:cacheprovider tests/test_kvcache_rotary_gpu.py tests/test_fuzz_kvcache.py -k "rotary" \
    2>&1 | tee "$logs/pytest_rotary.log" | tail -8
  status=$((status | ${PIPESTATUS[0]}))
  # synccheck too: the TMA decode's rotary form writes into mbarrier-guarded stages
  for tool in memcheck racecheck synccheck; do
    extra=""; [[ $tool == memcheck ]] && extra="--report-api-errors no"
    SANITIZE_SKIP=dense,kvcache,varlen,torch timeout 400 compute-sanitizer --tool $tool $extra \
      --error-exitcode 9 python3 scripts/sanitize_cases.py > "$logs/sanitize_rotary_$tool.log" 2>&1 &
  done
  for tool in memcheck racecheck synccheck; do wait -n; rc=$?; status=$((status | rc)); done
  for tool in memcheck racecheck synccheck; do
    echo "compute-sanitizer $tool (rotary):"; grep -E "ERROR SUMMARY|ok rotary|Error|Traceback" "$logs/sanitize_rotary_$tool.log" | tail -4
  done
  timeout 300 python3 bench/kvcache_decode.py --quick --paged "" --rotary \
    --out "$out/kvcache_decode_rotary.json" 2>&1 | tee "$logs/kvcache_decode_rotary.log" | tail -30
  status=$((status | ${PIPESTATUS[0]}))
fi
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$logs"
exit $status
