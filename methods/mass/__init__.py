"""MASS (Multi-Agent Self-Supervision): a searched multi-agent workflow, self-judged, distilled into one model.

algorithm.py: the algorithm as plain Python; method.py: the `Method` that runs it in a round (the glue to the
store and the backend), registered in configs/registry.py."""
