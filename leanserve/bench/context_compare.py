"""``leanserve bench --compare documents|answer-cache``: one run, two variants side by side, against a live server.

- ``documents`` (knowledge-qa with passage selection on vs off): :func:`qa_set` writes questions whose answer (a
  port, a year, a name, a file name) is stated in exactly one of about ten retrieved passages, among hard
  negatives (the same kind of fact about other projects), standard-library docstrings and near-duplicate mirrors
  of them. *Off* pastes every passage into the user message (what a client does without the server's help);
  *on* sends the same passages as ``documents`` with ``top_k_documents`` (the server de-duplicates, ranks by BM25
  and reorders). Both use the same prompt layout (``leanserve.context.passages.build_messages``), greedy
  decoding and stop at EOS. Reported: mean prompt tokens (the server's usage), median TTFT, output tok/s and the
  accuracy (the expected answer appears in the reply, case-insensitive).
- ``answer-cache`` (customer-service, answer cache on vs off; the server must run with ``--answer-cache``):
  :func:`faq_requests` writes 50 FAQ questions (shared system prompt, the FAQ entry, the question); each run
  draws the same requests from a Zipf distribution over them (rank k with weight 1 / k^s, s = 1.0), and a share
  of them (30 % by default) asks a question of its own about its FAQ entry (an order number added), which no
  cache answers (:func:`customer_requests`). *Off* sends ``cache: false``. At each rate of the sweep, off runs and
  then on (back to back, so that both meet the same machine load), each after a warm-up of one request per FAQ:
  the steady state of a help desk, not its cold start (``--no-warmup`` measures from cold). Each run has prompts
  of its own (its system prompt names the run, with a number unique to the invocation, so no run reuses
  another's cache entries or prefix blocks, not even those of an earlier invocation against the same server).
  Reported per rate: the hit rate, p50/p99 TTFT and the SLO attainment; then the highest rate at which every
  rate up to it met the attainment goal.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from leanserve.bench.corpus import Corpus
from leanserve.bench.runner import BenchConfig, RunResult, run_benchmark
from leanserve.bench.stats import max_sustained_rate
from leanserve.bench.workloads import SUPPORT_SYSTEM_PROMPT, BenchRequest
from leanserve.context.passages import Passage, build_messages

QA_SYSTEM = "Answer the question with the exact value from the documents, in a few words."
NAMES = ["Quorbel", "Fenwick", "Zarantha", "Mollusk", "Tiberon", "Pendra", "Vexlow", "Ombrix", "Caldera", "Nimbrel",
         "Sorvik", "Hexaline", "Brumby", "Kestrel", "Lunaris", "Draxon", "Peridot", "Wyvern", "Glimmer", "Sablefish",
         "Orrery", "Tansy", "Quillon", "Marrow"]
PEOPLE = ["Mira Okafor", "Jonas Lindqvist", "Priya Raman", "Tomas Ferreira", "Aiko Tanaka", "Lena Brandt",
          "Samuel Osei", "Clara Moreau", "Diego Alvarez", "Yusuf Demir"]
FILE_WORDS = ["settings", "options", "profile", "layout", "tuning", "defaults"]
FACTS: list[tuple[str, str, Callable[[random.Random], str]]] = [
    ("The {name} server listens on port {value} by default.",
     "Which port does the {name} server listen on by default?", lambda r: str(r.randint(1100, 9900))),
    ("The {name} project was first released in {value}.",
     "In which year was the {name} project first released?", lambda r: str(r.randint(1991, 2023))),
    ("The maintainer of the {name} package is {value}.", "Who is the maintainer of the {name} package?",
     lambda r: r.choice(PEOPLE)),
    ("The {name} tool keeps its configuration in a file named {value}.",
     "In which file does the {name} tool keep its configuration?",
     lambda r: f"{r.choice(FILE_WORDS)}.{r.choice(['toml', 'ini', 'yaml'])}"),
]


def qa_set(corpus: Corpus, n: int, seed: int = 0, num_passages: int = 10) -> list[tuple[list[Passage], str, str]]:
    """``n`` (passages in retrieval order, question, expected answer), the same for the same corpus and seed."""
    rng = random.Random(f"qa/{seed}")
    out = []
    for _ in range(n):
        fact, question, value_of = rng.choice(FACTS)
        name, *others = rng.sample(NAMES, 3)
        value = value_of(rng)

        def filler() -> str:
            return rng.choice(corpus.passages).text[:260].rsplit(" ", 1)[0]

        passages = [Passage(f"doc-{name.lower()}", f"{fact.format(name=name, value=value)} {filler()}")]
        for other in others:  # hard negatives: the same kind of fact about other projects
            passages.append(Passage(f"doc-{other.lower()}", f"{fact.format(name=other, value=value_of(rng))} "
                                    f"{filler()}"))
        while len(passages) < num_passages:
            p = rng.choice(corpus.passages)
            text = p.text[:320].rsplit(" ", 1)[0]
            passages.append(Passage(p.source, text))
            if rng.random() < 0.3 and len(passages) < num_passages:  # a mirror copy: near-duplicate
                passages.append(Passage(f"{p.source} (mirror)", text.replace(". ", ".  ", 1) + " (mirror copy)"))
        ids = {}
        unique = []
        for p in passages:  # ids must be unique in a request
            ids[p.id] = ids.get(p.id, 0) + 1
            unique.append(Passage(p.id if ids[p.id] == 1 else f"{p.id}#{ids[p.id]}", p.text))
        rng.shuffle(unique)
        out.append((unique, question.format(name=name), value))
    return out


def qa_requests(items: Sequence[tuple[list[Passage], str, str]], count: Callable[[str], int], top_k: int,
                max_tokens: int = 16) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(off, on) requests of the QA items: every passage pasted in, or sent as ``documents`` with ``top_k``."""
    off, on = [], []
    for passages, question, _ in items:
        base = [{"role": "system", "content": QA_SYSTEM}, {"role": "user", "content": question}]
        pasted, _ = build_messages(base, passages)
        text = "\n\n".join(m["content"] for m in pasted)
        off.append(BenchRequest(pasted, text, count(text), max_tokens, {"ignore_eos": False}))
        docs = [{"id": p.id, "text": p.text} for p in passages]
        on.append(BenchRequest(base, "\n\n".join(m["content"] for m in base), count(question), max_tokens,
                               {"ignore_eos": False, "documents": docs, "top_k_documents": top_k}))
    return off, on


