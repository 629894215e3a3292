"""Numbered schema migrations for the rsiflow DuckDB store.

`MIGRATIONS` is an ordered list of (version, name, sql). Opening a writable `Store` applies
every version not yet recorded in `schema_migrations`, each in its own transaction, so a
migration either lands completely (with its `schema_migrations` row) or not at all.
Adding a schema change is one new entry at the end of the list; never edit an applied one.

Conventions:
- Every table a pipeline step writes carries (run_id, round, step). `Store.step` finds these
  tables by their columns, so a table added by a later migration is cleared on a step rerun
  without further code.
- Timestamps are UTC, stored as TIMESTAMP (no time zone).
- JSON columns hold JSON text; the store serialises Python dicts/lists on insert.
- Few indexes: DuckDB's per-row-group min/max statistics already serve range filters such as
  `WHERE run_id = ? AND round = ?`. ART indexes are kept to the id lookups that lineage
  queries join on, and left off `turns`, the one table that grows to millions of rows.
"""

import time
from datetime import UTC, datetime

import duckdb

from rsiflow.stores.lake import CONFLICT_RETRIES, LAKE_LOCKS_SQL, LEASE_LOCK_SQL, lake_migration_sql

INITIAL_SCHEMA = """
CREATE TABLE runs (
    run_id      VARCHAR PRIMARY KEY,
    name        VARCHAR,
    config      JSON,
    base_model  VARCHAR,
    created_at  TIMESTAMP
);

CREATE TABLE rounds (
    run_id          VARCHAR,
    round           INTEGER,
    status          VARCHAR CHECK (status IN ('running', 'completed', 'failed')),
    champion_before VARCHAR,
    champion_after  VARCHAR,
    started_at      TIMESTAMP,
    finished_at     TIMESTAMP,
    metrics         JSON,
    PRIMARY KEY (run_id, round)
);

CREATE TABLE steps (
    run_id      VARCHAR,
    round       INTEGER,
    step        VARCHAR,
    status      VARCHAR CHECK (status IN ('running', 'completed', 'failed')),
    started_at  TIMESTAMP,
    finished_at TIMESTAMP,
    error       VARCHAR,
    PRIMARY KEY (run_id, round, step)
);

CREATE TABLE models (
    model_id      VARCHAR PRIMARY KEY,
    parent_id     VARCHAR,
    run_id        VARCHAR,
    round         INTEGER,
    step          VARCHAR,
    path          VARCHAR,
    role          VARCHAR CHECK (role IN ('base', 'candidate', 'champion', 'rejected')),
    train_metrics JSON,
    created_at    TIMESTAMP DEFAULT (now() AT TIME ZONE 'UTC')
);

CREATE TABLE tasks (
    run_id    VARCHAR,
    round     INTEGER,
    step      VARCHAR,
    task_id   VARCHAR,
    env       VARCHAR,
    split     VARCHAR,
    task_type VARCHAR,
    seed      BIGINT,
    spec      JSON
);

CREATE TABLE trajectories (
    traj_id       VARCHAR,
    run_id        VARCHAR,
    round         INTEGER,
    step          VARCHAR,
    task_id       VARCHAR,
    model_id      VARCHAR,
    group_id      VARCHAR,
    sample_idx    INTEGER,
    purpose       VARCHAR CHECK (purpose IN ('train', 'eval')),
    status        VARCHAR CHECK (status IN ('success', 'failure', 'error')),
    success       BOOLEAN,
    reward        DOUBLE,
    n_turns       INTEGER,
    error         VARCHAR,
    hindsight     JSON,
    workflow_id   VARCHAR,
    agent_role    VARCHAR,
    prompt_tokens BIGINT,
    gen_tokens    BIGINT,
    wall_s        DOUBLE
);

CREATE TABLE turns (
    traj_id       VARCHAR,
    run_id        VARCHAR,
    round         INTEGER,
    step          VARCHAR,
    turn_idx      INTEGER,
    observation   VARCHAR,
    action_text   VARCHAR,      -- the action executed (and trained on)
    raw_text      VARCHAR,      -- what the model generated, when it differs (projected onto an admissible action)
    action_symbol VARCHAR,
    token_ids     INTEGER[],    -- sampled tokens of raw_text (or of action_text when they are equal)
    logprobs      FLOAT[],
    reward        DOUBLE,
    done          BOOLEAN,
    valid         BOOLEAN,
    feedback      VARCHAR,
    wall_s        DOUBLE
);

CREATE TABLE examples (
    example_id     VARCHAR,
    run_id         VARCHAR,
    round          INTEGER,
    step           VARCHAR,
    method         VARCHAR,
    source_traj_id VARCHAR,
    messages       JSON,
    weight         DOUBLE,
    meta           JSON
);

-- Which examples trained which candidate model.
CREATE TABLE train_inputs (
    model_id   VARCHAR,
    example_id VARCHAR,
    run_id     VARCHAR,
    round      INTEGER,
    step       VARCHAR
);

CREATE TABLE evaluations (
    eval_id            VARCHAR,
    run_id             VARCHAR,
    round              INTEGER,
    step               VARCHAR,
    model_id           VARCHAR,
    split              VARCHAR,
    env                VARCHAR,
    task_type          VARCHAR,  -- '*' = all task types together
    n                  INTEGER,
    successes          INTEGER,
    success_rate       DOUBLE,
    ci_low             DOUBLE,
    ci_high            DOUBLE,
    tokens_per_success DOUBLE,
    win_rate           DOUBLE
);

CREATE TABLE gate_decisions (
    run_id          VARCHAR,
    round           INTEGER,
    step            VARCHAR,
    candidate_id    VARCHAR,
    champion_id     VARCHAR,
    decision        VARCHAR CHECK (decision IN ('promote', 'reject', 'skip')),  -- skip: no candidate was trained
    rule            VARCHAR,
    evidence        JSON,
    new_champion_id VARCHAR,
    decided_at      TIMESTAMP DEFAULT (now() AT TIME ZONE 'UTC')
);

CREATE INDEX models_run_round ON models (run_id, round);
CREATE INDEX trajectories_traj_id ON trajectories (traj_id);
CREATE INDEX trajectories_model_id ON trajectories (model_id);
CREATE INDEX examples_example_id ON examples (example_id);
CREATE INDEX train_inputs_model_id ON train_inputs (model_id);
CREATE INDEX evaluations_model_id ON evaluations (model_id);
CREATE INDEX gate_decisions_run_round ON gate_decisions (run_id, round);
"""

