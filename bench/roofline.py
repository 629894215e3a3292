"""The machine's limit for a model, measured in the same run as the figure it bounds.

A dense decoder's matmul work per token is 2 FLOPs per weight of its Linear layers (lm_head included;
attention's context term, which grows with the context, left out): `flops_per_token`. Its forward pass can at
best run at the matmul throughput this device reaches in the model's dtype, on a matmul of the model's own
shape: `matmul_flops`. Their ratio is the processed tokens/s (prefill + generated) that no engine exceeds;
training does about 3x the forward work per token (the backward pass computes two matmuls for each of the
forward's), so its limit is a third of that.

That compute roof bounds work where each weight read serves many tokens (prefill, training). A decoding step
feeds one token per row, so it also reads every weight once for the whole batch and each row's cached keys and
values: `decode_step_bytes`. At the memory bandwidth the device reaches (`read_bandwidth`, measured the same
way), a step can take no less than its bytes over that bandwidth, nor less than its FLOPs over the matmul
throughput; the larger of the two is the step's limit (`decode_step_limit`): a roofline with both roofs.
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


def matmul_flops(model, tokens: int = 512, seconds: float = 2.0, windows: int = 4) -> float:
    """FLOP/s of a (tokens x hidden) @ (hidden x intermediate) matmul, the model's MLP up-projection shape, in
    the model's dtype on the model's device, after a warm-up (CPU: this process's torch threads): the best of
    `windows` timing windows sharing `seconds`. A limit is what the machine can reach: on the 2-core CPU single
    2-second windows read 149-196 GFLOP/s in one quiet session, so the best window is taken, not the mean. On CPU
    the same product also runs through oneDNN on a packed weight (models.packed_linear, what the hf backend uses)
    for as long again, and the faster library sets the limit."""
    from rsiflow.models.packed_linear import available, pack_linears

    p = next(model.parameters())
    hidden = model.config.hidden_size
    inter = getattr(model.config, "intermediate_size", 4 * hidden)
    if p.device.type == "cuda":   # a GPU needs far more work per call to reach its throughput
        tokens = max(tokens, 8192)
    a = torch.randn(tokens, hidden, device=p.device, dtype=p.dtype)
    b = torch.randn(hidden, inter, device=p.device, dtype=p.dtype)
    products = [lambda: a @ b]
    if p.device.type == "cpu" and not available(p.dtype):
        linear = torch.nn.Linear(hidden, inter, bias=False, dtype=p.dtype).requires_grad_(False)
        linear.weight.copy_(b.t())
        pack_linears(linear)
        products.append(lambda: linear(a))
    best = 0.0
    for product in products:
        for _ in range(3):
            product()
        _sync(p.device)
        for _ in range(windows):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / windows:
                for _ in range(5):
                    product()
                n += 5
                _sync(p.device)
            best = max(best, 2 * tokens * hidden * inter * n / (time.perf_counter() - t0))
    return best


def read_bandwidth(device: torch.device | str = "cpu", gib: float = 1.0, seconds: float = 2.0) -> float:
    """Bytes/s this process reads from memory: a float32 sum over `gib` GiB (far beyond the caches) repeated
    over `seconds` after a warm-up, on `device` (CPU: this process's torch threads)."""
    device = torch.device(device)
    x = torch.ones(int(gib * 2**30) // 4, device=device)
    x.sum()
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x.sum()
        n += 1
        _sync(device)
    return n * x.numel() * 4 / (time.perf_counter() - t0)


def weight_bytes(model) -> int:
    """Bytes of every parameter (tied embeddings counted once): what one forward pass reads at least once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_position(model, kv_dtype: torch.dtype | None = None) -> int:
    """Bytes of the cached keys and values of one position of one row, over all layers."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    size = torch.empty((), dtype=kv_dtype or next(model.parameters()).dtype).element_size()
    return 2 * cfg.num_hidden_layers * heads * head_dim * size


def decode_step_bytes(model, rows: int, context: int, kv_dtype: torch.dtype | None = None, shared: int = 0) -> int:
    """Least bytes a decoding step of `rows` rows over `context` cached positions each (pads included: the kernel
    reads them) and `shared` positions all rows attend to from one copy moves: the weights once, each row's keys
    and values once, the shared ones once."""
    return weight_bytes(model) + (rows * context + shared) * kv_bytes_per_position(model, kv_dtype)


def decode_step_limit(model, rows: int, context: int, flops: float, bandwidth: float,
                      kv_dtype: torch.dtype | None = None, shared: int = 0) -> float:
    """Least seconds for one decoding step: the larger of its matmul FLOPs over `flops` (FLOP/s) and its bytes
    over `bandwidth` (bytes/s)."""
    return max(rows * flops_per_token(model) / flops,
               decode_step_bytes(model, rows, context, kv_dtype, shared) / bandwidth)


def describe(model) -> str:
    """Where the limit was measured: device, dtype and (CPU) threads."""
    p = next(model.parameters())
    if p.device.type == "cuda":
        where = torch.cuda.get_device_name(p.device)
    else:
        where = f"cpu, {torch.get_num_threads()} threads"
    return f"{str(p.dtype).removeprefix('torch.')} on {where}"
