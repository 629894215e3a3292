"""Training through `accelerate launch` (models/launch.py, models/train_worker.py).

Fast tier: the config keys and their errors, the launch command and the accelerate config it writes (read back by
accelerate's own parser), the shipped configs/accelerate/*.yaml, the refusals under sharded parameters.

Slow tier: the tiny model trained in this process with batch B and by 2 CPU processes (gloo) with batch B/2, on
the same rows and seed: the same global batches in the same order, so the per-step loss curves must agree within
LOSS_RTOL and the weights within WEIGHT_RTOL of how far training moved them (SFT rows with unequal weights; GRPO
rows). A crashing job fails with one line and the same job folder then trains. A tiny GRPO round with
train.processes=2 registers its candidate.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError, TrainConfig
from rsiflow.models.grpo_trainer import PolicyLoss
from rsiflow.models.launch import (
    LOG,
    LaunchError,
    _last_error,
    check_supported,
    launch_command,
    train_launched,
    uses_launcher,
)
from rsiflow.models.sft_trainer import DistillLoss
from rsiflow.models.trainer import train_candidate
from tests.conftest import REPO, TINY, tiny_overrides

# Measured here (2 CPU cores shared with a background job): loss curves SFT 1.2e-7, SFT+distillation+validation
# 2.4e-7, GRPO with riding rows 1.2e-6 (weights: see the README's accelerate part). The bounds leave room for other
# thread counts and BLAS builds; a wrong deal of the rows or a missing loss scale moves the curve by >1e-2.
LOSS_RTOL = 1e-4    # |loss_2 - loss_1| / max(1, |loss_1|) at every step
WEIGHT_RTOL = 1e-3  # ||w_2 - w_1|| / ||w_1 - w_parent|| over all weights; measured 8.9e-6 (SFT+distillation+
                    # validation), 3.6e-5 (GRPO with riding rows). Adam magnifies rounding where gradients are ~0, so
                    # single elements differ more (max |w_2 - w_1| / max |w_1 - w_parent|: 0.007, 0.036; printed)
ACCEL = REPO / "configs" / "accelerate"


# ---- fast tier -------------------------------------------------------------------------------------------


def test_defaults_train_in_process():
    cfg = TrainConfig()
    assert cfg.processes == 1 and cfg.accelerate_config is None and not uses_launcher(cfg)
    assert uses_launcher(TrainConfig(processes=2))
    assert uses_launcher(TrainConfig(accelerate_config=str(ACCEL / "ddp.yaml")))


def test_bad_values_name_the_key_and_source(tmp_path):
    with pytest.raises(ConfigError, match=r"--set train.processes=0: train.processes: .*greater than or equal to 1"):
        load_config([TINY], ["train.processes=0"])
    with pytest.raises(ConfigError, match=r"train.accelerate_config: file not found: .*nope.yaml"):
        load_config([TINY], [f"train.accelerate_config={tmp_path / 'nope.yaml'}"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config([TINY], [f"train.accelerate_config={bad}"])
    with pytest.raises(ConfigError, match=r"train.processes \(8\) differs from num_processes \(16\)"):
        load_config([TINY], [f"train.accelerate_config={ACCEL / 'multi-node-ddp.yaml'}", "train.processes=8"])
    with pytest.raises(ConfigError, match="main_process_port"):
        load_config([TINY], ["train.main_process_port=70000"])
    cfg = load_config([TINY], [f"train.accelerate_config={ACCEL / 'multi-node-ddp.yaml'}", "train.processes=16"])
    assert cfg.train.processes == 16


def test_launch_command_writes_an_accelerate_config_that_accelerate_reads(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    cmd = launch_command(TrainConfig(processes=2), tmp_path, port=12345, python="PY")
    assert cmd[:3] == ["PY", "-m", "accelerate.commands.launch"]
    assert cmd[cmd.index("--config_file") + 1] == str(tmp_path / "accelerate.yaml")
    assert cmd[cmd.index("--num_processes") + 1] == "2"
    assert cmd[cmd.index("--main_process_port") + 1] == "12345"
    assert cmd[-3:] == ["-m", "rsiflow.models.train_worker", str(tmp_path)]
    written = load_config_from_file(str(tmp_path / "accelerate.yaml"))
    assert written.distributed_type == "MULTI_GPU" and written.num_machines == 1 and written.num_processes == 2
    assert written.mixed_precision == "no"
    # train.main_process_port wins over the free port
    cmd = launch_command(TrainConfig(processes=2, main_process_port=29600), tmp_path, port=12345)
    assert cmd[cmd.index("--main_process_port") + 1] == "29600"


def test_a_given_accelerate_config_is_passed_and_its_port_kept(tmp_path):
    multi = TrainConfig(processes=16, accelerate_config=str(ACCEL / "multi-node-ddp.yaml"))
    cmd = launch_command(multi, tmp_path, port=12345)
    assert cmd[cmd.index("--config_file") + 1] == str((ACCEL / "multi-node-ddp.yaml").resolve())
    assert "--main_process_port" not in cmd  # the file's 29500 (every machine must use the same)
    assert not (tmp_path / "accelerate.yaml").exists()


@pytest.mark.parametrize("name", ["ddp.yaml", "fsdp.yaml", "deepspeed-zero2.yaml", "multi-node-ddp.yaml"])
def test_shipped_accelerate_configs_parse(name):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(ACCEL / name))
    assert loaded.compute_environment == "LOCAL_MACHINE"
    raw = yaml.safe_load((ACCEL / name).read_text())
    TrainConfig(processes=raw.get("num_processes", 8), accelerate_config=str(ACCEL / name))


def test_sharded_parameters_refuse_what_needs_whole_weights():
    fsdp = TrainConfig(processes=8, accelerate_config=str(ACCEL / "fsdp.yaml"))
    sft = [{"kind": "sft", "example_id": "a", "messages": []}]
    check_supported(fsdp, sft, None)  # plain SFT rows are fine
    with pytest.raises(ConfigError, match=r"train.accelerate_config .*FSDP.*validation rows"):
        check_supported(fsdp, sft + [{"kind": "sft", "validation": True}], None)
    with pytest.raises(ConfigError, match="EMA teacher"):
        check_supported(fsdp, [{"kind": "distill"}], DistillLoss(ema_rate=0.05))
    check_supported(fsdp, [{"kind": "distill"}], DistillLoss(ema_rate=0.0))
    with pytest.raises(ConfigError, match="train.lora.enabled"):
        check_supported(fsdp.model_copy(update={"lora": fsdp.lora.model_copy(update={"enabled": True})}), sft, None)
    # DDP and ZeRO-2 keep whole weights on every process: nothing refused
    for name in ("ddp.yaml", "deepspeed-zero2.yaml"):
        check_supported(TrainConfig(processes=8, accelerate_config=str(ACCEL / name)),
                        sft + [{"kind": "sft", "validation": True}], DistillLoss())


# ---- slow tier: real 2-process training on CPU (gloo) ----------------------------------------------------


def _weight_deviation(parent: Path, one: Path, two: Path) -> float:
    """||w_two - w_one|| over all weights, relative to how far training moved them (||w_one - w_parent||)."""
    from rsiflow.models.loading import load_model_and_tokenizer

    p, a, b = (load_model_and_tokenizer(x)[0].state_dict() for x in (parent, one, two))
    diff = sum(float(((a[k] - b[k]).double() ** 2).sum()) for k in a) ** 0.5
    moved = sum(float(((a[k] - p[k]).double() ** 2).sum()) for k in a) ** 0.5
    peak = max(float((a[k] - b[k]).abs().max()) for k in a) / max(float((a[k] - p[k]).abs().max()) for k in a)
    print(f"weights: ||difference|| {diff:.3g}, ||update|| {moved:.3g}: ratio {diff / moved:.3g} "
          f"(max element ratio {peak:.3g})")
    assert moved > 0
    return diff / moved


def _compare(one: dict, two: dict) -> float:
    """The largest deviation of the 2-process loss curve from the 1-process one, relative to the loss."""
    assert len(one["loss_curve"]) == len(two["loss_curve"]) == one["steps"] == two["steps"] > 1
    dev = max(abs(a - b) / max(1.0, abs(a)) for a, b in zip(one["loss_curve"], two["loss_curve"]))
    print(f"\nloss curves: 1 process {one['loss_curve']}\n             2 processes {two['loss_curve']}\n"
          f"max relative deviation {dev:.3g}")
    return dev


def test_a_failed_job_names_the_rank_that_failed_first(tmp_path):
    """The one-line reason: the oldest error-rank file, else the log's exception line, else the launcher's
    root-cause summary; never a rule line."""
    (tmp_path / LOG).write_text("$ accelerate launch ...\n[rank1]: RuntimeError: Connection closed by peer\n"
                                "=====\n")
    assert _last_error(tmp_path) == "[rank1]: RuntimeError: Connection closed by peer"
    (tmp_path / "error-rank0").write_text("rank 0: OSError: disk full\nTraceback ...\n")
    later = tmp_path / "error-rank1"
    later.write_text("rank 1: RuntimeError: Connection closed by peer\n")
    os.utime(later, (later.stat().st_mtime + 5,) * 2)
    assert _last_error(tmp_path) == "rank 0: OSError: disk full"
    for f in tmp_path.glob("error-rank*"):
        f.unlink()
    (tmp_path / LOG).write_text("$ accelerate launch ...\n" + "=" * 40 + "\nRoot Cause (first observed failure):\n"
                                "[0]:\n  time      : 2026-12-04_20:01:02\n  rank      : 1 (local_rank: 1)\n"
                                "  exitcode  : 1 (pid: 123)\n  error_file: <N/A>\n" + "=" * 40 + "\n")
    message = _last_error(tmp_path)
    assert "rank : 1" in message and "exitcode : 1" in message and "=" not in message.replace(" : ", "")


def _launched(job_dir, cfg, **kwargs):
    """train_launched for a job expected to succeed: on a failure the log's tail goes to the test's output."""
    try:
        return train_launched(job_dir, cfg, **kwargs)
    except LaunchError:
        print("".join((Path(job_dir) / LOG).read_text(errors="replace").splitlines(keepends=True)[-60:]))
        raise


@pytest.mark.slow
def test_sft_two_processes_match_one_and_a_crashed_job_fails_in_one_line(tiny_path, tmp_path):
    from tests.models.test_trainer_sft import expert_conversation

    rows = []
    for seed in range(8):  # unequal weights: the token-sum normaliser across processes is exercised
        msgs, tf = expert_conversation(seed, few_shot=False)
        rows.append({"example_id": f"e{seed}", "kind": "sft", "messages": msgs, "weight": 1.0 + 0.25 * (seed % 3),
                     "train_from": tf})
    job = tmp_path / "job"
    # a job that crashes (no parent checkpoint): one line with the exit code and the worker's exception
    with pytest.raises(LaunchError) as crash:
        train_launched(job, TrainConfig(processes=2), model_path=tmp_path / "missing", rows=rows,
                       out_dir=tmp_path / "bad", seed=7)
    message = str(crash.value)
    print("\ncrash:", message)
    assert "\n" not in message and "exited with 1" in message and "Error" in message and str(job) in message
    assert not (job / "result.json").exists() and not (tmp_path / "bad").exists()

    one, used_one = train_candidate(tiny_path, rows, tmp_path / "one", TrainConfig(learning_rate=3e-3, epochs=2,
                                                                                   batch_size=4), seed=7)
    progress = []
    two, used_two = _launched(job, TrainConfig(learning_rate=3e-3, epochs=2, batch_size=2, processes=2),
                                   on_step=lambda s, n: progress.append((s, n)), model_path=tiny_path, rows=rows,
                                   out_dir=tmp_path / "two", seed=7)  # the same job folder: a rerun starts clean
    assert sorted(used_one) == sorted(used_two) and one["trained_tokens"] == two["trained_tokens"]
    assert _compare(one, two) <= LOSS_RTOL
    assert _weight_deviation(tiny_path, tmp_path / "one", tmp_path / "two") <= WEIGHT_RTOL
    assert progress and progress[-1] == (two["steps"], two["steps"])
    assert "--num_processes 2" in (job / "launch.log").read_text().splitlines()[0]


@pytest.mark.slow
def test_sft_distillation_and_validation_rows_two_processes_match_one(tiny_path, tmp_path):
    """SRD-style privileged-teacher rows (EMA teacher) mixed with weighted SFT rows, plus MASS-style validation rows
    (best epoch restored): batches of each process hold different mixes, the normalisers are summed over them."""
    from tests.models.test_trainer_distill import _pair
    from tests.models.test_trainer_sft import expert_conversation

    student, teacher = _pair()
    rows = [{"example_id": f"d{i}", "kind": "distill", "student": student, "teacher": teacher, "train_from": 2,
             "weight": 0.5 + 0.5 * (i % 2)} for i in range(4)]
    for seed in range(4):
        msgs, tf = expert_conversation(seed, few_shot=False)
        rows.append({"example_id": f"s{seed}", "kind": "sft", "messages": msgs, "weight": 1.0 + 0.5 * (seed % 2),
                     "train_from": tf})
    for seed in (10, 11):
        msgs, tf = expert_conversation(seed, few_shot=False)
        rows.append({"example_id": f"v{seed}", "kind": "sft", "messages": msgs, "train_from": tf, "validation": True})
    distill = DistillLoss(loss_weight=1.0, ema_rate=0.05, top_k=16)
    one, used_one = train_candidate(tiny_path, rows, tmp_path / "one", TrainConfig(learning_rate=3e-3, epochs=2,
                                                                                   batch_size=4),
                                    seed=5, distill=distill)
    two, used_two = _launched(tmp_path / "job", TrainConfig(learning_rate=3e-3, epochs=2, batch_size=2,
                                                                 processes=2),
                                   model_path=tiny_path, rows=rows, out_dir=tmp_path / "two", seed=5, distill=distill)
    assert sorted(used_one) == sorted(used_two) and one["distill_examples"] == two["distill_examples"] == 4
    assert _compare(one, two) <= LOSS_RTOL
    assert one["ema_teacher"] and two["ema_teacher"]
    assert math.isclose(two["distill_loss_mean"], one["distill_loss_mean"], rel_tol=1e-3)
    assert two["validation_best_epoch"] == one["validation_best_epoch"]
    assert all(math.isclose(a, b, rel_tol=LOSS_RTOL) for a, b in zip(one["validation_losses"],
                                                                       two["validation_losses"]))
    print("distill loss mean", one["distill_loss_mean"], two["distill_loss_mean"], "validation",
          one["validation_losses"], two["validation_losses"])
    assert _weight_deviation(tiny_path, tmp_path / "one", tmp_path / "two") <= WEIGHT_RTOL


@pytest.mark.slow
def test_grpo_rows_with_riding_rows_two_processes_match_one(tiny_path, tmp_path):
    """GRPO rows with an SFT row and a distillation row riding along (current-weights teacher, ema_rate 0): the
    processes run different numbers of forward passes (one holds the aux rows of a slot, the other none)."""
    from tests.models.test_grpo_trainer import episodes, pg_rows
    from tests.models.test_trainer_distill import _pair

    played = episodes(tiny_path, n_tasks=3, group=2)
    student, teacher = _pair()
    rows = pg_rows(played) + [  # 6 pg rows, advantages +1/-1
        {"kind": "sft", "example_id": "s0", "messages": played[0].messages, "train_from": played[0].n_prefix},
        {"kind": "distill", "example_id": "d0", "student": student, "teacher": teacher, "train_from": 2,
         "weight": 1.0}]
    policy, distill = PolicyLoss(passes=2), DistillLoss(loss_weight=1.0, ema_rate=0.0, top_k=16)
    one, used_one = train_candidate(tiny_path, rows, tmp_path / "one",
                                    TrainConfig(learning_rate=1e-3, epochs=1, batch_size=2), seed=3, policy=policy,
                                    distill=distill)
    two, used_two = _launched(tmp_path / "job", TrainConfig(learning_rate=1e-3, epochs=1, batch_size=1,
                                                                 processes=2),
                                   model_path=tiny_path, rows=rows, out_dir=tmp_path / "two", seed=3, policy=policy,
                                   distill=distill)
    assert sorted(used_one) == sorted(used_two) and one["pg_rows"] == two["pg_rows"] == 6
    assert one["pg_tokens"] == two["pg_tokens"] and one["examples"] == two["examples"] == 1
    assert _compare(one, two) <= LOSS_RTOL
    # the processes' per-micro-batch logs merge into one entry per step: the action tokens of the whole step
    assert len(two["pg_steps_log"]) == two["steps"]
    assert sum(h["tokens"] for h in two["pg_steps_log"]) == sum(h["tokens"] for h in one["pg_steps_log"])
    assert math.isclose(two["pg_loss_mean"], one["pg_loss_mean"], rel_tol=1e-3, abs_tol=1e-6)
    assert math.isclose(two["distill_loss_mean"], one["distill_loss_mean"], rel_tol=1e-3)
    assert _weight_deviation(tiny_path, tmp_path / "one", tmp_path / "two") <= WEIGHT_RTOL


@pytest.mark.slow
def test_grpo_round_with_two_training_processes_registers_the_candidate(tmp_path, prefect_api):
    import duckdb

    from rsiflow.flows.round import improvement_round
    from rsiflow.models.loading import load_model_and_tokenizer

    overrides = tiny_overrides(tmp_path, "env.name=tests.flows.test_grpo_round:CoinEnv", "env.kwargs={}",
                               "env.max_turns=1", "env.show_admissible=false", "env.project_actions=false",
                               "generate.group_size=4", "distill.methods=[grpo]", "train.processes=2",
                               "train.batch_size=2")
    result = improvement_round([TINY], overrides)
    assert result["round"] == 1
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    path, metrics = con.execute("SELECT path, train_metrics FROM models WHERE role != 'base' AND model_id LIKE "
                                "'%/r1/candidate'").fetchone()
    metrics = json.loads(metrics)
    assert metrics["steps"] >= 1 and metrics["pg_rows"] >= 1 and len(metrics["loss_curve"]) == metrics["steps"]
    n_inputs = con.execute("SELECT count(*) FROM train_inputs").fetchone()[0]
    assert n_inputs == metrics["pg_rows"]
    model, _ = load_model_and_tokenizer(path)  # the candidate rank 0 saved loads
    assert all(torch.isfinite(p).all() for p in model.parameters())
    log = next((tmp_path / "runs").glob("*/launch/round-1/launch.log"))
    assert "--num_processes 2" in log.read_text().splitlines()[0]
