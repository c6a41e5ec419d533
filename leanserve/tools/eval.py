"""``leanserve eval``: compare quantization configurations of one model side by side, as a deployment gate.

For each configuration (weights none / auto / int8 / int4, optionally with an int8 KV cache) it measures
(a) perplexity on a text (default: the bundled Python Language Reference excerpt), (b) accuracy on a JSONL test set
(``{"prompt" | "messages", "expected", "metric"}``, metric in exact, contains, regex, json_valid, rougeL, choice),
(c) greedy agreement with the first (baseline) configuration: the share of identical first tokens and of identical
32-token continuations on windows of the text, (d) weight bytes, KV bytes per token and, with ``--speed``, decode
tokens/s at batch 1 and 32. ``--max-drop X`` makes the command exit 1 when a configuration's accuracy is more than
``X`` (a fraction, e.g. 0.05) below the baseline's.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from leanserve.entrypoints.llm import LLM
from leanserve.errors import InvalidParameterError
from leanserve.loader import LoadedModel, load_model
from leanserve.quantization import QUANTIZATION_METHODS
from leanserve.sampling_params import SamplingParams
from leanserve.tools.eval_metrics import ALL_METRICS, ROUGE_L_PASS, score
from leanserve.tools.eval_report import format_table, gate_failures, write_png
from leanserve.tools.eval_result import ConfigResult
from leanserve.tools.perplexity import continuation_logprob, default_text, perplexity

AGREEMENT_TOKENS = 32  # tokens of each greedy continuation compared with the baseline
AGREEMENT_PROMPT_TOKENS = 48  # tokens of text before each continuation


@dataclass
class EvalConfig:
    """One configuration under test."""

    name: str  # as given on the command line, e.g. "int4+kv-int8"
    quantization: str  # weights: none, auto, int8 or int4
    kv_cache_dtype: str  # auto, float16 or int8


def parse_configs(text: str) -> list[EvalConfig]:
    """``"none,int8,int4,kv-int8,int4+kv-int8,auto+kv-float16"`` -> configs; "kv-int8" (or "kv-float16") alone
    keeps unquantized weights.

    Raises:
        InvalidParameterError: an unknown part or an empty list.
    """
    configs = []
    for name in (c.strip() for c in text.split(",") if c.strip()):
        quant, kv = "none", "auto"
        for part in name.split("+"):
            if part in ("kv-int8", "kv-float16"):
                kv = part[3:]
            elif part in QUANTIZATION_METHODS:
                quant = part
            else:
                raise InvalidParameterError("configs", f"unknown config part {part!r} in {name!r}; use "
                                            f"{', '.join(QUANTIZATION_METHODS)}, kv-int8 or kv-float16, joined "
                                            f"with '+'")
        configs.append(EvalConfig(name, quant, kv))
    if not configs:
        raise InvalidParameterError("configs", "no configuration given")
    return configs


def default_tests_path() -> str:
    """The bundled example test set (``leanserve/tools/data/example_tests.jsonl``)."""
    return str(resources.files("leanserve.tools").joinpath("data/example_tests.jsonl"))


def load_test_set(path: str) -> list[dict[str, Any]]:
    """Read and validate a JSONL test set (blank lines skipped).

    Raises:
        InvalidParameterError: bad JSON, no prompt/messages, no expected, an unknown metric, or a choice case
            without a ``choices`` list containing ``expected``.
    """
    cases = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                case = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidParameterError("tests", f"{where}: not JSON: {exc}") from exc
            if not isinstance(case, dict) or ("prompt" not in case and "messages" not in case):
                raise InvalidParameterError("tests", f"{where}: needs 'prompt' or 'messages'")
            if "expected" not in case or case.get("metric") not in ALL_METRICS:
                raise InvalidParameterError("tests", f"{where}: needs 'expected' and 'metric' in "
                                            f"{', '.join(ALL_METRICS)}")
            if case["metric"] == "choice" and case["expected"] not in (case.get("choices") or []):
                raise InvalidParameterError("tests", f"{where}: a choice case needs 'choices' containing 'expected'")
            cases.append(case)
    return cases


def _prompt_ids(llm: LLM, case: dict[str, Any]) -> list[int]:
    """Token ids of a case: chat-templated messages (a bare prompt becomes one user message)."""
    tok = llm.get_tokenizer()
    messages = case.get("messages") or [{"role": "user", "content": case["prompt"]}]
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def run_test_set(llm: LLM, cases: list[dict[str, Any]], kv_cache_dtype: str, max_tokens: int
                 ) -> tuple[float, dict[str, float]]:
    """(mean pass rate, mean score per metric) of ``llm`` on ``cases`` (greedy generation; choices by
    log-likelihood of each choice after the prompt)."""
    tok = llm.get_tokenizer()
    gen_cases = [c for c in cases if c["metric"] != "choice"]
    outs = llm.generate([{"prompt_token_ids": _prompt_ids(llm, c)} for c in gen_cases],
                        SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False) if gen_cases else []
    texts = iter(o.outputs[0].text for o in outs)
    passed, by_metric = [], {}
    for case in cases:
        if case["metric"] == "choice":
            prompt = _prompt_ids(llm, case)
            scores = [continuation_logprob(llm.engine.model, prompt, tok.encode(ch, add_special_tokens=False),
                                           kv_cache_dtype) for ch in case["choices"]]
            s = float(case["choices"][scores.index(max(scores))] == case["expected"])
        else:
            s = score(case["metric"], next(texts), case["expected"])
        by_metric.setdefault(case["metric"], []).append(s)
        passed.append(s >= ROUGE_L_PASS if case["metric"] == "rougeL" else s == 1.0)
    return sum(passed) / len(passed), {m: sum(v) / len(v) for m, v in by_metric.items()}


def greedy_continuations(llm: LLM, text_ids: list[int], n: int) -> list[list[int]]:
    """Greedy ``AGREEMENT_TOKENS``-token continuations of ``n`` windows of the text (EOS ignored)."""
    step = max(1, (len(text_ids) - AGREEMENT_PROMPT_TOKENS) // max(n, 1))
    prompts = [{"prompt_token_ids": text_ids[i * step:i * step + AGREEMENT_PROMPT_TOKENS]} for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def decode_speed(llm: LLM, batch: int, tokens: int = 32) -> float:
    """Decode tokens/s with ``batch`` concurrent 16-token prompts: tokens generated after every request's first
    token, over the time since then."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"speed-{batch}-{i}", [(7 * i + j) % 1000 + 100 for j in range(16)], params)
    first: set[str] = set()
    t_start, generated = None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if t_start is not None:
            generated += len(outs)
        for o in outs:
            first.add(o.request_id)
        if t_start is None and len(first) == batch:
            t_start = time.perf_counter()
    return generated / (time.perf_counter() - t_start)


