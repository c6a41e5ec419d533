"""Model routing benchmark: quality, mean latency and compute per request of always-cheap, always-strong and each
router policy of :mod:`leanserve.routing`, on the labelled set of :mod:`benchmarks.routing_data`.

How it runs (Python API, ``leanserve.LLM``, one per model, greedy, the same few-shot completion prompt for both):

1. Each model answers every request of the set once, **one request at a time** (so each latency is a single-stream
   latency, not a share of a batch), with ``logprobs=0`` (the chosen tokens' logprobs, which the cascade judges).
   Greedy decoding is deterministic, so a policy's outcome on a request is exactly the recorded answer of the model
   it picks: each policy is then *replayed* from these records instead of generating again.
2. Policies: ``always-cheap``, ``always-strong``, ``rules`` (prompt length, code, math), ``learned@S`` (WordLlama
   kNN over the set's ``examples`` split, threshold calibrated on its ``calibration`` split to a strong share S),
   ``cascade@E`` (cheap first; escalate when the answer's mean token logprob is under a threshold calibrated on the
   ``calibration`` split to an escalation share E), and ``learned x216 outcome`` (knn / logistic x WordLlama /
   MiniLM, trained on outcome labels of the ``examples`` and ``calibration`` splits together, calibrated on their
   own leave-one-out / out-of-fold scores; the labelled file is written to
   ``benchmarks/data/routing_outcome_examples.jsonl``). The table reports the ``heldout`` split only.
3. Per request: quality = the answer passes its checker (:func:`benchmarks.routing_data.is_correct`); latency =
   the seconds of every model that ran (the cascade: cheap + strong when it escalates) plus the policy's own time;
   compute = 2 x (matmul parameters per token: every projection of every layer and the output head, not the
   embedding lookup) x (prompt + output tokens), summed over the models that ran (attention's score FLOPs are
   left out: under 2 % at these lengths).

Usage:
    .venv/bin/python -m benchmarks.routing [--limit N] [--strong gemma3-270m|smollm2-fp32] [--probe]
``--probe`` only measures each candidate model's quality (batched, quick) to pick the pair. Writes
benchmarks/results/routing.json (with the ``machine`` field) and prints a table; the recorded answers go to
routing_records.json, which ``--records`` replays (other shares, no model run; latencies are the recorded ones).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from leanserve import LLM, SamplingParams

from benchmarks.common import write_json
from benchmarks.routing_data import DATA, SET_PATH, is_correct

# the examples + calibration parts labelled by outcome ("hard": the strong model right, the cheap one wrong),
# written by each run (the same bytes for the same answers): a learned router's examples file
OUTCOME_EXAMPLES_PATH = DATA / "routing_outcome_examples.jsonl"

CANDIDATES = {  # name -> LLM keyword arguments
    "smollm2-q4": {"model": None, "quantization": "auto"},  # the default SmolLM2-135M-Instruct Q4_1 file
    "smollm2-fp32": {"model": None, "quantization": "none"},  # the same file, dequantized to fp32
    "gemma3-270m": {"model": "gemma3-270m", "quantization": "auto"},  # Gemma 3 270M base (`make gemma`)
}
FEW_SHOT = ("Answer each question with only the answer.\n\n"
            "Q: Sentence: The box is heavy.\nIs the box light? Answer yes or no.\nA: no\n\n"
            "Q: Text: Maria is a singer who lives in Lisbon.\nWhat is Maria's job?\nA: singer\n\n"
            "Q: Repeat exactly: sun table\nA: sun table\n\n"
            "Q: Sentence: The cup is full.\nIs the cup full? Answer yes or no.\nA: yes\n\n"
            "Q: Write the word stone in capital letters.\nA: STONE\n\n"
            "Q: Compute (10 * 3) - 4 + 2.\nA: 28\n\n"
            "Q: Text: Leo is a tailor who lives in Oslo.\nWho lives in Oslo?\nA: Leo\n\n")
MAX_TOKENS = 12
STOP = ["\n"]


def prompt_of(question: str) -> str:
    """The completion prompt both models get: :data:`FEW_SHOT` then ``Q: question / A:``."""
    return f"{FEW_SHOT}Q: {question}\nA:"


def load_set(limit: int | None = None) -> list[dict]:
    """The labelled set; with ``limit``, the first ``limit`` items of each split (the file is shuffled)."""
    items = [json.loads(line) for line in SET_PATH.read_text().splitlines()]
    if limit is None:
        return items
    counts: dict[str, int] = {}
    out = []
    for item in items:
        if counts.get(item["split"], 0) < limit:
            counts[item["split"]] = counts.get(item["split"], 0) + 1
            out.append(item)
    return out


def matmul_params(cfg) -> int:
    """Weights multiplied per token: q, k, v, o and the three MLP matrices of every layer, plus the output head."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * h


