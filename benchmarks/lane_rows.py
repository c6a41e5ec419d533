"""The lane kernel by number of rows: a whole decode step of the default model (``ModelRunner.measure_decode_cost``,
ms, the fastest of ``--repeats``) and one product of each of the default model's quantized matrix shapes (ms,
all 30 layers' matrices in turn, weights cold in cache as in a forward pass), for this checkout and optionally a
baseline source tree (e.g. ``git archive <commit> leanserve | tar -x -C /tmp/base``), measured in turns, in
separate processes, so that load from other processes on this shared machine hits both alike. Usage:
    .venv/bin/python -m benchmarks.lane_rows [--baseline /tmp/base] [--rounds 3] [--rows 1,2,3,4,5,6,8,16,32]
Writes benchmarks/results/lane_rows.json (per tree: the minimum over rounds) and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROWS = (1, 2, 3, 4, 5, 6, 8, 16, 32)
# (name, weights of one layer whose rows are concatenated, as the model packs them)
MATRICES = (("qkv 960x576", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("o 576x576", ("self_attn.o_proj",)), ("gate_up 3072x576", ("mlp.gate_proj", "mlp.up_proj")),
            ("down 576x1536", ("mlp.down_proj",)))


def measure(rows: list[int], repeats: int) -> dict:
    """In this process: the step cost and the per-matrix kernel ms for each number of rows."""
    import leanserve  # noqa: F401  (first: OpenMP wait policy)
    from leanserve import LLM
    from leanserve.kernels import native_ops
    from leanserve.quantization.weights import GroupQuantized, pack_group_quantized

    import torch

    llm = LLM(model="smollm2-135m")
    runner = llm.engine.runner if hasattr(llm.engine, "runner") else llm.llm_engine.runner
    step = {n: t * 1e3 for n, t in runner.measure_decode_cost(rows, repeats=repeats).items()}
    from leanserve.loader import load_model

    loaded = load_model(None, quantization="auto")
    ext = native_ops()
    kernel: dict[str, dict[int, float]] = {}
    for name, parts in MATRICES:
        mats = []
        for i in range(loaded.config.num_layers):
            g = GroupQuantized.cat_rows([loaded.weights[f"model.layers.{i}.{p}.weight"] for p in parts])
            mats.append(pack_group_quantized(g, ext))
        kernel[name] = {}
        for m in rows:
            x = torch.randn(m, mats[0].shape[1])
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                for w in mats:
                    w.kernel(x)
                best = min(best, (time.perf_counter() - t0) / len(mats) * 1e3)
            kernel[name][m] = best
    return {"step_ms": step, "kernel_ms": kernel}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="", help="a source tree (holding leanserve/) to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--out", default="benchmarks/results/lane_rows.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        print(json.dumps(measure(rows, args.repeats)))
        return
    trees = {"this": str(Path.cwd())} | ({"baseline": args.baseline} if args.baseline else {})
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, "-m", "benchmarks.lane_rows", "--child", "--rows", args.rows,
                                  "--repeats", str(args.repeats)], env=env, cwd=tree, check=True,
                                 capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    best = {}
    for name, rs in runs.items():
        best[name] = {"step_ms": {r: min(x["step_ms"][str(r)] for x in rs) for r in rows},
                      "kernel_ms": {m: {r: min(x["kernel_ms"][m][str(r)] for x in rs) for r in rows}
                                    for m in rs[0]["kernel_ms"]}}
    print(f"{'rows':<22}" + "".join(f"{r:>8}" for r in rows))
    for name, b in best.items():
        print(f"{'step ms ' + name:<22}" + "".join(f"{b['step_ms'][r]:>8.2f}" for r in rows))
        print(f"{'  / 1 row':<22}" + "".join(f"{b['step_ms'][r] / b['step_ms'][rows[0]]:>8.2f}" for r in rows))
    if "baseline" in best:
        print(f"{'step baseline/this':<22}" + "".join(
            f"{best['baseline']['step_ms'][r] / best['this']['step_ms'][r]:>8.2f}" for r in rows))
    for m in best["this"]["kernel_ms"]:
        for name, b in best.items():
            print(f"{m + ' ' + name:<22}" + "".join(f"{b['kernel_ms'][m][r]:>8.3f}" for r in rows))
    from leanserve.kernels import cpu_info

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu_info(), "load_note": "2-core machine shared with other "
                                          "engineers; trees measured in turns, minimum over rounds",
                                          "rounds": args.rounds, "repeats": args.repeats, "results": best,
                                          "raw": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
