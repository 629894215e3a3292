"""MASS in a round without Prefect, on the tiny random model: the method's distill (search, teacher collection,
SFT examples) and its gate-step assessment against a real backend, the rows it writes, and the trainer keeping
the lowest-validation-loss checkpoint.

The tiny model solves no real env, so the round plays a one-reply env defined here whose verifier accepts a reply
of even length (about half of random replies): outcomes are mixed, and the oracle judge (the verifier) decides
pairs, so the search and the tournament have something to rank."""

import json

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError
from rsiflow.envs.base import Env, StepResult, TaskSpec, sample_hashed_tasks, step_guard
from rsiflow.envs.rollout import prompt_setup
from rsiflow.methods import AssessContext, DistillContext, enabled_methods
from rsiflow.stores import Store
from tests.conftest import TINY

ENV = "tests.tasks.test_mass_method:ParityEnv"


class ParityEnv(Env):
    """One reply; solved when its first line has an even number of characters (and is not empty)."""

    name = "parity"
    task_types = ("parity",)

    def __init__(self):
        self._task, self._done, self._success = None, False, False

    def sample_tasks(self, split: str, n: int, seed: int) -> list[TaskSpec]:
        return sample_hashed_tasks(self.name, self.task_types, split, n, seed,
                                   lambda task_type, rng: {"question": f"Say something ({rng.randrange(10**9)})."})

    def reset(self, task: TaskSpec) -> str:
        self._task, self._done, self._success = task, False, False
        return task.spec["question"]

    def step(self, action: str) -> StepResult:
        if (guard := step_guard(self._task, self._done, self._success)) is not None:
            return guard
        line = (action.strip().splitlines() or [""])[0]
        self._done, self._success = True, bool(line) and len(line) % 2 == 0
        return StepResult("Done.", float(self._success), True, self._success, {"valid": True, "feedback": "ok"})

    def hindsight(self) -> list[str]:
        return ["Even-length replies win."]

    def canonicalize(self, action: str) -> str:
        return "say<text>"

    def instructions(self) -> str:
        return "Reply with one line."


def config(tmp_path, *overrides):
    return load_config([TINY], [f"run.store={tmp_path / 'store.duckdb'}", f"run.run_dir={tmp_path / 'run'}",
                                f"env.name={ENV}", "env.kwargs={}", "env.max_turns=1", "env.show_admissible=false",
                                "env.project_actions=false", "distill.methods=[mass]", "generate.tasks_per_round=4",
                                *overrides])


def distill(cfg, tiny_path, round_no=1):
    """The distill step's work on stored tasks, without Prefect: read, distill, one transaction of rows."""
    env = ParityEnv()
    tasks = env.sample_tasks("train", cfg.generate.tasks_per_round, round_no)
    prefix, tools = prompt_setup(cfg)
    (method,) = enabled_methods(cfg)
    with Store(cfg.run.store) as store:
        with store.step(cfg.run.name, round_no, "generate") as tx:
            tx.insert("tasks", [t.to_row() for t in tasks])
        ctx = DistillContext(cfg=cfg, round=round_no, champion="tiny-base", champion_path=str(tiny_path),
                             trajectories=[], prefix=prefix, tools=tools)
        inputs = method.read(store, ctx)
    out = method.distill(ctx, inputs)
    with Store(cfg.run.store) as store, store.step(cfg.run.name, round_no, "distill") as tx:
        tx.insert("examples", out.examples)
        for table, rows in out.tables.items():
            tx.insert(table, rows)
        tx.metrics({"mass": out.metrics})
    return method, out, prefix


