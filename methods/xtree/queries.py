"""X-Tree's reads of its own tables (and of the core ones it mines), through the store it is given
(`Store.rows`: SQL with parameters, JSON columns parsed); the method's `read` calls them while the step holds the
store open."""

from __future__ import annotations


def corpus(store, run_id: str, first_round: int, last_round: int) -> list[dict]:
    """X-Tree's corpus: the run's training rollouts (generate step) of rounds first_round..last_round, each with
    traj_id, round, group_id, task_type, status, success, reward and `symbols`, its turns' canonical action
    symbols in turn order; by round, then traj_id."""
    return store.rows("SELECT t.traj_id, t.round, t.group_id, k.task_type, t.status, t.success, t.reward,"
                      " coalesce(list(u.action_symbol ORDER BY u.turn_idx)"
                      "   FILTER (WHERE u.turn_idx IS NOT NULL), []) AS symbols"
                      " FROM trajectories t"
                      " LEFT JOIN tasks k ON k.task_id = t.task_id AND k.run_id = t.run_id AND k.round = t.round"
                      "   AND k.step = t.step"
                      " LEFT JOIN turns u ON u.traj_id = t.traj_id AND u.run_id = t.run_id AND u.round = t.round"
                      "   AND u.step = t.step"
                      " WHERE t.run_id = ? AND t.step = 'generate' AND t.round BETWEEN ? AND ?"
                      " GROUP BY ALL ORDER BY t.round, t.traj_id", [run_id, first_round, last_round])


def tree(store, run_id: str, round_no: int | None = None) -> dict | None:
    """The X-Tree a round mined (params parsed), or with round None the run's latest; None if there is none."""
    sql = "SELECT * FROM xtree_trees WHERE run_id = ?"
    params: list = [run_id]
    if round_no is not None:
        sql += " AND round = ?"
        params.append(round_no)
    rows = store.rows(sql + " ORDER BY round DESC LIMIT 1", params, json_cols=("params",))
    return rows[0] if rows else None


def latest_before(store, run_id: str, round_no: int) -> dict | None:
    """The run's newest X-Tree of a round before `round` (params parsed), or None."""
    rows = store.rows("SELECT * FROM xtree_trees WHERE run_id = ? AND round < ? ORDER BY round DESC LIMIT 1",
                      [run_id, round_no], json_cols=("params",))
    return rows[0] if rows else None


def nodes(store, tree_id: str) -> list[dict]:
    """A tree's nodes in merge order (task_types parsed)."""
    return store.rows("SELECT * FROM xtree_nodes WHERE tree_id = ? ORDER BY node_idx", [tree_id],
                     json_cols=("task_types",))
