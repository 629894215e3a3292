"""RSIPO in a round without Prefect: the tiny model plays a parity env (generate's work), RSIPO's read and distill
write skills, replays, tests and the library as the distill step writes them, its training rows train a candidate;
a second round retrieves, re-tests and (by the rule) retires library skills.

The tiny random model solves no real env, so the env here wins by the parity of the reply's length (even for one
task type, odd for the other): about half of all rollouts win, so gains and their noise are real numbers."""

import json
import math
from collections import defaultdict
from statistics import mean

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError
from rsiflow.envs.base import Env, StepResult, TaskSpec, sample_hashed_tasks, step_guard
from rsiflow.envs.rollout import Episode, env_factory, episode_rows, prompt_setup
from rsiflow.methods import DistillContext, enabled_methods
from rsiflow.methods.rsipo.algorithm import SKILL_HEADER, noise_variance
from rsiflow.models.backend import backend_for
from rsiflow.stores import Store
from rsiflow.tasks.common import play, trajectories_with_turns
from tests.conftest import TINY


class ParityEnv(Env):
    name = "parity"
    task_types = ("even", "odd")

    def __init__(self):
        self._task, self._done, self._success = None, False, False

    def sample_tasks(self, split: str, n: int, seed: int) -> list[TaskSpec]:
        return sample_hashed_tasks(self.name, self.task_types, split, n, seed,
                                   lambda task_type, rng: {"question": f"Parity {rng.randrange(10**9)}"})

    def reset(self, task: TaskSpec) -> str:
        self._task, self._done, self._success = task, False, False
        return f"{task.spec['question']}: reply with one line; a reply of {task.task_type} length wins."

    def step(self, action: str) -> StepResult:
        guard = step_guard(self._task, self._done, self._success)
        if guard:
            return guard
        self._done = True
        self._success = (len(action) % 2 == 0) == (self._task.task_type == "even")
        return StepResult("Done.", float(self._success), True, self._success, {"valid": True, "feedback": "ok"})

    def hindsight(self) -> list[str]:
        return [f"Replies of {self._task.task_type} length win."]

    def canonicalize(self, action: str) -> str:
        return "say<text>"

    def solution(self) -> list[str] | None:
        return ["ab"] if self._task.task_type == "even" else ["abc"]

    def instructions(self) -> str:
        return "Reply with one line of text."


def config(tmp_path, *overrides):
    return load_config([TINY], [f"run.store={tmp_path / 'store.duckdb'}", f"run.run_dir={tmp_path / 'run'}",
                                "env.name=tests.tasks.test_rsipo_method:ParityEnv", "env.kwargs={}",
                                "env.max_turns=1", "env.show_admissible=false", "env.project_actions=false",
                                "generate.tasks_per_round=6", "generate.group_size=4",
                                "distill.methods=[grpo,rsipo]", "distill.rsipo.replays=3", *overrides])


def generate(cfg, round_no, path):
    """The generate step's work, without Prefect."""
    env = env_factory(cfg)()
    specs = env.sample_tasks("train", cfg.generate.tasks_per_round, 100 + round_no)
    env.close()
    episodes = [Episode(traj_id=f"tiny/r{round_no}/gen/{i:04d}-{g:02d}", task=t,
                        group_id=f"tiny/r{round_no}/{t.task_id}", sample_idx=g)
                for i, t in enumerate(specs) for g in range(cfg.generate.group_size)]
    play(cfg, backend_for(cfg, path), episodes, cfg.backend.temperature, round_no, "generate")
    trajs, turns = episode_rows(episodes, "tiny/base", "train")
    with Store(cfg.run.store) as store, store.step("tiny", round_no, "generate") as tx:
        tx.insert("tasks", [t.to_row() for t in specs])
        tx.insert("trajectories", trajs)
        tx.insert("turns", turns)


def distill(cfg, round_no, path):
    """The distill step's work, without Prefect: every method's read, distill, and one transaction of rows."""
    methods = enabled_methods(cfg)
    prefix, tools = prompt_setup(cfg)
    with Store(cfg.run.store) as store:
        ctx = DistillContext(cfg=cfg, round=round_no, champion="tiny/base", champion_path=str(path),
                             trajectories=trajectories_with_turns(store, "tiny", round_no, "generate", prefix, tools),
                             prefix=prefix, tools=tools)
        inputs = {m.name: m.read(store, ctx) for m in methods}
    out = {m.name: m.distill(ctx, inputs[m.name]) for m in methods}
    with Store(cfg.run.store) as store, store.step("tiny", round_no, "distill") as tx:
        for m in methods:
            tx.insert("examples", [{**e, "method": e.get("method", m.name)} for e in out[m.name].examples])
            for table, rows in out[m.name].tables.items():
                tx.insert(table, rows)
        tx.metrics({name: c.metrics for name, c in out.items()})
    return out["rsipo"]


