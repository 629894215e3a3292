"""Batching the training rows: `RowCollator` pads SFT and distillation rows of every kind together (the
SFT/distillation trainer's collator); `encode_pg_rows` tokenizes policy-gradient rows and `collate_pg` builds the
batch GRPOTrainer's loss reads from them; `pad` is the shared right- or left-padding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from rsiflow.models.encoding import tokenize_conversation


class RowCollator(DataCollatorForLanguageModeling):
    """Pads rows of every kind together: input_ids/labels by TRL's collator; the row weights; and the
    teacher's ids, the completion positions in both encodings and the sampled logprobs (empty for SFT rows)."""

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().torch_call(examples)
        out["weights"] = torch.tensor([float(e.get("weight", 1.0)) for e in examples])
        pad, n = self.pad_token_id, len(examples)
        t_len = max([len(e.get("teacher_input_ids") or []) for e in examples] + [1])
        p_len = max([len(e.get("student_pos") or []) for e in examples] + [1])
        t_ids = torch.full((n, t_len), pad, dtype=torch.long)
        t_mask = torch.zeros((n, t_len), dtype=torch.long)
        s_pos = torch.full((n, p_len), -1, dtype=torch.long)
        t_pos = torch.full((n, p_len), -1, dtype=torch.long)
        slp = torch.full((n, p_len), math.nan)
        for i, e in enumerate(examples):
            ids = e.get("teacher_input_ids") or []
            t_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            t_mask[i, :len(ids)] = 1
            sp, tp = e.get("student_pos") or [], e.get("teacher_pos") or []
            s_pos[i, :len(sp)] = torch.tensor(sp, dtype=torch.long)
            t_pos[i, :len(tp)] = torch.tensor(tp, dtype=torch.long)
            lp = e.get("sampled_logprobs") or []
            slp[i, :len(lp)] = torch.tensor([math.nan if x is None else x for x in lp], dtype=torch.float)
        out.update(teacher_input_ids=t_ids, teacher_attention_mask=t_mask, student_pos=s_pos, teacher_pos=t_pos,
                   sampled_logprobs=slp, kind=torch.tensor([int(e.get("kind", 0)) for e in examples]),
                   term=torch.tensor([int(e.get("term", 0)) for e in examples]))
        return out


ROW_COLUMNS = ("weight", "teacher_input_ids", "student_pos", "teacher_pos", "sampled_logprobs", "kind", "term")


BATCH_EXTRAS = ("weights", "teacher_input_ids", "teacher_attention_mask", "student_pos", "teacher_pos",
                 "sampled_logprobs", "kind", "term")


def encode_pg_rows(tokenizer, rows: list[dict], max_length: int) -> tuple[list[dict], dict[str, int]]:
    """Tokenize "pg" rows: prompt ids (before the first own action), completion ids, the action mask over the
    completion, the advantage, and per completion token the sampler's logprob after temperature only where the
    encoding reproduces the sampled tokens (NaN elsewhere: end-of-turn markers, projected actions).

    Returns (rows, counts): `too_long` rows are dropped; `sampled_match` / `sampled_turns` count the action
    turns whose sampled tokens the encoding reproduced."""
    out, counts = [], {"too_long": 0, "no_action": 0, "sampled_match": 0, "sampled_turns": 0}
    for row in rows:
        enc = tokenize_conversation(tokenizer, row["messages"], int(row.get("train_from") or 0), row.get("tools"))
        ids, labels = enc["input_ids"], enc["labels"]
        if len(ids) > max_length:
            counts["too_long"] += 1
            continue
        labelled = [i for i, lab in enumerate(labels) if lab != -100]
        if not labelled:
            counts["no_action"] += 1
            continue
        start = labelled[0]
        sample_logps = [math.nan] * (len(ids) - start)
        spans, cur = [], []
        for i in labelled:  # contiguous labelled runs = the assistant turns, in order
            if cur and i != cur[-1] + 1:
                spans.append(cur)
                cur = []
            cur.append(i)
        spans.append(cur)
        for span, sampled in zip(spans, row.get("sampled") or []):
            tok, lps = list(sampled["token_ids"]), list(sampled["temp_logprobs"])
            counts["sampled_turns"] += 1
            if tok and len(lps) == len(tok) and [ids[i] for i in span[:len(tok)]] == tok:
                counts["sampled_match"] += 1
                for i, lp in zip(span, lps):
                    sample_logps[i - start] = float(lp)
        out.append({"example_id": row["example_id"], "prompt_ids": ids[:start], "completion_ids": ids[start:],
                    "action_mask": [int(lab != -100) for lab in labels[start:]],
                    "advantage": float(row["advantage"]), "sample_logps": sample_logps})
    return out, counts


def pad(seqs: list[list], value, left: bool = False, dtype=torch.long) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([([value] * (width - len(s)) + list(s)) if left else (list(s) + [value] * (width - len(s)))
                         for s in seqs], dtype=dtype)


def collate_pg(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """TRL's batch layout: prompts left-padded, completions right-padded, `tool_mask` = the action mask; the
    advantage per token (A·w, w the mismatch weight) where `weights` are known, else per row."""
    batch = {
        "prompt_ids": pad([r["prompt_ids"] for r in rows], pad_id, left=True),
        "prompt_mask": pad([[1] * len(r["prompt_ids"]) for r in rows], 0, left=True),
        "completion_ids": pad([r["completion_ids"] for r in rows], pad_id),
        "completion_mask": pad([[1] * len(r["completion_ids"]) for r in rows], 0),
        "tool_mask": pad([r["action_mask"] for r in rows], 0),
    }
    if "old_logps" in rows[0]:
        batch["old_per_token_logps"] = pad([r["old_logps"] for r in rows], 0.0, dtype=torch.float32)
        # the reference is the initial policy π_old, unless another model's logprobs were attached (prepare_reference)
        batch["ref_per_token_logps"] = (pad([r["ref_logps"] for r in rows], 0.0, dtype=torch.float32)
                                        if "ref_logps" in rows[0] else batch["old_per_token_logps"])
        weights = pad([r["weights"] for r in rows], 0.0, dtype=torch.float32)
        adv = torch.tensor([r["advantage"] for r in rows], dtype=torch.float32)
        batch["advantages"] = adv[:, None] * weights
    else:
        batch["advantages"] = torch.tensor([r["advantage"] for r in rows], dtype=torch.float32)
    return batch
