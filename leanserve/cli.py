"""Command line: ``leanserve serve | demo | generate | chat | bench | plan | eval | advise``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from leanserve.config import EngineConfig, ServerConfig, add_config_args, config_from_args, flag_of
from leanserve.engine.llm_engine import LLMEngine
from leanserve.entrypoints.openai.api_server import run_server
from leanserve.errors import LeanserveError
from leanserve.sampling_params import SamplingParams

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear emails.",
    "Explain in two sentences what a KV cache is in a language model.",
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options (every :class:`EngineConfig` field; vLLM's flag names) for a command that loads a model."""
    add_config_args(p.add_argument_group("engine"), EngineConfig)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` of parsed engine options. Raises InvalidParameterError for a refused value."""
    return config_from_args(EngineConfig, args)


def stream(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams,
           on_text: Callable[[str], None]) -> dict[str, float | int | str | None]:
    """Generate one request, calling ``on_text`` with each text delta; return its timings and finish reason."""
    rid = f"cli-{time.monotonic_ns()}"
    engine.add_request(rid, prompt_ids, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            on_text(out.outputs[0].delta_text)
            final = out
    m = final.metrics
    return {"ttft_s": m.ttft, "decode_tok_s": m.decode_tokens_per_s, "tokens": m.num_generation_tokens,
            "finish_reason": final.outputs[0].finish_reason, "text": final.outputs[0].text}


def _print(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_demo(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config(args))
    print(f"model: {engine.model_path}\nloaded in {engine.load_time_s:.2f} s, engine ready in "
          f"{engine.init_time_s:.2f} s\n")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tok = engine.tokenizer
    for prompt in DEMO_PROMPTS:
        print(f">>> {prompt}")
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False)
        r = stream(engine, ids, params, _print)
        speed = f"{r['decode_tok_s']:.1f} tok/s" if r["decode_tok_s"] else "n/a"
        print(f"\n[TTFT {r['ttft_s'] * 1000:.0f} ms | decode {speed} | {r['tokens']} tokens | "
              f"finish_reason {r['finish_reason']}]\n")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config(args))
    tok = engine.tokenizer
    if args.raw:
        ids = tok.encode(args.prompt)
    else:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}]),
                         add_special_tokens=False)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                            top_p=args.top_p)
    stream(engine, ids, params, _print)
    print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config(args))
    tok = engine.tokenizer
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Interactive chat; an empty line or Ctrl-D quits.")
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        _print("assistant> ")
        r = stream(engine, ids, params, _print)
        print()
        messages.append({"role": "assistant", "content": str(r["text"])})
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from leanserve.entrypoints.openai.models_config import default_served_model_name
    from leanserve.errors import ModelLoadError
    from leanserve.loader import resolve_model_path
    from leanserve.tools.plan import config_from_path, format_report, parse_bytes, plan_report

    try:
        memory = None if args.memory is None else parse_bytes(args.memory)
        reserve = parse_bytes(args.reserve)
    except ValueError as exc:
        print(f"error: bad memory size: {exc}", file=sys.stderr)
        return 2
    try:
        paths = [resolve_model_path(m) for m in args.model or [None]]  # aliases as serve takes them
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(paths) > 1:  # several models in one server: each model, and the set against --memory
        from leanserve.tools.plan import format_set_report, set_plan_report

        names = args.served_model_name or [default_served_model_name(p) for p in paths]
        if len(names) != len(paths) or len(set(names)) != len(names):
            print("error: --served-model-name: give one distinct name per --model (the same file twice needs "
                  "names)", file=sys.stderr)
            return 2
        report = set_plan_report({n: config_from_path(p) for n, p in zip(names, paths, strict=True)}, memory,
                                 args.max_model_len, reserve)
        print(json.dumps(report, indent=2) if args.json else format_set_report(report))
        return 0
    report = plan_report(config_from_path(paths[0]), memory, args.max_model_len, reserve)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from leanserve.tools.eval import run_eval_cli

    return run_eval_cli(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from leanserve.entrypoints.openai.models_config import load_models_config, model_specs

    models = args.model or []  # --model may be repeated for serve
    args.model = models[0] if models else None
    server = config_from_args(ServerConfig, args)
    several = len(models) > 1 or server.models_config is not None or len(server.served_model_names) > 1
    if several and (server.replicas > 1 or server.ray_address):
        print("error: --replicas > 1 (Ray Serve) serves one model; several models (repeated --model or "
              "--models-config) run in one process: use --replicas 1", file=sys.stderr)
        return 2
    if server.replicas > 1 or server.ray_address:
        try:  # the optional extra: pip install 'leanserve[ray]'
            from leanserve.entrypoints.ray_serve.app import run_fleet
        except ImportError as exc:
            print(f"error: --replicas > 1 needs Ray Serve (pip install 'leanserve[ray]'): {exc}", file=sys.stderr)
            return 2
        return run_fleet(engine_config(args), server)
    if not several:
        return run_server(engine_config(args), server)
    entries = None if server.models_config is None else load_models_config(server.models_config)
    specs = model_specs(engine_config(args), models, server.served_model_names, entries)
    return run_server(specs[0].engine, server, specs)


def cmd_bench(args: argparse.Namespace) -> int:
    from leanserve.bench.command import run_bench

    try:
        return run_bench(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_advise(args: argparse.Namespace) -> int:
    # the CLI hands the bench's replay to the advisor: leanserve.tools and leanserve.bench do not import each other
    from leanserve.bench.replay import WorkloadReplay, infer_workload
    from leanserve.tools.advise import run_advise_cli
    from leanserve.tools.advise_thresholds import TPOT_SLO_MS, TTFT_SLO_MS

    def make_replay(workload: str, num_prompts: int, rate: float, seed: int, tokenizer: str | None):
        return WorkloadReplay(workload, num_prompts, rate, seed, tokenizer, {"ttft": TTFT_SLO_MS, "tpot": TPOT_SLO_MS})

    try:
        return run_advise_cli(args, infer_workload, make_replay)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leanserve", description="A lean LLM inference and serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_config_args(serve.add_argument_group("server"), ServerConfig)
    demo = sub.add_parser("demo", help="answer three built-in chat prompts, with TTFT and decode speed")
    demo.add_argument("--max-tokens", type=int, default=64)
    gen = sub.add_parser("generate", help="complete one prompt and print it")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    chat = sub.add_parser("chat", help="interactive chat, printing tokens as they are produced")
    chat.add_argument("--system", default=None, help="system prompt")
    for p in (gen, chat):
        p.add_argument("--max-tokens", type=int, default=256)
        p.add_argument("--temperature", type=float, default=0.7 if p is chat else 0.0)
        p.add_argument("--seed", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=1.0)
    add_config_args(serve.add_argument_group("engine (with several models: every model's defaults)"), EngineConfig,
                    repeat=("model",))
    for p in (demo, gen, chat):
        add_engine_args(p)
    from leanserve.bench.command import add_bench_args

    add_bench_args(sub.add_parser("bench", help="benchmark an OpenAI-compatible server (TTFT, TPOT, goodput...)"))
    plan = sub.add_parser("plan", help="weight memory per precision, KV bytes per token, and what fits in a device")
    plan.add_argument("--model", default=None, action="append",
                      help="GGUF file, HF folder or config.json (default: SmolLM2-135M); repeat it to size several "
                      "models served together")
    plan.add_argument("--served-model-name", default=None, action="append", metavar="NAME",
                      help="with --model repeated: each model's name, in the same order (default: the file names)")
    plan.add_argument("--memory", default=None, help="device memory, e.g. 24GB or 16GiB: adds the fit table")
    plan.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    plan.add_argument("--reserve", default="0", help="memory kept free for activations/runtime, e.g. 1GB")
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ev = sub.add_parser("eval", help="compare quantization configs: perplexity, test set, greedy agreement, speed")
    from leanserve.tools.eval_args import add_eval_args

    add_eval_args(ev)
    from leanserve.bench.workloads import WORKLOADS
    from leanserve.tools.advise_args import add_advise_args

    add_advise_args(sub.add_parser("advise", help="read a server's metrics and rank what to optimize next"),
                    sorted(WORKLOADS))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"serve": cmd_serve, "demo": cmd_demo, "generate": cmd_generate, "chat": cmd_chat,
               "bench": cmd_bench, "plan": cmd_plan, "eval": cmd_eval,
               "advise": cmd_advise}[args.command]
    try:
        return handler(args)
    except LeanserveError as e:
        param = (getattr(e, "param", None) or "").split(".")[0]  # "speculative_config.method" -> its flag
        flag = param and (flag_of(EngineConfig, param) or flag_of(ServerConfig, param))
        print(f"error: {flag}: {e}" if flag else f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
