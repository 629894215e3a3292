"""bench.compare: arm parsing, pooling, and a tiny 2 arms × 2 seeds × 1 round run checked against its store."""

import csv
import json
import os
import shutil
import subprocess
import sys

import duckdb
import pytest

from bench.compare import aggregate, markdown, parse_arm, split_overrides
from tests.conftest import REPO, TINY, prefect_home


def test_arm_overrides_keep_brackets_and_quotes_together():
    assert split_overrides("distill.methods=[exit,srd],train.epochs=2") == [
        "distill.methods=[exit,srd]", "train.epochs=2"]
    assert split_overrides("a.b={x: 1, y: 2}; c.d='p,q'") == ["a.b={x: 1, y: 2}", "c.d='p,q'"]
    assert parse_arm("exit") .overrides == []
    arm = parse_arm("srd:distill.methods=[exit,srd]")
    assert (arm.name, arm.overrides) == ("srd", ["distill.methods=[exit,srd]"])
    with pytest.raises(ValueError):
        split_overrides("distill.methods=[exit,srd")
    with pytest.raises(ValueError):
        parse_arm("x:train.epochs")


def test_merge_copies_runs_of_a_store_older_code_wrote(tmp_path):
    """A store written before a later migration lacks that migration's tables: its runs merge, with no rows
    there; merging again copies nothing; a run with more completed rounds replaces the copy."""
    from bench.compare import merge_runs
    from rsiflow.stores.store import Store

    src = tmp_path / "old" / "compare.duckdb"
    src.parent.mkdir()
    with Store(src) as s:
        s.create_run("a-s0", "a-s0", {"x": 1}, "base")
        s.start_round("a-s0", 1, "base")
        s.finish_round("a-s0", 1, "base", {"m": 1})
    con = duckdb.connect(str(src))
    con.execute("DROP TABLE mass_verdicts")   # as if written before MASS's migration
    con.close()
    assert merge_runs(tmp_path / "merged", [src.parent]) == ["a-s0"]
    assert merge_runs(tmp_path / "merged", [src.parent]) == []
    with Store(tmp_path / "merged" / "compare.duckdb", read_only=True) as m:
        assert [r["round"] for r in m.rows("SELECT round FROM rounds WHERE status = 'completed'")] == [1]
        assert m.rows("SELECT count(*) AS n FROM mass_verdicts")[0]["n"] == 0


def _run_store(path, champion_role="base"):
    """A store with run a-s0: rounds 0 and 1 completed, round 2 in progress (a trajectory, a candidate), a lease."""
    from rsiflow.stores.store import Store

    path.parent.mkdir(parents=True, exist_ok=True)
    with Store(path) as s:
        s.create_run("a-s0", "a-s0", {"x": 1}, "base")
        s.con.execute("INSERT INTO models (model_id, run_id, round, path, role) VALUES"
                      " ('base', 'a-s0', 0, '/wheel/model', 'base'),"
                      f" ('a-s0/r1/candidate', 'a-s0', 1, '/runs/a-s0/models/round-1', '{champion_role}'),"
                      " ('a-s0/r2/candidate', 'a-s0', 2, '/runs/a-s0/models/round-2', 'candidate')")
        champion = "base" if champion_role == "base" else "a-s0/r1/candidate"
        for r in (0, 1):
            s.start_round("a-s0", r, "base")
            s.finish_round("a-s0", r, champion, {"m": r})
        s.start_round("a-s0", 2, champion)
        for r in (1, 2):
            s.con.execute("INSERT INTO trajectories (traj_id, run_id, round) VALUES (?, 'a-s0', ?)", [f"t{r}", r])
        s.acquire_lease("a-s0", "host:1:x", 60.0, "host", 1)


def test_pack_carries_completed_rounds_to_a_fresh_store(tmp_path):
    """A pack holds the run's rows up to its last completed round, no lease; merged into a fresh comparison
    folder it gives the same completed rounds, and a second merge copies nothing."""
    from bench.compare import merge_packs, pack_path, write_pack
    from rsiflow.stores.store import Store

    out = tmp_path / "here"
    _run_store(out / "compare.duckdb")
    assert write_pack(out, "a-s0") == pack_path(out, "a-s0")
    there = tmp_path / "there"
    (there / "packs").mkdir(parents=True)
    shutil.copy(pack_path(out, "a-s0"), pack_path(there, "a-s0"))
    assert merge_packs(there, ["a-s0", "b-s0"]) == ["a-s0"]
    assert merge_packs(there, ["a-s0"]) == []
    with Store(there / "compare.duckdb", read_only=True) as m:
        assert m.last_completed_round("a-s0") == 1
        assert [r["round"] for r in m.rows("SELECT round FROM rounds ORDER BY round")] == [0, 1]
        assert [r["traj_id"] for r in m.rows("SELECT traj_id FROM trajectories")] == ["t1"]
        assert [r["model_id"] for r in m.rows("SELECT model_id FROM models ORDER BY model_id")] == [
            "a-s0/r1/candidate", "base"]
        assert m.rows("SELECT count(*) AS n FROM leases")[0]["n"] == 0


