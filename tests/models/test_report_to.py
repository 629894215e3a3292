"""train.report_to: TRL sends the training metrics to the configured tracker; TensorBoard's event files land in the
folder rsiflow names, and the trainer leaves no folder of its own beside the candidate."""

import pytest

from rsiflow.configs.schema import TrainConfig
from rsiflow.models.trainer import train_candidate
from tests.models.test_trainer_sft import expert_conversation


def _rows(n=4):
    rows = []
    for seed in range(n):
        msgs, train_from = expert_conversation(seed, few_shot=False)
        rows.append({"example_id": f"e{seed}", "kind": "sft", "messages": msgs, "train_from": train_from,
                     "weight": 1.0})
    return rows


def test_tensorboard_gets_the_training_metrics(tmp_path, tiny_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = TrainConfig(epochs=1, batch_size=2, learning_rate=1e-3, report_to=["tensorboard"])
    out, logs = tmp_path / "models" / "round-1-candidate", tmp_path / "tensorboard" / "round-1"
    metrics, used = train_candidate(tiny_path, _rows(), out, cfg, log_dir=logs, run_name="demo-round-1")
    assert metrics["steps"] == 2 and len(used) == 4
    events = EventAccumulator(str(logs))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["round-1-candidate"]  # no .trainer folder


def test_no_tracker_by_default_and_no_trainer_folder(tmp_path, tiny_path):
    out = tmp_path / "models" / "round-1-candidate"
    train_candidate(tiny_path, _rows(2), out, TrainConfig(epochs=1, batch_size=2, learning_rate=1e-3))
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_dir()) == ["models", "round-1-candidate"]
