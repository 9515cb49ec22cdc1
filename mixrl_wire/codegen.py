"""Regenerate the Python modules of ``proto/`` into ``mixrl_wire/``.

    .venv/bin/python -m mixrl_wire.codegen            # rewrite mixrl_wire/v1/*_pb2*.py(i)
    .venv/bin/python -m mixrl_wire.codegen --check    # exit 1 if the checked-in files are stale

The protos live at ``proto/mixrl/v1/*.proto`` (directory = proto package, as buf expects), so protoc
names the generated modules ``mixrl.v1.*``. A top-level ``mixrl`` package would be easy to shadow
and ``proto`` collides with the ``proto-plus`` distribution, so the modules are written under
``mixrl_wire/v1/`` and the one absolute import protoc emits between them is rewritten to match.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "proto"
OUT_ROOT = REPO / "mixrl_wire"
# protoc's import of a sibling generated module, e.g. "from mixrl.v1 import rollout_pb2 as ..."
_IMPORT = re.compile(r"^from mixrl\.v1 import ", re.MULTILINE)
_PYI_IMPORT = re.compile(r"^(from|import) mixrl\.v1", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("mixrl/**/*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) on every proto into ``out_dir/v1/``; return the files."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    with tempfile.TemporaryDirectory() as tmp:
        import grpc_tools

        include = Path(grpc_tools.__file__).parent / "_proto"
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *(str(p.relative_to(PROTO_ROOT)) for p in proto_files())]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        written = []
        for src in sorted(Path(tmp, "mixrl", "v1").glob("*")):
            text = src.read_text()
            text = _IMPORT.sub("from mixrl_wire.v1 import ", text)
            text = _PYI_IMPORT.sub(lambda m: f"{m.group(1)} mixrl_wire.v1", text)
            dst = out_dir / "v1" / src.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text)
            written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mixrl_wire.codegen", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the checked-in files, write nothing")
    args = p.parse_args(argv)
    if not args.check:
        for path in generate(OUT_ROOT):
            print(f"wrote {path.relative_to(REPO)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for path in generate(Path(tmp)):
            current = OUT_ROOT / path.relative_to(tmp)
            if not current.exists() or current.read_text() != path.read_text():
                stale.append(str(current.relative_to(REPO)))
        if stale:
            print("stale generated files (run python -m mixrl_wire.codegen): " + ", ".join(stale))
            return 1
    print("generated files are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
