"""Real processes on loopback: `mixrl-sample` fleets of different recipes against the rollout service,
a sampler killed with SIGKILL mid-generation, a corrupt weight version, a service restart."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny import tiny_char_model

from sampler_torch.client import Backoff, RolloutClient

pytest.importorskip("sampler_torch.engine", reason="the sampler engine is needed for real sampler processes")
from trainer_jax.config import load_config
from trainer_jax.service import RolloutService

BIN = Path(sys.executable).parent
TOKEN = "fleet-token"
RECIPES = {"bf16": "bf16", "fp8": "fp8_block", "int8": "w8a8_int8"}


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """The tiny model published by the converter as v0 (good), v1 (a corrupt shard per format), v2 (good)."""
    from convert.publish import publish
    root = tmp_path_factory.mktemp("fleet")
    init = tiny_char_model(root / "init")
    out = {}
    for v in (0, 1, 2):
        out[v] = publish(init, None, root / "pub", v, list(RECIPES.values()), keep_last=None)
    for path in out[1].values():
        shard = next(path.glob("*.safetensors"))
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0x5A
        shard.write_bytes(bytes(raw))
    return out


class Fleet:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, address: str, recipe: str, model_dir: Path, *extra: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        p = subprocess.Popen(
            [BIN / "mixrl-sample", "--trainer", address, "--group", name, "--recipe", recipe,
             "--model-dir", str(model_dir), "--threads", "1", "--name", name,
             "--weights-cache", str(self.tmp / f"cache-{name}"), *extra],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "MIXRL_TOKEN": TOKEN})
        self.procs[name] = p
        return p

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{(self.tmp / f'{n}.log').read_text()[-3000:]}" for n in self.procs)

    def stop(self) -> dict[str, int]:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        return {n: p.wait(timeout=30) for n, p in self.procs.items()}


def wait_for(cond, timeout: float, what: str, fleet: Fleet, period: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(period)
    raise AssertionError(f"timed out waiting for {what}\n{fleet.logs()}")


def test_fleet_exactly_once_with_kill_and_weight_versions(tmp_path, versions):
    cfg = load_config(None, [
        "service.listen=127.0.0.1:0", "service.session_ttl_s=1.5", "service.heartbeat_s=0.3",
        "tasks.group_size=2", "tasks.sampling.max_new_tokens=4", "tasks.sampling.head_k=8",
        "tasks.sampling.top_p=0.9", "tasks.sampling.top_k=32"])
    svc = RolloutService.from_config(cfg, token=TOKEN).start()
    svc.publish_version(0, versions[0])
    groups, stop = [], threading.Event()

    def drain():  # the training loop's side of the buffer
        while not stop.is_set():
            groups.extend(svc.buffer.take_groups(64, timeout=0.05))

    threading.Thread(target=drain, daemon=True).start()
    fleet = Fleet(tmp_path)
    try:
        victim = fleet.start("victim", svc.address, "bf16", versions[0]["bf16"], "--capacity", "64")
        for recipe, fmt in RECIPES.items():
            extra = ("--weights-transfer", "fetch") if recipe == "fp8" else ()
            fleet.start(recipe, svc.address, recipe, versions[0][fmt], "--capacity", "8", *extra)

        def victim_busy():
            return any(s["name"] == "victim" and s["outstanding"] > 0 for s in svc.status()["samplers"])

        wait_for(victim_busy, 90, "the victim to hold leases", fleet, period=0.01)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        wait_for(lambda: svc.status()["totals"].get("requeued_samples", 0) > 0, 10,
                 "the victim's leases to be re-queued", fleet)

        def on(version_ok, failures=0):
            live = [s for s in svc.status()["samplers"] if s["name"] in RECIPES]
            return len(live) == 3 and all(
                version_ok(s["weights_version"]) and s["weight_failures"] >= failures for s in live)

        wait_for(lambda: on(lambda v: v == 0), 60, "all samplers registered on v0", fleet)
        svc.publish_version(1, versions[1])  # corrupt: must be refused, v0 keeps serving
        wait_for(lambda: on(lambda v: v == 0, failures=1), 30, "v1 refused by every sampler", fleet)
        svc.publish_version(2, versions[2])
        wait_for(lambda: on(lambda v: v == 2, failures=1), 30, "v2 loaded by every sampler", fleet)
        wait_for(lambda: len(groups) >= 300 and sum(
            any(t.versions.max() == 2 for t in g.trajectories) for g in groups) >= 10, 120,
            "300 groups, some generated with v2", fleet)
        codes = fleet.stop()
    finally:
        for p in fleet.procs.values():
            if p.poll() is None:
                p.kill()
        stop.set()
        time.sleep(0.1)
        svc.stop(grace=0)
    assert codes["victim"] == -signal.SIGKILL and all(codes[r] == 0 for r in RECIPES), fleet.logs()
    groups.extend(svc.buffer.take_groups(10_000, timeout=0))
    done = [g.task_id for g in groups]
    assert len(done) == len(set(done)), "a task completed twice"
    open_tasks = set(svc.scheduler.tasks)
    assert not open_tasks & set(done)
    # Every task the service created is either completed exactly once or still open: none lost.
    assert set(done) | open_tasks == set(range(1, svc.scheduler._next_task_id))
    recipes_seen = set()
    for g in groups:
        assert [t.sample_index for t in g.trajectories] == [0, 1]
        for t in g.trajectories:
            assert set(t.versions.tolist()) <= {0, 2}, "a token from the corrupt version"
            assert t.support_indptr is not None and t.reward in (0.0, 1.0)
            recipes_seen.add((t.group, t.recipe["name"], t.recipe["weight_format"]))
    expected = {("bf16", "bf16", "bf16"), ("fp8", "fp8", "fp8_block"), ("int8", "int8", "w8a8_int8")}
    assert expected <= recipes_seen
    st = svc.status()
    assert st["totals"].get("rejected", 0) == 0
    assert st["totals"]["requeued_samples"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(address: str, weights: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [BIN / "mixrl-train", "serve", "--listen", address, "--weights-dir", str(weights),
         "--status-every", "0", "service.session_ttl_s=2", "service.heartbeat_s=0.3",
         "tasks.group_size=2", "tasks.sampling.max_new_tokens=4", "tasks.sampling.head_k=8"],
        stdout=open(log, "a"), stderr=subprocess.STDOUT, env={**os.environ, "MIXRL_TOKEN": TOKEN})


def test_samplers_reconnect_after_the_service_restarts(tmp_path, versions):
    address = f"127.0.0.1:{_free_port()}"
    fleet = Fleet(tmp_path)
    server = _serve(address, versions[0]["bf16"], tmp_path / "serve.log")
    observer = RolloutClient(address, TOKEN, group="observer", backoff=Backoff(initial_s=0.05, max_s=0.5))
    try:
        for name in ("s1", "s2"):
            fleet.start(name, address, "bf16", versions[0]["bf16"], "--capacity", "4")

        def progress(min_each: int):
            st = observer.status()
            acc = {s.name: s.accepted for s in st.samplers}
            return st.server_id if all(acc.get(n, 0) >= min_each for n in ("s1", "s2")) else None

        first = wait_for(lambda: progress(5), 90, "both samplers working", fleet)
        server.send_signal(signal.SIGKILL)
        server.wait()
        time.sleep(0.5)
        server = _serve(address, versions[0]["bf16"], tmp_path / "serve.log")
        second = wait_for(lambda: progress(5), 60, "both samplers working on the new service", fleet)
        assert second != first
        assert all(p.poll() is None for p in fleet.procs.values()), fleet.logs()
        codes = fleet.stop()
        assert codes == {"s1": 0, "s2": 0}, fleet.logs()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        assert "stopped; accepted" in (tmp_path / "serve.log").read_text()
    finally:
        observer.close()
        for p in [*fleet.procs.values(), server]:
            if p.poll() is None:
                p.kill()


def test_serve_needs_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MIXRL_TOKEN"}
    out = subprocess.run([BIN / "mixrl-train", "serve", "--listen", "127.0.0.1:0"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 2 and "MIXRL_TOKEN" in out.stderr
    out = subprocess.run([BIN / "mixrl-sample", "--trainer", "127.0.0.1:1", "--group", "g", "--model-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "MIXRL_TOKEN" in out.stderr


def test_serve_serves_the_demo_configs_environment_mix(tmp_path):
    """`mixrl-train serve --config configs/local_mixed.yaml` (the command docs/wire.md gives) leases
    the environment mix's tasks."""
    config = Path(__file__).parents[2] / "configs" / "local_mixed.yaml"
    log = tmp_path / "serve.log"
    server = subprocess.Popen(
        [BIN / "mixrl-train", "serve", "--config", str(config), "--listen", "127.0.0.1:0",
         "--status-every", "0"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, "MIXRL_TOKEN": TOKEN})
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        address = log.read_text().split("listening on ")[1].split()[0]
        client = RolloutClient(address, TOKEN, group="g", capacity=8,
                               backoff=Backoff(initial_s=0.05, max_s=0.5))
        client.register()
        tasks = client.lease(8).tasks
        assert tasks and {t.env for t in tasks} == {"arithmetic"}
        assert all(t.group_size == 8 and t.sampling.max_new_tokens == 12 for t in tasks)
        client.close()
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
