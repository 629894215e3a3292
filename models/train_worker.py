"""One training process of an `accelerate launch` job (models/launch.py starts it):
`python -m rsiflow.models.train_worker <job_dir>`.

Every process reads the whole job (`<job_dir>/job.pkl`: the parent checkpoint path, the training rows, the
TrainConfig, seed, losses, output folder) and runs `models.trainer.train_candidate` on it; the Trainer inside joins
the processes (accelerate reads the launcher's RANK / WORLD_SIZE / MASTER_ADDR) and deals the batches out by
rank. Rank 0 alone saves the candidate (train_candidate does that), writes `<job_dir>/progress` ("step total",
replaced after every optimizer step) and, at the end, `<job_dir>/result.json` (metrics and the ids of the rows
trained on). Nothing here touches the store.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

from rsiflow.models.launch import JOB, PROGRESS, RESULT


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rsiflow.models.train_worker <job_dir>  (started by accelerate launch)", file=sys.stderr)
        return 2
    job_dir = Path(argv[0])
    with open(job_dir / JOB, "rb") as f:
        job = pickle.load(f)
    rank = int(os.environ.get("RANK", "0"))
    on_step = (lambda step, total: _write(job_dir / PROGRESS, f"{step} {total}\n")) if rank == 0 else None

    from rsiflow.models.trainer import train_candidate

    metrics, used_ids = train_candidate(**job, on_step=on_step)
    if rank == 0:
        _write(job_dir / RESULT, json.dumps({"metrics": metrics, "used_ids": used_ids}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
