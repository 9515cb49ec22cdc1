"""The fleet's parts that need no cluster: group specs and Ray options from a config and a plan,
the replica's environment (the GPU Ray gave it), the autoscaler's decisions on real Status
messages, and the seam: the trainer process never imports the fleet or Ray."""

import os
import socket
import subprocess
import sys

import pytest
import yaml

from fleet.autoscale import GroupSignal, decide, read_status, smooth
from fleet.replica import remove_stale, replica_env, sampler_command
from fleet.spec import FleetError, fleet_groups, load_fleet_config, read_token
from mixrl_wire import pb
from mixrl_wire.devices import resolve_device

CONFIG = {"groups": [
    {"name": "h100", "recipe": "fp8", "accelerator": "H100", "spawn": False, "processes": 2,
     "min_processes": 1, "max_processes": 4,
     "resources": {"num_cpus": 8, "num_gpus": 1, "memory": 2**30, "nvme": 1}, "price_per_hour": 3.0},
    {"name": "cpu", "recipe": "bf16", "accelerator": "cpu", "spawn": False, "processes": 1},
    {"name": "local", "recipe": "bf16", "processes": 1},
]}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


def test_groups_and_ray_options(config):
    specs = {g.name: g for g in fleet_groups(load_fleet_config(config))}
    assert set(specs) == {"h100", "cpu"}  # the spawned group is the trainer's own
    h = specs["h100"]
    assert (h.replicas, h.min_replicas, h.max_replicas, h.price_per_hour) == (2, 1, 4, 3.0)
    assert h.ray_options() == {"num_cpus": 8, "num_gpus": 1, "memory": 2**30,
                               "resources": {"nvme": 1, "H100": 1}}
    # no accelerator resource for a CPU group; one CPU unless the group asks otherwise
    assert specs["cpu"].ray_options() == {"num_cpus": 1.0}
    args = list(h.sampler_args)
    assert args[args.index("--recipe") + 1] == "fp8" and args[args.index("--accelerator") + 1] == "H100"


def test_a_plan_sets_the_replica_counts(config, tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"groups": [{"name": "h100", "accelerator": "H100", "processes": 4,
                                                "price_per_hour": 2.5}]}))
    specs = {g.name: g for g in fleet_groups(load_fleet_config(config, plan))}
    assert (specs["h100"].replicas, specs["h100"].price_per_hour, specs["cpu"].replicas) == (4, 2.5, 1)
    plan.write_text(yaml.safe_dump({"groups": [{"name": "a100", "processes": 1}]}))
    with pytest.raises(FleetError, match="'a100' is not a group"):
        load_fleet_config(config, plan)


def test_token_from_file_or_env(tmp_path):
    assert read_token(None, {"MIXRL_TOKEN": " t0k "}) == "t0k"
    (tmp_path / "tok").write_text("abc\n")
    assert read_token(str(tmp_path / "tok"), {}) == "abc"
    with pytest.raises(FleetError, match="no bearer token"):
        read_token(None, {})
    with pytest.raises(FleetError, match="--token-file"):
        read_token(str(tmp_path / "absent"), {})


def test_the_replica_child_uses_the_gpu_ray_gave_it():
    """Ray sets CUDA_VISIBLE_DEVICES for an actor with num_gpus; a launcher rank or a trainer's
    spawn slot inherited from the node would make ``--device auto`` pick another GPU."""
    env = replica_env({"CUDA_VISIBLE_DEVICES": "3", "LOCAL_RANK": "2", "MIXRL_SAMPLER_SLOT": "1", "X": "y"})
    assert env == {"CUDA_VISIBLE_DEVICES": "3", "X": "y"}
    assert resolve_device("auto", visible=1, cuda_visible_devices=env["CUDA_VISIBLE_DEVICES"]) == "cuda:0"
    cmd = sampler_command("py", "t:1", ["--group", "g", "--recipe", "bf16"], model_dir="m", token_file="tf",
                          name="g-0", cache="c", transfer="fetch", parent=42)
    assert cmd[:5] == ["py", "-m", "sampler_torch.cli", "--trainer", "t:1"]
    assert cmd[cmd.index("--exit-with-parent") + 1] == "42" and cmd[cmd.index("--model-dir") + 1] == "m"


def _sig(name, replicas, **kw):
    return GroupSignal(name, replicas, kw.pop("lo", 1), kw.pop("hi", 4), kw.pop("price", 1.0), **kw)


def test_autoscale_moves_a_replica_from_a_masked_or_idle_group_to_the_best_per_dollar():
    groups = [_sig("h100", 2, price=3.0, tokens_per_s=600.0, useful_share=0.9, idle_share=0.1),
              _sig("b200", 2, price=5.0, tokens_per_s=1200.0, useful_share=0.95, idle_share=0.0),
              _sig("mxfp4", 2, price=1.0, tokens_per_s=900.0, useful_share=0.3, idle_share=0.0)]
    move = decide(groups)
    # mxfp4 is 70 % masked; per replica per USD/h b200 makes 1200*0.95/2/5 = 114, h100 600*0.9/2/3 = 90
    assert move is not None and move.donor == "mxfp4"
    assert move.receiver == "b200" and "masked" in move.why
    # a donor at its minimum gives nothing; a receiver at its maximum takes nothing
    assert decide([_sig("a", 1, lo=1, tokens_per_s=1.0, useful_share=0.1),
                   _sig("b", 1, tokens_per_s=9.0)]) is None
    assert decide([_sig("a", 2, tokens_per_s=1.0, idle_share=0.8),
                   _sig("b", 4, hi=4, tokens_per_s=9.0)]) is None
    move = decide([_sig("a", 2, tokens_per_s=1.0, idle_share=0.8), _sig("b", 1, tokens_per_s=9.0)])
    assert (move.donor, move.receiver) == ("a", "b") and "idle" in move.why
    # healthy groups: no move, whatever their prices
    assert decide([_sig("a", 2, tokens_per_s=1.0, useful_share=0.9, idle_share=0.2),
                   _sig("b", 1, tokens_per_s=99.0, useful_share=1.0, idle_share=0.0)]) is None
    assert smooth(None, 0.5) == 0.5 and smooth(0.5, None) == 0.5 and smooth(0.0, 1.0, alpha=0.25) == 0.25


