"""Packed Linear layers (models/packed_linear.py, `backend.hf.packed_linears`): the same products as PyTorch's
Linear (float32 to the last bits, bfloat16 exactly), a weight changed in place is repacked, training is untouched,
and the hf backend generates the same tokens with them as without."""

import pytest
import torch

from rsiflow.models.backend import SamplingParams
from rsiflow.models.hf_backend import HFBackend
from rsiflow.models.packed_linear import PackedLinear, available, pack_linears

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no packed Linear layers here: {available()}")
BF16_PACKED = available(torch.bfloat16) is None   # oneDNN packs bf16 on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.SiLU(), torch.nn.Linear(96, 40, bias=False)).to(dtype)


@pytest.mark.parametrize("rows", [1, 3, 16, 200])
def test_packed_layers_compute_what_pytorch_computes(rows):
    plain, packed = _model(), _model()
    assert pack_linears(packed) == 2 and all(type(m) is PackedLinear for m in (packed[0], packed[2]))
    x = torch.randn(2, rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)
    plain_bf16, packed_bf16 = _model(torch.bfloat16), _model(torch.bfloat16)
    assert pack_linears(packed_bf16) == (2 if BF16_PACKED else 0)   # elsewhere left as they are
    with torch.inference_mode():
        assert torch.equal(packed_bf16(x.bfloat16()), plain_bf16(x.bfloat16()))   # the same oneDNN kernel


def test_a_weight_changed_or_replaced_is_repacked_and_training_gets_gradients():
    plain, packed = _model(), _model()
    pack_linears(packed)
    x = torch.randn(5, 48)
    with torch.no_grad():
        for p, q in zip(plain.parameters(), packed.parameters()):
            p.mul_(-0.5)
            q.mul_(-0.5)
    stale = packed[0]._packed_of
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)
    assert stale != packed[0]._packed_of == PackedLinear._key(packed[0].weight)   # the inference call repacked it
    plain.to(torch.bfloat16), packed.to(torch.bfloat16)   # new weight tensors: packed again, in their dtype
    with torch.inference_mode():   # (where oneDNN packs no bf16, PyTorch's own Linear runs them)
        assert torch.equal(packed(x.bfloat16()), plain(x.bfloat16()))
    assert (packed[0]._packed_of[1] == torch.bfloat16) == BF16_PACKED
    plain.float(), packed.float()
    packed(x).sum().backward()   # grad enabled, weights that need it: PyTorch's own Linear, with autograd
    plain(x).sum().backward()
    for p, q in zip(plain.parameters(), packed.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_the_backend_generates_the_same_tokens_with_packed_layers(tiny_path):
    prompts = [[{"role": "user", "content": f"Room {i}: " + "a dusty corridor, " * (2 * i) + "Your action:"}]
               for i in range(5)]
    plain = HFBackend(tiny_path, max_batch_size=4, kv_reuse=True, packed_linears=False)
    packed = HFBackend(tiny_path, max_batch_size=4, kv_reuse=True)
    assert not any(type(m) is PackedLinear for m in plain.model.modules())
    assert sum(type(m) is PackedLinear for m in packed.model.modules()) == sum(
        isinstance(m, torch.nn.Linear) for m in plain.model.modules())
    for params in (SamplingParams(max_new_tokens=8, temperature=0.0),
                   SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.95, seed=3)):
        want, got = plain.generate(prompts, params), packed.generate(prompts, params)
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)


def test_a_model_made_under_inference_mode_is_packed_and_runs():
    plain = _model()
    with torch.inference_mode():
        made = _model()   # inference tensors: no version counter
        assert made[0].weight.is_inference()
        pack_linears(made)
        x = torch.randn(3, 48)
        torch.testing.assert_close(made(x), plain(x), rtol=1e-5, atol=1e-5)


def test_where_packing_cannot_run_the_model_is_left_as_it_is_and_a_warning_says_why(monkeypatch, caplog):
    from rsiflow.models import packed_linear

    monkeypatch.setattr(packed_linear, "available", lambda dtype=torch.float32: "no oneDNN here")
    monkeypatch.setattr(packed_linear, "_warned", [])
    model = _model()
    with caplog.at_level("WARNING", logger=packed_linear.__name__):
        assert pack_linears(model) == 0 and pack_linears(_model()) == 0
    assert not any(type(m) is PackedLinear for m in model.modules())
    said = [r.getMessage() for r in caplog.records if "packed Linear layers" in r.getMessage()]
    assert said == ["packed Linear layers (backend.hf.packed_linears) are off: no oneDNN here; PyTorch's own Linear "
                    "layers run instead"]   # once a process


def test_a_dtype_onednn_cannot_pack_on_this_cpu_is_left_to_pytorch(monkeypatch, caplog):
    """An AVX2-only CPU: oneDNN refuses to pack bfloat16 weights. Those layers stay PyTorch's (said once); float32
    ones in the same model are packed; a packed layer later cast to that dtype runs PyTorch's Linear."""
    from rsiflow.models import packed_linear

    def refuse(*args):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(packed_linear, "_dtype_reasons", {})
    monkeypatch.setattr(packed_linear, "_warned", [])
    real = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda w, rows: refuse() if w.dtype == torch.bfloat16 else real(w, rows), raising=False)
    mixed = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).bfloat16())
    with caplog.at_level("WARNING", logger=packed_linear.__name__):
        assert pack_linears(mixed) == 1 and pack_linears(_model(torch.bfloat16)) == 0
    assert type(mixed[0]) is PackedLinear and type(mixed[1]) is torch.nn.Linear
    said = [r.getMessage() for r in caplog.records if "packed Linear layers" in r.getMessage()]
    assert len(said) == 1 and "oneDNN packs no bfloat16 weights on this CPU (mkldnn_reorder" in said[0]
    plain, packed = _model(), _model()
    pack_linears(packed)
    plain.to(torch.bfloat16), packed.to(torch.bfloat16)
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), plain(x))
