"""X-Tree mining time: 10k, 100k and 1M action symbols, the growth exponent, against HF `tokenizers`' BPE trainer.

    python -m bench.xtree [--sizes 10000,100000,1000000] [--household-sizes 10000,100000,1000000] [--seed 0]

Streams (each trace a trajectory):
- synthetic: 24 symbols; 6 planted sub-routines of 3-6 symbols; each slot of a trace is a routine with
  probability 0.3, else a random symbol; a trace succeeds with probability 0.3, 0.8 when it holds routine 0.
  "planted found" counts the routines whose exact span is a node.
- household: trajectories played in the real household env (train split, default env size) by its scripted
  expert that takes a random admissible action instead with probability 0.3 (at most 12 turns), canonicalised by
  the env. Then the planted-structure check: the expert alone (no noise) on 20 tasks per type, mined together;
  per type the longest node that at least 40% of its trajectories execute.

Timings on each stream, in the same run:
- `own X`: methods.xtree.mine with docs/methods.md, X-Tree's defaults (X = f · len · (succ + 0.05), f − 1 > 1 + 0.5 len,
  depth ≤ 6), until no merge is admissible (the nodes grow with the corpus), and `own X 256` with the pipeline's
  default cap of 256 nodes (distill.xtree.max_nodes);
- `own BPE`: the same code with the score plain BPE uses (X = f, f ≥ 3, depth ≤ 64), capped at the merges of
  `own X`;
- `HF BPE`: `tokenizers.trainers.BpeTrainer` (Rust) on the same traces (one character per symbol, one "word"
  per trace), vocab_size = alphabet + the merges of `own BPE`, min_frequency 3. Its merges are compared with
  `own BPE`'s in order ("same merges"): they agree where no span repeats back to back (HF counts a run "aaa"
  as two (a, a) pairs, X-Tree as one, docs/methods.md's non-overlapping count). It cannot express X-Tree's score
  (success rate, length), its admissibility rule or its depth bound, so the pipeline keeps its own miner.
The growth exponent is the least-squares slope of log(CPU seconds) on log(symbols) over the sizes.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter

from rsiflow.methods.xtree.algorithm import MineParams, Trace, executed, mine

PLAIN_BPE = MineParams(p=0.0, p_s=0.0, eta0=1.0, eta1=0.0, max_depth=64)


def synthetic(n_symbols: int, seed: int) -> tuple[list[Trace], list[tuple[str, ...]]]:
    rng = random.Random(seed)
    alphabet = [f"v{i:02d}<r{i % 3}>" for i in range(24)]
    routines = [tuple(rng.choice(alphabet) for _ in range(rng.randint(3, 6))) for _ in range(6)]
    out, total = [], 0
    while total < n_symbols:
        s: list[str] = []
        length = rng.randint(8, 40)
        while len(s) < length:
            s += routines[rng.randrange(6)] if rng.random() < 0.3 else [rng.choice(alphabet)]
        s = s[:n_symbols - total]
        holds = any(tuple(s[i:i + len(routines[0])]) == routines[0] for i in range(len(s)))
        out.append(Trace(str(len(out)), s, rng.random() < (0.8 if holds else 0.3)))
        total += len(s)
    return out, routines


def household(n_symbols: int, seed: int, noise: float = 0.3, max_turns: int = 12) -> list[Trace]:
    from rsiflow.envs.household import HouseholdEnv

    env = HouseholdEnv()
    rng = random.Random(seed)
    out, total, batch = [], 0, 0
    while total < n_symbols:
        for task in env.sample_tasks("train", 500, seed=seed * 100_003 + batch):
            env.reset(task)
            symbols, success = [], False
            for _ in range(max_turns):
                action = env.expert_action()
                if rng.random() < noise or action is None:
                    action = rng.choice(env.admissible_actions())
                symbols.append(env.canonicalize(action))
                res = env.step(action)
                if res.done:
                    success = res.success
                    break
            symbols = symbols[:n_symbols - total]
            out.append(Trace(task.task_id, symbols, success, task.task_type))
            total += len(symbols)
            if total >= n_symbols:
                break
        batch += 1
    return out


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - w, time.process_time() - c


def hf_bpe(traces: list[Trace], merges: int) -> tuple[list[tuple[str, ...]], float, float]:
    """HF's BPE trainer on the traces: (its merges as symbol spans, wall s, CPU s). Only the training is timed."""
    from tokenizers import Tokenizer, models, trainers

    alphabet = sorted({s for t in traces for s in t.symbols})
    char = {s: chr(0x4E00 + i) for i, s in enumerate(alphabet)}
    back = {c: s for s, c in char.items()}
    texts = ["".join(char[s] for s in t.symbols) for t in traces]
    tok = Tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + merges, min_frequency=3, show_progress=False,
                                  initial_alphabet=list(char.values()))
    _, wall, cpu = timed(lambda: tok.train_from_iterator(texts, trainer))
    spans = [tuple(back[c] for c in "".join(m)) for m in json.loads(tok.to_str())["model"]["merges"]]
    return spans, wall, cpu


