"""X-Tree (docs/methods.md, X-Tree): experience tokenization. A BPE-style miner over canonical action symbols.

Each trajectory is a trace of `verb<role>` symbols (the env's `canonicalize`). The miner merges adjacent
tokens like a BPE trainer, but picks merges by how reusable and how successful a span is:

    X = f · len^p · (succ + ε)^p_s

f = the pair's occurrences (non-overlapping: a run "a a a" holds one (a, a), counted from the run's
start), len = the merged span's length in atomic symbols, succ = the success rate of the traces that
contain the pair. A merge is admissible only while it still compresses, f − 1 > η(len) with
η(len) = eta0 + eta1 · len, and while its depth (atomic symbols 0, a merge 1 + its deeper child) is at
most max_depth. The best admissible merge is taken (ties: the smaller token ids), its occurrences are
rewritten, and the loop repeats until no merge is admissible (or max_nodes). Deterministic.

Counting is incremental, as fast BPE trainers do: the traces are one linked list of positions; a merge
visits only its own occurrences and re-counts the pairs of the window around each (the neighbouring
runs of equal tokens, whose non-overlapping count depends on where the run starts); changed pairs are
re-pushed into a heap with lazy invalidation. A pair's count never grows once its tokens exist, so a
pair that is inadmissible stays so. Total work: O(N log N) for N symbols.

The merges form the tree: each node has two children (atomic symbols or earlier nodes), its span, f,
succ, score, depth and the occurrences (trace, start, end) rewritten when it was merged.

Uses (each a config switch in the pipeline):
- `online_bonus`: r_i = r_verifier + λ_g · B_i, B_i the share of the relevant nodes whose span the
  rollout executes (contains contiguously), λ_g = λ0 · (1 − group win rate);
- `turn_weights`: per action, 1 + alpha · (best normalised score of a node span covering it),
  rescaled to mean 1 over the trajectory (ours);
- `render`: the tree (top nodes with their sub-nodes) as an indented outline, the privileged teacher's
  extra prompt.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

_SHIFT = 24                # pair key = (a << _SHIFT) | b; token ids stay below 2**24
_MASK = (1 << _SHIFT) - 1


@dataclass(frozen=True)
class MineParams:
    """The miner's settings (docs/methods.md, X-Tree's defaults, marked ours there)."""

    p: float = 1.0            # exponent of the span length in X
    p_s: float = 1.0          # exponent of (succ + eps) in X
    eps: float = 0.05         # ε
    eta0: float = 1.0         # η(len) = eta0 + eta1 · len
    eta1: float = 0.5
    max_depth: int = 6
    max_nodes: int | None = None   # most merges; None = until no merge is admissible

    def eta(self, length: int) -> float:
        return self.eta0 + self.eta1 * length

    def score(self, f: int, length: int, succ: float) -> float:
        return f * length ** self.p * (succ + self.eps) ** self.p_s


@dataclass(frozen=True)
class Trace:
    """One trajectory's canonical symbols, whether it succeeded, and a label (its task type)."""

    key: str
    symbols: list[str]
    success: bool
    label: str = ""


@dataclass
class Node:
    idx: int                  # merge order, 0-based; its token name is f"#{idx}"
    left: str                 # child token: an atomic symbol or "#<idx>"
    right: str
    span: tuple[str, ...]     # the atomic symbols it stands for
    freq: int                 # f at merge time (= its occurrences)
    succ: float               # success rate of the traces containing it at merge time
    score: float              # X at merge time
    depth: int
    traces: int               # distinct traces containing it at merge time
    labels: dict[str, int] = field(default_factory=dict)   # occurrences by trace label

    @property
    def name(self) -> str:
        return f"#{self.idx}"

    @property
    def length(self) -> int:
        return len(self.span)


class Occurrence(NamedTuple):
    node: int
    trace: int                # index into the mined traces
    start: int                # first atomic position (turn index) in the trace
    end: int                  # one past the last


@dataclass
class Tree:
    nodes: list[Node]
    occurrences: list[Occurrence]
    n_traces: int
    n_symbols: int
    alphabet: list[str]
    params: MineParams

    def node(self, name: str) -> Node | None:
        """The node of a token name ("#3"), None for an atomic symbol."""
        return self.nodes[int(name[1:])] if name.startswith("#") else None

    def relevant(self, label: str | None = None) -> list[Node]:
        """The nodes with an occurrence in a trace of `label` (all nodes for None)."""
        return [n for n in self.nodes if label is None or n.labels.get(label)]


