"""``leanserve advise`` through its command-line entry (:func:`run_advise_cli`) against HTTP stand-ins: a server
that answers like llama.cpp's ``llama-server --metrics`` (its metric names and ``owned_by``; counters that grow
between scrapes like a server under load), and a URL that answers nothing."""

from __future__ import annotations

import argparse
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from leanserve.tools.advise import run_advise_cli
from leanserve.tools.advise_args import add_advise_args

import pytest

from tests.tools.test_advise_metrics import LLAMA


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_advise_args(p, ["customer-service", "knowledge-qa"])
    return p.parse_args(list(argv))


@pytest.fixture
def llama_server():
    """/v1/models and /metrics the way llama-server writes them; each scrape adds 300 prompt tokens (1.5 s) and
    50 generated tokens (2 s), with 4 requests processing and 2 deferred."""
    scrapes = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/v1/models":
                body = json.dumps({"object": "list", "data": [{"id": "smollm2.gguf", "object": "model",
                                                                "owned_by": "llamacpp"}]})
            elif self.path == "/metrics":
                n = len(scrapes)
                scrapes.append(n)
                body = LLAMA.format(prompt=1000 + 300 * n, prompt_s=5.0 + 1.5 * n, pred=400 + 50 * n,
                                    pred_s=10.0 + 2.0 * n, processing=4, deferred=2)
            else:
                self.send_error(404)
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", scrapes
    httpd.shutdown()


def test_llama_server_gets_advice_on_what_it_exports_and_a_list_of_what_it_does_not(llama_server, tmp_path):
    url, scrapes = llama_server
    out = io.StringIO()
    args = parse("--base-url", url + "/v1", "--duration", "0.3", "--interval", "0.1", "--json", "--html",
                 str(tmp_path / "a.html"))
    assert run_advise_cli(args, lambda p, o: "customer-service", out=out, log=lambda _: None) == 0
    doc = json.loads(out.getvalue())
    m = doc["metrics"]
    n = len(scrapes) - 1  # scrape intervals between the first and the last
    assert m["server_kind"] == "llama.cpp" and m["model"] == "smollm2.gguf" and m["scope"] == "window"
    assert m["prompt_throughput"] == pytest.approx(300 * n / m["window_s"])
    assert m["prefill_share"] == pytest.approx(1.5 / 3.5) and m["prefill_tokens_per_s"] == pytest.approx(200.0)
    assert (m["running_peak"], m["waiting_peak"]) == (4.0, 2.0)
    assert m["ttft_ms"] is None and m["preemptions"] is None and m["prefix_cache_hit_rate"] is None
    unseen = [what for what, _ in m["unseen"]]
    assert {"TTFT distribution", "queue time", "TPOT", "preemptions", "prefix-cache hit rate"} <= set(unseen)
    assert [r["id"] for r in doc["recommendations"]] == ["missing-metrics", "framework"]
    assert f"leanserve bench --base-url {url} --workload customer-service" in doc["recommendations"][0]["change"]
    assert "cannot see" in out.getvalue() or "Cannot see" in (tmp_path / "a.html").read_text()


def test_text_report_against_llama_server(llama_server):
    url, _ = llama_server
    out = io.StringIO()
    assert run_advise_cli(parse("--base-url", url, "--duration", "0.2", "--interval", "0.1"),
                          lambda p, o: "customer-service", out=out, log=lambda _: None) == 0
    text = out.getvalue()
    assert "(llama.cpp, smollm2.gguf)" in text and "cannot see: TTFT distribution" in text
    assert "1. [step 1] missing-metrics" in text and "2. [step 3] framework" in text


def test_nothing_to_read_is_an_error(capsys):
    args = parse("--base-url", "http://127.0.0.1:9", "--duration", "0")
    assert run_advise_cli(args, lambda p, o: "customer-service", out=io.StringIO(), log=lambda _: None) == 2
    assert "answers neither /metrics nor /v1/models" in capsys.readouterr().err


def test_bad_options_are_refused_before_anything_is_read():
    with pytest.raises(ValueError, match="--interval must be > 0"):
        run_advise_cli(parse("--interval", "0"), lambda p, o: "x", out=io.StringIO(), log=lambda _: None)
    with pytest.raises(ValueError, match="--serve-args"):
        run_advise_cli(parse("--serve-args", "--bogus 1"), lambda p, o: "x", out=io.StringIO(), log=lambda _: None)


def test_against_a_real_llama_server_with_traffic():
    """The real peer (built by ../shared/tools/build-llama-cpp.sh; skipped where it is not built): advise reads
    llama-server's own /metrics under load, names what it cannot see and recommends measuring first."""
    import httpx

    from benchmarks.common import LlamaServer, find_llama_server
    from tests.conftest import DEFAULT_GGUF, default_model_dir

    binary = find_llama_server(None)
    if binary is None:
        pytest.skip("llama-server is not built (../shared/tools/build-llama-cpp.sh)")
    with LlamaServer(binary, f"{default_model_dir()}/{DEFAULT_GGUF}", slots=2, ctx_per_slot=512, threads=1,
                     extra_args=["--metrics"]) as srv:
        stop = threading.Event()

        def traffic() -> None:
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                while not stop.is_set():
                    c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Name a river."}],
                                                         "max_tokens": 8})

        worker = threading.Thread(target=traffic, daemon=True)
        worker.start()
        out = io.StringIO()
        try:
            code = run_advise_cli(parse("--base-url", srv.url, "--duration", "3", "--interval", "0.5", "--json"),
                                  lambda p, o: "customer-service", out=out, log=lambda _: None)
        finally:
            stop.set()
            worker.join(60)
    assert code == 0
    doc = json.loads(out.getvalue())
    m = doc["metrics"]
    assert m["server_kind"] == "llama.cpp" and m["model"].endswith(DEFAULT_GGUF)
    assert m["output_throughput"] > 0 and m["ttft_ms"] is None
    assert {"TTFT distribution", "queue time", "prefix-cache hit rate"} <= {what for what, _ in m["unseen"]}
    assert doc["recommendations"][0]["id"] == "missing-metrics"
