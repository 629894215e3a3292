"""A default round runs on each env family from its config alone (with the tiny model, small sizes)."""

import duckdb
import pytest

from rsiflow.envs.scienceworld import runtime_missing
from rsiflow.flows.round import improvement_round
from rsiflow.tasks.common import STEPS
from tests.conftest import REPO, tiny_overrides

SMALL = ("model.base=tiny:0", "backend.max_new_tokens=8", "generate.tasks_per_round=4", "generate.group_size=2",
         "gate.heldout_tasks=4", "train.epochs=1", "train.batch_size=4")

ROUND_CONFIGS = {
    "arithmetic": ["configs/arithmetic.yaml"],
    "tooluse": ["configs/tooluse.yaml"],
    "byo-countdown": ["configs/default.yaml", "examples/byo.yaml"],
    "scienceworld": ["configs/scienceworld.yaml"],
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(ROUND_CONFIGS))
def test_default_round_runs_from_config(family, tmp_path, prefect_api):
    if family == "scienceworld" and (reason := runtime_missing()):
        pytest.skip(f"ScienceWorld can't run here: {reason}")
    extra = SMALL + (("gate.heldout_tasks=2", "env.max_turns=3")
                     if family == "scienceworld" else ())
    files = [str(REPO / f) for f in ROUND_CONFIGS[family]]
    result = improvement_round(files, tiny_overrides(tmp_path, *extra))
    assert result["round"] == 1 and set(result["results"]) == set(STEPS)
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    try:
        (status,), = con.execute("SELECT status FROM rounds WHERE round = 1").fetchall()
        assert status == "completed"
        envs = {r[0] for r in con.execute("SELECT DISTINCT env FROM tasks").fetchall()}
        n_gen, errors = con.execute("SELECT count(*), count(*) FILTER (WHERE status = 'error') FROM trajectories"
                                    " WHERE step = 'generate'").fetchall()[0]
    finally:
        con.close()
    assert envs == {"countdown" if family == "byo-countdown" else family}
    assert n_gen == 8 and errors == 0
