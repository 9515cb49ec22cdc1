"""`mixrl-sample`: run a sampler that joins a trainer over gRPC.

    MIXRL_TOKEN=... mixrl-sample --trainer HOST:PORT --group NAME --recipe fp8 [--model-dir DIR]
        [--backend engine|sglang|vllm [--server-url URL]] [--device auto|cpu|cuda|cuda:N]

Leases tasks, generates with the engine in the given precision recipe, submits trajectories and
reloads weights in flight as the trainer publishes them (verified against the sha256 manifest).
Without ``--model-dir`` it first fetches the trainer's current version over gRPC (as a
``mixrl-fleet`` replica does, ``fleet.weights.fetch_current``) and says so.

It never waits silently: until the trainer answers it logs ``waiting for the trainer at ADDR``
with the time so far (every ``$MIXRL_WAIT_REPORT_S`` seconds, 15 by default) and gives up after
``--connect-timeout-s`` in one line; once connected, a trainer unreachable for ``--gone-after-s``
ends it with one line ``trainer at ADDR is gone``. Exits 0 on SIGTERM/SIGINT (or after
``--max-samples``), 1 when the trainer never answered or went away, 2 on bad arguments, 3 when
the trainer refuses the token.

``--device auto`` (the default) is the local GPU when torch sees one (the ``LOCAL_RANK``-th
visible device under a launcher, ``sampler_torch.device``), else the CPU; a GPU asked for on a
machine without one is refused before anything else is checked or loaded. The registration
reports the device and, per recipe, whether its matmuls run ``native`` or ``emulate`` there.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mixrl-sample",
        description="Join a mixrl trainer as a sampler: lease tasks, generate with a precision recipe, "
                    "submit trajectories, reload weights in flight.")
    p.add_argument("--trainer", required=True, help="trainer address HOST:PORT")
    p.add_argument("--group", required=True, help="sampler group name")
    p.add_argument("--recipe", default="bf16", help="precision recipe name (sampler_torch.recipes)")
    p.add_argument("--recipe-override", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a recipe field, e.g. kv_cache_dtype=fp8_e4m3 (repeatable)")
    p.add_argument("--model-dir", default=None,
                   help="initial weights (a full HF export in the recipe's format); default: fetch the "
                        "trainer's current version over gRPC into --weights-cache/initial")
    p.add_argument("--connect-timeout-s", type=float, default=300.0, metavar="S",
                   help="give up when nothing answers at --trainer within S seconds (default 300)")
    p.add_argument("--gone-after-s", type=float, default=20.0, metavar="S",
                   help="exit when the trainer has been unreachable for S seconds after it answered "
                        "(default 20; 0: wait for it forever, e.g. across a slow trainer restart)")
    p.add_argument("--backend", choices=("engine", "sglang", "vllm"), default="engine",
                   help="what generates: the torch engine here, or an SGLang / vLLM server")
    p.add_argument("--server-url", default=None, metavar="URL",
                   help="attach to a running sglang/vllm server holding --model-dir; without it "
                        "the server is started with the recipe's arguments and stopped on exit")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for a server we start (repeatable), e.g. "
                        "--server-arg=--mem-fraction-static=0.5")
    p.add_argument("--server-log", default=None, metavar="FILE", help="where a started server logs")
    p.add_argument("--token-file", help="file holding the bearer token (default: $MIXRL_TOKEN)")
    p.add_argument("--capacity", type=int, default=8, help="samples leased and generated per round")
    p.add_argument("--max-batch", type=int, default=32, help="engine batch slots")
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                   help="where the engine computes (default auto: the local GPU if torch sees "
                        "one, else the CPU)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="the engine's compiled decode step (default auto: on CUDA; on the CPU it "
                        "runs ~1.5x faster once compiled but costs 15-75 s of compile per batch / "
                        "length shape)")
    p.add_argument("--accelerator", default=None,
                   help="label reported to the trainer (default: the device's name)")
    p.add_argument("--name", default=None, help="sampler name (default host:pid)")
    p.add_argument("--weights-cache", default="~/.cache/mixrl/weights", help="where fetched weights go")
    p.add_argument("--weights-transfer", choices=("auto", "shared", "fetch"), default="auto",
                   help="use the trainer's path (shared filesystem), fetch over gRPC, or auto")
    p.add_argument("--tls-ca", help="CA certificate (PEM) that signed the trainer's certificate")
    p.add_argument("--tls-cert", help="client certificate (PEM) for mutual TLS")
    p.add_argument("--tls-key", help="client private key (PEM) for mutual TLS")
    p.add_argument("--tls-server-name", help="expected name in the trainer's certificate")
    p.add_argument("--episode-tokens", type=int, default=None,
                   help="token budget of a multi-turn episode (default: one turn of max_new_tokens)")
    p.add_argument("--max-samples", type=int, default=None, help="exit after submitting this many")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                   help="stop when process PID (the trainer that spawned us) dies")
    return p


def compute_report(device: str, backend: str) -> dict:
    """What the registration says the sampler computes on: device type and name and, for every
    registered recipe, ``native`` or ``emulate`` probed on that device (a server backend computes
    elsewhere: its type is ``server`` and it reports no kernels)."""
    from sampler_torch.device import describe

    if backend != "engine":
        return {"type": "server", "name": backend, "kernels": {}}
    from sampler_torch.recipes.linear import recipe_kernels

    return describe(device) | {"kernels": recipe_kernels(device)}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("mixrl.sampler")
    if args.exit_with_parent is not None:  # before the slow imports: a dead trainer's child stops at once
        from sampler_torch.parent_watch import exit_with_parent

        exit_with_parent(args.exit_with_parent)

    # The device first: a GPU asked for and absent is the one problem to report, before the token.
    from sampler_torch.device import DeviceError, check_spec, local_device

    try:
        check_spec(args.device)
        device = local_device(args.device) if args.backend == "engine" else "cpu"
    except DeviceError as e:
        print(f"mixrl-sample: {e}", file=sys.stderr)
        return 2

    from mixrl_wire.token_file import TokenFileError, read_token_text
    from sampler_torch.client import ConnectTimeout, RolloutClient, RolloutError, TLSOptions, TrainerGone

    try:  # bounded and never blocking: /dev/zero or a FIFO named as the token file is one line
        if args.token_file:
            token = read_token_text(args.token_file)
            if token is None:
                raise TokenFileError(f"token file {args.token_file}: No such file or directory")
        else:
            token = os.environ.get("MIXRL_TOKEN", "").strip()
    except TokenFileError as e:
        print(f"mixrl-sample: {e}", file=sys.stderr)
        return 2
    if not token:
        print("mixrl-sample: no bearer token: set MIXRL_TOKEN or pass --token-file", file=sys.stderr)
        return 2
    overrides = {}
    for item in args.recipe_override:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"mixrl-sample: --recipe-override {item!r} is not FIELD=VALUE", file=sys.stderr)
            return 2
        overrides[key] = value
    if problem := model_dir_problem(args.model_dir):
        print(f"mixrl-sample: --model-dir {problem}", file=sys.stderr)
        return 2

    import torch

    from sampler_torch.backends import BACKENDS, ServerError, open_backend
    from sampler_torch.loop import LoopConfig, SamplerLoop
    from sampler_torch.recipes import RecipeError, get_recipe

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        recipe = get_recipe(args.recipe, **overrides)
    except RecipeError as e:
        print(f"mixrl-sample: {e}", file=sys.stderr)
        return 2
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TLSOptions(ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key,
                         server_name=args.tls_server_name)
    compute = compute_report(device, args.backend)
    name = args.name or f"{socket.gethostname()}:{os.getpid()}"
    client = RolloutClient(
        args.trainer, token, group=args.group, accelerator=args.accelerator or compute["name"],
        capacity=args.capacity, weight_formats=(recipe.weight_format,), name=name,
        recipe=dict(name=recipe.name, weight_format=recipe.weight_format,
                    activation_format=recipe.activations, kv_dtype=recipe.describe()["kv_cache_dtype"],
                    backend=BACKENDS[args.backend], logit_noise=recipe.logit_noise,
                    round_weights=(dict(bits=recipe.round_weights[0], block_size=recipe.round_weights[1])
                                   if recipe.round_weights else None)),
        tls=tls, device=compute, gone_after_s=args.gone_after_s or None)
    stop = threading.Event()
    loop: list = []  # the SamplerLoop once there is one, for the signal handler

    def on_signal(signum, frame):
        log.info("signal %d: stopping", signum)
        stop.set()
        for running in loop:
            running.stop()
        client.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    engine = None
    try:
        wait = lambda: client.wait_ready(  # noqa: E731
            args.connect_timeout_s, every_s=_report_every_s(), on_wait=lambda s: log.info(
                "waiting for the trainer at %s (%.0f s so far; giving up after --connect-timeout-s %g)",
                args.trainer, s, args.connect_timeout_s))
        model_dir = args.model_dir
        if model_dir is None:
            wait()
            model_dir = fetch_initial(args, token, recipe.name, name, stop, log)
            if model_dir is None:
                return 0 if stop.is_set() else 1
        try:
            engine = open_backend(args.backend, model_dir, recipe, server_url=args.server_url,
                                  max_batch=args.max_batch, server_extra_args=args.server_arg,
                                  log_path=args.server_log, device=device,
                                  compile={"on": True, "off": False}.get(args.compile, "auto"))
        except (RecipeError, ValueError, ServerError, OSError) as e:  # a server refusing the recipe, or down
            print(f"mixrl-sample: --backend {args.backend}: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        log.info("computing on %s (%s), recipe %s: matmuls %s, attention %s, compiled decode %s",
                 device, compute["name"], recipe.name, compute["kernels"].get(recipe.name, "?"),
                 getattr(engine, "attention", "server"), getattr(engine, "compile", "server"))
        wait()
        loop.append(SamplerLoop(client, engine, LoopConfig(
            capacity=args.capacity, weights_cache=args.weights_cache, transfer=args.weights_transfer,
            episode_tokens=args.episode_tokens, max_samples=args.max_samples)))
        stats = loop[0].run()
        if client.gone is not None:  # the heartbeat found it gone; the loop then stopped
            raise client.gone
    except ConnectTimeout:
        logging.disable(logging.CRITICAL)  # the line below is the last: no thread's epilogue after it
        print(f"mixrl-sample: no trainer answered at {args.trainer} within --connect-timeout-s "
              f"{args.connect_timeout_s:g} (is it running, and is that its address and port?)",
              file=sys.stderr)
        return 1
    except TrainerGone as e:
        if loop:  # what it contributed before the trainer went (a finished run ends this way too)
            _log_done(log, loop[0].stats)
        logging.disable(logging.CRITICAL)
        print(f"mixrl-sample: {e.details}; exiting", file=sys.stderr)
        return 1
    except RolloutError as e:
        if client.gone is not None:
            if loop:
                _log_done(log, loop[0].stats)
            logging.disable(logging.CRITICAL)
            print(f"mixrl-sample: {client.gone.details}; exiting", file=sys.stderr)
            return 1
        if stop.is_set() and e.code.name == "CANCELLED":  # SIGTERM while connecting: a plain stop
            log.info("stopped before the trainer answered")
            return 0
        log.error("trainer refused us: %s", e)
        return 3 if e.code.name in ("UNAUTHENTICATED", "PERMISSION_DENIED") else 1
    finally:
        client.close()
        if hasattr(engine, "close"):  # stops a server we started (an attached one is left alone)
            engine.close()
    _log_done(log, stats)
    return 0


def _log_done(log: logging.Logger, stats) -> None:
    log.info("done: %d rounds, %d accepted, %d duplicates, refused %s, weights %s, %d weight failures",
             stats.rounds, stats.accepted, stats.duplicates, dict(stats.refused), stats.weight_versions,
             stats.weight_failures)


def _report_every_s() -> float:
    """Seconds between "waiting for the trainer" lines: ``$MIXRL_WAIT_REPORT_S`` (the trainer's
    waits read it too; tests set a second or two), else 15."""
    try:
        return max(0.1, float(os.environ.get("MIXRL_WAIT_REPORT_S") or 15.0))
    except ValueError:
        return 15.0


def model_dir_problem(model_dir: str | None) -> str | None:
    """Why ``--model-dir`` cannot be loaded, in one phrase (None: absent, or looks loadable)."""
    if model_dir is None:
        return None
    from convert.delta import delta_hint

    path = os.path.expanduser(model_dir)
    if not os.path.isdir(path):
        return (f"{model_dir}: no such directory (leave --model-dir out to fetch the trainer's "
                "current weights)")
    if hint := delta_hint(path):
        return f"{hint}; or leave --model-dir out to fetch the trainer's current weights"
    return None


def fetch_initial(args: argparse.Namespace, token: str, recipe: str, name: str, stop: threading.Event,
                  log: logging.Logger) -> str | None:
    """No ``--model-dir``: the trainer's current version in ``recipe``'s format, downloaded into
    ``--weights-cache/initial`` (read in place with ``--weights-transfer shared``) and verified, as
    a fleet replica does; None (after one line) when it could not be had."""
    from pathlib import Path

    from fleet.weights import FetchError, fetch_current

    cache = Path(args.weights_cache).expanduser() / "initial"
    # A copy of our own unless --weights-transfer shared says to read the trainer's directory: the
    # trainer prunes old versions (keep_last), and the engine reads its start directory later on
    # (tokenizer, probe), so the publish directory of a version is no place to start from.
    transfer = "fetch" if args.weights_transfer == "auto" else args.weights_transfer
    log.info("no --model-dir: fetching the current weights from the trainer at %s into %s", args.trainer,
             cache if transfer == "fetch" else "(its own directory)")
    try:
        version, path = fetch_current(args.trainer, token, group=args.group, recipe=recipe, name=name,
                                      cache_dir=cache, transfer=transfer,
                                      timeout_s=args.connect_timeout_s, stop=stop)
    except FetchError as e:
        if not stop.is_set():
            print(f"mixrl-sample: fetching the initial weights: {e}", file=sys.stderr)
        return None
    log.info("starting from the trainer's version %d (%s)", version, path)
    return str(path)


def run() -> None:
    """``mixrl-sample`` as a process: ``main``, then exit at once with its code. The sampler has
    closed its client and engine by then; interpreter teardown with gRPC's and torch's native
    threads still parked could abort the process after its work was done ("terminate called
    without an active exception", exit -6, seen once in CI after a clean ``done`` line)."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