def test_oracle_search_teacher_collection_and_bare_sft_data(tmp_path, tiny_path):
    cfg = config(tmp_path, "distill.mass.judge=oracle", "distill.mass.proposer=mutation", "distill.mass.versions=4",
                 "distill.mass.search_tasks=4", "distill.mass.episodes_per_task=4", "distill.mass.opponents=2")
    method, out, prefix = distill(cfg, tiny_path)
    m = out.metrics
    wf = {w["workflow_id"]: w for w in out.tables["mass_workflows"]}
    assert len(wf) == 5 and wf["tiny/r1/mass/reference"]["version"] == -1
    assert [w["proposer"] for w in wf.values() if w["version"] >= 0] == ["seed", "mutation", "mutation", "mutation"]
    # a version is accepted only if it beat the reference and the champion of its time (oracle: by the verifier)
    champion = "tiny/r1/mass/reference"
    for k in range(4):
        w = wf[f"tiny/r1/mass/v{k}"]
        assert w["parent_id"] == champion and w["diff"]
        beats = w["win_vs_reference"] > 0.5 and (w["win_vs_champion"] is None or w["win_vs_champion"] > 0.5)
        assert w["accepted"] == beats
        if beats:
            champion = w["workflow_id"]
    assert [w["workflow_id"] for w in wf.values() if w["retained"]] == [champion]
    # the oracle's verdicts are the verifier's, in both orders
    for v in out.tables["mass_verdicts"]:
        assert v["judge"] == "oracle" and v["judge_model_id"] is None
        expect = 0.5 if v["verifier_x"] == v["verifier_y"] else float(v["verifier_x"])
        assert v["score"] == expect
    if champion == "tiny/r1/mass/reference":
        assert not out.examples and not m["collected"]
        pytest.skip("no version beat the reference with this seed: nothing collected (checked above)")
    # teacher collection: K episodes per task, each ranked; top -> train, next -> validation
    ranks = out.tables["mass_rankings"]
    assert len(ranks) == 4 * 4 and all(r["games"] == 2 for r in ranks)
    by_task = {}
    for r in ranks:
        by_task.setdefault(r["task_id"], []).append(r)
    for rows in by_task.values():
        rows.sort(key=lambda r: r["rank"])
        assert [r["rank"] for r in rows] == [1, 2, 3, 4]
        assert [r["bt_score"] for r in rows] == sorted((r["bt_score"] for r in rows), reverse=True)
    assert m["examples"] == sum(e["meta"]["split"] == "train" for e in out.examples) > 0
    episodes = {e["episode_id"]: e for e in out.tables["mass_episodes"]}
    for e in out.examples:
        ep = episodes[e["source_traj_id"]]
        assert ep["purpose"] == "teacher" and ep["workflow_id"] == champion
        # the bare task prompt and the workflow's final answer, never a hop's note or a contract
        assert e["messages"][:len(prefix)] == prefix and len(e["messages"]) == len(prefix) + 2
        assert e["messages"][-1] == {"role": "assistant", "content": ep["final_text"]}
        assert "Note from the" not in e["messages"][-2]["content"] and e["messages"][-2]["content"].endswith(
            "Your action:")
        assert len(ep["hops"]) == len(wf[champion]["spec"]["hops"])
    rows = method.training_rows(None, "tiny", 1, [{**e, "meta": e["meta"]} for e in out.examples])
    assert [bool(r.get("validation")) for r in rows] == [e["meta"]["split"] == "validation" for e in out.examples]


def test_single_agent_control_has_no_search_and_keeps_the_token_budget(tmp_path, tiny_path):
    cfg = config(tmp_path, "distill.mass.judge=oracle", "distill.mass.teacher=single_agent",
                 "distill.mass.episodes_per_task=4", "distill.mass.opponents=2", "distill.mass.train_top=2",
                 "distill.mass.max_train_tokens=20")
    _, out, _ = distill(cfg, tiny_path)
    assert [w["proposer"] for w in out.tables["mass_workflows"]] == ["reference"]
    assert {e["purpose"] for e in out.tables["mass_episodes"]} == {"teacher"}
    train = [e for e in out.examples if e["meta"]["split"] == "train"]
    assert train and sum(e["meta"]["final_tokens"] for e in train) <= 20
    assert out.metrics["train_answer_tokens"] == sum(e["meta"]["final_tokens"] for e in train)
    # the budget is spent rank by rank: no rank-2 example while a rank-1 example that fits is left out
    used = {r["episode_id"] for r in out.tables["mass_rankings"] if r["split"] == "train"}
    assert used == {e["source_traj_id"] for e in train}