def test_autoscale_reads_the_wire_status():
    st = pb.StatusResponse(groups=[pb.GroupStatus(name="a", samplers=2, tokens_per_s=50.0, outstanding=4),
                                   pb.GroupStatus(name="b", samplers=0, tokens_per_s=0.0)])
    read = read_status(st, {"a": 8, "b": 8})
    assert read["a"]["tokens_per_s"] == 50.0 and read["a"]["idle_share"] == pytest.approx(0.75)
    assert read["b"]["idle_share"] is None  # no samplers: nothing measured, not idle
    assert read["a"]["useful_share"] is None  # not fed back yet: the controller takes it as 1
    # What the trainer reports now (GroupStatus.useful_share / idle_share) wins over the estimate.
    st = pb.StatusResponse(groups=[pb.GroupStatus(name="a", samplers=2, tokens_per_s=50.0, outstanding=4,
                                                  useful_share=0.4, idle_share=0.1)])
    read = read_status(st, {"a": 8})
    assert read["a"]["useful_share"] == pytest.approx(0.4) and read["a"]["idle_share"] == pytest.approx(0.1)


def test_the_fleet_cli_and_render_load_no_ray_torch_or_jax():
    """``render`` and the CLI's start need no Ray; the trainer side of the seam (trainer_jax never
    imports fleet or ray) is in tests/test_seam.py."""
    probe = ("import sys\nimport fleet.cli, fleet.render, fleet.spec, fleet.autoscale, fleet.replica\n"
             "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = set(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                check=True).stdout.split())
    assert "fleet" in loaded and not loaded & {"ray", "torch", "jax"}, loaded & {"ray", "torch", "jax"}


def test_the_controller_moves_a_replica_by_the_trainers_status(tmp_path):
    """The controller's autoscale tick against a real rollout service over gRPC: group a's sampler
    holds no lease (idle), group b's holds its whole capacity; one replica moves a -> b, and no
    further once a is at its minimum. Supervision (Ray) is off: only the tick runs."""
    from fleet.controller import Controller, group_dicts
    from sampler_torch.client import RolloutClient
    from trainer_jax.service import RolloutService

    token = "fleet-autoscale-token"
    groups = [{"name": "a", "recipe": "bf16", "spawn": False, "processes": 2, "min_processes": 1,
               "max_processes": 2, "capacity": 4, "price_per_hour": 1.0},
              {"name": "b", "recipe": "bf16", "spawn": False, "processes": 1, "max_processes": 3,
               "capacity": 4, "price_per_hour": 2.0}]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"groups": groups, "service": {"listen": "127.0.0.1:0"},
                                    "tasks": {"group_size": 2}}))
    cfg = load_fleet_config(path)
    svc = RolloutService.from_config(cfg, token=token).start()
    clients = []
    try:
        for g in ("a", "b"):
            c = RolloutClient(svc.address, token, group=g, capacity=4, name=f"{g}-0")
            c.register()
            clients.append(c)
        assert clients[1].lease(4).tasks
        assert svc.status()["groups"]["b"]["outstanding"] == 4
        ctrl = Controller("t", svc.address, token, group_dicts(fleet_groups(cfg)), autoscale=True,
                          supervise=False)
        assert ctrl.targets == {"a": 2, "b": 1}
        ctrl._autoscale()
        assert ctrl.targets == {"a": 1, "b": 2}, ctrl.events
        assert "autoscale: one replica a -> b: a is 100% idle" in ctrl.events[-1]
        assert ctrl._signals["b"]["idle_share"] == 0.0
        ctrl._autoscale()
        assert ctrl.targets == {"a": 1, "b": 2}  # a is at min_processes
    finally:
        for c in clients:
            c.close()
        svc.stop(grace=0)


def test_no_cluster_or_no_token_is_one_line_and_exit_2(config, capsys, monkeypatch):
    """Nothing listening at --address: refused in seconds (ray.init alone retries for minutes)."""
    from fleet.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert main(["status", "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no Ray cluster at --address 127.0.0.1:{port}" in err, err
    monkeypatch.delenv("MIXRL_TOKEN", raising=False)
    assert main(["up", "--config", str(config), "--trainer", "t:1", "--address", f"127.0.0.1:{port}"]) == 2
    assert "no bearer token" in capsys.readouterr().err


def test_a_killed_replicas_files_are_removed_by_the_next_one_on_the_node(tmp_path):
    """A SIGKILLed actor never runs ``stop``: its token and weights stay until a replica on the
    same node starts and sees its pid gone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, pid in (("gone", dead.pid), ("alive", os.getpid()), ("new", os.getpid())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "pid").write_text(str(pid))
        (tmp_path / name / "token").write_text("secret")
    (tmp_path / "other").mkdir()  # not a replica's: left alone
    assert remove_stale(tmp_path, keep=tmp_path / "new") == [tmp_path / "gone"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alive", "new", "other"]
