"""Two models in one server under concurrent load, against one model alone: output tokens/s in total and per model,
with the engines' steps serialized (the default, ``engine/step_lock.py``) and running at once
(``--no-serialize-model-steps``).

Configurations (one ``leanserve serve`` each, the default SmolLM2 file, ``--threads`` default = all cores):
- ``one``: the file served once (``smol-a``), ``--concurrency`` closed-loop clients.
- ``two-serialized``: the file twice (``smol-a``, ``smol-b``: two engines, two KV pools), ``--concurrency`` clients
  per model, one engine step at a time.
- ``two-concurrent``: the same, with ``--no-serialize-model-steps``.

Each client sends ``--requests`` / concurrency completions one after the other: a ~``--prompt-tokens``-token
window of the bench corpus (distinct per request, so no prefix-cache hits) and ``--max-tokens`` output tokens
(``ignore_eos``). Reported: wall time, output tokens/s in total and per model, and the median of the requests'
``timings.predicted_per_token_ms`` (TPOT).

Usage (the machine's load changes the numbers; on a shared machine say so):
    PYTHONPATH=$PWD nice -n 19 .venv/bin/python -m benchmarks.multi_model [--out multi_model.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from leanserve.bench.corpus import corpus_text
from leanserve.tools.banner import wait_for_banner_url

import httpx

CONFIGS = {
    "one": ([{"served_model_name": "smol-a"}], []),
    "two-serialized": ([{"served_model_name": "smol-a"}, {"served_model_name": "smol-b"}], []),
    "two-concurrent": ([{"served_model_name": "smol-a"}, {"served_model_name": "smol-b"}],
                       ["--no-serialize-model-steps"]),
}


def start(models: list[dict], extra: list[str], kv_bytes: int) -> tuple[subprocess.Popen, str]:
    cfg = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(models, cfg)
    cfg.close()
    cmd = [sys.executable, "-m", "leanserve.cli", "serve", "--port", "0", "--log-level", "warning",
           "--models-config", cfg.name, "--kv-cache-memory", str(kv_bytes), "--max-model-len", "1024", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = wait_for_banner_url(proc, 300)
    if not url:
        proc.kill()
        raise RuntimeError("server did not start")
    return proc, url


async def load(url: str, models: list[str], prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    per_model: dict[str, dict] = {m: {"tokens": 0, "tpot_ms": []} for m in models}
    queues = {m: list(prompts) for m in models}

    async def client(c: httpx.AsyncClient, model: str) -> None:
        while queues[model]:
            prompt = queues[model].pop()
            r = await c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                      "ignore_eos": True, "temperature": 0})
            body = r.json()
            per_model[model]["tokens"] += body["usage"]["completion_tokens"]
            per_model[model]["tpot_ms"].append(body["timings"]["predicted_per_token_ms"])

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await c.post("/v1/completions", json={"model": models[0], "prompt": "warm up", "max_tokens": 4})
        t0 = time.monotonic()
        await asyncio.gather(*(client(c, m) for m in models for _ in range(concurrency)))
        wall = time.monotonic() - t0
    total = sum(v["tokens"] for v in per_model.values())
    return {"wall_s": round(wall, 2), "output_tok_s": round(total / wall, 1),
            "per_model": {m: {"output_tok_s": round(v["tokens"] / wall, 1),
                              "tpot_ms_p50": round(statistics.median(v["tpot_ms"]), 1)}
                          for m, v in per_model.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=4, help="clients per model")
    ap.add_argument("--requests", type=int, default=12, help="requests per model")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="about this many tokens per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-memory", type=int, default=128 << 20, help="bytes per model")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    text = corpus_text()
    chars = args.prompt_tokens * 4  # ~4 characters per token of English/code prose
    prompts = [text[i * chars:(i + 1) * chars] for i in range(args.requests)]
    results = {"machine_cpus": os.cpu_count(), "args": vars(args), "configs": {}}
    for name in args.configs.split(","):
        models, extra = CONFIGS[name]
        proc, url = start(models, extra, args.kv_cache_memory)
        try:
            r = asyncio.run(load(url, [m["served_model_name"] for m in models], prompts, args.concurrency,
                                 args.max_tokens))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
        results["configs"][name] = r
        print(f"{name:<16} wall {r['wall_s']:>7.1f} s  total {r['output_tok_s']:>6.1f} tok/s  " + "  ".join(
            f"{m}: {v['output_tok_s']:.1f} tok/s (TPOT p50 {v['tpot_ms_p50']:.0f} ms)"
            for m, v in r["per_model"].items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