def test_a_run_is_finished_with_all_its_rounds_and_its_final_test(tmp_path, monkeypatch):
    """--report-only --pack packs only unfinished runs (a merged, finished run got a pack once)."""
    import bench.compare as bc

    store = tmp_path / "here" / "compare.duckdb"
    _run_store(store)   # rounds 0 and 1 completed
    assert not bc._finished(store, "a-s0", 2) and not bc._finished(store, "a-s0", None)
    assert not bc._finished(store, "a-s0", 1)        # no final test split stored
    monkeypatch.setattr(bc, "_final_test_missing", lambda *_: False)
    assert bc._finished(store, "a-s0", 1) and not bc._finished(store, "a-s0", 2)


def test_pack_refuses_a_trained_champion_and_a_run_without_rounds(tmp_path):
    from bench.compare import write_pack
    from rsiflow.stores.store import Store

    out = tmp_path / "here"
    _run_store(out / "compare.duckdb", champion_role="champion")
    with pytest.raises(ValueError, match="trained checkpoint /runs/a-s0/models/round-1"):
        write_pack(out, "a-s0")
    with Store(out / "compare.duckdb") as s:
        s.create_run("b-s0", "b-s0", {"x": 1}, "base")
    assert write_pack(out, "b-s0") is None
    assert not (out / "packs" / "b-s0.duckdb.gz").exists()


def test_waiting_on_a_run_packs_each_newly_completed_round(tmp_path, capsys):
    """--pack: while the run's process lives, a round completed since the last pack is packed once."""
    import bench.compare as bc

    out = tmp_path / "here"
    _run_store(out / "compare.duckdb")

    class Proc:   # a run process that is still running at the first two looks, then exits 0
        looks = 0

        def wait(self, timeout=None):
            self.looks += 1
            if self.looks <= 2:
                raise subprocess.TimeoutExpired("rsiflow", timeout)
            return 0

    assert bc._wait(Proc(), out, "a-s0", packed=0) == 0
    assert bc.pack_path(out, "a-s0").exists()
    assert capsys.readouterr().out.count("packed 1 completed round(s)") == 1
    bc.pack_path(out, "a-s0").unlink()
    assert bc._wait(Proc(), out, "a-s0", packed=1) == 0   # nothing new completed: no pack
    assert not bc.pack_path(out, "a-s0").exists()


def _h(k, n):
    return {"successes": k, "n": n, "success_rate": k / n}


def test_pooling_over_seeds():
    data = {
        ("a", 0): [{"round": 0, "serving": _h(1, 10), "candidate": None, "decision": None},
                   {"round": 1, "serving": _h(3, 10), "candidate": _h(3, 10), "decision": "promote",
                    "train_episodes": 8, "train_successes": 2, "gen_tokens": 100, "wall_s": 10.0, "steps_s": 9.0,
                    "extras": {"examples": 2, "srd.loss": 0.5}}],
        ("a", 1): [{"round": 0, "serving": _h(1, 10), "candidate": None, "decision": None},
                   {"round": 1, "serving": _h(1, 10), "candidate": _h(0, 10), "decision": "reject",
                    "train_episodes": 8, "train_successes": 2, "gen_tokens": 60, "wall_s": 20.0, "steps_s": 19.0,
                    "extras": {"examples": 4}}],
    }
    table, keys = aggregate(data, ["a"], [0, 1])
    assert keys == ["examples", "srd.loss"]
    r1 = table[1]
    assert (r1["serving"]["k"], r1["serving"]["n"], r1["serving"]["mean"]) == (4, 20, 0.2)
    assert (r1["candidate"]["k"], r1["candidate"]["n"]) == (3, 20)
    assert 0.08 < r1["serving"]["ci_low"] < 0.2 < r1["serving"]["ci_high"] < 0.45
    assert r1["decisions"] == {"promote": 1, "reject": 1}
    assert (r1["train_successes"], r1["gen_tokens"], r1["wall_s"]) == (4, 160, 15.0)
    assert r1["extras"] == {"examples": 3.0, "srd.loss": 0.5}
    md = markdown(table, keys, "t", "n")
    assert "| a | 1 | 3/10 1/10 | 4/20 = 0.200 [" in md and "promote×1, reject×1" in md and "| 40 |" in md


