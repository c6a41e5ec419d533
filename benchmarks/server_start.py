"""Server start to ready: seconds from launching ``leanserve serve`` (the default model) to its first ``/health``
200, here and from a second checkout of the same sources (a copy of the tracked files in a temporary directory,
importing its own ``leanserve``), interleaved: the native kernels' build cache is keyed by sources, flags, torch
and CPU (leanserve/kernels), so the second checkout must find them built and start as fast.

Usage:
    .venv/bin/python -m benchmarks.server_start [--repeats 3] [--timeout 120]

Both checkouts' bytecode is written first, as their setup writes it (``make setup``, ``make run``), so no start
compiles Python sources. Run it on an idle machine (a start is mostly imports, the GGUF load and thread start-up:
CPU-bound). Writes benchmarks/results/server_start.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import write_json

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_ready(checkout: Path, timeout: float) -> float:
    """Seconds from spawning ``python -m leanserve.cli serve`` with ``checkout`` first on the path to its first
    ``/health`` 200; the server is then stopped. Raises RuntimeError if it exits or is not ready in ``timeout``."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "leanserve.cli", "serve", "--port", str(port)], cwd=checkout,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"not ready after {timeout} s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def compile_bytecode(checkout: Path) -> None:
    """Writes ``checkout``'s leanserve bytecode, as ``make setup`` / ``make run`` do (``compileall``)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "checked-hash", "leanserve"],
                   cwd=checkout, check=True)


def copy_checkout(dest: Path) -> Path:
    """The tracked files of this checkout (as they are in the working tree) copied under ``dest``, with their
    bytecode written as its setup would."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    compile_bytecode(dest)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", default="benchmarks/results/server_start.json")
    args = ap.parse_args()
    compile_bytecode(ROOT)
    with tempfile.TemporaryDirectory(prefix="leanserve-checkout-") as tmp:
        other = copy_checkout(Path(tmp))
        times: dict[str, list[float]] = {"this checkout": [], "another checkout": []}
        for _ in range(args.repeats):
            times["this checkout"].append(time_to_ready(ROOT, args.timeout))
            times["another checkout"].append(time_to_ready(other, args.timeout))
    print(f"{'':<18} {'median s':>9} {'max s':>7}  runs")
    for name, ts in times.items():
        print(f"{name:<18} {statistics.median(ts):9.2f} {max(ts):7.2f}  {', '.join(f'{t:.2f}' for t in ts)}")
    write_json(args.out, {"repeats": args.repeats, "seconds": times,
                          "median_s": {k: statistics.median(v) for k, v in times.items()}})


if __name__ == "__main__":
    main()
