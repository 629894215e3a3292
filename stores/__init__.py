"""DuckDB store: schema migrations, step transactions, run bookkeeping, export and lineage."""

from stores.store import Store, StoreLockedError, StepWriter

__all__ = ["Store", "StoreLockedError", "StepWriter"]
