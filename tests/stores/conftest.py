import pytest

from rsiflow.stores import Store


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "rsiflow.duckdb") as s:
        yield s
