"""Trajectory transport: the rollout service vs the same bytes over a raw loopback socket, same run.

8 client processes submit trajectories of 4,096 policy tokens with a K=20 head (the docs/design.md
section 3 record: token ids, loss mask, logprob, logprob_full, version, head ids + logprobs) to a
real ``mixrl-train serve`` process over gRPC on 127.0.0.1, which validates every one, groups and
drops them. Each client leases its tasks, encodes each trajectory from numpy arrays straight to
wire bytes (``encode_trajectory``, as the sampler loop does) and submits it, one unary call at a
time; a second gRPC pass uses one ``SubmitStream`` per leased batch. The baseline sends the
identical serialized bytes, length-prefixed, from 8 processes to one receiving process over plain
TCP sockets and waits for a 1-byte ack per message. A fourth phase sends the same bytes to a gRPC
method that does nothing with them: the ceiling of Python gRPC on this machine, so the report
separates gRPC's own cost from the trajectory path's. Each phase also records the CPU time spent
per trajectory by the clients (all 8 together) and by the receiving process: throughput swings
with whatever else the machine runs, CPU per trajectory much less, so it says where time goes;
the JSON holds the service's server CPU per trajectory over the opaque server's (issue 49: at most
1.3 for SubmitStream).

    .venv/bin/python benchmarks/bench_transport.py [--clients 8] [--per-client 48] [--quick]
        [--out benchmarks/results/bench_transport.json]
    .venv/bin/python benchmarks/bench_transport.py --parts   # the service's Python time per part
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"
VOCAB = 151_936  # Qwen3's vocabulary: ids are realistic, and validation checks their range


def behaviour_arrays(n: int, k: int, seed: int) -> dict:
    """A valid per-token record for ``n`` policy tokens (random values, the right invariants)."""
    rng = np.random.default_rng(seed)
    head_lp = -np.sort(rng.exponential(2.0, size=(n, k)).astype(np.float32), axis=1)
    head_ids = ((rng.integers(0, VOCAB, size=(n, 1)) + np.arange(k)) % VOCAB).astype(np.int32)
    return dict(token_ids=head_ids[:, 0].copy(), logprobs=head_lp[:, 0].copy(),
                logprobs_full=head_lp[:, 0].copy(), versions=np.zeros(n, np.int32),
                head_ids=head_ids, head_logprobs=head_lp)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (all its threads) from /proc; None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def python_thread_cpu_seconds(pid: int) -> float | None:
    """CPU time of ``pid``'s threads that run Python (the main thread's name: Python does not
    rename its threads) as opposed to gRPC core's own named threads (``event_engine`` ...); the
    rest of ``cpu_seconds`` is what gRPC's C core spends outside the interpreter. None off Linux."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            main_name = f.read().strip()
        total = 0.0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # the thread ended
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            if name == main_name:
                fields = stat.rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
    except OSError:
        return None
    return total / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# Servers: `mixrl-train serve` and a raw-socket receiver, both alive for the whole run


def serve_overrides(args) -> list[str]:
    """The config of the service under test (``mixrl-train serve``, and ``--parts`` in process)."""
    return ["tasks.group_size=1", f"tasks.sampling.max_new_tokens={args.tokens}",
            f"tasks.sampling.head_k={args.k}", f"service.vocab_size={VOCAB}",
            "service.limits.max_message_bytes=67108864", "service.buffer.max_trajectories=100000",
            "service.buffer.max_bytes=8589934592", f"service.max_workers={2 * args.clients + 8}"]


def start_serve(args) -> tuple[subprocess.Popen, str, Path]:
    port = _free_port()
    summary = Path(tempfile.mkdtemp(prefix="bench-transport-")) / "summary.json"
    server = subprocess.Popen(
        [sys.executable, "-m", "trainer_jax.cli", "serve", "--listen", f"127.0.0.1:{port}",
         "--status-every", "0", "--summary-json", str(summary), "--log-level", "WARNING",
         *serve_overrides(args)],
        env={**os.environ, "MIXRL_TOKEN": TOKEN}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=REPO)
    line = server.stdout.readline()
    if "listening on" not in line:
        server.kill()
        raise RuntimeError(f"serve did not start: {line}{server.stdout.read()}")
    threading.Thread(target=server.stdout.read, daemon=True).start()
    return server, f"127.0.0.1:{port}", summary


