"""The URL a ``leanserve serve`` subprocess prints when it is ready ("... on http://127.0.0.1:PORT ...")."""

from __future__ import annotations

import re
import subprocess
import threading

_URL = re.compile(r" on (http://127\.0\.0\.1:\d+)")


def wait_for_banner_url(proc: subprocess.Popen, timeout_s: float) -> str:
    """The URL of the first banner line on ``proc.stdout`` (text mode), within ``timeout_s`` seconds; "" when the
    process ended or the time ran out first. A daemon thread keeps draining stdout after, so the pipe never fills."""
    found: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in proc.stdout:
            m = _URL.search(line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    ready.wait(timeout_s)
    return found[0] if found else ""
