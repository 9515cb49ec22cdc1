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
# Where a generator stamps its own release into what it writes: grpcio-tools' plugin as
# GRPC_GENERATED_VERSION, protoc as a comment and the runtime-version check's numbers. A newer
# grpcio-tools than the one that made the checked-in files changes only these, so ``--check``
# compares the files without them (the runtime checks still hold the checked-in files' floor).
_STAMPS = (
    re.compile(r"^(GRPC_GENERATED_VERSION = )'[^']*'", re.MULTILINE),
    re.compile(r"^(# Protobuf Python Version: ).*$", re.MULTILINE),
    re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,"
               r"\s*\d+,\s*'[^']*',"),
)
_VERSION = re.compile(r"^GRPC_GENERATED_VERSION = '([^']*)'|^# Protobuf Python Version: (.*)$", re.MULTILINE)


def unstamped(text: str) -> str:
    """``text`` with the generators' version stamps replaced by a placeholder."""
    for stamp in _STAMPS:
        text = stamp.sub(lambda m: m.group(1) + "<version>", text)
    return text


def stamp_of(text: str) -> str:
    """The generator release a generated file names (grpc or protobuf), or ``unknown``."""
    m = _VERSION.search(text)
    return next((g for g in m.groups() if g), "unknown") if m else "unknown"


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


def stale(out_root: Path = OUT_ROOT) -> list[str]:
    """The generated files under ``out_root`` that differ from what protoc makes of ``proto/`` now,
    version stamps aside, each named with the generator releases of both sides."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            current = out_root / path.relative_to(tmp)
            fresh = path.read_text()
            old = current.read_text() if current.exists() else None
            if old is None:
                problems.append(f"{current.name} (missing)")
            elif unstamped(old) != unstamped(fresh):
                problems.append(f"{current.name} (checked in by generator {stamp_of(old)}, "
                                f"this one is {stamp_of(fresh)})")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mixrl_wire.codegen", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the checked-in files, write nothing")
    args = p.parse_args(argv)
    if not args.check:
        for path in generate(OUT_ROOT):
            print(f"wrote {path.relative_to(REPO)}")
        return 0
    if problems := stale():
        print("stale generated files (run python -m mixrl_wire.codegen): " + "; ".join(problems))
        return 1
    print("generated files are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
