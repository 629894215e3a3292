"""Training a candidate under `accelerate launch` (train.processes > 1, or a train.accelerate_config).

The train step calls `train_launched` instead of `models.trainer.train_candidate`; it

1. writes the job (parent checkpoint path, the round's training rows, the TrainConfig, seed, losses, output
   folder) to `<job_dir>/job.pkl`; every process reads the whole job (each needs all rows: they encode them the
   same way and the trainers deal the batches out by process index, see below);
2. runs `python -m accelerate.commands.launch --config_file F --num_processes N [--main_process_port P]
   -m rsiflow.models.train_worker <job_dir>` with its output in `<job_dir>/launch.log`, following rank 0's progress
   file (`on_step`);
3. reads rank 0's `<job_dir>/result.json` (metrics and the ids of the rows trained on). Only rank 0 saves the
   candidate and writes the result; the store rows stay the train step's, written after this returns.

A job that exits non-zero raises `LaunchError` with one line: the exit code, the first failed rank's exception
(its `<job_dir>/error-rank<r>`, else the log's last exception line, else the launcher's root-cause summary),
and the log's path. The step then registers nothing; a rerun clears `<job_dir>` and the output folder.

Without an accelerate_config, F is a file written here: one machine, `distributed_type: MULTI_GPU` (accelerate's
torchrun launcher: N local processes), no mixed precision (the trainer picks bf16 from model.dtype). On a machine
without GPUs the trainer runs every process on CPU (`use_cpu`) and accelerate joins them with gloo
(MULTI_CPU). Writing F also keeps a user's default accelerate config (~/.cache/huggingface/accelerate) out.

Data sharding (what a process trains on): SFT/distillation rows go through the Trainer's DataLoader, which
accelerate prepares with a seedable sampler: every process draws the same permutation (seed = the round's
training seed) and cuts it into per-process batches of train.batch_size; process r takes batches r, r+N, r+2N, ...
(BatchSamplerShard, split_batches=False; the last batches wrap around to the start when the rows don't fill
N batches: even_batches). GRPO rows are dealt the same way by models.grpo_trainer.StoredRolloutGRPOTrainer. So one
optimizer step sees batch_size x grad_accum x N rows; with batch_size B/N it sees the rows one process with
batch_size B would see, in the same order.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from rsiflow.configs.schema import ConfigError

REPO = Path(__file__).resolve().parents[1]
JOB, RESULT, PROGRESS, LOG, ACCELERATE_YAML = "job.pkl", "result.json", "progress", "launch.log", "accelerate.yaml"
ERROR_PREFIX = "error-rank"  # + rank: what a training process raised (models/train_worker.py writes it)


class LaunchError(RuntimeError):
    """The launched training job failed (one line: exit code, last exception, log path)."""


def uses_launcher(cfg) -> bool:
    """Whether the train step trains through `accelerate launch` (cfg: configs.schema.TrainConfig)."""
    return cfg.processes > 1 or cfg.accelerate_config is not None


def accelerate_settings(cfg) -> dict[str, Any]:
    """The accelerate config file's settings ({} without one)."""
    if cfg.accelerate_config is None:
        return {}
    return yaml.safe_load(Path(cfg.accelerate_config).expanduser().read_text()) or {}


def shards_parameters(settings: dict) -> bool:
    """Whether the accelerate settings shard the parameters over processes (FSDP, DeepSpeed ZeRO-3)."""
    kind = str(settings.get("distributed_type", "")).upper()
    zero = (settings.get("deepspeed_config") or {}).get("zero_stage")
    return kind == "FSDP" or (kind == "DEEPSPEED" and int(zero or 0) == 3)


