import json

import pytest

from trainer_jax.diagnostics import CollapseAlarms, MetricsSink, plot_run, read_metrics


def test_sink_writes_jsonl_and_tensorboard_and_plots(tmp_path):
    sink = MetricsSink(tmp_path)
    for step in range(12):
        sink.write(step, {"reward_mean": step / 12, "k3": 1e-3 * (1 + step), "grad_norm": 1.0,
                          "group/fp8/k3": 2e-3, "group/bf16/k3": 1e-3, "termination/answered": 0.9,
                          "entropy": float("nan")})
    sink.close()
    records = read_metrics(tmp_path)
    assert len(records) == 12 and records[3]["step"] == 3 and records[3]["entropy"] is None
    assert any(p.name.startswith("events") for p in (tmp_path / "tensorboard").iterdir())
    written = {p.name for p in plot_run(tmp_path)}
    assert {"reward.png", "kl.png", "grad_norm.png", "terminations.png"} <= written
    assert (tmp_path / "plots" / "kl.png").stat().st_size > 1000


def test_partial_last_line_is_tolerated_but_corruption_is_not(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0}) + "\n" + '{"step": 1, "lo')
    assert read_metrics(tmp_path) == [{"step": 0}]
    path.write_text('{"ste\n' + json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match=":1"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "nope")


def test_alarms_fire_on_the_seed_failure_modes():
    alarms = CollapseAlarms(baseline_steps=3, window=3)
    fired = []
    for step in range(20):
        reward = 0.6 if step < 10 else 0.05
        k3 = 1e-3 if step < 10 else 5e-3
        empty = 0.0 if step < 15 else 0.5
        fired.append(alarms.update(reward, k3, empty))
    assert not any(fired[:10])
    assert any("reward collapsing" in a for a in fired[14])
    assert any("KL" in a for a in fired[14])
    assert any("empty replies" in a for a in fired[16])


def test_alarm_transitions_report_each_alarm_once_and_its_end():
    alarms = CollapseAlarms(baseline_steps=3, window=3)
    printed = []
    for step in range(30):
        k3 = 5e-3 if 10 <= step < 20 else 1e-3
        printed.append(alarms.transitions(alarms.update(0.5, k3, 0.0)))
    kl_lines = [(step, line) for step, lines in enumerate(printed) for line in lines if "KL" in line]
    # One line when the KL alarm starts (its moving average crosses 3x), one when it ends.
    assert len(kl_lines) == 2, kl_lines
    (start, first), (end, last) = kl_lines
    assert 10 <= start < 20 and first.startswith("KL blow-up: k3 at")
    assert end > start and last == "cleared: KL blow-up"


def test_kl_alarm_holds_until_well_below_its_threshold():
    # k3 settles at 1e-3, then hovers around 3x (2.5x / 3.5x alternating): the alarm rises once and
    # stays up (hysteresis) instead of toggling; it clears when k3 returns under 2x.
    hover = [1e-3] * 6 + [3.5e-3, 2.5e-3] * 10 + [1e-3] * 8
    alarms = CollapseAlarms(baseline_steps=3, window=1)
    printed = [line for k3 in hover for line in alarms.transitions(alarms.update(0.5, k3, 0.0))]
    assert [line.split(":")[0] for line in printed] == ["KL blow-up", "cleared"], printed
    no_hysteresis = CollapseAlarms(baseline_steps=3, window=1, kl_clear_factor=3.0)
    toggles = [line for k3 in hover for line in no_hysteresis.transitions(no_hysteresis.update(0.5, k3, 0.0))]
    assert len(toggles) > 10
    with pytest.raises(ValueError, match="kl_clear_factor"):
        CollapseAlarms(kl_factor=3.0, kl_clear_factor=4.0)


def test_kl_baseline_starts_after_the_settle_steps():
    # k3 ramps up during warmup and then holds: measured from step 0 the plateau looks like a
    # blow-up, measured after the ramp it does not.
    ramp = [1e-4 * (i + 1) for i in range(5)] + [1e-3] * 20
    eager, settled = CollapseAlarms(baseline_steps=3, window=3), CollapseAlarms(baseline_steps=3, window=3,
                                                                                 settle_steps=5)
    assert any("KL" in a for k3 in ramp for a in eager.update(0.5, k3, 0.0))
    assert not any("KL" in a for k3 in ramp for a in settled.update(0.5, k3, 0.0))
