"""The real training path can memorise one small batch: train_candidate on 8 SFT rows at a high learning rate drives
the loss to ~0, the saved checkpoint answers every row's question with its trained answer (greedy), and the
logprob_change diagnostic sees the trained tokens' logprob rise.

Measured (2 CPU cores, ~30 s): loss 14.0 -> 0.0008 over the 100 steps, the same on 1 and 2 threads; at 60 steps the
loss stalls near 0.028 with 2 + 5 answered 'Answer: 9', at 80 it is 0.003 with every answer right.
Checked to fail without what it tests: at learning rate 1e-6 (5 epochs) the loss stays at 13.97, delta is 0.04 and
the generations are noise; without the logprob_change metric the lookup fails (KeyError)."""

import pytest

from rsiflow.configs.schema import TrainConfig
from rsiflow.envs.rollout import ACTION_STOP
from rsiflow.models.backend import SamplingParams
from rsiflow.models.hf_backend import HFBackend
from rsiflow.models.trainer import train_candidate

SYSTEM = {"role": "system", "content": "You are a calculator. Reply with the answer only."}
PAIRS = [(3, 4), (2, 5), (6, 1), (8, 9), (4, 4), (7, 2), (5, 6), (9, 3)]


def conversation(a: int, b: int) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"Answer: {a + b}"}]


def test_train_candidate_overfits_one_batch_and_the_checkpoint_answers_it(tiny_path, tmp_path):
    rows = [{"kind": "sft", "example_id": f"add-{a}-{b}", "messages": conversation(a, b), "train_from": 2,
             "weight": 1.0} for a, b in PAIRS]
    cfg = TrainConfig(learning_rate=3e-3, epochs=100, batch_size=8, warmup_ratio=0.0, lr_scheduler="constant")
    metrics, used = train_candidate(tiny_path, rows, tmp_path / "cand", cfg, seed=0)
    assert sorted(used) == sorted(r["example_id"] for r in rows)
    assert metrics["steps"] == 100 and metrics["first_loss"] > 5.0      # a random model: ~ln(vocab) at the start
    assert metrics["last_loss"] < 0.05
    change = metrics["logprob_change"]
    assert set(change) == {"positive"} and change["positive"]["rows"] == 8
    assert change["positive"]["tokens"] == metrics["trained_tokens"]  # every labelled token is scored
    # before = the parent's token-mean logprob of the trained tokens = minus the first step's loss (same tokens)
    assert change["positive"]["before"] == pytest.approx(-metrics["first_loss"], rel=1e-4)
    assert change["positive"]["delta"] > 10.0 and change["positive"]["after"] > -0.05

    backend = HFBackend(tmp_path / "cand")
    gens = backend.generate([conversation(a, b)[:-1] for a, b in PAIRS],
                            SamplingParams(max_new_tokens=12, temperature=0.0, stop=ACTION_STOP))
    assert [g.text for g in gens] == [f"Answer: {a + b}" for a, b in PAIRS]
