"""Model routing: which of two served models (a cheap and a strong one) answers a request sent to a virtual
router model (``"model": "auto"``). Plain Python + numpy, no server imports; the server calls :meth:`decide`.

- :class:`RulesPolicy`: prompt length, requested ``max_tokens``, code or math in the prompt (``detect.py``).
- :class:`LearnedPolicy`: the share of hard among labelled easy / hard examples, weighted by similarity on
  WordLlama embeddings (RouteLLM's spirit), its threshold calibrated to a target strong-model share
  (:meth:`LearnedPolicy.calibrate`).
- :class:`CascadePolicy`: FrugalGPT's cascade: the cheap answer first, escalated when its mean token logprob is
  under a threshold (:meth:`CascadePolicy.judge`; :func:`calibrate_min_mean_logprob`).
- ``factory.py``: ``--model-router`` / ``--model-routers-file`` definitions -> policies (:func:`build_router`).
"""

from __future__ import annotations

from leanserve.routing.base import RouteDecision, RouteInput, RouterPolicy
from leanserve.routing.cascade import CascadePolicy, calibrate_min_mean_logprob, mean_logprob
from leanserve.routing.detect import detect_code, detect_math
from leanserve.routing.factory import (
    DEFAULT_ROUTER_NAME,
    RouterSpec,
    build_router,
    load_router_specs,
    parse_router_flag,
)
from leanserve.routing.learned import LearnedPolicy, load_examples, threshold_for_share
from leanserve.routing.rules import RulesPolicy

__all__ = ["DEFAULT_ROUTER_NAME", "CascadePolicy", "LearnedPolicy", "RouteDecision", "RouteInput", "RouterPolicy",
           "RouterSpec", "RulesPolicy", "build_router", "calibrate_min_mean_logprob", "detect_code", "detect_math",
           "load_examples", "load_router_specs", "mean_logprob", "parse_router_flag", "threshold_for_share"]
