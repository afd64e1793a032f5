"""Soak: a million small calls and a thousand large ones from several threads, each thread
on its own stream. Passes when no call raises, no result changes and memory does not
grow after warm-up.

What runs. ``--threads`` threads (default 4), each with its own non-blocking CuPy stream
(``with stream:``) and its own copy of the inputs (the same values in every thread, in
buffers of its own), share ``--small`` and ``--large`` calls of the public API on CuPy
bfloat16 arrays:

- small: B=1, H=2, D=64, M = N = 64, 77 (causal), 96, 128 (causal), w = N // 4, the four
  shapes in turn (one round), so that the signature memo and the launch caches switch
  at every call. The forward without lse, except every 10th round, which asks for lse
  and runs ``attention_backward`` (default mode) after it;
- large: B=2, H=16, M = N = 4096, D=128, w=1024, the forward with lse and the backward,
  spread evenly among the small calls.

On an H200 the small shapes take the mma.sync forward (split-KV) and the Hopper backward,
the large one the Hopper forward and backward (``CUPY_PIECEWISE_PATH=mma`` soaks the
mma.sync kernels instead).

Checks. Before its loop each thread computes, for every shape, the forward, the default
backward and the deterministic backward: its baselines, which must equal thread 0's bit
for bit. Every 250th round of small calls (each small shape once per 1000 calls) and
every 10th large call, that call's results are compared with the baselines: o and lse bit
for bit (the forward is deterministic), and so is o of a forward without lse; the
deterministic backward of the same inputs bit for bit; the call's own default backward:
dk1, dk2, dv bit for bit and dq1, dq2 within 2**-6 of the largest |dq| (the Hopper
backward adds dQ with float32 atomics in a varying order, so the last bfloat16 bit may
differ; a race or a buffer reused too early gives differences of the size of dq itself).
A call that raises is counted, its first messages kept, and the thread goes on.

Memory. Every thread stops at the same checkpoints -- after 2% of its calls (the end of
warm-up: every kernel and cache has been used once) and after every further 5% -- with its
stream synchronised and no result alive; the main thread then records CuPy's memory pool
(bytes in use and bytes held), the device's memory in use (cudaMemGetInfo) and the
process's resident memory (/proc/self/statm, so Linux only). The soak fails when any of
the four grows by more than 64 MiB from the warm-up checkpoint to the end.

Recorded (--out, JSON; a summary is printed): date, GPU, versions, command, configuration,
wall time, calls and calls per second, host time of a small forward call (median and
99th percentile; measured inside the threads, so it includes waiting for the GIL, and, for
comparison, in one thread alone before the soak), host time of a small backward call,
checks made, mismatches, errors, memory at every checkpoint, growth. Exit status 1 on any
error, mismatch or growth.

Usage, on a GPU machine from the checkout:

    PYTHONPATH=$PWD python3 scripts/soak.py --out /tmp/soak.json [--quick] [--small N]
        [--large N] [--threads T]

Time (an estimate, not yet measured): the small calls are bound by host time, about
25-40 us each and serialised by the GIL whatever the number of threads (30-45 s for a
million), the large ones by the GPU, about 30 ms for a forward and backward (about 30 s
for a thousand), the two overlapping: one to two minutes for the defaults on an H200 once
the kernels are compiled (a first run on a fresh machine adds the NVRTC compiles), a few
seconds with --quick (20000 small, 50 large).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402

import cupy_piecewise  # noqa: E402
from cupy_piecewise.gpu_arrays import bfloat16  # noqa: E402


class Shape(NamedTuple):
    B: int
    H: int
    L: int  # M = N = L
    D: int
    causal: bool
    w: int


SMALL = tuple(Shape(1, 2, L, 64, causal, L // 4)
              for L, causal in ((64, False), (77, True), (96, False), (128, True)))
LARGE = Shape(2, 16, 4096, 128, False, 1024)
#: A backward after every this many rounds of small calls (one round: each small shape once).
BACKWARD_EVERY = 10
#: Small rounds between checks (a multiple of BACKWARD_EVERY: checked rounds run the backward).
CHECK_EVERY = 250
#: Large calls between checks.
LARGE_CHECK_EVERY = 10
#: Fractions of each thread's calls after which all threads stop for a memory sample; the
#: first one ends the warm-up.
CHECKPOINTS = (0.02,) + tuple(k / 20 for k in range(1, 21))
#: Growth allowed from the warm-up checkpoint to the end, for each memory figure.
GROWTH_LIMIT = 64 * 2**20
#: dq of the default backward may differ from its baseline by this fraction of max|dq|.
DQ_TOLERANCE = 2.0**-6
#: Seconds a thread waits at a checkpoint for the main thread before giving up.
GATE_TIMEOUT_S = 600.0
#: Errors whose messages are kept, per thread.
KEEP_MESSAGES = 5


def host_inputs(shape: Shape, seed: int):
    """q1, k1, q2, k2, v, do of ``shape``: bfloat16 NumPy arrays (ml_dtypes)."""
    rng = np.random.default_rng(seed)
    dims = (shape.B, shape.H, shape.L, shape.D)
    return [rng.standard_normal(dims, dtype=np.float32).astype(bfloat16()) for _ in range(6)]


def same_bits(a, b) -> bool:
    bits = {2: cupy.uint16, 4: cupy.uint32}[a.itemsize]
    return a.shape == b.shape and bool((a.view(bits) == b.view(bits)).all())


def as_f32(a):
    """float32 values of a bfloat16 CuPy array (exact; by its bits, so that no bfloat16
    arithmetic of CuPy is needed)."""
    return (a.view(cupy.uint16).astype(cupy.uint32) << np.uint32(16)).view(cupy.float32)


def forward(shape: Shape, ins, lse: bool):
    q1, k1, q2, k2, v, _ = ins
    return cupy_piecewise.attention(q1, k1, q2, k2, v, shape.w, causal=shape.causal,
                                    return_lse=lse)


def backward(shape: Shape, ins, o, lse, deterministic: bool = False):
    q1, k1, q2, k2, v, do = ins
    return cupy_piecewise.attention_backward(do, q1, k1, q2, k2, v, o, lse, shape.w,
                                             causal=shape.causal, deterministic=deterministic)


class Baseline(NamedTuple):
    o: object
    lse: object
    grads: tuple  # default backward
    det: tuple    # deterministic backward


def baseline(shape: Shape, ins) -> Baseline:
    o, lse = forward(shape, ins, True)
    return Baseline(o, lse, backward(shape, ins, o, lse), backward(shape, ins, o, lse, True))


class Gate:
    """The checkpoints: each worker arrives and waits until the main thread, having seen
    all of them arrive and taken its sample, lets them go on."""

    def __init__(self, workers: int, points: int):
        self.workers = workers
        self.arrived = [0] * points
        self.go = [threading.Event() for _ in range(points)]
        self._lock = threading.Lock()

    def arrive(self, k: int) -> None:
        with self._lock:
            self.arrived[k] += 1
        if not self.go[k].wait(GATE_TIMEOUT_S):
            raise RuntimeError(f"checkpoint {k}: the main thread did not let the workers go on")

    def all_here(self, k: int) -> bool:
        return self.arrived[k] >= self.workers

    def open_all(self) -> None:
        for event in self.go:
            event.set()


class Worker(threading.Thread):
    """One thread's share of the calls, on its own stream (see the module docstring)."""

    def __init__(self, index: int, n_small: int, n_large: int, host: dict, gate: Gate):
        super().__init__(name=f"soak-{index}", daemon=True)
        self.index, self.n_small, self.n_large = index, n_small, n_large
        self.host, self.gate = host, gate
        self.calls = 0          # small and large calls done (progress)
        self.counts = Counter()  # API calls by kind, checks by kind
        self.mismatches = Counter()
        self.errors = 0
        self.messages: list[str] = []
        self.fatal = ""
        self.inputs: dict = {}
        self.baselines: dict = {}
        # host time of each small forward / backward call; filled with NaN now so that
        # writing them later touches no new memory
        self.fwd_us = np.full(n_small, np.nan)
        self.bwd_us = np.full(n_small, np.nan)

    def run(self) -> None:
        try:
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                self.inputs = {s: [cupy.asarray(a) for a in arrays] for s, arrays in self.host.items()}
                self.baselines = {s: baseline(s, ins) for s, ins in self.inputs.items()}
                stream.synchronize()
                self._loop(stream)
        except BaseException:  # a bug of this script or a broken device: stop the soak
            self.fatal = traceback.format_exc()

    def _loop(self, stream) -> None:
        total = self.n_small + self.n_large
        large_at = {j * total // self.n_large for j in range(self.n_large)}
        stops = [max(1, round(f * total)) for f in CHECKPOINTS]
        k = 0
        small = large = 0
        for position in range(total):
            if position in large_at:
                self._guarded(self._large, large)
                large += 1
            else:
                self._guarded(self._small, small)
                small += 1
            self.calls += 1
            while k < len(stops) and stops[k] == position + 1:
                stream.synchronize()
                self.gate.arrive(k)
                k += 1
        for rest in range(k, len(stops)):  # a thread without calls still meets the others
            self.gate.arrive(rest)

    def _guarded(self, call, i: int) -> None:
        try:
            call(i)
        except Exception:
            self.errors += 1
            if len(self.messages) < KEEP_MESSAGES:
                self.messages.append(f"thread {self.index}: {traceback.format_exc()}")

    def _small(self, i: int) -> None:
        shape = SMALL[i % len(SMALL)]
        rnd = i // len(SMALL)
        ins = self.inputs[shape]
        with_bwd = rnd % BACKWARD_EVERY == 0
        t0 = time.perf_counter()
        out = forward(shape, ins, with_bwd)
        self.fwd_us[i] = (time.perf_counter() - t0) * 1e6
        self.counts["small forward"] += 1
        if not with_bwd:
            return
        o, lse = out
        t0 = time.perf_counter()
        grads = backward(shape, ins, o, lse)
        self.bwd_us[i] = (time.perf_counter() - t0) * 1e6
        self.counts["small backward"] += 1
        if rnd % CHECK_EVERY == 0:
            self._check("small", shape, ins, o, lse, grads)

    def _large(self, j: int) -> None:
        ins = self.inputs[LARGE]
        o, lse = forward(LARGE, ins, True)
        grads = backward(LARGE, ins, o, lse)
        self.counts["large forward+backward"] += 1
        if j % LARGE_CHECK_EVERY == 0:
            self._check("large", LARGE, ins, o, lse, grads)

    def _check(self, kind: str, shape: Shape, ins, o, lse, grads) -> None:
        """This call's results and two more calls on the same inputs against the baselines."""
        base = self.baselines[shape]
        self.counts[f"{kind} checks"] += 1
        if not (same_bits(o, base.o) and same_bits(lse, base.lse)):
            self.mismatches[f"{kind} forward"] += 1
        if not same_bits(forward(shape, ins, False), base.o):
            self.mismatches[f"{kind} forward without lse"] += 1
        det = backward(shape, ins, o, lse, True)
        if not all(same_bits(g, b) for g, b in zip(det, base.det)):
            self.mismatches[f"{kind} deterministic backward"] += 1
        dq1, dk1, dq2, dk2, dv = grads
        b_dq1, b_dk1, b_dq2, b_dk2, b_dv = base.grads
        if not all(same_bits(g, b) for g, b in ((dk1, b_dk1), (dk2, b_dk2), (dv, b_dv))):
            self.mismatches[f"{kind} backward dk/dv"] += 1
        for g, b in ((dq1, b_dq1), (dq2, b_dq2)):
            g, b = as_f32(g), as_f32(b)
            # written so that a NaN anywhere counts as a mismatch
            if not float(cupy.abs(g - b).max()) <= DQ_TOLERANCE * float(cupy.abs(b).max()):
                self.mismatches[f"{kind} backward dq"] += 1
                break


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_sample(label: str, t0: float) -> dict:
    pool = cupy.get_default_memory_pool()
    free, total = cupy.cuda.runtime.memGetInfo()
    return {"checkpoint": label, "t_s": round(time.perf_counter() - t0, 3),
            "pool_used_bytes": int(pool.used_bytes()), "pool_held_bytes": int(pool.total_bytes()),
            "device_used_bytes": int(total - free), "rss_bytes": rss_bytes()}


def one_thread_us(host: dict, warmup: int = 200, iters: int = 5000) -> dict:
    """Host time of a small forward call in this thread alone, before the soak."""
    shape = SMALL[0]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        ins = [cupy.asarray(a) for a in host[shape]]
        for _ in range(warmup):
            forward(shape, ins, False)
        stream.synchronize()
        times = np.empty(iters)
        for i in range(iters):
            t0 = time.perf_counter()
            forward(shape, ins, False)
            times[i] = (time.perf_counter() - t0) * 1e6
        stream.synchronize()
    return {"median": float(np.median(times)), "p99": float(np.percentile(times, 99)),
            "calls": iters, "shape": shape._asdict()}


def split(n: int, parts: int, i: int) -> int:
    return n // parts + (1 if i < n % parts else 0)


def progress_bar(total: int):
    """tqdm's bar when tqdm is installed, else a line every 10%."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        return tqdm(total=total, unit="call", smoothing=0.1)

    class Lines:
        n, shown = 0, -1

        def update(self, k):
            self.n += k
            tenth = 10 * self.n // max(total, 1)
            if tenth > self.shown:
                self.shown = tenth
                print(f"{self.n}/{total} calls", flush=True)

        def close(self):
            pass

    return Lines()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, default=1_000_000, help="small calls in all")
    ap.add_argument("--large", type=int, default=1000, help="large calls in all")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--out", required=True, help="path of the JSON file to write")
    ap.add_argument("--quick", action="store_true", help="20000 small and 50 large calls")
    args = ap.parse_args(argv)
    if args.quick:
        args.small, args.large = 20_000, 50
    if min(args.small, args.large) < 0 or args.threads < 1:
        ap.error("--small and --large must be >= 0, --threads >= 1")

    device = cupy.cuda.Device()
    gpu = cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode()
    host = {shape: host_inputs(shape, seed) for seed, shape in enumerate(SMALL + (LARGE,))}
    print(f"soak on {gpu}: {args.small} small and {args.large} large calls from "
          f"{args.threads} threads", flush=True)
    alone = one_thread_us(host)

    gate = Gate(args.threads, len(CHECKPOINTS))
    workers = [Worker(i, split(args.small, args.threads, i), split(args.large, args.threads, i),
                      host, gate) for i in range(args.threads)]
    total = args.small + args.large
    bar = progress_bar(total)
    samples = []
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    k = shown = 0
    while any(w.is_alive() for w in workers):
        done = sum(w.calls for w in workers)
        bar.update(done - shown)
        shown = done
        if k < len(CHECKPOINTS) and gate.all_here(k):
            label = "warm-up" if k == 0 else f"{CHECKPOINTS[k]:.0%}"
            samples.append(memory_sample(label, t0))
            gate.go[k].set()
            k += 1
            continue
        if any(w.fatal for w in workers):  # a worker died: let the others run to the end
            gate.open_all()
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    bar.update(sum(w.calls for w in workers) - shown)
    bar.close()
    device.synchronize()

    failures = [f"thread {w.index} stopped:\n{w.fatal}" for w in workers if w.fatal]
    counts, mismatches = Counter(), Counter()
    for w in workers:
        counts.update(w.counts)
        mismatches.update(w.mismatches)
    errors = sum(w.errors for w in workers)
    messages = [m for w in workers for m in w.messages]
    if errors:
        failures.append(f"{errors} calls raised")
    if mismatches:
        failures.append(f"results changed: {dict(mismatches)}")
    first = workers[0].baselines
    for w in workers[1:]:
        for shape, base in w.baselines.items():
            ref = first.get(shape)
            if ref is None or not all(same_bits(a, b) for a, b in
                                      zip((base.o, base.lse) + base.det, (ref.o, ref.lse) + ref.det)):
                failures.append(f"thread {w.index}: baseline of {shape} differs from thread 0's")
    growth = {}
    if len(samples) == len(CHECKPOINTS):
        growth = {key: samples[-1][key] - samples[0][key]
                  for key in ("pool_used_bytes", "pool_held_bytes", "device_used_bytes", "rss_bytes")}
        grown = {key: value for key, value in growth.items() if value > GROWTH_LIMIT}
        if grown:
            failures.append(f"memory grew after warm-up by more than {GROWTH_LIMIT >> 20} MiB: {grown}")
    else:
        failures.append(f"only {len(samples)} of {len(CHECKPOINTS)} memory checkpoints reached")

    fwd_us = np.concatenate([w.fwd_us for w in workers])
    bwd_us = np.concatenate([w.bwd_us for w in workers])
    api_calls = (counts["small forward"] + counts["small backward"]
                 + 2 * counts["large forward+backward"])

    def stats(us):
        us = us[~np.isnan(us)]
        return {"median": float(np.median(us)), "p99": float(np.percentile(us, 99)),
                "calls": int(us.size)} if us.size else {}

    record = {
        "benchmark": "soak",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "host": platform.node(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cupy": cupy.__version__,
        "cupy_piecewise": cupy_piecewise.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
        "kernel_path_env": os.environ.get("CUPY_PIECEWISE_PATH", "auto"),
        "config": {
            "small": args.small, "large": args.large, "threads": args.threads,
            "small_shapes": [s._asdict() for s in SMALL], "large_shape": LARGE._asdict(),
            "dtype": "bfloat16", "backward_every_rounds": BACKWARD_EVERY,
            "check_every_rounds": CHECK_EVERY, "large_check_every": LARGE_CHECK_EVERY,
            "checkpoints": list(CHECKPOINTS), "growth_limit_bytes": GROWTH_LIMIT,
            "dq_tolerance_of_max": DQ_TOLERANCE,
        },
        "wall_s": wall,
        "calls": dict(counts),
        "api_calls": api_calls,
        "api_calls_per_s": api_calls / wall,
        "calls_per_s": total / wall,
        "small_forward_host_us_in_threads": stats(fwd_us),
        "small_forward_host_us_one_thread": alone,
        "small_backward_host_us_in_threads": stats(bwd_us),
        "mismatches": dict(mismatches),
        "errors": errors,
        "error_messages": messages,
        "memory": samples,
        "growth_after_warmup_bytes": growth,
        "passed": not failures,
        "failures": failures,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")

    mib = {key: f"{value / 2**20:+.1f} MiB" for key, value in growth.items()}
    fwd = record["small_forward_host_us_in_threads"]
    print(f"{total} calls ({api_calls} API calls) in {wall:.1f} s: {total / wall:.0f} calls/s; "
          f"small forward host time {fwd.get('median', float('nan')):.1f} us median in the "
          f"threads, {alone['median']:.1f} us alone")
    print(f"checks {dict((k, v) for k, v in counts.items() if 'checks' in k)}, "
          f"mismatches {dict(mismatches)}, errors {errors}")
    print(f"memory growth after warm-up: {mib}")
    for message in messages:
        print(message)
    print(("PASSED" if not failures else "FAILED: " + "; ".join(failures)) + f" (wrote {out})")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
