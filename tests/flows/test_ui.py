"""The Prefect UI as rsiflow's dashboard, checked in a real headless browser: two tiny rounds and a round whose
first step times out run against a local Prefect server; Chromium (Debian's chromium-headless-shell, driven by
playwright) opens the runs list, a round's flow run page (task graph in step order, one readable log line per
step, the held-out history), its artifacts, the per-round table, the plot and the failed step, and takes
screenshots. RSIFLOW_UI_SCREENSHOTS=docs writes them where the README shows them (default: the test's tmp dir).

Slow: a Prefect server, three flow runs and a browser (~6 min on 2 cores). Skipped, saying why, where playwright
or the browser is missing (`pip install -e .[ui]`, `apt-get install chromium-headless-shell`).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rsiflow.stores.store import Store
from tests.conftest import REPO, TINY, prefect_home, tiny_overrides

CHROMIUM = os.environ.get("RSIFLOW_CHROMIUM") or shutil.which("chromium-headless-shell") or shutil.which("chromium")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(api: str, path: str, body: dict) -> list | dict:
    req = urllib.request.Request(f"{api}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def _rsiflow(env: dict, log: Path, *args: str) -> int:
    with open(log, "a") as out:
        return subprocess.run([sys.executable, "-m", "rsiflow.flows.cli", "run", "--config", TINY, *args], cwd=REPO,
                              env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1200).returncode


@pytest.mark.slow
def test_prefect_ui_shows_rounds_history_and_a_failed_step(tmp_path):
    pytest.importorskip("playwright", reason="playwright is not installed (pip install -e .[ui])")
    if CHROMIUM is None:
        pytest.skip("no headless Chromium: apt-get install chromium-headless-shell (or set RSIFLOW_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    shots = Path(os.environ.get("RSIFLOW_UI_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    ui, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PYTHONPATH": str(REPO), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    sets = [a for o in tiny_overrides(tmp_path, "distill.methods=[exit,srd]", "distill.srd.note_writer=template",
                                      "gate.rule=paired_test") for a in ("--set", o)]
    log = tmp_path / "rsiflow.log"
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port)], env=env, cwd=tmp_path, stdout=open(tmp_path / "server.log", "w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{api}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        # two rounds (SRD's template notes give the tiny model something to train on; paired_test rejects the
        # candidates, so retention deletes them), then a round whose first step exceeds its timeout
        assert _rsiflow(env, log, *sets, "--rounds", "2") == 0, log.read_text()[-4000:]
        assert _rsiflow(env, log, *sets, "--set", "run.name=tiny-timeout", "--set", "prefect.step_timeout_s=0.5") != 0
        # Retry on the completed round 2 (the CLI's retry; the UI's button does the same): refused, nothing runs
        with open(log, "a") as out:
            retried = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", "tiny-round-2",
                                      "--entrypoint", "flows/round.py:improvement_round"], cwd=REPO, env=env,
                                     stdout=out, stderr=subprocess.STDOUT, timeout=600)
        assert retried.returncode == 0, log.read_text()[-3000:]

        with Store(tmp_path / "store.duckdb", read_only=True) as store:
            decisions = [d["decision"] for d in store.promotion_history("tiny")]
            deleted = store.deleted_checkpoints("tiny")
        assert decisions == ["reject", "reject"]   # and no round 3: the retry ran nothing
        assert [d["model_id"] for d in deleted] == ["tiny/r1/candidate", "tiny/r2/candidate"]
        assert not (tmp_path / "runs" / "tiny" / "models" / "round-1-candidate").exists()

        runs = {r["name"]: r for r in _api(api, "/flow_runs/filter", {})}
        round2, failed_round = runs["tiny-round-2"], runs["tiny-timeout-round-1"]
        assert failed_round["state_type"] == "FAILED"
        assert round2["state_type"] == "COMPLETED" and round2["state"]["message"].startswith(
            "retry refused: flow run 'tiny-round-2' ran round 2 of run 'tiny', which completed")
        assert {"gate:reject", "champion:tiny/base"} <= set(round2["tags"])
        tasks = _api(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [round2["id"]]}}})
        by_id = {t["id"]: t for t in tasks}
        order = {by_id[t["id"]]["name"].rsplit("-", 1)[0]: [by_id[i["id"]]["name"].rsplit("-", 1)[0]
                                                            for i in t["task_inputs"].get("wait_for", [])]
                 for t in tasks}
        # the task graph is the step order and nothing else
        assert order == {"generate": [], "evaluate": ["generate"], "distill": ["evaluate"], "train": ["distill"],
                         "gate": ["train"], "deploy": ["gate"]}
        assert all(not v for t in tasks for k, v in t["task_inputs"].items() if k != "wait_for")
        failed_step, = [t for t in _api(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [failed_round["id"]]}}})
                        if t["state_type"] == "FAILED"]
        table, = _api(api, "/artifacts/filter", {"artifacts": {"key": {"any_": ["rsiflow-tiny-rounds"]}},
                                                 "flow_runs": {"id": {"any_": [round2["id"]]}}})
        plot, = _api(api, "/artifacts/filter", {"artifacts": {"key": {"any_": ["rsiflow-tiny-plot"]}},
                                                "flow_runs": {"id": {"any_": [round2["id"]]}}})
        progress = _api(api, "/artifacts/filter", {"artifacts": {"type": {"any_": ["progress"]}},
                                                   "flow_runs": {"id": {"any_": [round2["id"]]}}})
        assert {a["description"].split(":")[0] for a in progress} >= {"round 2 generate", "round 2 train",
                                                                      "round 2 gate"}
        assert all(a["data"] == 100.0 for a in progress)

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})

            def shot(url: str, name: str, wait_text: str, tab: str | None = None, height: int = 1000,
                     scroll: bool = False) -> str:
                page.set_viewport_size({"width": 1400, "height": height})   # the UI scrolls inside its own pane
                page.goto(ui + url)
                page.wait_for_load_state("networkidle")
                if tab:
                    page.get_by_text(tab, exact=True).first.click()
                page.get_by_text(wait_text).first.wait_for(timeout=30_000)
                if scroll:   # the UI scrolls inside its own pane: bring the line into the picture
                    page.get_by_text(wait_text).first.scroll_into_view_if_needed()
                page.wait_for_timeout(1500)   # let the graph and the images settle
                page.screenshot(path=str(shots / name), full_page=True)
                return page.inner_text("body")

            text = shot("/runs", "ui-runs.png", "tiny-round-2")
            assert "tiny-timeout-round-1" in text and "run:tiny" in text and "gate:reject" in text
            text = shot(f"/runs/flow-run/{round2['id']}", "ui-refused-retry.png", "a flow run runs one round",
                        scroll=True)
            assert "retry refused" in text or "which completed" in text
            text = shot(f"/runs/flow-run/{round2['id']}", "ui-flow-run.png", "round 2 deploy", height=2100)
            assert "round 2 generate: tiny/base played 4 tasks x 2 rollouts" in text
            assert "round 2 gate: candidate" in text and "held-out: base 0/6" in text and "{'" not in text
            text = shot(f"/runs/flow-run/{round2['id']}", "ui-flow-run-artifacts.png", "rsiflow-tiny-rounds",
                        tab="Artifacts", height=1400)
            assert "held-out success of the serving model" in text and "round 2 0/6" in text
            text = shot(f"/artifacts/artifact/{table['id']}", "ui-rounds-table.png", "wins / losses")
            assert "reject (paired_test)" in text and "candidate held-out" in text
            text = shot(f"/artifacts/artifact/{plot['id']}", "ui-plot.png", "held-out success per round")
            assert "data:image" not in text    # an image artifact prints its data URI under the picture
            text = shot(f"/runs/task-run/{failed_step['id']}", "ui-failed-step.png", "StepTimedOut")
            assert "ran past prefect.step_timeout_s = 0.5 s and was stopped" in text
            browser.close()
        assert all((shots / n).stat().st_size > 10_000 for n in (
            "ui-runs.png", "ui-refused-retry.png", "ui-flow-run.png", "ui-flow-run-artifacts.png",
            "ui-rounds-table.png", "ui-plot.png", "ui-failed-step.png"))
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