def test_a_round_of_skills_replays_trust_and_library(tmp_path, tiny_path):
    cfg = config(tmp_path)
    generate(cfg, 1, tiny_path)
    out = distill(cfg, 1, tiny_path)
    store = Store(cfg.run.store)
    q = store.rows

    # skills: one per task, written by the policy from its best rollout, its sampled tokens kept
    skills = q("SELECT s.*, t.reward AS src_reward FROM rsipo_skills s JOIN trajectories t ON t.traj_id ="
               " s.source_traj_id")
    assert len(skills) == 6 and {s["writer"] for s in skills} == {"policy"}
    for s in skills:
        assert s["model_id"] == "tiny/base" and s["token_ids"] and len(s["token_ids"]) == len(s["temp_logprobs"])
        best = q("SELECT max(reward) AS r FROM trajectories WHERE group_id = ? AND step = 'generate'",
                 [s["group_id"]])[0]["r"]
        assert s["src_reward"] == best
        assert s["usable"] == (s["reject_reason"] is None)

    # replays: M per test, same task and seed as the students, their own purpose, the skill in the task message
    tests = q("SELECT * FROM rsipo_tests ORDER BY test_id")
    usable = [s for s in skills if s["usable"]]
    assert len(tests) == len(usable) > 0 and {t["origin"] for t in tests} == {"new"}
    for t in tests:
        replays = q("SELECT r.task_id, r.purpose, r.step, r.reward, k.seed, u.observation FROM trajectories r"
                    " JOIN tasks k ON k.task_id = r.task_id AND k.step = 'generate'"
                    " JOIN turns u ON u.traj_id = r.traj_id AND u.turn_idx = 0"
                    " WHERE r.traj_id IN (SELECT unnest(replay_traj_ids) FROM rsipo_tests WHERE test_id = ?)",
                    [t["test_id"]])
        assert len(replays) == 3
        assert {(r["task_id"], r["seed"], r["purpose"], r["step"]) for r in replays} == {
            (t["task_id"], t["task_seed"], "replay", "distill")}
        skill = next(s for s in skills if s["skill_id"] == t["skill_id"])
        assert all(SKILL_HEADER in r["observation"] and skill["text"] in r["observation"] for r in replays)
        students = q("SELECT reward FROM trajectories WHERE group_id = ? AND step = 'generate' ORDER BY sample_idx",
                     [t["group_id"]])
        rs, rt = [s["reward"] for s in students], [r["reward"] for r in replays]
        assert t["gain"] == pytest.approx(mean(rt) - mean(rs))
        assert t["noise_var"] == pytest.approx(noise_variance(rs, rt))
    # the empirical-Bayes fit per task type, as docs/methods.md, RSIPO writes it
    by_type = defaultdict(list)
    for t in tests:
        by_type[t["task_type"]].append(t)
    for members in by_type.values():
        g = [t["gain"] for t in members]
        g_bar = mean(g)
        spread = sum((x - g_bar) ** 2 for x in g) / (len(g) - 1) if len(g) > 1 else 0.0
        tau2 = max(0.0, spread - mean(t["noise_var"] for t in members))
        for t in members:
            b = tau2 / (tau2 + t["noise_var"]) if tau2 > 0 else 0.0
            assert t["type_mean_gain"] == pytest.approx(g_bar) and t["tau2"] == pytest.approx(tau2)
            assert t["shrunk_gain"] == pytest.approx(g_bar + b * (t["gain"] - g_bar))
            assert t["weight"] == pytest.approx(min(max(t["shrunk_gain"] / 0.5, 0.0), 1.0))
            assert t["centred_gain"] == pytest.approx(t["gain"] - g_bar)

    # trust-weighted distillation: the selected skill in the teacher's prompt only, weighted by w > 0
    examples = q("SELECT example_id, weight, meta, source_traj_id FROM examples WHERE method = 'rsipo'")
    distill_rows = [e for e in examples if json.loads(e["meta"])["kind"] == "distill"]
    selected = [t for t in tests if t["selected"]]
    assert selected, "some skill should have earned trust (w > 0) on this seed"
    assert all(t["weight"] > 0 for t in selected) and len({t["task_id"] for t in selected}) == len(selected)
    assert len(distill_rows) == 4 * len(selected)
    for e in distill_rows:
        meta = json.loads(e["meta"])
        t = next(t for t in tests if t["test_id"] == meta["test_id"])
        assert t["selected"] and e["weight"] == t["weight"]
        (pair,) = q("SELECT * FROM foresight WHERE foresight_id = ?", [meta["foresight_id"]])
        assert pair["channel"] == "rsipo" and pair["source_traj_id"] == e["source_traj_id"]
        assert SKILL_HEADER in pair["teacher_messages"] and SKILL_HEADER not in pair["student_messages"]
    # skill evolution: one policy-gradient row per tested new skill, the centred gain as advantage
    evolution = [e for e in examples if json.loads(e["meta"])["kind"] == "evolution"]
    assert len(evolution) == len(tests)
    assert sorted(json.loads(e["meta"])["advantage"] for e in evolution) == pytest.approx(
        sorted(t["centred_gain"] for t in tests))

    # the library after round 1: every tested skill, with its test
    library = q("SELECT * FROM rsipo_library WHERE round = 1")
    assert {r["skill_id"] for r in library} == {t["skill_id"] for t in tests}
    assert all(r["n_tests"] == 1 and r["written_round"] == 1 for r in library)
    assert out.metrics["library_size"] == sum(r["status"] == "active" for r in library)

    # training: the rows train a candidate; distill rows and evolution rows are both trained
    from rsiflow.models.trainer import train_candidate
    from rsiflow.tasks.train import _policy_loss, distill_terms

    methods = enabled_methods(cfg)
    examples = [{**e, "meta": json.loads(e["meta"] or "{}")} for e in store.examples_dataset("tiny", 1)]
    rows = [r for m in methods for r in m.training_rows(store, "tiny", 1, [e for e in examples
                                                                           if e["method"] == m.name])]
    store.close()
    assert {r["kind"] for r in rows if r["example_id"].endswith(("/distill", "/evolution"))} == {"distill", "pg"}
    metrics, used = train_candidate(tiny_path, rows, tmp_path / "cand", cfg.train, distill=distill_terms(methods),
                                    policy=_policy_loss(methods))
    assert {e["example_id"] for e in distill_rows} <= set(used)
    assert metrics["distill_examples"] == len(distill_rows) and math.isfinite(metrics["distill_loss_mean"])
    nonzero = {e["example_id"] for e in evolution if json.loads(e["meta"])["advantage"] != 0.0}
    assert nonzero and nonzero <= set(used)

    # round 2: library skills of the task's type are retrieved and re-tested beside the new skills
    generate(cfg, 2, tiny_path)
    out2 = distill(cfg, 2, tiny_path)
    with Store(cfg.run.store) as store:
        lib_tests = store.rows("SELECT * FROM rsipo_tests WHERE round = 2 AND origin = 'library'")
        before = {r["skill_id"]: r for r in store.rows("SELECT * FROM rsipo_library WHERE round = 1")}
        after = {r["skill_id"]: r for r in store.rows("SELECT * FROM rsipo_library WHERE round = 2")}
    assert lib_tests and all(before[t["skill_id"]]["status"] == "active" and t["skill_round"] == 1
                             and before[t["skill_id"]]["task_type"] == t["task_type"] for t in lib_tests)
    assert set(before) <= set(after)
    for sid, r in after.items():
        tests_of = json.loads(r["tests"])
        assert r["n_tests"] == len(tests_of)
        if sid in before:
            assert r["n_tests"] == 1 + sum(t["skill_id"] == sid for t in lib_tests)
            streak = 0
            for t in reversed(tests_of):
                if t["shrunk"] > 0:
                    break
                streak += 1
            assert (r["status"] == "retired") == (streak >= 2 or before[sid]["status"] == "retired")
    assert out2.metrics["tests_library"] == len(lib_tests)


