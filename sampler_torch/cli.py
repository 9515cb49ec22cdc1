"""`mixrl-sample`: run a sampler that joins a trainer over gRPC."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mixrl-sample",
        description="Join a mixrl trainer as a sampler: lease tasks, generate with a precision recipe, "
                    "submit trajectories, reload weights in flight.")
    p.add_argument("--trainer", required=True, help="trainer address HOST:PORT")
    p.add_argument("--group", required=True, help="sampler group name")
    p.add_argument("--recipe", default="bf16", help="precision recipe name")
    p.add_argument("--model-dir", required=True, help="initial weights (HF directory)")
    p.parse_args(sys.argv[1:] if argv is None else argv)
    print("mixrl-sample: not implemented yet (the gRPC wire issue brings the sampler loop)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
