"""Where a decode step's time goes: one stream (or ``--batch`` streams) of the default model, each step split into
the scheduler, the input tensors, the forward pass (native GEMMs per projection, the paged attention kernel, the
fused add+RMSNorm, RoPE and SwiGLU, and the rest: torch ops and Python between them), the logits (output matrix), the
sampler and the output processing, per layer where it applies. Where the fused decode applies
(leanserve/model/fused_decode.py: the layers in one native call, the default for GGUF Q4/Q8 on CPU), it reports the
step with it ("plain"), the step on the per-op path, the fused call's own time split into its phases (qkv, o,
gate_up and down GEMMs, attention, norms, RoPE + KV write, SiLU; timed inside the native call by its own clock,
``FusedDecode.set_profiling``), and the breakdown of the per-op path (whose kernels are the same). Usage:

    .venv/bin/python -m benchmarks.step_profile [--batch 1] [--steps 64] [--threads 2]

Every native call and phase is timed with ``time.perf_counter`` around it (a timing wrapper adds ~0.3 us per call,
~80 us per step at 250 calls: the "wrapped" column reports the step with it, "plain" without). Writes
benchmarks/results/step_profile.json and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve import LLM, SamplingParams
from leanserve.loader import load_model
from leanserve.quantization.weights import BlockQuantWeight

import torch

from benchmarks.common import write_json


class Clock:
    """Accumulates seconds and calls per name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
                self.calls[name] += 1
        return timed


class TimedExt:
    """An extension module whose functions are timed under ``prefix.function``."""

    def __init__(self, ext, clock: Clock, prefix: str) -> None:
        self._ext, self._clock, self._prefix = ext, clock, prefix

    def __getattr__(self, name: str):
        return self._clock.wrap(f"{self._prefix}.{name}", getattr(self._ext, name))


def instrument(llm: LLM, clock: Clock) -> None:
    engine = llm.engine
    runner, model = engine.runner, engine.runner.model
    for layer in model.layers:
        for kind in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer, kind)
            if isinstance(w, BlockQuantWeight):
                w.ext = TimedExt(w.ext, clock, f"gemm {kind}")
    if model._fused is not None:
        model._fused = TimedExt(model._fused, clock, "fused")
    if runner.decode_kernel is not None:
        runner.decode_kernel = clock.wrap("attention kernel", runner.decode_kernel)
    model.forward = clock.wrap("forward", model.forward)
    model.compute_logits = clock.wrap("logits (output matrix)", model.compute_logits)
    runner.build_inputs = clock.wrap("input tensors", runner.build_inputs)
    runner.sampler = clock.wrap("sampler", runner.sampler)
    engine.scheduler.schedule = clock.wrap("scheduler", engine.scheduler.schedule)
    engine.scheduler.update_from_output = clock.wrap("scheduler update", engine.scheduler.update_from_output)
    engine.processor.update = clock.wrap("output processing", engine.processor.update)


