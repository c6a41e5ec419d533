"""Which models one server serves: repeated ``--model`` / ``--served-model-name`` flags, or a models config file.

``leanserve serve --model A --model B --served-model-name a --served-model-name b`` serves two models with the
command line's engine options. ``--models-config FILE`` gives each model its own options: a JSON list of objects
whose keys are :class:`~leanserve.config.EngineConfig` field names plus ``served_model_name``, e.g.::

    [{"served_model_name": "smol"},
     {"served_model_name": "smol-fp32", "quantization": "none", "max_num_seqs": 8},
     {"model": "gemma3-270m", "served_model_name": "gemma", "kv_cache_memory": 268435456}]

The engine options given on the command line (``--model`` included, when given once) are the defaults every
entry inherits. Each entry is validated by :class:`EngineConfig` itself, so a bad value fails at startup naming the
field: ``InvalidParameterError.param`` is ``models_config[i].<field>``.

Process-wide settings: ``num_threads`` (torch's and BLAS's pools are one per process, see
``worker/cpu_threads.py``) must be the same for every model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from typing import Any

from leanserve.config import EngineConfig
from leanserve.errors import InvalidParameterError
from leanserve.loader import resolve_model_path

SERVED_MODEL_NAME = "served_model_name"


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve: its engine options and its API name (None: the model file's name, known once loaded)."""

    engine: EngineConfig
    served_model_name: str | None = None


def _engine_fields() -> set[str]:
    return {f.name for f in fields(EngineConfig)}


def _entry_spec(base: EngineConfig, entry: Any, where: str) -> ModelSpec:
    if not isinstance(entry, dict):
        raise InvalidParameterError(where, f"{where} must be a JSON object of EngineConfig fields and "
                                    f"served_model_name, got {type(entry).__name__}")
    known = _engine_fields()
    unknown = sorted(k for k in entry if k not in known and k != SERVED_MODEL_NAME)
    if unknown:
        raise InvalidParameterError(f"{where}.{unknown[0]}", f"{where}: unknown field {unknown[0]!r}; known: "
                                    f"{SERVED_MODEL_NAME}, {', '.join(sorted(known))}")
    name = entry.get(SERVED_MODEL_NAME)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise InvalidParameterError(f"{where}.{SERVED_MODEL_NAME}",
                                    f"{where}: {SERVED_MODEL_NAME} must be a non-empty string, got {name!r}")
    options = {k: v for k, v in entry.items() if k != SERVED_MODEL_NAME}
    try:
        engine = replace(base, **options)  # runs EngineConfig.__post_init__: every value checked
    except InvalidParameterError as exc:
        raise InvalidParameterError(f"{where}.{exc.param}", f"{where}.{exc.param}: {exc}") from None
    except TypeError as exc:  # pragma: no cover - unknown keys are caught above
        raise InvalidParameterError(where, f"{where}: {exc}") from None
    return ModelSpec(engine, name)


def load_models_config(path: str) -> list[Any]:
    """The entries of a models config file (a JSON list, at least one entry).

    Raises:
        InvalidParameterError: ``param`` "models_config": the file cannot be read, is not JSON, or not a non-empty
            list.
    """
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise InvalidParameterError("models_config", f"cannot read models config {path}: {exc.strerror or exc}") \
            from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidParameterError("models_config", f"models config {path} is not valid JSON: {exc}") from None
    if not isinstance(data, list) or not data:
        raise InvalidParameterError("models_config", f"models config {path} must be a non-empty JSON list of "
                                    "objects (one per model)")
    return data


def model_specs(base: EngineConfig, models: list[str] | None = None, served_names: list[str] | None = None,
                config_entries: list[Any] | None = None) -> list[ModelSpec]:
    """The models to serve, in order.

    Args:
        base: the command line's engine options (every model's defaults; ``base.model`` is the default file).
        models: the ``--model`` flags (None or one: a single model, ``base.model`` or that one).
        served_names: the ``--served-model-name`` flags, in the order of ``models`` (None: the files' names).
        config_entries: the models config file's entries (:func:`load_models_config`); then ``models`` may hold
            at most one value (the default file of the entries).

    Raises:
        InvalidParameterError: repeated ``--model`` together with a models config; a count of served names that
            is not the count of models; a bad entry (``param`` ``models_config[i].<field>``); two models with one
            served name; models with different ``num_threads``.
    """
    models = list(models or [])
    names = list(served_names or [])
    if config_entries is not None:
        if len(models) > 1:
            raise InvalidParameterError("models_config", "give the models either as repeated --model flags or in "
                                        "--models-config, not both")
        if names:
            raise InvalidParameterError("served_model_name", "with --models-config, give each model's name as its "
                                        "entry's served_model_name, not with --served-model-name")
        if models:
            base = replace(base, model=models[0])
        specs = [_entry_spec(base, e, f"models_config[{i}]") for i, e in enumerate(config_entries)]
    else:
        if names and len(names) != max(len(models), 1):
            raise InvalidParameterError("served_model_name", f"--served-model-name was given {len(names)} "
                                        f"time{'s' if len(names) != 1 else ''} for {max(len(models), 1)} "
                                        "model(s): give one per --model, in the same order")
        files = models or [base.model]
        specs = [ModelSpec(replace(base, model=m), names[i] if names else None) for i, m in enumerate(files)]
    threads = {s.engine.num_threads for s in specs}
    if len(threads) > 1:
        raise InvalidParameterError("num_threads", "every model must use the same num_threads (--threads): torch's "
                                    "and BLAS's thread pools are one per process; got "
                                    f"{', '.join(str(t) for t in threads)}")
    check_unique_names([s.served_model_name for s in specs if s.served_model_name is not None])
    return specs


def default_served_model_name(model_path: str) -> str:
    """The file or folder name of the model, without ``.gguf``."""
    name = os.path.basename(os.path.normpath(model_path))
    return name[:-5] if name.lower().endswith(".gguf") else name


def served_names(specs: list[ModelSpec]) -> list[str]:
    """Each spec's served name (its own, else its file's name), checked unique before any model loads.

    Raises:
        InvalidParameterError: two models under one name (e.g. one file twice without names). ModelLoadError: from
            :func:`leanserve.loader.resolve_model_path`.
    """
    names = [s.served_model_name or default_served_model_name(resolve_model_path(s.engine.model)) for s in specs]
    check_unique_names(names)
    return names


def check_unique_names(names: list[str]) -> None:
    """Raises InvalidParameterError (``served_model_name``) when two models would be served under one name."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidParameterError(SERVED_MODEL_NAME, f"two models are served as {name!r}: give each its own "
                                        "--served-model-name (or served_model_name in --models-config)")
        seen.add(name)
