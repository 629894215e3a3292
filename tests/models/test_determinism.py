"""train_candidate is reproducible: the same rows, seed and config (fresh output folders) give the same loss curve and
bit-identical saved weights, for the SFT trainer and for GRPO on stored rows (with SFT rows riding along).

Checked to fail without what it tests: each test also trains once with another seed (another shuffling of the rows
into micro-batches) and asserts that run's loss curve and weights differ, so the comparisons are not vacuous (they
would pass trivially if, e.g., nothing were trained or the curve were not recorded)."""

from safetensors.torch import load_file

from rsiflow.configs.schema import TrainConfig
from rsiflow.models.grpo_trainer import PolicyLoss
from rsiflow.models.trainer import train_candidate
from tests.models.test_logprob_change import pg_rows
from tests.models.test_overfit import PAIRS, conversation


def weights(path):
    return load_file(str(path / "model.safetensors"))


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and bool((a[k] == b[k]).all()) for k in a)


def sft_rows(n: int) -> list[dict]:
    return [{"kind": "sft", "example_id": f"add-{a}-{b}", "messages": conversation(a, b), "train_from": 2,
             "weight": 1.0 if i % 3 else 0.5} for i, (a, b) in enumerate(PAIRS[:n])]


def run_twice_and_once_more(tiny_path, tmp_path, rows, cfg, **kwargs):
    runs = [train_candidate(tiny_path, rows, tmp_path / name, cfg, seed=seed, **kwargs)[0]
            for name, seed in (("a", 0), ("b", 0), ("other-seed", 1))]
    return runs, [weights(tmp_path / name) for name in ("a", "b", "other-seed")]


def test_sft_training_is_deterministic(tiny_path, tmp_path):
    cfg = TrainConfig(learning_rate=1e-3, epochs=2, batch_size=2, warmup_ratio=0.0, lr_scheduler="constant")
    (one, two, other), (w1, w2, w3) = run_twice_and_once_more(tiny_path, tmp_path, sft_rows(6), cfg)
    assert one["steps"] == 6 and len(one["loss_curve"]) == 6
    assert one["loss_curve"] == two["loss_curve"] and one["train_loss"] == two["train_loss"]
    assert one["logprob_change"] == two["logprob_change"]
    assert same_weights(w1, w2)
    assert other["loss_curve"] != one["loss_curve"] and not same_weights(w1, w3)


def test_grpo_training_is_deterministic(tiny_path, tmp_path):
    rows = pg_rows([1.0, -1.0, 0.5, -0.5] * 2) + sft_rows(2)
    cfg = TrainConfig(learning_rate=1e-3, epochs=1, batch_size=2, warmup_ratio=0.0, lr_scheduler="constant")
    (one, two, other), (w1, w2, w3) = run_twice_and_once_more(tiny_path, tmp_path, rows, cfg,
                                                              policy=PolicyLoss(passes=2))
    assert one["pg_rows"] == 8 and one["examples"] == 2 and one["steps"] == 8
    assert one["loss_curve"] == two["loss_curve"] and one["pg_steps_log"] == two["pg_steps_log"]
    assert one["logprob_change"] == two["logprob_change"]
    assert same_weights(w1, w2)
    assert other["loss_curve"] != one["loss_curve"] and not same_weights(w1, w3)