def raw_receiver(port_q, stop) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    port_q.put(srv.getsockname()[1])

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(bytearray(64 * 1024**2))
        head = bytearray(8)
        while True:
            if conn.recv_into(head, 8, socket.MSG_WAITALL) < 8:
                return
            (n,) = struct.unpack("<Q", head)
            got = 0
            while got < n:
                r = conn.recv_into(view[got:n], n - got)
                if not r:
                    return
                got += r
            conn.sendall(b"\x01")

    srv.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def opaque_server(port_q) -> None:
    """The gRPC ceiling: a method that takes the same bytes unparsed and answers a 2-byte ack."""
    from concurrent import futures

    import grpc

    from mixrl_wire import BULK_CHANNEL_OPTIONS

    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"ok")
    server = grpc.server(futures.ThreadPoolExecutor(32),
                         options=[("grpc.max_receive_message_length", 64 * 1024**2), *BULK_CHANNEL_OPTIONS])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Opaque", {"Put": handler})])
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


# ------------------------------------------------------------------------------------------------
# --parts: where the service's own Python time goes, in process, one thread


def ingest_parts(args, rounds: int = 3, per_round: int = 400) -> dict:
    """Thread CPU (ms per trajectory) of each part of the real lease and submit paths, called in
    process without gRPC: the service's functions are wrapped with ``time.thread_time`` (each
    wrapper adds ~0.5 us) and ``RolloutService._submit`` runs unchanged on the wire bytes.
    Returns ``{part: [one figure per round]}``; gRPC's own cost is what the served phases add.
    The wrappers are removed again on return."""
    import functools

    import trainer_jax.service.server as server_mod
    from mixrl_wire import pb
    from mixrl_wire.encoder import encode_trajectory
    from trainer_jax.config import load_config
    from trainer_jax.service import RolloutService
    from trainer_jax.service.scheduler import Scheduler

    spent: dict[str, float] = {}
    originals: list[tuple[object, str, object]] = []

    def timed(owner, name: str, part: str) -> None:
        f = getattr(owner, name)
        originals.append((owner, name, f))

        @functools.wraps(f)
        def wrapper(*a, **k):
            t = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                spent[part] = spent.get(part, 0.0) + time.thread_time() - t
        setattr(owner, name, wrapper)

    svc = RolloutService.from_config(load_config(None, serve_overrides(args)), token=TOKEN)
    svc.source.score = svc.source.score  # an instance attribute, so that the wrapper is too
    timed(server_mod, "decode_trajectory", "decode")
    timed(server_mod, "validate_trajectory", "validate")
    timed(svc.source, "score", "score")
    timed(Scheduler, "begin_submit", "lease checks (begin_submit)")
    timed(Scheduler, "finish_submit", "commit (finish_submit)")
    timed(Scheduler, "_refill", "lease: task generation")
    session = svc.scheduler.register(pb.RegisterRequest(name="parts", group="g", capacity=8), "in-process")
    arrays = behaviour_arrays(args.tokens, args.k, 0)
    out: dict[str, list[float]] = {}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            spent.clear()
            n = 0
            while n < per_round:
                t = time.thread_time()
                tasks = svc.scheduler.lease(pb.LeaseRequest(session_id=session.id, max_samples=8)).tasks
                spent["lease total"] = spent.get("lease total", 0.0) + time.thread_time() - t
                data = [encode_trajectory(task, i, finish_reason="length", session_id=session.id,
                                          **arrays).data for task in tasks for i in task.sample_indices]
                t = time.thread_time()
                for d in data:
                    ack = svc._submit(d)
                    if ack.code:
                        raise RuntimeError(f"refused: {ack.reason}")
                    ack.SerializeToString()
                spent["submit total"] = spent.get("submit total", 0.0) + time.thread_time() - t
                n += len(data)
                svc.buffer.take_groups(1 << 20, timeout=0)
            if r:
                for part, s in spent.items():
                    out.setdefault(part, []).append(s / n * 1e3)
    finally:
        svc.buffer.close()
        for owner, name, f in reversed(originals):
            setattr(owner, name, f)
    return out


