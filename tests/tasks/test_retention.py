"""Retention (train.keep_candidates): rejected checkpoints are deleted after their gate and the deletion is
recorded; the champion lineage (base and every promoted candidate) and the last N candidates are kept."""

from rsiflow.configs.loader import load_config
from rsiflow.stores.store import Store
from rsiflow.tasks.deploy import expire_checkpoints
from tests.conftest import TINY, tiny_overrides


def _run_with_candidates(tmp_path, keep: int):
    """A store with base -> r1 promoted -> r2 rejected -> r3 rejected -> r4 promoted, each with a folder."""
    cfg = load_config([TINY], tiny_overrides(tmp_path, f"train.keep_candidates={keep}"))
    models = cfg.run_dir / "models"
    roles = {1: "champion", 2: "rejected", 3: "rejected", 4: "champion"}
    with Store(cfg.run.store) as store:
        store.create_run("tiny", "tiny", {}, "tiny:0")
        with store.step("tiny", 0, "init") as tx:
            tx.insert("models", [{"model_id": "tiny/base", "path": str(tmp_path / "cache" / "tiny-0"), "role": "base"}])
        parent = "tiny/base"
        for r, role in roles.items():
            folder = models / f"round-{r}-candidate"
            folder.mkdir(parents=True)
            (folder / "model.safetensors").write_bytes(b"x" * 100)
            with store.step("tiny", r, "train") as tx:
                tx.insert("models", [{"model_id": f"tiny/r{r}/candidate", "parent_id": parent, "path": str(folder),
                                      "role": role}])
            parent = f"tiny/r{r}/candidate" if role == "champion" else parent
    return cfg, models


def _deploy_retention(cfg, round_no):
    """What the deploy step does: list, delete, record in its transaction."""
    with Store(cfg.run.store) as store:
        expired = store.expired_checkpoints("tiny", cfg.train.keep_candidates)
    deleted, elsewhere = expire_checkpoints(cfg, round_no, expired)
    with Store(cfg.run.store) as store, store.step("tiny", round_no, "deploy") as tx:
        tx.insert("deleted_checkpoints", deleted)
    return deleted, elsewhere


def test_rejected_checkpoints_are_deleted_and_recorded_and_the_lineage_kept(tmp_path):
    cfg, models = _run_with_candidates(tmp_path, keep=0)
    deleted, elsewhere = _deploy_retention(cfg, 4)
    assert [d["model_id"] for d in deleted] == ["tiny/r2/candidate", "tiny/r3/candidate"] and not elsewhere
    assert sorted(p.name for p in models.iterdir()) == ["round-1-candidate", "round-4-candidate"]
    with Store(cfg.run.store, read_only=True) as store:
        rows = store.deleted_checkpoints("tiny")
        assert [(r["model_id"], r["round"], r["bytes"]) for r in rows] == [
            ("tiny/r2/candidate", 4, 100), ("tiny/r3/candidate", 4, 100)]
        assert all(r["deleted_at"] is not None and "rejected in round" in r["reason"] for r in rows)
        # the registry keeps the rows (lineage), only the folders are gone
        assert store.has_model("tiny/r2/candidate")
        # nothing left to delete: a second pass (a rerun of deploy) deletes and records nothing more
        assert store.expired_checkpoints("tiny", 0) == []


def test_keep_candidates_keeps_the_newest_rejected_ones(tmp_path):
    cfg, models = _run_with_candidates(tmp_path, keep=2)   # the last two candidates: r4 (champion), r3 (rejected)
    deleted, _ = _deploy_retention(cfg, 4)
    assert [d["model_id"] for d in deleted] == ["tiny/r2/candidate"]
    assert sorted(p.name for p in models.iterdir()) == ["round-1-candidate", "round-3-candidate", "round-4-candidate"]


def test_a_folder_outside_the_runs_models_folder_is_left_alone(tmp_path):
    cfg, _ = _run_with_candidates(tmp_path, keep=0)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    deleted, elsewhere = expire_checkpoints(cfg, 5, [{"model_id": "x", "round": 1, "path": str(outside)}])
    assert deleted == [] and elsewhere == [str(outside.resolve())] and outside.exists()
