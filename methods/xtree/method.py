"""X-Tree in a round: the run's rollouts so far mined into a tree of reusable action spans, and its uses.

Thin over methods/xtree/algorithm.py. `read` takes the corpus from the store: the canonical action symbols of the
run's training rollouts of the last `window` rounds (this one included; crashed episodes left out) and
the previous tree (for lineage). `distill` mines the tree and contributes its rows (`xtree_trees`,
`xtree_nodes`, `xtree_occurrences`), then applies each enabled use:

- bonus: per rollout of this round, B = share of the task type's nodes it executes and
  λ_g = bonus_lambda · (1 − group win rate); rows of `xtree_bonus`. The bonus reaches GRPO through the
  round's state (`REWARD_BONUS`, traj_id -> bonus), and GRPO's distill (which consumes that key, so it runs
  after this one) adds it to the verifier reward;
- token_weights: each successful rollout gets one weight per action (`TURN_WEIGHTS` in the round's state), which
  ExIt's distill turns into weighted spans of the trajectory (`split_by_turn_weights`);
- context: for up to `context_trajectories` rollouts per group, a teacher/student pair (the `foresight`
  table, channel "xtree"): the teacher sees the rendered tree of the task type in the task message, the
  student does not; at training time a "distill" row scored on the rollout's own actions.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from statistics import mean

from rsiflow.methods.base import (
    REWARD_BONUS,
    TURN_WEIGHTS,
    Contribution,
    DistillContext,
    Key,
    Method,
    distill_row,
    num,
    teacher_loss,
    term_loss,
)
from rsiflow.methods.srd.algorithm import with_privileged
from rsiflow.methods.xtree import queries
from rsiflow.methods.xtree.algorithm import (
    MineParams,
    Trace,
    Tree,
    mine,
    online_bonus,
    render,
    turn_weights,
)
from rsiflow.methods.xtree.options import XTreeOptions

log = logging.getLogger(__name__)

CONTEXT_HEADER = ("Reusable action patterns from earlier episodes of this kind of task (privileged, do not "
                  "reveal), each with its sub-patterns:")
USES = ("bonus", "token_weights", "context")


def tree_id(run_id: str, round_no: int) -> str:
    return f"{run_id}/r{round_no}/xtree"


class XTree(Method):
    """X-Tree (docs/methods.md, X-Tree): experience tokenization over canonical actions; no LLM calls."""

    name = "xtree"
    Options = XTreeOptions
    tables = ("xtree_trees", "xtree_nodes", "xtree_occurrences", "xtree_bonus", "foresight")

    def provides(self) -> set[Key]:
        c = self.cfg.distill.xtree
        return {k for k, on in ((REWARD_BONUS, c.bonus), (TURN_WEIGHTS, c.token_weights)) if on}

    def params(self) -> MineParams:
        c = self.cfg.distill.xtree
        return MineParams(p=c.p, p_s=c.p_s, eps=c.eps, eta0=c.eta0, eta1=c.eta1, max_depth=c.max_depth,
                          max_nodes=c.max_nodes)

    def read(self, store, ctx: DistillContext) -> dict:
        window = self.cfg.distill.xtree.window
        first = 1 if window is None else max(1, ctx.round - window + 1)
        previous = queries.latest_before(store, ctx.run_id, ctx.round)
        return {"first_round": first, "corpus": queries.corpus(store, ctx.run_id, first, ctx.round),
                "previous": previous, "previous_nodes": queries.nodes(store, previous["tree_id"]) if previous else []}

    def distill(self, ctx: DistillContext, inputs: dict) -> Contribution:
        c = self.cfg.distill.xtree
        corpus = [r for r in inputs["corpus"] if r["status"] != "error" and r["symbols"]]
        traces = [Trace(r["traj_id"], list(r["symbols"]), bool(r["success"]), r["task_type"] or "") for r in corpus]
        t0 = time.perf_counter()
        tree = mine(traces, self.params())
        mine_s = time.perf_counter() - t0
        tid = tree_id(ctx.run_id, ctx.round)
        seen = {tuple(n["span"]): n["first_round"] for n in inputs["previous_nodes"]}
        uses = [u for u in USES if getattr(c, u)]
        tables: dict[str, list[dict]] = {
            "xtree_trees": [{"tree_id": tid, "parent_tree_id": inputs["previous"]["tree_id"] if inputs["previous"]
                             else None, "first_round": inputs["first_round"], "n_trajectories": len(traces),
                             "n_symbols": tree.n_symbols, "alphabet": tree.alphabet, "n_nodes": len(tree.nodes),
                             "params": vars(tree.params), "uses": uses, "mine_s": mine_s}],
            "xtree_nodes": [{"tree_id": tid, "node_idx": n.idx, "left_child": n.left, "right_child": n.right,
                             "span": list(n.span), "length": n.length, "depth": n.depth, "freq": n.freq,
                             "succ": n.succ, "score": n.score, "n_trajectories": n.traces, "task_types": n.labels,
                             "first_round": seen.get(n.span, ctx.round)} for n in tree.nodes],
            "xtree_occurrences": [{"tree_id": tid, "node_idx": o.node, "traj_id": traces[o.trace].key,
                                   "turn_start": o.start, "turn_end": o.end} for o in tree.occurrences],
        }
        symbols = {r["traj_id"]: list(r["symbols"]) for r in corpus}
        played = [t for t in ctx.trajectories if t["status"] != "error" and t["n_turns"]]
        metrics = {"first_round": inputs["first_round"], "trajectories": len(traces), "symbols": tree.n_symbols,
                   "nodes": len(tree.nodes), "new_nodes": sum(n.span not in seen for n in tree.nodes),
                   "max_depth": max((n.depth for n in tree.nodes), default=0), "mine_s": round(mine_s, 4),
                   "uses": uses, "outline": render(tree, top=6)}
        examples: list[dict] = []
        if c.bonus:
            tables["xtree_bonus"], figures = self._bonus(tree, tid, played, symbols)
            ctx.provide(self, REWARD_BONUS, {r["traj_id"]: r["bonus"] for r in tables["xtree_bonus"]})
            metrics.update(figures)
        if c.token_weights:
            weights, figures = self._token_weights(tree, played, symbols)
            ctx.provide(self, TURN_WEIGHTS, weights)
            metrics.update(figures)
        if c.context:
            tables["foresight"], examples = self._context(ctx, tree, played)
            metrics["context_pairs"] = len(examples)
        log.info("round %d X-Tree: %d nodes from %d symbols in %.3f s", ctx.round, len(tree.nodes), tree.n_symbols,
                 mine_s)
        return Contribution(examples=examples, tables=tables, metrics=metrics)

    # ---- uses --------------------------------------------------------------------------------------

    def _bonus(self, tree: Tree, tid: str, played: list[dict], symbols: dict[str, list[str]]):
        """Rows of xtree_bonus (one per played trajectory) and the round's bonus figures."""
        lam0 = self.cfg.distill.xtree.bonus_lambda
        groups: dict[str, list[dict]] = defaultdict(list)
        for t in played:
            groups[t["group_id"]].append(t)
        rows, separated = [], 0
        for gid in sorted(groups):
            members = groups[gid]
            nodes = tree.relevant(members[0].get("task_type") or "")
            out = online_bonus([(symbols.get(t["traj_id"], []), bool(t["success"])) for t in members], nodes, lam0)
            for t, b in zip(members, out["rollouts"]):
                rows.append({"tree_id": tid, "traj_id": t["traj_id"], "group_id": gid, "verifier_reward": t["reward"],
                             "win_rate": out["win_rate"], "lambda_g": out["lambda_g"], "n_nodes": len(nodes),
                             "executed": b["nodes"], "share": b["share"], "bonus": b["bonus"]})
            if out["win_rate"] == 0.0 and len({b["bonus"] for b in out["rollouts"]}) > 1:
                separated += 1
        all_fail = sum(1 for g in groups.values() if not any(t["success"] for t in g))
        return rows, {"bonus_rollouts": len(rows), "bonus_nonzero": sum(r["bonus"] > 0 for r in rows),
                      "bonus_mean": mean(r["bonus"] for r in rows) if rows else None,
                      "share_mean": mean(r["share"] for r in rows) if rows else None,
                      "all_fail_groups": all_fail, "all_fail_separated": separated}

    def _token_weights(self, tree: Tree, played: list[dict], symbols: dict[str, list[str]]) -> tuple[dict, dict]:
        """The per-action weights of each successful trajectory (traj_id -> weights) and the round's figures."""
        alpha = self.cfg.distill.xtree.token_weight_alpha
        weights, spread = {}, []
        for t in played:
            if not t["success"]:
                continue
            w = turn_weights(tree.relevant(t.get("task_type") or ""), symbols.get(t["traj_id"], []), alpha)
            if len(w) != t["n_turns"]:
                raise ValueError(f"trajectory {t['traj_id']}: {len(w)} symbols for {t['n_turns']} turns")
            weights[t["traj_id"]] = w
            spread.append(max(w) / min(w))
        return weights, {"weighted_trajectories": len(weights), "weight_ratio_max": max(spread) if spread else None}

    def _context(self, ctx: DistillContext, tree: Tree, played: list[dict]) -> tuple[list[dict], list[dict]]:
        """Teacher/student pairs with the task type's rendered tree as the teacher's privileged text."""
        c = self.cfg.distill.xtree
        per_group: dict[str, int] = defaultdict(int)
        pairs, examples = [], []
        for t in sorted(played, key=lambda t: t["traj_id"]):
            nodes = tree.relevant(t.get("task_type") or "")
            if not nodes or per_group[t["group_id"]] >= c.context_trajectories:
                continue
            per_group[t["group_id"]] += 1
            start = int(t["train_from"])
            student = [dict(m) for m in t["messages"]]
            teacher = with_privileged(student, start, f"{CONTEXT_HEADER}\n{render(tree, nodes, c.context_nodes)}")
            pair_id = f"{t['traj_id']}/xtree-context"
            pairs.append({"foresight_id": pair_id, "group_id": t["group_id"], "task_id": t["task_id"],
                          "channel": "xtree", "source_traj_id": t["traj_id"], "student_messages": student,
                          "teacher_messages": teacher, "train_from": start, "model_id": ctx.champion})
            examples.append({"example_id": f"{pair_id}/xtree", "method": self.name, "source_traj_id": t["traj_id"],
                             "messages": student, "weight": 1.0,
                             "meta": {"foresight_id": pair_id, "channel": "xtree", "train_from": start,
                                      **({"tools": ctx.tools} if ctx.tools else {})}})
        return pairs, examples

    # ---- training and reports ------------------------------------------------------------------------

    def training_rows(self, store, run_id: str, round_no: int, examples: list[dict]) -> list[dict]:
        """Each context example is a "distill" row: the rollout's conversation as the student, the same with the
        rendered tree as the teacher, scored on the rollout's own actions."""
        pairs = store.foresight_pairs(run_id, round_no)
        return [distill_row(e, pairs[e["meta"]["foresight_id"]]) for e in examples]

    def distill_loss(self):
        if not self.cfg.distill.xtree.context:
            return None
        return teacher_loss(self.cfg, self.cfg.distill.xtree.context_loss_weight)

    @classmethod
    def round_metrics(cls, distill_metrics: dict | None, train_metrics: dict) -> dict | None:
        if distill_metrics is None:
            return None
        if "context_pairs" not in distill_metrics:
            return distill_metrics
        return {**distill_metrics, "distill_loss": term_loss(train_metrics, cls.name)}

    @classmethod
    def report_section(cls, rounds: list[dict]) -> list[str]:
        rows = [r for r in rounds if r.get("xtree")]
        if not rows:
            return []
        lines = ["X-Tree per round (the tree mined over rounds first..round: trajectories, symbols, nodes, of them new "
                 "spans, deepest node, mining seconds; bonus: rollouts with a bonus > 0, mean bonus, all-fail groups "
                 "the bonus separates; weighted: successful trajectories with token weights; context pairs and their "
                 "mean distillation loss D):", "",
                 "| round | corpus rounds | trajectories | symbols | nodes (new) | depth | mine s | bonus > 0 | "
                 "mean bonus | all-fail separated | weighted | context pairs (D) |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            m = r["xtree"]
            sep = f"{m['all_fail_separated']}/{m['all_fail_groups']}" if "all_fail_groups" in m else "-"
            lines.append(f"| {r['round']} | {m['first_round']}-{r['round']} | {m['trajectories']} | {m['symbols']} | "
                         f"{m['nodes']} ({m['new_nodes']}) | {m['max_depth']} | {m['mine_s']:.3f} | "
                         f"{m.get('bonus_nonzero', '-')} | {num(m.get('bonus_mean'), '.4f')} | {sep} | "
                         f"{m.get('weighted_trajectories', '-')} | {m.get('context_pairs', '-')} "
                         f"({num(m.get('distill_loss'), '.4f')}) |")
        last = rows[-1]
        lines += ["", f"Top nodes of round {last['round']}'s tree (span, occurrences when merged, success rate of the "
                  "trajectories containing it), sub-nodes indented:", "", "```",
                  last["xtree"]["outline"] or "(no node: no span compresses yet)", "```"]
        return lines