@dataclass
class Answer:
    """One model's recorded answer to one request."""

    text: str
    prompt_tokens: int
    output_tokens: int
    token_logprobs: list[float]
    latency_s: float
    correct: bool


def run_model(name: str, items: list[dict], sequential: bool) -> tuple[dict[str, Answer], dict]:
    """Every item answered by candidate ``name``; ``sequential``: one request at a time (latencies are
    single-stream), else one batch (latencies are then meaningless). Returns answers by id and the model's info."""
    llm = LLM(**CANDIDATES[name], max_model_len=2048)
    cfg = llm.engine.model_config
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=STOP, logprobs=0)
    prompts = [prompt_of(it["question"]) for it in items]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up (kernels, allocator)
    answers: dict[str, Answer] = {}

    def record(item, out, seconds):
        comp = out.outputs[0]
        lps = [next(iter(d.values())).logprob if len(d) == 1 else d[tid].logprob
               for d, tid in zip(comp.logprobs or [], comp.token_ids, strict=True)]
        answers[item["id"]] = Answer(comp.text, len(out.prompt_token_ids), len(comp.token_ids), lps, seconds,
                                     is_correct(comp.text, item))

    if sequential:
        for item, prompt in zip(items, prompts, strict=True):
            t0 = time.perf_counter()
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            record(item, out, time.perf_counter() - t0)
    else:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        per = (time.perf_counter() - t0) / len(items)
        for item, out in zip(items, outs, strict=True):
            record(item, out, per)
    info = {"matmul_params": matmul_params(cfg), "architecture": cfg.architecture, **CANDIDATES[name]}
    del llm
    return answers, info


def quality_by(answers: dict[str, Answer], items: list[dict], key: str) -> dict[str, float]:
    groups: dict[str, list[bool]] = {}
    for it in items:
        groups.setdefault(it[key], []).append(answers[it["id"]].correct)
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}


def probe(limit: int | None) -> None:
    items = load_set(limit)
    rows = {}
    for name in CANDIDATES:
        t0 = time.perf_counter()
        answers, info = run_model(name, items, sequential=False)
        q = sum(a.correct for a in answers.values()) / len(answers)
        rows[name] = {"quality": q, "by_label": quality_by(answers, items, "label"),
                      "by_category": quality_by(answers, items, "category"), "seconds": time.perf_counter() - t0,
                      **info}
        print(f"{name}: quality {q:.3f} {rows[name]['by_label']} {rows[name]['by_category']}", flush=True)
    write_json("benchmarks/results/routing_probe.json", {"items": len(items), "candidates": rows})


@dataclass
class Outcome:
    """What a policy did on one request."""

    models: list[str]  # the models that ran, in order (the cascade: cheap, then strong when escalated)
    answer: Answer  # the final answer
    decide_s: float  # the policy's own time (detectors, embedding, judging)


def replay(policy_run, items: list[dict], records: dict[str, dict[str, Answer]],
           flops_per_token: dict[str, int]) -> dict:
    """Runs ``policy_run(item) -> Outcome`` on every item and sums quality, latency and compute."""
    correct = strong = 0
    latency = compute = 0.0
    for item in items:
        out = policy_run(item)
        correct += out.answer.correct
        strong += out.models[-1] == "strong"
        latency += out.decide_s + sum(records[m][item["id"]].latency_s for m in out.models)
        compute += sum(flops_per_token[m] * (records[m][item["id"]].prompt_tokens
                                             + records[m][item["id"]].output_tokens) for m in out.models)
    n = len(items)
    return {"quality": correct / n, "strong_share": strong / n, "mean_latency_s": latency / n,
            "gflop_per_request": compute / n / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="at most N items of each split")
    ap.add_argument("--cheap", default="smollm2-q4", choices=sorted(CANDIDATES))
    ap.add_argument("--strong", default="gemma3-270m", choices=sorted(CANDIDATES))
    ap.add_argument("--probe", action="store_true", help="only each candidate's quality (batched)")
    ap.add_argument("--strong-shares", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5],
                    help="learned routers: strong-model shares to calibrate to")
    ap.add_argument("--outcome-shares", type=float, nargs="+", default=[0.1, 0.15, 0.2, 0.3],
                    help="learned routers trained on outcome labels of the examples + calibration parts: shares")
    ap.add_argument("--escalation-shares", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3],
                    help="cascades: escalation shares to calibrate to")
    ap.add_argument("--records", help="replay the answers saved by an earlier run (its *_records.json) instead of "
                    "running the models")
    ap.add_argument("--out", default="benchmarks/results/routing.json")
    args = ap.parse_args()
    if args.probe:
        probe(args.limit)
        return
    benchmark(args)


