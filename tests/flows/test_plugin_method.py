"""A third-party method with the powers of a built-in one, from files outside the repository.

The toy lives in a package written to a temporary folder (`toyplug/method.py`, one file besides an empty
`__init__.py`) and is named in the config as 'toyplug.method:Toy'. It has one option (`distill.toy.weight`,
validated by its own pydantic model, with an error naming the key and where it came from) and one table of its own
(`toy_seen`, created by its `migrations` when the run is set up, keyed by method and version, cleared with its step).
Adding it touches no file of the repository: the measure the structure issue asks for (a new method with options
and a table touches its own files, plus one registry line when it is made a built-in, `configs/registry.py`).
"""

import json
import subprocess
import textwrap

import duckdb
import pytest

from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError
from tests.conftest import REPO, TINY, tiny_overrides

TOY = "toyplug.method:Toy"

METHOD_PY = '''
"""A toy method: every generated trajectory becomes an SFT row of weight `distill.toy.weight`, and its number of
turns is recorded in the method's own table."""

from pydantic import Field

from rsiflow.configs.section import Section
from rsiflow.methods import Contribution, Method


class ToyOptions(Section):
    weight: float = Field(0.25, gt=0, le=1, description="Training weight of each toy row.")


class Toy(Method):
    name = "toy"
    Options = ToyOptions
    tables = ("toy_seen",)
    migrations = ((1, "toy_seen", "CREATE TABLE toy_seen (run_id VARCHAR NOT NULL, round INTEGER NOT NULL, "
                                  "step VARCHAR NOT NULL, traj_id VARCHAR NOT NULL, turns INTEGER NOT NULL)"),)

    def distill(self, ctx, inputs):
        w = self.options.weight
        used = [t for t in ctx.trajectories if t["n_turns"]]
        rows = [{"example_id": f"{t['traj_id']}/toy", "method": self.name, "source_traj_id": t["traj_id"],
                 "messages": t["messages"], "weight": w, "meta": {"train_from": t["train_from"]}} for t in used]
        seen = [{"traj_id": t["traj_id"], "turns": t["n_turns"]} for t in used]
        return Contribution(examples=rows, tables={"toy_seen": seen}, metrics={"rows": len(rows), "weight": w})

    @classmethod
    def report_section(cls, rounds):
        return ["Toy per round:", *[f"- round {r['round']}: {r['toy']['rows']} rows of weight {r['toy']['weight']}"
                                    for r in rounds if r.get("toy")]]
'''


@pytest.fixture
def toy_plugin(tmp_path, monkeypatch):
    """The toy's package in a folder of its own, importable here and in any process a step starts."""
    folder = tmp_path / "plugins"
    (folder / "toyplug").mkdir(parents=True)
    (folder / "toyplug" / "__init__.py").write_text("")
    (folder / "toyplug" / "method.py").write_text(textwrap.dedent(METHOD_PY))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", str(folder))
    return folder


def test_the_plugins_option_is_validated_by_its_own_model(toy_plugin):
    cfg = load_config([TINY], [f"distill.methods=[{TOY}]", "distill.toy.weight=0.5"])
    assert cfg.distill.toy.weight == 0.5
    assert load_config([TINY], [f"distill.methods=[{TOY}]"]).distill.toy.weight == 0.25   # its default
    with pytest.raises(ConfigError) as e:
        load_config([TINY], [f"distill.methods=[{TOY}]", "distill.toy.wieght=0.5"])
    assert "distill.toy.wieght" in str(e.value) and "--set" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config([TINY], [f"distill.methods=[{TOY}]", "distill.toy.weight=2"])
    assert "distill.toy.weight" in str(e.value) and "less than or equal to 1" in str(e.value)
    # without the method named, its section is unknown
    with pytest.raises(ConfigError, match="distill.toy"):
        load_config([TINY], ["distill.toy.weight=0.5"])


@pytest.mark.slow
def test_a_plugin_method_with_an_option_and_a_table_runs_a_round(tmp_path, toy_plugin, prefect_api):
    from rsiflow.flows.round import improvement_round

    tracked = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    result = improvement_round([TINY], tiny_overrides(tmp_path, f"distill.methods=[{TOY}]", "distill.toy.weight=0.5"))
    assert result["round"] == 1 and result["results"]["distill"]["examples"] == {"toy": 8}

    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)

    def q(sql, *p):
        return con.execute(sql, list(p)).fetchall()

    assert q("SELECT method, version FROM method_migrations") == [("toy", 1)]
    n_gen, = q("SELECT count(*) FROM trajectories WHERE step = 'generate'")[0]
    # its table's rows carry the step's key (filled by the store) and point at the round's trajectories
    assert q("SELECT run_id, round, step, count(*) FROM toy_seen GROUP BY ALL") == [("tiny", 1, "distill", n_gen)]
    assert q("SELECT count(*) FROM toy_seen s JOIN trajectories t USING (traj_id) WHERE s.turns = t.n_turns") == [
        (n_gen,)]
    assert q("SELECT method, count(*), min(weight), max(weight) FROM examples GROUP BY 1") == [("toy", n_gen, .5, .5)]
    (round_metrics,), = q("SELECT metrics FROM rounds WHERE round = 1")
    assert json.loads(round_metrics)["toy"] == {"rows": n_gen, "weight": 0.5}
    con.close()
    report = (tmp_path / "runs" / "tiny" / "report" / "report.md").read_text()
    assert f"- round 1: {n_gen} rows of weight 0.5" in report

    # the files it took: its own two, outside the repository; the repository's files are as they were
    assert sorted(p.relative_to(toy_plugin).as_posix() for p in toy_plugin.rglob("*.py")) == [
        "toyplug/__init__.py", "toyplug/method.py"]
    assert subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                          text=True).stdout == tracked