def test_self_judge_on_explain_and_assessment(tmp_path, tiny_path):
    cfg = load_config([TINY], [f"run.store={tmp_path / 'store.duckdb'}", f"run.run_dir={tmp_path / 'run'}",
                               "env.name=explain", "env.kwargs={}", "env.max_turns=2", "env.show_admissible=false",
                               "env.project_actions=false", "distill.methods=[mass]", "generate.tasks_per_round=2",
                               "distill.mass.versions=2", "distill.mass.search_tasks=2",
                               "distill.mass.episodes_per_task=2", "distill.mass.opponents=1",
                               "distill.mass.assess_tasks=3"])
    (method,) = enabled_methods(cfg)
    from rsiflow.envs.explain import ExplainEnv

    tasks = ExplainEnv().sample_tasks("train", 2, 1)
    prefix, tools = prompt_setup(cfg)
    with Store(cfg.run.store) as store:
        with store.step("tiny", 1, "generate") as tx:
            tx.insert("tasks", [t.to_row() for t in tasks])
        ctx = DistillContext(cfg=cfg, round=1, champion="tiny-base", champion_path=str(tiny_path), trajectories=[],
                             prefix=prefix, tools=tools)
        inputs = method.read(store, ctx)
    out = method.distill(ctx, inputs)
    # no verifier: every episode's success is unknown, the model judged, and no agreement can be measured
    assert all(e["success"] is None for e in out.tables["mass_episodes"])
    assert out.tables["mass_verdicts"] and all(v["judge"] == "self" and v["judge_model_id"] == "tiny-base"
                                               for v in out.tables["mass_verdicts"])
    assert all(v["raw_xy"] is not None and v["verdict_xy"] in ("A", "B", "tie", "invalid")
               for v in out.tables["mass_verdicts"])
    assert out.metrics["judge_agreement"] is None
    heldout = ExplainEnv().sample_tasks("heldout", 4, 0)
    a = method.assess(AssessContext(cfg=cfg, round=1, candidate="cand", candidate_path=str(tiny_path),
                                    champion="tiny-base", champion_path=str(tiny_path), base="tiny-base",
                                    base_path=str(tiny_path), heldout=heldout))
    assert a.metrics["assess_n"] == 3 and 0 <= a.metrics["win_vs_base"] <= 1
    assert "verifier_win_vs_base" not in a.metrics
    eps = a.tables["mass_episodes"]
    assert [e["model_id"] for e in eps] == ["cand"] * 3 + ["tiny-base"] * 3
    # the same checkpoint, greedy, plays both sides: the same answers, so a consistent judge can only tie
    assert [e["final_text"] for e in eps[:3]] == [e["final_text"] for e in eps[3:]]
    for v in a.tables["mass_verdicts"]:
        assert v["purpose"] == "assess" and v["x_episode_id"].startswith("tiny/r1/mass/assess/candidate/")


def test_oracle_judge_needs_a_verifier():
    with pytest.raises(ConfigError, match="distill.mass.judge"):
        enabled_methods(load_config([TINY], ["env.name=explain", "env.kwargs={}", "distill.methods=[mass]",
                                             "distill.mass.judge=oracle"]))


@pytest.mark.parametrize("override,key", [("distill.mass.opponents=6", "opponents"),
                                          ("distill.mass.train_top=6", "train_top")])
