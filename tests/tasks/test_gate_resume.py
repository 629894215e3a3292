"""A stopped gate resumes its held-out plays: what a stopped attempt played is not played again, the resumed
plays are those of an unbroken attempt, and changed settings (or weights) start the plays over."""

import pytest

import rsiflow.tasks.gate as gate
from rsiflow.configs.loader import load_config
from rsiflow.tasks.gate import HeldoutPlays, heldout_tasks
from tests.conftest import TINY, tiny_overrides


@pytest.fixture
def cfg(tmp_path):
    return load_config([TINY], tiny_overrides(tmp_path, "env.name=arithmetic", "env.kwargs={}", "env.max_turns=2",
                                              "env.show_admissible=false", "env.project_actions=false",
                                              "gate.heldout_tasks=4", "gate.samples=2"))


def _plays(cfg, tiny_path, checkpoint=None, seed=1):
    paths = {"cand": str(tiny_path), "champ": str(tiny_path)}
    return HeldoutPlays(cfg, heldout_tasks(cfg), paths, {"cand": "candidate", "champ": "champion"}, "t/r1/gate",
                        seed, {"cand": 5, "champ": 6}, 2, "test", checkpoint=checkpoint)


def _figures(plays, n):
    return ({m: [plays.greedy[m][i]["success"] for i in range(n)] for m in plays.paths},
            {m: [plays.sampled[m][i]["successes"] for i in range(n)] for m in plays.paths},
            {m: [[t.action_text for t in e.turns] for e in plays.played_sampled[m]] for m in plays.paths})


class Stop(Exception):
    pass


def test_a_stopped_gate_resumes_its_plays(cfg, tiny_path, tmp_path, monkeypatch):
    unbroken = _plays(cfg, tiny_path)
    unbroken.play_first(4)

    real_play, calls = gate.play, []

    def stop_on_third(*args, **kwargs):  # cand greedy, cand sampled, then stop before champ greedy
        calls.append(args[4])
        if len(calls) == 3:
            raise Stop
        return real_play(*args, **kwargs)

    checkpoint = tmp_path / "partial" / "gate.pkl"
    monkeypatch.setattr(gate, "play", stop_on_third)
    with pytest.raises(Stop):
        _plays(cfg, tiny_path, checkpoint).play_first(4)
    assert checkpoint.exists()

    calls.clear()
    monkeypatch.setattr(gate, "play", lambda *a, **k: (calls.append(a[4]), real_play(*a, **k))[1])
    resumed = _plays(cfg, tiny_path, checkpoint)
    assert resumed.resumed == 4 + 8   # the candidate's greedy and sampled plays
    resumed.play_first(4)
    assert len(calls) == 2            # only the champion's two batches were played
    assert _figures(resumed, 4) == _figures(unbroken, 4)
    assert len(resumed.rows(4, "heldout", "t/r1/gate")["trajectories"]) == 2 * (4 + 8)
    resumed.discard_checkpoint()
    assert not checkpoint.exists()


def test_other_settings_start_the_plays_over(cfg, tiny_path, tmp_path, caplog):
    checkpoint = tmp_path / "gate.pkl"
    _plays(cfg, tiny_path, checkpoint).play_first(2)
    assert _plays(cfg, tiny_path, checkpoint).resumed == 2 * (2 + 4)
    assert not caplog.records
    assert _plays(cfg, tiny_path, checkpoint, seed=2).resumed == 0      # another greedy seed
    assert "made with other settings" in caplog.text                   # said, not silent
    checkpoint.write_bytes(b"cut short")
    assert _plays(cfg, tiny_path, checkpoint).resumed == 0              # unreadable: from the start
    assert "not readable (UnpicklingError" in caplog.text or "not readable (EOFError" in caplog.text
