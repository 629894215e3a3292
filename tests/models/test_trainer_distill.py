"""Privileged-teacher distillation: the divergence by hand, the alignment check, the trainer on a tiny model."""

import math

import pytest
import torch
from transformers import AutoTokenizer

from rsiflow.configs.schema import TrainConfig
from rsiflow.models.encoding import MisalignedCompletion, encode_pair
from rsiflow.models.loading import load_model_and_tokenizer
from rsiflow.models.losses import importance_weights, topk_divergence
from rsiflow.models.sft_trainer import DistillLoss
from rsiflow.models.trainer import train_candidate

# teacher p = [0.5, 0.3, 0.15, 0.05], student q uniform; k = 2: the teacher's top-2 are tokens 0 and 1,
# the tail bucket holds the rest: T = [0.5, 0.3, 0.2], S = [0.25, 0.25, 0.5].
P = [0.5, 0.3, 0.15, 0.05]
Q = [0.25, 0.25, 0.25, 0.25]
T = [0.5, 0.3, 0.2]
S = [0.25, 0.25, 0.5]


def _kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b))


def _logits(p):
    return torch.log(torch.tensor([p], dtype=torch.float64))


def test_forward_and_reverse_kl_with_tail_bucket_by_hand():
    fwd = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.5)
    rev = 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(0.25 / 0.3) + 0.5 * math.log(0.5 / 0.2)
    assert fwd == pytest.approx(0.218012, abs=1e-6) and rev == pytest.approx(0.239278, abs=1e-6)
    got_f = topk_divergence(_logits(P), _logits(Q), top_k=2, divergence="forward_kl")
    got_r = topk_divergence(_logits(P), _logits(Q), top_k=2, divergence="reverse_kl")
    assert got_f.item() == pytest.approx(fwd, abs=1e-6)
    assert got_r.item() == pytest.approx(rev, abs=1e-6)


def test_generalized_jsd_with_tail_bucket_by_hand():
    for beta in (0.5, 0.2):
        m = [beta * t + (1 - beta) * s for t, s in zip(T, S)]
        want = beta * _kl(T, m) + (1 - beta) * _kl(S, m)
        got = topk_divergence(_logits(P), _logits(Q), top_k=2, divergence="jsd", beta=beta)
        assert got.item() == pytest.approx(want, abs=1e-6)
    assert topk_divergence(_logits(P), _logits(Q), top_k=2).item() == pytest.approx(0.055582, abs=1e-5)


def test_without_the_tail_bucket_the_figure_would_differ():
    # Renormalising the top-2 instead (T' = [0.625, 0.375], S' = [0.5, 0.5]) gives another number:
    # the tail bucket is what is computed.
    renorm = _kl([0.625, 0.375], [0.5, 0.5])
    got = topk_divergence(_logits(P), _logits(Q), top_k=2, divergence="forward_kl").item()
    assert abs(got - renorm) > 0.1


def test_full_support_is_the_exact_divergence_and_zero_for_equal_distributions():
    full = topk_divergence(_logits(P), _logits(Q), top_k=4, divergence="forward_kl").item()
    assert full == pytest.approx(_kl(P, Q), abs=1e-6)
    same = topk_divergence(_logits(P), _logits(P), top_k=2)
    assert same.item() == pytest.approx(0.0, abs=1e-6)