def same_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(name: str, traces: list[Trace], planted: list[tuple[str, ...]] | None) -> dict:
    tree, wall, cpu = timed(lambda: mine(traces))
    capped, _, cap_cpu = timed(lambda: mine(traces, MineParams(max_nodes=256)))
    bpe, bpe_wall, bpe_cpu = timed(lambda: mine(traces, MineParams(**{**vars(PLAIN_BPE),
                                                                       "max_nodes": max(len(tree.nodes), 1)})))
    hf, hf_wall, hf_cpu = hf_bpe(traces, len(bpe.nodes))
    own = [n.span for n in bpe.nodes]
    row = {"stream": name, "symbols": tree.n_symbols, "traces": tree.n_traces, "alphabet": len(tree.alphabet),
           "nodes": len(tree.nodes), "depth": max((n.depth for n in tree.nodes), default=0),
           "own_x_wall": wall, "own_x_cpu": cpu, "own_cap_cpu": cap_cpu, "own_bpe_wall": bpe_wall,
           "own_bpe_cpu": bpe_cpu,
           "hf_wall": hf_wall, "hf_cpu": hf_cpu, "bpe_merges": len(own), "same_merges": same_prefix(own, hf),
           "same_set": len(set(own) & set(hf))}
    if planted is not None:
        spans = {n.span for n in tree.nodes}
        row["planted_found"] = f"{sum(r in spans for r in planted)}/{len(planted)}"
    return row


def exponent(rows: list[dict], key: str) -> float | None:
    pts = [(math.log(r["symbols"]), math.log(r[key])) for r in rows if r[key] > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def table(rows: list[dict]) -> list[str]:
    lines = ["| stream | symbols | traces | nodes (depth) | own X: wall / CPU s | own X 256: CPU s | own BPE: CPU s | "
             "HF BPE: wall / CPU s | own X / HF (CPU) | own BPE / HF (CPU) | same merges (in order / as a set) | "
             "planted found |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['stream']} | {r['symbols']:,} | {r['traces']:,} | {r['nodes']} ({r['depth']}) | "
                     f"{r['own_x_wall']:.2f} / {r['own_x_cpu']:.2f} | {r['own_cap_cpu']:.2f} | "
                     f"{r['own_bpe_cpu']:.2f} | "
                     f"{r['hf_wall']:.2f} / {r['hf_cpu']:.2f} | {r['own_x_cpu'] / r['hf_cpu']:.1f}x | "
                     f"{r['own_bpe_cpu'] / r['hf_cpu']:.1f}x | {r['same_merges']} / {r['same_set']} of "
                     f"{r['bpe_merges']} | {r.get('planted_found', '-')} |")
    return lines


def planted_structure(seed: int) -> list[str]:
    """The expert's trajectories, 20 per task type, mined together: each type's characteristic node."""
    from rsiflow.envs.household import TASK_TYPES, HouseholdEnv

    env = HouseholdEnv()
    corpus = []
    for task in env.sample_tasks("train", 20 * len(TASK_TYPES), seed=seed):
        env.reset(task)
        corpus.append(Trace(task.task_id, [env.canonicalize(a) for a in env.solution()], True, task.task_type))
    tree = mine(corpus)
    lines = [f"{len(corpus)} expert trajectories, {tree.n_symbols} symbols -> {len(tree.nodes)} nodes", "",
             "| task type | characteristic node (longest executed by >= 40% of the type) | executed by | f | depth |",
             "|---|---|---|---|---|"]
    for task_type in TASK_TYPES:
        own = [t for t in corpus if t.label == task_type]
        runs = Counter(i for t in own for i in executed(tree.nodes, t.symbols))
        node = max((n for n in tree.nodes if runs[n.idx] >= 0.4 * len(own)), key=lambda n: (n.length, n.score))
        lines.append(f"| {task_type} | {' > '.join(node.span)} | {runs[node.idx]}/{len(own)} | {node.freq} | "
                     f"{node.depth} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--household-sizes", default="10000,100000,1000000")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = []
    for kind, sizes in (("synthetic", args.sizes), ("household", args.household_sizes)):
        group = []
        for n in (int(s) for s in sizes.split(",") if s):
            t0 = time.perf_counter()
            if kind == "synthetic":
                traces, planted = synthetic(n, args.seed)
            else:
                traces, planted = household(n, args.seed), None
            made = time.perf_counter() - t0
            row = measure(kind, traces, planted)
            print(f"{kind} {n:,}: stream made in {made:.1f} s; {json.dumps(row)}", flush=True)
            group.append(row)
        if len(group) > 1:
            print(f"{kind}: growth exponent (CPU s against symbols) own X {exponent(group, 'own_x_cpu'):.2f}, "
                  f"own X 256 {exponent(group, 'own_cap_cpu'):.2f}, "
                  f"own BPE {exponent(group, 'own_bpe_cpu'):.2f}, HF BPE {exponent(group, 'hf_cpu'):.2f}", flush=True)
        rows += group
    print()
    print("\n".join(table(rows)))
    print()
    print("\n".join(planted_structure(args.seed)))


if __name__ == "__main__":
    main()
