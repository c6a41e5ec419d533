"""Replaying one built-in scenario against servers, the same requests each time: what ``leanserve advise
--experiment`` measures a change with (the before and after runs), and the scenario closest to observed traffic.

(``leanserve.tools`` and ``leanserve.bench`` are independent layers; the CLI hands a :class:`WorkloadReplay` to
the advisor, which only calls :meth:`WorkloadReplay.run`.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from leanserve.bench.command import load_tokenizer
from leanserve.bench.corpus import Corpus
from leanserve.bench.runner import BenchConfig, run_benchmark
from leanserve.bench.workloads import WORKLOADS, BenchRequest, make_workload


def infer_workload(mean_prompt_tokens: float | None, mean_output_tokens: float | None) -> str:
    """The built-in scenario whose prompt and output ranges' midpoints are nearest to the observed means, by
    distance in log space (lengths differ by ratios, not by sums); "customer-service" when neither is known."""
    if not mean_prompt_tokens and not mean_output_tokens:
        return "customer-service"

    def distance(name: str) -> float:
        spec = WORKLOADS[name]
        d = 0.0
        for observed, (lo, hi) in ((mean_prompt_tokens, spec.prompt_range), (mean_output_tokens, spec.output_range)):
            if observed:
                d += (math.log(max(observed, 1.0)) - math.log((lo + hi) / 2)) ** 2
        return d
    return min(WORKLOADS, key=distance)


@dataclass
class WorkloadReplay:
    """``num_prompts`` requests of ``workload`` (fixed by ``seed``), sent at ``request_rate`` (inf: all at once)
    to whichever server :meth:`run` is given; the requests are built once, so every run sends the same ones.

    Attributes:
        tokenizer: GGUF file or HF folder of the served model's tokenizer (None: the default model's).
        slos: goodput SLOs in ms (``ttft`` / ``tpot`` / ``e2el``), for SLO attainment.
    """

    workload: str
    num_prompts: int = 16
    request_rate: float = math.inf
    seed: int = 1000
    tokenizer: str | None = None
    slos: dict[str, float] = field(default_factory=dict)
    _requests: list[BenchRequest] | None = None
    _count: Any = None

    def requests(self) -> list[BenchRequest]:
        """The requests every run sends (built on first use: loads the tokenizer and the corpus, a few seconds).

        Raises:
            KeyError: unknown workload. ModelLoadError / OSError: the tokenizer cannot be read.
        """
        if self._requests is None:
            tokenizer = load_tokenizer(self.tokenizer)
            self._requests = make_workload(self.workload, Corpus.load(tokenizer), self.num_prompts, self.seed)
            self._count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))
        return self._requests

    def run(self, base_url: str, label: str, api_key: str | None = None) -> dict[str, Any]:
        """One ``leanserve bench`` run of the requests against ``base_url``: its result dict
        (:meth:`leanserve.bench.runner.RunResult.to_dict`).

        Raises:
            RuntimeError: the server's model list cannot be read.
        """
        requests = self.requests()
        config = BenchConfig(base_url=base_url, request_rate=self.request_rate, seed=self.seed, slos=dict(self.slos),
                             api_key=api_key, progress=False, metrics_interval_s=0.25)
        return run_benchmark(config, requests, label, self._count).to_dict()
