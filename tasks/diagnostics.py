"""Learning diagnostics of a round, computed by the gate step once the trained candidate has played its
held-out tasks. None of them is read by the promotion decision; they say whether training moved the model,
where, and by how much, when held-out success alone does not:

- `train_tasks`: candidate and champion on the round's own first `diagnostics.train_tasks` training tasks:
  sampled (the champion's figure is its generate-step rollouts; the candidate replays the same tasks with the
  generate step's seed and group size) and greedy (one play each). A method that learned nothing from its
  rows shows no gain here, whatever held-out does.
- `heldout_changed`: the share of the gate's held-out tasks on which the candidate's greedy actions differ
  from the champion's (0 = training did not change a single greedy answer).
- `kl`: the mean KL(candidate || champion) of the next-token distributions at the candidate's own greedy
  action tokens on the first `diagnostics.kl_tasks` held-out tasks, in the trainer's dtype.
- per task type: held-out success of both models, greedy and sampled (from the gate's plays).

The change of the trained tokens' logprobs, split by the sign of what trained them, comes from the trainer
(`train_metrics.logprob_change`) and is shown beside these in the report.
"""

from __future__ import annotations

import math

import torch

from rsiflow.envs.rollout import Episode, env_factory, round_seed
from rsiflow.models.backend import backend_for
from rsiflow.models.shared_prefix import shared_prefix_length
from rsiflow.stats.gating import sign_flip_pvalue
from rsiflow.tasks.common import open_store, play


def heldout_changed(plays, candidate: str, champion: str, n: int) -> dict:
    """How many of the first n held-out tasks the candidate answered (greedy) differently from the champion."""
    changed = [plays.greedy[candidate][i].get("actions") != plays.greedy[champion][i].get("actions")
               for i in range(n)]
    return {"tasks": n, "changed": sum(changed), "share": sum(changed) / n if n else None}


@torch.no_grad()
def _action_logprobs(path: str, dtype: str, conversations: list[tuple[list[dict], int]],
                     trust_remote_code: bool, reuse_prefix: bool = True) -> list[torch.Tensor]:
    """Per conversation, the log-softmax over the vocabulary at every labelled (own action) token's position.

    The token prefix all conversations share (an env's system prompt and few-shot turns: 530 of a household
    conversation's ~1,070 tokens) is encoded once and its keys/values reused for each conversation, and the
    vocabulary projection runs at the labelled positions only: the same figures as one full forward pass a
    conversation, up to rounding. `reuse_prefix=False` encodes each conversation whole (still projecting only the
    labelled positions); the test holds the two against each other."""
    import copy

    from transformers import DynamicCache

    from rsiflow.models.encoding import tokenize_conversation
    from rsiflow.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(path, dtype=dtype, trust_remote_code=trust_remote_code)
    encoded = [tokenize_conversation(tokenizer, messages, train_from) for messages, train_from in conversations]
    ids = [e["input_ids"] for e in encoded]
    # logits at p - 1 predict the labelled token at p
    targets = [[i - 1 for i, lab in enumerate(e["labels"]) if lab != -100] for e in encoded]
    scored = [i for i, t in enumerate(targets) if t]
    # each conversation must still feed the position before its first labelled token
    cut = shared_prefix_length([ids[i] for i in scored], min((targets[i][0] for i in scored), default=0)) \
        if reuse_prefix else 0
    prefix = None
    if cut:
        prefix = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids[scored[0]][:cut]]), cache=prefix, use_cache=True, logits_to_keep=1)
    out = [torch.empty(0, model.config.vocab_size) for _ in conversations]
    for i in scored:
        keep = torch.tensor([t - cut for t in targets[i]])
        if prefix is None:
            logits = model(input_ids=torch.tensor([ids[i]]), logits_to_keep=keep).logits[0]
        else:
            logits = model(input_ids=torch.tensor([ids[i][cut:]]), cache=copy.deepcopy(prefix), use_cache=True,
                           logits_to_keep=keep).logits[0]
        out[i] = torch.log_softmax(logits.float(), dim=-1)
    del model
    return out


