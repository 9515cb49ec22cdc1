"""A replica's first weights: the trainer's current version, fetched before the sampler starts.

``mixrl-sample`` needs ``--model-dir`` (its engine opens weights before it registers). A fleet
replica has nothing staged on its node, so it first registers a short-lived session under its
own name, waits for the trainer's current version on ``WatchWeights`` and materializes it
(``RolloutClient.materialize_weights``: the trainer's path when this node can read it, i.e. a
shared ``train.weights.root``, else a download over gRPC; sha256-checked either way). That
session holds capacity 1 and is never leased from; it expires after ``service.session_ttl_s``
(15 s by default) while the sampler registers its own. Torch-free.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from mixrl_wire.recipes import get_recipe
from sampler_torch.client import Backoff, RolloutClient, RolloutError
from sampler_torch.weights_fetch import WeightsError


class FetchError(RuntimeError):
    """The current version could not be obtained (no version published in time, refused token)."""


def fetch_current(trainer: str, token: str, *, group: str, recipe: str, name: str,
                  cache_dir: str | os.PathLike, transfer: str = "auto", timeout_s: float = 300.0,
                  stop: threading.Event | None = None) -> tuple[int, Path]:
    """``(version, directory)`` of the trainer's current weights in ``recipe``'s format.

    Waits up to ``timeout_s`` for a first version (a trainer that has not published yet); raises
    ``FetchError`` on timeout, a refused token or weights that fail their manifest."""
    fmt = get_recipe(recipe).weight_format
    client = RolloutClient(trainer, token, group=group, recipe={"name": recipe, "weight_format": fmt},
                           capacity=1, weight_formats=(fmt,), name=f"{name}/fetch",
                           backoff=Backoff(initial_s=0.2, max_s=5.0), max_retry_s=timeout_s)
    found: list = []
    done = threading.Event()

    def watch() -> None:
        try:
            for wv in client.watch_weights(-1):
                found.append(wv)
                break
        except RolloutError as e:
            found.append(e)
        done.set()

    threading.Thread(target=watch, name="mixrl-fleet-fetch", daemon=True).start()
    try:
        waited = 0.0
        while not done.wait(0.2):
            waited += 0.2
            if waited >= timeout_s or (stop is not None and stop.is_set()):
                raise FetchError(f"no weight version from {trainer} within {timeout_s:g} s")
        if stop is not None and stop.is_set():  # no download for a replica already stopped
            raise FetchError("stopped before the weights were fetched")
        if not found:
            raise FetchError(f"{trainer}: the weight stream ended before a version arrived")
        if isinstance(found[0], RolloutError):
            raise FetchError(f"{trainer} refused us: {found[0]}")
        wv = found[0]
        try:
            _, path = client.materialize_weights(wv, Path(cache_dir).expanduser(), transfer)
        except WeightsError as e:
            raise FetchError(f"version {wv.version}: {e}") from None
        return wv.version, path
    finally:
        client.close()
