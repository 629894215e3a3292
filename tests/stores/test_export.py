"""Round data leaves the store as a datasets.Dataset (for TRL) and as Parquet files."""

import pyarrow.parquet as pq


def test_examples_dataset_round_trip(store):
    with store.step("r", 0, "distill") as tx:
        tx.insert("examples", [
            {"example_id": "e1", "method": "exit", "source_traj_id": "t1", "weight": 1.0,
             "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go north", "extra": 1}]},
            {"example_id": "e2", "method": "srd", "source_traj_id": "t2", "weight": 0.25,
             "messages": [{"role": "user", "content": "hello"}]},
        ])
    with store.step("r", 1, "distill") as tx:
        tx.insert("examples", [{"example_id": "other-round", "method": "exit", "messages": [], "weight": 1.0}])

    ds = store.examples_dataset("r", 0)
    assert ds.num_rows == 2
    rows = {r["example_id"]: r for r in ds}
    assert rows["e1"]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go north"}]
    assert rows["e2"]["weight"] == 0.25 and rows["e1"]["weight"] == 1.0
    assert rows["e2"]["source_traj_id"] == "t2"

    srd = store.examples_dataset("r", 0, method="srd")
    assert srd["example_id"] == ["e2"]


def test_export_parquet(store, tmp_path):
    with store.step("r", 0, "generate") as tx:
        tx.insert("trajectories", [{"traj_id": "t1"}])
        tx.insert("turns", [{"traj_id": "t1", "turn_idx": i, "token_ids": [i, i + 1]} for i in range(3)])
    paths = store.export_parquet("r", 0, tmp_path / "export" / "round_0")
    assert set(paths) == {"trajectories", "turns", "examples"}
    turns = pq.read_table(paths["turns"])
    assert turns.num_rows == 3 and turns.column("token_ids").to_pylist()[2] == [2, 3]
    assert pq.read_table(paths["examples"]).num_rows == 0
