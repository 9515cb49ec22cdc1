"""Mutation testing of the core modules with cosmic-ray (issue 37; docs/testing.md).

``make mutate [MODULE=name] [SAMPLE=N] [SEED=S]`` runs this. Per module it mutates the module's
files in a git clone of this repository's HEAD under ``--workdir`` (never in the working tree:
cosmic-ray rewrites sources in place) and runs only the test files that cover the module, with
the suite's own pytest settings (pyproject.toml) plus ``-x -q -p no:cacheprovider`` and the
markers ``make test`` uses. The clone's code is what the tests import (``PYTHONPATH`` = the clone,
checked before any mutant runs), and a baseline run of the unmutated tests must pass first.

Resumable: the session (cosmic-ray's sqlite work db) survives an interrupted run; the same
command continues with the mutants not yet run, while the commit, sample and seed match. A
seeded sample (``--sample N --seed S``) runs N mutants chosen from all of the module's, sorted by
file, operator and occurrence (stable across runs); the rest are marked skipped.

Writes ``<results>/<module>.json``: commit, date, totals, killed / survived / timeout / incompetent,
sample size, and every survivor with its diff (what a new test has to catch).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import functools
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

# module name -> (paths to mutate, test files that cover them).
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "objective": (["trainer_jax/objective"],
                  ["tests/objective/test_mutation_objective.py", "tests/objective/test_components.py",
                   "tests/trainer/test_staleness_metrics.py"]),
    # every file the CPU runs: the Pallas kernels through the Pallas interpreter (the tests' CPU
    # default); not device_check.py, the one-shot accelerator check (needs a GPU or TPU)
    "linear_logsumexp": ([f"trainer_jax/kernels/linear_logsumexp/{f}.py" for f in (
                             "__init__", "_online", "api", "names", "pallas", "pallas_common", "pallas_gpu",
                             "pallas_tpu", "reference", "xla")],
                         ["tests/kernels/test_mutation_linear_logsumexp.py",
                          "tests/kernels/test_linear_logsumexp.py"]),
    # test_learner's packed-forward test (24 s of compiling) is left out: the packing test
    # asserts the ids, segments and positions it feeds
    "batching": (["trainer_jax/batching.py"],
                 ["tests/trainer/test_mutation_batching.py",
                  "tests/trainer/test_learner.py::test_overflow_is_left_for_later_and_staleness_masks",
                  "tests/trainer/test_learner.py::test_sample_validation"]),
    "checkpoint": (["trainer_jax/checkpoint.py", "trainer_jax/resume.py"],
                   ["tests/trainer/test_mutation_checkpoint.py", "tests/trainer/test_checkpoint.py",
                    "tests/trainer/test_mutation_resume.py",
                    "tests/trainer/test_run_dir.py"]),
    "validation": (["trainer_jax/service/validation.py"],
                   ["tests/service/test_reward_parts_inf.py",
                    "tests/service/test_validation.py", "tests/service/test_mutation_validation.py",
                    "tests/service/test_validation_fast.py"]),
    "scheduler": (["trainer_jax/service/scheduler.py"],
                  ["tests/service/test_mutation_scheduler.py", "tests/service/test_service.py",
                   "tests/service/test_evaluation_tasks.py"]),
    "delta": (["convert/delta.py", "convert/delta_codec.py"],
              ["tests/convert/test_mutation_delta.py", "tests/convert/test_delta.py",
               "tests/convert/test_delta_codec.py", "tests/convert/test_mutation_delta_records.py"]),
    "manifest": (["convert/manifest.py"],
                 ["tests/convert/test_mutation_manifest.py", "tests/convert/test_export_publish.py"]),
    "formats": (["convert/formats"],
                ["tests/convert/test_mutation_formats.py", "tests/convert/test_formats.py",
                 "tests/convert/test_numerics.py", "tests/convert/test_mutation_formats_scales.py"]),
    "weights_fetch": (["sampler_torch/weights_fetch.py"],
                      ["tests/sampler/test_weights_fetch_roots.py",
                       "tests/service/test_mutation_weights_fetch.py",
                       "tests/service/test_weight_deltas.py"]),
    "sampling": (["sampler_torch/engine/sampling.py"],
                 ["tests/sampler/test_topp_reference.py",
                  "tests/sampler/test_mutation_sampling.py", "tests/sampler/test_engine.py",
                  "tests/sampler/test_logit_noise.py::"
                  "test_noise_is_standard_normal_and_a_pure_function_of_seed_counter_and_id"]),
    # test_jail's two-sandbox fork bomb is left out: its cgroup-empty check after a kill races under
    # load (failed once unmutated here), and a flaky test would count as a kill
    "sandbox": (["envs/sandbox.py"],
                ["tests/envs/test_mutation_sandbox.py", "tests/envs/test_sandbox.py"]
                + [f"tests/envs/test_jail.py::test_{t}" for t in (
                    "limits_in_force_inside_are_the_configured_ones",
                    "process_count_past_the_pids_limit_is_refused_by_the_cgroup",
                    "memfd_past_the_memory_limit_is_stopped", "sysv_ipc_is_gone_when_the_run_ends",
                    "setsid_sleep_is_gone_after_a_timeout_and_after_close",
                    "disk_fill_stops_at_the_writable_area_size",
                    "the_jail_dies_with_its_owner_and_the_next_sandbox_cleans_up")]),
    "rewards": (["envs/rewards"], ["tests/envs/test_mutation_rewards.py", "tests/envs/test_math_answers.py",
                                   "tests/envs/test_rewards.py",
                                   "tests/envs/test_code_reward.py", "tests/envs/test_reward_workers.py",
                                   "tests/envs/test_reward_requests.py"]),
    "router": (["trainer_jax/service/router.py"],
               ["tests/service/test_router_limits.py", "tests/service/test_mutation_router.py",
                "tests/cost/test_cost_accounting.py",
                "tests/service/test_service.py::test_router_shares_follow_measured_throughput",
                "tests/service/test_service.py::test_router_quota_limits_a_group_and_status_exports_shares"]),
    # issue 46: the decision functions named there, each with its reference test first
    # not test_cli_subcommand (a fresh interpreter per run, 120 s limit: timed out unmutated at a
    # load of 40) nor the dial-limits report test (reads the committed report, not the solver)
    "plan": (["experiments/plan_solve.py", "experiments/plan.py", "trainer_jax/plan_file.py"],
             ["tests/experiments/test_plan_reference.py"]
             + [f"tests/experiments/test_plan.py::test_{t}" for t in (
                 "plan_finds_the_optimum_greedy_misses", "min_and_max_replicas",
                 "default_limits_judge_what_a_precision_adds", "solver_is_exact_against_brute_force",
                 "bad_input_is_one_line_and_exit_2", "plan_merges_into_a_run_config")]
             + ["tests/experiments/test_mutation_plan.py"]),
    "probes": (["trainer_jax/service/probes.py", "mixrl_wire/probe.py"],
               ["tests/service/test_probe_judgement.py",
                "tests/sampler/test_probe.py::test_probe_json_round_trips_and_malformed_files_name_the_problem",
                "tests/sampler/test_probe.py::test_judge_tells_older_current_undecided_and_above_bound_apart",
                "tests/sampler/test_probe.py::test_run_bounds_alarm_on_a_jump_over_the_groups_own_baseline_once",
                "tests/service/test_mutation_probes.py"]),
    # not test_fleet_parts' import-time check (a fresh interpreter, timed out unmutated under load)
    "fleet": (["fleet/autoscale.py", "fleet/controller.py"],
              ["tests/fleet/test_autoscale_donor.py", "tests/fleet/test_controller_backoff.py",
               "tests/fleet/test_autoscale_edges.py", "tests/fleet/test_mutation_fleet.py"]
              + [f"tests/fleet/test_fleet_parts.py::test_{t}" for t in (
                  "autoscale_moves_a_replica_from_a_masked_or_idle_group_to_the_best_per_dollar",
                  "autoscale_reads_the_wire_status",
                  "the_controller_moves_a_replica_by_the_trainers_status")]),
    "batch_shape": (["trainer_jax/batch_shape.py"],
                    ["tests/trainer/test_batch_shape_fit.py", "tests/trainer/test_batch_shape.py",
                     "tests/trainer/test_mutation_batch_shape.py"]),
    "verifiers": (["envs/verifiers_env.py"],
                  ["tests/envs/test_verifiers_rerender.py", "tests/envs/test_env_verifiers.py",
                   "tests/envs/test_mutation_verifiers.py"]),
}
# Left out of a run of every module: the sandbox's mutants run as root with its jail (one chowned /
# and /tmp on the machine that ran it): name it, inside scripts/throwaway_root.sh (docs/testing.md).
LATER = {"sandbox"}
# Survivors judged equivalent (no test can tell them apart), each with why: [{"file", "code" (the
# line, stripped), "mutant" (the mutated line, or "*": any mutant of that line), "why"}], and
# "line" where the same code stands on more than one line of the file.
EQUIVALENT = Path(__file__).with_name("mutate_equivalent.json")
PYTEST = "-m pytest -x -q -p no:cacheprovider -m 'not slow and not gpu'"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def prepare_clone(clone: Path) -> str:
    """A clone of this repository's HEAD at ``clone``, reset to it (a killed run may have left a
    mutant on disk); returns the commit."""
    head = _run(["git", "-C", str(REPO), "rev-parse", "HEAD"]).stdout.strip()
    if not (clone / ".git").is_dir():
        clone.parent.mkdir(parents=True, exist_ok=True)
        _run(["git", "clone", "-q", str(REPO), str(clone)])
    _run(["git", "-C", str(clone), "fetch", "-q", str(REPO), head])
    _run(["git", "-C", str(clone), "reset", "-q", "--hard", head])
    _run(["git", "-C", str(clone), "clean", "-q", "-fdx", "-e", ".mutate"])
    return head


def test_env(clone: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(clone), "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports(clone: Path, paths: list[str]) -> None:
    """The tests must import the clone's modules, not the editable install's (the working tree)."""
    top = sorted({p.split("/")[0] for p in paths})
    code = "; ".join(f"import {t}; print({t}.__file__)" for t in top)
    files = _run([PY, "-c", code], cwd=clone, env=test_env(clone)).stdout.split()
    wrong = [f for f in files if not Path(f).resolve().is_relative_to(clone.resolve())]
    if wrong:
        sys.exit(f"mutate: the tests would import {wrong}, not the clone's code in {clone}")


def test_command(clone: Path, name: str, timeout: float, *, quiet: bool = False,
                 tests: list[str] | None = None) -> str:
    """The pytest command line that runs ``name``'s mapped tests (those in the clone's commit),
    or ``tests`` of them."""
    tests = MODULES[name][1] if tests is None else tests
    missing = [t for t in tests if not (clone / t.split("::")[0]).exists()]
    tests = [t for t in tests if t not in missing]
    if missing and not quiet:
        print(f"mutate {name}: not in this commit, left out: {', '.join(missing)}")
    if not tests:  # pytest given no path collects the whole suite (or none): never a mutant's verdict
        sys.exit(f"mutate {name}: none of the tests {', '.join(missing)} is in this commit: nothing "
                 "to run the mutants against")
    return f"{shlex.quote(PY)} {PYTEST} --timeout={int(timeout)} {' '.join(tests)}"


def write_config(clone: Path, name: str, timeout: float, *, quiet: bool = False) -> Path:
    paths = MODULES[name][0]
    command = test_command(clone, name, timeout, quiet=quiet)
    cfg = (f'[cosmic-ray]\nmodule-path = {json.dumps(paths)}\ntimeout = {timeout}\nexcluded-modules = []\n'
           f'test-command = {json.dumps(command)}\n\n[cosmic-ray.distributor]\nname = "local"\n')
    path = clone / ".mutate" / f"{name}.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(cfg)
    return path


def baseline(clone: Path, config: Path) -> float:
    """Run the unmutated tests once: they must pass, and their time sets the mutants' timeout."""
    from cosmic_ray.config import load_config

    return baseline_command(clone, load_config(str(config)).test_command)


