"""Examples: a complete bring-your-own env in one file (countdown_env.py) and its config (byo.yaml)."""