@pytest.mark.slow
def test_compare_runs_arms_and_seeds_on_tiny(tmp_path):
    out = tmp_path / "cmp"
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "bench.compare", "--config", TINY, "--arm", "a", "--arm", "b:train.learning_rate=1e-4",
           "--seeds", "0,1", "--rounds", "1", "--set", "gate.heldout_tasks=4", "--out", str(out)]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "| arm | round |" in res.stdout
    for f in ("table.md", "table.csv", "runs.csv", "compare.duckdb"):
        assert (out / f).exists()
    assert (out / "success.png").read_bytes()[:4] == b"\x89PNG"

    rows = list(csv.DictReader(open(out / "table.csv")))
    assert [(r["arm"], r["round"]) for r in rows] == [("a", "0"), ("a", "1"), ("b", "0"), ("b", "1")]
    con = duckdb.connect(str(out / "compare.duckdb"), read_only=True)

    def q(sql, *params):
        return con.execute(sql, list(params)).fetchall()

    assert sorted(r for (r,) in q("SELECT run_id FROM runs")) == ["a-s0", "a-s1", "b-s0", "b-s1"]
    assert q("SELECT DISTINCT config->'$.run'->>'seed' FROM runs WHERE run_id LIKE '%-s1'") == [("1",)]
    assert q("SELECT DISTINCT config->'$.train'->>'learning_rate' FROM runs WHERE run_id LIKE 'b-%'") == [("0.0001",)]
    for r in rows:
        runs = [f"{r['arm']}-s0", f"{r['arm']}-s1"]
        if r["round"] == "0":   # the base's held-out evaluation
            (k, n), = q("SELECT sum(successes), sum(n) FROM evaluations WHERE split = 'heldout' AND task_type = '*'"
                        " AND model_id IN (?, ?)", *[f"{x}/base" for x in runs])
            assert (int(r["heldout_k"]), int(r["heldout_n"])) == (k, n) and n == 8
            continue
        (eps, succ, toks), = q("SELECT count(*), count(*) FILTER (WHERE success), sum(gen_tokens) FROM trajectories"
                               " WHERE step = 'generate' AND round = 1 AND run_id IN (?, ?)", *runs)
        assert (int(r["train_episodes"]), int(r["train_successes"]), int(r["gen_tokens"])) == (eps, succ, toks)
        decisions = q("SELECT decision, count(*) FROM gate_decisions WHERE round = 1 AND run_id IN (?, ?)"
                      " GROUP BY decision ORDER BY decision", *runs)
        assert r["decisions"] == ";".join(f"{d}:{c}" for d, c in decisions)
        (wall,), = q("SELECT avg(epoch(finished_at - started_at)) FROM rounds"
                     " WHERE round = 1 AND run_id IN (?, ?)", *runs)
        assert float(r["wall_s_mean"]) == pytest.approx(wall, abs=0.01)
        assert r["examples"] != ""   # a key of the rounds' metrics JSON, flattened into a column
    con.close()

    # the same command again: every run is complete, nothing runs; --report-only rebuilds the table
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("skipped") == 4 and "running" not in again.stdout
    (out / "table.csv").unlink()
    rep = subprocess.run([sys.executable, "-m", "bench.compare", "--out", str(out), "--report-only"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    assert list(csv.DictReader(open(out / "table.csv"))) == rows

    # the records alone (a fresh checkout: no store, no checkpoints) give the same tables, and the comparison
    # command skips the runs they hold
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copytree(out / "records", fresh / "records")
    shutil.copy(out / "compare.json", fresh / "compare.json")
    assert sorted(p.name for p in (fresh / "records").iterdir()) == [f"{r}.json" for r in
                                                                     ("a-s0", "a-s1", "b-s0", "b-s1")]
    rep = subprocess.run([sys.executable, "-m", "bench.compare", "--out", str(fresh), "--report-only"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    assert list(csv.DictReader(open(fresh / "table.csv"))) == rows
    assert (fresh / "learning.md").read_text() == (out / "learning.md").read_text()
    resumed = subprocess.run([*cmd[:-1], str(fresh)], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0 and resumed.stdout.count("skipped") == 4, resumed.stdout[-2000:]
    assert not (fresh / "compare.duckdb").exists()

    # a comparison split over folders merges into one store: same table; merging again copies nothing
    merged = tmp_path / "merged"
    merge_cmd = [sys.executable, "-m", "bench.compare", "--out", str(merged), "--report-only", "--merge", str(out),
                 "--arm", "a", "--arm", "b", "--seeds", "0,1"]
    first = subprocess.run(merge_cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "merged runs ['a-s0', 'a-s1', 'b-s0', 'b-s1']" in first.stdout
    assert list(csv.DictReader(open(merged / "table.csv"))) == rows
    second = subprocess.run(merge_cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "merged runs []" in second.stdout
    con = duckdb.connect(str(merged / "compare.duckdb"), read_only=True)
    source = duckdb.connect(str(out / "compare.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM trajectories").fetchall() == \
        source.execute("SELECT count(*) FROM trajectories").fetchall()
    source.close()
    con.close()


def test_prose_metrics_stay_out_of_the_table():
    from bench.compare import _flatten

    flat = _flatten({"xtree": {"nodes": 3, "outline": "- a > b\n  - a", "kind": "hf"}, "note": "x" * 81})
    assert flat == {"xtree.nodes": 3, "xtree.kind": "hf"}


def test_a_record_of_another_version_is_refused_with_the_fix(tmp_path):
    from bench.compare import read_record, record_path

    path = record_path(tmp_path, "a-s0")
    path.parent.mkdir()
    path.write_text(json.dumps({"version": 0, "rows": []}))
    with pytest.raises(ValueError, match=r"a-s0.json: record version 0.*--report-only"):
        read_record(tmp_path, "a-s0")
    assert read_record(tmp_path, "b-s0") is None


@pytest.mark.slow
def test_a_run_stopped_during_its_final_test_split_plays_it_on_the_next_invocation(tmp_path):
    """A run with all its rounds but no final test split (stopped while playing it) is not skipped: the next
    invocation plays the split, and the one after skips the run."""
    out = tmp_path / "cmp"
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "bench.compare", "--config", TINY, "--arm", "a", "--seeds", "0", "--rounds", "1",
           "--set", "gate.heldout_tasks=4", "--set", "gate.test_tasks=3", "--out", str(out)]
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    record = out / "records" / "a-s0.json"
    assert json.loads(record.read_text())["final_test"]["tasks"] == 3

    # as if stopped while playing the split: its step and the record's figures are gone
    con = duckdb.connect(str(out / "compare.duckdb"))
    con.execute("DELETE FROM steps WHERE run_id = 'a-s0' AND step = 'test'")
    con.close()
    data = json.loads(record.read_text())
    data["final_test"] = None
    record.write_text(json.dumps(data))

    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "its final test split is not: playing it" in second.stdout and "skipped" not in second.stdout
    assert json.loads(record.read_text())["final_test"]["tasks"] == 3
    third = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0 and "1 round(s) already in the store, skipped" in third.stdout, third.stdout[-2000:]


@pytest.mark.slow
def test_a_packed_run_resumes_on_a_fresh_checkout(tmp_path):
    """A run cut off after its first round (no record), packed, continues in another folder that holds only the
    pack: its first round is merged, not played again, the second is played, and the finished run's pack goes."""
    out, fresh = tmp_path / "cmp", tmp_path / "fresh"
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "bench.compare", "--config", TINY, "--arm", "a", "--seeds", "0",
           "--set", "gate.heldout_tasks=4", "--pack"]
    res = subprocess.run([*cmd, "--rounds", "1", "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not (out / "packs" / "a-s0.duckdb.gz").exists()   # finished: its record replaces the pack
    (out / "records" / "a-s0.json").unlink()                   # as if cut off after round 1
    res = subprocess.run([sys.executable, "-m", "bench.compare", "--out", str(out), "--report-only", "--pack"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "packed a-s0" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    (fresh / "packs").mkdir(parents=True)
    shutil.copy(out / "packs" / "a-s0.duckdb.gz", fresh / "packs")
    res = subprocess.run([*cmd, "--rounds", "2", "--out", str(fresh)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "merged the packs of ['a-s0']" in res.stdout
    log = (fresh / "logs" / "a-s0.log").read_text()
    assert "round 2 generate" in log and "round 1 generate" not in log   # round 1 came from the pack
    con = duckdb.connect(str(fresh / "compare.duckdb"), read_only=True)
    assert con.execute("SELECT list(round ORDER BY round) FROM rounds WHERE status = 'completed'").fetchall() == [
        ([1, 2],)]
    con.close()
    assert json.loads((fresh / "records" / "a-s0.json").read_text())["rounds_completed"] == 2
    assert not (fresh / "packs" / "a-s0.duckdb.gz").exists()