def heldout_kl(cfg, plays, candidate: str, candidate_path: str, champion_path: str, n: int) -> dict:
    """Mean KL(candidate || champion) per action token of the candidate's greedy held-out episodes (first n)."""
    convs = [(plays.greedy[candidate][i]["messages"], plays.greedy[candidate][i]["n_prefix"]) for i in range(n)
             if plays.greedy[candidate][i].get("messages")]
    if not convs:
        return {"tasks": 0, "tokens": 0, "mean": None}
    cand = _action_logprobs(candidate_path, cfg.model.dtype, convs, cfg.model.trust_remote_code)
    champ = _action_logprobs(champion_path, cfg.model.dtype, convs, cfg.model.trust_remote_code)
    kls = torch.cat([(c.exp() * (c - h)).sum(-1) for c, h in zip(cand, champ) if len(c)])
    return {"tasks": len(convs), "tokens": int(kls.numel()), "mean": float(kls.mean()) if kls.numel() else None,
            "max": float(kls.max()) if kls.numel() else None}


def train_task_replay(cfg, round_no: int, candidate_path: str, champion_path: str, n: int) -> dict:
    """Candidate vs champion on the round's first n training tasks: sampled (group_size plays, generate's seed;
    the champion's are its stored rollouts) and greedy (one play each, gate.seed)."""
    run_id, group = cfg.run.name, cfg.generate.group_size
    env = env_factory(cfg)()
    try:
        tasks = env.sample_tasks("train", cfg.generate.tasks_per_round, round_seed(cfg, round_no))[:n]
    finally:
        env.close()
    with open_store(cfg) as store:
        generated = {t["traj_id"]: t for t in store.step_trajectories(run_id, round_no, "generate")}
    champion_sampled = [sum(bool(generated.get(f"{run_id}/r{round_no}/gen/{ti:04d}-{g:02d}", {}).get("success"))
                            for g in range(group)) for ti in range(len(tasks))]
    sampled = [Episode(traj_id=f"diag-{ti}-{g}", task=t, group_id=t.task_id, sample_idx=g)
               for ti, t in enumerate(tasks) for g in range(group)]
    candidate = backend_for(cfg, candidate_path)  # the sampler's dtype, as the champion's rollouts it is held against
    play(cfg, candidate, sampled, cfg.backend.temperature, round_seed(cfg, round_no),
         f"round {round_no} diagnostics: candidate on {len(tasks)} training tasks x {group}", False)
    candidate_sampled = [sum(bool(e.success) for e in sampled[ti * group:(ti + 1) * group])
                         for ti in range(len(tasks))]
    greedy = {}
    for role, path in (("candidate", candidate_path), ("champion", champion_path)):
        eps = [Episode(traj_id=f"diag-greedy-{ti}", task=t, group_id=t.task_id, sample_idx=0)
               for ti, t in enumerate(tasks)]
        play(cfg, backend_for(cfg, path, evaluation=True), eps, 0.0, cfg.gate.seed,
             f"round {round_no} diagnostics: {role} greedy on {len(tasks)} training tasks", False)
        greedy[role] = [int(bool(e.success)) for e in eps]
    plays = len(tasks) * group
    diffs = [c - h for c, h in zip(candidate_sampled, champion_sampled)]
    return {"tasks": len(tasks), "samples": group,
            "candidate_sampled": sum(candidate_sampled) / plays if plays else None,
            "champion_sampled": sum(champion_sampled) / plays if plays else None,
            "sampled_p_value": sign_flip_pvalue(diffs),
            "candidate_greedy": sum(greedy["candidate"]) / len(tasks) if tasks else None,
            "champion_greedy": sum(greedy["champion"]) / len(tasks) if tasks else None,
            "greedy_wins": sum(c > h for c, h in zip(greedy["candidate"], greedy["champion"])),
            "greedy_losses": sum(c < h for c, h in zip(greedy["candidate"], greedy["champion"]))}


def learning_diagnostics(cfg, round_no: int, candidate: str, candidate_path: str, champion: str, champion_path: str,
                         plays, n: int) -> dict:
    """The round's diagnostics (module docstring) as one JSON-ready dict."""
    d = cfg.diagnostics
    out: dict = {"heldout_changed": heldout_changed(plays, candidate, champion, n)}
    if d.kl_tasks:
        out["kl"] = heldout_kl(cfg, plays, candidate, candidate_path, champion_path, min(d.kl_tasks, n))
    if d.train_tasks:
        out["train_tasks"] = train_task_replay(cfg, round_no, candidate_path, champion_path,
                                               min(d.train_tasks, cfg.generate.tasks_per_round))
    return _finite(out)


def _finite(x):
    """JSON-safe: NaN and infinities become None."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
