"""Training forward passes that encode the prefix every row of a batch shares once, not once per row.

An episode's training sequence is the prompt prefix (system message, few-shot turns: the same tokens for every
row of a round) followed by the row's own turns. With few-shot prompts the prefix is most of the row: an
arithmetic row is ~250 prefix tokens and ~40 of its own. Here the prefix is run once (batch 1), its keys and
values are broadcast to the batch, and only each row's remaining tokens are run on top of them, with the
positions they have in the full sequence. The loss and its gradients are those of the plain forward up to
floating-point rounding: the prefix's activations are the same for every row, and autograd sums the rows'
gradients through the broadcast, as it sums them over the rows' own copies in the plain pass.

Two layouts are handled:
- right-padded rows starting at column 0 (SFT and distillation rows, TRL's collator): `shared_prefix_logits`;
- left-padded prompt + right-padded completion (TRL's GRPO batches): `completion_logps`, which first moves each
  row's tokens to start at column 0 (RoPE attention depends on position differences only, so the left pads'
  shift of every position changes nothing) and returns the per-token logprobs of the completion columns.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from rsiflow.models.collate import pad

# A shared prefix shorter than this is not worth a second forward call.
MIN_SHARED_PREFIX = 32


def common_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, most: int) -> int:
    """Leading columns on which every row has the same, unmasked token (at most `most`); 0 when fewer than
    MIN_SHARED_PREFIX or a single row."""
    if input_ids.size(0) < 2 or most < MIN_SHARED_PREFIX:
        return 0
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)
    n = int(same[:most].long().cumprod(0).sum())
    return n if n >= MIN_SHARED_PREFIX else 0


def shared_prefix_length(sequences: list[list[int]], most: int) -> int:
    """`common_prefix` of token sequences of any lengths: the leading tokens all of them share (at most `most`);
    0 when fewer than MIN_SHARED_PREFIX or a single sequence."""
    if len(sequences) < 2:
        return 0
    ids = pad(sequences, -1)
    return common_prefix(ids, ids >= 0, min(most, *map(len, sequences)))


def _run_on_prefix(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix: int, logits_to_keep: int):
    """(logits of the prefix's last position (B, 1, V), logits of the last `logits_to_keep` positions of the rest
    (B, K, V)): the prefix encoded once and broadcast, the rest at its true positions."""
    batch, width = input_ids.shape
    cache = DynamicCache(config=model.config)
    head = model(input_ids=input_ids[:1, :prefix], cache=cache, use_cache=True, logits_to_keep=1)
    for layer in cache.layers:
        layer.keys = layer.keys.expand(batch, -1, -1, -1)
        layer.values = layer.values.expand(batch, -1, -1, -1)
    positions = torch.arange(prefix, width, device=input_ids.device).expand(batch, -1)
    rest = model(input_ids=input_ids[:, prefix:], attention_mask=attention_mask, position_ids=positions, cache=cache,
                 use_cache=True, logits_to_keep=logits_to_keep)
    return head.logits.expand(batch, -1, -1), rest.logits


def shared_prefix_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         first_scored: int) -> tuple[torch.Tensor, int]:
    """(logits, offset) for right-padded rows: logits[:, j] are the plain forward's logits at column offset + j, for
    every column from offset on; `first_scored` is the first column whose token is scored (its logits come from
    the column before it, so the shared part ends there). offset 0: a plain forward (nothing worth sharing)."""
    prefix = common_prefix(input_ids, attention_mask, min(first_scored, input_ids.size(1) - 1))
    if not prefix:
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits, 0
    head, rest = _run_on_prefix(model, input_ids, attention_mask, prefix, input_ids.size(1) - prefix)
    return torch.cat([head, rest], dim=1), prefix - 1


def completion_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                     temperature: float = 1.0, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs (and entropies) of the last `logits_to_keep` columns of left-padded prompt + right-padded
    completion rows (TRL's GRPO layout), under logits divided by `temperature`; the same as TRL's
    `_get_per_token_logps_and_entropies` up to rounding."""
    batch, width = input_ids.shape
    left = (attention_mask.cumsum(1) == 0).sum(1)                        # left pads per row
    shift = int(left.min())
    new_width = width - shift
    ids = input_ids.new_full((batch, new_width), 0)
    mask = attention_mask.new_zeros((batch, new_width))
    for i in range(batch):
        n = width - int(left[i])
        ids[i, :n] = input_ids[i, int(left[i]):]
        mask[i, :n] = attention_mask[i, int(left[i]):]
    # column c of the original is column c - left[i] here; the completion's first token is predicted from the
    # column before it, so the logits needed start at width - logits_to_keep - 1 - left[i]
    first = (width - logits_to_keep - 1 - left)                          # per row, in the new layout
    keep = int(new_width - first.min())
    prefix = common_prefix(ids, mask, int(first.min()))
    if prefix:
        _, logits = _run_on_prefix(model, ids, mask, prefix, keep)
    else:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=keep).logits
    start = logits.size(1) - (new_width - first)                          # per row, index of its first logit
    index = (start[:, None] + torch.arange(logits_to_keep, device=ids.device)[None]).clamp(max=logits.size(1) - 1)
    picked = logits.gather(1, index[..., None].expand(-1, -1, logits.size(-1))).float() / temperature
    logp_all = torch.log_softmax(picked, dim=-1)
    tokens = input_ids[:, width - logits_to_keep:]
    logps = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else None
    return logps, ent