def faq_requests(corpus: Corpus, run: int, num_faqs: int = 50, max_tokens: int = 24) -> list[BenchRequest]:
    """The ``num_faqs`` FAQ requests of run ``run`` (its system prompt names the run: a cold cache per run)."""
    rng = random.Random("faq")
    entries = rng.sample(corpus.passages, num_faqs)
    system = f"{SUPPORT_SYSTEM_PROMPT} (Help desk session {run}.)"
    out = []
    for p in entries:
        answer = p.text[:240].rsplit(" ", 1)[0]
        user = f"FAQ:\nQ: What is {p.source}?\nA: {answer}\n\nCustomer: Hi, what does {p.source} do?"
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        out.append(BenchRequest(msgs, f"{system}\n\n{user}", corpus.count(f"{system}\n\n{user}"), max_tokens))
    return out


def customer_requests(faqs: Sequence[BenchRequest], n: int, s: float, unique_share: float, seed: int,
                      count: Callable[[str], int]) -> list[BenchRequest]:
    """``n`` requests of a help desk: each a Zipf draw over ``faqs`` (:func:`zipf_draw`); a share ``unique_share``
    of them (seeded) asks its FAQ entry a question of its own (the customer's order number added: a prompt no
    other request has, so never an exact cache hit), the others repeat the FAQ request exactly."""
    rng = random.Random(f"unique/{seed}")
    out = []
    for i, r in enumerate(zipf_draw(faqs, n, s, seed)):
        if rng.random() < unique_share:
            system, user = r.messages[0]["content"], r.messages[1]["content"]
            user = f"{user} My order number is {rng.randint(10_000, 99_999)}-{i}."
            text = f"{system}\n\n{user}"
            r = BenchRequest([{"role": "system", "content": system}, {"role": "user", "content": user}], text,
                             count(text), r.max_tokens, dict(r.extra))
        out.append(r)
    return out


