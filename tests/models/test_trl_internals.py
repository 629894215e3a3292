"""The TRL internals the trainers (models/sft_trainer.py, models/grpo_trainer.py) rely on, named one by one: a TRL
release that renames one, changes its parameters or makes the GRPO loss read a batch key rsiflow does not build
fails here, with a message that says which, instead of deep inside a training round. constraints.txt pins the
TRL these were checked on."""

import inspect
import re

import pytest
import trl
from trl import GRPOTrainer, SFTTrainer


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


# (owner, name, the leading parameters rsiflow passes, in order)
METHODS = [
    (GRPOTrainer, "_get_per_token_logps_and_entropies",
     ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
      "compute_aux_loss"]),
    (GRPOTrainer, "_compute_loss", ["self", "model", "inputs"]),
    (GRPOTrainer, "_prepare_inputs", ["self"]),
    (SFTTrainer, "_set_signature_columns_if_needed", ["self"]),
]


@pytest.mark.parametrize(("owner", "name", "leading"), METHODS, ids=[f"{o.__name__}.{n}" for o, n, _ in METHODS])
def test_the_private_methods_the_trainer_overrides_or_calls_keep_their_parameters(owner, name, leading):
    fn = getattr(owner, name, None)
    assert fn is not None, (f"TRL {trl.__version__}: {owner.__name__}.{name} is gone; the trainers override or "
                            "calls it (pin trl as constraints.txt does, or port the trainer)")
    got = _params(fn)[:len(leading)]
    assert got == leading, (f"TRL {trl.__version__}: {owner.__name__}.{name} takes {got}, the trainers pass "
                            f"{leading}")


def _collate_keys() -> set[str]:
    from rsiflow.models.collate import collate_pg

    row = {"prompt_ids": [1, 2], "completion_ids": [3], "action_mask": [1], "old_logps": [-1.0], "weights": [1.0],
           "advantage": 1.0}
    return set(collate_pg([row], pad_id=0)) | {"num_items_in_batch"}


def test_collate_pg_builds_every_key_the_grpo_loss_reads():
    """GRPOTrainer._compute_loss reads the batch by key; models.collate.collate_pg builds those keys (the trainer
    adds num_items_in_batch). importance_sampling_ratio is read only when TRL generates with vLLM itself
    (use_vllm), which rsiflow never does: its rows are stored, its own mismatch correction weights the advantages."""
    read = set(re.findall(r'inputs\["(\w+)"\]', inspect.getsource(GRPOTrainer._compute_loss)))
    missing = read - _collate_keys() - {"importance_sampling_ratio"}
    assert read, f"TRL {trl.__version__}: GRPOTrainer._compute_loss no longer reads its batch by key"
    assert not missing, (f"TRL {trl.__version__}: GRPOTrainer._compute_loss reads {sorted(missing)}, which "
                         "models.collate.collate_pg does not build")


def test_the_helpers_the_trainer_imports_from_trl_exist():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: F401
    from trl.trainer.utils import add_fused_lm_head

    assert _params(add_fused_lm_head)[:2] == ["model", "temperature"], _params(add_fused_lm_head)
