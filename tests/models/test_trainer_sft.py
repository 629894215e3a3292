"""SFT glue: labels only on the episode's own action tokens; weighted loss; a real TRL training run."""

import math

import pytest
import torch
from transformers import AutoTokenizer

from rsiflow.configs.schema import TrainConfig
from rsiflow.envs import make_env
from rsiflow.envs.rollout import prompt_prefix, render_observation
from rsiflow.models.encoding import encode_rows, tokenize_conversation
from rsiflow.models.loading import load_model_and_tokenizer
from rsiflow.models.losses import weighted_token_ce
from rsiflow.models.trainer import train_candidate


def expert_conversation(seed: int, few_shot: bool = True):
    """A solved household episode by the scripted expert, as the runner would present it."""
    env = make_env("household")
    task = env.sample_tasks("train", 1, seed)[0]
    prefix = prompt_prefix(env, few_shot=few_shot)
    first = render_observation(env.reset(task), env.admissible_actions(), True)
    msgs = list(prefix) + [{"role": "user", "content": first}]
    while True:
        action = env.expert_action()
        res = env.step(action)
        msgs.append({"role": "assistant", "content": action})
        if res.done:
            assert res.success
            return msgs, len(prefix)
        msgs.append({"role": "user", "content": render_observation(res.observation, env.admissible_actions(), True)})


def labelled_spans(out: dict) -> list[list[int]]:
    """The runs of labelled tokens of an encoded row (each label equal to its input token)."""
    spans, cur = [], []
    for tid, lab in zip(out["input_ids"], out["labels"]):
        if lab != -100:
            assert lab == tid
            cur.append(tid)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


def test_labels_cover_exactly_the_episode_actions(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    msgs, train_from = expert_conversation(3)
    out = tokenize_conversation(tok, msgs, train_from)
    assert len(out["input_ids"]) == len(out["labels"])
    # contiguous labelled spans, decoded, are the actions each followed by the end-of-turn marker
    spans = labelled_spans(out)
    own_actions = [m["content"] for m in msgs[train_from:] if m["role"] == "assistant"]
    decoded = [tok.decode(s) for s in spans]
    assert [d.replace("<|im_end|>", "").strip() for d in decoded] == own_actions
    assert all("<|im_end|>" in d for d in decoded)           # the model learns to stop
    # the few-shot demonstration's actions are prompt, never labels
    demo = [m["content"] for m in msgs[:train_from] if m["role"] == "assistant"]
    assert demo and not set(demo) & set(decoded)
    everything = tokenize_conversation(tok, msgs, 0)
    assert sum(x != -100 for x in everything["labels"]) > sum(x != -100 for x in out["labels"])


def test_too_long_examples_are_dropped_and_counted(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    msgs, tf = expert_conversation(1)
    rows, counts = encode_rows(tok, [{"example_id": "a", "kind": "sft", "messages": msgs, "weight": 1.0,
                                      "train_from": tf}], 32)
    assert rows == [] and counts["too_long"] == counts["sft_too_long"] == 1


def test_weighted_loss_scales_with_example_weight(tiny_path):
    model, tok = load_model_and_tokenizer(tiny_path)
    msgs, tf = expert_conversation(2)
    ids = tokenize_conversation(tok, msgs, tf)
    batch = {"input_ids": torch.tensor([ids["input_ids"]]), "labels": torch.tensor([ids["labels"]]),
             "attention_mask": torch.ones(1, len(ids["input_ids"]), dtype=torch.long)}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    half = weighted_token_ce(logits, batch["labels"], torch.tensor([0.5]))
    full = weighted_token_ce(logits, batch["labels"], torch.tensor([2.0]))
    assert full.item() == pytest.approx(4 * half.item(), rel=1e-5)
    # weight 1 is the model's own token-mean cross-entropy (what TRL's loss would give)
    plain = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    weighted = weighted_token_ce(logits, batch["labels"], torch.tensor([1.0]))
    assert weighted.item() == pytest.approx(plain.item(), rel=1e-5)


def test_train_sft_learns_expert_actions(tiny_path, tmp_path):
    examples = []
    for seed in range(4):
        msgs, tf = expert_conversation(seed, few_shot=False)  # shorter rows; the same labelled actions
        examples.append({"example_id": f"e{seed}", "kind": "sft", "messages": msgs, "weight": 1.0, "train_from": tf})
    cfg = TrainConfig(learning_rate=3e-3, epochs=3, batch_size=2)
    metrics, used = train_candidate(tiny_path, examples, tmp_path / "cand", cfg, seed=0)
    assert sorted(used) == sorted(f"e{s}" for s in range(4))
    assert metrics["steps"] == 6 and metrics["trained_tokens"] > 0
    assert math.isfinite(metrics["train_loss"]) and metrics["last_loss"] < metrics["first_loss"]
    model, _ = load_model_and_tokenizer(tmp_path / "cand")      # a loadable full checkpoint
    assert sum(p.numel() for p in model.parameters()) > 0


def test_no_examples_gives_parent_copy(tiny_path, tmp_path):
    metrics, used = train_candidate(tiny_path, [], tmp_path / "cand", TrainConfig(), seed=0)
    assert metrics["examples"] == 0 and metrics["steps"] == 0 and used == []
    parent, _ = load_model_and_tokenizer(tiny_path)
    child, _ = load_model_and_tokenizer(tmp_path / "cand")
    assert all(torch.equal(a, b) for a, b in zip(parent.state_dict().values(), child.state_dict().values()))