def mine(traces: list[Trace], params: MineParams = MineParams()) -> Tree:
    """Mine the tree of `traces` (module docstring)."""
    alphabet = sorted({s for t in traces for s in t.symbols})
    sym_id = {s: i for i, s in enumerate(alphabet)}
    names = list(alphabet)                      # token id -> name
    length = [1] * len(alphabet)                # token id -> atomic length
    depth = [0] * len(alphabet)
    tok: list[int] = []
    nxt: list[int] = []
    prv: list[int] = []
    seq_of: list[int] = []
    seq_start: list[int] = []
    for s, t in enumerate(traces):
        base = len(tok)
        seq_start.append(base)
        n = len(t.symbols)
        tok.extend(sym_id[x] for x in t.symbols)
        nxt.extend(range(base + 1, base + n))
        if n:
            nxt.append(-1)
            prv.append(-1)
        prv.extend(range(base, base + n - 1))
        seq_of.extend([s] * n)
    success = [bool(t.success) for t in traces]
    labels = [t.label for t in traces]

    pair_pos: dict[int, set[int]] = {}
    pair_seq: dict[int, dict[int, int]] = {}
    pair_succ: dict[int, int] = {}
    dirty: set[int] = set()

    def add(q: int) -> None:
        key = (tok[q] << _SHIFT) | tok[nxt[q]]
        pos = pair_pos.get(key)
        if pos is None:
            pair_pos[key] = pos = set()
            pair_seq[key] = {}
            pair_succ[key] = 0
        pos.add(q)
        s = seq_of[q]
        seqs = pair_seq[key]
        c = seqs.get(s, 0)
        if not c and success[s]:
            pair_succ[key] += 1
        seqs[s] = c + 1
        dirty.add(key)

    def remove(q: int) -> None:
        key = (tok[q] << _SHIFT) | tok[nxt[q]]
        pair_pos[key].remove(q)
        s = seq_of[q]
        seqs = pair_seq[key]
        c = seqs[s] - 1
        if c:
            seqs[s] = c
        else:
            del seqs[s]
            if success[s]:
                pair_succ[key] -= 1
        dirty.add(key)

    def counted(left: int, right: int) -> list[int]:
        """Starts of the counted pairs from `left` (a run start) up to the pair ending at `right` (a run end;
        -1: to the trace's end). Equal neighbours are counted from their run's start, every other position."""
        out = []
        q, idx = left, 0
        while q != right:
            n = nxt[q]
            if n < 0:
                break
            if tok[n] == tok[q]:
                if not idx & 1:
                    out.append(q)
                idx += 1
            else:
                out.append(q)
                idx = 0
            q = n
        return out

    def run_start(q: int) -> int:
        t = tok[q]
        while prv[q] >= 0 and tok[prv[q]] == t:
            q = prv[q]
        return q

    def run_end(q: int) -> int:
        t = tok[q]
        while nxt[q] >= 0 and tok[nxt[q]] == t:
            q = nxt[q]
        return q

    for s, base in enumerate(seq_start):       # the initial count, in bulk
        if len(traces[s].symbols) > 1:
            for q in counted(base, -1):
                key = (tok[q] << _SHIFT) | tok[nxt[q]]
                pos = pair_pos.get(key)
                if pos is None:
                    pair_pos[key] = {q}
                    pair_seq[key] = {s: 1}
                    pair_succ[key] = int(success[s])
                    continue
                pos.add(q)
                seqs = pair_seq[key]
                c = seqs.get(s, 0)
                if not c and success[s]:
                    pair_succ[key] += 1
                seqs[s] = c + 1
    dirty.update(pair_pos)

    version: dict[int, int] = {}
    heap: list[tuple[float, int, int, int]] = []

    def stats(key: int) -> tuple[int, int, int, float]:
        """(f, length, depth, succ) of a pair."""
        a, b = key >> _SHIFT, key & _MASK
        seqs = pair_seq[key]
        return (len(pair_pos[key]), length[a] + length[b], 1 + max(depth[a], depth[b]),
                pair_succ[key] / len(seqs) if seqs else 0.0)

    def push(key: int) -> None:
        v = version.get(key, 0) + 1
        version[key] = v
        if not pair_pos[key]:
            del pair_pos[key], pair_seq[key], pair_succ[key]
            return
        f, ln, d, succ = stats(key)
        if d <= params.max_depth and f - 1 > params.eta(ln):
            heapq.heappush(heap, (-params.score(f, ln, succ), key >> _SHIFT, key & _MASK, v))

    for key in sorted(dirty):
        push(key)
    dirty.clear()

    nodes: list[Node] = []
    occurrences: list[Occurrence] = []
    while heap and (params.max_nodes is None or len(nodes) < params.max_nodes):
        neg, a, b, v = heapq.heappop(heap)
        key = (a << _SHIFT) | b
        if version.get(key) != v:
            continue
        f, ln, d, succ = stats(key)
        new = len(names)
        if new > _MASK:
            raise ValueError(f"more than {_MASK} tokens: raise max_nodes' limit or shorten the corpus")
        idx = len(nodes)
        names.append(f"#{idx}")
        length.append(ln)
        depth.append(d)
        positions = sorted(pair_pos[key])
        node_labels = Counter(labels[seq_of[q]] for q in positions)
        nodes.append(Node(idx=idx, left=names[a], right=names[b], span=(*_span(nodes, names, a),
                                                                        *_span(nodes, names, b)),
                          freq=f, succ=succ, score=-neg, depth=d, traces=len(pair_seq[key]),
                          labels=dict(sorted(node_labels.items()))))
        for q in positions:
            s = seq_of[q]
            start = q - seq_start[s]
            occurrences.append(Occurrence(idx, s, start, start + ln))
        i = 0
        while i < len(positions):
            batch = [positions[i]]                    # a chain: each occurrence right after the previous one
            while i + 1 < len(positions) and nxt[nxt[batch[-1]]] == positions[i + 1]:
                i += 1
                batch.append(positions[i])
            i += 1
            # the window whose counted pairs can change: a neighbour of another token keeps its run as it is
            p = prv[batch[0]]
            left = batch[0] if p < 0 else p if tok[p] != a else run_start(p)
            n = nxt[nxt[batch[-1]]]
            right = -1 if n < 0 else n if tok[n] != b else run_end(n)
            for q in counted(left, right):
                remove(q)
            for q in batch:
                j = nxt[q]
                tok[q] = new
                nx = nxt[j]
                nxt[q] = nx
                if nx >= 0:
                    prv[nx] = q
            for q in counted(left, right):
                add(q)
        for k in sorted(dirty):
            push(k)
        dirty.clear()
    return Tree(nodes=nodes, occurrences=occurrences, n_traces=len(traces), n_symbols=len(tok),
                alphabet=alphabet, params=params)


