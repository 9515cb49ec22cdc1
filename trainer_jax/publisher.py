"""Weight publication off the training thread: the newest request wins.

The training thread hands over a host snapshot of the parameters (the only work it does); if a
publish is still running when the next one is requested, the older pending request is dropped, so
a slow disk delays samplers' weights, never the learner. The formats are asked for at every
publish, so a group that joins asking for a new format gets it from the next version on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from convert.publish import publish
from trainer_jax.models import Qwen3
from trainer_jax.parallel.publish import iter_gathered_hf_tensors


def snapshot(model: Qwen3) -> dict[str, np.ndarray]:
    """The model's parameters as HF-named host arrays (what a publish writes), each gathered
    from its shards once (with several processes, a collective every process must call)."""
    return dict(iter_gathered_hf_tensors(model))


class Publisher:
    """Writes versions with ``convert.publish`` in a background thread.

    ``formats()`` names the formats of the next version; ``on_published(version, {format: dir})``
    runs after each one is on disk (the rollout service announces it to the samplers).
    """

    def __init__(self, out_root: Path, config: dict, formats: Callable[[], list[str]], tokenizer_dir: Path,
                 keep_last: int, on_published: Callable[[int, dict[str, Path]], None]):
        self.out_root, self.config, self.formats = out_root, config, formats
        self.tokenizer_dir, self.keep_last, self.on_published = tokenizer_dir, keep_last, on_published
        self._pending: tuple[int, dict] | None = None
        self._cond = threading.Condition()
        self._stop = False
        self.errors: list[str] = []
        self.published: list[int] = []
        self._thread = threading.Thread(target=self._run, name="mixrl-publisher", daemon=True)
        self._thread.start()

    def publish_now(self, version: int, tensors: dict) -> dict[str, Path]:
        paths = publish(tensors, self.config, self.out_root, version, self.formats(),
                        keep_last=self.keep_last, tokenizer_dir=self.tokenizer_dir)
        self.published.append(version)
        self.on_published(version, paths)
        return paths

    def request(self, version: int, tensors: dict) -> None:
        with self._cond:
            self._pending = (version, tensors)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stop:
                    self._cond.wait()
                if self._pending is None:  # stopping, nothing left to publish
                    return
                version, tensors = self._pending
                self._pending = None
            try:
                self.publish_now(version, tensors)
            except Exception as e:  # keep training; samplers keep the previous version
                self.errors.append(f"v{version}: {type(e).__name__}: {e}")

    def latest(self, fmt: str = "bf16") -> Path:
        """The directory of the newest published version in ``fmt``."""
        return self.out_root / f"v{self.published[-1]:08d}" / fmt

    def close(self) -> None:
        """Finish the pending publish, if any, and stop (idempotent)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()
