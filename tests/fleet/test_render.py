"""mixrl-fleet render: Deployments checked against the Kubernetes client's models, SkyPilot tasks
against SkyPilot's task and resources schemas (vendored from skypilot 0.14.1)."""

from pathlib import Path

import pytest
import yaml

from fleet.cli import main
from fleet.render import validate_skypilot

CONFIG = {
    "run": {"name": "Demo_Run"},
    "groups": [
        {"name": "h100_fp8", "recipe": "fp8", "accelerator": "H100", "spawn": False, "processes": 2,
         "resources": {"num_cpus": 8, "num_gpus": 1, "memory": 64 * 2**30}, "price_per_hour": 3.0},
        {"name": "cpu", "recipe": "bf16", "accelerator": "cpu", "spawn": False, "processes": 1,
         "resources": {"num_cpus": 4}},
        {"name": "gone", "recipe": "bf16", "accelerator": "B200", "spawn": False, "processes": 0},
        {"name": "local", "recipe": "bf16", "spawn": True, "processes": 1},
    ]}


def _render(tmp_path: Path, target: str, *extra: str, config: dict = CONFIG) -> int:
    """``mixrl-fleet render`` in this process (the CLI's own entry point; a subprocess costs ~3 s)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return main(["render", "--target", target, "--config", str(path), "--out", str(tmp_path / target),
                 "--trainer", "trainer.example:50051", *extra])


def _k8s_model(doc: dict):
    """``doc`` as a ``V1Deployment``, and back: the model raises on a missing required field and
    the round trip drops (so reveals) any field the API does not have."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    model = api._ApiClient__deserialize(doc, "V1Deployment")
    return model, api.sanitize_for_serialization(model)


def test_k8s_deployments_per_group_validate_against_the_client_models(tmp_path):
    pytest.importorskip("kubernetes")
    assert _render(tmp_path, "k8s", "--node-selector-key", "example.com/accelerator") == 0
    files = sorted((tmp_path / "k8s").glob("*.yaml"))
    # the spawned group is the trainer's own; a group of 0 replicas is a Deployment scaled to 0
    assert [f.name for f in files] == ["demo-run-cpu.deployment.yaml", "demo-run-gone.deployment.yaml",
                                       "demo-run-h100-fp8.deployment.yaml"]
    docs = {f.name.split(".")[0]: yaml.safe_load(f.read_text()) for f in files}
    for doc in docs.values():
        model, back = _k8s_model(doc)
        assert back == doc
    gpu = _k8s_model(docs["demo-run-h100-fp8"])[0]
    assert gpu.spec.replicas == 2 and docs["demo-run-gone"]["spec"]["replicas"] == 0
    pod = gpu.spec.template.spec
    assert pod.node_selector == {"example.com/accelerator": "H100"}
    c = pod.containers[0]
    assert c.resources.limits == {"nvidia.com/gpu": "1"}
    assert c.resources.requests == {"cpu": "8", "memory": str(64 * 2**30)}
    assert c.command[:5] == ["mixrl-fleet", "replica", "--trainer", "trainer.example:50051", "--"]
    assert c.command[c.command.index("--recipe") + 1] == "fp8"
    assert c.env[0].value_from.secret_key_ref.name == "mixrl-token"
    assert gpu.spec.selector.match_labels == gpu.spec.template.metadata.labels
    cpu = _k8s_model(docs["demo-run-cpu"])[0].spec.template.spec
    assert cpu.node_selector is None and cpu.containers[0].resources.limits is None


