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
