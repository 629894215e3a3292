"""One layer's attention with a prefix all rows share: in every row's cache (what the hf backend does with
`backend.hf.shared_prefix_attention: false`: PyTorch's SDPA over the whole row) against attended apart from one copy
and merged with each row's own attention (`_attend_to_shared_prefix`, the backend's function). SmolLM2-135M's
attention shape (9 query and 3 key/value heads of 64), float32 as the bf16 engine computes it, 16 rows, a 530-token
shared prefix (the household few-shot prompt) and each row's own cached tokens (left pads of 0-195 positions
masked, as rows of different lengths share a batch). Two shapes: a prefill of 72 new tokens a row after 500 own
cached ones (a household turn's observation), and a decoding step (one token after 572). Prints, for each shape and
thread count, ms per call both ways, their ratio and the largest difference of the outputs.

    python -m bench.shared_prefix [--repeat 20] [--rows 16] [--shared 530]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from rsiflow.models.hf_backend import _attend_to_shared_prefix

HEADS, KV_HEADS, DIM = 9, 3, 64


def _time(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def compare(rows: int, shared: int, new: int, own: int, repeat: int) -> dict:
    """ms per call of both attentions for one shape, and the largest difference of their outputs."""
    torch.manual_seed(0)
    query = torch.randn(rows, new, HEADS, DIM).transpose(1, 2)   # as the model's projections lay it out
    prefix = torch.randn(2, KV_HEADS, shared, DIM)
    keys, values = torch.randn(rows, KV_HEADS, own + new, DIM), torch.randn(rows, KV_HEADS, own + new, DIM)
    mask = torch.ones(rows, 1, new, own + new, dtype=torch.bool)
    for b in range(rows):
        mask[b, :, :, :(b * 13) % min(own, 200) if own else 0] = False   # left pads
    mask[:, :, :, own:] &= torch.ones(new, new, dtype=torch.bool).tril()   # causal over the new tokens
    whole_keys = torch.cat([prefix[0:1].expand(rows, -1, -1, -1), keys], 2)
    whole_values = torch.cat([prefix[1:2].expand(rows, -1, -1, -1), values], 2)
    whole_mask = torch.cat([torch.ones(rows, 1, new, shared, dtype=torch.bool), mask], 3)
    module = SimpleNamespace(layer_idx=0)
    scale = DIM ** -0.5

    def in_every_row():
        return torch.nn.functional.scaled_dot_product_attention(query, whole_keys, whole_values, attn_mask=whole_mask,
                                                                scale=scale, enable_gqa=True).transpose(1, 2)

    def apart():
        return _attend_to_shared_prefix(module, query, keys, values, mask, scale, [prefix])

    diff = (in_every_row() - apart()).abs().max().item()
    return {"in_every_row": _time(in_every_row, repeat), "apart": _time(apart, repeat), "max_diff": diff}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.shared_prefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per figure")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--shared", type=int, default=530, help="shared prefix tokens")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    print(f"{args.rows} rows, {args.shared}-token shared prefix, {HEADS} query / {KV_HEADS} key-value heads of {DIM}, "
          f"float32")
    for name, new, own in (("prefill 72 new after 500 own", 72, 500), ("decoding step after 572 own", 1, 572)):
        for n in sorted({threads, 1}, reverse=True):
            torch.set_num_threads(n)
            r = compare(args.rows, args.shared, new, own, args.repeat)
            print(f"{name}, {n} thread(s): prefix in every row {r['in_every_row']:.2f} ms, apart {r['apart']:.2f} ms "
                  f"= {r['in_every_row'] / r['apart']:.2f}x; largest difference {r['max_diff']:.1e}")
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
