"""Training rows to token ids: what the trainer (models/trainer.py) trains on.

A training row is a dict with `example_id`, `weight` and a `kind` the trainer knows:
- "sft": `messages` and `train_from`: the loss is on the assistant messages at index >= train_from
  (earlier ones, e.g. few-shot demonstrations, are prompt), except those whose indices are in the optional
  `untrained` (context, not trained: e.g. an action the env did not accept before a corrected one);
- "distill": `student` and `teacher` conversations and `train_from` (privileged-teacher
  distillation, docs/methods.md): the completion (assistant messages at index >= train_from) is
  scored under both prompts; optional `completion_ids` / `sampling_logprobs` of the sampled tokens.

SmolLM2's chat template has no `{% generation %}` markers, so TRL's `assistant_only_loss` can't find
assistant spans: conversations are tokenized here and labels masked. Each assistant span is the
tokens between the rendered prefix with a generation prompt and the rendered prefix that includes the
message: the action text plus the end-of-turn token, exactly what the backend sampled (and the stop
that ended it). A row's optional `tools` (JSON schemas, the env's `tools()`) go to the chat template
as the backend passed them when it sampled, so training renders the prompt generation saw.
"""

from __future__ import annotations

import math
from typing import Any

KINDS = ("sft", "distill")


class MisalignedCompletion(ValueError):
    """The completion's tokens differ between the teacher's and the student's encodings."""


def _render(tokenizer, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_conversation(tokenizer, messages: list[dict], train_from: int = 0,
                          tools: list[dict] | None = None, untrained=()) -> dict[str, list[int]]:
    """input_ids of the whole conversation; labels = input_ids on the spans of assistant messages at
    index >= `train_from` and not in `untrained` (message indices left unlabelled), -100 elsewhere."""
    full = _render(tokenizer, messages, False, tools)
    labels = [-100] * len(full)
    skip = {int(i) for i in untrained or ()}
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < train_from or i in skip:
            continue
        prompt = _render(tokenizer, messages[:i], True, tools)
        start, end = len(prompt), len(_render(tokenizer, messages[: i + 1], False, tools))
        if full[:start] != prompt or end > len(full):
            raise ValueError(f"chat template is not prefix-stable at message {i}: can't locate the assistant span")
        labels[start:end] = full[start:end]
    return {"input_ids": full, "labels": labels}


def encode_pair(tokenizer, student: list[dict], teacher: list[dict], train_from: int,
                completion_ids: list[int] | None = None, sampling_logprobs: list[float] | None = None,
                tools: list[dict] | None = None) -> dict[str, Any]:
    """Token ids of both conversations and the positions of the completion tokens in each.

    Raises MisalignedCompletion when the completion tokens (assistant messages at index >=
    train_from) differ between the two encodings, or there are none. With `completion_ids` (the
    tokens the student sampled), their `sampling_logprobs` are attached where the encoding
    reproduces them exactly (NaN elsewhere: no IS weight there)."""
    s = tokenize_conversation(tokenizer, student, train_from, tools)
    t = tokenize_conversation(tokenizer, teacher, train_from, tools)
    s_pos = [i for i, lab in enumerate(s["labels"]) if lab != -100]
    t_pos = [i for i, lab in enumerate(t["labels"]) if lab != -100]
    s_tok = [s["input_ids"][i] for i in s_pos]
    t_tok = [t["input_ids"][i] for i in t_pos]
    if not s_tok:
        raise MisalignedCompletion("no completion tokens to score (no assistant message at or after train_from)")
    if s_tok != t_tok:
        first = next((i for i, (a, b) in enumerate(zip(s_tok, t_tok)) if a != b), min(len(s_tok), len(t_tok)))
        raise MisalignedCompletion(
            f"completion tokens differ between the teacher's and the student's encodings at completion token {first} "
            f"(student {len(s_tok)} tokens, teacher {len(t_tok)}): the privileged text must stay in a user turn")
    logps = [math.nan] * len(s_tok)
    sampled_match = False
    if completion_ids and sampling_logprobs and len(sampling_logprobs) == len(completion_ids):
        n = len(completion_ids)
        if s_tok[:n] == list(completion_ids):
            logps[:n] = [float(x) for x in sampling_logprobs]
            sampled_match = True
    return {"input_ids": s["input_ids"], "labels": [-100] * len(s["input_ids"]),
            "teacher_input_ids": t["input_ids"], "student_pos": s_pos, "teacher_pos": t_pos,
            "sampled_logprobs": logps, "sampled_match": sampled_match}


def encode_rows(tokenizer, rows: list[dict], max_length: int) -> tuple[list[dict], dict[str, int]]:
    """Tokenize training rows of every kind into one schema (SFT rows have empty teacher columns).

    Returns (encoded rows, counts): `too_long` rows (longer than `max_length` tokens, either
    encoding) and `misaligned` distillation pairs are dropped and counted; `sampled_match` counts
    pairs whose sampled tokens the encoding reproduced (their IS weights are known)."""
    out, counts = [], {"too_long": 0, "misaligned": 0, "sampled_match": 0,
                       "sft_too_long": 0, "distill_too_long": 0}
    for row in rows:
        kind, tools = row.get("kind", "sft"), row.get("tools")
        if kind == "sft":
            enc = tokenize_conversation(tokenizer, row["messages"], int(row.get("train_from") or 0), tools,
                                        row.get("untrained") or ())
            enc.update(teacher_input_ids=[], student_pos=[], teacher_pos=[], sampled_logprobs=[])
        elif kind == "distill":
            try:
                enc = encode_pair(tokenizer, row["student"], row["teacher"], int(row["train_from"]),
                                  row.get("completion_ids"), row.get("sampling_logprobs"), tools)
            except MisalignedCompletion:
                counts["misaligned"] += 1
                continue
            counts["sampled_match"] += int(enc.pop("sampled_match"))
        else:
            raise ValueError(f"training row {row.get('example_id')!r}: unknown kind {kind!r}; "
                             f"the trainer knows {KINDS}")
        if max(len(enc["input_ids"]), len(enc["teacher_input_ids"])) > max_length:
            counts["too_long"] += 1
            counts[f"{kind}_too_long"] += 1
            continue
        out.append({**enc, "weight": float(row.get("weight", 1.0)), "example_id": row.get("example_id"),
                    "kind": KINDS.index(kind), "term": int(row.get("term") or 0)})
    return out, counts