SRD_TABLES = """
-- SRD hindsight notes: one per trajectory that got a note (pitfall: failures; knowledge: successes).
CREATE TABLE notes (
    note_id       VARCHAR,
    run_id        VARCHAR,
    round         INTEGER,
    step          VARCHAR,
    traj_id       VARCHAR,      -- the trajectory the note was written from
    group_id      VARCHAR,
    task_id       VARCHAR,
    channel       VARCHAR CHECK (channel IN ('pitfall', 'knowledge')),
    writer        VARCHAR CHECK (writer IN ('policy', 'template')),
    model_id      VARCHAR,      -- the policy that wrote it (NULL for the template writer)
    failure_kind  VARCHAR,
    prompt        JSON,         -- the messages the writer was given
    text          VARCHAR,      -- the note as kept (cleaned)
    raw_text      VARCHAR,      -- what the writer produced
    n_tokens      INTEGER,
    usable        BOOLEAN       -- has at least one Error:/Knowledge: block; only usable notes reach a teacher
);

-- Teacher/student pairs for privileged-teacher distillation (SRD's foresight channel, the action channel).
CREATE TABLE foresight (
    foresight_id      VARCHAR,
    run_id            VARCHAR,
    round             INTEGER,
    step              VARCHAR,
    group_id          VARCHAR,
    task_id           VARCHAR,
    channel           VARCHAR,      -- pitfall | knowledge | action
    source_traj_id    VARCHAR,      -- action channel: the episode scored
    note_ids          VARCHAR[],    -- the notes in the teacher's prompt
    student_messages  JSON,         -- the student's conversation incl. the completion
    teacher_messages  JSON,         -- the same with the privileged text in a user turn
    train_from        INTEGER,      -- assistant messages at index >= train_from are the scored completion
    completion_ids    INTEGER[],    -- foresight channel: the tokens the student sampled
    sampling_logprobs FLOAT[],
    model_id          VARCHAR,
    n_tokens          INTEGER
);
"""

