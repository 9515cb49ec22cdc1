"""`mixrl-sample`: run a sampler that joins a trainer over gRPC.

    MIXRL_TOKEN=... mixrl-sample --trainer HOST:PORT --group NAME --recipe fp8 --model-dir DIR
        [--backend engine|sglang|vllm [--server-url URL]] [--device auto|cpu|cuda|cuda:N]

Leases tasks, generates with the engine in the given precision recipe, submits trajectories and
reloads weights in flight as the trainer publishes them (verified against the sha256 manifest).
Exits 0 on SIGTERM/SIGINT (or after ``--max-samples``), 2 on bad arguments, 3 when the trainer
refuses the token.

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
    p.add_argument("--model-dir", required=True, help="initial weights (export in the recipe's format)")
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

    from sampler_torch.client import RolloutClient, RolloutError, TLSOptions

    try:
        if args.token_file:
            with open(args.token_file) as f:
                token = f.read().strip()
        else:
            token = os.environ.get("MIXRL_TOKEN", "").strip()
    except OSError as e:
        print(f"mixrl-sample: token file {args.token_file}: {e.strerror}", file=sys.stderr)
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
    try:
        engine = open_backend(args.backend, args.model_dir, recipe, server_url=args.server_url,
                              max_batch=args.max_batch, server_extra_args=args.server_arg,
                              log_path=args.server_log, device=device,
                              compile={"on": True, "off": False}.get(args.compile, "auto"))
    except (RecipeError, ValueError, ServerError) as e:  # a server refusing the recipe, or down
        print(f"mixrl-sample: --backend {args.backend}: {e}", file=sys.stderr)
        return 2
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TLSOptions(ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key,
                         server_name=args.tls_server_name)
    compute = compute_report(device, args.backend)
    accelerator = args.accelerator or compute["name"]
    log.info("computing on %s (%s), recipe %s: matmuls %s, attention %s, compiled decode %s",
             device, compute["name"], recipe.name, compute["kernels"].get(recipe.name, "?"),
             getattr(engine, "attention", "server"), getattr(engine, "compile", "server"))
    client = RolloutClient(
        args.trainer, token, group=args.group, accelerator=accelerator, capacity=args.capacity,
        weight_formats=(recipe.weight_format,), name=args.name or f"{socket.gethostname()}:{os.getpid()}",
        recipe=dict(name=recipe.name, weight_format=recipe.weight_format,
                    activation_format=recipe.activations, kv_dtype=recipe.describe()["kv_cache_dtype"],
                    backend=BACKENDS[args.backend], logit_noise=recipe.logit_noise),
        tls=tls, device=compute)
    loop = SamplerLoop(client, engine, LoopConfig(
        capacity=args.capacity, weights_cache=args.weights_cache, transfer=args.weights_transfer,
        episode_tokens=args.episode_tokens, max_samples=args.max_samples))

    def on_signal(signum, frame):
        log.info("signal %d: stopping", signum)
        loop.stop()
        client.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stats = loop.run()
    except RolloutError as e:
        log.error("trainer refused us: %s", e)
        return 3 if e.code.name in ("UNAUTHENTICATED", "PERMISSION_DENIED") else 1
    finally:
        client.close()
        if hasattr(engine, "close"):  # stops a server we started (an attached one is left alone)
            engine.close()
    log.info("done: %d rounds, %d accepted, %d duplicates, refused %s, weights %s, %d weight failures",
             stats.rounds, stats.accepted, stats.duplicates, dict(stats.refused), stats.weight_versions,
             stats.weight_failures)
    return 0


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
