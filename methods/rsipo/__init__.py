"""RSIPO: skills written by the policy, checked by replay, trusted by empirical Bayes, kept in a library.

algorithm.py: the algorithm as plain Python; method.py: the `Method` that runs it in a round (the glue to the
store and the backend), registered in configs/registry.py."""