def test_the_k8s_check_catches_what_it_should():
    """The check above is not vacuous: a misspelled field and a missing required one fail it."""
    pytest.importorskip("kubernetes")
    doc = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"selector": {"matchLabels": {"a": "b"}},
                    "template": {"spec": {"containers": [{"name": "c", "image": "i"}],
                                          "nodeSelektor": {"k": "v"}}}}}
    assert _k8s_model(doc)[1] != doc
    del doc["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        _k8s_model(doc)


def test_skypilot_tasks_per_group_validate_against_its_schema(tmp_path):
    pytest.importorskip("jsonschema")
    assert _render(tmp_path, "skypilot") == 0
    files = sorted((tmp_path / "skypilot").glob("*.yaml"))
    # no task for the group of 0 replicas (SkyPilot needs a node)
    assert [f.name for f in files] == ["demo-run-cpu.sky.yaml", "demo-run-h100-fp8.sky.yaml"]
    tasks = {f.name.split(".")[0]: yaml.safe_load(f.read_text()) for f in files}
    for task in tasks.values():
        validate_skypilot(task)
    gpu = tasks["demo-run-h100-fp8"]
    assert gpu["num_nodes"] == 2
    assert gpu["resources"] == {"accelerators": "H100:1", "cpus": "8+", "memory": "64+"}
    assert gpu["run"].startswith("mixrl-fleet replica --trainer $MIXRL_TRAINER -- "
                                 "--group h100_fp8 --recipe fp8")
    assert gpu["envs"] == {"MIXRL_TRAINER": "trainer.example:50051"} and "MIXRL_TOKEN" in gpu["secrets"]
    assert "accelerators" not in tasks["demo-run-cpu"]["resources"]


def test_the_skypilot_schema_refuses_what_skypilot_refuses():
    import jsonschema

    good = {"name": "t", "num_nodes": 1, "resources": {"accelerators": "H100:1"}, "run": "true"}
    validate_skypilot(good)
    for bad in ({**good, "num_node": 2},                              # unknown task field
                {**good, "resources": {"acclerators": "H100:1"}},     # unknown resources field
                {**good, "envs": {"1BAD": "x"}},                      # not an env name
                {**good, "num_nodes": "two"}):
        with pytest.raises(jsonschema.ValidationError):
            validate_skypilot(bad)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    spawned = {"groups": [{"name": "a", "recipe": "bf16"}]}
    assert _render(tmp_path, "k8s", config=spawned) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "spawn: false" in err, err
    odd = {"groups": [{"name": "a", "recipe": "bf16", "spawn": False, "accelerator": "H100:sxm"}]}
    assert _render(tmp_path, "k8s", config=odd) == 2
    assert "not a Kubernetes label value" in capsys.readouterr().err
    typo = {"groups": [{"name": "a", "recipe": "bf16", "spawn": False, "procsses": 2}]}
    assert _render(tmp_path, "skypilot", config=typo) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "procsses" in err, err


@pytest.mark.parametrize("config", ["configs/gpu_host.yaml", "configs/tpu_slice.yaml"])
def test_the_shipped_fleet_configs_render_gpu_requests_without_a_warning(tmp_path, capsys, config):
    """Every group of the shipped multi-host configs asks for one GPU of its accelerator, in both
    targets (the groups named their accelerators only in their names: `resources: {}`, no
    selector, no SkyPilot accelerators, and no warning)."""
    pytest.importorskip("kubernetes")
    root = Path(__file__).parents[2]
    groups = yaml.safe_load((root / config).read_text())["groups"]
    assert groups and all(g["accelerator"] and g["resources"]["num_gpus"] == 1 for g in groups), groups
    label = {g["accelerator"]: f"NVIDIA-{g['accelerator']}-label" for g in groups}
    for target in ("k8s", "skypilot"):
        extra = [a for acc, v in label.items() for a in ("--node-selector-value", f"{acc}={v}")]
        assert main(["render", "--target", target, "--config", str(root / config), "--out",
                     str(tmp_path / target), *(extra if target == "k8s" else [])]) == 0
        assert capsys.readouterr().err == ""  # every group asks for an accelerator: no warning
    deployments = sorted((tmp_path / "k8s").glob("*.yaml"))
    tasks = sorted((tmp_path / "skypilot").glob("*.yaml"))
    assert len(deployments) == len(tasks) == len(groups)
    by_group = {g["name"]: g for g in groups}
    for path in deployments:
        doc = yaml.safe_load(path.read_text())
        model, back = _k8s_model(doc)
        assert back == doc
        c = model.spec.template.spec.containers[0]
        group = by_group[c.command[c.command.index("--group") + 1]]
        assert c.resources.limits == {"nvidia.com/gpu": "1"}
        selector = model.spec.template.spec.node_selector
        assert selector == {"nvidia.com/gpu.product": label[group["accelerator"]]}
    for path in tasks:
        task = yaml.safe_load(path.read_text())
        validate_skypilot(task)
        group = by_group[task["run"].split("--group ")[1].split()[0]]
        assert task["resources"]["accelerators"] == f"{group['accelerator']}:1"


WARN = ("mixrl-fleet render: warning: group {} requests no accelerator (set its accelerator: and "
        "resources.num_gpus, or accelerator: cpu): its replicas may be scheduled on any node\n")


def test_an_accelerator_without_a_count_asks_for_one_and_none_warns_per_group(tmp_path, capsys):
    pytest.importorskip("kubernetes")
    groups = [{"name": "h100", "recipe": "bf16", "accelerator": "H100", "spawn": False},
              {"name": "bare-a", "recipe": "bf16", "spawn": False},
              {"name": "cpu", "recipe": "bf16", "accelerator": "cpu", "spawn": False},
              {"name": "counted", "recipe": "bf16", "spawn": False, "resources": {"num_gpus": 2}},
              {"name": "bare-b", "recipe": "bf16", "spawn": False, "processes": 3}]
    config = {"run": {"name": "r"}, "groups": groups}
    assert _render(tmp_path, "k8s", config=config) == 0
    # one line per group that asks for nothing (explicit cpu is a choice; a bare count is a request)
    assert capsys.readouterr().err == WARN.format("bare-a") + WARN.format("bare-b")
    docs = {p.name.split(".")[0]: yaml.safe_load(p.read_text()) for p in (tmp_path / "k8s").glob("*.yaml")}
    pods = {name[2:]: _k8s_model(doc)[0].spec.template.spec for name, doc in docs.items()}
    assert pods["h100"].containers[0].resources.limits == {"nvidia.com/gpu": "1"}
    assert pods["h100"].node_selector == {"nvidia.com/gpu.product": "H100"}
    assert pods["counted"].containers[0].resources.limits == {"nvidia.com/gpu": "2"}
    assert pods["counted"].node_selector is None
    for bare in ("bare-a", "bare-b", "cpu"):
        assert pods[bare].containers[0].resources.limits is None and pods[bare].node_selector is None
    assert _render(tmp_path, "skypilot", config=config) == 0
    assert capsys.readouterr().err == WARN.format("bare-a") + WARN.format("bare-b")
    tasks = {p.name.split(".")[0][2:]: yaml.safe_load(p.read_text())
             for p in (tmp_path / "skypilot").glob("*")}
    assert tasks["h100"]["resources"] == {"accelerators": "H100:1"}
    assert tasks["cpu"]["resources"] == tasks["bare-a"]["resources"] == {}


def test_node_selector_values_map_accelerators_and_bad_ones_are_one_line(tmp_path, capsys):
    config = {"groups": [{"name": "a", "recipe": "bf16", "spawn": False, "accelerator": "H100"},
                         {"name": "b", "recipe": "bf16", "spawn": False, "accelerator": "A100"}]}
    assert _render(tmp_path, "k8s", "--node-selector-value", "H100=NVIDIA-H100-80GB-HBM3", config=config) == 0
    sel = {p.name: yaml.safe_load(p.read_text())["spec"]["template"]["spec"]["nodeSelector"]
           for p in (tmp_path / "k8s").glob("*.yaml")}
    assert sel == {"run-a.deployment.yaml": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                   "run-b.deployment.yaml": {"nvidia.com/gpu.product": "A100"}}  # unmapped: the name
    capsys.readouterr()
    for bad, says in ((["H100"], "expected ACCELERATOR=LABEL_VALUE"),
                      (["B200=x"], "no group of the config has accelerator 'B200' (they have: A100, H100)"),
                      (["H100=NVIDIA H100"], "'NVIDIA H100' is not a Kubernetes label value")):
        assert _render(tmp_path, "k8s", "--node-selector-value", *bad, config=config) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
