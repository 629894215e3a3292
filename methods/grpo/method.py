"""GRPO in a round: the generate step's groups become policy-gradient rows with group-relative advantages.

Each trajectory of the round (but crashed episodes) gets its advantage from its group's verifier
rewards (methods/grpo/algorithm.py); it is stored as an `examples` row of method "grpo" (meta: advantage,
group, reward) with lineage to the trajectory. At training time each becomes a "pg" row: the whole
multi-turn episode as one sequence, the loss on the model's own action tokens with the trajectory's
advantage, TRL's GRPO loss (models/grpo_trainer.py). Uniform groups (all fail / all pass) are
counted; their rows have advantage 0 and add no policy gradient.
"""

from __future__ import annotations

from statistics import mean

from rsiflow.methods.base import POLICY_LOSS, REWARD_BONUS, Contribution, DistillContext, Key, Method, num
from rsiflow.methods.grpo.algorithm import trajectory_advantages
from rsiflow.methods.grpo.options import GrpoOptions
from rsiflow.stats.groups import group_counts, group_stats


class GRPO(Method):
    name = "grpo"
    Options = GrpoOptions
    uses_temp_logprobs = True  # the trainer's mismatch correction

    def provides(self) -> set[Key]:
        return {POLICY_LOSS}

    def consumes(self) -> set[Key]:
        return {REWARD_BONUS}

    def distill(self, ctx: DistillContext, inputs) -> Contribution:
        c = self.cfg.distill.grpo
        played = [t for t in ctx.trajectories if t["status"] != "error" and t["n_turns"]]
        # X-Tree's online bonus, written on the trajectories by its distill (distill.xtree.bonus, xtree before grpo)
        provided = ctx.get(REWARD_BONUS, {})   # a reward bonus a method of the round provided (X-Tree's bonus)
        bonus = {t["traj_id"]: provided[t["traj_id"]] for t in played if t["traj_id"] in provided}
        adv = trajectory_advantages(played, c.advantage, c.eps, bonus)
        rows = [{"example_id": f"{t['traj_id']}/grpo", "method": self.name, "source_traj_id": t["traj_id"],
                 "messages": t["messages"], "weight": 1.0,
                 "meta": {"advantage": adv[t["traj_id"]], "group_id": t["group_id"], "reward": t["reward"],
                          **({"xtree_bonus": bonus[t["traj_id"]],
                              "shaped_reward": float(t["reward"] or 0.0) + bonus[t["traj_id"]]} if bonus else {}),
                          "train_from": t["train_from"], **({"tools": ctx.tools} if ctx.tools else {})}}
                for t in played]
        counts = group_counts(group_stats(played)) if played else {}
        nonzero = [r for r in rows if r["meta"]["advantage"] != 0.0]
        return Contribution(examples=rows, metrics={
            "groups": counts.get("groups", 0), "all_fail": counts.get("all_fail", 0),
            "all_pass": counts.get("all_pass", 0), "mixed": counts.get("mixed", 0),
            "rows": len(rows), "nonzero_advantage_rows": len(nonzero),
            "crashed_excluded": len(ctx.trajectories) - len(played),
            "mean_abs_advantage": mean(abs(r["meta"]["advantage"]) for r in rows) if rows else None,
            "advantage": c.advantage})

    def training_rows(self, store, run_id: str, round_no: int, examples: list[dict]) -> list[dict]:
        """Each example is a "pg" row: its conversation, advantage and, per own turn, the sampled token ids with
        their logprobs after temperature only (for the mismatch correction)."""
        turns: dict[str, list[dict]] = {}
        for t in store.step_turns(run_id, round_no, "generate"):
            turns.setdefault(t["traj_id"], []).append(t)
        return [{"kind": "pg", "example_id": e["example_id"], "weight": e["weight"], "messages": e["messages"],
                 "train_from": e["meta"]["train_from"], "tools": e["meta"].get("tools"),
                 "advantage": e["meta"]["advantage"],
                 "sampled": [{"token_ids": t["token_ids"] or [], "temp_logprobs": t["temp_logprobs"] or []}
                             for t in turns.get(e["source_traj_id"], [])]}
                for e in examples]

    def policy_loss(self):
        from rsiflow.models.grpo_trainer import PolicyLoss
        from rsiflow.models.mismatch import Correction

        c = self.cfg.distill.grpo
        # Greedy rollouts (temperature 0) were scored from the raw logits: the trainer's temperature is then 1.
        return PolicyLoss(loss_type=c.loss_type, epsilon=c.epsilon, epsilon_high=c.epsilon_high, beta=c.beta,
                          passes=c.passes, temperature=self.cfg.backend.temperature or 1.0,
                          correction=Correction(c.correction, c.tis_cap, c.cis_lambda, c.cis_kappa),
                          skip_zero_advantage=c.skip_zero_advantage,
                          # "base": tasks/train.py passes the base model's checkpoint as train_candidate's
                          # reference_path (the path is not known here)
                          reference=c.reference)

    @classmethod
    def round_metrics(cls, distill_metrics: dict | None, train_metrics: dict) -> dict | None:
        if distill_metrics is None:
            return None
        keys = ("pg_rows", "pg_skipped_zero_advantage", "pg_tokens", "mismatch_mean_abs_delta",
                "mismatch_kl_sampler_trainer", "mismatch_capped_share", "mismatch_weight_mean", "pg_loss_mean",
                "clip_ratio_mean")
        return {**distill_metrics, **{k: train_metrics.get(k) for k in keys}}

    @classmethod
    def report_section(cls, rounds: list[dict]) -> list[str]:
        rows = [r for r in rounds if r.get("grpo")]
        if not rows:
            return []

        lines = ["GRPO per round (groups fail/pass/mixed; rows trained with a non-zero advantage; mismatch: mean "
                 "|Δ logprob| sampler vs trainer, estimated KL(sampler ‖ trainer), share of tokens capped):", "",
                 "| round | groups fail/pass/mixed | rows (non-zero A) | policy loss | mean abs Δ | KL | capped |",
                 "|---|---|---|---|---|---|---|"]
        for r in rows:
            m = r["grpo"]
            lines.append(f"| {r['round']} | {m['all_fail']}/{m['all_pass']}/{m['mixed']} | {m['rows']} "
                         f"({m['nonzero_advantage_rows']}) | {num(m.get('pg_loss_mean'), '.4f')} | "
                         f"{num(m.get('mismatch_mean_abs_delta'), '.2e')} | "
                         f"{num(m.get('mismatch_kl_sampler_trainer'), '.2e')} | "
                         f"{num(m.get('mismatch_capped_share'), '.3f')} |")
        return lines
