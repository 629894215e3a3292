"""X-Tree in a round, without a model: hand-made rollouts in a store, the method's read and distill, its rows
written as the distill step writes them, and what GRPO and ExIt do with the bonus and the token weights."""

import json

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError
from rsiflow.methods import DistillContext, enabled_methods
from rsiflow.methods.xtree import queries
from rsiflow.stores import Store
from rsiflow.tasks.common import trajectories_with_turns
from tests.conftest import TINY

PREFIX = [{"role": "system", "content": "Act."}]
ROUTINE = ["go<receptacle>", "take<object,receptacle>", "go<receptacle>", "heat<object,microwave>"]


def config(tmp_path, *overrides):
    return load_config([TINY], [f"run.store={tmp_path / 'store.duckdb'}", f"run.run_dir={tmp_path / 'run'}",
                                *overrides])


def play(store, run, round_no, episodes):
    """Store a generate step: episodes are (group, task_type, symbols, success)."""
    tasks, trajs, turns = {}, [], []
    for i, (group, task_type, symbols, success) in enumerate(episodes):
        task_id = f"r{round_no}-{group}"
        tasks[task_id] = {"task_id": task_id, "env": "household", "split": "train", "task_type": task_type,
                          "seed": 0, "spec": "{}"}
        traj_id = f"r{round_no}-{i:02d}"
        trajs.append({"traj_id": traj_id, "task_id": task_id, "model_id": "m", "group_id": f"r{round_no}-{group}",
                      "sample_idx": i, "purpose": "train", "status": "success" if success else "failure",
                      "success": success, "reward": float(success), "n_turns": len(symbols)})
        turns += [{"traj_id": traj_id, "turn_idx": k, "observation": f"obs {k}", "action_text": f"{s} {k}",
                   "action_symbol": s, "valid": True} for k, s in enumerate(symbols)]
    with store.step(run, round_no, "generate") as tx:
        tx.insert("tasks", list(tasks.values()))
        tx.insert("trajectories", trajs)
        tx.insert("turns", turns)


def distill(cfg, round_no):
    """The distill step's work, without Prefect: every method's read, distill, and one transaction of rows."""
    methods = enabled_methods(cfg)
    with Store(cfg.run.store) as store:
        ctx = DistillContext(cfg=cfg, round=round_no, champion="m", champion_path="-",
                             trajectories=trajectories_with_turns(store, cfg.run.name, round_no, "generate", PREFIX),
                             prefix=PREFIX)
        inputs = {m.name: m.read(store, ctx) for m in methods}
    out = {m.name: m.distill(ctx, inputs[m.name]) for m in methods}
    with Store(cfg.run.store) as store, store.step(cfg.run.name, round_no, "distill") as tx:
        for m in methods:
            tx.insert("examples", out[m.name].examples)
            for table, rows in out[m.name].tables.items():
                tx.insert(table, rows)
        tx.metrics({name: c.metrics for name, c in out.items()})
    return out


NOISE = ["look<>", "inventory<>", "open<receptacle>", "examine<object>"]


def round_of(round_no):
    """Two heat groups (one all-fail: two rollouts run the routine, two don't) and a mixed pick group."""
    eps = []
    for k in range(4):
        rare = [["close<receptacle>", "examine<receptacle>"], ["examine<receptacle>", "close<receptacle>"]]
        eps.append(("g0", "pick_heat_then_place", [NOISE[k]] + ROUTINE if k < 2 else rare[k - 2], False))
    for _ in range(4):
        eps.append(("g1", "pick_heat_then_place", ROUTINE + ["put<object,receptacle>"], True))
    for k in range(4):
        eps.append(("g2", "pick_and_place", ["go<receptacle>", "take<object,receptacle>", "go<receptacle>",
                                             "put<object,receptacle>"] if k % 2 else NOISE[:2], bool(k % 2)))
    return eps