def test_ring_settings_are_checked(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config([TINY], [override])


def test_trainer_keeps_the_lowest_validation_loss_checkpoint(tmp_path, tiny_path):
    from rsiflow.models.trainer import train_candidate

    cfg = load_config([TINY], ["train.epochs=3", "train.learning_rate=5e-2", "train.batch_size=2"]).train
    convo = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi there friend"}]
    other = [{"role": "user", "content": "Say bye."}, {"role": "assistant", "content": "completely different words"}]
    rows = [{"kind": "sft", "example_id": f"t{i}", "messages": convo, "weight": 1.0, "train_from": 0}
            for i in range(4)]
    rows.append({"kind": "sft", "example_id": "v0", "messages": other, "weight": 1.0, "train_from": 0,
                 "validation": True})
    metrics, used = train_candidate(tiny_path, rows, tmp_path / "out", cfg, seed=0)
    assert "v0" not in used and len(used) == 4 and metrics["validation_examples"] == 1
    losses = metrics["validation_losses"]
    assert len(losses) == 3 and metrics["validation_loss_best"] == min(losses)
    assert metrics["validation_best_epoch"] == losses.index(min(losses)) + 1
    # the saved checkpoint is the best epoch's: its validation loss is the best one
    from rsiflow.models.callbacks import BestValidationCallback
    from rsiflow.models.encoding import encode_rows
    from rsiflow.models.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(tmp_path / "out")
    enc, _ = encode_rows(tok, [rows[-1]], 512)
    assert BestValidationCallback(enc, tok.pad_token_id, 2).loss(model) == pytest.approx(min(losses), rel=1e-4)
    assert json.dumps(metrics)   # stored as JSON with the model


def test_report_section_shows_the_figures_with_intervals():
    from rsiflow.methods.mass.method import MASS

    m = {"teacher": "workflow", "retained_hops": "analyst -> solver", "collected": True, "accepted": 1, "versions": 4,
         "judge": "self", "judge_agreement": 0.5, "examples": 8, "validation_examples": 8, "train_answer_tokens": 120,
         "validation_loss_best": 1.234, "win_vs_base": 0.625, "win_vs_base_low": 0.43, "win_vs_base_high": 0.79,
         "verifier_win_vs_base": 0.5, "verifier_win_vs_base_low": 0.31, "verifier_win_vs_base_high": 0.69,
         "assess_agreement": 0.25, "candidate_tokens": 12.5, "base_tokens": 14.0, "win_per_1k_tokens": 50.0,
         "success_per_1k_tokens": 10.0, "retained_spec": '{"hops": ["analyst", "solver"]}'}
    none = {"teacher": "workflow", "retained_hops": "solver", "collected": False, "accepted": 0, "versions": 4}
    lines = MASS.report_section([{"round": 1, "mass": m}, {"round": 2, "mass": none}, {"round": 3}])
    text = "\n".join(lines)
    assert "| 1 | workflow | analyst -> solver | 1/4 | self (0.50) | 8 (8) / 120 | 1.234 | 0.625 [0.43, 0.79] | " \
           "0.500 [0.31, 0.69] | 0.25 | 12.5/14.0 | 50.0 (10.0) |" in text
    assert "| 2 | workflow | solver (none beat the reference) | 0/4 |" in text and "| 3 |" not in text
    assert "Retained workflow of round 2" not in text and MASS.report_section([{"round": 1}]) == []


def test_a_model_proposal_that_is_no_spec_becomes_a_recorded_mutation(tmp_path, tiny_path):
    cfg = config(tmp_path, "distill.mass.judge=oracle", "distill.mass.proposer=model", "distill.mass.versions=2",
                 "distill.mass.search_tasks=2", "distill.mass.proposal_max_tokens=16")
    _, out, _ = distill(cfg, tiny_path)
    (v1,) = [w for w in out.tables["mass_workflows"] if w["version"] == 1]
    # the tiny random model writes no JSON spec: the mutation operator proposed instead, and says so
    assert v1["proposer"] == "mutation-after-invalid-proposal" and "(model: proposal:" in v1["proposal"]
    assert out.metrics["proposers"] == {"mutation-after-invalid-proposal": 1, "seed": 1}


def test_tooluse_calc_answers_are_verified_and_examples_carry_the_tools(tmp_path, tiny_path):
    from rsiflow.envs.tooluse import ToolUseEnv

    cfg = load_config([TINY], [f"run.store={tmp_path / 'store.duckdb'}", f"run.run_dir={tmp_path / 'run'}",
                               "env.name=tooluse", "env.kwargs={task_types: [calc], max_steps: 6}", "env.max_turns=6",
                               "env.show_admissible=false", "env.project_actions=false", "distill.methods=[mass]",
                               "distill.mass.judge=oracle", "distill.mass.teacher=single_agent",
                               "distill.mass.episodes_per_task=2", "distill.mass.opponents=1"])
    (method,) = enabled_methods(cfg)
    tasks = ToolUseEnv(task_types=["calc"]).sample_tasks("train", 2, 1)
    prefix, tools = prompt_setup(cfg)
    assert tools
    with Store(cfg.run.store) as store:
        with store.step("tiny", 1, "generate") as tx:
            tx.insert("tasks", [t.to_row() for t in tasks])
        ctx = DistillContext(cfg=cfg, round=1, champion="tiny-base", champion_path=str(tiny_path), trajectories=[],
                             prefix=prefix, tools=tools)
        inputs = method.read(store, ctx)
    out = method.distill(ctx, inputs)
    assert all(e["success"] is False for e in out.tables["mass_episodes"])   # verified (the tiny model can't answer)
    assert out.examples and all(e["meta"]["tools"] == tools for e in out.examples)
    assert out.metrics["judge_agreement"] is None          # the oracle judged: no model verdict to score
