"""The models one server serves, by API name: the one place a request's ``"model"`` becomes an engine.

:class:`ServedModels` maps each served name to a :class:`ServedModel` (its :class:`AsyncEngine`, with its own engine
thread and KV pool, and the serving objects and metrics built on it). :meth:`ServedModels.resolve` is what every
route calls; a *virtual* name (:meth:`ServedModels.add_virtual`, e.g. a router's ``"auto"``) resolves per request
to one of the real models, given the parsed request body.

The registry also answers for all its engines together what the server's lifecycle asks of one engine
(``draining``, ``dead``, ``num_in_flight``, ``begin_drain``, ``begin_shutdown``, ``shutdown``), so the gate and
:class:`~leanserve.entrypoints.openai.api_server.LeanserveServer` take it in place of an engine: a drain drains
every engine, and one dead engine ends the server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from leanserve.engine.async_engine import AsyncEngine
from leanserve.entrypoints.openai.metrics import ServerMetrics
from leanserve.entrypoints.openai.serving_chat import OpenAIServingChat
from leanserve.entrypoints.openai.serving_common import OpenAIError
from leanserve.entrypoints.openai.serving_completion import OpenAIServingCompletion


def model_not_found(name: str) -> OpenAIError:
    """OpenAI's answer to an unknown model: 404, ``invalid_request_error``, code ``model_not_found``."""
    return OpenAIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                       "model_not_found")


@dataclass
class ServedModel:
    """One served model: its API name, engine, per-model serving objects and metrics (and answer cache, if on)."""

    name: str
    engine: AsyncEngine
    chat: OpenAIServingChat
    completion: OpenAIServingCompletion
    metrics: ServerMetrics
    answer_cache: Any = None  # answer_cache.ServingAnswerCache or None


# A virtual name's resolver: (the registry, the parsed request body or None) -> the real model serving it.
VirtualResolver = Callable[["ServedModels", Any], ServedModel]


class ServedModels:
    """Served name -> :class:`ServedModel`, in the order added (the first is the default: a request without
    ``"model"`` gets it, and it is listed first)."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self._virtual: dict[str, VirtualResolver] = {}
        self._held = 0  # server requests in progress (hold / release), whichever model they end up on

    def add(self, model: ServedModel) -> None:
        """Raises ValueError when the name is taken."""
        if model.name in self._models or model.name in self._virtual:
            raise ValueError(f"two models are served as {model.name!r}")
        self._models[model.name] = model

    def add_virtual(self, name: str, resolver: VirtualResolver) -> None:
        """Serve ``name`` by calling ``resolver(self, body)`` per request (a router). Raises ValueError when taken."""
        if name in self._models or name in self._virtual:
            raise ValueError(f"the model name {name!r} is taken")
        self._virtual[name] = resolver

    def resolve(self, name: str | None, body: Any = None) -> ServedModel:
        """The model serving a request for ``name`` (None: the default model).

        Raises:
            OpenAIError: 404 ``model_not_found`` for a name neither served nor virtual.
        """
        if name is None:
            return self.default
        model = self._models.get(name)
        if model is not None:
            return model
        resolver = self._virtual.get(name)
        if resolver is None:
            raise model_not_found(name)
        return resolver(self, body)

    def get(self, name: str) -> ServedModel | None:
        """The real model served as ``name`` (no virtual names), or None."""
        return self._models.get(name)

    @property
    def default(self) -> ServedModel:
        return next(iter(self._models.values()))

    @property
    def names(self) -> list[str]:
        """The real models' names, in order."""
        return list(self._models)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(list(self._models.values()))

    def __len__(self) -> int:
        return len(self._models)

    # ------------------------------------------------------------------ lifecycle of all engines together
    @property
    def engines(self) -> list[AsyncEngine]:
        return [m.engine for m in self._models.values()]

    @property
    def draining(self) -> bool:
        """True when any engine refuses new requests (a drain or shutdown covers every engine)."""
        return any(e.draining for e in self.engines)

    @property
    def is_running(self) -> bool:
        return all(e.is_running for e in self.engines)

    @property
    def dead(self) -> BaseException | None:
        """The failure of the first engine whose thread died, or None."""
        return next((e.dead for e in self.engines if e.dead is not None), None)

    @property
    def num_in_flight(self) -> int:
        return self._held or sum(e.num_in_flight for e in self.engines)  # see AsyncEngine.num_in_flight

    def hold(self) -> None:
        """As :meth:`AsyncEngine.hold`: a server request in progress, which a drain waits for."""
        self._held += 1

    def release(self) -> None:
        self._held -= 1

    def begin_drain(self) -> None:
        for e in self.engines:
            e.begin_drain()

    def begin_shutdown(self) -> None:
        for e in self.engines:
            e.begin_shutdown()

    def shutdown(self, timeout: float = 30.0) -> None:
        self.begin_shutdown()
        for e in self.engines:
            e.shutdown(timeout)