# (version, name, sql). Append only.
# What a step reports about itself (e.g. the distill step: each method's per-round figures, keyed by
# method name), written in the step's own transaction.
STEP_METRICS = """
ALTER TABLE steps ADD COLUMN metrics JSON;
"""

# Per sampled token, its logprob under the temperature-scaled distribution without top-p truncation
# (what the trainer recomputes; `logprobs` stays the distribution actually sampled from).
TEMP_LOGPROBS = """
ALTER TABLE turns ADD COLUMN temp_logprobs FLOAT[];
"""

# One row per run while a round of it executes: who holds the run (one round at a time, whatever
# started it) and until when. The holder renews `expires_at` with heartbeats; a lease past its
# `expires_at`, or one whose process on the same host is gone, may be taken over.
LEASES = """
CREATE TABLE leases (
    run_id        VARCHAR PRIMARY KEY,
    holder        VARCHAR NOT NULL,   -- '<host>:<pid>:<token>': one process (and context) holding the run
    host          VARCHAR,
    pid           INTEGER,
    flow_run_id   VARCHAR,            -- the Prefect flow run executing under the lease, when there is one
    flow_run_name VARCHAR,
    acquired_at   TIMESTAMP,
    heartbeat_at  TIMESTAMP,
    expires_at    TIMESTAMP
);
"""

# X-Tree (docs/methods.md, X-Tree): the tree a round mined over its window of the run's rollouts, its nodes (one per
# merge, with lineage to the first round whose tree had the same span), where each node occurred when it
# was merged, and the online bonus each rollout of the round got (next to its verifier reward).
XTREE_TABLES = """
CREATE TABLE xtree_trees (
    tree_id        VARCHAR,      -- '<run>/r<round>/xtree'
    run_id         VARCHAR,
    round          INTEGER,
    step           VARCHAR,
    parent_tree_id VARCHAR,      -- the run's previous tree (NULL for the first)
    first_round    INTEGER,      -- the corpus: the run's training rollouts of rounds first_round..round
    n_trajectories INTEGER,
    n_symbols      BIGINT,
    alphabet       VARCHAR[],    -- the canonical symbols seen
    n_nodes        INTEGER,
    params         JSON,         -- p, p_s, eps, eta0, eta1, max_depth, max_nodes
    uses           VARCHAR[],    -- the uses active this round: bonus, token_weights, context
    mine_s         DOUBLE
);

CREATE TABLE xtree_nodes (
    tree_id     VARCHAR,
    run_id      VARCHAR,
    round       INTEGER,
    step        VARCHAR,
    node_idx    INTEGER,         -- merge order; the node's token is '#<node_idx>'
    left_child  VARCHAR,         -- a canonical symbol or '#<node_idx>'
    right_child VARCHAR,
    span        VARCHAR[],       -- the canonical symbols it stands for
    length      INTEGER,
    depth       INTEGER,
    freq        INTEGER,         -- f: occurrences when merged
    succ        DOUBLE,          -- success rate of the trajectories containing it when merged
    score       DOUBLE,          -- X = f · len^p · (succ + eps)^p_s
    n_trajectories INTEGER,
    task_types  JSON,            -- occurrences by task type
    first_round INTEGER          -- the earliest round of the run whose tree had this span
);

CREATE TABLE xtree_occurrences (
    tree_id    VARCHAR,
    run_id     VARCHAR,
    round      INTEGER,          -- the tree's round (the trajectory's own round is in trajectories)
    step       VARCHAR,
    node_idx   INTEGER,
    traj_id    VARCHAR,
    turn_start INTEGER,          -- turns [turn_start, turn_end) of the trajectory
    turn_end   INTEGER
);

CREATE TABLE xtree_bonus (
    tree_id         VARCHAR,
    run_id          VARCHAR,
    round           INTEGER,
    step            VARCHAR,
    traj_id         VARCHAR,
    group_id        VARCHAR,
    verifier_reward DOUBLE,      -- the env's reward, as stored in trajectories (never changed)
    win_rate        DOUBLE,      -- the group's success rate
    lambda_g        DOUBLE,      -- bonus_lambda · (1 - win_rate)
    n_nodes         INTEGER,     -- nodes the share is taken over (the task type's)
    executed        INTEGER[],   -- node_idx of the nodes whose span the rollout contains
    share           DOUBLE,      -- B
    bonus           DOUBLE       -- lambda_g · B; the GRPO reward is verifier_reward + bonus
);
"""

