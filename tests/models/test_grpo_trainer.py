"""GRPO on stored rollouts: TRL's loss on our batches, the action-only gradient, the mismatch figures."""

import math

import pytest
import torch
from trl import GRPOTrainer

from rsiflow.configs.schema import TrainConfig
from rsiflow.envs.household import HouseholdEnv
from rsiflow.envs.rollout import Episode, run_episodes
from rsiflow.models.backend import SamplingParams
from rsiflow.models.collate import encode_pg_rows
from rsiflow.models.grpo_trainer import PolicyLoss, StoredRolloutGRPOTrainer, grpo_args
from rsiflow.models.hf_backend import HFBackend
from rsiflow.models.loading import load_model_and_tokenizer
from rsiflow.models.mismatch import Correction
from rsiflow.models.trainer import train_candidate

SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.95, seed=3)


def episodes(path, dtype="float32", n_tasks=2, group=2, turns=3):
    env = HouseholdEnv(n_receptacles=2, n_distractors=1)
    eps = [Episode(traj_id=f"t{i}-{g}", task=t, group_id=f"g{i}", sample_idx=g)
           for i, t in enumerate(env.sample_tasks("train", n_tasks, 0)) for g in range(group)]
    # no few-shot turns: shorter sequences, the same structure (prompt, then actions between observations)
    return run_episodes(lambda: HouseholdEnv(n_receptacles=2, n_distractors=1), eps, HFBackend(path, dtype=dtype),
                        SAMPLING, max_turns=turns, few_shot=False)


def pg_rows(eps, advantages=None):
    return [{"kind": "pg", "example_id": e.traj_id, "messages": e.messages, "train_from": e.n_prefix,
             "advantage": (advantages or {}).get(e.traj_id, 1.0 if i % 2 == 0 else -1.0),
             "sampled": [{"token_ids": t.token_ids, "temp_logprobs": t.temp_logprobs} for t in e.turns]}
            for i, e in enumerate(eps)]


@pytest.fixture(scope="module")
def played(tiny_path):
    return episodes(tiny_path)


def trainer_for(tiny_path, tmp_path, rows, policy=None, batch_size=4):
    policy = policy or PolicyLoss()
    model, tok = load_model_and_tokenizer(tiny_path)
    pg, counts = encode_pg_rows(tok, rows, 4096)
    cfg = TrainConfig(learning_rate=1e-3, epochs=1, batch_size=batch_size)
    args = grpo_args(cfg, policy, str(tmp_path / "t"), 0, len(pg), use_cpu=True, bf16=False)
    trainer = StoredRolloutGRPOTrainer(model=model, args=args, processing_class=tok,
                                       pg_rows=pg, aux_rows=[], policy=policy)
    return trainer, pg, counts


def test_encoding_splits_prompt_and_episode_and_attaches_sampled_logprobs(tiny_path, played):
    _, tok = load_model_and_tokenizer(tiny_path)
    rows, counts = encode_pg_rows(tok, pg_rows(played), 4096)
    assert len(rows) == len(played) and counts["sampled_turns"] == sum(len(e.turns) for e in played)
    # A turn's sampled logprobs attach where re-encoding the stored action reproduces the sampled ids (the runner
    # strips the text, and a random tiny model's tokens need not be the tokenizer's own split of their text).
    assert 0 < counts["sampled_match"] <= counts["sampled_turns"]
    for r, e in zip(rows, played):
        actions = [i for i, m in enumerate(r["action_mask"]) if m]
        known = [i for i, lp in enumerate(r["sample_logps"]) if not math.isnan(lp)]
        assert actions[0] == 0                                             # the completion starts at the first action
        assert set(known) <= set(actions) and len(known) <= sum(len(t.token_ids) for t in e.turns)
        assert len(actions) > len(known)                                   # end-of-turn markers: trained, not sampled
        assert sum(r["action_mask"]) < len(r["completion_ids"])            # observations are in the completion, masked
        for i in known:                                                    # the attached values are the sampler's
            assert r["sample_logps"][i] in {lp for t in e.turns for lp in t.temp_logprobs}


