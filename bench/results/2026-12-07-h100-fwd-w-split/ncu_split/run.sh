git apply bench/results/2026-12-07-h100-fwd-w-split/straddle_split.patch || exit 3
M="gpu__time_duration.sum|smsp__inst_executed.sum |sm__warps_active.avg.per_cycle_active|smsp__average_warps_issue_stalled_(wait|short_scoreboard|long_scoreboard|barrier|math_pipe_throttle|mio_throttle|not_selected|dispatch_stall|no_instruction|selected|branch_resolving|lg_throttle)_per_issue_active.ratio "
for m in 0 1; do
  sed -i "s/#define PW_FWD_STRADDLE_SPLIT [01]/#define PW_FWD_STRADDLE_SPLIT $m/" kernels_cu/forward.cu
  for wf in 1 0.25; do
    f=$OUT/ncu_split${m}_w$wf.txt
    CUPY_PIECEWISE_PATH=mma timeout 100 ncu --clock-control none -k "regex:^pw_forward$" --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section InstructionStats --page raw python3 scripts/profile_case.py --L 2048 --D 128 --w-frac $wf > $f 2>&1
    echo "== split=$m w=${wf}L rc=$?"; grep -E "$M" $f | sed 's/  */ /g'
  done
done
