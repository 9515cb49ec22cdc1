import json
import struct
import subprocess
import sys
import textwrap

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
    events = _read_events(tmp_path / "tensorboard")
    assert [e.step for e in events] == list(range(12))
    scalars = {v.tag: v.simple_value for v in events[3].summary.value}
    assert scalars["k3"] == pytest.approx(4e-3) and scalars["group/fp8/k3"] == pytest.approx(2e-3)
    assert "entropy" not in scalars  # NaN is left out of TensorBoard (null in the JSONL)
    written = {p.name for p in plot_run(tmp_path)}
    assert {"reward.png", "kl.png", "grad_norm.png", "terminations.png"} <= written
    assert (tmp_path / "plots" / "kl.png").stat().st_size > 1000



def _read_events(directory):
    """The step events of the one event file in ``directory`` (TFRecord framing, no CRC check)."""
    from tensorboardX.proto.event_pb2 import Event

    (path,) = list(directory.iterdir())
    data, events, pos = path.read_bytes(), [], 0
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        events.append(Event.FromString(data[pos + 12:pos + 12 + n]))
        pos += 12 + n + 4
    return [e for e in events if e.HasField("summary")]


def test_a_full_disk_stops_the_writer_at_once():
    """tensorboardX's queued writer thread died on a full disk and the next step blocked forever
    on its queue (a trainer hang seen in CI); the sink raises where the step is written."""
    script = textwrap.dedent("""
        import resource, sys, tempfile
        from trainer_jax.diagnostics import MetricsSink
        sink = MetricsSink(tempfile.mkdtemp())
        sink.write(0, {"loss": 1.0})
        resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))
        # the TensorBoard writer alone ("tb": the old writer's thread died while the JSONL's
        # line of that step had gone through), or the whole sink
        write = sink._tb.write if sys.argv[1] == "tb" else sink.write
        for step in range(1, 100):
            try:
                write(step, {f"metric/{i}": float(i) for i in range(40)})
            except OSError as e:
                print("stopped at", step, e)
                break
    """)
    for kind in ("tb", "jsonl"):
        out = subprocess.run([sys.executable, "-c", script, kind], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "stopped at 1 " in out.stdout and "File too large" in out.stdout, \
            out.stdout + out.stderr


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
