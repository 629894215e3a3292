"""rsiflow: recursive self-improvement rounds for LLM agents (generate, evaluate, distill, train, gate, deploy),
orchestrated by Prefect and stored in DuckDB. It installs as this one package; its subpackages keep their folders at
the repository's top level (pyproject.toml `package-dir`): `rsiflow.configs` (the config schema and shipped
configs), `rsiflow.envs` (environments), `rsiflow.methods` (the algorithms, plain Python), `rsiflow.models`
(generation backends and the trainer), `rsiflow.stores` (the DuckDB store), `rsiflow.tasks` (the round's steps) and
`rsiflow.flows` (the Prefect flows and the `rsiflow` command).
"""

__version__ = "0.1.0"
