"""SRD (Self-Retrospection Distillation): hindsight notes distilled into foresight through a privileged teacher.

algorithm.py: the algorithm as plain Python; method.py: the `Method` that runs it in a round (the glue to the
store and the backend), registered in configs/registry.py."""