def zipf_draw(items: Sequence[Any], n: int, s: float, seed: int) -> list[Any]:
    """``n`` items drawn with replacement, rank k (1-based, in ``items`` order) with weight 1 / k^s."""
    rng = random.Random(f"zipf/{seed}")
    weights = [1.0 / (k ** s) for k in range(1, len(items) + 1)]
    return rng.choices(list(items), weights=weights, k=n)


def _median_ttft_ms(run: RunResult) -> float | None:
    return run.metrics.latency.get("median_ttft_ms")


def compare_documents(config: BenchConfig, corpus: Corpus, n: int, seed: int, top_k: int = 3,
                      count_tokens: Callable[[str], int] | None = None) -> dict[str, Any]:
    """Run knowledge-qa off then on; returns the table's rows (and prints them)."""
    items = qa_set(corpus, n, seed)
    off, on = qa_requests(items, corpus.count, top_k)
    rows = {}
    for name, reqs in (("selection off", off), ("selection on", on)):
        run = run_benchmark(config, reqs, f"knowledge-qa {name}", count_tokens)
        correct = [r.success and answer.lower() in r.generated_text.lower()
                   for r, (_, _, answer) in zip(run.results, items, strict=True)]
        ok = [r for r in run.results if r.success]
        rows[name] = {"requests": len(reqs), "failed": run.metrics.failed,
                      "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / max(1, len(ok)),
                      "median_ttft_ms": _median_ttft_ms(run), "output_tok_s": run.metrics.output_throughput,
                      "accuracy": sum(correct) / len(correct)}
        print(f"{name}: accuracy {rows[name]['accuracy']:.0%}, median TTFT {_fmt(rows[name]['median_ttft_ms'], 0)}"
              " ms", flush=True)  # each variant as it ends
    print_table("knowledge-qa: passage selection (documents + top_k_documents) off vs on", rows)
    return rows


def compare_answer_cache(config: BenchConfig, corpus: Corpus, n: int, seed: int, rates: Sequence[float],
                         goal: float, zipf_s: float = 1.0, count_tokens: Callable[[str], int] | None = None,
                         unique_share: float = 0.3, warmup: bool = True) -> dict[str, Any]:
    """Run customer-service at every rate, the answer cache off then on at each; returns the table's rows.

    With ``warmup`` each measured run follows one request per FAQ (its own run's, all at once, not measured): the
    steady state of a help desk whose frequent questions were asked before (on: the answer cache holds them;
    off: the prefix cache does), rather than a cold start. ``unique_share``: see :func:`customer_requests`."""
    import dataclasses

    if not 0.0 <= unique_share <= 1.0:
        raise ValueError(f"--unique-share must be in [0, 1], got {unique_share}")
    variants = (("answer cache off", {"cache": False}), ("answer cache on", {}))
    per_rate: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    run_index = time.time_ns() // 1000 % 10**9  # runs of this invocation never meet a cache an earlier one filled
    count = corpus.count
    for i, rate in enumerate(rates):
        for name, extra in variants:  # off and on back to back at each rate: both see the same machine load
            run_index += 1
            faqs = [dataclasses.replace(r, extra=dict(extra)) for r in faq_requests(corpus, run=run_index)]
            if warmup:
                run_benchmark(dataclasses.replace(config, request_rate=math.inf, slos={}), faqs,
                              f"customer-service {name} warm-up", count_tokens)
            reqs = customer_requests(faqs, n, zipf_s, unique_share, seed, count)
            cfg = dataclasses.replace(config, request_rate=rate, seed=config.seed + i)
            run = run_benchmark(cfg, reqs, f"customer-service {name} rate={rate:g}", count_tokens)
            hits = sum(r.answer_cache == "hit" for r in run.results)
            lat = run.metrics.latency
            x = {"rate": rate, "hit_rate": hits / len(reqs), "p50_ttft_ms": lat.get("median_ttft_ms"),
                 "p99_ttft_ms": lat.get("p99_ttft_ms"), "slo_attainment": run.metrics.slo_attainment,
                 "failed": run.metrics.failed}
            per_rate[name].append(x)
            print(f"{name}, rate {_fmt(rate, 2)} req/s: " + _cache_cells(x), flush=True)  # each rate as it ends
    rows: dict[str, Any] = {}
    for name, runs in per_rate.items():
        best = max_sustained_rate([(x["rate"], x["slo_attainment"]) for x in runs], goal)
        rows[name] = {"runs": runs, "max_sustained_rate": best}
    print_cache_table(rows, config.slos, goal)
    return rows


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.{digits}f}"
    return str(v)


