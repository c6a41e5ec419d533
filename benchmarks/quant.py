"""Quantized vs unquantized, side by side in one run: decode tokens/s at batch 1 and 32, prefill tokens/s of
512- and 2,048-token prompts, for leanserve fp32 (``--quantization none``), int8 (per channel, re-quantized from the
dequantized file) and int4 (the file's native Q4_1, ``--quantization auto``; its prefill rows on the default
``--prefill-gemm auto``, and on ``lane`` and ``bf16x3``), beside llama.cpp on the same GGUF file; plus the KV
tokens the int8 cache holds in the memory of the fp32 one; plus, per batch size, the time of one Q4_1 matrix product in
each kernel (leanserve's lane kernel, which the default runs at every batch size; its block kernel and dequantize + fp32
GEMM, which a matrix whose width is not a multiple of 64 runs; torch's packed int4 with bf16 activations; the bf16
prefill paths).

The engines are measured round-robin (repeat 1 of every config, then repeat 2, ...) so that load from other
processes on this shared machine hits them alike; medians are reported. Usage:
    .venv/bin/python -m benchmarks.quant [--repeats 3] [--decode-tokens 64] [--prefill-tokens 512,2048]
        [--no-llama-cpp] [--threads 2] [--b1-only] [--configs "int4 (native Q4_1)"] [--no-kernel-table]
        [--interleave-peer] [--llama-cpp-bin DIR [--llama-cpp-bin DIR2]]
``--llama-cpp-bin`` is the folder of llama.cpp's llama-bench and llama-batched-bench (default: the AVX2-only build of
``benchmarks/build_llama_cpp_avx2.sh`` when ``LEANSERVE_KERNEL_ISA=avx2`` is set and it is built, else the native
build); a second one is measured in the same run, in the same turns, and its ratios printed too (e.g. the native
peer beside the AVX2-only one). ``--threads`` sets both engines' threads; ``--b1-only`` measures single-stream
decode only (llama.cpp's ``llama-bench`` tg and leanserve's, alternating per repeat) for the configs of ``--configs``
(comma-separated names; default: all). Writes benchmarks/results/quant.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from unittest import mock

from leanserve import LLM, SamplingParams
from leanserve.loader import default_model_path, load_model
from leanserve.quantization.prefill_gemm import BF16_GEMM_ENV, prefill_gemm_engine

import torch

from benchmarks.common import corpus_text, peer_env, write_json
from benchmarks.llama_cpp_build import LlamaCppBuild, resolve_llama_cpp_bin

# name -> (quantization, use_native_kernels, prefill_gemm)
CONFIGS = {"fp32": ("none", True, "auto"), "int8": ("int8", True, "auto"),
           "int4 (native Q4_1)": ("auto", True, "auto"), "Q4_1, torch kernels": ("auto", False, "auto"),
           "Q4_1 prefill lane": ("auto", True, "lane"),
           "Q4_1 prefill bf16x3": ("auto", True, "bf16x3"), "Q4_1 prefill int8": ("auto", True, "int8"),
           "Q4_1 prefill bf16 avx512": ("auto", True, "auto", "avx512_bf16")}
# a fourth element: the config's $LEANSERVE_BF16_GEMM (the bf16 prefill GEMM's engine; the others measure theirs)
KERNEL_ROWS = (1, 4, 16, 32, 48, 64, 128, 256, 512, 2048)
PER_OP = "Q4_1, per-op path"  # --b1-only: native Q4_1 with the fused decode off


def kernel_table(loaded, repeats: int = 20) -> dict[str, dict[int, float]]:
    """Milliseconds per product of the default model's fused gate/up matrix (3072 x 576, Q4_1) with M rows, over
    all 30 layers' matrices in turn (weights cold in cache, as in a forward pass), per kernel (the bf16 prefill
    paths with their dequantization into a shared bf16 buffer included, and that dequantization alone)."""
    from leanserve.kernels import native_ops
    from leanserve.quantization.weights import BlockQuantWeight, FloatWeight, GroupQuantized, pack_group_quantized

    ext = native_ops()
    mats = []
    for i in range(loaded.config.num_layers):
        p = f"model.layers.{i}.mlp."
        g = GroupQuantized.cat_rows([loaded.weights[p + "gate_proj.weight"], loaded.weights[p + "up_proj.weight"]])
        mats.append((BlockQuantWeight.from_group(g, ext, lanes=False) if ext else None, pack_group_quantized(g),
                     pack_group_quantized(g, ext) if ext else None))
    kernels = {"torch int4 (bf16 activations)": lambda x, b, t, ln: t.matmul(x)}
    if ext is not None:
        kernels["lane kernel (default)"] = lambda x, b, t, ln: ln.kernel(x)
        kernels["block kernel"] = lambda x, b, t, ln: b.kernel(x)
        kernels["dequantize + fp32 GEMM"] = lambda x, b, t, ln: FloatWeight(b.dequantize()).matmul(x)
    if ext is not None and hasattr(ext, "bf16_gemm"):  # the prefill paths of --prefill-gemm bf16 / bf16x3
        from leanserve.quantization.prefill_gemm import Bf16Prefill

        size = 3072 * loaded.config.hidden_size
        hi, lo = torch.empty(size, dtype=torch.bfloat16), torch.empty(size, dtype=torch.bfloat16)
        none = torch.empty(0, dtype=torch.bfloat16)
        bf16, bf16x3 = Bf16Prefill(ext, hi, none), Bf16Prefill(ext, hi, lo)
        kernels["bf16: dequantize + bf16 GEMM"] = lambda x, b, t, ln: bf16.matmul(ln, x)
        kernels["bf16x3: dequantize + 3 bf16 products"] = lambda x, b, t, ln: bf16x3.matmul(ln, x)
        if ext.amx_bf16_status() == "ready":  # the AMX engine beside the AVX512_BF16 one
            amx = Bf16Prefill(ext, hi, none, "amx")
            kernels["bf16 on AMX tiles"] = lambda x, b, t, ln: amx.matmul(ln, x)
        kernels["  of which lane_dequant_bf16 (bf16)"] = lambda x, b, t, ln: ext.lane_dequant_bf16(
            ln.codes, ln.d, ln._mn(), ln.bits, hi, none)
    if ext is not None and hasattr(ext, "lane_q8_gemm"):  # the prefill path of --prefill-gemm int8
        from leanserve.quantization.prefill_gemm import Int8Prefill

        int8 = Int8Prefill(ext)
        kernels[f"int8 activations ({ext.lane_q8_gemm_isa()})"] = lambda x, b, t, ln: int8.matmul(ln, x)
    table: dict[str, dict[int, float]] = {k: {} for k in kernels}
    for m in KERNEL_ROWS:
        x = torch.randn(m, loaded.config.hidden_size)
        for name, fn in kernels.items():
            n = max(1, repeats * 8 // m)
            t0 = time.perf_counter()
            for _ in range(n):
                for b, t, ln in mats:
                    fn(x, b, t, ln)
            table[name][m] = (time.perf_counter() - t0) / (n * len(mats)) * 1e3
    return table


def config_llm(loaded, name: str, args: argparse.Namespace) -> LLM:
    """The LLM of ``CONFIGS[name]`` on the shared ``loaded`` weights (its bf16 GEMM engine set while it loads)."""
    q, nk, pg, *engine = CONFIGS[name]
    with mock.patch.dict(os.environ, {BF16_GEMM_ENV: engine[0]} if engine else {}):
        return LLM(loaded=loaded, quantization=q, kv_cache_memory=args.kv_cache_memory, use_native_kernels=nk,
                   num_threads=args.threads, prefill_gemm=pg)


def decode_tok_s(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    """Decode tokens/s of ``len(prompts)`` concurrent requests: tokens after every request's first token, over the
    time since the last first token."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", p, params)
    seen: set[str] = set()
    t0, generated = None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if t0 is not None:
            generated += len(outs)
        seen.update(o.request_id for o in outs)
        if t0 is None and len(seen) == len(prompts):
            t0 = time.perf_counter()
    return generated / (time.perf_counter() - t0)