def test_the_tree_is_stored_with_lineage_and_grows_with_the_run(tmp_path):
    cfg = config(tmp_path, "distill.methods=[xtree]")
    with Store(cfg.run.store) as store:
        play(store, "tiny", 1, round_of(1))
    out = distill(cfg, 1)["xtree"]
    assert out.metrics["first_round"] == 1 and out.metrics["trajectories"] == 12 and out.metrics["nodes"] > 0
    with Store(cfg.run.store) as store:
        play(store, "tiny", 2, round_of(2))
    distill(cfg, 2)
    with Store(cfg.run.store) as store:
        t1, t2 = queries.tree(store, "tiny", 1), queries.tree(store, "tiny", 2)
        assert t2["parent_tree_id"] == t1["tree_id"] == "tiny/r1/xtree" and t2["first_round"] == 1
        assert t2["n_trajectories"] == 24 and t2["n_symbols"] == 2 * t1["n_symbols"]   # the corpus grew
        nodes = queries.nodes(store, t2["tree_id"])
        heat = next(n for n in nodes if n["span"] == ROUTINE)
        assert heat["first_round"] == 1                                    # lineage to the round it first appeared
        occ = store.rows("SELECT o.traj_id, o.turn_start, o.turn_end, list(u.action_symbol ORDER BY u.turn_idx) AS s"
                         " FROM xtree_occurrences o JOIN turns u ON u.traj_id = o.traj_id"
                         " AND u.turn_idx >= o.turn_start AND u.turn_idx < o.turn_end"
                         " WHERE o.tree_id = ? AND o.node_idx = ? GROUP BY ALL", [t2["tree_id"], heat["node_idx"]])
        assert len(occ) == heat["freq"] and all(r["s"] == ROUTINE for r in occ)
        assert json.loads(store.rows("SELECT CAST(metrics AS VARCHAR) AS m FROM steps WHERE round = 2 AND"
                                     " step = 'distill'")[0]["m"])["xtree"]["uses"] == []
    # a window of one round mines round 2 only
    cfg1 = config(tmp_path, "distill.methods=[xtree]", "distill.xtree.window=1")
    assert distill(cfg1, 2)["xtree"].metrics["trajectories"] == 12


def test_the_bonus_shapes_grpo_advantages_and_leaves_the_verifier_reward(tmp_path):
    cfg = config(tmp_path, "distill.methods=[xtree,grpo]", "distill.xtree.bonus=true",
                 "distill.xtree.bonus_lambda=0.5")
    with Store(cfg.run.store) as store:
        play(store, "tiny", 1, round_of(1))
    out = distill(cfg, 1)
    bonus = {r["traj_id"]: r for r in out["xtree"].tables["xtree_bonus"]}
    grpo = {e["source_traj_id"]: e["meta"] for e in out["grpo"].examples}
    # the all-fail heat group: lambda_g = 0.5; the two rollouts that ran the routine get a bonus, the others none
    g0 = [bonus[f"r1-{i:02d}"] for i in range(4)]
    assert [r["lambda_g"] for r in g0] == [0.5] * 4 and [r["verifier_reward"] for r in g0] == [0.0] * 4
    assert g0[0]["bonus"] > 0 and g0[1]["bonus"] > 0 and g0[2]["bonus"] == g0[3]["bonus"] == 0.0
    assert g0[0]["bonus"] == pytest.approx(0.5 * g0[0]["share"])
    assert grpo["r1-00"]["advantage"] > 0 > grpo["r1-02"]["advantage"]           # signal from an all-fail group
    assert grpo["r1-00"]["reward"] == 0.0 and grpo["r1-00"]["shaped_reward"] == pytest.approx(g0[0]["bonus"])
    # the all-pass group: lambda_g = 0, no bonus, no advantage
    assert all(bonus[f"r1-{i:02d}"]["bonus"] == 0.0 and grpo[f"r1-{i:02d}"]["advantage"] == 0.0 for i in range(4, 8))
    assert out["xtree"].metrics["all_fail_separated"] == 1 and out["xtree"].metrics["all_fail_groups"] == 1
    with Store(cfg.run.store) as store:   # the trajectories keep the verifier's outcome
        assert store.rows("SELECT sum(reward) AS r FROM trajectories")[0]["r"] == 6.0
        assert store.rows("SELECT count(*) AS n FROM xtree_bonus")[0]["n"] == 12


