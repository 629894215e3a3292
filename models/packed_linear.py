"""Linear layers through oneDNN with weights packed once, for the generation model on CPU.

PyTorch computes a float32 `nn.Linear` on CPU with MKL's sgemm, which re-arranges (packs) the weight matrix into its
kernel's blocked layout on every call. For the few rows of a decoding step that packing is most of the work: on the
2-core AMD EPYC this project is measured on, a decoding step of SmolLM2-135M (10 rows) spent 87 of its 137 ms in
`aten::mm`, reading the weights at ~6 GB/s where the memory gives ~28 GB/s. oneDNN, given a weight packed once
(`torch.ops.mkldnn._reorder_linear_weight`, what `torch.compile`'s CPU backend does for frozen weights), ran the
same Linear layers 1.5-3.9x faster at 3-48 rows (the lm_head at 10 rows 5x) and 1.1-1.3x at 256-4,096 rows
(prefill); the step took 81 ms. bfloat16 layers already run on oneDNN, without the packing: packed they run
1.4-1.75x faster at decoding sizes, bit for bit the same, where oneDNN packs bfloat16 weights at all (a CPU with
AVX512-BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU bfloat16 layers stay PyTorch's, `available`). In float32
the two libraries sum in different orders: outputs differ in the last bits (~1e-4 of values of ~10), as they do
between batch layouts (`python -m bench.packed` checks the generations).

`pack_linears(model)` switches every Linear of an inference model to `PackedLinear`. A call that needs gradients
runs PyTorch's own Linear (F.linear); a weight replaced (`model.to(...)`) or changed in place since it was packed is
packed again on the next call. The packed copies are extra memory (one more copy of the Linear weights; the
originals stay for everything else that reads them).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

# Rows the packing is tuned for (oneDNN takes it as a hint; any row count works): a decoding batch.
ROWS_HINT = 16
_warned: list[str] = []   # the reasons packing is off, each said once in this process


_dtype_reasons: dict[torch.dtype, str | None] = {}   # available(dtype)'s answer, found once a process


def available(dtype: torch.dtype = torch.float32) -> str | None:
    """None when Linear layers of `dtype` can run packed in this PyTorch on this CPU, else why not (a lookup after
    the first call for a dtype, so the layers ask it on every call)."""
    if dtype in _dtype_reasons:
        return _dtype_reasons[dtype]
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available():
        reason = "this PyTorch has no oneDNN (mkldnn)"
    elif not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        reason = "this PyTorch's oneDNN has no packed-weight linear ops"
    else:   # oneDNN packs bfloat16 only on CPUs with the instructions for it
        try:
            packed = ops._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), ROWS_HINT)
            ops._linear_pointwise(torch.zeros(2, 8, dtype=dtype), packed, None, "none", [], "")
            reason = None
        except RuntimeError as e:
            reason = f"oneDNN packs no {str(dtype).removeprefix('torch.')} weights on this CPU ({e})"
    _dtype_reasons[dtype] = reason
    return reason


def _say_off(reason: str) -> None:
    """Log why packing is off, once a process for each reason."""
    if reason not in _warned:
        _warned.append(reason)
        logging.getLogger(__name__).warning("packed Linear layers (backend.hf.packed_linears) are off: %s; PyTorch's "
                                            "own Linear layers run instead", reason)


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` whose inference calls run oneDNN on a packed copy of its weight (see the module's doc)."""

    _packed: torch.Tensor | None = None
    _packed_of: tuple | None = None   # the weight it was packed from: (storage, dtype, version)

    @staticmethod
    def _key(weight: torch.Tensor) -> tuple:
        """What identifies a weight's values: a new tensor (`module.to(...)`, a load) or an in-place change. A
        weight made under `torch.inference_mode` keeps no version counter: only a new tensor is seen there."""
        return weight.data_ptr(), weight.dtype, -1 if weight.is_inference() else weight._version

    def _pack(self) -> torch.Tensor:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), ROWS_HINT)
        self._packed_of = self._key(self.weight)
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype != weight.dtype
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return F.linear(x, weight, self.bias)
        if reason := available(weight.dtype):   # cast since it was packed to a dtype oneDNN can't pack here
            _say_off(reason)
            return F.linear(x, weight, self.bias)
        packed = self._packed if self._packed_of == self._key(weight) else self._pack()
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Switch the float32/bfloat16 Linear layers of `model` (on CPU) to `PackedLinear` and pack their weights now.
    Returns how many were switched (none of a dtype `available(dtype)` says why not: logged as a warning, once a
    process for each reason)."""
    n = 0
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
                and module.weight.dtype in (torch.float32, torch.bfloat16)):
            if reason := available(module.weight.dtype):
                _say_off(reason)
                continue
            module.__class__ = PackedLinear
            module._pack()
            n += 1
    return n
