"""``mixrl-fleet render`` with an --out it cannot write: one line and exit 2, not a traceback."""

import yaml

from fleet.cli import main


def test_an_unwritable_out_is_one_line_and_exit_2(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"groups": [{"name": "a", "recipe": "bf16", "spawn": False,
                                                  "accelerator": "H100"}]}))
    taken = tmp_path / "out"
    taken.write_text("a file, not a directory")
    for target in ("k8s", "skypilot"):
        assert main(["render", "--target", target, "--config", str(config), "--out", str(taken)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--out" in err and str(taken) in err, err
