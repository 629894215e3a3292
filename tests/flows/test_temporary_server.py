"""The temporary Prefect API server `rsiflow run` and `rsiflow serve` start when PREFECT_API_URL is unset
(rsiflow.flows.temporary_server): this process's settings point at it, child processes' environments don't, it runs
in a session of its own, and the client never imports Prefect's server package."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, prefect_home

SCRIPT = """
import json, os, sys
from rsiflow.flows import temporary_server
from prefect.settings import PREFECT_API_URL
assert not PREFECT_API_URL.value()
temporary_server.start()
temporary_server.start()   # once: the second call finds PREFECT_API_URL set
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    client.api_healthcheck()
    api = str(client.api_url)
child = os.popen(sys.executable + " -c 'import os; print(os.environ.get(\\"PREFECT_API_URL\\"))'").read().strip()
print(json.dumps({"url": PREFECT_API_URL.value(), "client": api, "user": temporary_server.user_api_url(),
                  "server_module": "prefect.server.api.server" in sys.modules, "child": child,
                  "started": temporary_server._started}))
"""


@pytest.mark.slow
def test_start_points_this_process_only_at_a_server_of_its_own(tmp_path):
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect"), "PYTHONPATH": str(REPO),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["url"].startswith("http://127.0.0.1:") and got["url"].endswith("/api")
    assert got["client"].rstrip("/") == got["url"] and got["started"] == [got["url"]]
    assert got["user"] is None                 # no server other processes reach
    assert got["child"] == "None"              # children's environment unchanged
    assert not got["server_module"]            # the client never imported Prefect's server package
