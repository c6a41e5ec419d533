"""Start a real ``leanserve serve`` in a subprocess, and parse what it sends (SSE streams, /metrics)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import httpx

API_KEY = "test-key"


@dataclass
class ServerProcess:
    """A ``leanserve serve`` subprocess on 127.0.0.1 and a free port (``--port 0``; the URL is read from the
    banner it prints when ready)."""

    args: list[str]
    api_key: str | None = API_KEY
    url: str = ""
    model: str = ""
    max_model_len: int = 0
    proc: subprocess.Popen | None = None
    stdout_lines: list[str] = field(default_factory=list)
    _stderr: object = None

    def start(self, timeout: float = 300.0) -> ServerProcess:
        cmd = [sys.executable, "-m", "leanserve.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--log-level", "warning", *self.args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        self._stderr = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        ready = threading.Event()

        def drain() -> None:
            for line in self.proc.stdout:
                self.stdout_lines.append(line)
                m = re.search(r" on (http://127\.0\.0\.1:\d+)", line)
                if m and not self.url:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError(f"server did not start:\n{''.join(self.stdout_lines)}\n{self.stderr()}")
        card = httpx.get(f"{self.url}/v1/models", headers=self.headers).json()["data"][0]
        self.model, self.max_model_len = card["id"], card["max_model_len"]
        return self

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stderr(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGINT (Ctrl-C), then wait; returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    # ------------------------------------------------------------------------------------------ HTTP helpers
    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kwargs.pop("timeout", 300.0), **kwargs)

    def async_client(self, **kwargs) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=kwargs.pop("timeout", 300.0),
                                 **kwargs)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", timeout=300.0,
                             max_retries=0)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=30.0).text)

    def healthy(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=30.0).status_code == 200


def parse_sse(raw: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing: every event is exactly one ``data: ...`` line
    followed by a blank line."""
    assert raw.endswith("\n\n"), f"stream does not end with a blank line: {raw[-80:]!r}"
    events = raw[:-2].split("\n\n")
    payloads = []
    for ev in events:
        assert ev.startswith("data: ") and "\n" not in ev, f"bad SSE event {ev!r}"
        payloads.append(ev[len("data: "):])
    return payloads


def sse_chunks(raw: str) -> list[dict]:
    """JSON chunks of an SSE body that ends with ``data: [DONE]`` (checked)."""
    payloads = parse_sse(raw)
    assert payloads[-1] == "[DONE]", payloads[-1]
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` and ``{"name": value}`` (labels dropped; summed over label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name + labels] = value
        if labels:
            out[name] = out.get(name, 0.0) + value if "le=" not in labels else out.get(name, 0.0)
    return out


def wait_for(predicate, timeout: float, interval: float = 0.02) -> float:
    """Poll until ``predicate()`` is true; return the seconds it took. Raises AssertionError on timeout."""
    t0 = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
