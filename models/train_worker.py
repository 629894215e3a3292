"""One training process of an `accelerate launch` job (models/launch.py starts it):
`python -m rsiflow.models.train_worker <job_dir>`.

Every process reads the whole job (`<job_dir>/job.pkl`: the parent checkpoint path, the training rows, the
TrainConfig, seed, losses, output folder) and runs `models.trainer.train_candidate` on it; the Trainer inside joins
the processes (accelerate reads the launcher's RANK / WORLD_SIZE / MASTER_ADDR) and deals the batches out by
rank. Rank 0 alone saves the candidate (train_candidate does that), writes `<job_dir>/progress` ("step total",
replaced after every optimizer step) and, at the end, `<job_dir>/result.json` (metrics and the ids of the rows
trained on). A process that raises writes `<job_dir>/error-rank<r>` (its exception line, then the traceback)
before it exits, so the launcher's one-line error names the real cause whatever else the log holds. Nothing here
touches the store.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from pathlib import Path

from rsiflow.models.launch import ERROR_PREFIX, JOB, PROGRESS, RESULT


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rsiflow.models.train_worker <job_dir>  (started by accelerate launch)", file=sys.stderr)
        return 2
    job_dir = Path(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    try:
        return _run(job_dir, rank)
    except BaseException as e:
        line = traceback.format_exception_only(type(e), e)[-1].strip()
        _write(job_dir / f"{ERROR_PREFIX}{rank}", f"rank {rank}: {line}\n{traceback.format_exc()}")
        raise


def _run(job_dir: Path, rank: int) -> int:
    with open(job_dir / JOB, "rb") as f:
        job = pickle.load(f)
    on_step = (lambda step, total: _write(job_dir / PROGRESS, f"{step} {total}\n")) if rank == 0 else None

    from rsiflow.models.trainer import train_candidate

    metrics, used_ids = train_candidate(**job, on_step=on_step)
    if rank == 0:
        _write(job_dir / RESULT, json.dumps({"metrics": metrics, "used_ids": used_ids}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
