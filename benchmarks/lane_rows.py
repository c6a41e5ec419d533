"""The lane kernel by number of rows: a whole decode step of the default model (``ModelRunner.measure_decode_cost``,
ms) and one product of each of the default model's quantized matrix shapes (ms, all 30 layers' matrices in turn,
weights cold in cache as in a forward pass), for this checkout's native kernels and optionally a baseline source
tree's (e.g. ``git archive <commit> leanserve | tar -x -C /tmp/base``; its extension is built or found by a
subprocess and loaded beside this one). Both run in this process, two engines over the same loaded weights, in
turns per row count and repeat, so that load from other processes on this shared machine hits both alike; the
fastest of the repeats is kept. Usage:
    .venv/bin/python -m benchmarks.lane_rows [--baseline /tmp/base] [--repeats 20] [--rows 1,2,3,4,5,6,8,16,32]
        [--threads N]
Writes benchmarks/results/lane_rows.json and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import leanserve  # noqa: F401  (first: OpenMP wait policy)

from benchmarks.common import load_extension

ROWS = (1, 2, 3, 4, 5, 6, 8, 16, 32)
# (name, weights of one layer whose rows are concatenated, as the model packs them)
MATRICES = (("qkv 960x576", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("o 576x576", ("self_attn.o_proj",)), ("gate_up 3072x576", ("mlp.gate_proj", "mlp.up_proj")),
            ("down 576x1536", ("mlp.down_proj",)))


def baseline_ext(tree: str):
    """The native kernels of the source tree ``tree`` (built there by a subprocess if need be), loaded here."""
    code = "from leanserve.kernels import native_ops; print(native_ops().__file__)"
    so = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=tree), cwd=tree, check=True,
                        capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return load_extension(so)


def engine_with(ext, loaded):
    """An LLM over ``loaded`` whose model and runner use the extension ``ext``."""
    import leanserve.model.llama as llama
    import leanserve.worker.model_runner as runner
    from leanserve import LLM

    import torch

    saved = llama.native_ops, runner.native_ops
    llama.native_ops = runner.native_ops = lambda: ext
    try:
        return LLM(loaded=loaded, num_threads=torch.get_num_threads())
    finally:
        llama.native_ops, runner.native_ops = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="", help="a source tree (holding leanserve/) to compare against")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--threads", type=int, default=0, help="torch's (and the kernels' pool's) threads (0: all)")
    ap.add_argument("--out", default="benchmarks/results/lane_rows.json")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]

    from leanserve.kernels import cpu_info, native_ops
    from leanserve.loader import load_model
    from leanserve.quantization.weights import GroupQuantized, pack_group_quantized

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    exts = {"this": native_ops()} | ({"baseline": baseline_ext(args.baseline)} if args.baseline else {})
    loaded = load_model(None, quantization="auto")
    runners = {k: engine_with(e, loaded).engine.runner for k, e in exts.items()}
    step = {k: {n: float("inf") for n in rows} for k in exts}
    for _ in range(max(1, args.repeats // 5)):  # turns: 5 repeats of one tree, then of the other
        for n in rows:
            for k, r in runners.items():
                step[k][n] = min(step[k][n], r.measure_decode_cost([n], repeats=5)[n] * 1e3)
    kernel: dict[str, dict[str, dict[int, float]]] = {k: {} for k in exts}
    for name, parts in MATRICES:
        groups = [GroupQuantized.cat_rows([loaded.weights[f"model.layers.{i}.{p}.weight"] for p in parts])
                  for i in range(loaded.config.num_layers)]
        mats = {k: [pack_group_quantized(g, e) for g in groups] for k, e in exts.items()}
        for k in exts:
            kernel[k][name] = {}
        for m in rows:
            x = torch.randn(m, mats["this"][0].shape[1])
            best = {k: float("inf") for k in exts}
            for _ in range(args.repeats):
                for k, ws in mats.items():
                    t0 = time.perf_counter()
                    for w in ws:
                        w.kernel(x)
                    best[k] = min(best[k], (time.perf_counter() - t0) / len(ws) * 1e3)
            for k in exts:
                kernel[k][name][m] = best[k]
    print(f"{'rows':<26}" + "".join(f"{r:>8}" for r in rows))
    for k in exts:
        print(f"{'step ms ' + k:<26}" + "".join(f"{step[k][r]:>8.2f}" for r in rows))
        print(f"{'  / 1 row':<26}" + "".join(f"{step[k][r] / step[k][rows[0]]:>8.2f}" for r in rows))
    if "baseline" in exts:
        print(f"{'step baseline / this':<26}" + "".join(f"{step['baseline'][r] / step['this'][r]:>8.2f}"
                                                      for r in rows))
    for name, _ in MATRICES:
        for k in exts:
            print(f"{name + ' ' + k:<26}" + "".join(f"{kernel[k][name][r]:>8.3f}" for r in rows))
        if "baseline" in exts:
            print(f"{'  baseline / this':<26}" + "".join(
                f"{kernel['baseline'][name][r] / kernel['this'][name][r]:>8.2f}" for r in rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "cpu": cpu_info(), "threads": torch.get_num_threads(), "repeats": args.repeats,
        "note": "2-core machine shared with other engineers' jobs; both trees in one process, in turns; fastest "
                "of the repeats", "step_ms": step, "kernel_ms": kernel}, indent=1) + "\n")


if __name__ == "__main__":
    main()
