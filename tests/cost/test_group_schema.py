"""Issue 35 item 1: the sampler group's cost keys, the price table and the accelerator check."""

import json

import pytest

from trainer_jax.cli import main
from trainer_jax.config import ConfigError, load_config
from trainer_jax.cost import accelerator_mismatch

GROUPS = """
prices: {H100: 4.0, RTXPRO6000: 1.8}
groups:
  - {name: a, accelerator: H100, processes: 2, min_processes: 1, max_processes: 4,
     resources: {num_cpus: 2, num_gpus: 1}}
  - {name: b, accelerator: B200, price_per_hour: 5.5}
  - {name: c, accelerator: RTXPRO6000, price_per_hour: 2.0}
  - {name: d, spawn: false, processes: 3}
"""


def test_prices_resolve_group_then_table_then_none(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(GROUPS)
    cfg = load_config(path)
    # own price wins over the table; no accelerator and no price: None (no USD figures)
    assert cfg.group_prices() == {"a": 4.0, "b": 5.5, "c": 2.0, "d": None}
    a = cfg.groups[0]
    assert (a.processes, a.min_processes, a.max_processes) == (2, 1, 4)
    assert a.resources == {"num_cpus": 2.0, "num_gpus": 1.0}
    assert cfg.groups[3].processes == 3  # the replica count of a group that joins on its own
    table = tmp_path / "prices.json"
    table.write_text(json.dumps({"H100": 3.0, "B200": 9.0}))
    merged = load_config(path, prices=table)  # the file wins over prices:, a group's own price over both
    assert merged.group_prices() == {"a": 3.0, "b": 5.5, "c": 2.0, "d": None}
    assert merged.prices == {"H100": 3.0, "RTXPRO6000": 1.8, "B200": 9.0}


@pytest.mark.parametrize("text, match", [
    ("groups: [{name: a, processes: 2, max_processes: 1}]\n", r"min_processes <= processes <= max_processes"),
    ("groups: [{name: a, processes: 1, min_processes: 2}]\n", r"got 2 <= 1 <= 1"),
    ("groups: [{name: a, price_per_hour: -1}]\n", r"groups\.0\.price_per_hour"),
    ("groups: [{name: a, accelerator: 'H 100'}]\n", r"groups\.0\.accelerator"),
    ("groups: [{name: a, resources: {num_gpus: -1}}]\n", r"resources\.num_gpus: must be a finite amount"),
    ("prices: {H100: -2}\n", r"prices\.H100"),
    ("service: {router: {policy: cost}}\ngroups: [{name: a, accelerator: H100}]\n",
     r"policy cost: group 'a' has no price"),
    ("service: {router: {min_share: 0.3, max_share: 0.2}}\n", "max_share .* is below min_share"),
    ("service: {router: {max_share: 0.2}}\ngroups: [{name: a}, {name: b}]\n", "leases cannot all be placed"),
    ("service: {router: {max_out_of_range: 2}}\n", r"max_out_of_range"),
])
def test_bad_cost_keys_are_one_line(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)


@pytest.mark.parametrize("body, match", [
    ("[1, 2]", "non-empty mapping"), ("{H100: cheap}", "H100: must be a number"),
    ("{H100: [", "not valid YAML"),
])
def test_bad_price_file(tmp_path, body, match):
    (tmp_path / "c.yaml").write_text("run: {name: x}\n")
    (tmp_path / "p.yaml").write_text(body)
    with pytest.raises(ConfigError, match=match):
        load_config(tmp_path / "c.yaml", prices=tmp_path / "p.yaml")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "c.yaml", prices=tmp_path / "missing.yaml")


def test_accelerator_matches_the_device_report_not_the_label():
    h100 = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "capability": "9.0"}
    assert accelerator_mismatch("H100", "anything", h100) is None
    assert accelerator_mismatch("cpu", "cpu", {"type": "cpu", "name": "x86_64"}) is None
    assert accelerator_mismatch(None, "cpu", {"type": "cpu"}) is None  # no accelerator: nothing to check
    # the label "H100" does not hide a CPU device
    assert "reports cpu" in accelerator_mismatch("H100", "H100", {"type": "cpu", "name": "x86_64"})
    assert "B200" in accelerator_mismatch("B200", "", h100)
    assert accelerator_mismatch("H100", "NVIDIA H100", {}) is None  # no device report: the label
    assert accelerator_mismatch("H100", "", {}) is not None


def test_serve_refuses_policy_cost_at_load(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("service: {router: {policy: cost}}\ngroups: [{name: a, price_per_hour: 1.0}]\n")
    assert main(["serve", "--config", str(path)]) == 2  # before any service or socket exists
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "policy cost needs a learner" in lines[0]


def test_a_mispriced_group_is_warned_once_not_per_replica(caplog):
    """Two samplers of a group priced as an H100 register from a CPU over real gRPC: both are
    accepted, and the mismatch is one warning (the second registration says it at info)."""
    import logging

    from sampler_torch.client import RolloutClient
    from trainer_jax.config import load_config
    from trainer_jax.service import RolloutService

    cfg = load_config(None, ["service.listen=127.0.0.1:0", "tasks.group_size=2",
                             "groups=[{name: g, recipe: bf16, accelerator: H100, spawn: false}]"])
    svc = RolloutService.from_config(cfg, token="t0k").start()
    cpu = {"type": "cpu", "name": "x86_64"}
    try:
        with caplog.at_level(logging.INFO, logger="mixrl"):
            for i in range(2):
                c = RolloutClient(svc.address, "t0k", group="g", name=f"r{i}", capacity=2, device=cpu)
                assert c.register().session_id
                c.close()
    finally:
        svc.stop(grace=0)
    said = [r for r in caplog.records if "priced as accelerator 'H100' but reports cpu" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.INFO], [r.getMessage() for r in said]


def test_status_carries_what_a_fleet_controller_scales_by():
    """GroupStatus over real gRPC: ``idle_share`` (capacity not leased out), ``useful_share``
    once the trainer fed one back (unset before), ``samples_per_busy_s``."""
    from sampler_torch.client import RolloutClient
    from trainer_jax.config import load_config
    from trainer_jax.service import RolloutService

    cfg = load_config(None, ["service.listen=127.0.0.1:0", "tasks.group_size=2"])
    svc = RolloutService.from_config(cfg, token="t0k").start()
    try:
        c = RolloutClient(svc.address, "t0k", group="g", name="r0", capacity=8)
        c.register()
        before = {g.name: g for g in c.status().groups}["g"]
        assert not before.HasField("useful_share") and before.idle_share == 1.0
        leased = sum(len(t.sample_indices) for t in c.lease(2).tasks)
        assert leased == 2
        svc.router.observe("g", useful_share=0.75)
        after = {g.name: g for g in c.status().groups}["g"]
        assert after.useful_share == pytest.approx(0.75)
        assert after.idle_share == pytest.approx(1 - 2 / 8)
        assert after.samples_per_busy_s >= 0.0
        c.close()
    finally:
        svc.stop(grace=0)