def _span(nodes: list[Node], names: list[str], token: int) -> tuple[str, ...]:
    name = names[token]
    return nodes[int(name[1:])].span if name.startswith("#") else (name,)


# ---- uses ------------------------------------------------------------------------------------------


def executed(nodes: list[Node], symbols: list[str]) -> list[int]:
    """Indices of the nodes whose span occurs contiguously in `symbols`."""
    present = {tuple(symbols[i:j]) for i in range(len(symbols)) for j in range(i + 2, len(symbols) + 1)}
    return [n.idx for n in nodes if n.span in present]


def bonus_weight(win_rate: float, lambda0: float) -> float:
    """λ_g = λ0 · (1 − group win rate): λ0 in an all-fail group, 0 when every rollout succeeded."""
    if not 0.0 <= win_rate <= 1.0:
        raise ValueError(f"a win rate lies in [0, 1], got {win_rate}")
    return lambda0 * (1.0 - win_rate)


def online_bonus(group: list[tuple[list[str], bool]], nodes: list[Node], lambda0: float) -> dict:
    """The bonus of each rollout of one group: `group` is (symbols, success) per rollout, `nodes` the nodes
    the share is taken over (e.g. those relevant to the group's task type). Returns lambda_g, win_rate and,
    per rollout in order, its share B_i of the nodes executed, the executed node indices and the bonus
    λ_g · B_i (0 for every rollout when there are no nodes)."""
    win = sum(s for _, s in group) / len(group) if group else 0.0
    lam = bonus_weight(win, lambda0)
    rows = []
    for symbols, _ in group:
        hit = executed(nodes, symbols) if nodes else []
        share = len(hit) / len(nodes) if nodes else 0.0
        rows.append({"share": share, "nodes": hit, "bonus": lam * share})
    return {"lambda_g": lam, "win_rate": win, "rollouts": rows}


def turn_weights(nodes: list[Node], symbols: list[str], alpha: float) -> list[float]:
    """Per action of a trajectory: 1 + alpha · s_t, with s_t the highest score X / max X over the nodes
    whose span covers action t where it occurs in `symbols` (0 outside every span), rescaled to mean 1 over
    the trajectory (so weighting moves the loss between actions, not its total)."""
    if not symbols:
        return []
    top = max((n.score for n in nodes), default=0.0)
    s = [0.0] * len(symbols)
    if top > 0:
        for n in nodes:
            k = n.length
            for i in range(len(symbols) - k + 1):
                if tuple(symbols[i:i + k]) == n.span:
                    for t in range(i, i + k):
                        s[t] = max(s[t], n.score / top)
    w = [1.0 + alpha * x for x in s]
    m = sum(w) / len(w)
    return [x / m for x in w]


def render(tree: Tree, nodes: list[Node] | None = None, top: int = 8, sep: str = " > ") -> str:
    """An indented outline of the `top` highest-scoring nodes of `nodes` (default: all), each with the merged
    nodes below it; a node already shown under a higher one is not repeated as a root."""
    pool = sorted(tree.nodes if nodes is None else nodes, key=lambda n: (-n.score, n.idx))[:top]
    below: set[int] = set()

    def descend(n: Node) -> None:
        for child in (n.left, n.right):
            c = tree.node(child)
            if c is not None and c.idx not in below:
                below.add(c.idx)
                descend(c)

    for n in pool:
        descend(n)
    lines: list[str] = []

    def show(n: Node, level: int) -> None:
        lines.append(f"{'  ' * level}- {sep.join(n.span)}  (used {n.freq}x, success {n.succ:.2f})")
        for child in (n.left, n.right):
            c = tree.node(child)
            if c is not None:
                show(c, level + 1)

    for n in pool:
        if n.idx not in below:
            show(n, 0)
    return "\n".join(lines)
