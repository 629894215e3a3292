"""Untrained assistant messages (an SFT row's `untrained`): kept in the conversation as context, never labelled."""

from transformers import AutoTokenizer

from rsiflow.models.encoding import encode_rows, tokenize_conversation
from tests.models.test_trainer_sft import labelled_spans

MSGS = [{"role": "system", "content": "Solve it."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "Let me think"},          # 2: no answer (invalid action)
        {"role": "user", "content": "Reply with an answer."},
        {"role": "assistant", "content": "answer: 5"},             # 4: the corrected one
        {"role": "user", "content": "And 1+1?"},
        {"role": "assistant", "content": "answer: 2"}]             # 6



def _decoded(tok, out: dict) -> list[str]:
    return [tok.decode(s).replace("<|im_end|>", "").strip() for s in labelled_spans(out)]


def test_an_untrained_assistant_message_gets_no_labels_the_others_keep_theirs(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    every = tokenize_conversation(tok, MSGS, 1)
    skipped = tokenize_conversation(tok, MSGS, 1, untrained={2})
    assert _decoded(tok, every) == ["Let me think", "answer: 5", "answer: 2"]
    assert _decoded(tok, skipped) == ["answer: 5", "answer: 2"]
    assert skipped["input_ids"] == every["input_ids"]             # still in the conversation, as context
    # the other messages' labels are the very same tokens at the same positions
    kept = [i for i, lab in enumerate(skipped["labels"]) if lab != -100]
    assert all(every["labels"][i] == skipped["labels"][i] for i in kept)
    assert len(kept) < sum(lab != -100 for lab in every["labels"])


def test_encode_rows_honours_the_rows_untrained_key(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    row = {"example_id": "a", "kind": "sft", "messages": MSGS, "weight": 1.0, "train_from": 1}
    (plain,), _ = encode_rows(tok, [row], 512)
    (skipping,), _ = encode_rows(tok, [{**row, "untrained": [2, 6]}], 512)
    assert _decoded(tok, plain) == ["Let me think", "answer: 5", "answer: 2"]
    assert _decoded(tok, skipping) == ["answer: 5"]
    assert skipping["input_ids"] == plain["input_ids"]
