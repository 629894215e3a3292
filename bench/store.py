"""Store throughput against DuckDB's own Arrow bulk insert of the same rows, in the same run.

    python -m bench.store [--turns 1000000] [--examples 50000]

1. Baseline: a fresh store file, then `INSERT INTO turns SELECT * FROM <arrow table>` straight
   through DuckDB (one transaction), N synthetic turns with 10 token ids and 10 logprobs each.
2. The store's API: a fresh store file, `with store.step(...) as tx: tx.insert("turns", table)`
   (the step transaction: delete the key's rows, insert, mark the step completed, commit).
3. Rerunning that step (replace: deletes N rows, inserts N again).
4. A round's examples (M conversations) to `datasets.Dataset` through Arrow, and the lineage
   queries of the README on that store.
Prints seconds and ratios to the baseline (budget: the store's insert ≤ 2× the raw insert).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from rsiflow.stores.store import Store


def synthetic_turns(n: int, run_id: str, round_no: int, step: str) -> pa.Table:
    rng = np.random.default_rng(0)
    per = 10
    ids = pa.ListArray.from_arrays(np.arange(0, (n + 1) * per, per, dtype=np.int32),
                                   pa.array(rng.integers(0, 49152, n * per, dtype=np.int32)))
    lps = pa.ListArray.from_arrays(np.arange(0, (n + 1) * per, per, dtype=np.int32),
                                   pa.array(-rng.random(n * per, dtype=np.float32)))
    traj = np.char.add("traj-", (np.arange(n) // 8).astype(str))
    return pa.table({
        "traj_id": pa.array(traj), "run_id": pa.array([run_id] * n), "round": pa.array([round_no] * n, pa.int32()),
        "step": pa.array([step] * n), "turn_idx": pa.array(np.arange(n) % 8, pa.int32()),
        "observation": pa.array(["You arrive at cabinet 1. The cabinet 1 is closed."] * n),
        "action_text": pa.array(["open cabinet 1"] * n), "raw_text": pa.nulls(n, pa.string()),
        "action_symbol": pa.array(["open<receptacle>"] * n), "token_ids": ids, "logprobs": lps,
        "reward": pa.array(np.zeros(n)), "done": pa.array(np.zeros(n, bool)), "valid": pa.array(np.ones(n, bool)),
        "feedback": pa.array(["ok"] * n), "wall_s": pa.array(np.full(n, 0.01)),
    })


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=1_000_000)
    ap.add_argument("--examples", type=int, default=50_000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rsiflow-bench-store-"))
    table = synthetic_turns(args.turns, "bench", 1, "generate")

    raw_path = tmp / "raw.duckdb"
    Store(raw_path).close()  # same schema, created by the migrations
    con = duckdb.connect(str(raw_path))
    con.register("arrow_turns", table)

    def raw_insert():
        con.begin()
        con.execute("INSERT INTO turns BY NAME SELECT * FROM arrow_turns")
        con.commit()

    raw_s, _ = timed(raw_insert)
    con.close()

    store = Store(tmp / "store.duckdb")

    def store_insert():
        with store.step("bench", 1, "generate") as tx:
            tx.insert("turns", table)

    store_s, _ = timed(store_insert)
    rerun_s, _ = timed(store_insert)
    n_rows = store.con.execute("SELECT count(*) FROM turns").fetchall()[0][0]
    assert n_rows == args.turns, n_rows

    msgs = json.dumps([{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "obs " * 40},
                       {"role": "assistant", "content": "go to cabinet 1"}] * 4)
    examples = pa.table({"example_id": [f"ex-{i}" for i in range(args.examples)], "method": ["exit"] * args.examples,
                         "source_traj_id": [f"traj-{i}" for i in range(args.examples)],
                         "messages": [msgs] * args.examples, "weight": np.ones(args.examples)})
    with store.step("bench", 1, "distill") as tx:
        tx.insert("examples", examples)
    export_s, ds = timed(lambda: store.examples_dataset("bench", 1))
    assert len(ds) == args.examples
    lineage = {name: timed(lambda f=f: f("bench"))[0] for name, f in
               [("trajectory_lineage", store.trajectory_lineage), ("promotion_history", store.promotion_history)]}
    store.close()

    print(f"turns {args.turns:,} (10 token ids + 10 logprobs each), examples {args.examples:,}")
    print(f"raw DuckDB Arrow insert : {raw_s:.2f} s  (baseline)")
    print(f"Store step insert       : {store_s:.2f} s  = {store_s / raw_s:.2f}x baseline   (budget <= 2x)")
    print(f"Store step rerun        : {rerun_s:.2f} s  = {rerun_s / raw_s:.2f}x baseline   (deletes and reinserts)")
    print(f"examples -> datasets    : {export_s:.2f} s  = {export_s / raw_s:.2f}x baseline")
    print("lineage queries         : " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in lineage.items()))


if __name__ == "__main__":
    main()
