"""X-Tree: a tree of reusable action spans mined from the run's rollouts, and its uses.

algorithm.py: the algorithm as plain Python; method.py: the `Method` that runs it in a round (the glue to the
store and the backend), registered in configs/registry.py."""
