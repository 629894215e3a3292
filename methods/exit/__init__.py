"""ExIt (expert iteration): SFT on the round's verified successes.

algorithm.py: the algorithm as plain Python; method.py: the `Method` that runs it in a round (the glue to the
store and the backend), registered in configs/registry.py."""
