"""The planner's behaviour its cosmic-ray mutants showed untested (issue 46; docs/testing.md): the
replica count read from the spawned samplers' logs, whatever the length of the group's name."""

from __future__ import annotations

import json


def test_replicas_are_counted_from_the_samplers_logs_for_names_of_any_length(tmp_path):
    from experiments.plan import read_run

    names = ("fp8", "bf16", "nvfp4", "mxfp4-b")  # 3, 4, 5 and 7 characters
    rows = [{"step": s + 1, "samples_trained": 10.0,
             **{f"group/{g}/{k}": v for g in names for k, v in (
                 ("sample_share", 0.25), ("tokens", 100.0), ("tokens_per_s", 50.0), ("k3", 0.01),
                 ("out_of_range", 0.0), ("dropped", 0.0), ("staleness", 1.0))}}
            for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logs = tmp_path / "logs"
    logs.mkdir()
    for name, n in (("fp8", 3), ("bf16", 2), ("nvfp4", 1), ("mxfp4-b", 2)):
        for i in range(n):
            (logs / f"{name}-{i}.log").write_text("up\n")
    (logs / "fp8-boot.log").write_text("")  # not a sampler's: no index
    (logs / "nvfp4-1-old.log").write_text("")
    groups = read_run(tmp_path)
    assert {g: (m.replicas, m.replicas_from) for g, m in groups.items()} == {
        "fp8": (3.0, "logs/"), "bf16": (2.0, "logs/"), "nvfp4": (1.0, "logs/"), "mxfp4-b": (2.0, "logs/")}