def baseline_command(clone: Path, command: str) -> float:
    """Run ``command`` (the unmutated tests) in the clone: it must pass; returns its seconds."""
    t0 = time.monotonic()
    proc = subprocess.run(["nice", "-n", "19", *shlex.split(command)], cwd=clone, env=test_env(clone),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"mutate: the unmutated tests fail in {clone}:\n{proc.stdout[-3000:]}")
    return time.monotonic() - t0


def tree_ids(clone: Path, paths: list[str]) -> dict[str, str]:
    """Git object ids of ``paths`` at the clone's HEAD: what identifies a session's mutants."""
    files = sorted({p.split("::")[0] for p in paths})
    return {p: _run(["git", "-C", str(clone), "rev-parse", f"HEAD:{p}"]).stdout.strip()
            for p in files if (clone / p).exists()}


def init_session(config: Path, db: Path, meta: dict, sample: int | None, seed: int) -> None:
    """A new work db unless one for the same module sources, sample and seed exists: then resume
    it, and when the test files changed since, run its survivors (and incompetents) again."""
    from cosmic_ray.work_db import WorkDB, WorkResultStorage, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    meta_path = db.with_suffix(".meta.json")
    same = ("sample", "seed", "paths", "sources")
    old = json.loads(meta_path.read_text()) if db.exists() and meta_path.exists() else None
    if old is not None and all(old.get(k) == meta[k] for k in same):
        if old.get("tests") != meta["tests"]:
            with use_db(str(db), WorkDB.Mode.open) as work_db:
                again = [j for j, r in work_db.results if r.worker_outcome != WorkerOutcome.SKIPPED
                         and r.test_outcome != TestOutcome.KILLED]
                with work_db._session_maker.begin() as session:  # cosmic-ray 8.7 has no public delete
                    session.query(WorkResultStorage).filter(WorkResultStorage.job_id.in_(again)).delete()
            print(f"mutate: the tests changed since the session began: {len(again)} survivors run again")
        meta_path.write_text(json.dumps(meta))
        return
    db.unlink(missing_ok=True)
    _run([*_cosmic_ray(), "init", str(config), str(db)], cwd=config.parent.parent)
    if sample is not None:
        with use_db(str(db), WorkDB.Mode.open) as work_db:
            items = sorted(work_db.work_items, key=lambda w: (
                str(w.mutations[0].module_path), w.mutations[0].operator_name, w.mutations[0].occurrence))
            if sample < len(items):
                keep = {w.job_id for w in random.Random(seed).sample(items, sample)}
                work_db.set_multiple_results([w.job_id for w in items if w.job_id not in keep],
                                             WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    meta_path.write_text(json.dumps(meta))


def _cosmic_ray() -> list[str]:
    exe = Path(PY).parent / "cosmic-ray"
    return [str(exe)] if exe.exists() else [PY, "-m", "cosmic_ray.cli"]


def _changed_lines(diff: str) -> tuple[str, str]:
    """The mutated line as it was and as the mutant has it (stripped; "" for a removed line)."""
    lines = diff.splitlines()

    def first(sign: str) -> str:
        return next((ln[1:].strip() for ln in lines
                     if ln.startswith(sign) and not ln.startswith(sign * 3) and ln[1:].strip()), "")
    return first("-"), first("+")


def annotations(tree: ast.AST) -> list[ast.AST]:
    """Every annotation in ``tree`` (arguments, annotated assignments, return types)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg | ast.AnnAssign):
            found.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append(node.returns)
    return [a for a in found if a is not None]


@functools.cache
def _annotation_spans(clone: Path, commit: str, path: str) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Where the annotations of ``path`` at ``commit`` are, when its ``from __future__ import
    annotations`` means they are never evaluated (a mutant inside one is equivalent); else ()."""
    tree = ast.parse(_run(["git", "-C", str(clone), "show", f"{commit}:{path}"]).stdout)
    if not any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
               and any(a.name == "annotations" for a in n.names) for n in tree.body):
        return ()
    return tuple(((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in annotations(tree))


def load_equivalents() -> dict[tuple[str, str, str], list[dict]]:
    """``EQUIVALENT``'s entries by (file, code, mutant)."""
    known: dict[tuple[str, str, str], list[dict]] = {}
    for e in json.loads(EQUIVALENT.read_text()) if EQUIVALENT.exists() else []:
        known.setdefault((e["file"], e["code"], e["mutant"]), []).append(e)
    return known


def judged(known: dict, path: str, code: str, mutant: str, line: int) -> str | None:
    """The reason a listed entry gives (an entry with a "line" only for that line: the same
    code can stand on two lines of a file, one of them tested)."""
    return next((e["why"] for key in ((path, code, mutant), (path, code, "*"))
                 for e in known.get(key, ()) if e.get("line", line) == line), None)


def report(db: Path, name: str, meta: dict) -> dict:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts = {"killed": 0, "survived": 0, "equivalent": 0, "timeout": 0, "incompetent": 0, "pending": 0}
    known = load_equivalents()
    survivors = []
    with use_db(str(db), WorkDB.Mode.open) as work_db:
        total = work_db.num_work_items
        results = dict(work_db.results)
        for item in work_db.work_items:
            m = item.mutations[0]
            r = results.get(item.job_id)
            if r is None:
                counts["pending"] += 1
            elif r.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            elif r.worker_outcome != WorkerOutcome.NORMAL or r.test_outcome == TestOutcome.INCOMPETENT:
                counts["incompetent"] += 1
            elif r.test_outcome == TestOutcome.SURVIVED:
                line, mutant = _changed_lines(r.diff)
                path = str(m.module_path)
                why = judged(known, path, line, mutant, m.start_pos[0]) or (
                    "inside an annotation, never evaluated (from __future__ import annotations)"
                    if any(lo <= tuple(m.start_pos) < hi for lo, hi in _annotation_spans(
                        db.parent.parent / "clone", meta["commit"], path)) else None)
                counts["equivalent" if why else "survived"] += 1
                survivors.append({"file": str(m.module_path), "operator": m.operator_name,
                                  "occurrence": m.occurrence, "line": m.start_pos[0], "code": line,
                                  "mutant": mutant, "equivalent": why})
            elif (r.output or "").strip() == "timeout":
                counts["timeout"] += 1
            else:
                counts["killed"] += 1
    run = counts["killed"] + counts["survived"] + counts["timeout"]
    out = {"module": name, **meta, "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "mutants_total": total, "sample_size": meta["sample"] or total, **counts,
           # killed (a timeout is a kill) of the non-equivalent mutants run
           "score": round((counts["killed"] + counts["timeout"]) / run, 3) if run else None,
           "survivors": sorted(survivors, key=lambda s: (s["file"], s["line"]))}
    return out


def mutate(name: str, *, workdir: Path, results: Path, sample: int | None, seed: int,
           timeout: float | None) -> dict:
    clone = workdir / "clone"
    commit = prepare_clone(clone)
    paths, _ = MODULES[name]
    check_imports(clone, paths)
    config = write_config(clone, name, timeout or 600, quiet=True)
    took = baseline(clone, config)
    limit = timeout or max(30.0, 3 * took + 15)
    config = write_config(clone, name, limit)
    print(f"mutate {name}: commit {commit[:10]}, baseline {took:.1f} s, timeout {limit:.0f} s per mutant")
    db = workdir / "sessions" / f"{name}.sqlite"
    db.parent.mkdir(parents=True, exist_ok=True)
    tests = MODULES[name][1]
    meta = {"commit": commit, "sample": sample, "seed": seed, "paths": paths,
            "sources": tree_ids(clone, paths), "tests": tree_ids(clone, tests)}
    init_session(config, db, meta, sample, seed)
    subprocess.run(["nice", "-n", "19", *_cosmic_ray(), "exec", str(config), str(db)], cwd=clone,
                   env=test_env(clone), check=True)
    _run(["git", "-C", str(clone), "reset", "-q", "--hard", commit])  # no mutant left behind
    return write_report(db, name, meta, results, baseline_s=round(took, 1))


def write_report(db: Path, name: str, meta: dict, results: Path, **extra) -> dict:
    out = {**report(db, name, meta), **extra}
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"mutate {name}: {out['killed']} killed, {out['timeout']} timeout, {out['survived']} survived, "
          f"{out['equivalent']} equivalent, "
          f"{out['incompetent']} incompetent of {out['sample_size']} (of {out['mutants_total']}); "
          f"-> {results / (name + '.json')}")
    return out


def table(results: Path) -> str:
    """The per-module scores in ``results`` as the markdown table docs/testing.md holds: cosmic-ray's
    operators (``<module>.json``) and the human-style ones (``<module>.human.json``) side by side."""
    rows = ["| module | operators | killed | timeout | survived | equivalent | score | sample (of all) "
            "| commit | date |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    names = sorted({p.name.split(".")[0] for p in results.glob("*.json")})
    for name in names:
        for kind, path in (("cosmic-ray", results / f"{name}.json"),
                           ("human", results / f"{name}.human.json")):
            if not path.exists():
                rows.append(f"| {name} | {kind} | | | | | not run | | | |")
                continue
            r = json.loads(path.read_text())
            score = "-" if r["score"] is None else f"{r['score']:.0%}"
            rows.append(f"| {r['module']} | {kind} | {r['killed']} | {r['timeout']} | {r['survived']} | "
                        f"{r.get('equivalent', 0)} | {score} | "
                        f"{r['sample_size']} ({r['mutants_total']}), seed {r['seed']} | "
                        f"{r['commit'][:7]} | {r['date']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module", action="append", choices=sorted(MODULES),
                    help="module to mutate (repeatable; default: every core module but "
                         f"{', '.join(sorted(LATER))})")
    ap.add_argument("--sample", type=int, help="run a seeded sample of this many mutants per module")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, help="seconds per mutant (default: 3x the baseline + 15)")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("MUTATE_DIR", "/tmp/mixrl-mutate")))
    ap.add_argument("--results", type=Path, default=REPO / "docs" / "mutation")
    ap.add_argument("--report", action="store_true",
                    help="write the results of the existing sessions again (after editing "
                         f"{EQUIVALENT.name}) without running anything")
    ap.add_argument("--table", action="store_true", help="print the results as a markdown table and exit")
    ap.add_argument("--operators", choices=("both", "cosmic-ray", "human"), default="both",
                    help="cosmic-ray's operators, the human-style ones (scripts/mutate_human.py), or both "
                         "(default), each with its own sample of --sample mutants")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.results))
        return 0
    if args.report:
        import mutate_human

        for name in args.module or sorted(MODULES):
            db = args.workdir / "sessions" / f"{name}.sqlite"
            if db.exists():
                write_report(db, name, json.loads(db.with_suffix(".meta.json").read_text()), args.results)
            mutate_human.report_session(name, args.workdir, args.results)
        return 0
    if args.sample is not None and args.sample <= 0:
        ap.error("--sample must be > 0")
    if args.workdir.resolve().is_relative_to(REPO):
        ap.error(f"--workdir {args.workdir} is inside the repository: mutants would land in the work tree")
    for name in args.module or [m for m in MODULES if m not in LATER]:
        if args.operators != "human":
            mutate(name, workdir=args.workdir, results=args.results, sample=args.sample, seed=args.seed,
                   timeout=args.timeout)
        if args.operators != "cosmic-ray":
            import mutate_human

            mutate_human.run_module(name, workdir=args.workdir, results=args.results, sample=args.sample,
                                    seed=args.seed, timeout=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
