"""The DuckDB store (store.py, built from steps.py, registry.py and queries.py): schema migrations, step
transactions, runs and leases, reads, export and lineage; the DuckLake form in lake.py."""

from rsiflow.stores.steps import StepWriter
from rsiflow.stores.store import Store, StoreLockedError

__all__ = ["Store", "StoreLockedError", "StepWriter"]