def decode_steps(llm: LLM, batch: int, steps: int, clock: Clock | None) -> list[float]:
    """Seconds of each decode step of ``batch`` greedy requests (after their prefill), EOS ignored."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", f"Story number {i}: once upon a time", params)
    engine.step()  # the prefills
    times = []
    if clock is not None:
        clock.seconds.clear()
        clock.calls.clear()
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    snapshot = (dict(clock.seconds), dict(clock.calls)) if clock is not None else None
    while engine.has_unfinished_requests():
        engine.step()
    if clock is not None:  # only the timed steps count
        clock.seconds.clear(), clock.calls.clear()
        clock.seconds.update(snapshot[0]), clock.calls.update(snapshot[1])
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/step_profile.json")
    args = ap.parse_args()
    llm = LLM(loaded=load_model(None, quantization="auto"), kv_cache_memory=64 << 20, num_threads=args.threads)
    model = llm.engine.runner.model
    fused = model.fused_decode
    decode_steps(llm, args.batch, 8, None)  # warm-up
    plain = statistics.median(decode_steps(llm, args.batch, args.steps, None))
    fused_forward, fused_phases = None, {}
    if fused is not None:  # the fused decode's forward alone (timed around its one native call)
        fclock = Clock()
        fused.forward = fclock.wrap("forward", fused.forward)
        decode_steps(llm, args.batch, args.steps, fclock)
        fused_forward = fclock.seconds["forward"] / args.steps
        del fused.forward
        fused.set_profiling(True)  # the native call's own phases (a clock read per phase, inside the call)
        decode_steps(llm, args.batch, args.steps, None)
        phases = fused.profile()
        fused.set_profiling(False)
        n = phases.pop("forwards")
        fused_phases = {k: v / n for k, v in phases.items()}
    model.fused_decode = None  # the per-op path, whose kernels the breakdown times one by one
    per_op = statistics.median(decode_steps(llm, args.batch, args.steps, None))
    clock = Clock()
    instrument(llm, clock)
    wrapped_steps = decode_steps(llm, args.batch, args.steps, clock)
    wrapped = statistics.median(wrapped_steps)
    mean_wrapped = statistics.fmean(wrapped_steps)
    steps = args.steps
    per_step = {name: s / steps for name, s in clock.seconds.items()}
    calls = {name: c / steps for name, c in clock.calls.items()}
    gemm = sum(v for k, v in per_step.items() if k.startswith("gemm "))
    fused_t = sum(v for k, v in per_step.items() if k.startswith("fused."))
    attn = per_step.get("attention kernel", 0.0)
    forward = per_step["forward"]
    rest_forward = forward - gemm - fused_t - attn
    step_total = sum(per_step[k] for k in ("scheduler", "forward") if k in per_step) + sum(
        per_step.get(k, 0.0) for k in ("logits (output matrix)", "sampler", "scheduler update", "output processing"))
    rows = [(k, per_step[k], calls[k]) for k in sorted(per_step) if k.startswith("gemm ")]
    rows += [("attention kernel", attn, calls.get("attention kernel", 0)),
             ("fused add+RMSNorm, RoPE, SwiGLU", fused_t, sum(v for k, v in calls.items() if k.startswith("fused."))),
             ("forward: torch ops + Python between kernels", rest_forward, 0),
             ("forward (all of the above)", forward, calls["forward"])]
    rows += [(k, per_step[k], calls[k]) for k in ("logits (output matrix)", "sampler", "input tensors", "scheduler",
                                                  "scheduler update", "output processing") if k in per_step]
    print(f"decode step, batch {args.batch}, {torch.get_num_threads()} threads, {steps} steps: median "
          f"{plain * 1e3:.2f} ms plain ({args.batch / plain:.0f} tok/s; fused decode "
          f"{'on' if fused is not None else 'n/a'}), per-op path {per_op * 1e3:.2f} ms "
          f"({args.batch / per_op:.0f} tok/s)")
    if fused_forward is not None:
        print(f"fused decode: the layers' one native call {fused_forward * 1e3:.3f} ms/step "
              f"(per-op forward below: {forward * 1e3:.3f} ms, of which kernels {(gemm + fused_t + attn) * 1e3:.3f})")
        timed = sum(fused_phases.values())
        print(f"phases of the native call (timed inside it, {timed * 1e3:.3f} ms/step in all):")
        print(f"{'phase':<46}{'ms/step':>9}{'share':>8}{'us/layer':>10}")
        layers = len(model.layers)
        for name, s in sorted(fused_phases.items(), key=lambda kv: -kv[1]):
            print(f"{name:<46}{s * 1e3:>9.3f}{s / timed:>8.1%}{s / layers * 1e6:>10.1f}")
    print(f"breakdown of the per-op path ({wrapped * 1e3:.2f} ms median wrapped); shares are of the mean wrapped "
          f"step, {mean_wrapped * 1e3:.2f} ms")
    print(f"{'part':<46}{'ms/step':>9}{'share':>8}{'calls/step':>12}{'us/call':>9}")
    for name, s, c in rows:
        per_call = f"{s / c * 1e6:.1f}" if c else "-"
        print(f"{name:<46}{s * 1e3:>9.3f}{s / mean_wrapped:>8.1%}{c:>12.0f}{per_call:>9}")
    other = mean_wrapped - step_total
    print(f"{'engine loop between phases (Python)':<46}{other * 1e3:>9.3f}{other / mean_wrapped:>8.1%}")
    write_json(args.out, {"batch": args.batch, "threads": torch.get_num_threads(), "steps": steps,
                          "plain_step_s": plain, "fused_decode": fused is not None,
                          "fused_forward_s": fused_forward, "fused_phases_s_per_step": fused_phases,
                          "per_op_step_s": per_op, "wrapped_step_s": wrapped,
                          "parts": [{"part": n, "s_per_step": s, "calls_per_step": c} for n, s, c in rows]
                          + [{"part": "engine loop between phases", "s_per_step": other, "calls_per_step": 0}]})


if __name__ == "__main__":
    main()
