"""The learning diagnostics on real tiny models: the KL between a model and itself is 0 and between two different
models positive; a model compared with itself changes no greedy answer; the replay of the round's own training
tasks plays what the config says."""

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.models.loading import resolve_base_model
from rsiflow.stores.store import Store
from rsiflow.tasks.diagnostics import learning_diagnostics
from rsiflow.tasks.gate import HeldoutPlays, heldout_tasks
from tests.conftest import TINY, tiny_overrides


@pytest.fixture
def cfg(tmp_path):
    cfg = load_config([TINY], tiny_overrides(tmp_path, "env.name=arithmetic", "env.kwargs={}", "env.max_turns=2",
                                             "env.show_admissible=false", "env.project_actions=false",
                                             "gate.heldout_tasks=3", "gate.samples=2", "generate.tasks_per_round=3",
                                             "generate.group_size=2", "diagnostics.train_tasks=2",
                                             "diagnostics.kl_tasks=3"))
    with Store(cfg.run.store) as store:
        store.create_run(cfg.run.name, cfg.run.name, {}, "tiny:0")
    return cfg


def _diagnostics(cfg, candidate_path, champion_path):
    tasks = heldout_tasks(cfg)
    paths = {"cand": str(candidate_path), "champ": str(champion_path)}
    plays = HeldoutPlays(cfg, tasks, paths, {"cand": "candidate", "champ": "champion"}, "t/r1/gate", 1,
                         {"cand": 5, "champ": 6}, 2, "test")
    plays.play_first(3)
    return learning_diagnostics(cfg, 1, "cand", paths["cand"], "champ", paths["champ"], plays, 3)


def test_a_model_against_itself_has_no_kl_and_changes_nothing(cfg, tiny_path):
    d = _diagnostics(cfg, tiny_path, tiny_path)
    assert d["heldout_changed"] == {"tasks": 3, "changed": 0, "share": 0.0}
    assert d["kl"]["tasks"] == 3 and d["kl"]["tokens"] > 0 and abs(d["kl"]["mean"]) < 1e-6
    tt = d["train_tasks"]
    assert tt["tasks"] == 2 and tt["samples"] == 2
    assert tt["candidate_greedy"] == tt["champion_greedy"] and tt["greedy_wins"] == tt["greedy_losses"] == 0


def test_two_different_models_differ(cfg, tiny_path, model_cache):
    other = resolve_base_model("tiny:1", model_cache)
    d = _diagnostics(cfg, other, tiny_path)
    assert d["kl"]["mean"] > 0.01
    assert d["heldout_changed"]["changed"] >= 1


def test_action_logprobs_reusing_the_shared_prefix_equal_full_forward_passes(tiny_path):
    """The shared prompt is encoded once and only labelled positions are projected; the figures are those of one
    full forward pass a conversation (computed here independently), also for a conversation with nothing to
    score and one whose answer starts right after the shared prefix."""
    import torch

    from rsiflow.models.encoding import tokenize_conversation
    from rsiflow.models.loading import load_model_and_tokenizer
    from rsiflow.models.shared_prefix import shared_prefix_length
    from rsiflow.tasks.diagnostics import _action_logprobs

    system = {"role": "system", "content": "You are in a house. Act with one command a turn. " * 8}
    convs = [([system, {"role": "user", "content": f"Task {k}: put the {thing} in the fridge."},
               {"role": "assistant", "content": f"go to {place}"}, {"role": "user", "content": "You arrive."},
               {"role": "assistant", "content": f"take {thing}"}], 2)
             for k, (thing, place) in enumerate([("apple", "table 1"), ("egg", "counter 2"), ("mug", "shelf 3")])]
    convs.append(([system, {"role": "user", "content": "Task 9: look around."}], 0))  # nothing labelled
    convs.append(([system, {"role": "user", "content": "Task 7: open the drawer."},
                   {"role": "assistant", "content": "open drawer 1"}], 2))
    got = _action_logprobs(str(tiny_path), "float32", convs, False)
    model, tokenizer = load_model_and_tokenizer(str(tiny_path), dtype="float32")
    assert shared_prefix_length([tokenize_conversation(tokenizer, m, t)["input_ids"] for m, t in convs], 10_000) > 50
    for (messages, train_from), lp in zip(convs, got):
        enc = tokenize_conversation(tokenizer, messages, train_from)
        positions = [i - 1 for i, lab in enumerate(enc["labels"]) if lab != -100]
        assert lp.shape == (len(positions), model.config.vocab_size)
        if positions:
            with torch.no_grad():
                full = torch.log_softmax(model(input_ids=torch.tensor([enc["input_ids"]])).logits[0, positions], -1)
            torch.testing.assert_close(lp, full, atol=2e-4, rtol=1e-4)
    for whole, lp in zip(_action_logprobs(str(tiny_path), "float32", convs, False, reuse_prefix=False), got):
        torch.testing.assert_close(whole, lp, atol=2e-4, rtol=1e-4)