def print_table(title: str, rows: dict[str, dict[str, Any]], out=None) -> None:
    out = out or sys.stdout
    print(f"\n{title}\n", file=out)
    print("| variant | requests | mean prompt tokens | median TTFT (ms) | output tok/s | accuracy |", file=out)
    print("|---|---|---|---|---|---|", file=out)
    for name, r in rows.items():
        print(f"| {name} | {r['requests']} | {_fmt(r['mean_prompt_tokens'], 0)} | {_fmt(r['median_ttft_ms'], 0)} | "
              f"{_fmt(r['output_tok_s'], 2)} | {r['accuracy']:.0%} |", file=out)
    out.flush()


def _cache_cells(x: dict[str, Any]) -> str:
    att = "-" if x["slo_attainment"] is None else f"{x['slo_attainment']:.0%}"
    return (f"hit rate {x['hit_rate']:.0%}, p50 TTFT {_fmt(x['p50_ttft_ms'], 0)} ms, p99 TTFT "
            f"{_fmt(x['p99_ttft_ms'], 0)} ms, SLO attainment {att}")


def slo_text(slos: dict[str, float]) -> str:
    """The SLOs as the README writes them: ``TTFT <= 3 s`` (whole seconds), else ``TPOT <= 200 ms``."""
    return ", ".join(f"{k.upper()} <= {v / 1000:g} s" if v >= 1000 and v % 1000 == 0 else f"{k.upper()} <= {v:g} ms"
                     for k, v in slos.items()) or "none"


def print_cache_table(rows: dict[str, Any], slos: dict[str, float], goal: float, out=None) -> None:
    out = out or sys.stdout
    slo = slo_text(slos)
    print(f"\ncustomer-service: answer cache off vs on (SLO {slo}, attainment goal {goal:.0%})\n", file=out)
    print(f"| variant | rate (req/s) | hit rate | p50 TTFT (ms) | p99 TTFT (ms) | SLO attainment ({slo}) |", file=out)
    print("|---|---|---|---|---|---|", file=out)
    for name, r in rows.items():
        for x in r["runs"]:
            att = "-" if x["slo_attainment"] is None else f"{x['slo_attainment']:.0%}"
            print(f"| {name} | {_fmt(x['rate'], 2)} | {x['hit_rate']:.0%} | {_fmt(x['p50_ttft_ms'], 0)} | "
                  f"{_fmt(x['p99_ttft_ms'], 0)} | {att} |", file=out)
    for name, r in rows.items():
        print(f"\nmax sustained rate, {name}: {_fmt(r['max_sustained_rate'], 2)} req/s", file=out)
    out.flush()


def write(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, default=str)
        print(f"wrote {path}")
