"""`distill.xtree`: X-Tree's options (validated by the config when it loads; `Method.Options`)."""

from __future__ import annotations

from pydantic import Field

from rsiflow.configs.section import Section


class XTreeOptions(Section):
    """X-Tree: a tree of reusable action spans mined from the run's rollouts, and its uses (docs/methods.md,
    X-Tree)."""

    window: int | None = Field(None, ge=1, description="Rounds of the run's training rollouts each round mines over "
        "(this round and the window - 1 before it); null = every round so far, so the tree grows with the run.")
    p: float = Field(1.0, ge=0.0, description="Exponent of the span length in the merge score X = f · len^p · "
        "(succ + eps)^p_s (docs/methods.md, X-Tree).")
    p_s: float = Field(1.0, ge=0.0, description="Exponent of (succ + eps) in X; succ = success rate of the "
        "trajectories that contain the span.")
    eps: float = Field(0.05, ge=0.0, description="eps of X, so spans seen only in failures still score.")
    eta0: float = Field(1.0, description="A merge is admissible while it compresses: f - 1 > eta0 + eta1 · len.")
    eta1: float = Field(0.5, description="See eta0.")
    max_depth: int = Field(6, ge=1, description="Deepest node (an action is depth 0, a merge 1 + its deeper child).")
    max_nodes: int | None = Field(256, ge=1, description="Most merges per tree; null = until none is admissible.")
    bonus: bool = Field(False, description="Online bonus for GRPO: r = r_verifier + lambda_g · B, B the share of the "
        "tree's nodes for the task type that the rollout executes, lambda_g = bonus_lambda · (1 - group win rate). "
        "Needs grpo after xtree in distill.methods; the verifier reward is stored unchanged beside it.")
    bonus_lambda: float = Field(0.2, gt=0.0, description="lambda0 of the online bonus (ours: below 1, so a bonus "
        "never outweighs a success).")
    token_weights: bool = Field(False, description="SFT/ExIt token weights: each action of a successful trajectory "
        "weighs 1 + token_weight_alpha · (best normalised score of a node span covering it), rescaled to mean 1 "
        "per trajectory. Needs exit after xtree in distill.methods.")
    token_weight_alpha: float = Field(1.0, gt=0.0, description="alpha of the token weights.")
    context: bool = Field(False, description="Privileged context: the rendered tree for the task type in the "
        "teacher's prompt, distilled into the student's own actions by the privileged-teacher term (the trainer SRD "
        "uses; its divergence settings are distill.srd's).")
    context_nodes: int = Field(8, ge=1, description="Top nodes (by X) of the task type rendered in the teacher's "
        "prompt, each with the merged nodes below it.")
    context_trajectories: int = Field(2, ge=1, description="Most trajectories per group scored with the tree as "
        "privileged context.")
    context_loss_weight: float = Field(0.01, ge=0.0, description="lambda of the context distillation term; equal to "
        "distill.srd.loss_weight when srd runs too (the trainer has one such term).")