def prefill_tok_s(llm: LLM, ids: list[int]) -> float:
    """Cold prefill tokens/s of one prompt (prefix cache reset first)."""
    llm.engine.kv.pool.reset_prefix_cache()
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return len(ids) / out.metrics.prefill_time


def llama_cpp(model: str, decode_tokens: int, prefill_tokens: list[int], threads: int = 2, b1_only: bool = False,
              bench_only: bool = False, build: LlamaCppBuild | None = None) -> dict:
    """llama.cpp's own numbers from the binaries of ``build`` (None: none found): ``llama-bench`` (tg at batch 1, pp
    at each of ``prefill_tokens``: keys ``prefill_<n>_tok_s``, and ``prefill_tok_s`` for the first) and
    ``llama-batched-bench`` (tg at 32); with ``b1_only``, tg at batch 1 alone; with ``bench_only``, ``llama-bench``
    alone."""
    if build is None:
        return {"error": "llama.cpp binaries not found (build them as benchmarks/README.md says)"}
    bin_dir = Path(build.bin)
    res: dict = {}
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", model, "-t", str(threads), "-p",
                          "0" if b1_only else ",".join(map(str, prefill_tokens)), "-n", str(decode_tokens), "-r",
                          "3", "-o", "json"],
                         capture_output=True, text=True, timeout=900, env=peer_env())
    for row in json.loads(out.stdout or "[]"):
        if row.get("n_gen"):
            res["decode_b1_tok_s"] = row["avg_ts"]
        else:
            res[f"prefill_{row['n_prompt']}_tok_s"] = row["avg_ts"]
            if row["n_prompt"] == prefill_tokens[0]:
                res["prefill_tok_s"] = row["avg_ts"]
    if b1_only or bench_only:
        return res
    out = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", model, "-t", str(threads), "-c", "8192", "-b",
                          "2048", "-ub", "512", "-npp", "16", "-ntg", str(decode_tokens), "-npl", "32",
                          "--output-format", "jsonl"], capture_output=True, text=True, timeout=900, env=peer_env())
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            res["decode_b32_tok_s"] = row.get("speed_tg")
    return res