RETENTION = """
-- Checkpoints deleted by the retention rule (train.keep_candidates): no `step` column, so a step rerun never
-- clears the record of a folder that is gone.
CREATE TABLE deleted_checkpoints (
    model_id    VARCHAR PRIMARY KEY,
    run_id      VARCHAR,
    round       INTEGER,     -- the round whose deploy step deleted it
    path        VARCHAR,
    bytes       BIGINT,      -- size of the folder when it was deleted (NULL: it was already gone)
    reason      VARCHAR,
    deleted_at  TIMESTAMP
);
"""

# RSIPO (docs/methods.md, RSIPO): replays are trajectories of their own purpose ('replay': a train task played
# again with a skill in its task message), so the CHECK on trajectories.purpose is widened (DuckDB cannot alter
# a CHECK: the table is rebuilt with the same columns in the same order, its rows and its index). Then the skills
# written per round, the replay tests (student and replay rewards, gain, noise, empirical-Bayes fit, trust weight)
# and the library as it stood after each round (one row per skill: status, tests so far, gains with an interval).
RSIPO_REBUILD = """
DROP INDEX trajectories_traj_id;
DROP INDEX trajectories_model_id;
CREATE TABLE trajectories_v8 (
    traj_id       VARCHAR,
    run_id        VARCHAR,
    round         INTEGER,
    step          VARCHAR,
    task_id       VARCHAR,
    model_id      VARCHAR,
    group_id      VARCHAR,
    sample_idx    INTEGER,
    purpose       VARCHAR CHECK (purpose IN ('train', 'eval', 'replay')),
    status        VARCHAR CHECK (status IN ('success', 'failure', 'error')),
    success       BOOLEAN,
    reward        DOUBLE,
    n_turns       INTEGER,
    error         VARCHAR,
    hindsight     JSON,
    workflow_id   VARCHAR,
    agent_role    VARCHAR,
    prompt_tokens BIGINT,
    gen_tokens    BIGINT,
    wall_s        DOUBLE
);
INSERT INTO trajectories_v8 SELECT * FROM trajectories;
DROP TABLE trajectories;
ALTER TABLE trajectories_v8 RENAME TO trajectories;
CREATE INDEX trajectories_traj_id ON trajectories (traj_id);
CREATE INDEX trajectories_model_id ON trajectories (model_id);
"""

