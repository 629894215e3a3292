"""GRPO on stored rows moves the trained tokens' logprob by the sign of their advantage (the logprob_change
diagnostic), and the β-KL reference can be another checkpoint than the champion (train_candidate's reference_path).

Measured (2 CPU cores): positive delta +0.72 (-13.07 -> -12.34), negative delta -2.97 (-13.18 -> -16.15); the first
micro-batch's KL to tiny:1 at temperature 0.7: 353.84 logged, 353.84 by hand (25.6 at temperature 1).
Checked to fail without what it tests: grouping by the wrong sign gives the positive group delta -2.97; with the
reference path ignored the reference is π_old and the first micro-batch's KL is 0 (the third test measures exactly
that with reference "champion"), not 353.8; scored at temperature 1 instead of the trainer's it would be 25.6."""

import math

import pytest
import torch

from rsiflow.configs.schema import TrainConfig
from rsiflow.models.collate import encode_pg_rows
from rsiflow.models.grpo_trainer import PolicyLoss
from rsiflow.models.loading import load_model_and_tokenizer, resolve_base_model
from rsiflow.models.trainer import train_candidate

SYSTEM = {"role": "system", "content": "You are in a house. Reply with one action."}
EPISODES = [  # (task, first action, observation, second action)
    ("find an apple", "open fridge 1", "You see an apple.", "take apple from fridge 1"),
    ("find a mug", "go to cabinet 2", "You see a mug.", "take mug from cabinet 2"),
    ("find a book", "go to shelf 1", "You see a book.", "take book from shelf 1"),
    ("find a pen", "open drawer 3", "You see a pen.", "take pen from drawer 3"),
    ("heat the soup", "go to stove 1", "The stove is off.", "turn on stove 1"),
    ("wash the cup", "go to sink 1", "The sink is empty.", "put cup in sink 1"),
    ("light the room", "go to lamp 2", "The lamp is off.", "turn on lamp 2"),
    ("cool the milk", "open freezer 1", "The freezer is cold.", "put milk in freezer 1"),
]


def pg_rows(advantages: list[float]) -> list[dict]:
    rows = []
    for i, ((task, a1, obs, a2), adv) in enumerate(zip(EPISODES, advantages)):
        messages = [SYSTEM, {"role": "user", "content": f"Your task: {task}."},
                    {"role": "assistant", "content": a1}, {"role": "user", "content": obs},
                    {"role": "assistant", "content": a2}]
        rows.append({"kind": "pg", "example_id": f"e{i}", "messages": messages, "train_from": 2, "advantage": adv})
    return rows


def test_grpo_raises_positive_and_lowers_negative_advantage_tokens(tiny_path, tmp_path):
    rows = pg_rows([1.0, -1.0] * 4)
    cfg = TrainConfig(learning_rate=3e-3, epochs=1, batch_size=4, warmup_ratio=0.0, lr_scheduler="constant")
    metrics, used = train_candidate(tiny_path, rows, tmp_path / "cand", cfg, policy=PolicyLoss(passes=4))
    assert metrics["pg_rows"] == 8 and metrics["steps"] == 8
    change = metrics["logprob_change"]
    assert set(change) == {"positive", "negative"}
    assert change["positive"]["rows"] == change["negative"]["rows"] == 4
    assert change["positive"]["tokens"] + change["negative"]["tokens"] == metrics["pg_tokens"]
    for group in change.values():   # the parent is a random model: its tokens are all unlikely
        assert group["before"] < -math.log(49152) / 2
        assert group["delta"] == pytest.approx(group["after"] - group["before"])
    assert change["positive"]["delta"] > 0.2
    assert change["negative"]["delta"] < -0.5


def _hand_kl(policy_path, reference_path, rows: list[dict], temperature: float) -> float:
    """TRL's token-mean k3 estimate of KL(π ‖ π_ref), exp(r - p) - (r - p) - 1 with r, p the logprobs (logits divided
    by `temperature`) of the action tokens, computed here from plain forward passes of both checkpoints."""
    policy, tok = load_model_and_tokenizer(policy_path)
    ref, _ = load_model_and_tokenizer(reference_path)
    encoded, _ = encode_pg_rows(tok, rows, 4096)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for r in encoded:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            pos = torch.tensor([len(r["prompt_ids"]) + j for j, m in enumerate(r["action_mask"]) if m])
            p, q = (torch.log_softmax(m(input_ids=ids).logits[0, pos - 1].float() / temperature, -1)
                    .gather(-1, ids[0, pos][:, None]).squeeze(-1) for m in (policy, ref))
            total += float((torch.exp(q - p) - (q - p) - 1).sum())
            tokens += len(pos)
    return total / tokens


def test_the_kl_reference_is_the_reference_path_model(tiny_path, model_cache, tmp_path):
    other = resolve_base_model("tiny:1", model_cache)   # another random model: far from the champion
    rows = pg_rows([1.0, -1.0] * 4)
    cfg = TrainConfig(learning_rate=1e-3, epochs=1, batch_size=8, warmup_ratio=0.0, lr_scheduler="constant")
    policy = PolicyLoss(beta=0.1, reference="base", temperature=0.7)
    metrics, _ = train_candidate(tiny_path, rows, tmp_path / "cand", cfg, policy=policy, reference_path=other)
    # one micro-batch holds every row; its KL is taken at π = the champion's weights (before the first update)
    first = metrics["pg_steps_log"][0]["kl"]
    assert first == pytest.approx(_hand_kl(tiny_path, other, rows, 0.7), rel=1e-3)
    assert first > 0.1 and metrics["reference"] == "base" and metrics["kl_mean"] is not None


def test_the_champion_reference_ignores_the_path_and_base_needs_one(tiny_path, model_cache, tmp_path):
    other = resolve_base_model("tiny:1", model_cache)
    rows = pg_rows([1.0, -1.0])
    cfg = TrainConfig(learning_rate=1e-3, epochs=1, batch_size=2, warmup_ratio=0.0, lr_scheduler="constant")
    metrics, _ = train_candidate(tiny_path, rows, tmp_path / "cand", cfg, policy=PolicyLoss(beta=0.1),
                                 reference_path=other)
    assert metrics["pg_steps_log"][0]["kl"] == pytest.approx(0.0, abs=1e-6)   # π_ref = π_old = π at the first step
    with pytest.raises(ValueError, match="reference_path"):
        train_candidate(tiny_path, rows, tmp_path / "c2", cfg, policy=PolicyLoss(beta=0.1, reference="base"))