def peer_builds(folders: list[str]) -> list[LlamaCppBuild | None]:
    """The llama.cpp builds to measure, the first the one the ratios are of: each of ``folders``
    (``--llama-cpp-bin``), else the default of :func:`resolve_llama_cpp_bin` (None: none found); prints which.

    Raises:
        SystemExit: a folder without an executable llama-bench."""
    try:
        builds = [resolve_llama_cpp_bin(f) for f in folders] if folders else [resolve_llama_cpp_bin()]
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    for b in builds:
        print(f"llama.cpp peer: {b.bin} ({'AVX2-only build' if b.isa == 'avx2' else 'native build'})" if b
              else "llama.cpp peer: not found")
    forced = os.environ.get("LEANSERVE_KERNEL_ISA", "").strip().lower() == "avx2"
    if forced and not folders and builds[0] and builds[0].isa != "avx2":
        print("LEANSERVE_KERNEL_ISA=avx2 but the AVX2-only llama.cpp is not built (make llama-cpp-avx2): the peer "
              "uses every instruction set the CPU has")
    return builds


def print_peer(results: dict, peer: dict, lengths: list[int]) -> None:
    """The row of one llama.cpp build and leanserve's int4 configs' ratios to it (stored in ``peer``)."""
    name = f"llama.cpp Q4_1 {peer.get('isa', '')}".strip()
    print(f"{name:<22}{peer['decode_b1_tok_s']:>11.1f}{peer.get('decode_b32_tok_s') or 0:>12.1f}"
          + "".join(f"{peer.get(f'prefill_{m}_tok_s', 0):>14.1f}" for m in lengths))
    for conf, r in results.items():
        if conf.startswith(("int4", "Q4_1 prefill")):
            ratios = {m: r[f"prefill_{m}_tok_s"] / peer[f"prefill_{m}_tok_s"] for m in lengths
                      if peer.get(f"prefill_{m}_tok_s")}
            peer[f"prefill_ratio {conf}"] = ratios
            print(f"{conf} prefill / {name}: " + ", ".join(f"{m}: {v:.2f}x" for m, v in ratios.items())
                  + " (target >= 4x, AVX2 2x)")
    if "int4 (native Q4_1)" in results:
        r = results["int4 (native Q4_1)"]
        peer["leanserve_q4_1_b1_ratio"] = r["decode_b1_tok_s"] / peer["decode_b1_tok_s"]
        line = f"leanserve native Q4_1 decode / {name}: b1 {peer['leanserve_q4_1_b1_ratio']:.2f}x"
        if peer.get("decode_b32_tok_s"):
            peer["leanserve_q4_1_b32_ratio"] = r["decode_b32_tok_s"] / peer["decode_b32_tok_s"]
            line += f", b32 {peer['leanserve_q4_1_b32_ratio']:.2f}x"
        print(line + " (b1 target >= 1.3x with AVX-512, 1.2x AVX2)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", default="512,2048", help="prompt lengths of the prefill measurements")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes of KV pool per engine")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="threads of both engines")
    ap.add_argument("--b1-only", action="store_true", help="single-stream decode only, alternating with llama.cpp")
    ap.add_argument("--configs", default="", help="comma-separated leanserve configs (default: all)")
    ap.add_argument("--no-kernel-table", action="store_true", help="skip the per-kernel product table")
    ap.add_argument("--interleave-peer", action="store_true",
                    help="run llama-bench once per repeat, before leanserve's configs (a shared machine's load then "
                    "hits both alike); its medians are reported")
    ap.add_argument("--llama-cpp-bin", action="append", default=[], metavar="DIR",
                    help="folder of llama-bench and llama-batched-bench (default: the AVX2-only build under "
                    "LEANSERVE_KERNEL_ISA=avx2 when built, else the native build); given twice, the second build is "
                    "measured in the same run beside the first")
    ap.add_argument("--out", default="benchmarks/results/quant.json")
    args = ap.parse_args()
    args.builds = [] if args.no_llama_cpp else peer_builds(args.llama_cpp_bin)
    if args.b1_only:
        return b1_main(args)
    from leanserve.kernels import kernel_isa

    lengths = [int(v) for v in str(args.prefill_tokens).split(",")]
    names = [n.strip() for n in args.configs.split(",") if n.strip()] or list(CONFIGS)

    # llama.cpp first, alone on the machine (no leanserve engine or thread alive yet); with --interleave-peer its
    # llama-bench numbers are the medians of one run per repeat, each just before that repeat's leanserve configs
    peers = [{**llama_cpp(str(default_model_path()), args.decode_tokens, lengths, args.threads, build=b),
              **(b.record() if b else {})} for b in args.builds]
    peer_runs: list[list[dict]] = [[p] for p in peers]
    loaded = load_model(None, quantization="auto")  # native weights; each config is built from them
    tok = loaded.tokenizer
    ids = tok.encode(corpus_text(200_000), add_special_tokens=False)
    long_ids = {n: ids[5000:5000 + n] for n in lengths}
    prompts = [ids[1000 + 16 * i:1000 + 16 * (i + 1)] for i in range(32)]
    llms = {name: config_llm(loaded, name, args) for name in CONFIGS if name in names}
    raw: dict[str, dict[str, list[float]]] = {
        n: {"decode_b1": [], "decode_b32": [], "prefill": [], **{f"prefill_{m}": [] for m in lengths}} for n in llms}
    for llm in llms.values():  # warm-up: a decode and a prefill (the first prefill of a process runs cold)
        decode_tok_s(llm, prompts[:1], 4)
        prefill_tok_s(llm, long_ids[lengths[0]])
    for rep in range(args.repeats):
        for b, runs in zip(args.builds, peer_runs, strict=True) if args.interleave_peer and rep else ():
            runs.append(llama_cpp(str(default_model_path()), args.decode_tokens, lengths, args.threads,
                                  b1_only=False, bench_only=True, build=b))
        for name, llm in llms.items():
            raw[name]["decode_b1"].append(decode_tok_s(llm, prompts[:1], args.decode_tokens))
            raw[name]["decode_b32"].append(decode_tok_s(llm, prompts, args.decode_tokens))
            for m in lengths:
                raw[name][f"prefill_{m}"].append(prefill_tok_s(llm, long_ids[m]))
            raw[name]["prefill"].append(raw[name][f"prefill_{lengths[0]}"][-1])
            print(f"repeat {rep + 1} {name}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in raw[name].items()),
                  flush=True)
    results = {n: {f"{k}_tok_s": statistics.median(v) for k, v in r.items()} for n, r in raw.items()}
    # medians of the interleaved llama-bench runs (llama-batched-bench: the first run's)
    for peer, runs in zip(peers, peer_runs, strict=True):
        if len(runs) > 1:
            peer["llama_bench_runs"] = runs[1:]
            for key in ("decode_b1_tok_s", "prefill_tok_s", *(f"prefill_{m}_tok_s" for m in lengths)):
                values = [r[key] for r in runs if key in r]
                if values:
                    peer[key] = statistics.median(values)
    peer = peers[0] if peers else {}
    for name, llm in llms.items():
        results[name]["weight_bytes"] = llm.engine.model.weight_bytes()
        results[name]["bf16_gemm_engine"] = prefill_gemm_engine(llm.engine.model)
    kv32 = LLM(loaded=loaded, quantization="auto", kv_cache_memory=args.kv_cache_memory).engine
    kv8 = LLM(loaded=loaded, quantization="auto", kv_cache_memory=args.kv_cache_memory, kv_cache_dtype="int8").engine
    kv = {"memory_bytes": args.kv_cache_memory, "fp32_tokens": kv32.kv.num_tokens_capacity(),
          "int8_tokens": kv8.kv.num_tokens_capacity()}
    kv["ratio"] = kv["int8_tokens"] / kv["fp32_tokens"]
    kernels = {} if args.no_kernel_table else kernel_table(loaded)

    base = results.get("fp32")
    pre = "".join(f"{'prefill ' + str(m):>14}" for m in lengths)
    print(f"\n{'engine':<22}{'decode b1':>11}{'decode b32':>12}{pre}{'b32 vs fp32':>13}{'weights MB':>12}")
    for name, r in results.items():
        vs = f"{r['decode_b32_tok_s'] / base['decode_b32_tok_s']:>12.2f}x" if base else f"{'-':>13}"  # fp32 not run
        print(f"{name:<22}{r['decode_b1_tok_s']:>11.1f}{r['decode_b32_tok_s']:>12.1f}"
              + "".join(f"{r[f'prefill_{m}_tok_s']:>14.1f}" for m in lengths)
              + f"{vs}{r['weight_bytes'] / 1e6:>12.1f}")
    for p in peers:
        if "decode_b1_tok_s" in p:
            print_peer(results, p, lengths)
        else:
            print(f"llama.cpp: {p}")
    print(f"KV cache in {kv['memory_bytes'] >> 20} MiB: fp32 {kv['fp32_tokens']} tokens, int8 {kv['int8_tokens']} "
          f"tokens ({kv['ratio']:.2f}x; target >= 3.5x)")
    if kernels:
        print(f"\nms per 3072x576 Q4_1 product (gate/up), by rows: {'':<4}" + "".join(f"{m:>8}" for m in KERNEL_ROWS))
    for name, row in kernels.items():
        print(f"{name:<52}" + "".join(f"{row[m]:>8.3f}" for m in row))
    write_json(args.out, {"cpu_count": os.cpu_count(), "raw": raw, "leanserve": results, "llama_cpp": peer,
                          **({"llama_cpp_others": peers[1:]} if len(peers) > 1 else {}),
                          "kernel_isa": kernel_isa(), "kv_cache": kv,
                          "kernel_ms": kernels})