RSIPO_NEW_TABLES = """
CREATE TABLE rsipo_skills (
    skill_id        VARCHAR,      -- '<run>/r<round>/rsipo/<task index>'
    run_id          VARCHAR,
    round           INTEGER,
    step            VARCHAR,
    task_id         VARCHAR,      -- the task whose rollout it summarises
    task_type       VARCHAR,
    group_id        VARCHAR,
    source_traj_id  VARCHAR,      -- the rollout it was written from (the group's best)
    writer          VARCHAR CHECK (writer IN ('policy', 'template')),
    template_source VARCHAR,      -- template writer: 'rollout' (a successful rollout's actions) or 'expert'
    model_id        VARCHAR,      -- the policy that wrote it (NULL for the template writer)
    prompt          JSON,         -- the skill-writing messages (policy writer)
    raw_text        VARCHAR,
    text            VARCHAR,      -- the skill as kept (cleaned)
    token_ids       INTEGER[],    -- the policy's sampled tokens and their logprobs after temperature only
    temp_logprobs   FLOAT[],      --   (the skill-evolution term's policy-gradient row)
    n_tokens        INTEGER,
    usable          BOOLEAN,
    reject_reason   VARCHAR,      -- why not usable: too short, or the ids it leaks
    leaked_ids      VARCHAR[]
);

CREATE TABLE rsipo_tests (
    test_id         VARCHAR,      -- '<skill_id>@<task_id>/r<round>'
    run_id          VARCHAR,
    round           INTEGER,
    step            VARCHAR,
    skill_id        VARCHAR,
    skill_round     INTEGER,      -- the round the skill was written
    origin          VARCHAR CHECK (origin IN ('new', 'library')),
    retrieval_score DOUBLE,       -- library candidates: lexical match with the task text
    task_id         VARCHAR,
    task_type       VARCHAR,
    task_seed       BIGINT,       -- the task's seed: the replays and the student rollouts share it
    group_id        VARCHAR,      -- the student rollouts' group
    student_traj_ids VARCHAR[],
    replay_traj_ids VARCHAR[],    -- trajectories of purpose 'replay' (step 'distill')
    student_rewards DOUBLE[],     -- R^S (crashed episodes left out)
    replay_rewards  DOUBLE[],     -- R^T
    gain            DOUBLE,       -- g = mean(R^T) - mean(R^S)
    noise_var       DOUBLE,       -- v = Var(R^T)/M + Var(R^S)/G
    type_mean_gain  DOUBLE,       -- ḡ_k over the round's tests of the type
    tau2            DOUBLE,       -- τ²_k
    shrink          DOUBLE,       -- B = τ² / (τ² + v)
    shrunk_gain     DOUBLE,       -- g̃ = ḡ_k + B (g - ḡ_k)
    centred_gain    DOUBLE,       -- ĝ = g - ḡ_k (skill evolution's advantage)
    weight          DOUBLE,       -- w = clip(g̃ / c, 0, 1)
    selected        BOOLEAN       -- the task's skill for the trust-weighted distillation
);

CREATE TABLE rsipo_library (
    skill_id          VARCHAR,
    run_id            VARCHAR,
    round             INTEGER,    -- the library as it stood after this round
    step              VARCHAR,
    task_type         VARCHAR,
    text              VARCHAR,
    author_model_id   VARCHAR,
    writer            VARCHAR,
    written_round     INTEGER,
    status            VARCHAR CHECK (status IN ('active', 'retired')),
    retired_round     INTEGER,
    n_tests           INTEGER,
    mean_gain         DOUBLE,
    gain_ci_low       DOUBLE,     -- mean gain ± 1.96 sqrt(Σ v) / n over its tests
    gain_ci_high      DOUBLE,
    last_gain         DOUBLE,
    last_shrunk_gain  DOUBLE,
    last_weight       DOUBLE,
    nonpositive_streak INTEGER,   -- its latest tests in a row with a shrunk gain <= 0
    tests             JSON        -- every test so far: round, test_id, task_id, gain, noise, shrunk, weight
);
"""
RSIPO_TABLES = RSIPO_REBUILD + "\n" + RSIPO_NEW_TABLES

