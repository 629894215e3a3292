"""DuckDB store: schema migrations, step transactions, run bookkeeping, export and lineage."""

from rsiflow.stores.store import StepWriter, Store, StoreLockedError

__all__ = ["Store", "StoreLockedError", "StepWriter"]
