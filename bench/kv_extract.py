"""Copying an episode's keys/values out of the hf backend's decoding cache after a call (`HFBackend._extract_row`):
the whole sequence against keeping the prefix the call's rows shared as it is (the entry it was preloaded from)
and copying only the rest. SmolLM2-135M's cache shape (30 layers, 3 key/value heads of 64), float32, 16 rows of
1,200 positions of which 600 are the shared prefix (the household few-shot prompt's share). Prints ms per row for
both and their ratio, three times (the first pass warms the allocator).

    python -m bench.kv_extract
"""

from __future__ import annotations

import time

import numpy as np
import torch

from rsiflow.models.hf_backend import HFBackend, ReservedCacheLayer, _KVEntry

LAYERS, ROWS, HEADS, POSITIONS, DIM, SHARED, NEW = 30, 16, 3, 1200, 64, 600, 580


class _Cache:
    def __init__(self, layers: list[ReservedCacheLayer]):
        self.layers = layers


def main() -> None:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = ReservedCacheLayer(POSITIONS)
        layer.allocate(ROWS, HEADS, DIM, torch.float32, "cpu")
        layer.fill(POSITIONS)
        layer._keys.normal_()
        layer._values.normal_()
        layers.append(layer)
    cache = _Cache(layers)
    shared = _KVEntry(ids=np.arange(SHARED), segments=[[torch.randn(2, HEADS, SHARED, DIM) for _ in range(LAYERS)]])
    ids = list(range(SHARED + NEW))   # SHARED cached tokens at [0, SHARED), then NEW new ones right after

    def per_row(base: _KVEntry | None) -> float:
        start = time.perf_counter()
        for b in range(ROWS):
            HFBackend._extract_row(cache, b, 0, SHARED, SHARED, ids, base)
        return (time.perf_counter() - start) / ROWS * 1e3

    print(f"threads {torch.get_num_threads()}; {ROWS} rows x {len(ids)} tokens, {SHARED} of them the shared prefix")
    for _ in range(3):
        whole, kept = per_row(None), per_row(shared)
        print(f"whole sequence copied {whole:.2f} ms/row; shared prefix kept {kept:.2f} ms/row = {kept / whole:.2f}")


if __name__ == "__main__":
    main()
