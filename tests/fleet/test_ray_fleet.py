"""mixrl-fleet on a real local Ray cluster the test starts on loopback and stops: a real rollout
service with the tiny model published as v0, replicas placed by their accelerator resource, one
killed (SIGKILL to its actor's worker) and replaced, a group scaled 1 -> 3 by a plan, a second
Ray node (the only A100) killed with its replica and a third one joining for the replacement, and
`down` leaving no Ray worker and no sampler behind."""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

ray = pytest.importorskip("ray", reason="the ray extra (pip install 'mixrl[ray]')")
pytest.importorskip("sampler_torch.engine", reason="the sampler engine is needed for real samplers")
sys.path.insert(0, str(Path(__file__).parents[1] / "service"))  # tiny.py
from loopback import peer_host  # noqa: E402
from tiny import tiny_char_model  # noqa: E402

from trainer_jax.config import load_config  # noqa: E402
from trainer_jax.service import RolloutService  # noqa: E402

BIN = Path(sys.executable).parent
TOKEN = "fleet-ray-token"
# The cluster runs with Ray's token authentication and a token of its own (Ray 2.60 turns it on
# by itself where ~/.ray/auth_token exists, as a `ray.init()` by hand leaves behind): the test then
# does not depend on what the machine's home holds, and the fleet is shown to work under it.
RAY_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "MIXRL_TOKEN": TOKEN, **RAY_AUTH}
# The head's GCS declares a silent node dead after 3 failed health checks a second apart (Ray's
# default: 5, 3 s apart, ~15 s); the timeout per check stays Ray's 10 s, so a node merely slow under
# load is not declared dead, and a killed one (connection refused at once) is, in ~3 s.
HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
# The node address every node of the test's cluster advertises: loopback, but not 127.0.0.1. Ray
# 2.60 replaces the literal 127.0.0.1 / localhost / ::1 of `--node-ip-address` and of addresses
# with the host's interface address (`resolve_ip_for_localhost`), and then the GCS, raylets,
# workers and drivers connect to that; any other address of 127.0.0.0/8 it takes as given. The
# test's loopback watch (tests/loopback.py) checks every Ray process's peers while it runs.
RAY_IP = "127.0.0.2"
_NODE_TEMPS: list[str] = []  # the temp dirs of this module's Ray nodes (head first): their processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_daemons() -> list[psutil.Process]:
    """Live raylet / gcs_server processes (zombies not counted: where PID 1 does not reap)."""
    return [p for p in psutil.process_iter(["name", "status"])
            if p.info["name"] in ("raylet", "gcs_server") and p.info["status"] != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def cluster():
    """`ray start --head` on loopback with 2 CPUs, 2 H100 and 3 B200 (custom resources) and its own
    temp dir; `ray stop` at the end whatever happened. Skipped where a Ray cluster already runs:
    `ray stop` stops every Ray process of the machine, and that one is not ours."""
    if _ray_daemons():
        pytest.skip("a Ray cluster already runs on this machine; the test's `ray stop` would stop it")
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="mxray", dir="/tmp")  # short: Ray's socket paths live under it
    _NODE_TEMPS.append(temp)
    cmd = [str(BIN / "ray"), "start", "--head", "--node-ip-address", RAY_IP, "--port", str(port),
           "--num-cpus", "2", "--object-store-memory", "500000000",
           "--resources", json.dumps({"H100": 2, "B200": 3}), "--disable-usage-stats",
           "--include-dashboard=false", "--temp-dir", temp]
    try:
        subprocess.run(cmd, env={**ENV, **HEALTH}, check=True, capture_output=True, text=True, timeout=120)
        # This process's driver: Ray reads the mode into its config at import, so refresh it (what
        # Ray's own token setup does after setting RAY_AUTH_MODE).
        os.environ.update(RAY_AUTH)
        from ray._raylet import Config
        Config.initialize("")
        ray.init(address=f"{RAY_IP}:{port}", namespace="mixrl", log_to_driver=False)
        yield f"{RAY_IP}:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for key in RAY_AUTH:
            os.environ.pop(key, None)
        subprocess.run([str(BIN / "ray"), "stop", "--force", "--grace-period", "2"], env=ENV,
                       capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
        assert not _ray_daemons(), "ray stop left Ray running"


def _join_node(address: str, resources: dict) -> tuple[subprocess.Popen, str]:
    """Start `ray start` of a worker node joining ``address`` on this machine (1 CPU, ``resources``,
    a temp dir of its own, by which `_kill_node` finds its processes); returns at once with the
    command and that dir. Ray 2.60 runs two nodes on one host with default ports (each raylet
    picks its own); the workers get a port range apart from the head's (10002-19999), so that the
    two raylets never hand out the same one."""
    temp = tempfile.mkdtemp(prefix="mxnode", dir="/tmp")
    _NODE_TEMPS.append(temp)
    cmd = [str(BIN / "ray"), "start", "--address", address, "--node-ip-address", RAY_IP,
           "--num-cpus", "1", "--object-store-memory", "100000000", "--resources", json.dumps(resources),
           "--min-worker-port", "20002", "--max-worker-port", "20999", "--disable-usage-stats",
           "--temp-dir", temp]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), temp


