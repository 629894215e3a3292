"""Errors the `rsiflow` commands turn into one line (flows/cli.py), kept in a module that imports nothing heavy."""


class StepFailed(RuntimeError):
    """A round's step raised (after its retries): names the run, round and step; the original exception is the cause."""