def benchmark(args) -> None:
    from leanserve.embeddings import MiniLMEmbedder, WordLlamaEmbedder
    from leanserve.errors import ModelLoadError
    from leanserve.routing import CascadePolicy, LearnedPolicy, RouteInput, RulesPolicy, calibrate_min_mean_logprob

    items = load_set(args.limit)
    by_split = {name: [it for it in items if it["split"] == name] for name in ("examples", "calibration", "heldout")}
    records: dict[str, dict[str, Answer]] = {}
    infos: dict[str, dict] = {}
    if args.records:  # replay an earlier run's answers (same set, same models)
        saved = json.loads(Path(args.records).read_text())
        infos = saved["models"]
        records = {role: {i: Answer(**a) for i, a in answers.items()} for role, answers in saved["records"].items()}
        for it in items:  # graded again: the checkers may have changed since
            for answers in records.values():
                if it["id"] in answers:
                    answers[it["id"]].correct = is_correct(answers[it["id"]].text, it)
        missing = [it["id"] for it in items if any(it["id"] not in records[r] for r in ("cheap", "strong"))]
        if missing or (infos["cheap"]["name"], infos["strong"]["name"]) != (args.cheap, args.strong):
            raise SystemExit(f"{args.records} does not hold these models' answers to every request")
    else:
        for role, name in (("cheap", args.cheap), ("strong", args.strong)):
            t0 = time.perf_counter()
            records[role], infos[role] = run_model(name, items, sequential=True)
            infos[role]["name"] = name
            print(f"{role} {name}: {len(items)} requests one at a time in {time.perf_counter() - t0:.0f} s",
                  flush=True)
        write_json(args.out.replace(".json", "_records.json"), {
            "models": infos, "records": {r: {i: asdict(a) for i, a in answers.items()}
                                         for r, answers in records.items()}})
    flops = {role: 2 * info["matmul_params"] for role, info in infos.items()}
    heldout = by_split["heldout"]
    cheap_prompt_tokens = {it["id"]: records["cheap"][it["id"]].prompt_tokens for it in items}

    def route_input(item):
        return RouteInput(item["question"], cheap_prompt_tokens[item["id"]], MAX_TOKENS)

    def routed(policy):
        def run(item):
            t0 = time.perf_counter()
            model = policy.decide(route_input(item)).model
            role = "strong" if model == "strong" else "cheap"
            return Outcome([role], records[role][item["id"]], time.perf_counter() - t0)
        return run

    def fixed(role):
        return lambda item: Outcome([role], records[role][item["id"]], 0.0)

    def cascaded(policy):
        def run(item):
            t0 = time.perf_counter()
            policy.first(route_input(item))
            escalated = policy.judge(records["cheap"][item["id"]].token_logprobs) is not None
            roles = ["cheap", "strong"] if escalated else ["cheap"]
            return Outcome(roles, records[roles[-1]][item["id"]], time.perf_counter() - t0)
        return run

    embedder = WordLlamaEmbedder()
    ex = by_split["examples"]
    calibration_texts = [it["question"] for it in by_split["calibration"]]
    # labels by design (the set's easy / hard categories) ...
    design = LearnedPolicy("cheap", "strong", embedder, design_easy(ex), design_hard(ex))
    # ... and by outcome, RouteLLM's way: "hard" = the strong model answered right where the cheap one did not
    wins = [it["question"] for it in ex
            if records["strong"][it["id"]].correct and not records["cheap"][it["id"]].correct]
    rest = [it["question"] for it in ex if it["question"] not in set(wins)]
    outcome = LearnedPolicy("cheap", "strong", embedder, rest, wins) if wins and rest else None
    def oracle(item):  # the bound of any router: the strong model only where it is right and the cheap one wrong
        win = records["strong"][item["id"]].correct and not records["cheap"][item["id"]].correct
        return fixed("strong" if win else "cheap")(item)

    policies: list[tuple[str, object, dict]] = [
        ("always-cheap", fixed("cheap"), {}), ("always-strong", fixed("strong"), {}), ("oracle (bound)", oracle, {}),
        ("rules (code, math)", routed(RulesPolicy("cheap", "strong")), {}),
    ]
    for share in args.strong_shares:
        for label, base in (("design", design), ("outcome", outcome)):
            if base is None:
                continue
            policy = copy.copy(base)  # shares the embedded examples; its own threshold
            t = policy.calibrate(calibration_texts, share)
            policies.append((f"learned, {label} labels @{share:.2f}", routed(policy),
                             {"target_share": share, "threshold": t}))
    # outcome labels on both non-held-out parts (216 requests), calibrated on their own held-out scores (no
    # calibration texts: leave-one-out for knn, 5-fold out-of-fold for logistic), by classifier and embedding
    train = by_split["examples"] + by_split["calibration"]
    won = {it["id"] for it in train if records["strong"][it["id"]].correct and not records["cheap"][it["id"]].correct}
    wins2 = [it["question"] for it in train if it["id"] in won]
    rest2 = [it["question"] for it in train if it["id"] not in won]
    write_jsonl(OUTCOME_EXAMPLES_PATH,
                [{"text": it["question"], "label": "hard" if it["id"] in won else "easy"} for it in train])
    embedders = {"WordLlama": embedder}
    try:
        embedders["MiniLM"] = MiniLMEmbedder()
    except ModelLoadError as exc:
        print(f"skipping the MiniLM routers: {exc}", flush=True)
    for emb_name, emb in embedders.items():
        for classifier in ("knn", "logistic"):
            base2 = LearnedPolicy("cheap", "strong", emb, rest2, wins2, classifier=classifier)
            for share in args.outcome_shares:
                policy = copy.copy(base2)
                t = policy.calibrate(None, share)
                policies.append((f"learned x216 outcome, {classifier}, {emb_name} @{share:.2f}", routed(policy),
                                 {"target_share": share, "threshold": t, "classifier": classifier,
                                  "embedding": emb_name}))
    cal_answers = [records["cheap"][it["id"]].token_logprobs for it in by_split["calibration"]]
    for share in args.escalation_shares:
        t = calibrate_min_mean_logprob(cal_answers, share)
        policies.append((f"cascade @{share:.2f}", cascaded(CascadePolicy("cheap", "strong", t)),
                         {"target_share": share, "min_mean_logprob": t}))
    rows = {}
    for name, run, extra in policies:
        rows[name] = {**replay(run, heldout, records, flops), **extra}
    strong_row = rows["always-strong"]
    print(f"\nRouting on {len(heldout)} held-out requests (cheap {args.cheap}, strong {args.strong}; "
          f"{len(ex)} labelled examples, {len(calibration_texts)} calibration requests)")
    print(f"{'policy':<48}{'to strong':>10}{'quality':>9}{'vs strong':>10}{'latency ms':>12}{'GFLOP/req':>11}"
          f"{'vs strong':>10}")
    for name, r in rows.items():
        r["quality_vs_strong"] = r["quality"] / strong_row["quality"] if strong_row["quality"] else float("nan")
        r["compute_vs_strong"] = r["gflop_per_request"] / strong_row["gflop_per_request"]
        print(f"{name:<48}{r['strong_share']:>10.2f}{r['quality']:>9.3f}{r['quality_vs_strong']:>9.0%} "
              f"{r['mean_latency_s'] * 1e3:>11.0f}{r['gflop_per_request']:>11.1f}{r['compute_vs_strong']:>9.0%}")
    quality = {role: {"all": sum(a.correct for a in records[role].values()) / len(items),
                      "heldout_by_category": quality_by(records[role], heldout, "category")} for role in records}
    write_json(args.out, {"items": len(items), "heldout": len(heldout), "models": infos, "quality": quality,
                          "outcome_hard_examples": len(wins), "outcome_hard_train": len(wins2), "policies": rows})


def write_jsonl(path: str, rows: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {path}")


def design_easy(items: list[dict]) -> list[str]:
    return [it["question"] for it in items if it["label"] == "easy"]


def design_hard(items: list[dict]) -> list[str]:
    return [it["question"] for it in items if it["label"] == "hard"]


if __name__ == "__main__":
    main()
