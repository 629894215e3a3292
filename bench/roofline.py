"""The machine's limit for a model, measured in the same run as the figure it bounds.

A dense decoder's matmul work per token is 2 FLOPs per weight of its Linear layers (lm_head included;
attention's context term, which grows with the context, left out): `flops_per_token`. Its forward pass can at
best run at the matmul throughput this device reaches in the model's dtype, on a matmul of the model's own
shape: `matmul_flops`. Their ratio is the processed tokens/s (prefill + generated) that no engine exceeds;
training does about 3x the forward work per token (the backward pass computes two matmuls for each of the
forward's), so its limit is a third of that.
"""

from __future__ import annotations

import time

import torch


def flops_per_token(model) -> float:
    """2 x the weights of every Linear layer (lm_head included): matmul FLOPs of one token's forward pass."""
    return 2.0 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(model, tokens: int = 512, seconds: float = 2.0) -> float:
    """FLOP/s of a (tokens x hidden) @ (hidden x intermediate) matmul, the model's MLP up-projection shape, in
    the model's dtype on the model's device, over `seconds` after a warm-up (CPU: this process's torch threads)."""
    p = next(model.parameters())
    hidden = model.config.hidden_size
    inter = getattr(model.config, "intermediate_size", 4 * hidden)
    if p.device.type == "cuda":   # a GPU needs far more work per call to reach its throughput
        tokens = max(tokens, 8192)
    a = torch.randn(tokens, hidden, device=p.device, dtype=p.dtype)
    b = torch.randn(hidden, inter, device=p.device, dtype=p.dtype)
    for _ in range(3):
        a @ b
    _sync(p.device)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ b
        n += 10
        _sync(p.device)
    return 2 * tokens * hidden * inter * n / (time.perf_counter() - t0)


def describe(model) -> str:
    """Where the limit was measured: device, dtype and (CPU) threads."""
    p = next(model.parameters())
    if p.device.type == "cuda":
        where = torch.cuda.get_device_name(p.device)
    else:
        where = f"cpu, {torch.get_num_threads()} threads"
    return f"{str(p.dtype).removeprefix('torch.')} on {where}"