# ------------------------------------------------------------------------------------------------
# Clients: one process each, alive for every phase, released together by a barrier per phase


def client_main(address: str, raw_port: int, opaque_port: int, payload: bytes, args, phases: list[str],
                seed: int, barrier, out) -> None:
    import grpc

    from mixrl_wire import BULK_CHANNEL_OPTIONS
    from mixrl_wire.encoder import encode_trajectory
    from sampler_torch.client import RolloutClient

    arrays = behaviour_arrays(args.tokens, args.k, seed)
    client = RolloutClient(address, TOKEN, group=f"bench-{seed % 2}", capacity=8, name=f"bench-{seed}",
                           max_message_bytes=64 * 1024**2)
    client.register()
    sock = socket.create_connection(("127.0.0.1", raw_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head, ack = struct.pack("<Q", len(payload)), bytearray(1)
    put = grpc.insecure_channel(f"127.0.0.1:{opaque_port}", options=[
        ("grpc.max_send_message_length", 64 * 1024**2), *BULK_CHANNEL_OPTIONS],
    ).unary_unary("/bench.Opaque/Put")

    def opaque(count: int) -> int:
        for _ in range(count):
            put(payload)
        return count

    def raw(count: int) -> int:
        for _ in range(count):
            sock.sendall(head)
            sock.sendall(payload)
            sock.recv_into(ack, 1)
        return count

    def grpc_submit(count: int, stream: bool) -> int:
        sent = 0
        while sent < count:
            tasks = client.lease(min(8, count - sent)).tasks
            if not tasks:
                time.sleep(0.01)
                continue
            # Encoded from numpy arrays per sample, as a sampler does: encoding is part of the cost.
            trajs = [encode_trajectory(t, i, finish_reason="length", session_id=client.session_id, **arrays)
                     for t in tasks for i in t.sample_indices]
            results = client.submit_many(trajs) if stream else [client.submit(t) for t in trajs]
            bad = [r for r in results if not r.accepted]
            if bad:
                raise RuntimeError(f"refused: {bad[0]}")
            sent += len(trajs)
        return sent

    run = {"raw": raw, "opaque": opaque, "unary": lambda n: grpc_submit(n, False),
           "stream": lambda n: grpc_submit(n, True)}
    for mode in run:  # warm-up: connections, first leases, numpy paths
        run[mode](2)
    for mode in phases:
        barrier.wait()
        cpu = time.process_time()
        n = run[mode](args.per_client)
        out.put((n, time.process_time() - cpu))
    sock.close()
    client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--per-client", type=int, default=48, help="timed trajectories per client")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of each phase")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 clients, 4 trajectories, 1 repeat")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/bench_transport.json"))
    p.add_argument("--parts", action="store_true",
                   help="only the service's own Python time per part, in process (no gRPC, no JSON)")
    args = p.parse_args(argv)
    if args.parts:
        print(f"service Python thread CPU, ms per {args.tokens}-token trajectory (K = {args.k}), "
              "min / median / max of 3 rounds:")
        for part, ms in sorted(ingest_parts(args).items()):
            print(f"  {part:<30} {min(ms):.3f} / {float(np.median(ms)):.3f} / {max(ms):.3f}")
        return 0
    if args.quick:
        args.clients, args.per_client, args.repeats = 2, 4, 1

    from mixrl_wire import pb
    from mixrl_wire.encoder import encode_trajectory

    task = pb.Task(lease_id="0" * 24, task_id=1, sample_indices=[0])
    payload = encode_trajectory(task, 0, finish_reason="length", session_id="0" * 32,
                                **behaviour_arrays(args.tokens, args.k, 0)).data
    print(f"trajectory: {args.tokens} tokens, head K={args.k}, {len(payload) / 1e6:.3f} MB on the wire; "
          f"{args.clients} clients x {args.per_client}", flush=True)

    # Phases interleave (raw, unary, stream, raw, ...) and repeat: the machine is shared, so a load
    # spike hits all three alike, and the median over repeats is what is reported.
    phases = ["raw", "opaque", "unary", "stream"] * args.repeats
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    receiver = ctx.Process(target=raw_receiver, args=(port_q, stop), daemon=True)
    receiver.start()
    raw_port = port_q.get(timeout=60)
    opaque = ctx.Process(target=opaque_server, args=(port_q,), daemon=True)
    opaque.start()
    opaque_port = port_q.get(timeout=60)
    server, address, summary = start_serve(args)
    barrier, out = ctx.Barrier(args.clients + 1), ctx.Queue()
    procs = [ctx.Process(target=client_main,
                         args=(address, raw_port, opaque_port, payload, args, phases, seed, barrier, out))
             for seed in range(args.clients)]
    for proc in procs:
        proc.start()
    runs: dict[str, list[dict]] = {"raw": [], "opaque": [], "unary": [], "stream": []}
    # CPU per trajectory, on each side: unlike throughput it barely moves when the machine is loaded,
    # so it says where the time goes even on a busy machine.
    server_pid = {"raw": receiver.pid, "opaque": opaque.pid, "unary": server.pid, "stream": server.pid}
    try:
        for mode in phases:
            barrier.wait(timeout=600)
            pid = server_pid[mode]
            t0, s0, py0 = time.perf_counter(), cpu_seconds(pid), python_thread_cpu_seconds(pid)
            got = [out.get(timeout=600) for _ in procs]
            wall = time.perf_counter() - t0
            s1, py1 = cpu_seconds(pid), python_thread_cpu_seconds(pid)
            n, client_cpu = sum(g[0] for g in got), sum(g[1] for g in got)
            server_ms = None if s0 is None or s1 is None else (s1 - s0) / n * 1e3
            python_ms = None if py0 is None or py1 is None else (py1 - py0) / n * 1e3
            runs[mode].append({"trajectories": n, "seconds": wall, "trajectories_per_s": n / wall,
                               "MB_per_s": n * len(payload) / wall / 1e6,
                               "client_cpu_ms_per_trajectory": client_cpu / n * 1e3,
                               "server_cpu_ms_per_trajectory": server_ms,
                               # of which the server's Python threads (RPC workers, gRPC's poller)
                               "server_python_threads_cpu_ms_per_trajectory": python_ms})
            server_txt = "n/a" if server_ms is None else f"{server_ms:.2f}"
            python_txt = "" if python_ms is None else f" (Python threads {python_ms:.2f})"
            print(f"{mode:>6}: {n / wall:8.1f} traj/s {n * len(payload) / wall / 1e6:8.1f} MB/s  cpu ms/traj "
                  f"client {client_cpu / n * 1e3:.2f} server {server_txt}{python_txt}", flush=True)
        for proc in procs:
            proc.join(timeout=60)
            if proc.exitcode != 0:
                raise RuntimeError(f"a client failed (exit {proc.exitcode})")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        server.terminate()
        server.wait(timeout=60)
        stop.set()
        receiver.join(timeout=5)
        opaque.kill()
    served = json.loads(summary.read_text())

    def median(mode: str) -> dict:
        ordered = sorted(runs[mode], key=lambda r: r["MB_per_s"])
        cpu = {k: float(np.median([r[k] for r in runs[mode] if r[k] is not None] or [np.nan]))
               for k in ("client_cpu_ms_per_trajectory", "server_cpu_ms_per_trajectory",
                         "server_python_threads_cpu_ms_per_trajectory")}
        return {**ordered[len(ordered) // 2], "runs_MB_per_s": [r["MB_per_s"] for r in runs[mode]],
                "median_cpu_ms_per_trajectory": cpu}

    raw, opaque_r, unary, stream = median("raw"), median("opaque"), median("unary"), median("stream")
    for name, r in (("gRPC opaque bytes", opaque_r), ("gRPC Submit", unary), ("gRPC SubmitStream", stream)):
        print(f"{name:>18}: {r['trajectories_per_s']:7.1f} traj/s {r['MB_per_s']:7.1f} MB/s, "
              f"ratio to raw socket {r['MB_per_s'] / raw['MB_per_s']:.3f} (median of {args.repeats})")

    def server_cpu_ratio(r: dict) -> float | None:
        """The service's CPU per trajectory over the opaque server's (medians over the repeats):
        issue 49's ingest goal is at most 1.3 for SubmitStream."""
        a = r["median_cpu_ms_per_trajectory"]["server_cpu_ms_per_trajectory"]
        b = opaque_r["median_cpu_ms_per_trajectory"]["server_cpu_ms_per_trajectory"]
        return a / b if np.isfinite(a) and np.isfinite(b) and b > 0 else None

    cpu_ratios = {"stream": server_cpu_ratio(stream), "unary": server_cpu_ratio(unary)}

    def paired_ratios(mode: str) -> list[float]:
        """Repeat i's server CPU per trajectory over the opaque phase of the same repeat (run
        seconds apart): a load swing between repeats moves both sides of each pair alike."""
        out = []
        for r, o in zip(runs[mode], runs["opaque"], strict=True):
            a, b = r["server_cpu_ms_per_trajectory"], o["server_cpu_ms_per_trajectory"]
            if a is not None and b:
                out.append(a / b)
        return out

    paired = {mode: paired_ratios(mode) for mode in ("stream", "unary")}
    for name, ratio in cpu_ratios.items():
        pairs = paired[name]
        print(f"server CPU per trajectory, {name} / opaque: "
              + ("n/a (too few trajectories for the clock)" if ratio is None else f"{ratio:.2f}x")
              + (f"; per repeat min / median / max {min(pairs):.2f} / {float(np.median(pairs)):.2f} / "
                 f"{max(pairs):.2f}x" if pairs else ""))
    result = {
        "benchmark": "bench_transport",
        "command": "python benchmarks/bench_transport.py" + (" --quick" if args.quick else ""),
        "config": {"clients": args.clients, "per_client": args.per_client, "repeats": args.repeats,
                   "tokens": args.tokens, "head_k": args.k, "vocab": VOCAB,
                   "bytes_per_trajectory": len(payload)},
        "raw_socket": raw, "grpc_opaque_bytes": opaque_r, "grpc_unary": unary, "grpc_stream": stream,
        "ratio_unary": unary["MB_per_s"] / raw["MB_per_s"],
        "ratio_stream": stream["MB_per_s"] / raw["MB_per_s"],
        # The gRPC ceiling on this machine, and how much of it the trajectory path keeps.
        "ratio_opaque_bytes": opaque_r["MB_per_s"] / raw["MB_per_s"],
        "stream_vs_opaque": stream["MB_per_s"] / opaque_r["MB_per_s"],
        "target_ratio": 0.2,
        # Server CPU per trajectory over the opaque gRPC server's, same run (None: the clock's
        # 10 ms ticks saw too little, as in --quick); goal at most 1.3 for SubmitStream.
        "server_cpu_ratio_stream_vs_opaque": cpu_ratios["stream"],
        "server_cpu_ratio_unary_vs_opaque": cpu_ratios["unary"],
        # The same ratio per repeat (each phase over the opaque phase of its own repeat).
        "server_cpu_ratio_stream_vs_opaque_per_repeat": paired["stream"],
        "server_cpu_ratio_unary_vs_opaque_per_repeat": paired["unary"],
        "server_cpu_target_ratio": 1.3,
        "server": {"accepted": served["totals"].get("accepted", 0),
                   "rejected": served["totals"].get("rejected", 0)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "loadavg_1m": os.getloadavg()[0]},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