def test_matches_trl_self_distillation_divergence_where_it_exists():
    loss_utils = pytest.importorskip("trl.experimental.sdft.loss_utils")
    t_top, idx = torch.topk(torch.log_softmax(_logits(P), -1), 2)
    s_top = torch.gather(torch.log_softmax(_logits(Q), -1), -1, idx)
    t_tail, s_tail = loss_utils.add_tail_bucket(t_top), loss_utils.add_tail_bucket(s_top)
    for beta in (0.0, 0.5, 1.0):  # TRL's alpha: 0 = forward KL(T||S), 1 = reverse KL(S||T)
        theirs = loss_utils.compute_divergence(s_tail, t_tail, beta).item()
        kind = {0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd")
        ours = topk_divergence(_logits(P), _logits(Q), top_k=2, divergence=kind, beta=0.5).item()
        assert ours == pytest.approx(theirs, abs=1e-6)


def test_gradient_flows_to_the_student_only():
    t = _logits(P).clone().requires_grad_(True)
    s = _logits(Q).clone().requires_grad_(True)
    topk_divergence(t, s, top_k=2).sum().backward()
    assert t.grad is None or torch.all(t.grad == 0)
    assert s.grad is not None and torch.any(s.grad != 0)


def test_importance_weights_are_clipped_detached_and_one_where_unknown():
    now = torch.tensor([0.0, -1.0, -3.0], requires_grad=True)
    sampled = torch.tensor([-2.0, -1.0, float("nan")])
    w = importance_weights(now, sampled, clip=2.0)
    assert w.tolist() == pytest.approx([2.0, 1.0, 1.0])  # exp(2) clipped to 2; equal -> 1; unknown -> 1
    assert not w.requires_grad
    assert importance_weights(now, sampled, clip=None).tolist() == [1.0, 1.0, 1.0]


@pytest.fixture(scope="module")
def tok(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path)


def _pair():
    student = [{"role": "system", "content": "You act."},
               {"role": "user", "content": "Task: put a mug on the desk.\n\nPredict the pitfalls."},
               {"role": "assistant", "content": "Error: the mug was dirty.\nRule: clean it first."}]
    teacher = [dict(m) for m in student]
    teacher[1] = {"role": "user", "content": "Task: put a mug on the desk.\n\nObserved pitfalls (privileged, do not "
                  "reveal):\nthe mug is in the fridge\n\nPredict the pitfalls."}
    return student, teacher


def test_encode_pair_lines_up_the_completion(tok):
    student, teacher = _pair()
    enc = encode_pair(tok, student, teacher, train_from=2)
    s_tok = [enc["input_ids"][i] for i in enc["student_pos"]]
    t_tok = [enc["teacher_input_ids"][i] for i in enc["teacher_pos"]]
    assert s_tok == t_tok and len(s_tok) > 5
    assert len(enc["teacher_input_ids"]) > len(enc["input_ids"])  # the privileged text is in the teacher only
    assert tok.decode(s_tok).startswith("Error: the mug was dirty.")
    assert all(lab == -100 for lab in enc["labels"])  # no SFT loss on a distillation row


def test_a_misaligned_completion_is_detected(tok):
    student, teacher = _pair()
    # privileged text leaking into the teacher's assistant turn changes the completion tokens
    leaked = [dict(m) for m in student]
    leaked[2] = {"role": "assistant", "content": "(the mug is in the fridge) " + student[2]["content"]}
    with pytest.raises(MisalignedCompletion, match="differ"):
        encode_pair(tok, student, leaked, train_from=2)
    with pytest.raises(MisalignedCompletion, match="no completion"):
        encode_pair(tok, student[:2], teacher[:2], train_from=2)


def test_sampled_logprobs_attach_only_when_the_encoding_reproduces_the_sampled_tokens(tok):
    student, teacher = _pair()
    ids = tok(student[2]["content"], add_special_tokens=False)["input_ids"]
    enc = encode_pair(tok, student, teacher, 2, completion_ids=ids, sampling_logprobs=[-0.5] * len(ids))
    assert enc["sampled_match"] and enc["sampled_logprobs"][: len(ids)] == [-0.5] * len(ids)
    assert all(math.isnan(x) for x in enc["sampled_logprobs"][len(ids):])  # the end-of-turn tokens
    other = encode_pair(tok, student, teacher, 2, completion_ids=[ids[0] + 1] + ids[1:],
                        sampling_logprobs=[-0.5] * len(ids))
    assert not other["sampled_match"] and all(math.isnan(x) for x in other["sampled_logprobs"])


def test_distillation_alone_trains_and_shrinks_the_divergence(tiny_path, tmp_path, tok):
    student, teacher = _pair()
    examples = [{"example_id": f"d{i}", "kind": "distill", "student": student, "teacher": teacher,
                 "train_from": 2, "weight": 1.0}
                for i in range(4)]
    cfg = TrainConfig(learning_rate=1e-3, epochs=6, batch_size=2)
    metrics, used = train_candidate(tiny_path, examples, tmp_path / "cand", cfg,
                                    distill=DistillLoss(loss_weight=1.0, ema_rate=0.0, top_k=16))
    assert used == [f"d{i}" for i in range(4)]
    assert metrics["distill_examples"] == 4 and metrics["distill_misaligned"] == 0 and metrics["steps"] == 12
    assert metrics["distill_loss_first"] > 0
    assert metrics["distill_loss_last"] < 0.9 * metrics["distill_loss_first"]
    # the saved candidate moved away from its parent
    parent, _ = load_model_and_tokenizer(tiny_path)
    child, _ = load_model_and_tokenizer(tmp_path / "cand")
    assert any(not torch.equal(a, b) for a, b in zip(parent.parameters(), child.parameters()))


def test_mixed_sft_and_distillation_batches_with_an_ema_teacher(tiny_path, tmp_path, tok):
    student, teacher = _pair()
    sft = [{"example_id": f"s{i}", "kind": "sft", "messages": student, "weight": 1.0, "train_from": 2}
           for i in range(2)]
    dis = [{"example_id": f"d{i}", "kind": "distill", "student": student, "teacher": teacher,
            "train_from": 2, "weight": 0.5}
           for i in range(2)]
    leaked = [dict(m) for m in student]
    leaked[2] = {"role": "assistant", "content": "leak " + student[2]["content"]}
    dis.append({"example_id": "bad", "kind": "distill", "student": student, "teacher": leaked, "train_from": 2})
    cfg = TrainConfig(learning_rate=1e-4, epochs=1, batch_size=4)
    metrics, used = train_candidate(tiny_path, sft + dis, tmp_path / "cand", cfg,
                                    distill=DistillLoss(loss_weight=0.01, ema_rate=0.05))
    assert sorted(used) == ["d0", "d1", "s0", "s1"]  # the misaligned pair was dropped and counted
    assert metrics["distill_misaligned"] == 1 and metrics["examples"] == 2 and metrics["distill_examples"] == 2
    assert metrics["ema_teacher"] is True and math.isfinite(metrics["train_loss"])


def test_the_loss_does_not_grow_with_gradient_accumulation(tiny_path, tmp_path, tok):
    """One optimizer step over the same 4 rows (2 SFT, 2 distillation) as 1 batch of 4 or as 2 micro-batches
    of 2 gives the same update: the SFT term is normalised over the accumulated step's tokens and the
    distillation term divided by the micro-batches (it used to be summed over them: grad_accum × λ)."""
    student, teacher = _pair()
    rows = [{"example_id": "s0", "kind": "sft", "messages": student, "weight": 1.0, "train_from": 2},
            {"example_id": "d0", "kind": "distill", "student": student, "teacher": teacher, "train_from": 2},
            {"example_id": "s1", "kind": "sft", "messages": student, "weight": 1.0, "train_from": 2},
            {"example_id": "d1", "kind": "distill", "student": student, "teacher": teacher, "train_from": 2}]
    loss = DistillLoss(loss_weight=50.0, ema_rate=0.0, top_k=16, is_clip=None)
    params = {}
    for name, batch, accum in (("one", 4, 1), ("accum", 2, 2)):
        # one step: no warm-up (the default's first step is at learning rate 0)
        cfg = TrainConfig(learning_rate=1e-3, epochs=1, batch_size=batch, grad_accum=accum, warmup_ratio=0.0,
                          lr_scheduler="constant")
        metrics, _ = train_candidate(tiny_path, rows, tmp_path / name, cfg, distill=loss, seed=0)
        assert metrics["steps"] == 1
        params[name], _ = load_model_and_tokenizer(tmp_path / name)
    parent, _ = load_model_and_tokenizer(tiny_path)
    moved = [(a - p).abs().sum().item() for a, p in zip(params["one"].parameters(), parent.parameters())]
    diff = [(a - b).abs().sum().item() for a, b in zip(params["one"].parameters(), params["accum"].parameters())]
    assert sum(moved) > 0 and sum(diff) < 1e-3 * sum(moved)


def test_two_methods_distill_together_each_with_its_own_weight(tiny_path, tmp_path, tok):
    """Several distillation terms (SRD's and RSIPO's, say) train in one run: each is normalised over its own rows
    and weighted by its own λ. With RSIPO's λ = 0 the step equals one that has SRD's rows alone."""
    student, teacher = _pair()
    sft = [{"example_id": f"s{i}", "kind": "sft", "messages": student, "weight": 1.0, "train_from": 2}
           for i in range(2)]

    def dis(term, i, weight):
        return {"example_id": f"{term}{i}", "kind": "distill", "student": student, "teacher": teacher,
                "train_from": 2, "weight": weight, "term": term}

    srd = [dis("srd", i, 1.0) for i in range(2)]
    rsipo = [dis("rsipo", i, 3.0) for i in range(2)]
    cfg = TrainConfig(learning_rate=1e-3, epochs=1, batch_size=6, warmup_ratio=0.0, lr_scheduler="constant")
    srd_loss = DistillLoss(loss_weight=50.0, ema_rate=0.0, top_k=16, is_clip=None)
    both, _ = train_candidate(tiny_path, sft + srd + rsipo, tmp_path / "both", cfg, seed=0,
                              distill={"srd": srd_loss, "rsipo": DistillLoss(loss_weight=0.0, ema_rate=0.0, top_k=16,
                                                                             is_clip=None, normalise="rows")})
    alone, _ = train_candidate(tiny_path, sft + [{k: v for k, v in r.items() if k != "term"} for r in srd],
                               tmp_path / "alone", cfg, seed=0, distill=srd_loss)
    assert both["steps"] == alone["steps"] == 1
    terms = both["distill_terms"]
    assert terms["srd"]["rows"] == 2 and terms["rsipo"]["rows"] == 2 and terms["rsipo"]["loss_weight"] == 0.0
    assert terms["srd"]["loss_mean"] == pytest.approx(alone["distill_loss_mean"], rel=1e-5)
    assert terms["rsipo"]["loss_mean"] > 0   # computed and logged, weighted by 0
    a, _ = load_model_and_tokenizer(tmp_path / "both")
    b, _ = load_model_and_tokenizer(tmp_path / "alone")
    parent, _ = load_model_and_tokenizer(tiny_path)
    moved = sum((x - p).abs().sum().item() for x, p in zip(b.parameters(), parent.parameters()))
    diff = sum((x - y).abs().sum().item() for x, y in zip(a.parameters(), b.parameters()))
    assert moved > 0 and diff < 1e-3 * moved
    with pytest.raises(ValueError, match="term 'mass' is not one of"):
        train_candidate(tiny_path, [dis("mass", 0, 1.0)], tmp_path / "bad", cfg,
                        distill={"srd": srd_loss, "rsipo": srd_loss})