def test_the_loss_is_trls_and_equals_the_hand_value_at_the_old_policy(tiny_path, tmp_path, played):
    trainer, pg, _ = trainer_for(tiny_path, tmp_path, pg_rows(played), PolicyLoss(loss_type="dapo",
                                                                                 correction=Correction("none")))
    stats = trainer.prepare_old_policy()
    assert stats["tokens"] > 0
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    ours = trainer.compute_loss(trainer.model, {"pg": dict(batch["pg"])})
    trls = GRPOTrainer._compute_loss(trainer, trainer.model, dict(batch["pg"]))
    assert ours.item() == pytest.approx(trls.item(), rel=1e-6)
    # at π = π_old every ratio is 1 (inside the clip): dapo = -Σ_t A·mask / (action tokens of the step)
    b = batch["pg"]
    assert b["advantages"].shape == b["tool_mask"].shape                 # per-token advantages A·w (w = 1: none)
    hand = -(b["advantages"] * b["tool_mask"]).sum() / b["tool_mask"].sum()
    assert ours.item() == pytest.approx(hand.item(), abs=1e-4)


def test_observation_tokens_get_exactly_zero_gradient(tiny_path, tmp_path, played):
    trainer, pg, _ = trainer_for(tiny_path, tmp_path, pg_rows(played))
    trainer.prepare_old_policy()
    batch = next(iter(trainer.get_train_dataloader()))["pg"]
    kept = {}

    def keep_hidden(module, args, output):  # the final hidden states: position p only feeds the logits at p
        output.last_hidden_state.retain_grad()
        kept["hidden"] = output.last_hidden_state

    handle = trainer.model.model.register_forward_hook(keep_hidden)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.compute_loss(trainer.model, {"pg": dict(batch)}).backward()
    handle.remove()
    grad = kept["hidden"].grad                     # (B, prompt + completion, H); position p predicts token p + 1
    P = batch["prompt_ids"].size(1)
    predicts = grad[:, P - 1:-1].abs().sum(-1)     # the positions predicting each completion token
    action = batch["tool_mask"].bool()
    assert torch.all(predicts[~action] == 0)        # observations (and padding): exactly zero
    assert torch.all(predicts[action] > 0)
    assert torch.all(grad[:, :P - 1] == 0)          # the prompt too


def test_no_mismatch_when_sampler_and_trainer_are_the_same_fp32_model(tiny_path, tmp_path, played):
    trainer, _, _ = trainer_for(tiny_path, tmp_path, pg_rows(played), PolicyLoss(correction=Correction("tis")))
    stats = trainer.prepare_old_policy()
    assert stats["mean_abs_delta"] < 1e-4 and stats["capped_share"] == 0.0
    assert stats["weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_a_bfloat16_sampler_makes_a_measurable_mismatch(tiny_path, tmp_path):
    bf16 = episodes(tiny_path, dtype="bfloat16", n_tasks=1)
    trainer, _, counts = trainer_for(tiny_path, tmp_path, pg_rows(bf16), PolicyLoss(correction=Correction("tis")))
    stats = trainer.prepare_old_policy()
    assert stats["tokens"] > 0 and stats["mean_abs_delta"] > 1e-3


def test_train_candidate_with_pg_rows_skips_zero_advantages_and_moves_the_weights(tiny_path, tmp_path, played):
    advantages = {e.traj_id: a for e, a in zip(played, [1.0, -1.0, 0.0, 0.0])}
    sft = [{"kind": "sft", "example_id": "s0", "messages": played[0].messages, "train_from": played[0].n_prefix}]
    metrics, used = train_candidate(tiny_path, pg_rows(played, advantages) + sft, tmp_path / "cand",
                                    TrainConfig(learning_rate=1e-3, epochs=1, batch_size=2),
                                    policy=PolicyLoss(passes=2))
    assert metrics["pg_rows"] == 2 and metrics["pg_skipped_zero_advantage"] == 2 and metrics["examples"] == 1
    assert metrics["steps"] == 2 and math.isfinite(metrics["pg_loss_mean"]) and len(metrics["pg_steps_log"]) == 2
    assert sorted(used) == sorted([played[0].traj_id, played[1].traj_id, "s0"])
    assert metrics["mismatch_mean_abs_delta"] < 1e-4
    parent, _ = load_model_and_tokenizer(tiny_path)
    child, _ = load_model_and_tokenizer(tmp_path / "cand")
    assert any(not torch.equal(a, b) for a, b in zip(parent.parameters(), child.parameters()))
