"""Minor page faults and time per step of a warm engine: repeated cold prefills (prefix caching off) of 2,048- and
512-token prompts, then batch-32 decodes, on the default model (``--quantization auto``). Each fault is a page the
step maps fresh (leanserve/worker/malloc_tuning.py, leanserve/quantization/anon_memory.py); ``cpu_s`` is the
process's user + system seconds, less sensitive than wall time to other load on a shared machine. Usage:

    .venv/bin/python -m benchmarks.page_faults [--repeats 6] [--kv-cache-memory 268435456] [--out PATH]

Compare with ``LEANSERVE_MALLOC_TUNING=0`` (malloc's defaults) or a checkout of an earlier commit. Writes
benchmarks/results/page_faults.json and prints a table.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from leanserve import LLM, SamplingParams
from leanserve.loader import load_model

import torch

from benchmarks.common import write_json


def _usage() -> tuple[int, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_utime + r.ru_stime


def measure(llm: LLM, prompts: list[dict], params: SamplingParams, repeats: int) -> dict:
    """Runs ``llm.generate(prompts)`` once to warm up, then ``repeats`` times: median / fastest wall seconds,
    median CPU seconds, each run's minor faults."""
    llm.generate(prompts, params, use_tqdm=False)
    walls, cpus, faults = [], [], []
    for _ in range(repeats):
        f0, c0 = _usage()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
        f1, c1 = _usage()
        faults.append(f1 - f0)
        cpus.append(c1 - c0)
    return {"wall_s_median": statistics.median(walls), "wall_s_best": min(walls),
            "cpu_s_median": statistics.median(cpus), "faults": faults, "faults_median": statistics.median(faults)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20,
                    help="bytes of KV pool (small enough that the warm-ups touch all of it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/page_faults.json")
    args = ap.parse_args()
    loaded = load_model(None, quantization="auto")
    llm = LLM(loaded=loaded, quantization="auto", kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False,
              num_threads=args.threads)
    g = torch.Generator().manual_seed(0)
    rows = {}
    one = SamplingParams(temperature=0, max_tokens=1)
    for n in (2048, 512):
        ids = torch.randint(100, 40000, (n,), generator=g).tolist()
        rows[f"prefill {n}"] = measure(llm, [{"prompt_token_ids": ids}], one, args.repeats)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (64,), generator=g).tolist()} for _ in range(32)]
    rows["decode 32 x 64"] = measure(llm, prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                                     max(2, args.repeats // 3))
    print(f"{'step':<16}{'wall s (median)':>16}{'best':>8}{'cpu s':>8}{'faults (median)':>17}")
    for name, r in rows.items():
        print(f"{name:<16}{r['wall_s_median']:>16.3f}{r['wall_s_best']:>8.3f}{r['cpu_s_median']:>8.3f}"
              f"{r['faults_median']:>17.0f}")
    write_json(args.out, {"kv_cache_memory": args.kv_cache_memory, "threads": args.threads, "rows": rows})


if __name__ == "__main__":
    main()