def evaluate(configs: list[EvalConfig], loaded: LoadedModel, text: str, cases: list[dict[str, Any]],
             ppl_tokens: int = 1024, ppl_window: int = 512, max_tokens: int = 64, agreement_prompts: int = 20,
             speed: bool = False, log: Any = None) -> list[ConfigResult]:
    """Measure every configuration (the first is the agreement baseline). ``loaded`` should hold the GGUF's native
    weights (``load_model(path, quantization="auto")``) so that every configuration can be built from it."""
    text_ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    ppl_ids = text_ids[:ppl_tokens]
    results: list[ConfigResult] = []
    baseline: list[list[int]] | None = None
    for cfg in configs:
        t0 = time.perf_counter()
        llm = LLM(loaded=loaded, quantization=cfg.quantization, kv_cache_dtype=cfg.kv_cache_dtype,
                  kv_cache_memory=256 << 20, max_num_seqs=64)
        model = llm.engine.model
        r = ConfigResult(cfg.name, perplexity(model, ppl_ids, ppl_window, cfg.kv_cache_dtype), None,
                         weight_bytes=model.weight_bytes(), kv_bytes_per_token=llm.engine.kv_bytes_per_token)
        if cases:
            r.accuracy, r.per_metric = run_test_set(llm, cases, cfg.kv_cache_dtype, max_tokens)
        if agreement_prompts:
            conts = greedy_continuations(llm, text_ids, agreement_prompts)
            baseline = baseline or conts
            r.first_token_agreement = sum(a[:1] == b[:1] for a, b in zip(conts, baseline, strict=True)) / len(conts)
            r.continuation_agreement = sum(a == b for a, b in zip(conts, baseline, strict=True)) / len(conts)
        if speed:
            r.decode_tok_s_b1 = decode_speed(llm, 1)
            r.decode_tok_s_b32 = decode_speed(llm, 32)
        r.eval_seconds = time.perf_counter() - t0
        results.append(r)
        if log:
            log(f"{cfg.name}: done in {r.eval_seconds:.1f} s")
        del llm, model
    return results


def run_eval_cli(args: Any) -> int:
    """``leanserve eval``: print the table, write JSON / PNG, and return 1 when ``--max-drop`` is exceeded."""
    configs = parse_configs(args.configs)
    cases = load_test_set(args.tests or default_tests_path())
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    else:
        text = default_text()
    loaded = load_model(args.model, quantization="auto")
    results = evaluate(configs, loaded, text, cases, args.ppl_tokens, args.ppl_window, args.max_tokens,
                       args.agreement_prompts, args.speed, log=lambda m: print(m, file=sys.stderr))
    print(format_table(results))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"model": loaded.path, "results": [asdict(r) for r in results]}, f, indent=2)
    if args.png_out:
        write_png(results, args.png_out)
    failures = gate_failures(results, args.max_drop)
    for line in failures:
        print(f"FAIL: {line}", file=sys.stderr)
    return 1 if failures else 0