def _joined(start: subprocess.Popen) -> None:
    out, _ = start.communicate(timeout=120)
    assert start.returncode == 0, out


def _node_procs(temp: str) -> list[psutil.Process]:
    """A node's processes: its raylet (found by its temp dir on the command line) with everything
    below it (agents, workers, their samplers) and the node's other daemons (log monitor)."""
    mine, raylets = [], []
    for p in psutil.process_iter(["cmdline", "name", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and temp in " ".join(p.info["cmdline"] or []):
                mine.append(p)
                if p.info["name"] == "raylet":
                    raylets.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for r in raylets:
        try:
            mine += [c for c in r.children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
        except psutil.NoSuchProcess:
            pass
    return list({p.pid: p for p in mine}.values())


def _kill_node(temp: str) -> list[int]:
    """SIGKILL every process of the node with temp dir ``temp`` (a node lost at once); their pids."""
    procs = _node_procs(temp)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in procs]


def _stop_node(temp: str, timeout: float = 30) -> list[psutil.Process]:
    """Kill the node until none of its processes is left (or ``timeout``); what is left. Never
    raises: it runs in the test's cleanup too."""
    deadline = time.monotonic() + timeout
    while (left := _node_procs(temp)) and time.monotonic() < deadline:
        _kill_node(temp)
        time.sleep(0.25)
    return left


def _fleet(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "mixrl-fleet"), *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def _wait(cond, timeout: float, what: str, logs=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}\n{logs()}")


def _gone(pid: int, born: float | None = None) -> bool:
    """Exited (a zombie nobody reaped yet counts: where PID 1 does not reap, it stays one; so does a
    pid reused by a process created after ``born``)."""
    try:
        p = psutil.Process(pid)
        return p.status() == psutil.STATUS_ZOMBIE or (born is not None and p.create_time() != born)
    except psutil.NoSuchProcess:
        return True


def _describe(pid: int) -> str:
    """What a process that should be gone is doing (for a timeout's message)."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return (f"pid {pid}: {p.status()}, parent {p.ppid()}, threads {p.num_threads()}, "
                    f"cpu {p.cpu_times()}, cmdline {' '.join(p.cmdline())[:300]}")
    except psutil.Error as e:
        return f"pid {pid}: {e!r}"


def _ours(address: str) -> list[psutil.Process]:
    """Ray workers running a fleet actor, and sampler processes joined to ``address``."""
    out = []
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if ("sampler_torch.cli" in cmd and address in cmd) or any(
                f"ray::{actor}" in cmd for actor in ("Replica", "Controller")):
            out.append(p)
    return out


def _ray_processes() -> list[int]:
    """Every process of this module's Ray nodes (daemons are nobody's child: the loopback watch
    of tests/conftest.py would not find them under this process)."""
    return [p.pid for temp in _NODE_TEMPS for p in _node_procs(temp)]


def test_fleet_on_a_local_ray_cluster(cluster, tmp_path, loopback_only):
    from convert.publish import publish

    loopback_only.add(_ray_processes)

    # No trainer takes groups here: a buffer of 16 samples is full within the replicas' first rounds
    # and their samplers then wait, registered and heartbeating, instead of generating up to the
    # default 4,096 on the cores the cluster shares (38 s of the test's 102 s of CPU).
    tree = {
        "run": {"name": "fleet-test"},
        "service": {"listen": "127.0.0.1:0", "session_ttl_s": 3.0, "heartbeat_s": 0.5,
                    "buffer": {"max_trajectories": 16}},
        "tasks": {"group_size": 2, "sampling": {"max_new_tokens": 4}},
        "groups": [
            {"name": "h100", "recipe": "bf16", "accelerator": "H100", "spawn": False, "processes": 1,
             "capacity": 2, "device": "auto", "resources": {"num_cpus": 0.5}, "price_per_hour": 3.0},
            {"name": "b200", "recipe": "bf16", "accelerator": "B200", "spawn": False, "processes": 1,
             "capacity": 2, "device": "auto", "resources": {"num_cpus": 0.5}, "price_per_hour": 5.0,
             "max_processes": 3},
            {"name": "a100", "recipe": "bf16", "accelerator": "A100", "spawn": False, "processes": 1,
             "capacity": 2, "device": "auto", "resources": {"num_cpus": 0.5}, "price_per_hour": 2.0},
        ]}
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(tree))
    cfg = load_config(config)
    svc = RolloutService.from_config(cfg, token=TOKEN).start()
    svc.publish_version(0, publish(tiny_char_model(tmp_path / "init"), None, tmp_path / "pub", 0, ["bf16"]))
    address = svc.address

    def registered() -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for s in svc.status()["samplers"]:
            if not s["name"].endswith("/fetch"):
                out.setdefault(s["group"], []).append(s)
        return out

    def fleet_status() -> str:
        r = _fleet("status", "--address", cluster, "--name", "fleet-test", timeout=180)
        return r.stdout + r.stderr

    def live(group: str) -> list[str]:
        return sorted(s["name"] for s in registered().get(group, []) if s["last_seen_s_ago"] < 2)

    def controller_status() -> dict:
        return ray.get(ray.get_actor("fleet-test", namespace="mixrl").status.remote(), timeout=60)

    # the cluster's only A100: a second node on this machine, joining while `up` starts the fleet
    nodes = [_join_node(cluster, {"A100": 1})]
    phases, t0 = [], time.monotonic()
    try:
        # `up` waits for every replica's placement, a100-0's until the A100 node has joined
        up = _fleet("up", "--config", str(config), "--trainer", address, "--address", cluster,
                    "--weights-transfer", "fetch")
        _joined(nodes[0][0])
        assert up.returncode == 0, up.stdout + up.stderr
        assert "fleet fleet-test -> trainer" in up.stdout
        phases.append(("up placed", time.monotonic() - t0))
        # each replica fetched v0 over gRPC, started its sampler, and the sampler registered
        _wait(lambda: [live(g) for g in ("h100", "b200", "a100")] == [["h100-0"], ["b200-0"], ["a100-0"]],
              180, "one sampler per group registered", fleet_status)
        phases.append(("3 samplers registered", time.monotonic() - t0))
        # placed by resource: one H100, one B200 and the A100 are taken, half a CPU each (of 2 + 1)
        avail = ray.available_resources()
        assert avail.get("H100") == 1 and avail.get("B200") == 2 and avail.get("A100", 0) == 0 \
            and avail.get("CPU") == 1.5, avail
        a100 = next(r for r in controller_status()["replicas"] if r["name"] == "a100-0")
        node_b = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("A100"))
        on_b = {p.pid for p in _node_procs(nodes[0][1])}
        assert a100["node"] == node_b and a100["pid"] in on_b, a100
        # the controller is on the head (with num_cpus=0 alone Ray may put it on node B, whose loss
        # below would then take the whole fleet)
        ctrl = [p.pid for p in psutil.process_iter(["cmdline"])
                if "ray::Controller" in " ".join(p.info["cmdline"] or [])]
        assert len(ctrl) == 1 and ctrl[0] not in on_b, (ctrl, on_b)

        # kill the h100 replica's actor process (its sampler goes with it; a new replica replaces
        # it) and, meanwhile, scale b200 from 1 to 3 replicas with a plan applied to the fleet
        victim = next(r for r in controller_status()["replicas"] if r["name"] == "h100-0")
        born = psutil.Process(victim["sampler_pid"]).create_time()  # a reused pid is another process
        os.kill(victim["pid"], signal.SIGKILL)
        plan = tmp_path / "plan.yaml"
        plan.write_text(yaml.safe_dump({"groups": [
            {"name": "b200", "accelerator": "B200", "processes": 3, "price_per_hour": 5.0}]}))
        up = _fleet("up", "--config", str(config), "--trainer", address, "--address", cluster,
                    "--plan", str(plan), "--weights-transfer", "fetch")
        assert up.returncode == 0 and "re-targeted" in up.stdout, up.stdout + up.stderr

        # meanwhile the A100 node dies (its raylet, workers and sampler SIGKILLed): once the head
        # declares it dead, a100-0 is a dead actor; its replacement fits nowhere and waits
        killed = _kill_node(nodes[0][1])
        assert a100["pid"] in killed and a100["sampler_pid"] in killed, (a100, killed)
        # (its watchdog SIGKILLs it ~10 s after the parent's death at the latest; the bound leaves
        # room for a loaded machine, and a timeout says what the process was doing)
        _wait(lambda: _gone(victim["sampler_pid"], born), 60, "the victim's sampler to go with its actor",
              lambda: _describe(victim["sampler_pid"]))

        def waiting_a100() -> dict | None:
            st = controller_status()
            rows = [r for r in st["replicas"] if r["group"] == "a100"]
            return st if [(r["name"], r["state"]) for r in rows] == [("a100-1", "starting")] else None
        st = _wait(waiting_a100, 60, "a100-0 dead and a100-1 waiting", fleet_status)
        assert any("a100-0 dead (the actor died" in e for e in st["events"]), st["events"]
        assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node_b)
        phases.append(("A100 node dead, a100-1 waiting", time.monotonic() - t0))
        _wait(lambda: "a100" not in registered(), 30, "the trainer to drop a100-0's session")
        out = fleet_status()
        row = next(line.split() for line in out.splitlines() if line.startswith("a100"))
        assert row[:2] == ["a100", "A100"] and row[-3:] == ["0", "1", "0"], out  # running, starting, dead
        assert any(line.split()[:2] == ["a100-1", "starting"] and "waiting for placement" in line
                   for line in out.splitlines()), out
        # seconds later (the CLI's own run) still nowhere to go: no placement, no second replacement
        st = controller_status()
        assert [(r["name"], r["state"]) for r in st["replicas"] if r["group"] == "a100"] == [
            ("a100-1", "starting")] and st["replaced"] == 2, st

        # a fresh node with an A100 joins: a100-1 is placed there and its sampler registers
        nodes.append(_join_node(cluster, {"A100": 1}))
        _joined(nodes[1][0])
        _wait(lambda: live("h100") == ["h100-1"] and live("b200") == ["b200-0", "b200-1", "b200-2"]
              and live("a100") == ["a100-1"], 180,
              "h100-1 replacing h100-0, three b200 samplers and a100-1 on the new node", fleet_status)
        phases.append(("replaced + scaled + new node, registered", time.monotonic() - t0))
        avail = ray.available_resources()
        assert avail.get("B200", 0) == 0 and avail.get("H100") == 1 and avail.get("A100", 0) == 0 \
            and avail.get("CPU", 0) == 0.5, avail
        st = controller_status()
        assert st["replaced"] == 2 and any("h100-0 dead (the actor died" in e for e in st["events"]), st
        a100 = next(r for r in st["replicas"] if r["name"] == "a100-1")
        assert a100["node"] not in ("", node_b) and a100["pid"] in {p.pid for p in _node_procs(nodes[1][1])}
        out = fleet_status()
        row = next(line.split() for line in out.splitlines() if line.startswith("b200"))
        assert row[:4] == ["b200", "B200", "3", "3"] and row[5] == "3", out  # target, plan, running
        assert "h100-1" in out and "running" in out

        pids = {p.pid for p in _ours(address)}
        assert len(pids) >= 10, pids  # 5 replica actors, 5 samplers (the controller too)
        down = _fleet("down", "--address", cluster, "--name", "fleet-test", timeout=120)
        assert down.returncode == 0 and "stopped 5 replicas" in down.stdout, down.stdout + down.stderr
        _wait(lambda: not _ours(address), 30, "no fleet process left",
              lambda: "\n".join(" ".join(p.cmdline()) for p in _ours(address)))
        with pytest.raises(ValueError):
            ray.get_actor("fleet-test", namespace="mixrl")
        # without --name, after `down`: no fleet runs (it said "no fleet named 'run'")
        after = _fleet("status", "--address", cluster, timeout=180)
        said = ("mixrl-fleet: no fleet is running on this cluster (namespace mixrl); "
                "`mixrl-fleet up` starts one")
        assert after.returncode == 1 and after.stderr.strip().splitlines()[-1:] == [said], \
            after.stdout + after.stderr
        assert not _node_procs(nodes[0][1]), "the dead node came back"
        assert not _stop_node(nodes[1][1]), "the second A100 node does not stop"
        phases.append(("down, nothing left", time.monotonic() - t0))
        # The watch looked at Ray's own traffic (not only this process's): the GCS, raylets and
        # workers talked over RAY_IP, and (checked at teardown) to no peer off loopback.
        loopback_only.sample()
        ray_peers = {remote for _, _, remote in loopback_only.seen if str(peer_host(remote)) == RAY_IP}
        assert len(ray_peers) >= 5 and not loopback_only.found, (ray_peers, loopback_only.found)
        print("phases (s since the first up):", ", ".join(f"{n} {t:.1f}" for n, t in phases))
    finally:
        for p in _ours(address):
            p.kill()
        for start, temp in nodes:  # the nodes this test joined: gone whatever happened
            if start.poll() is None:
                start.kill()
            _stop_node(temp)
            shutil.rmtree(temp, ignore_errors=True)
        svc.stop(grace=0)