def b1_main(args: argparse.Namespace) -> None:
    """Single-stream decode of leanserve's configs beside llama.cpp's ``llama-bench`` tg, in turns per repeat (so
    that load from other processes hits them alike), at ``args.threads`` threads; medians."""
    from leanserve.kernels import kernel_isa

    names = [n.strip() for n in args.configs.split(",") if n.strip()] or list(CONFIGS)
    loaded = load_model(None, quantization="auto")
    ids = loaded.tokenizer.encode(corpus_text(20_000), add_special_tokens=False)
    prompt = [ids[1000:1016]]
    llms = {n: config_llm(loaded, n, args) for n in names}
    if "int4 (native Q4_1)" in llms:  # the same weights and kernels on the per-op path (fused decode off)
        per_op = LLM(loaded=loaded, quantization="auto", kv_cache_memory=args.kv_cache_memory,
                     num_threads=args.threads)
        per_op.engine.runner.model.fused_decode = None
        llms[PER_OP] = per_op
        names.append(PER_OP)
    for llm in llms.values():  # warm-up
        decode_tok_s(llm, prompt, 4)
    raw: dict[str, list[float]] = {n: [] for n in [*names, "llama.cpp"]}
    for rep in range(args.repeats):
        if not args.no_llama_cpp:
            peer = llama_cpp(str(default_model_path()), args.decode_tokens, 0, args.threads, b1_only=True,
                             build=args.builds[0])
            raw["llama.cpp"].append(peer.get("decode_b1_tok_s", float("nan")))
        for name, llm in llms.items():
            raw[name].append(decode_tok_s(llm, prompt, args.decode_tokens))
        print(f"repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in raw.items() if v), flush=True)
    med = {k: statistics.median(v) for k, v in raw.items() if v}
    print(f"\ndecode b1 tok/s, {args.threads} threads, kernel ISA {kernel_isa()} (medians of {args.repeats}):")
    for k, v in med.items():
        ratio = f"  {v / med['llama.cpp']:.2f}x llama.cpp" if "llama.cpp" in med and k != "llama.cpp" else ""
        print(f"  {k:<22}{v:>8.1f}{ratio}")
    build = args.builds[0] if args.builds else None
    write_json(args.out, {"mode": "b1-only", "threads": args.threads, "kernel_isa": kernel_isa(), "raw": raw,
                          "llama_cpp": build.record() if build else {},
                          "decode_b1_tok_s": med,
                          "ratio_to_llama_cpp": {k: v / med["llama.cpp"] for k, v in med.items()
                                                 if "llama.cpp" in med and k != "llama.cpp"}})


if __name__ == "__main__":
    main()