def check_supported(cfg, rows: list[dict], distill) -> None:
    """ConfigError for what the launched trainer can't do with these settings. Under DDP (the tested setup) every
    row kind and every loss works. With parameters sharded (FSDP, ZeRO-3) three things read or copy whole weights
    on every process and are refused: validation rows (per-epoch loss and best-epoch restore), the EMA teacher of
    distillation rows (a full copy updated from the local parameters) and LoRA (merged before saving)."""
    terms = list(distill.values()) if isinstance(distill, dict) else [distill] if distill is not None else []
    if len(terms) > 1 and getattr(cfg, "processes", 1) > 1:
        raise ConfigError("train.processes > 1 with several distillation terms (distill.methods with more than one "
                          "of srd, xtree context, rsipo): the launched trainer merges one term's per-step log; run "
                          "them in one process, or one such method per run")
    settings = accelerate_settings(cfg)
    if not shards_parameters(settings):
        return
    where = f"train.accelerate_config ({cfg.accelerate_config}: distributed_type {settings.get('distributed_type')})"
    if any(r.get("validation") for r in rows):
        raise ConfigError(f"{where} shards the parameters: validation rows (MASS's next-ranked episodes) need whole "
                          "weights on every process; use DDP or DeepSpeed ZeRO-1/2 for this method")
    if any(d.ema_rate > 0 for d in terms) and any(r.get("kind") == "distill" for r in rows):
        raise ConfigError(f"{where} shards the parameters: the EMA teacher of distillation rows needs whole weights; "
                          "set the method's distill ema_rate to 0 or use DDP / ZeRO-1/2")
    if cfg.lora.enabled:
        raise ConfigError(f"{where} shards the parameters: train.lora.enabled is not supported with it here; "
                          "use DDP or DeepSpeed ZeRO-1/2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(cfg, job_dir: str | Path, port: int | None = None, python: str = sys.executable) -> list[str]:
    """The `accelerate launch` command line of a job (writes `<job_dir>/accelerate.yaml` when the config names no
    accelerate config). `port`: the rendezvous port (train.main_process_port, else the accelerate config's, else
    the caller's free port)."""
    job_dir = Path(job_dir)
    if cfg.accelerate_config is not None:
        config_file = str(Path(cfg.accelerate_config).expanduser().resolve())
    else:
        config_file = str(job_dir / ACCELERATE_YAML)
        (job_dir / ACCELERATE_YAML).write_text(yaml.safe_dump({
            "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": 1,
            "machine_rank": 0, "num_processes": cfg.processes, "gpu_ids": "all", "mixed_precision": "no",
            "use_cpu": False, "rdzv_backend": "static", "same_network": True, "main_training_function": "main",
            "downcast_bf16": "no", "debug": False}, sort_keys=False))
    cmd = [python, "-m", "accelerate.commands.launch", "--config_file", config_file,
           "--num_processes", str(cfg.processes)]
    if cfg.main_process_port is not None:
        port = cfg.main_process_port
    elif accelerate_settings(cfg).get("main_process_port") is not None:
        port = None
    if port is not None:
        cmd += ["--main_process_port", str(port)]
    return cmd + ["-m", "rsiflow.models.train_worker", str(job_dir)]


def _last_error(job_dir: Path) -> str:
    """Why the job failed, in one line: the exception of the rank that failed first (the oldest
    `error-rank<r>` file; the others usually fail after it, on the broken collective), else the log's last
    exception line from a training process (not the launcher's ChildFailedError wrapper), else the launcher's
    root-cause summary (rank and exit code of a process that died without a Python exception), else the log's
    last line that is not a rule."""
    errors = sorted(job_dir.glob(ERROR_PREFIX + "*"), key=lambda p: p.stat().st_mtime)
    for path in errors:
        with contextlib.suppress(OSError, IndexError):   # unreadable or empty: the next source
            return path.read_text(errors="replace").splitlines()[0][:400]
    try:
        lines = [ln.strip() for ln in (job_dir / LOG).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    pattern = re.compile(r"^(\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(Error|Exception|Interrupt)|Killed)\b")
    found = [ln for ln in lines if pattern.match(ln) and "ChildFailedError" not in ln]
    if found:
        return found[-1][:400]
    cause = [ln for ln in lines if re.match(r"^(rank|exitcode|error_file)\s*:", ln)]
    if cause:
        return "no exception in the log; launcher's root cause: " + ", ".join(" ".join(ln.split()) for ln in cause[:3])
    lines = [ln for ln in lines if not re.fullmatch(r"[=\-_ ]+", ln)]
    return (lines[-1] if lines else "(empty log)")[:400]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the job's process group (the launcher and its training processes), SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def train_launched(job_dir: str | Path, cfg, on_step=None, poll_s: float = 1.0,
                   **train_kwargs) -> tuple[dict[str, Any], list]:
    """`models.trainer.train_candidate(cfg=cfg, on_step=on_step, **train_kwargs)` run by `accelerate launch` with
    cfg.processes processes; returns its (metrics, ids of the rows trained on) from rank 0. `job_dir` is emptied
    first (a rerun starts clean). Raises LaunchError if the job fails; an interrupted wait stops the job."""
    check_supported(cfg, train_kwargs.get("rows", []), train_kwargs.get("distill"))
    job_dir = Path(job_dir)
    if job_dir.exists():
        shutil.rmtree(job_dir)
    job_dir.mkdir(parents=True)
    tmp = job_dir / (JOB + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump({**train_kwargs, "cfg": cfg}, f, protocol=pickle.HIGHEST_PROTOCOL)
    tmp.rename(job_dir / JOB)
    cmd = launch_command(cfg, job_dir, port=free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "TOKENIZERS_PARALLELISM": "false"}
    if "OMP_NUM_THREADS" not in env:  # torchrun would set 1; share this machine's cores between its processes
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.processes))
    log = job_dir / LOG
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    seen = -1
    try:
        while proc.poll() is None:
            time.sleep(poll_s)
            seen = _report_progress(job_dir / PROGRESS, on_step, seen)
    except BaseException:
        _stop(proc)
        raise
    _report_progress(job_dir / PROGRESS, on_step, seen)
    if proc.returncode != 0:
        raise LaunchError(f"accelerate launch ({cfg.processes} processes) exited with {proc.returncode}: "
                          f"{_last_error(job_dir)} (log: {log})")
    try:
        result = json.loads((job_dir / RESULT).read_text())
    except (OSError, ValueError) as e:
        raise LaunchError(f"accelerate launch exited with 0 but rank 0 left no readable {RESULT}: {e} "
                          f"(log: {log})") from None
    return result["metrics"], result["used_ids"]


def _report_progress(path: Path, on_step, seen: int) -> int:
    """Calls on_step(step, total) with rank 0's last progress line if it moved on; returns the step seen."""
    if on_step is None:
        return seen
    try:
        last = path.read_text().split()[-2:]
    except (OSError, IndexError):
        return seen
    if len(last) == 2 and last[0].isdigit() and last[1].isdigit() and int(last[0]) != seen:
        on_step(int(last[0]), int(last[1]))
        return int(last[0])
    return seen