def test_token_weights_split_exit_examples_into_weighted_spans(tmp_path):
    cfg = config(tmp_path, "distill.methods=[xtree,exit]", "distill.xtree.token_weights=true",
                 "distill.exit.dedupe=false")
    with Store(cfg.run.store) as store:
        play(store, "tiny", 1, round_of(1))
    out = distill(cfg, 1)
    rows = [e for e in out["exit"].examples if e["source_traj_id"] == "r1-04"]   # ROUTINE + put, a success
    assert len(rows) >= 2
    turns = [tuple(r["meta"]["turns"]) for r in rows]
    assert turns[0][0] == 0 and turns[-1][1] == 5 and all(a[1] == b[0] for a, b in zip(turns, turns[1:]))
    weights = [w for r in rows for w in [r["weight"]] * (r["meta"]["turns"][1] - r["meta"]["turns"][0])]
    assert sum(weights) / 5 == pytest.approx(1.0) and max(weights) > min(weights)
    for r in rows:   # each row trains its own turns only, after the conversation before them
        s, e = r["meta"]["turns"]
        assert len(r["messages"]) == len(PREFIX) + 2 * e and r["meta"]["train_from"] == len(PREFIX) + 2 * s
    assert out["xtree"].metrics["weighted_trajectories"] == 6


def test_context_pairs_put_the_rendered_tree_in_the_teachers_task_message(tmp_path):
    cfg = config(tmp_path, "distill.methods=[xtree]", "distill.xtree.context=true",
                 "distill.xtree.context_trajectories=1")
    with Store(cfg.run.store) as store:
        play(store, "tiny", 1, round_of(1))
    out = distill(cfg, 1)["xtree"]
    assert len(out.examples) == 3                                  # one per group
    pair = out.tables["foresight"][0]
    student, teacher, start = pair["student_messages"], pair["teacher_messages"], pair["train_from"]
    assert [m for i, m in enumerate(teacher) if i != start] == [m for i, m in enumerate(student) if i != start]
    assert teacher[start]["content"].startswith(student[start]["content"])
    assert "Reusable action patterns" in teacher[start]["content"] and "heat<object,microwave>" in \
        teacher[start]["content"]
    with Store(cfg.run.store) as store:
        (method,) = enabled_methods(cfg)
        examples = [{**e, "meta": json.loads(e["meta"])} for e in store.examples_dataset("tiny", 1)]
        rows = method.training_rows(store, "tiny", 1, examples)
    assert {r["kind"] for r in rows} == {"distill"} and rows[0]["teacher"][start] == teacher[start]
    assert method.distill_loss().loss_weight == 0.01


def test_a_use_without_a_method_that_consumes_it_is_a_config_error_and_order_follows_the_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"distill.xtree: provides reward_bonus .* no method of \['xtree'\] consumes"):
        enabled_methods(config(tmp_path, "distill.methods=[xtree]", "distill.xtree.bonus=true"))
    # the order of distill.methods does not matter: X-Tree provides the weights ExIt consumes, so it runs first
    cfg = config(tmp_path, "distill.methods=[exit,xtree]", "distill.xtree.token_weights=true")
    assert [m.name for m in enabled_methods(cfg)] == ["xtree", "exit"]
    assert [m.name for m in enabled_methods(config(tmp_path, "distill.methods=[exit,xtree]"))] == ["exit", "xtree"]
    with pytest.raises(ConfigError, match="rsipo requires policy_loss, which no method of"):
        enabled_methods(config(tmp_path, "distill.methods=[rsipo]"))
    # a disabled method's options are inert: GRPO alone gets no bonus, whatever distill.xtree says
    cfg = config(tmp_path, "distill.methods=[grpo]", "distill.xtree.bonus=true")
    with Store(cfg.run.store) as store:
        play(store, "tiny", 1, round_of(1))
    out = distill(cfg, 1)["grpo"]
    assert out.examples and not any("xtree_bonus" in e["meta"] for e in out.examples)
