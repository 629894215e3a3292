import pytest

from stores import Store


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "rsiflow.duckdb") as s:
        yield s
