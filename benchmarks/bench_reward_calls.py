"""What one reward call costs through the pool (issue 44 item 3): ``RewardPool(spec, workers=N)``
scores ``--calls`` GSM8K-style replies one after another per thread (``N`` threads, one per
worker) and reports the median and p95 milliseconds per call, after ``--warmup`` calls that
start the workers and import the function.

``math`` and ``exact`` are the built-ins; ``exact`` does almost nothing, so its figure is the
per-call overhead of the isolation itself (fork, cgroup, uid, mount namespace, pipes).
``--modes full,fork`` compares the isolation as root with the fork alone
(``MIXRL_REWARD_ISOLATION=fork``). ``--phases`` also times the isolation's steps one by one in a
process forked like a call (root only).

    .venv/bin/python benchmarks/bench_reward_calls.py [--calls 200] [--specs math,exact]
        [--workers 1,2] [--modes full,fork] [--phases] [--out benchmarks/results/bench_reward_calls.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from envs.rewards import RewardPool  # noqa: E402
from envs.rewards.call_isolation import ISOLATION_ENV  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench(spec: str, workers: int, calls: int, warmup: int, mode: str) -> dict:
    os.environ[ISOLATION_ENV] = mode  # read when the pool is made
    pool = RewardPool(spec, workers=workers, timeout_s=10.0)
    times: list[float] = []
    lock = threading.Lock()
    wrong: list[str] = []

    def run(thread: int) -> None:
        for i in range(warmup + calls):
            n = thread * 100_000 + i
            reply, answer = f"So the total is \\boxed{{{n}}}.", str(n)
            if spec == "exact":
                reply = answer
            t0 = time.perf_counter()
            result = pool.score(completion=reply, answer=answer, prompt="q", task={})
            dt = (time.perf_counter() - t0) * 1000
            if result.reward != 1.0:
                wrong.append(f"{spec}: {reply!r} scored {result.reward} ({result.reason}: {result.error})")
            if i >= warmup:
                with lock:
                    times.append(dt)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.close()
    if wrong:
        raise SystemExit(f"{len(wrong)} calls scored wrong, first: {wrong[0]}")
    return {"spec": spec, "workers": workers, "mode": mode, "calls": len(times),
            "median_ms": round(statistics.median(times), 2), "p95_ms": round(_percentile(times, 0.95), 2)}


def time_phases(n: int) -> dict:
    """Median milliseconds of each step a call's child takes, in a child forked from this process
    (which has sympy and the project loaded, like a worker): the fork and reap alone, joining the
    cgroup, the mount + IPC namespaces with the private /dev/shm, covering the directories closed
    to others, dropping to the uid."""
    import sympy  # noqa: F401 - a worker of `math` holds it: the fork copies its page tables

    from envs.rewards import call_isolation as ci

    jail = ci.WorkerJail(ci.plan("full"), 256 * 1024**2)
    call = ci.CallJail.from_argument(jail.argument(256 * 1024**2))
    steps = {"join_cgroup": call.join_cgroup, "namespaces_and_shm": call.private_namespaces,
             "cover_closed_dirs": call.cover_closed_dirs, "drop_uid": call.drop_uid}
    times: dict[str, list[float]] = {"fork_and_reap": [], **{k: [] for k in steps}}
    try:
        for _ in range(n):
            r, w = os.pipe()
            t0 = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                out = []
                for step in steps.values():
                    s0 = time.perf_counter()
                    step()
                    out.append(time.perf_counter() - s0)
                os.write(w, json.dumps(out).encode())
                os._exit(0)
            os.close(w)
            data = os.read(r, 4096)
            os.waitpid(pid, 0)
            total = time.perf_counter() - t0
            os.close(r)
            measured = json.loads(data)
            times["fork_and_reap"].append((total - sum(measured)) * 1000)
            for k, v in zip(steps, measured, strict=True):
                times[k].append(v * 1000)
            call.clear()
    finally:
        jail.release()
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--specs", default="math,exact")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--modes", default="full,fork", help="MIXRL_REWARD_ISOLATION values to compare")
    ap.add_argument("--phases", action="store_true", help="time each isolation step (root only)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for spec in args.specs.split(","):
        for workers in map(int, args.workers.split(",")):
            for mode in args.modes.split(","):
                row = bench(spec, workers, args.calls, args.warmup, mode)
                print(json.dumps(row), flush=True)
                rows.append(row)
    report = {"rows": rows, "load_avg_1m_at_end": os.getloadavg()[0], "cpus": os.cpu_count()}
    if args.phases:
        report["phases_ms"] = time_phases(args.calls)
        print(json.dumps(report["phases_ms"]), flush=True)
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
