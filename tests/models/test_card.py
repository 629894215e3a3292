"""Model cards: README.md in a checkpoint folder with rsiflow's facts as front matter, updated after the gate,
readable by huggingface_hub, and no obstacle to from_pretrained."""

from rsiflow.models.card import read_model_card, update_model_card, write_model_card

FACTS = {"model_id": "demo/r2/candidate", "run": "demo", "round": 2, "parent_id": "demo/r1/candidate",
         "parent_path": "/runs/demo/models/round-1-candidate", "methods": ["exit", "srd"],
         "examples": {"exit": 3, "srd": 5}, "trained_rows": 8,
         "training": {"steps": 4, "train_loss": 1.5, "first_loss": 2.0, "last_loss": 1.0, "learning_rate": 2e-5,
                      "epochs": 2.0, "lora": False}, "gate": None, "created": "2026-12-01T10:00:00"}


def test_card_round_trips_and_gets_the_gate_evidence(tmp_path):
    write_model_card(tmp_path, FACTS)
    assert read_model_card(tmp_path) == FACTS
    text = (tmp_path / "README.md").read_text()
    assert "from `demo/r1/candidate`" in text and "exit 3, srd 5; 8 rows trained on" in text
    assert "loss 2.000 → 1.000 (mean 1.500)" in text and "not gated yet" in text
    gate = {"round": 2, "decision": "reject", "rule": "paired_test", "n": 24, "wins": 1, "losses": 2,
            "p_value": 0.875, "candidate": "3/24", "champion": "4/24", "champion_id": "demo/r1/candidate"}
    update_model_card(tmp_path, gate=gate)
    assert read_model_card(tmp_path) == {**FACTS, "gate": gate}
    text = (tmp_path / "README.md").read_text()
    assert ("**reject** in round 2 (rule paired_test): candidate 3/24 vs champion 4/24 on the same 24 held-out "
            "tasks, 1 wins, 2 losses, p = 0.875") in text


def test_huggingface_hub_reads_the_card_and_from_pretrained_loads_the_folder(tmp_path, tiny_path):
    import shutil

    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_path, folder)
    write_model_card(folder, FACTS)
    card = ModelCard.load(folder / "README.md")
    assert card.data.rsiflow["parent_id"] == "demo/r1/candidate" and "rsiflow-srd" in card.data.tags
    assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == "llama"


def test_a_base_checkpoint_rsiflow_makes_has_a_card(tmp_path, model_cache):
    from rsiflow.models.loading import EMBEDDED_DIRNAME, resolve_base_model

    if (model_cache / EMBEDDED_DIRNAME / "config.json").is_file():   # its tokenizer, without the GGUF conversion
        (tmp_path / EMBEDDED_DIRNAME).symlink_to(model_cache / EMBEDDED_DIRNAME)
    folder = resolve_base_model("tiny:7", tmp_path)
    assert read_model_card(folder)["name"] == "tiny:7"
    assert "randomly initialised" in (folder / "README.md").read_text()
