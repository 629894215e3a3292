"""Encoding a batch's shared prefix once gives the plain forward's logits, logprobs and gradients (up to float
rounding), in both layouts the trainers use; and training with it follows the same loss curve."""

import torch

from rsiflow.models.loading import load_model_and_tokenizer
from rsiflow.models.shared_prefix import (
    MIN_SHARED_PREFIX,
    common_prefix,
    completion_logps,
    shared_prefix_length,
    shared_prefix_logits,
)

PREFIX = list(range(100, 100 + 2 * MIN_SHARED_PREFIX))      # 64 shared tokens (a few-shot prompt stands in)
OWN = [[7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21], [22, 23, 24, 25]]


def _right_padded(rows, pad=0):
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


def test_shared_prefix_logits_and_gradients_match_the_plain_forward(tiny_path):
    model, _ = load_model_and_tokenizer(tiny_path)
    model.train()
    ids, mask = _right_padded([PREFIX + own for own in OWN])
    first_scored = len(PREFIX) + 1
    plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    shared, offset = shared_prefix_logits(model, ids, mask, first_scored)
    assert offset == len(PREFIX) - 1 and shared.shape[1] == ids.shape[1] - offset
    real = mask[:, offset:].bool()
    torch.testing.assert_close(shared[real], plain[:, offset:][real], atol=2e-5, rtol=1e-4)

    def grads(logits, off):
        model.zero_grad()
        targets = ids[:, off + 1:].masked_fill(mask[:, off + 1:] == 0, -100)
        targets[:, :first_scored - off - 1] = -100
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    g_plain = grads(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, 0)
    g_shared = grads(shared_prefix_logits(model, ids, mask, first_scored)[0], offset)
    assert g_plain.keys() == g_shared.keys()
    for name in g_plain:
        torch.testing.assert_close(g_shared[name], g_plain[name], atol=1e-5, rtol=1e-3, msg=name)


def test_nothing_shared_below_the_minimum_or_with_one_row():
    ids, mask = _right_padded([PREFIX[:10] + own for own in OWN])
    assert common_prefix(ids, mask, 100) == 0
    ids, mask = _right_padded([PREFIX + OWN[0]])
    assert common_prefix(ids, mask, 100) == 0
    ids, mask = _right_padded([PREFIX + own for own in OWN])
    assert common_prefix(ids, mask, 40) == 40 and common_prefix(ids, mask, 1000) == len(PREFIX)


def test_shared_prefix_length_of_token_lists():
    rows = [PREFIX + own for own in OWN]
    assert shared_prefix_length(rows, 1000) == len(PREFIX) and shared_prefix_length(rows, 40) == 40
    assert shared_prefix_length([PREFIX + [1], PREFIX], 1000) == len(PREFIX)   # one row is all prefix
    assert shared_prefix_length([PREFIX[:10] + own for own in OWN], 1000) == 0
    assert shared_prefix_length(rows[:1], 1000) == 0


def test_completion_logps_match_the_plain_left_padded_forward(tiny_path):
    """TRL's GRPO layout: prompts (shared prefix + a question of its own length) left-padded, completions
    right-padded; the logprobs of the completion columns at temperature 0.7, and their entropies."""
    model, _ = load_model_and_tokenizer(tiny_path)
    prompts = [PREFIX + [30 + i] * (i + 1) for i in range(4)]
    completions = [[40, 41, 42], [43], [44, 45, 46, 47], [48, 49]]
    p_width, c_width = max(map(len, prompts)), max(map(len, completions))
    ids = torch.tensor([[0] * (p_width - len(p)) + p + c + [0] * (c_width - len(c))
                        for p, c in zip(prompts, completions)])
    mask = torch.tensor([[0] * (p_width - len(p)) + [1] * (len(p) + len(c)) + [0] * (c_width - len(c))
                         for p, c in zip(prompts, completions)])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -c_width - 1:-1] / 0.7
        logp = torch.log_softmax(logits.float(), -1)
        expected = logp.gather(-1, ids[:, -c_width:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        got, got_entropy = completion_logps(model, ids, mask, c_width, 0.7, entropy=True)
    real = mask[:, -c_width:].bool()
    torch.testing.assert_close(got[real], expected[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_entropy[real], entropy[real], atol=2e-5, rtol=1e-4)


def test_training_with_a_shared_prefix_follows_the_same_loss_curve(tiny_path, tmp_path):
    from rsiflow.configs.schema import TrainConfig
    from rsiflow.models.trainer import train_candidate

    system = {"role": "system", "content": "You solve arithmetic problems. " * 12}
    rows = [{"kind": "sft", "example_id": f"e{i}", "weight": 1.0, "train_from": 2,
             "messages": [system, {"role": "user", "content": f"What is {i} + 2?"},
                          {"role": "assistant", "content": f"Answer: {i + 2}"}]} for i in range(8)]
    curves = {}
    for shared in (True, False):
        cfg = TrainConfig(learning_rate=1e-3, epochs=3, batch_size=4, warmup_ratio=0.0, lr_scheduler="constant",
                          shared_prefix=shared)
        metrics, _ = train_candidate(tiny_path, rows, tmp_path / f"out-{shared}", cfg, seed=0)
        curves[shared] = metrics["loss_curve"]
    assert len(curves[True]) == len(curves[False]) == 6
    torch.testing.assert_close(torch.tensor(curves[True]), torch.tensor(curves[False]), atol=1e-3, rtol=1e-3)