def test_the_template_writer_is_named_and_never_trains_skill_writing(tmp_path, tiny_path, caplog):
    cfg = config(tmp_path, "distill.rsipo.skill_writer=template", "distill.rsipo.library_candidates=0")
    generate(cfg, 1, tiny_path)
    with caplog.at_level("INFO"):
        out = distill(cfg, 1, tiny_path)
    assert "'template' writer" in caplog.text
    with Store(cfg.run.store) as store:
        skills = store.rows("SELECT s.skill_id, s.writer, s.template_source, s.model_id, s.text, s.usable,"
                            " bool_or(t.success) AS solved FROM rsipo_skills s JOIN trajectories t"
                            " ON t.group_id = s.group_id AND t.step = 'generate' GROUP BY ALL")
        kinds = {json.loads(m)["kind"] for (m,) in store.con.sql(
            "SELECT meta FROM examples WHERE method = 'rsipo'").fetchall()}
    assert len(skills) == 6 and all(s["writer"] == "template" and s["model_id"] is None and s["usable"]
                                    for s in skills)
    assert all(s["template_source"] == ("rollout" if s["solved"] else "expert") for s in skills)
    assert all("say <text>" in s["text"] for s in skills)
    assert "evolution" not in kinds and out.metrics["evolution_rows"] == 0 and out.metrics["writer"] == "template"


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="distill.methods"):
        enabled_methods(config(tmp_path, "distill.methods=[rsipo]"))
    with pytest.raises(ConfigError, match="generate.group_size"):
        enabled_methods(config(tmp_path, "generate.group_size=1"))
    with pytest.raises(ValueError, match="distill.rsipo.replays"):
        config(tmp_path, "distill.rsipo.replays=1")


