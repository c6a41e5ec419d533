"""What ``leanserve advise`` knows of the observed server's configuration, and the ``leanserve serve`` flags of a
changed one.

``--serve-args "..."`` tells advise how the observed leanserve server was started (the same text as after
``leanserve serve``); it is parsed with the flags :func:`leanserve.config.add_config_args` derives from
:class:`~leanserve.config.EngineConfig` and :class:`~leanserve.config.ServerConfig`, so it accepts exactly what
``serve`` accepts. Without it advise assumes leanserve's defaults and says so (``Setup.known`` is False).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from dataclasses import MISSING, dataclass, fields
from typing import Any

from leanserve.config import EngineConfig, ServerConfig, add_config_args, config_from_args
from leanserve.errors import InvalidParameterError


@dataclass(frozen=True)
class Setup:
    """The observed server's configuration as far as advise knows it.

    Attributes:
        engine: its engine options (``--serve-args``, else :class:`EngineConfig`'s defaults).
        known: True when ``--serve-args`` was given; False when the defaults are assumed.
        max_model_len: the served context length (``GET /v1/models``), when the server says.
        base_url: the observed server's root URL (named in the commands advise suggests).
        workload: the ``leanserve bench`` scenario closest to the observed traffic (or ``--workload``).
    """

    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    known: bool = False
    max_model_len: int | None = None
    base_url: str = "http://127.0.0.1:8000"
    workload: str = "customer-service"

    @property
    def is_gguf(self) -> bool:
        """Whether the model is a GGUF file (the default model is one)."""
        return self.engine.model is None or self.engine.model.lower().endswith(".gguf")


def parse_serve_args(text: str | None) -> tuple[EngineConfig, bool]:
    """``leanserve serve`` flags as text -> (:class:`EngineConfig`, whether any were given). Server options
    (``--host``, ``--port``, ``--api-key``...) are accepted and not kept.

    Raises:
        ValueError: an unknown flag or a value ``serve`` would refuse.
    """
    if not text or not text.strip():
        return EngineConfig(), False
    parser = argparse.ArgumentParser(prog="--serve-args", add_help=False, exit_on_error=False)
    add_config_args(parser, EngineConfig)
    add_config_args(parser, ServerConfig)
    try:
        args, unknown = parser.parse_known_args(shlex.split(text))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"--serve-args: {exc}") from None
    if unknown:
        raise ValueError(f"--serve-args: not a `leanserve serve` flag: {' '.join(unknown)}")
    try:
        return config_from_args(EngineConfig, args), True
    except InvalidParameterError as exc:
        raise ValueError(f"--serve-args: {exc}") from None


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def config_to_flags(config: EngineConfig) -> list[str]:
    """The ``leanserve serve`` flags that turn the defaults into ``config`` (only the fields that differ)."""
    out: list[str] = []
    for f in fields(EngineConfig):
        if not f.metadata.get("cli", False):
            continue
        default = f.default if f.default is not MISSING else None
        value = getattr(config, f.name)
        if value == default:
            continue
        if isinstance(default, bool):
            out.append(_flag(f))  # a switch: --no-... for a True default, --name for a False one
        elif value is not None:
            out += [_flag(f), _text(value)]
    return out


def _text(value: Any) -> str:
    """A flag's value as ``serve`` parses it: a nested config (e.g. speculative_config) as JSON."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json.dumps(dataclasses.asdict(value))
    return json.dumps(value) if isinstance(value, dict) else str(value)


def change_flags(changes: dict[str, Any]) -> list[str]:
    """The flags that set ``changes`` (EngineConfig field -> value), whatever the defaults are.

    Raises:
        KeyError: a name that is not an EngineConfig option.
    """
    by_name = {f.name: f for f in fields(EngineConfig) if f.metadata.get("cli", False)}
    out: list[str] = []
    for name, value in changes.items():
        f = by_name[name]
        if isinstance(f.default, bool):
            if value != f.default:
                out.append(_flag(f))
        else:
            out += [_flag(f), _text(value)]
    return out


def apply_change(config: EngineConfig, changes: dict[str, Any]) -> EngineConfig:
    """``config`` with ``changes`` (EngineConfig field -> value) applied; validated like any EngineConfig.

    Raises:
        InvalidParameterError: a value EngineConfig refuses. TypeError: an unknown field.
    """
    return dataclasses.replace(config, **changes)