# MASS (docs/methods.md, MASS): the workflow versions a round searched (spec, parent, proposer, verdict figures, whether
# it became the champion and whether it was retained), every multi-agent (or bare) episode the method played
# (each hop's output, the final answer, the verifier's outcome), every pairwise verdict (both orders, the judge,
# its rationale), and the Bradley-Terry ranking of the teacher episodes with the split each went to.
MASS_TABLES = """
CREATE TABLE mass_workflows (
    workflow_id     VARCHAR,      -- '<run>/r<round>/mass/reference' or '.../v<k>'
    run_id          VARCHAR,
    round           INTEGER,
    step            VARCHAR,
    version         INTEGER,      -- -1 the reference (bare task), 0..N the searched versions
    parent_id       VARCHAR,      -- the champion it was derived from (NULL for the reference)
    spec            JSON,         -- {"agents": [{role, instruction, contract}], "hops": [...]}
    proposer        VARCHAR,      -- reference | previous | seed | model | mutation | mutation-after-invalid-proposal
    proposal        VARCHAR,      -- the model's raw proposal, or the mutation applied
    diff            VARCHAR[],    -- changes from the parent
    model_id        VARCHAR,      -- the model that played (and judged, with judge 'self') it
    win_vs_reference DOUBLE,      -- mean combined judge score against the reference on the search tasks
    win_vs_champion  DOUBLE,      -- ... against the champion at the time (NULL when the champion is the reference)
    verifier_success DOUBLE,      -- share of its search episodes the verifier accepts (NULL: no verifier)
    accepted        BOOLEAN,      -- became the champion during the search
    retained        BOOLEAN       -- the round's champion at the end of the search (teacher collection used it)
);

CREATE TABLE mass_episodes (
    episode_id   VARCHAR,
    run_id       VARCHAR,
    round        INTEGER,
    step         VARCHAR,         -- distill (search, teacher) or gate (assess)
    purpose      VARCHAR CHECK (purpose IN ('search', 'teacher', 'assess')),
    workflow_id  VARCHAR,         -- NULL for assess episodes (bare single-agent answers of one model)
    task_id      VARCHAR,
    model_id     VARCHAR,
    hops         JSON,            -- [{"role", "output", "tokens"}]
    final_text   VARCHAR,         -- the answer given to the env
    gen_tokens   INTEGER,         -- every hop's tokens
    final_tokens INTEGER,         -- the answer's tokens
    success      BOOLEAN,         -- the verifier's outcome (NULL: no verifier)
    reward       DOUBLE
);

CREATE TABLE mass_verdicts (
    verdict_id     VARCHAR,
    run_id         VARCHAR,
    round          INTEGER,
    step           VARCHAR,
    purpose        VARCHAR,       -- search | teacher | assess
    judge          VARCHAR CHECK (judge IN ('self', 'oracle')),
    judge_model_id VARCHAR,       -- NULL for the oracle (the env's verifier)
    task_id        VARCHAR,
    x_episode_id   VARCHAR,
    y_episode_id   VARCHAR,
    verdict_xy     VARCHAR,       -- x shown as A: A | B | tie | invalid
    rationale_xy   VARCHAR,
    raw_xy         VARCHAR,
    verdict_yx     VARCHAR,       -- y shown as A
    rationale_yx   VARCHAR,
    raw_yx         VARCHAR,
    score          DOUBLE,        -- x's combined score over both orders: 0, 0.25, 0.5, 0.75, 1
    verifier_x     BOOLEAN,
    verifier_y     BOOLEAN
);

CREATE TABLE mass_rankings (
    run_id      VARCHAR,
    round       INTEGER,
    step        VARCHAR,
    task_id     VARCHAR,
    episode_id  VARCHAR,
    games       INTEGER,
    wins        DOUBLE,           -- sum of its combined scores
    bt_score    DOUBLE,           -- log p of the Bradley-Terry fit over the task's teacher episodes
    rank        INTEGER,          -- 1 = best of the task
    split       VARCHAR           -- train | validation | NULL (not used)
);
"""

# Learning measurement: the gate's sampled held-out plays ('eval_sampled', beside the greedy 'eval' plays it reuses)
# and the final test split's plays ('test', 'test_sampled', never read by a promotion decision) are trajectories
# of their own purposes: the CHECK on trajectories.purpose is widened by the same rebuild as in version 8.
PURPOSES_REBUILD = RSIPO_REBUILD.replace("trajectories_v8", "trajectories_v10").replace(
    "('train', 'eval', 'replay')", "('train', 'eval', 'replay', 'eval_sampled', 'test', 'test_sampled')")

