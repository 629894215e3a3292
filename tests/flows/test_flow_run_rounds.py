"""A flow run is one round: a retried flow run (as the UI's Retry does it, through the API) resumes its own
round when that failed and refuses when it completed; the outcome is on the flow run (tags, state message);
a step timeout stops the step and is recorded; a flow run that fails before its round is named for why."""

import pytest
from prefect import task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.flow_engine import run_flow
from prefect.states import Scheduled

from rsiflow.flows import round as round_flow
from rsiflow.flows.round import improvement_round
from rsiflow.stores.store import Store
from tests.conftest import TINY, tiny_overrides


def _flow_run(name: str):
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    assert len(runs) == 1, [r.name for r in runs]
    return runs[0]


def _retry(flow_run):
    """What the UI's Retry does: force the finished flow run back to Scheduled (AwaitingRetry), then run that same
    flow run again (a worker would run it in a fresh process)."""
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run.id, Scheduled(name="AwaitingRetry", message="Retry from the UI"),
                                  force=True)
        again = client.read_flow_run(flow_run.id)
    return run_flow(improvement_round, flow_run=again, parameters=again.parameters, return_type="state")


@task(name="train")
def _crashing_train(cfg, round_no):
    raise RuntimeError("the machine ran out of memory (simulated)")


def test_retry_resumes_a_failed_round_and_refuses_a_completed_one(tmp_path, prefect_api, monkeypatch):
    overrides = tiny_overrides(tmp_path, "run.name=retry")
    monkeypatch.setitem(round_flow.STEP_TASKS, "train", _crashing_train)
    state = improvement_round([TINY], overrides, return_state=True)
    assert state.is_failed()
    failed = _flow_run("retry-round-1")
    with Store(tmp_path / "store.duckdb", read_only=True) as store:
        assert store.completed_steps("retry", 1) == {"generate", "evaluate", "distill"}
        assert [s["status"] for s in store.step_history("retry") if s["step"] == "train"] == ["failed"]
        assert [r["flow_run_id"] for r in store.round_flow_runs("retry", 1)] == [str(failed.id)]

    monkeypatch.undo()   # the cause is fixed; the operator presses Retry on the failed flow run
    state = _retry(failed)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["round"] == 1 and result["skipped"] == ["distill", "evaluate", "generate"]
    again = _flow_run("retry-round-1")   # the same flow run, still named for its round
    assert again.id == failed.id
    decision, serving = round_flow.outcome(round_flow.load_config([TINY], overrides), 1)
    assert f"gate:{decision}" in again.tags and f"champion:{serving}" in again.tags
    assert state.message == f"round 1: {decision}, {serving} serves"

    # Retry on the completed flow run: it runs nothing, says why and what to run; round 2 does not exist
    state = _retry(again)
    assert state.is_completed()
    assert state.message.startswith("retry refused: flow run 'retry-round-1' ran round 1 of run 'retry', which "
                                    "completed") and "prefect deployment run" in state.message
    with Store(tmp_path / "store.duckdb", read_only=True) as store:
        assert store.last_completed_round("retry") == 1 and store.round_status("retry", 2) is None
    assert _flow_run("retry-round-1").id == failed.id

    # the next round is a new flow run with its own name
    assert improvement_round([TINY], overrides)["round"] == 2
    assert _flow_run("retry-round-2").id != failed.id


def test_a_step_timeout_stops_generate_and_is_recorded(tmp_path, prefect_api):
    """Generate of 64 tasks x 8 on the tiny model runs far longer than 2 s: both attempts are stopped."""
    overrides = tiny_overrides(tmp_path, "run.name=slow", "prefect.step_timeout_s=2", "prefect.retries=1",
                               "generate.tasks_per_round=64", "generate.group_size=8")
    state = improvement_round([TINY], overrides, return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"step generate failed: StepTimedOut: step generate ran past "
                                        r"prefect.step_timeout_s = 2 s and was stopped \(Interrupted"):
        state.result()
    with Store(tmp_path / "store.duckdb", read_only=True) as store:
        gen = [s for s in store.step_history("slow") if s["step"] == "generate"]
        assert [s["status"] for s in gen] == ["failed"] and "StepTimedOut" in gen[0]["error"]
        assert store.rows("SELECT count(*) AS n FROM trajectories WHERE run_id = 'slow'")[0]["n"] == 0
    with get_client(sync_client=True) as client:
        attempts = client.read_task_runs()
    generate = [t for t in attempts if t.flow_run_id == _flow_run("slow-round-1").id and t.name.startswith("generate")]
    assert len(generate) == 1 and generate[0].run_count == 2 and generate[0].state.is_failed()


def test_a_flow_run_that_fails_before_its_round_is_named_for_why(tmp_path, prefect_api):
    state = improvement_round([TINY], tiny_overrides(tmp_path, "run.name=broken", "train.learning_rat=1"),
                              return_state=True)
    assert state.is_failed()
    assert _flow_run("broken-config-error")


def test_a_flow_run_that_finds_its_run_busy_is_named_so(tmp_path, prefect_api):
    import threading

    from rsiflow.flows.lease import run_lease
    from rsiflow.tasks.setup import ensure_run

    overrides = tiny_overrides(tmp_path, "run.name=held")
    cfg = round_flow.load_config([TINY], overrides)
    ensure_run(cfg)
    held, release = threading.Event(), threading.Event()

    def hold():   # another holder (another thread) runs a round of the run
        with run_lease(cfg, 0):
            held.set()
            release.wait(120)
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(60)
        state = improvement_round([TINY], overrides, return_state=True)
    finally:
        release.set()
        holder.join()
    assert state.is_failed() and "RunBusyError" in repr(state.message) + str(state.result(raise_on_failure=False))
    assert _flow_run("held-busy")


def test_events_after_a_rename_name_the_flow_run_by_its_new_name(prefect_api):
    """Prefect attaches the flow run to every event from the run context's copy: the rename updates it too, so a
    gate event points at `<run>-round-<n>`, not at the random name the flow run was created with."""
    import asyncio

    from prefect import flow
    from prefect.events.related import related_resources_from_run_context

    @flow
    def renamed():
        round_flow.update_flow_run("renamed-round-9", ["gate:promote"])

        async def related():
            async with get_client() as client:
                return await related_resources_from_run_context(client)
        return asyncio.run(related())

    resources = renamed()
    (flow_run,) = [r for r in resources if r["prefect.resource.role"] == "flow-run"]
    assert flow_run["prefect.resource.name"] == "renamed-round-9"
    assert "prefect.tag.gate:promote" in {r["prefect.resource.id"] for r in resources}
