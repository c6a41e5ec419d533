"""Helpers shared by the benchmarks: offline text, fixed-seed workloads, llama-server process, JSON/table output."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from leanserve.bench.corpus import corpus_text

import httpx


@dataclass
class BenchRequest:
    """One request of a workload: prompt token ids and the exact number of tokens to generate."""

    prompt_ids: list[int]
    max_tokens: int


def make_workload(tokenizer, n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int) -> list[BenchRequest]:
    """``n`` requests with prompt and output lengths drawn uniformly from the ranges (tokens), fixed by ``seed``;
    prompts are windows of :func:`leanserve.bench.corpus.corpus_text` (the Python standard library's sources, PSF
    License)."""
    rng = random.Random(seed)
    ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    out = []
    for _ in range(n):
        p = rng.randint(*prompt_range)
        start = rng.randrange(0, len(ids) - p)
        out.append(BenchRequest(ids[start:start + p], rng.randint(*output_range)))
    return out


# Threading settings that importing leanserve makes for its own process (see leanserve/__init__.py).
LEANSERVE_THREADING_ENV = ("OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT")


def peer_env() -> dict[str, str]:
    """The environment for a peer engine (llama.cpp, transformers): this process's, without the threading settings
    that importing leanserve makes for itself, so each peer runs with its own defaults. (llama.cpp's OpenMP threads
    meet at barriers many times per token; made to sleep between them, its single-stream decode fell from ~130 to
    ~42 tok/s on this machine.)"""
    env = dict(os.environ)
    for name in LEANSERVE_THREADING_ENV:
        env.pop(name, None)
    return env


@contextlib.contextmanager
def peer_environ() -> Iterator[None]:
    """Within the block, ``os.environ`` is :func:`peer_env` (for a peer started with multiprocessing's spawn)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(peer_env())
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failure(proc: subprocess.Popen, timeout: float) -> str:
    """Why a server never became healthy: its exit status, or the timeout (seconds)."""
    code = proc.poll()
    return f"did not become healthy in {timeout:g} s" if code is None else f"exited with status {code} at start"


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Poll ``url/health`` every 0.5 s until it answers 200 (True), the process exits or ``timeout`` seconds pass
    (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


class LlamaServer:
    """llama.cpp's ``llama-server`` on loopback, as a context manager.

    Args:
        binary: path of llama-server. model: GGUF path. slots: parallel sequences (-np).
        ctx_per_slot: context tokens per slot. threads: CPU threads (-t).
        extra_args: more command-line arguments (e.g. ``["--metrics"]``).
    """

    def __init__(self, binary: str, model: str, slots: int, ctx_per_slot: int, threads: int,
                 extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [binary, "-m", model, "-c", str(slots * ctx_per_slot), "-np", str(slots), "-t", str(threads),
                    "-tb", str(threads), "--host", "127.0.0.1", "--port", str(self.port), "-b", "2048", "-ub", "512",
                    "--no-webui", *(extra_args or [])]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.cmd, env=peer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_healthy(self.url, self.proc, 120):
            why = _failure(self.proc, 120)  # before __exit__ stops a live process
            self.__exit__()
            raise RuntimeError(f"llama-server {why}: {' '.join(self.cmd)}")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(timeout=30)


class LeanserveServer:
    """``leanserve serve`` (this checkout's, ``python -m leanserve.cli``) on loopback, as a context manager.

    Args:
        model: GGUF path or HF folder. threads: CPU threads (``--threads``).
        args: more ``serve`` options (e.g. ``["--max-num-seqs", "8"]``).
    """

    def __init__(self, model: str, threads: int, args: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "leanserve.cli", "serve", "--model", model, "--host", "127.0.0.1",
                    "--port", str(self.port), "--log-level", "warning", "--threads", str(threads), *(args or [])]
        self.env = dict(os.environ)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LeanserveServer:
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen(self.cmd, cwd=root, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        if not wait_healthy(self.url, self.proc, 300):
            why = _failure(self.proc, 300)  # before __exit__ stops a live process
            self.__exit__()
            raise RuntimeError(f"leanserve {why}: {' '.join(self.cmd)}")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def find_llama_server(explicit: str | None) -> str | None:
    """Path of llama-server: ``explicit`` (None when it is given but not an executable file: a wrong path is an
    error, not a reason to use another binary), else $LLAMA_SERVER, else the folder benchmarks/README.md builds."""
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    built = Path.home() / ".cache/leanserve-peers/llama-cpp-0.3.36/src/vendor/llama.cpp/build/bin/llama-server"
    candidates = [os.environ.get("LLAMA_SERVER"), str(built)]
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def write_json(path: str, payload: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    from leanserve.kernels import cpu_info

    payload = {"argv": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": cpu_info(), **payload}
    out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {out}")


def load_extension(so: str):
    """The kernel extension built at ``so`` (a ``leanserve_kernels_<key>`` shared object, e.g. another source tree's
    build in the torch_extensions cache), imported beside this checkout's."""
    spec = importlib.util.spec_from_file_location(Path(so).name.split(".")[0], so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
