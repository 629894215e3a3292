"""What the gate's KL diagnostic costs, against the way it was computed before, in the same run.

    python -m bench.diagnostics [--model embedded:smollm2-135m-instruct] [--conversations 24] [--repeats 2]

The KL diagnostic (`tasks.diagnostics.heldout_kl`) scores each of `diagnostics.kl_tasks` held-out conversations
under the candidate and the champion. It used to run one full forward pass a conversation and project every
position onto the vocabulary; `_action_logprobs` now encodes the token prefix the conversations share once and
projects only the labelled positions. This bench times both on household conversations solved by the env's
scripted expert (the episodes `bench.train` trains on; a gate's failed episodes run to `env.max_turns` and are
longer), one model, and prints seconds, tokens/s as a fraction of the matmul limit `bench.roofline` measures in
the same process, the ratio, and the largest difference between the two paths' log-probabilities. Both rates
count every token of every conversation, so the new path's is an effective rate: the shared prefix it encodes
once counts for each conversation (which is how it can exceed the limit).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench import roofline
from bench.cli import add_model_args, model_path
from bench.train import expert_rows
from rsiflow.models.encoding import tokenize_conversation
from rsiflow.models.loading import load_model_and_tokenizer
from rsiflow.models.shared_prefix import shared_prefix_length
from rsiflow.tasks.diagnostics import _action_logprobs


@torch.no_grad()
def full_passes(model, tokenizer, conversations: list[tuple[list[dict], int]]) -> list[torch.Tensor]:
    """The previous computation: one forward pass a conversation, logits at every position, then the labelled."""
    out = []
    for messages, train_from in conversations:
        enc = tokenize_conversation(tokenizer, messages, train_from)
        positions = [i - 1 for i, lab in enumerate(enc["labels"]) if lab != -100]
        logits = model(input_ids=torch.tensor([enc["input_ids"]])).logits[0].float()
        out.append(torch.log_softmax(logits[positions], dim=-1))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--conversations", type=int, default=24, help="as many as the default diagnostics.kl_tasks")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each path (the best is reported)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    path = str(model_path(args))
    convs = [(r["messages"], r["train_from"]) for r in expert_rows(args.conversations, args.seed)]
    model, tokenizer = load_model_and_tokenizer(path, dtype=args.dtype)
    encoded = [tokenize_conversation(tokenizer, m, t) for m, t in convs]
    tokens = sum(len(e["input_ids"]) for e in encoded)
    labelled = sum(lab != -100 for e in encoded for lab in e["labels"])
    first = min(next(i for i, lab in enumerate(e["labels"]) if lab != -100) for e in encoded)
    shared = shared_prefix_length([e["input_ids"] for e in encoded], first - 1)
    limit = roofline.matmul_flops(model) / roofline.flops_per_token(model)

    def best(fn) -> tuple[float, list[torch.Tensor]]:
        times, result = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t0)
        return min(times), result

    # the new path loads its model itself: time the load apart and take it out
    t0 = time.perf_counter()
    load_model_and_tokenizer(path, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    old_s, old = best(lambda: full_passes(model, tokenizer, convs))
    new_s, new = best(lambda: _action_logprobs(path, args.dtype, convs, False))
    new_s = max(new_s - load_s, 1e-9)
    diff = max(float((a - b).abs().max()) for a, b in zip(old, new) if len(a))
    print(f"{len(convs)} household conversations (scripted expert), {tokens} tokens ({tokens / len(convs):.0f} a "
          f"conversation), {labelled} labelled, shared prefix {shared} tokens; {args.dtype}, "
          f"{torch.get_num_threads()} threads; roofline {limit:.0f} processed tokens/s")
    for name, s in (("full forward a conversation (before)", old_s), ("shared prefix + labelled logits", new_s)):
        print(f"  {name:38s} {s:7.2f} s  {tokens / s:7.0f} tokens/s  {tokens / s / limit:.2f} of the limit")
    print(f"  ratio {old_s / new_s:.2f}x (model load {load_s:.2f} s taken out); largest |delta logprob| {diff:.2e}")


if __name__ == "__main__":
    main()