# Which Prefect flow runs ran which round: a flow run runs one round, so a retried flow run finds here the round
# it ran (flows/round.py: refused when that round completed, resumed when not).
ROUND_FLOW_RUNS = """
CREATE TABLE round_flow_runs (
    run_id        VARCHAR NOT NULL,
    round         INTEGER NOT NULL,
    flow_run_id   VARCHAR NOT NULL,   -- a Prefect flow run that ran or resumed the round
    flow_run_name VARCHAR,
    deployment_id VARCHAR,            -- the deployment that created the flow run, when one did
    started_at    TIMESTAMP
);
"""

# Tables that record who held a store when, and which process ran what (leases, Prefect flow runs, the schema's
# own versions, the lake's lock row), not what a run computed: two stores of the same run differ in them by design,
# so comparisons of runs (bench.chaos, bench.lake) leave them out.
BOOKKEEPING_TABLES = frozenset({"leases", "round_flow_runs", "schema_migrations", "method_migrations", "lake_locks"})

# A method's own tables are its migrations (`Method.migrations`: (version, name, sql), numbered per method), applied
# by `apply_method_migrations` when a run that enables the method is set up, and recorded here by (method, version):
# a new method adds no entry to MIGRATIONS. (The built-in methods' tables predate this and stay in MIGRATIONS,
# versions 2, 6, 8 and 9: stores exist that hold them under those versions.)
METHOD_MIGRATIONS = """
CREATE TABLE method_migrations (
    method      VARCHAR,
    version     INTEGER,
    name        VARCHAR,
    applied_at  TIMESTAMP,
    PRIMARY KEY (method, version)
);
"""

MIGRATIONS: list[tuple[int, str, str]] = [
    (1, "initial schema", INITIAL_SCHEMA),
    (2, "SRD notes and foresight pairs", SRD_TABLES),
    (3, "per-step metrics (each method's figures of the distill step)", STEP_METRICS),
    (4, "sampled tokens' logprobs after temperature only (mismatch correction)", TEMP_LOGPROBS),
    (5, "run leases: one round of a run at a time", LEASES),
    (6, "X-Tree trees, nodes, occurrences and online bonuses", XTREE_TABLES),
    (7, "checkpoints deleted by retention", RETENTION),
    (8, "RSIPO skills, replays and library", RSIPO_TABLES),
    (9, "MASS workflows, verdicts, rankings", MASS_TABLES),
    (10, "trajectory purposes of sampled held-out plays and the final test split", PURPOSES_REBUILD),
    (11, "the flow runs that ran each round", ROUND_FLOW_RUNS),
    (12, "each method's own schema versions", METHOD_MIGRATIONS),
]


# The lake (stores/lake.py) takes each migration through `lake_migration_sql` (no constraints, indexes or now()
# defaults there); these versions differ beyond that. 5: the lake's lock row that serialises lease writes.
# 8 and 10: no trajectories rebuild (they only widened a CHECK, which a lake table has none of; DuckLake can't
# rename a table created in the same transaction either). 10 changes nothing else, so it updates the lock row:
# two processes applying it at once then conflict on that row (the loser retries and finds it applied) instead
# of both recording it.
LAKE_MIGRATIONS: dict[int, str] = {
    5: LEASES + LAKE_LOCKS_SQL,
    8: RSIPO_NEW_TABLES,
    10: LEASE_LOCK_SQL + ";",   # only a CHECK was widened
}

SCHEMA_MIGRATIONS = ("CREATE TABLE IF NOT EXISTS schema_migrations ("
                     " version INTEGER PRIMARY KEY, name VARCHAR, applied_at TIMESTAMP)")


def migration_sql(version: int, sql: str, lake: bool) -> str:
    """The SQL a migration runs on this kind of store."""
    return lake_migration_sql(LAKE_MIGRATIONS.get(version, sql)) if lake else sql


def applied_versions(con: duckdb.DuckDBPyConnection) -> set[int]:
    """Versions recorded in `schema_migrations` (empty if the table does not exist yet)."""
    exists = con.sql(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'schema_migrations'"
        " AND table_catalog = current_database()"
    ).fetchall()[0][0]
    if not exists:
        return set()
    return {v for (v,) in con.sql("SELECT version FROM schema_migrations").fetchall()}


