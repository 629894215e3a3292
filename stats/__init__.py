"""Statistics the steps share: success intervals and the gate's tests (success.py), the promotion rules and
the sequential procedure (gating.py), per-task groups of rollouts (groups.py)."""
