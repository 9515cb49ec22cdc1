"""Providers that live above ``convert``: weight sources and the FP8 KV-cache calibrator.

``convert`` sits below the trainer and the samplers, so it never imports them. What it needs
from them (reading a trainer training checkpoint, running the sampler model to calibrate KV
scales) is registered here by the providers themselves, which ``convert`` finds through Python
entry points of the group ``mixrl.convert``: each entry point names a zero-argument callable
that calls ``register_source_reader`` / ``register_kv_calibrator``. Declaring one is all a
package above needs::

    [project.entry-points."mixrl.convert"]
    my_reader = "my_package.my_module:register"

Providers are loaded once, on first use (not at import: ``import convert.x`` stays free of
everything above). A provider that cannot be loaded (say its package needs torch, which is not
installed) is remembered, and the error for whatever needed it names it and what to install.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

ENTRY_POINT_GROUP = "mixrl.convert"

#: ``(path, hf_config, step) -> iterator of (hf_name, array)``; ``step`` may be ``None`` (latest)
ReadFn = Callable[[Path, dict, "int | None"], Iterator[tuple[str, np.ndarray]]]
#: ``(hf_dir, input_ids [B, T]) -> {layer: (k_scale, v_scale)}``
KVCalibrateFn = Callable[[str | os.PathLike, np.ndarray], dict[int, tuple[float, float]]]

# Import names whose pip distribution is spelled differently (for the install hint).
_PIP_NAMES = {"orbax": "orbax-checkpoint", "yaml": "pyyaml"}


class PluginError(ValueError):
    """A provider is missing, failed to load, or lacks a package it needs.

    A ValueError so that ``mixrl-convert`` prints it as its usual one-line error.
    """


@dataclasses.dataclass(frozen=True)
class _Provider:
    name: str
    requires: tuple[str, ...]
    install: str | None

    def check_installed(self, what: str) -> None:
        """Fail with one line naming the missing packages before any work starts."""
        missing = [m for m in self.requires if not _module_available(m)]
        if missing:
            raise PluginError(f"{what} needs {', '.join(missing)} (not installed): "
                              f"{self.install or _pip_hint(missing)}")


@dataclasses.dataclass(frozen=True)
class SourceReader(_Provider):
    """Reads one kind of on-disk weights that stores no HF config (e.g. a training checkpoint)."""

    detect: Callable[[Path], bool]
    read: ReadFn
    description: str  # "a training checkpoint": used in messages about this kind of source

    def check(self) -> None:
        self.check_installed(f"reading {self.description}")

    def open(self, path: Path, hf_config: dict,
             step: int | None) -> Iterator[tuple[str, np.ndarray]]:
        self.check()
        return _translate_missing(self.read(path, hf_config, step), self)


@dataclasses.dataclass(frozen=True)
class KVCalibrator(_Provider):
    fn: KVCalibrateFn

    def __call__(self, hf_dir: str | os.PathLike,
                 input_ids: np.ndarray) -> dict[int, tuple[float, float]]:
        self.check_installed(f"FP8 KV-cache calibration ({self.name})")
        try:
            return self.fn(hf_dir, input_ids)
        except ModuleNotFoundError as e:
            raise PluginError(_missing_message(f"FP8 KV-cache calibration ({self.name})", e,
                                               self.install)) from None


_lock = threading.RLock()  # re-entrant: a provider may look up the registry while loading
_loaded = False
_source_readers: dict[str, SourceReader] = {}
_kv_calibrators: dict[str, KVCalibrator] = {}
_failed: dict[str, str] = {}  # entry point name -> one-line reason


def register_source_reader(name: str, detect: Callable[[Path], bool], read: ReadFn, *,
                           description: str, requires: Iterable[str] = (),
                           install: str | None = None) -> None:
    """Register a weight source ``open_source`` tries before the built-in ones.

    ``detect(path)`` must be cheap and import nothing heavy: it runs for every path given to
    ``mixrl-convert``. ``requires`` lists modules ``read`` imports (checked before reading so a
    missing one is a one-line error); ``install`` overrides the default ``pip install`` hint.
    """
    _source_readers[name] = SourceReader(name=name, requires=tuple(requires), install=install,
                                         detect=detect, read=read, description=description)


def register_kv_calibrator(fn: KVCalibrateFn, *, name: str = "default",
                           requires: Iterable[str] = (), install: str | None = None) -> None:
    """Register the function behind ``--kv-calibration`` (see ``KVCalibrateFn``)."""
    _kv_calibrators[name] = KVCalibrator(name=name, requires=tuple(requires), install=install,
                                         fn=fn)


def load_providers() -> None:
    """Load every ``mixrl.convert`` entry point once; remember the ones that fail."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                ep.load()()
            except ModuleNotFoundError as e:
                _failed[ep.name] = _missing_message(f"provider {ep.name} ({ep.value})", e, None)
            except Exception as e:  # noqa: BLE001 - one broken provider must not break the rest
                _failed[ep.name] = f"provider {ep.name} ({ep.value}) failed to load: {e!r}"


def source_readers() -> list[SourceReader]:
    load_providers()
    return list(_source_readers.values())


def failed_providers() -> Mapping[str, str]:
    """``{entry point name: reason}`` for providers that could not be loaded."""
    load_providers()
    return dict(_failed)


def kv_calibrator() -> KVCalibrator:
    """The one registered KV calibrator, or a ``PluginError`` saying what to install."""
    load_providers()
    if len(_kv_calibrators) == 1:
        return next(iter(_kv_calibrators.values()))
    if _kv_calibrators:
        raise PluginError(f"several FP8 KV-cache calibrators are registered "
                          f"({', '.join(sorted(_kv_calibrators))}); uninstall all but one")
    raise PluginError("--kv-calibration needs an FP8 KV-cache calibrator and none is registered"
                      + unavailable_note())


def unavailable_note() -> str:
    """``"; <reasons>"`` for providers that failed to load, else a hint about entry points."""
    if _failed:
        return "; " + "; ".join(_failed.values())
    return (f" (providers register through '{ENTRY_POINT_GROUP}' entry points: reinstall "
            "mixrl, e.g. pip install -e ., so its entry points are visible)")


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package of a dotted name is missing
        return False


def _pip_hint(modules: Iterable[str]) -> str:
    names = dict.fromkeys(_PIP_NAMES.get(m.split(".")[0], m.split(".")[0]) for m in modules)
    return "pip install " + " ".join(names)


def _missing_message(what: str, e: ModuleNotFoundError, install: str | None) -> str:
    module = e.name or str(e)
    return f"{what} needs {module} (not installed): {install or _pip_hint([module])}"


def _translate_missing(tensors: Iterator, provider: _Provider) -> Iterator:
    """Re-raise a lazy import failure inside a reader's iterator as a one-line PluginError."""
    try:
        yield from tensors
    except ModuleNotFoundError as e:
        raise PluginError(_missing_message(f"provider {provider.name}", e,
                                           provider.install)) from None