def apply_migrations(con: duckdb.DuckDBPyConnection, lake: bool = False) -> list[int]:
    """Apply pending migrations in version order, one transaction each; return the versions applied.

    On a lake several processes may open a new store at once: the later of two that create the same tables
    fails (its commit loses a write conflict, or its CREATE finds the other's table), rolls back and starts over,
    then finds the winner's versions applied.
    """
    for attempt in range(CONFLICT_RETRIES if lake else 1):
        try:
            return _apply(con, lake)
        except (duckdb.TransactionException, duckdb.CatalogException) as err:
            lost_race = isinstance(err, duckdb.TransactionException) or "already exists" in str(err)
            if not lake or not lost_race or attempt == CONFLICT_RETRIES - 1:
                raise
            time.sleep(min(0.05 * 1.5 ** attempt, 1.0))
    raise AssertionError("unreachable")


def _apply(con: duckdb.DuckDBPyConnection, lake: bool) -> list[int]:
    con.execute(lake_migration_sql(SCHEMA_MIGRATIONS) if lake else SCHEMA_MIGRATIONS)
    done = applied_versions(con)
    applied = []
    for version, name, sql in sorted(MIGRATIONS):
        if version in done:
            continue
        con.begin()
        try:
            if lake and version in applied_versions(con):   # another process applied it since `done` was read
                con.commit()
                continue
            con.execute(migration_sql(version, sql, lake))
            con.execute(
                "INSERT INTO schema_migrations VALUES (?, ?, ?)",
                [version, name, datetime.now(UTC).replace(tzinfo=None)],
            )
            con.commit()
        except BaseException:
            try:
                con.rollback()
            except duckdb.TransactionException:
                pass   # a failed commit has ended the transaction already
            raise
        applied.append(version)
    return applied


def apply_method_migrations(con: duckdb.DuckDBPyConnection, method: str, migrations, lake: bool = False) -> list[int]:
    """Apply a method's pending migrations ((version, name, sql), in version order, one transaction each) and record
    them in `method_migrations`; return the versions applied. On a lake, a process that loses the race to another
    applying the same version rolls back and finds it applied (as `apply_migrations`)."""
    for attempt in range(CONFLICT_RETRIES if lake else 1):
        try:
            return _apply_method(con, method, migrations, lake)
        except (duckdb.TransactionException, duckdb.CatalogException) as err:
            lost_race = isinstance(err, duckdb.TransactionException) or "already exists" in str(err)
            if not lake or not lost_race or attempt == CONFLICT_RETRIES - 1:
                raise
            time.sleep(min(0.05 * 1.5 ** attempt, 1.0))
    raise AssertionError("unreachable")


def _method_versions(con: duckdb.DuckDBPyConnection, method: str) -> set[int]:
    return {v for (v,) in con.execute("SELECT version FROM method_migrations WHERE method = ?", [method]).fetchall()}


def _apply_method(con: duckdb.DuckDBPyConnection, method: str, migrations, lake: bool) -> list[int]:
    versions = [v for v, _, _ in migrations]
    if len(set(versions)) != len(versions):
        raise ValueError(f"method {method!r}: its migrations repeat a version: {sorted(versions)}")
    done, applied = _method_versions(con, method), []
    for version, name, sql in sorted(migrations):
        if version in done:
            continue
        con.begin()
        try:
            if lake and version in _method_versions(con, method):   # another process applied it meanwhile
                con.commit()
                continue
            con.execute(lake_migration_sql(sql) if lake else sql)
            con.execute("INSERT INTO method_migrations VALUES (?, ?, ?, ?)",
                        [method, version, name, datetime.now(UTC).replace(tzinfo=None)])
            con.commit()
        except BaseException:
            try:
                con.rollback()
            except duckdb.TransactionException:
                pass
            raise
        applied.append(version)
    return applied
