"""MASS's reads of its own tables (and of the core ones it mines), through the store it is given
(`Store.rows`: SQL with parameters, JSON columns parsed); the method's `read` calls them while the step holds the
store open."""

from __future__ import annotations


def retained_workflow(store, run_id: str, round_no: int) -> dict | None:
    """MASS: the workflow retained by the run's newest round before `round` that retained one other than the
    reference (workflow_id, round, version, spec parsed), or None."""
    rows = store.rows("SELECT workflow_id, round, version, spec FROM mass_workflows WHERE run_id = ? AND round < ?"
                      " AND retained AND version >= 0 AND step = 'distill' ORDER BY round DESC LIMIT 1",
                      [run_id, round_no], json_cols=("spec",))
    return rows[0] if rows else None