def test_trust_weights_scale_the_distillation_term(tiny_path):
    """With normalise "rows" (RSIPO's), halving every row's weight halves the term; with "weights" (SRD's), the
    weights only move the term between rows."""
    import torch

    from rsiflow.models.collate import RowCollator
    from rsiflow.models.encoding import encode_rows
    from rsiflow.models.loading import load_model_and_tokenizer
    from rsiflow.models.sft_trainer import DistillLoss, RowLoss

    model, tok = load_model_and_tokenizer(tiny_path)
    student = [{"role": "user", "content": "Parity 1: reply."}, {"role": "assistant", "content": "hello there"}]
    teacher = [{"role": "user", "content": "Parity 1: reply.\n\nSkill: be brief."},
               {"role": "assistant", "content": "hello there"}]
    terms = {}
    for normalise in ("rows", "weights"):
        for w in (1.0, 0.5):
            enc, _ = encode_rows(tok, [{"kind": "distill", "example_id": "e", "student": student, "teacher": teacher,
                                        "train_from": 1, "weight": w}], 512)
            batch = RowCollator(pad_token_id=tok.pad_token_id)(enc)
            host = type("Host", (), {"ema_teacher": None})()
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"]).logits
                term, _ = RowLoss._distill_term(host, model, logits, batch["input_ids"], batch["weights"],
                                                torch.tensor([0]), batch, None, 0,
                                                DistillLoss(ema_rate=0.0, normalise=normalise))
            terms[normalise, w] = float(term)
    assert terms["rows", 1.0] > 0
    assert terms["rows", 0.5] == pytest.approx(terms["rows", 1.0] / 2)
    assert terms["weights", 0.5] == pytest.approx(terms["weights", 1.0])
    with pytest.raises(ValueError, match="normalise"):
        DistillLoss(normalise="tokens")


def test_on_household_the_teacher_sees_the_skill_where_the_replay_did(tmp_path, tiny_path):
    """The real env's task message (observation, admissible actions, "Your action:"): each replay's first message is
    the student's first message with the skill inserted by `with_skill`, the teacher's insertion."""
    from rsiflow.methods.rsipo.algorithm import skill_block, with_skill

    cfg = load_config([TINY], [f"run.store={tmp_path / 'store.duckdb'}", f"run.run_dir={tmp_path / 'run'}",
                               "distill.methods=[grpo,rsipo]", "distill.rsipo.skill_writer=template",
                               "distill.rsipo.replays=2", "env.max_turns=2"])
    generate(cfg, 1, tiny_path)
    distill(cfg, 1, tiny_path)
    with Store(cfg.run.store) as store:
        tests = store.rows("SELECT t.test_id, t.group_id, t.replay_traj_ids, s.text FROM rsipo_tests t"
                           " JOIN rsipo_skills s USING (skill_id)")
        first = {r["traj_id"]: r["observation"] for r in store.rows(
            "SELECT traj_id, observation FROM turns WHERE turn_idx = 0")}
        students = {r["group_id"]: r["traj_id"] for r in store.rows(
            "SELECT group_id, min(traj_id) AS traj_id FROM trajectories WHERE step = 'generate' GROUP BY 1")}
    assert len(tests) == 4
    for t in tests:
        student = first[students[t["group_id"]]]
        assert "Valid actions:" in student
        for rid in t["replay_traj_ids"]:
            assert first[rid] == with_skill(student, skill_block(t["text"]))
