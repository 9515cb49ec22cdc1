"""What a sampler computes on, end to end: the registration carries the device and the per-recipe
kernels through a real gRPC server into ``Status`` and the service's log line; ``groups[].device``
reaches the spawned ``mixrl-sample`` command line; a spawned group on a GPU the JAX trainer holds
is refused at config load unless JAX's memory share was lowered."""

import logging
from pathlib import Path

import pytest

from mixrl_wire.devices import DeviceError, gpu_sharing_problem, jax_platform, jax_preallocation
from sampler_torch.cli import compute_report
from sampler_torch.client import Backoff, RolloutClient
from trainer_jax.config import ConfigError, load_config
from trainer_jax.samplers import sampler_command
from trainer_jax.service import RolloutService
from trainer_jax.service.status import watch_status_lines

TOKEN = "device-token-0123"
BASE = ["service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.max_new_tokens=8",
        "tasks.sampling.head_k=4"]


@pytest.fixture
def service():
    svc = RolloutService.from_config(load_config(None, BASE), token=TOKEN).start()
    yield svc
    svc.stop(grace=0)


def _client(svc, name, **kw) -> RolloutClient:
    return RolloutClient(svc.address, TOKEN, group="g", name=name, capacity=2, max_retry_s=3.0,
                         backoff=Backoff(initial_s=0.01, max_s=0.1), **kw)


def test_registration_carries_device_and_kernels_into_status(service, caplog):
    report = compute_report("cpu", "engine")  # probed here, as mixrl-sample does
    assert report["type"] == "cpu" and report["kernels"]["bf16"] == "native"
    with caplog.at_level(logging.INFO, logger="mixrl.service"):
        a = _client(service, "with-device", recipe={"name": "fp8"}, device=report)
        b = _client(service, "old-sampler")  # a sampler that predates the field
        try:
            a.register()
            b.register()
            st = a.status()
            line = next(watch_status_lines(service, 0.01))  # mixrl-train serve's status line
        finally:
            a.close()
            b.close()
    by_name = {s.name: s for s in st.samplers}
    dev = by_name["with-device"].device
    assert (dev.type, dev.name) == ("cpu", report["name"])
    assert dict(dev.kernels) == report["kernels"]
    assert set(dev.kernels) >= {"bf16", "fp8", "int8", "nvfp4_w4a4"}
    assert not by_name["old-sampler"].HasField("device")
    assert " samplers=2 devices=?=1,cpu=1 " in line, line
    snap = {s["name"]: s for s in service.status()["samplers"]}
    assert snap["with-device"]["device"]["kernels"] == report["kernels"]
    lines = [r.getMessage() for r in caplog.records if "registered" in r.getMessage()]
    assert any("with-device" in m and f"cpu {report['name']}, fp8 matmuls "
               f"{report['kernels']['fp8']}" in m for m in lines), lines
    assert any("old-sampler" in m and "device unreported" in m for m in lines), lines


def test_server_backends_report_no_kernels():
    assert compute_report("cpu", "vllm") == {"type": "server", "name": "vllm", "kernels": {}}


# ------------------------------------------------------------------------- config


def test_group_device_and_compile_reach_the_command_line():
    cfg = load_config(None, ["groups=[{name: a, device: 'cuda:1', spawn: false}, {name: b}]"])
    a, b = cfg.groups
    assert (a.device, b.device, b.compile) == ("cuda:1", "auto", "auto")
    kw = dict(address="127.0.0.1:5", model_dir=Path("m"), token_file=Path("t"),
              cache_dir=Path("c"), episode_tokens=16)
    cmd = sampler_command(a, 0, **kw)
    assert cmd[cmd.index("--device") + 1] == "cuda:1"
    cmd = sampler_command(b.model_copy(update={"compile": "on"}), 0, **kw)
    assert (cmd[cmd.index("--device") + 1], cmd[cmd.index("--compile") + 1]) == ("auto", "on")


def test_bad_group_device_is_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["groups=[{name: a, device: gpu0}]"])
    msg = str(e.value)
    assert "\n" not in msg and "groups.0.device" in msg and "expected auto, cpu, cuda or cuda:N" in msg


def test_gpu_sharing_rule():
    gpu = "gpu"
    assert gpu_sharing_problem(["cuda:0"], {}, "cpu") is None          # a CPU trainer holds no GPU
    assert gpu_sharing_problem(["cpu"], {}, gpu) is None                # CPU samplers need none
    for spec in ("auto", "cuda", "cuda:1"):
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in gpu_sharing_problem([spec], {}, gpu)
    assert gpu_sharing_problem(["cuda"], {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, gpu) is None
    assert gpu_sharing_problem(["cuda"], {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"}, gpu)
    assert gpu_sharing_problem(["cuda"], {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, gpu) is None
    assert gpu_sharing_problem(["cuda"], {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, gpu) is None
    assert jax_preallocation({}) == 0.75
    with pytest.raises(DeviceError, match="not a fraction"):
        jax_preallocation({"XLA_PYTHON_CLIENT_MEM_FRACTION": "half"})
    assert jax_platform({"JAX_PLATFORMS": "cuda,cpu"}) == "gpu"
    assert jax_platform({"JAX_PLATFORMS": "cpu"}) == "cpu"
    assert jax_platform({"JAX_PLATFORMS": "tpu"}) == "tpu"


def test_sampler_on_the_trainers_gpu_refused_at_load(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # the trainer's JAX will hold the GPUs
    for var in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["groups=[{name: s, device: 'cuda:0'}]"])
    msg = str(e.value)
    assert "\n" not in msg and "group 's'" in msg and "XLA_PYTHON_CLIENT_MEM_FRACTION" in msg
    with pytest.raises(ConfigError, match="auto"):  # the default device resolves to a GPU there
        load_config(None, [])
    load_config(None, ["groups=[{name: s, device: cpu}]"])               # a CPU group is fine
    load_config(None, ["groups=[{name: s, device: cuda, spawn: false}]"])  # not spawned: not ours
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
    assert load_config(None, ["groups=[{name: s, device: 'cuda:0'}]"]).groups[0].device == "cuda:0"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "lots")
    with pytest.raises(ConfigError, match="not a fraction"):
        load_config(None, [])
