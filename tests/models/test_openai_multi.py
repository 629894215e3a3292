"""The `openai` backend on several servers (`backend.openai.base_urls`).

Fast tier: real HTTP servers on loopback ports in this process (`FakeServer`: the endpoints the backend uses,
with a deterministic completion that depends only on the prompt, the request's seed and the checkpoint the
server serves, as vLLM's seeded sampling is per request), and the real backend: a batch spread over three
servers gives the rows one server gives, in order; a server killed / answering 503 / hanging mid-batch is taken
out (a log line names it) and its rows run on the others; all servers down is an error naming each; redeploy
updates every server and drops the one that fails; a server that comes back is redeployed before it gets a row.

Slow tier: two real `vllm serve` CPU servers of SmolLM2 (skipped, saying why, where vLLM is not installed):
seeded rows over both equal one server's, and one killed mid-batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import DEFAULT_URL, ConfigError, server_urls
from rsiflow.models import openai_backend
from rsiflow.models.backend import SamplingParams
from rsiflow.models.openai_backend import OpenAIBackend

LOGGER = "rsiflow.models.openai_backend"
CHATS = [[{"role": "user", "content": f"task {i}: put the {['apple', 'mug', 'key'][i % 3]} in room {i}"}]
         for i in range(24)]
SEEDED = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1.0, seed=11)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive, as a real server: the client pools its connections

    def setup(self):
        super().setup()
        with self.server.fake.lock:
            self.server.fake.conns.append(self.connection)

    def log_message(self, *args):
        pass

    def _reply(self, status: int, payload: dict | None = None) -> None:
        data = json.dumps(payload or {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 (http.server's name)
        fake = self.server.fake
        fake.log.append(("GET " + self.path, None, fake.serving))
        if fake.mode == "dead":
            self.close_connection = True
            return
        self._reply(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})

    def do_POST(self):  # noqa: N802
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        fake.log.append(("POST " + self.path, body, fake.serving))
        if self.path == "/collective_rpc":
            if fake.fail_reload:
                return self._reply(500, {"error": "reload_weights failed: checkpoint not readable"})
            time.sleep(fake.delay)
            fake.serving = body["kwargs"]["weights_path"]
            return self._reply(200, {"results": [None]})
        if self.path == "/reset_prefix_cache":
            return self._reply(200)
        if self.path != "/v1/completions":
            return self._reply(404, {"error": f"no route {self.path}"})
        with fake.lock:
            fake.completions += 1
            fake.in_flight += 1
            fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
            if fake.fail_after is not None and fake.completions > fake.fail_after and fake.mode == "ok":
                fake.die()
        try:
            time.sleep(fake.delay)
            if fake.mode == "dead":        # killed: the connection closes without an answer
                self.close_connection = True
                return
            if fake.mode == "503":
                return self._reply(503, {"error": "overloaded"})
            if fake.mode == "hang":
                time.sleep(fake.hang)
                self.close_connection = True
                return
            fake.answered += 1
            self._reply(200, {"choices": [fake.complete(body, fake.serving)]})
        finally:
            with fake.lock:
                fake.in_flight -= 1


class _Reusable(ThreadingHTTPServer):
    allow_reuse_address = True   # a server restarted on the same port (a server coming back)
    daemon_threads = True


class FakeServer:
    """A small OpenAI-compatible completions server on a loopback port (threads in this process): GET /v1/models,
    POST /v1/completions, and vLLM's dev endpoints /collective_rpc (reload_weights: sets what it serves) and
    /reset_prefix_cache. A completion is a deterministic function of (prompt, seed, served checkpoint); after
    `fail_after` completions it fails in `fail_mode`: 'dead' (connections close unanswered, the port is closed),
    '503' or 'hang' (no answer within the client's timeout)."""

    def __init__(self, port: int = 0, serving: str = "unknown", delay: float = 0.05, fail_after: int | None = None,
                 fail_mode: str = "dead", fail_reload: bool = False, hang: float = 3.0):
        self.serving, self.delay, self.fail_after, self.fail_mode = serving, delay, fail_after, fail_mode
        self.fail_reload, self.hang, self.mode = fail_reload, hang, "ok"
        self.log: list[tuple[str, dict | None, str]] = []   # (method + path, body, what it served then)
        self.lock = threading.Lock()
        self.conns: list[socket.socket] = []
        self.completions = self.answered = self.in_flight = self.max_in_flight = 0
        self.http = _Reusable(("127.0.0.1", port), _Handler)
        self.http.fake = self
        self.port = self.http.server_port
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def complete(body: dict, serving: str) -> dict:
        """Six tokens (ids 100-999, never eos) and their logprobs, from sha256 of prompt, seed and checkpoint."""
        key = json.dumps([body["prompt"], body.get("seed") if body["temperature"] > 0 else None, serving])
        digest = hashlib.sha256(key.encode()).digest()
        ids = [100 + int.from_bytes(digest[2 * k:2 * k + 2], "big") % 900 for k in range(body["max_tokens"])]
        return {"text": "", "token_ids": ids, "finish_reason": "length",
                "logprobs": {"token_logprobs": [-(t % 97) / 100 for t in ids]}}

    def die(self) -> None:
        """Fail from now on in `fail_mode`; 'dead' also closes the listening port (connections are refused)."""
        self.mode = self.fail_mode
        if self.fail_mode == "dead":
            threading.Thread(target=self.stop, daemon=True).start()

    def stop(self) -> None:
        """As a killed process: the port is closed, and so is every connection (idle or in flight)."""
        self.mode = "dead"
        self.http.shutdown()
        self.http.server_close()
        with self.lock:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def completion_bodies(self) -> list[dict]:
        return [b for p, b, _ in self.log if p == "POST /v1/completions"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(gens):
    return [(g.text, g.token_ids, g.logprobs, g.temp_logprobs, g.finish_reason, g.prompt_tokens) for g in gens]


@pytest.fixture
def servers():
    made: list[FakeServer] = []

    def make(n: int = 1, **kw) -> list[FakeServer]:
        new = [FakeServer(**kw) for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for s in made:
        if s.mode != "dead":
            s.stop()


def _backend(tiny_path, urls, **kw) -> OpenAIBackend:
    opts = {"retries": 2, "backoff_seconds": 0.01, "max_concurrency": 4, "redeploy": "vllm_reload", **kw}
    return OpenAIBackend(str(tiny_path), base_urls=urls, **opts)


def test_a_batch_spreads_over_three_servers_with_one_servers_rows_in_order(tiny_path, servers):
    [one] = servers(1)
    three = servers(3)
    want = _backend(tiny_path, [one.url]).generate(CHATS, SEEDED)
    got = _backend(tiny_path, [s.url for s in three]).generate(CHATS, SEEDED)
    assert _rows(got) == _rows(want)
    assert len({tuple(g.token_ids) for g in got}) == len(CHATS)   # distinct rows: an order mix-up would show
    counts = [s.answered for s in three]
    assert sum(counts) == len(CHATS) and min(counts) >= 4, counts   # every server got a share (8 each when even)
    assert max(s.max_in_flight for s in three) <= 4                 # max_concurrency per server
    seeds = sorted(b["seed"] for s in three for b in s.completion_bodies())
    assert seeds == [11 + i for i in range(len(CHATS))]             # seed + row index, whichever server ran it
    assert {g.extra["server"] for g in got} == {s.url for s in three}


@pytest.mark.parametrize("fail_mode", ["dead", "503", "hang"])
def test_a_server_failing_mid_batch_is_taken_out_and_its_rows_run_on_the_others(tiny_path, servers, caplog,
                                                                               fail_mode):
    [one] = servers(1)
    a, c = servers(2)
    [b] = servers(1, fail_after=6, fail_mode=fail_mode, hang=6.0)   # fails with its 7th request
    want = _backend(tiny_path, [one.url]).generate(CHATS, SEEDED)
    backend = _backend(tiny_path, [a.url, b.url, c.url], timeout=2.0, reprobe_seconds=3600)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = backend.generate(CHATS, SEEDED)
    assert _rows(got) == _rows(want)
    # at most 4 in flight per server, so its 7th request came after >= 3 answers; then requests on it failed
    assert b.answered >= 3 and b.completions > b.answered
    assert a.answered + c.answered == len(CHATS) - b.answered
    assert sum(g.extra["server"] == b.url for g in got) == b.answered
    out = [r.getMessage() for r in caplog.records if "taken out of rotation" in r.getMessage()]
    assert len(out) == 1 and b.url in out[0] and "2 of 3 left" in out[0], out
    again = len(b.log)
    assert _rows(backend.generate(CHATS[:6], SEEDED)) == _rows(want[:6])
    assert len(b.log) == again                      # out of rotation: the next call does not try it


def test_all_servers_down_is_an_error_naming_each_url_and_its_last_error(tiny_path, servers):
    urls = [f"http://127.0.0.1:{_closed_port()}/v1" for _ in range(2)]
    with pytest.raises(RuntimeError, match="no generation server is left") as err:
        _backend(tiny_path, urls)                   # GET /models for the model name: nobody answers
    for url in urls:
        assert f"{url}: the generation server at {url}/models did not answer after 3 tries (ConnectError" \
               in str(err.value)
    [a] = servers(1, fail_after=0, fail_mode="503")
    urls2 = [f"http://127.0.0.1:{_closed_port()}/v1", a.url]
    backend = _backend(tiny_path, urls2, model="fake", redeploy="none")
    with pytest.raises(RuntimeError, match="no generation server is left") as err:
        backend.generate(CHATS[:4], SEEDED)
    msg = str(err.value)
    assert f"{urls2[0]}: the generation server at {urls2[0]}/completions did not answer" in msg
    assert "ConnectError" in msg
    assert f"{a.url}: the generation server at {a.url}/completions did not answer after 3 tries (HTTP 503)" in msg


def test_redeploy_updates_every_server_and_drops_the_one_that_fails(tiny_path, servers, caplog, tmp_path):
    a, b = servers(2)
    [c] = servers(1, fail_reload=True)
    [one] = servers(1)
    new = str(tmp_path / "candidate")
    backend = _backend(tiny_path, [a.url, b.url, c.url])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        record = backend.serve(new)
    assert a.serving == b.serving == new and c.serving == "unknown"
    assert record["action"] == "reloaded weights in place on the server (collective_rpc reload_weights) (2 servers)"
    assert list(record["urls"]) == [a.url, b.url] and list(record["out_of_rotation"]) == [c.url]
    assert "reload_weights failed" in record["out_of_rotation"][c.url]
    assert any(c.url in r.getMessage() and "redeploy of" in r.getMessage() for r in caplog.records)
    got = backend.generate(CHATS, SEEDED)
    assert c.completion_bodies() == []              # never a row on a server that may serve an older model
    want = _backend(tiny_path, [one.url])
    want.serve(new)
    assert _rows(got) == _rows(want.generate(CHATS, SEEDED))
    with pytest.raises(RuntimeError, match=f"no generation server is left.*{c.url}: redeploy of"):
        _backend(tiny_path, [c.url], reprobe_seconds=3600).generate(CHATS[:2], SEEDED)


def test_command_redeploy_runs_once_per_server_with_its_url(tiny_path, servers, tmp_path):
    a, b = servers(2)
    script = ("import json, sys, urllib.request; url, path = sys.argv[1], sys.argv[2]; "
              "urllib.request.urlopen(urllib.request.Request(url[:-3] + '/collective_rpc', method='POST', "
              "data=json.dumps({'method': 'reload_weights', 'kwargs': {'weights_path': path}}).encode()))")
    with pytest.raises(ValueError, match=r"redeploy_command must contain '\{url\}'"):
        _backend(tiny_path, [a.url, b.url], redeploy="command", redeploy_command=[sys.executable, "-c", script])
    backend = _backend(tiny_path, [a.url, b.url], redeploy="command",
                       redeploy_command=[sys.executable, "-c", script, "{url}", "{path}"])
    record = backend.serve(tmp_path / "v2")
    assert a.serving == b.serving == str(tmp_path / "v2") and record["action"].startswith("ran [")
    assert backend.serve(tmp_path / "v2")["action"] == "already serving (2 servers)"


def test_a_server_that_comes_back_is_redeployed_before_it_gets_a_row(tiny_path, servers, caplog):
    a, b = servers(2)
    backend = _backend(tiny_path, [a.url, b.url], reprobe_seconds=0)
    backend.generate(CHATS[:4], SEEDED)
    b.stop()                                        # b goes away; the next call takes it out
    with caplog.at_level(logging.INFO, logger=LOGGER):
        backend.generate(CHATS[:4], SEEDED)
        [back] = servers(1, port=b.port, serving="an older checkpoint")   # b restarts, serving something else
        got = backend.generate(CHATS, SEEDED)
    assert any(b.url in r.getMessage() and "back in rotation" in r.getMessage() for r in caplog.records)
    paths = [p for p, _, _ in back.log]
    assert paths[:3] == ["GET /v1/models", "POST /collective_rpc", "POST /reset_prefix_cache"], paths[:4]
    assert back.answered > 0 and {s for p, _, s in back.log if p == "POST /v1/completions"} == {str(tiny_path)}
    assert _rows(got) == _rows(_backend(tiny_path, [a.url]).generate(CHATS, SEEDED))


def test_with_every_server_out_each_is_probed_at_once(tiny_path, servers):
    [a] = servers(1)
    backend = _backend(tiny_path, [a.url], reprobe_seconds=3600)
    a.stop()
    with pytest.raises(RuntimeError, match="no generation server is left"):
        backend.generate(CHATS[:2], SEEDED)
    assert a.url in openai_backend._DOWN
    [back] = servers(1, port=a.port)               # back, before reprobe_seconds: none is left, so probed anyway
    again = _backend(tiny_path, [a.url], reprobe_seconds=3600)   # its GET /models answers
    assert again.model == "fake" and a.url not in openai_backend._DOWN
    assert len(backend.generate(CHATS[:2], SEEDED)) == 2 and back.answered == 2


def test_a_config_with_base_urls_opens_a_backend_over_all_of_them(tiny_path, servers):
    from rsiflow.models.backend import backend_for

    two = servers(2)
    urls = ", ".join(s.url for s in two)
    cfg = load_config(["configs/default.yaml"], ["backend.kind=openai", f"backend.openai.base_urls=[{urls}]",
                                                 "backend.openai.redeploy=vllm_reload",
                                                 "backend.openai.max_concurrency=2"])
    backend = backend_for(cfg, str(tiny_path))
    assert backend.base_urls == [s.url for s in two] and backend.reprobe_seconds == 60.0
    backend.generate(CHATS[:8], SEEDED)
    assert sum(s.answered for s in two) == 8 and min(s.answered for s in two) >= 2
    assert {s.serving for s in two} == {str(tiny_path)}   # redeploy reached both


def test_base_url_and_base_urls(tiny_path, servers):
    [a] = servers(1)
    assert OpenAIBackend(str(tiny_path), base_url=a.url + "/", retries=0).base_urls == [a.url]   # one-server form
    with pytest.raises(ValueError, match="base_url and backend.openai.base_urls are both set"):
        OpenAIBackend(str(tiny_path), base_url=a.url, base_urls=[a.url])
    with pytest.raises(ConfigError, match="backend.openai.base_urls: backend.openai.base_url and "
                                          "backend.openai.base_urls are both set"):
        load_config(["configs/default.yaml"], ["backend.kind=openai", f"backend.openai.base_url={a.url}",
                                               f"backend.openai.base_urls=[{a.url}]"])
    with pytest.raises(ConfigError, match="backend.openai.base_urls: .*listed more than once"):
        load_config(["configs/default.yaml"], ["backend.kind=openai", f"backend.openai.base_urls=[{a.url}, {a.url}/]"])
    with pytest.raises(ConfigError, match="backend.openai.base_urls: 'x' is not an http"):
        load_config(["configs/default.yaml"], ["backend.kind=openai", f"backend.openai.base_urls=[{a.url}, x]"])
    opts = load_config(["configs/default.yaml"], ["backend.kind=openai"]).backend.options()
    assert opts["base_url"] is None and opts["base_urls"] == []
    assert server_urls(None, None) == [DEFAULT_URL]


# -- two real `vllm serve` CPU servers ----------------------------------------------------------------------

def _start_vllm(python: str, model, port: int, log_path) -> subprocess.Popen:
    """`vllm serve` of `model` on a loopback port, as tests/conftest.py's `vllm_server` starts it, with 1 GiB of KV
    cache and one thread (two servers share this machine's cores); its own process group, so it can be killed."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as out:
        return subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                 "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "rsiflow",
                                 "--dtype", "float32", "--max-model-len", "2048", "--enable-prefix-caching",
                                 "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                                 "--enforce-eager"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.fixture
def second_vllm_server(vllm_server, smollm2_path, tmp_path):
    """A second real `vllm serve` of SmolLM2 beside conftest's session one (which skips, saying why, where vLLM is
    not installed): yields (base URL, Popen); killed at the end."""
    from tests.conftest import vllm_python, wait_for_server

    port, log = _closed_port(), tmp_path / "serve-2.log"
    proc = _start_vllm(vllm_python() or sys.executable, smollm2_path, port, log)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_for_server(proc, url, log)
        yield url, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


REAL = [[{"role": "user", "content": f"Count from {i} to {i + 20}, one number per line."}] for i in range(16)]


@pytest.mark.slow
def test_two_vllm_servers_share_a_batch_and_survive_one_killed_mid_batch(vllm_server, second_vllm_server,
                                                                          smollm2_path, caplog):
    url_a, (url_b, proc_b) = vllm_server, second_vllm_server
    # seeded sampling (vLLM seeds per request: a row's sample does not depend on where it runs)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, top_p=1.0, seed=5)
    both = OpenAIBackend(str(smollm2_path), base_urls=[url_a, url_b], redeploy="vllm_reload", max_concurrency=4,
                         retries=2, backoff_seconds=0.2, reprobe_seconds=3600)
    record = both.serve(smollm2_path)              # every server this process has not switched yet is reloaded
    assert list(record["urls"]) == [url_a, url_b] and record["urls"][url_b].startswith("reloaded weights in place")
    one = OpenAIBackend(str(smollm2_path), base_url=url_a, redeploy="vllm_reload", max_concurrency=4)
    t0 = time.monotonic()
    alone = one.generate(REAL, params)
    t1 = time.monotonic()
    spread = both.generate(REAL, params)
    t2 = time.monotonic()
    assert {g.extra["server"] for g in spread} == {url_a, url_b}
    same = sum(a.token_ids == b.token_ids for a, b in zip(alone, spread))
    assert same >= len(REAL) - 1, same             # CPU float32 in other batches: a near-tie may flip one row

    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(gens=both.generate(REAL, params)))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        started = time.monotonic()
        worker.start()
        while not both._load[url_b] and worker.is_alive():   # this call's requests in flight on server b
            time.sleep(0.01)
        time.sleep(1.0)                            # into the batch: its rows are being prefilled / decoded
        os.killpg(proc_b.pid, signal.SIGKILL)
        killed_at = time.monotonic() - started
        worker.join(timeout=600)
    wall = time.monotonic() - started
    assert not worker.is_alive() and len(result["gens"]) == len(REAL)
    msgs = [r.getMessage() for r in caplog.records]
    assert any(url_b in m and "taken out of rotation" in m for m in msgs), msgs
    moved = [m for m in msgs if "runs again on another server" in m]
    assert moved, "no row was in flight on the killed server: the kill came after the batch"
    same_after = sum(a.token_ids == b.token_ids for a, b in zip(alone, result["gens"]))
    assert same_after >= len(REAL) - 1, same_after
    print(f"\n{len(REAL)} seeded rows x {params.max_new_tokens} tokens: one server {t1 - t0:.1f} s, two servers "
          f"{t2 - t1:.1f} s ({same}/{len(REAL)} rows equal); {url_b} killed {killed_at:.1f} s into the batch: "
          f"{len(moved)} rows ran again on {url_a}, batch {wall:.1f} s, {same_after}/{len(REAL)} rows equal to one "
          f"server's")
