"""RSIPO's reads of its own tables (and of the core ones it mines), through the store it is given
(`Store.rows`: SQL with parameters, JSON columns parsed); the method's `read` calls them while the step holds the
store open."""

from __future__ import annotations


def library(store, run_id: str, round_no: int) -> list[dict]:
    """RSIPO's skill library as it stood after the run's newest round before `round` (every skill written so
    far, active or retired, with its tests parsed), by skill_id; [] before the first."""
    return store.rows("SELECT * FROM rsipo_library WHERE run_id = ? AND round = (SELECT max(round)"
                      " FROM rsipo_library WHERE run_id = ? AND round < ?) ORDER BY skill_id",
                      [run_id, run_id, round_no], json_cols=("tests",))


def skills(store, run_id: str, round_no: int) -> dict[str, dict]:
    """The skills RSIPO wrote in a round (prompt parsed), by skill_id."""
    rows = store.rows("SELECT * FROM rsipo_skills WHERE run_id = ? AND round = ? AND step = 'distill'",
                      [run_id, round_no], json_cols=("prompt",))
    return {r["skill_id"]: r for r in rows}
