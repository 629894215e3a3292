"""Whether two checkouts' runs of the same configs left the same artifacts: the check that a refactor changed
no behaviour.

    python -m bench.identity /tmp/before /tmp/after --store runs/learn.duckdb --store runs/tiny-grpo.duckdb

Each folder is a checkout that ran the same commands with the same seeds (its stores and `runs/` below it).
Every table of each named store is compared row by row, by key, as bench.chaos compares a resumed run with an
uninterrupted one (time-dependent columns and bookkeeping tables left out, each checkout's folder replaced by
`<dir>` in paths), and every checkpoint's safetensors file under `runs/` by hash. Prints one line per table
with a difference and a summary; exit status 1 if any row or checkpoint differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.chaos import checkpoint_hashes, compare, table_rows


def diff(before: Path, after: Path, stores: list[str]) -> dict:
    """Per store and table the compare() counts where they differ, and the checkpoints that differ."""
    out: dict = {"tables": {}, "rows": 0, "checkpoints": {}}
    for name in stores:
        ref, new = table_rows(before / name, before), table_rows(after / name, after)
        for table in sorted(ref.keys() | new.keys()):
            counts = compare(ref.get(table, []), new.get(table, []))
            out["rows"] += counts["reference"]
            if counts["lost"] or counts["duplicate"] or counts["changed"] or table not in ref or table not in new:
                out["tables"][f"{name}:{table}"] = counts
    ref_ck, new_ck = checkpoint_hashes(before), checkpoint_hashes(after)
    out["checkpoints_compared"] = len(ref_ck)
    for path in sorted(ref_ck.keys() | new_ck.keys()):
        if ref_ck.get(path) != new_ck.get(path):
            out["checkpoints"][path] = (ref_ck.get(path), new_ck.get(path))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path, help="the checkout before the change (its runs already made)")
    p.add_argument("after", type=Path, help="the checkout after the change, having run the same commands")
    p.add_argument("--store", action="append", required=True,
                   help="a store path relative to each checkout (repeat for several)")
    args = p.parse_args(argv)
    result = diff(args.before.resolve(), args.after.resolve(), args.store)
    for table, counts in result["tables"].items():
        print(f"{table}: {counts}")
    for path, (a, b) in result["checkpoints"].items():
        print(f"checkpoint {path}: {a} -> {b}")
    same = not result["tables"] and not result["checkpoints"]
    print(f"{'identical' if same else 'DIFFERENT'}: {result['rows']} rows in {len(args.store)} store(s), "
          f"{result['checkpoints_compared']} checkpoint file(s)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
