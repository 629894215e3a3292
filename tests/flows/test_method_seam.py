"""The method seam: a method is one module registered in one dict; the steps never name one.

A toy method defined here (weighted SFT rows from every generated trajectory, successful or not)
runs through a real tiny round without any edit of a step: its examples are stored with lineage,
trained on with their weights, its figures land in the round's metrics and its section in the report.
"""

import ast
import json
from pathlib import Path

import duckdb
import pytest

from rsiflow.methods import METHODS, Contribution, DistillContext, Method, method_class
from tests.conftest import REPO, TINY, tiny_overrides

TOY_WEIGHT = 0.25


class Toy(Method):
    name = "toy"

    def distill(self, ctx: DistillContext, inputs) -> Contribution:
        rows = [{"example_id": f"{t['traj_id']}/toy", "method": self.name, "source_traj_id": t["traj_id"],
                 "messages": t["messages"], "weight": TOY_WEIGHT, "meta": {"train_from": t["train_from"]}}
                for t in ctx.trajectories if t["n_turns"]]
        return Contribution(examples=rows, metrics={"rows": len(rows), "weight": TOY_WEIGHT})

    @classmethod
    def report_section(cls, rounds):
        return ["Toy per round:", *[f"- round {r['round']}: {r['toy']['rows']} rows" for r in rounds if r.get("toy")]]


def test_registry_finds_built_ins_and_module_class_names(monkeypatch):
    assert method_class("exit").name == "exit" and method_class("srd").name == "srd"
    assert method_class("tests.flows.test_method_seam:Toy") is Toy
    monkeypatch.setitem(METHODS, "toy", "tests.flows.test_method_seam:Toy")
    assert method_class("toy") is Toy
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        method_class("nope")
    with pytest.raises(ValueError, match="not a subclass"):
        method_class("tests.conftest:REPO")


def test_the_steps_never_name_a_method():
    """distill, train, report and the flows hold no method name: they iterate over the configured methods."""
    names = set(METHODS)
    for path in [REPO / "tasks" / f for f in ("distill.py", "train.py", "report.py", "deploy.py", "gate.py")] + \
            sorted((REPO / "flows").glob("*.py")):
        strings = {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str)}
        assert not names & strings, f"{path.name} names methods {names & strings}"


@pytest.mark.slow
def test_a_toy_method_runs_through_a_tiny_round_without_editing_a_step(tmp_path, prefect_api, monkeypatch):
    from rsiflow.flows.round import improvement_round

    monkeypatch.setitem(METHODS, "toy", "tests.flows.test_method_seam:Toy")
    result = improvement_round([TINY], tiny_overrides(tmp_path, "distill.methods=[toy]"))
    assert result["round"] == 1 and result["results"]["distill"]["examples"] == {"toy": 8}
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    def q(sql, *p):
        return con.execute(sql, list(p)).fetchall()
    n_gen, = q("SELECT count(*) FROM trajectories WHERE step = 'generate'")[0]
    assert q("SELECT method, count(*), min(weight), max(weight) FROM examples GROUP BY 1") == [
        ("toy", n_gen, TOY_WEIGHT, TOY_WEIGHT)]
    # every example trained the candidate, and points at the trajectory it came from
    assert q("SELECT count(*) FROM train_inputs i JOIN examples e USING (example_id, run_id)"
             " JOIN trajectories t ON t.traj_id = e.source_traj_id") == [(n_gen,)]
    metrics, = q("SELECT train_metrics FROM models WHERE model_id = 'tiny/r1/candidate'")[0]
    assert json.loads(metrics)["examples"] == n_gen
    (round_metrics,), = q("SELECT metrics FROM rounds WHERE round = 1")
    assert json.loads(round_metrics)["toy"] == {"rows": n_gen, "weight": TOY_WEIGHT}
    con.close()
    report = Path(tmp_path / "runs" / "tiny" / "report" / "report.md").read_text()
    assert f"- round 1: {n_gen} rows" in report
