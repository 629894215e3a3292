"""What the pipeline steps, the report and a person read from the store: named reads, dataset export,
retention, lineage, the replay buffer's examples and `rows` for your own SQL."""

from __future__ import annotations

import json
from pathlib import Path

from rsiflow.stores.common import as_dicts


class StoreReads:
    """Store's reads (a part of `Store`, stores/store.py)."""

    # ---- export ---------------------------------------------------------------------------

    def examples_dataset(self, run_id: str, round_no: int, method: str | None = None):
        """The round's training examples as a `datasets.Dataset` (built from Arrow, no copy
        through Python objects): example_id, method, weight, source_traj_id, meta (JSON text), and
        messages as a list of {"role", "content"} dicts (other message keys are dropped)."""
        import datasets  # imports pandas: keep it off the store's import path

        sql = (
            "SELECT example_id, method, weight, source_traj_id, CAST(meta AS VARCHAR) AS meta,"
            " json_transform(messages, '[{\"role\": \"VARCHAR\", \"content\": \"VARCHAR\"}]') AS messages"
            " FROM examples WHERE run_id = ? AND round = ?"
        )
        params: list = [run_id, round_no]
        if method is not None:
            sql += " AND method = ?"
            params.append(method)
        table = self._con.sql(sql + " ORDER BY method, example_id", params=params).to_arrow_table()
        return datasets.Dataset(table)

    def export_parquet(self, run_id: str, round_no: int, folder: str | Path) -> dict[str, Path]:
        """Write the round's trajectories, turns and examples to `folder/<table>.parquet`;
        return the paths by table name."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {}
        for table in ("trajectories", "turns", "examples"):
            path = folder / f"{table}.parquet"
            self._con.sql(
                f"SELECT * FROM {table} WHERE run_id = ? AND round = ?", params=[run_id, round_no]
            ).write_parquet(str(path))
            paths[table] = path
        return paths

    # ---- what the pipeline steps read -----------------------------------------------------------

    def model_path(self, model_id: str) -> str:
        """The checkpoint path of a registered model; LookupError if it is not registered."""
        rows = self._con.execute("SELECT path FROM models WHERE model_id = ?", [model_id]).fetchall()
        if not rows:
            raise LookupError(f"model {model_id!r} is not in the store's registry")
        return rows[0][0]

    def has_model(self, model_id: str) -> bool:
        """Whether `model_id` is registered (e.g. the round's candidate was trained)."""
        return bool(self._con.execute("SELECT count(*) FROM models WHERE model_id = ?", [model_id]).fetchall()[0][0])

    def train_metrics(self, model_id: str | None) -> dict:
        """The training metrics recorded with a model ({} for none, or an untrained model)."""
        if model_id is None:
            return {}
        rows = self.rows("SELECT train_metrics FROM models WHERE model_id = ?", [model_id],
                         json_cols=("train_metrics",))
        return (rows[0]["train_metrics"] or {}) if rows else {}

    def step_tasks(self, run_id: str, round_no: int, step: str) -> list[dict]:
        """The tasks a step played: task_id, env, split, task_type, seed, spec (JSON text)."""
        return self.rows("SELECT task_id, env, split, task_type, seed, spec FROM tasks"
                         " WHERE run_id = ? AND round = ? AND step = ? ORDER BY task_id", [run_id, round_no, step])

    def step_trajectories(self, run_id: str, round_no: int, step: str) -> list[dict]:
        """Every column of a step's trajectories, by traj_id, joined with their task's task_type."""
        return self.rows("SELECT t.*, k.task_type FROM trajectories t LEFT JOIN tasks k"
                         " ON k.task_id = t.task_id AND k.run_id = t.run_id AND k.round = t.round AND k.step = t.step"
                         " WHERE t.run_id = ? AND t.round = ? AND t.step = ? ORDER BY t.traj_id",
                         [run_id, round_no, step])

    def step_turns(self, run_id: str, round_no: int, step: str) -> list[dict]:
        """A step's turns in order (traj_id, turn_idx): observation as shown, executed action, the raw
        generated text when projection changed it, validity, the env's feedback, the sampled token ids and
        their logprobs (as sampled, and after temperature only)."""
        return self.rows("SELECT traj_id, turn_idx, observation, action_text, raw_text, valid, feedback, token_ids,"
                         " logprobs, temp_logprobs FROM turns"
                         " WHERE run_id = ? AND round = ? AND step = ? ORDER BY traj_id, turn_idx",
                         [run_id, round_no, step])

    def trajectory_actions(self, traj_ids: list[str]) -> dict[str, list[str]]:
        """The executed action texts of these trajectories, in turn order (traj_id -> actions)."""
        if not traj_ids:
            return {}
        rows = self.rows("SELECT traj_id, action_text FROM turns WHERE list_contains(?, traj_id)"
                         " ORDER BY traj_id, turn_idx", [list(traj_ids)])
        out: dict[str, list[str]] = {}
        for r in rows:
            out.setdefault(r["traj_id"], []).append(r["action_text"])
        return out

    def eval_trajectories(self, run_id: str, model_id: str) -> list[dict]:
        """A model's held-out (purpose 'eval') trajectories of the run, newest round first."""
        return self.rows("SELECT traj_id, task_id, success, gen_tokens, round FROM trajectories"
                         " WHERE run_id = ? AND model_id = ? AND purpose = 'eval' ORDER BY round DESC, traj_id",
                         [run_id, model_id])

    def foresight_pairs(self, run_id: str, round_no: int) -> dict[str, dict]:
        """The round's privileged-teacher pairs by foresight_id: student and teacher messages (parsed),
        train_from, the student's sampled completion ids and their sampling logprobs."""
        rows = self.rows("SELECT foresight_id, student_messages, teacher_messages, train_from, completion_ids,"
                         " sampling_logprobs FROM foresight WHERE run_id = ? AND round = ? AND step = 'distill'",
                         [run_id, round_no], json_cols=("student_messages", "teacher_messages"))
        return {r["foresight_id"]: r for r in rows}

    def base_model(self, run_id: str) -> str | None:
        """The run's base model (its `models` row with role 'base'), or None."""
        rows = self.rows("SELECT model_id FROM models WHERE run_id = ? AND role = 'base' ORDER BY created_at LIMIT 1",
                         [run_id])
        return rows[0]["model_id"] if rows else None

    def latest_heldout(self, run_id: str, model_id: str | None, split: str = "heldout") -> dict | None:
        """A model's newest evaluation of `split` ('heldout': greedy; 'heldout:sampled': the sampled plays; 'test',
        'test:sampled': the final test split) over all task types: success_rate, ci_low, ci_high, n, successes,
        tokens_per_success; None if it has none."""
        if model_id is None:
            return None
        rows = self.rows("SELECT success_rate, ci_low, ci_high, n, successes, tokens_per_success FROM evaluations"
                         " WHERE run_id = ? AND model_id = ? AND split = ? AND task_type = '*'"
                         " ORDER BY round DESC LIMIT 1", [run_id, model_id, split])
        return rows[0] if rows else None

    def projected_share(self, run_id: str, round_no: int) -> float | None:
        """Share of the round's generated actions that projection replaced (None without turns)."""
        return self._con.execute("SELECT avg(CASE WHEN raw_text IS NULL THEN 0 ELSE 1 END) FROM turns"
                                 " WHERE run_id = ? AND round = ? AND step = 'generate'",
                                 [run_id, round_no]).fetchall()[0][0]

    def count_examples(self, run_id: str, round_no: int) -> int:
        """Training examples the round's distill step wrote (all methods)."""
        return self._con.execute("SELECT count(*) FROM examples WHERE run_id = ? AND round = ?",
                                 [run_id, round_no]).fetchall()[0][0]

    def step_seconds(self, run_id: str, round_no: int) -> dict[str, float]:
        """Wall seconds of each completed step of the round."""
        rows = self._con.execute("SELECT step, epoch(finished_at - started_at) FROM steps"
                                 " WHERE run_id = ? AND round = ? AND status = 'completed'",
                                 [run_id, round_no]).fetchall()
        return {step: float(s) for step, s in rows}

    def step_metrics(self, run_id: str, round_no: int, step: str) -> dict | None:
        """What a completed step recorded about itself (`StepWriter.metrics`), or None."""
        rows = self.rows("SELECT metrics FROM steps"
                         " WHERE run_id = ? AND round = ? AND step = ? AND status = 'completed'",
                         [run_id, round_no, step], json_cols=("metrics",))
        return rows[0]["metrics"] if rows else None

    def completed_step_metrics(self, step: str) -> list[dict]:
        """run_id, round and metrics of every completed step named `step`, over all runs of the store."""
        return self.rows("SELECT run_id, round, metrics FROM steps WHERE step = ? AND status = 'completed'"
                         " ORDER BY run_id, round", [step], json_cols=("metrics",))

    def step_history(self, run_id: str) -> list[dict]:
        """Every step attempt's last state: round, step, status, started/finished, error."""
        return self.rows("SELECT round, step, status, started_at, finished_at, error FROM steps"
                         " WHERE run_id = ? ORDER BY round, started_at", [run_id])

    def round_history(self, run_id: str) -> list[dict]:
        """The run's rounds in order: round, status, champion_before, champion_after, started_at, finished_at."""
        return self.rows("SELECT round, status, champion_before, champion_after, started_at, finished_at FROM rounds"
                         " WHERE run_id = ? ORDER BY round", [run_id])

    # ---- retention ------------------------------------------------------------------------

    def expired_checkpoints(self, run_id: str, keep_candidates: int) -> list[dict]:
        """Rejected candidates of the run older than its last `keep_candidates` trained candidates whose
        deletion is not recorded yet: model_id, round, path. Base and champions (the lineage) are never listed."""
        return self.rows(
            "WITH c AS (SELECT model_id, round, path, role, row_number() OVER (ORDER BY round DESC) AS newest"
            " FROM models WHERE run_id = ? AND role IN ('candidate', 'champion', 'rejected') AND parent_id IS NOT NULL)"
            " SELECT model_id, round, path FROM c WHERE role = 'rejected' AND newest > ?"
            " AND model_id NOT IN (SELECT model_id FROM deleted_checkpoints) ORDER BY round",
            [run_id, keep_candidates])

    def deleted_checkpoints(self, run_id: str) -> list[dict]:
        """The run's checkpoints deleted by retention: model_id, round, path, bytes, reason, deleted_at."""
        return self.rows("SELECT model_id, round, path, bytes, reason, deleted_at FROM deleted_checkpoints"
                         " WHERE run_id = ? ORDER BY round, model_id", [run_id])

    # ---- lineage --------------------------------------------------------------------------

    def trajectory_lineage(self, run_id: str) -> list[dict]:
        """Each trajectory of the run with the model that produced it and that model's path
        and role. The plain SQL:

            SELECT t.traj_id, t.round, t.step, t.task_id, t.purpose, t.success, t.reward,
                   t.model_id, m.path AS model_path, m.role AS model_role
            FROM trajectories t LEFT JOIN models m USING (model_id)
            WHERE t.run_id = ?
        """
        return self.rows(
            "SELECT t.traj_id, t.round, t.step, t.task_id, t.purpose, t.success, t.reward,"
            " t.model_id, m.path AS model_path, m.role AS model_role"
            " FROM trajectories t LEFT JOIN models m USING (model_id)"
            " WHERE t.run_id = ? ORDER BY t.round, t.step, t.traj_id",
            [run_id],
        )

    def training_examples_of(self, model_id: str) -> list[dict]:
        """The examples that trained `model_id`, with the trajectory each was distilled from.
        The plain SQL:

            SELECT e.*, t.model_id AS source_model_id, t.success AS source_success
            FROM train_inputs i
            JOIN examples e USING (example_id, run_id)
            LEFT JOIN trajectories t ON t.traj_id = e.source_traj_id
            WHERE i.model_id = ?
        """
        return self.rows(
            "SELECT e.example_id, e.method, e.weight, e.messages, e.source_traj_id,"
            " e.round, e.step, t.model_id AS source_model_id, t.success AS source_success"
            " FROM train_inputs i"
            " JOIN examples e ON e.example_id = i.example_id AND e.run_id = i.run_id"
            " LEFT JOIN trajectories t ON t.traj_id = e.source_traj_id AND t.run_id = e.run_id"
            " WHERE i.model_id = ? ORDER BY e.example_id",
            [model_id],
            json_cols=("messages",),
        )

    def promotion_history(self, run_id: str) -> list[dict]:
        """Each gate decision of the run in order: candidate, champion, decision, rule, evidence
        and the champion after it. The plain SQL:

            SELECT round, candidate_id, champion_id, decision, rule, evidence, new_champion_id
            FROM gate_decisions WHERE run_id = ? ORDER BY round, decided_at
        """
        return self.rows(
            "SELECT round, step, candidate_id, champion_id, decision, rule, evidence, new_champion_id"
            " FROM gate_decisions WHERE run_id = ? ORDER BY round, decided_at",
            [run_id],
            json_cols=("evidence",),
        )

    def rows(self, sql: str, params: list | None = None, json_cols: tuple[str, ...] = ()) -> list[dict]:
        """Run a query and return its rows as dicts, parsing the named JSON columns. For benches and ad-hoc
        analysis; pipeline steps call the named methods above (steps hold no SQL)."""
        rows = as_dicts(self._con.sql(sql, params=params))
        for row in rows:
            for col in json_cols:
                if row[col] is not None:
                    row[col] = json.loads(row[col])
        return rows

    # ---- replay buffer (train step) -----------------------------------------------------------

    def examples_before(self, run_id: str, round_no: int, method: str, first_round: int | None = None) -> list[dict]:
        """A method's examples of the run's rounds before `round` (from `first_round` on; None = every earlier
        round), newest round first (then by example_id): example_id, round, method, weight, source_traj_id, meta
        (parsed), messages (role/content dicts, as `examples_dataset` gives them) and the source trajectory's
        task_id (None when the trajectory is not in the store)."""
        sql = ("SELECT e.example_id, e.round, e.method, e.weight, e.source_traj_id, CAST(e.meta AS VARCHAR) AS meta,"
               " CAST(e.messages AS VARCHAR) AS messages, t.task_id"
               " FROM examples e LEFT JOIN trajectories t ON t.traj_id = e.source_traj_id AND t.run_id = e.run_id"
               " WHERE e.run_id = ? AND e.method = ? AND e.round < ?")
        params: list = [run_id, method, round_no]
        if first_round is not None:
            sql += " AND e.round >= ?"
            params.append(first_round)
        rows = self.rows(sql + " ORDER BY e.round DESC, e.example_id", params, json_cols=("meta", "messages"))
        for r in rows:
            r["messages"] = [{"role": m.get("role"), "content": m.get("content")} for m in r["messages"] or []]
        return rows

    def example_task_ids(self, run_id: str, round_no: int) -> dict[str, str | None]:
        """The task of each example of the round (example_id -> its source trajectory's task_id, None when the
        trajectory is not in the store)."""
        rows = self.rows("SELECT e.example_id, t.task_id FROM examples e LEFT JOIN trajectories t"
                         " ON t.traj_id = e.source_traj_id AND t.run_id = e.run_id"
                         " WHERE e.run_id = ? AND e.round = ?", [run_id, round_no])
        return {r["example_id"]: r["task_id"] for r in rows}
