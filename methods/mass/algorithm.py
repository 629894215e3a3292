"""MASS (Multi-Agent Self-Supervision, docs/methods.md, MASS): one model as solver, workflow optimizer and judge.

What this module computes (plain Python; the model is reached through a generation backend passed in,
the env's verifier through a function passed in; methods/mass/method.py does the store and the round):

- `Workflow`: a typed spec, the order of hops between sub-agents and, per sub-agent, its role, instruction
  and output contract; JSON round-trip (`to_dict` / `from_dict`, errors name the bad key) and rendering into
  prompts (`hop_messages`). Every hop is one call of the same model. The last hop answers the task: its prompt
  is the *bare* task prompt (the env's system message and few-shot turns, the task message) with the earlier
  hops' notes and its contract added to the task message, so dropping them gives back the bare task prompt
  (what SFT trains on). The reference workflow is that last hop alone: the bare single-agent answer.
- `mutate`: the structured mutation operator (ours, for models too small to propose edits): add a hop,
  remove a hop, reorder two hops, change a contract; the result is always a valid spec.
- `proposal_messages` / `parse_proposal`: the model's own proposal of the next version from the history of
  verdicts, rationales and diffs (JSON, validated like any spec).
- The pairwise judge (docs/methods.md): `judge_messages` / `parse_verdict` (A, B or tie, with a rationale),
  asked in both orders (`judge_pairs`) and combined into one score in {0, 1/4, 1/2, 3/4, 1} for the first
  item, so a judge that always answers "A" gives a tie; `oracle_pairs` decides by the env's verifier instead
  (a named option: it tests the pipeline where the model's judgement is near chance); `agreement` scores the
  judge against the verifier.
- `bradley_terry`: the MM algorithm exactly as docs/methods.md writes it (prior of virtual games, renormalised
  to mean 1, 500 iterations, score = log p).
- `ring_pairs`, `select_ranked`: the teacher-collection tournament (each episode judged against m others) and
  the split of the ranks into training (top) and validation (next) episodes.
- `sft_messages`: the SFT conversation of an episode: the bare task prompt and the workflow's final answer.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

# ---- workflow spec ------------------------------------------------------------------------------------------

MAX_HOPS = 6
FINAL_ROLE = "solver"


class SpecError(ValueError):
    """A workflow spec that is not valid; the message names the bad key."""


@dataclass(frozen=True)
class Agent:
    """One sub-agent: its role (unique in the workflow), what it is told, and what its output must be."""

    role: str
    instruction: str
    contract: str


@dataclass(frozen=True)
class Workflow:
    """Sub-agents and the order of hops between them (roles, each once); the last hop answers the task and is
    played by the `solver` agent. The reference workflow is `Workflow.reference()`: the solver alone."""

    agents: tuple[Agent, ...]
    hops: tuple[str, ...]

    def __post_init__(self):
        validate(self)

    @staticmethod
    def reference() -> Workflow:
        return Workflow(agents=(Agent(FINAL_ROLE, "", ""),), hops=(FINAL_ROLE,))

    @property
    def is_reference(self) -> bool:
        return len(self.hops) == 1 and not self.agent(FINAL_ROLE).contract and not self.agent(FINAL_ROLE).instruction

    def agent(self, role: str) -> Agent:
        return next(a for a in self.agents if a.role == role)

    def to_dict(self) -> dict:
        return {"agents": [asdict(a) for a in self.agents], "hops": list(self.hops)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data) -> Workflow:
        """A Workflow from its dict form; SpecError naming the bad key (`agents[1].contract`, `hops`, ...)."""
        if not isinstance(data, dict):
            raise SpecError(f"workflow: expected an object with 'agents' and 'hops', got {type(data).__name__}")
        unknown = set(data) - {"agents", "hops"}
        if unknown:
            raise SpecError(f"workflow: unknown key(s) {sorted(unknown)}; a workflow has 'agents' and 'hops'")
        agents_in, hops = data.get("agents"), data.get("hops")
        if not isinstance(agents_in, list) or not agents_in:
            raise SpecError("agents: expected a non-empty list of {role, instruction, contract}")
        if not isinstance(hops, list) or not all(isinstance(h, str) for h in hops):
            raise SpecError("hops: expected a list of agent roles (str)")
        agents = []
        for i, a in enumerate(agents_in):
            if not isinstance(a, dict):
                raise SpecError(f"agents[{i}]: expected an object, got {type(a).__name__}")
            for key in ("role", "instruction", "contract"):
                if not isinstance(a.get(key), str):
                    raise SpecError(f"agents[{i}].{key}: missing or not a string")
            extra = set(a) - {"role", "instruction", "contract"}
            if extra:
                raise SpecError(f"agents[{i}]: unknown key(s) {sorted(extra)}")
            agents.append(Agent(a["role"].strip(), a["instruction"].strip(), a["contract"].strip()))
        return cls(agents=tuple(agents), hops=tuple(h.strip() for h in hops))

    @classmethod
    def from_json(cls, text: str) -> Workflow:
        return cls.from_dict(json.loads(text))


def validate(w: Workflow) -> None:
    """SpecError unless: 1..MAX_HOPS hops, each naming a defined agent once, the last one the solver; roles unique,
    short and plain; every agent used; every non-solver agent has an instruction and a contract."""
    roles = [a.role for a in w.agents]
    for i, role in enumerate(roles):
        if not re.fullmatch(r"[a-z][a-z_]{0,23}", role):
            raise SpecError(f"agents[{i}].role: {role!r} must be 1-24 lowercase letters or '_'")
    if len(set(roles)) != len(roles):
        raise SpecError(f"agents: a role is defined twice ({roles})")
    if not 1 <= len(w.hops) <= MAX_HOPS:
        raise SpecError(f"hops: {len(w.hops)} hops; a workflow has 1 to {MAX_HOPS}")
    for i, hop in enumerate(w.hops):
        if hop not in roles:
            raise SpecError(f"hops[{i}]: {hop!r} is not a defined agent role ({roles})")
    if len(set(w.hops)) != len(w.hops):
        raise SpecError(f"hops: a role takes two hops ({list(w.hops)})")
    if w.hops[-1] != FINAL_ROLE:
        raise SpecError(f"hops[{len(w.hops) - 1}]: the last hop must be {FINAL_ROLE!r} (it answers the task)")
    unused = set(roles) - set(w.hops)
    if unused:
        raise SpecError(f"agents: {sorted(unused)} take no hop")
    for i, a in enumerate(w.agents):
        if a.role != FINAL_ROLE and not (a.instruction and a.contract):
            raise SpecError(f"agents[{i}]: {a.role!r} needs an instruction and a contract")
        if len(a.instruction) > 400 or len(a.contract) > 200:
            raise SpecError(f"agents[{i}]: instruction (<= 400 chars) or contract (<= 200 chars) too long")


def spec_diff(old: Workflow, new: Workflow) -> list[str]:
    """What changed from `old` to `new`, one line per change (hops, instructions, contracts)."""
    out = []
    if old.hops != new.hops:
        out.append(f"hops: {' -> '.join(old.hops)}  =>  {' -> '.join(new.hops)}")
    old_agents = {a.role: a for a in old.agents}
    for a in new.agents:
        before = old_agents.get(a.role)
        if before is None:
            out.append(f"+ {a.role}: {a.instruction} [contract: {a.contract}]")
            continue
        if before.instruction != a.instruction:
            out.append(f"~ {a.role}.instruction: {before.instruction!r} => {a.instruction!r}")
        if before.contract != a.contract:
            out.append(f"~ {a.role}.contract: {before.contract!r} => {a.contract!r}")
    out += [f"- {role}" for role in old_agents if role not in {a.role for a in new.agents}]
    return out


# The seed version v0 (a planner, then the solver) and the library the mutation operator draws from.
SEED_WORKFLOW = Workflow(
    agents=(Agent("planner", "Read the task and plan how to solve it. Do not give the final answer.",
                  "at most 3 short numbered steps"),
            Agent(FINAL_ROLE, "Follow your team's notes.", "")),
    hops=("planner", FINAL_ROLE))

ROLE_LIBRARY = (
    Agent("planner", "Read the task and plan how to solve it. Do not give the final answer.",
          "at most 3 short numbered steps"),
    Agent("analyst", "List the facts and quantities the task gives, and what it asks for.",
          "a short list of the given facts, then the question"),
    Agent("worker", "Work the task out step by step, showing each intermediate result.",
          "the working, one step a line, ending with the result"),
    Agent("checker", "Check the notes so far for mistakes and say what the correct result is.",
          "'OK' or the mistake and its correction, in one line"),
    Agent("critic", "Point out what a good answer to this task must contain and what to avoid.",
          "two short bullet points"),
)
CONTRACT_LIBRARY = (
    "one short line",
    "at most 3 short numbered steps",
    "a short list of facts",
    "the result only",
    "two sentences at most",
    "the working, one step a line, ending with the result",
)
SOLVER_CONTRACTS = ("", "Answer in the required format; keep it short.",
                    "Check the notes, then answer in the required format.")
MUTATIONS = ("add_hop", "remove_hop", "reorder_hops", "change_contract")


def mutate(w: Workflow, rng: random.Random) -> tuple[Workflow, dict]:
    """One structured edit of `w` (docs/methods.md, MASS, ours): an operator drawn among those that apply, then its
    arguments; returns the new (valid) spec and {"op", "detail"}. Structure first: add/remove/reorder are drawn
    before change_contract when they apply (weights 3:2:2:1)."""
    helpers = [h for h in w.hops if h != FINAL_ROLE]
    spare = [a for a in ROLE_LIBRARY if a.role not in {x.role for x in w.agents}]
    ops, weights = [], []
    for op, ok, weight in (("add_hop", spare and len(w.hops) < MAX_HOPS, 3), ("remove_hop", len(helpers) >= 1, 2),
                           ("reorder_hops", len(helpers) >= 2, 2), ("change_contract", True, 1)):
        if ok:
            ops.append(op)
            weights.append(weight)
    op = rng.choices(ops, weights)[0]
    agents, hops = list(w.agents), list(w.hops)
    if op == "add_hop":
        new = rng.choice(spare)
        at = rng.randrange(len(hops))          # anywhere before the solver
        hops.insert(at, new.role)
        agents.insert(at, new)
        detail = f"add {new.role} at hop {at}"
    elif op == "remove_hop":
        role = rng.choice(helpers)
        hops.remove(role)
        agents = [a for a in agents if a.role != role]
        detail = f"remove {role}"
    elif op == "reorder_hops":
        i, j = sorted(rng.sample(range(len(helpers)), 2))
        hops[i], hops[j] = hops[j], hops[i]
        detail = f"swap hops {i} ({hops[j]}) and {j} ({hops[i]})"
    else:
        role = rng.choice(list(hops))
        a = next(x for x in agents if x.role == role)
        options = [c for c in (SOLVER_CONTRACTS if role == FINAL_ROLE else CONTRACT_LIBRARY) if c != a.contract]
        contract = rng.choice(options)
        agents = [Agent(x.role, x.instruction, contract) if x.role == role else x for x in agents]
        detail = f"{role}.contract: {a.contract!r} -> {contract!r}"
    out = Workflow(agents=tuple(agents), hops=tuple(hops))
    return out, {"op": op, "detail": detail}


# ---- rendering ----------------------------------------------------------------------------------------------

def solver_message(task_message: str, notes: list[tuple[str, str]], instruction: str, contract: str) -> str:
    """The solver's task message: the earlier hops' notes, the bare task message with its instruction and contract
    in parentheses before the message's last line (where the env asks for the action, e.g. "Your action:"; after
    a one-line message). With no notes, instruction or contract it is the bare task message itself."""
    head = "".join(f"Note from the {role}: {text.strip()}\n" for role, text in notes)
    said = " ".join(x for x in (instruction, contract) if x)
    body = task_message
    if said:
        first, sep, last = task_message.rpartition("\n")
        body = f"{first}\n({said}){sep}{last}" if sep else f"{task_message}\n({said})"
    return (f"{head}\n" if head else "") + body


def hop_messages(w: Workflow, hop: int, prefix: list[dict], task_message: str, task_text: str,
                 notes: list[tuple[str, str]]) -> list[dict]:
    """The conversation hop `hop` of `w` sends to the model. `prefix` is the env's bare prompt prefix (system
    message, few-shot turns), `task_message` the task's user message as the bare prompt shows it, `task_text` the
    task statement alone, `notes` the (role, output) of the earlier hops. A helper hop gets its own system message
    (role, instruction) and the task with the notes so far; the solver gets the bare prompt with the notes and its
    instruction and contract after the task message."""
    agent = w.agent(w.hops[hop])
    if agent.role == FINAL_ROLE:
        return [*prefix, {"role": "user",
                          "content": solver_message(task_message, notes, agent.instruction, agent.contract)}]
    system = f"You are the {agent.role} of a team that solves tasks together. {agent.instruction}"
    body = f"Task: {task_text.strip()}\n"
    body += "".join(f"Note from the {role}: {text.strip()}\n" for role, text in notes)
    body += f"\nWrite {agent.contract}. Do not answer for the whole team."
    return [{"role": "system", "content": system}, {"role": "user", "content": body}]


def sft_messages(prefix: list[dict], task_message: str, answer: str) -> list[dict]:
    """The SFT conversation of a teacher episode: the bare task prompt (the workflow's notes and contracts
    dropped) and the workflow's final answer as the assistant turn; train from len(prefix)."""
    return [*prefix, {"role": "user", "content": task_message}, {"role": "assistant", "content": answer}]


# ---- execution ----------------------------------------------------------------------------------------------

@dataclass
class Episode:
    """One run of a workflow on one task: every hop's output, the final answer, the verifier's outcome (None
    where the env has no verifier)."""

    episode_id: str
    task_id: str
    workflow_id: str
    hops: list[dict] = field(default_factory=list)   # {"role", "output", "tokens"}
    final: str = ""
    gen_tokens: int = 0
    final_tokens: int = 0
    success: bool | None = None
    reward: float | None = None


@dataclass(frozen=True)
class TaskPrompt:
    """A task as the workflow sees it: its id, its statement and its user message in the bare prompt."""

    task_id: str
    text: str
    message: str


Generate = Callable[[list[list[dict]], bool], list[tuple[str, int]]]
"""generate(conversations, final_hop) -> [(text, tokens)]: one batched model call (the final hop stops where an
env action ends)."""


def run_workflow(w: Workflow, workflow_id: str, tasks: list[TaskPrompt], prefix: list[dict], generate: Generate,
                 episode_id: Callable[[int, TaskPrompt], str]) -> list[Episode]:
    """Play `w` on every task, hop by hop, all tasks' hop k in one batched call."""
    episodes = [Episode(episode_id(i, t), t.task_id, workflow_id) for i, t in enumerate(tasks)]
    for k, role in enumerate(w.hops):
        convs = [hop_messages(w, k, prefix, t.message, t.text, [(h["role"], h["output"]) for h in ep.hops])
                 for t, ep in zip(tasks, episodes)]
        outs = generate(convs, role == FINAL_ROLE)
        for ep, (text, tokens) in zip(episodes, outs):
            ep.hops.append({"role": role, "output": text, "tokens": tokens})
            ep.gen_tokens += tokens
            if role == FINAL_ROLE:
                ep.final, ep.final_tokens = text.strip(), tokens
    return episodes


# ---- the pairwise judge -------------------------------------------------------------------------------------

JUDGE_SYSTEM = ("You are a strict judge. You compare two responses to the same task and say which one is better: "
                "correct beats incorrect, then clear and complete beats vague.")
VERDICTS = ("A", "B", "tie", "invalid")
_VERDICT_RE = re.compile(r"^\W*(?:verdict\s*[:\-]?\s*)?(?:response\s+)?(A|B|tie)\b\W*(.*)$", re.IGNORECASE | re.DOTALL)


def judge_messages(task_text: str, a: str, b: str) -> list[dict]:
    return [{"role": "system", "content": JUDGE_SYSTEM},
            {"role": "user", "content": f"Task: {task_text.strip()}\n\nResponse A: {a.strip() or '(empty)'}\n\n"
                                        f"Response B: {b.strip() or '(empty)'}\n\nWhich response is better? Reply "
                                        "'A', 'B' or 'tie', then one short sentence saying why."}]


def parse_verdict(text: str) -> tuple[str, str]:
    """(verdict, rationale): verdict "A", "B" or "tie" when the reply starts with it (after punctuation, an
    optional 'Verdict:' or 'Response'), else "invalid" (scored as a tie, stored as given)."""
    m = _VERDICT_RE.match(text.strip())
    if not m:
        return "invalid", text.strip()
    v = m.group(1)
    return ("tie" if v.lower() == "tie" else v.upper()), m.group(2).strip()


_FIRST_SCORE = {"A": 1.0, "B": 0.0, "tie": 0.5, "invalid": 0.5}


@dataclass
class PairResult:
    """Both orders of one comparison of x and y: x shown first (ab) and second (ba); `score` is x's combined
    score in [0, 1] (1 = x better in both orders, 1/2 = tie or the two orders disagree)."""

    x: str
    y: str
    task_id: str
    ab: tuple[str, str, str] = ("invalid", "", "")   # (verdict, rationale, raw text), x shown as A
    ba: tuple[str, str, str] = ("invalid", "", "")   # y shown as A
    judge: str = "self"

    @property
    def score(self) -> float:
        return (_FIRST_SCORE[self.ab[0]] + 1.0 - _FIRST_SCORE[self.ba[0]]) / 2

    @property
    def winner(self) -> str | None:
        return self.x if self.score > 0.5 else self.y if self.score < 0.5 else None


def judge_pairs(pairs: list[tuple[str, str, str, str, str, str]], ask: Callable[[list[list[dict]]], list[str]]
                ) -> list[PairResult]:
    """pairs: (x_id, y_id, task_id, task_text, x_text, y_text). `ask(conversations) -> replies` is the judge model;
    both orders of every pair go to it in one batched call."""
    convs = []
    for _, _, _, task_text, x_text, y_text in pairs:
        convs += [judge_messages(task_text, x_text, y_text), judge_messages(task_text, y_text, x_text)]
    replies = ask(convs) if convs else []
    out = []
    for i, (x, y, task_id, _, _, _) in enumerate(pairs):
        r_ab, r_ba = replies[2 * i], replies[2 * i + 1]
        out.append(PairResult(x, y, task_id, (*parse_verdict(r_ab), r_ab), (*parse_verdict(r_ba), r_ba)))
    return out


def oracle_pairs(pairs: list[tuple[str, str, str, str, str, str]], verified: dict[str, bool | None]
                 ) -> list[PairResult]:
    """The `oracle` judge: the env's verifier decides (solved beats unsolved; equal outcomes tie), the same in
    both orders. Raises ValueError for an item the verifier did not score (an env without a verifier)."""
    out = []
    for x, y, task_id, _, _, _ in pairs:
        sx, sy = verified.get(x), verified.get(y)
        if sx is None or sy is None:
            raise ValueError(f"oracle judge: no verifier outcome for {x if sx is None else y} (the env has no "
                             "verifier; use distill.mass.judge=self)")
        first = "A" if sx and not sy else "B" if sy and not sx else "tie"
        second = {"A": "B", "B": "A", "tie": "tie"}[first]
        why = f"oracle: verifier x={'solved' if sx else 'unsolved'}, y={'solved' if sy else 'unsolved'}"
        out.append(PairResult(x, y, task_id, (first, why, ""), (second, why, ""), judge="oracle"))
    return out


def agreement(results: list[PairResult], verified: dict[str, bool | None]) -> dict:
    """The judge against the verifier, over the pairs where the verifier decides (one solved, one not):
    `agree` pairs where the judge's combined verdict picks the solved one, `disagree` the other one, `ties`
    neither; `rate` = agree / decided (None without such pairs). Pairs the verifier can't score are left out."""
    agree = disagree = ties = 0
    for r in results:
        sx, sy = verified.get(r.x), verified.get(r.y)
        if sx is None or sy is None or sx == sy:
            continue
        if r.winner is None:
            ties += 1
        elif (r.winner == r.x) == sx:
            agree += 1
        else:
            disagree += 1
    decided = agree + disagree + ties
    return {"decided": decided, "agree": agree, "disagree": disagree, "ties": ties,
            "rate": agree / decided if decided else None}


# ---- Bradley-Terry ------------------------------------------------------------------------------------------

def bradley_terry(items: list[str], results: list[tuple[str, str, float]], prior: float = 0.5,
                  iterations: int = 500) -> dict[str, float]:
    """Bradley-Terry scores by the MM algorithm of docs/methods.md. results: (i, j, s) = one game of i against j
    in which i scored s (1 win, 0.5 tie, 0 loss; j scores 1 - s). With W_i = Σ_j w_ij, n_ij games between i and
    j, every iteration sets

        p_i ← (W_i + prior) / (prior / (p_i + 1) + Σ_{j≠i} n_ij / (p_i + p_j))

    for all i at once from the previous p, then rescales p to mean 1; score_i = log p_i."""
    idx = {k: n for n, k in enumerate(items)}
    m = len(items)
    wins = [0.0] * m
    games: dict[tuple[int, int], float] = {}
    for a, b, s in results:
        i, j = idx[a], idx[b]
        if i == j:
            raise ValueError(f"bradley_terry: {a} plays itself")
        wins[i] += s
        wins[j] += 1.0 - s
        games[(i, j)] = games.get((i, j), 0.0) + 1
        games[(j, i)] = games.get((j, i), 0.0) + 1
    opponents: list[list[tuple[int, float]]] = [[] for _ in range(m)]
    for (i, j), n in games.items():
        opponents[i].append((j, n))
    p = [1.0] * m
    for _ in range(iterations):
        new = []
        for i in range(m):
            denom = prior / (p[i] + 1) + sum(n / (p[i] + p[j]) for j, n in opponents[i])
            num = wins[i] + prior
            if num == 0.0:
                new.append(0.0)
            elif denom == 0.0:
                raise ValueError(f"bradley_terry: {items[i]} has no games and the prior is 0")
            else:
                new.append(num / denom)
        mean = sum(new) / m
        p = [x / mean for x in new]
    return {k: (math.log(p[idx[k]]) if p[idx[k]] > 0 else -math.inf) for k in items}


def ring_pairs(n: int, m: int) -> list[tuple[int, int]]:
    """The ring tournament of n items in which each plays m others (m < n): item i against i+1 .. i+m//2 (mod n),
    and for odd m also against i + n//2 (n even). Each unordered pair once."""
    if not 1 <= m < n:
        raise ValueError(f"ring tournament: each of {n} items can play 1 to {n - 1} others, not {m}")
    if m % 2 and n % 2:
        raise ValueError(f"ring tournament: an odd m ({m}) needs an even number of items (got {n})")
    pairs = {(min(i, (i + d) % n), max(i, (i + d) % n)) for i in range(n) for d in range(1, m // 2 + 1)}
    if m % 2:
        pairs |= {(i, i + n // 2) for i in range(n // 2)}
    return sorted(pairs)


def select_ranked(scores: dict[str, float], train_top: int, val_next: int) -> dict[str, tuple[int, str | None]]:
    """Rank items by score (highest first; ties by id) and split: ranks 1..train_top -> "train", the next
    val_next -> "validation", the rest None. Returns {item: (rank, split)}."""
    order = sorted(scores, key=lambda k: (-scores[k], k))
    return {k: (r + 1, "train" if r < train_top else "validation" if r < train_top + val_next else None)
            for r, k in enumerate(order)}


# ---- the optimizer's proposal -------------------------------------------------------------------------------

PROPOSER_SYSTEM = ("You design workflows for a team of assistants that solve tasks. A workflow is JSON: "
                   '{"agents": [{"role": ..., "instruction": ..., "contract": ...}], "hops": [roles in order]}. '
                   "The last hop is the 'solver', which answers the task. Change structure (hops, contracts) "
                   "before wording.")


def proposal_messages(task_examples: list[str], champion: Workflow, history: list[dict]) -> list[dict]:
    """The optimizer's prompt: example tasks, the current champion spec, and per earlier version its change,
    its win rates against the reference and the champion, and a few of the judge's rationales."""
    lines = []
    for h in history[-6:]:
        lines.append(f"- {h['name']}: change {'; '.join(h['diff']) or 'none'}; won {h['vs_reference']:.2f} against "
                     f"the reference, {h['vs_champion']:.2f} against the champion; "
                     f"{'kept' if h['accepted'] else 'discarded'}. Judge said: "
                     f"{' | '.join(r[:80] for r in h['rationales'][:2]) or '-'}")
    user = ("Example tasks:\n" + "\n".join(f"- {t.strip()[:200]}" for t in task_examples[:3])
            + f"\n\nCurrent best workflow:\n{champion.to_json()}\n\nHistory:\n" + ("\n".join(lines) or "- none")
            + "\n\nPropose a better workflow. Reply with the JSON only.")
    return [{"role": "system", "content": PROPOSER_SYSTEM}, {"role": "user", "content": user}]


def parse_proposal(text: str) -> Workflow:
    """The first JSON object in the model's reply as a Workflow; SpecError saying what is wrong."""
    start = text.find("{")
    if start < 0:
        raise SpecError("proposal: no JSON object in the reply")
    try:
        data, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError as err:
        raise SpecError(f"proposal: not valid JSON ({err.msg} at char {err.pos})") from None
    return Workflow.from_dict(data)


# ---- statistics of a comparison -----------------------------------------------------------------------------

def win_rate(scores: list[float], confidence: float = 0.95) -> dict:
    """Win rate of the first model over n paired comparisons (each score in [0, 1], ties 1/2): the mean, wins,
    ties, losses and a Wilson interval on the mean taken as k/n with k = Σ scores."""
    from rsiflow.stats.success import wilson_interval

    n = len(scores)
    k = sum(scores)
    lo, hi = wilson_interval(k, n, confidence) if n else (None, None)
    return {"n": n, "rate": k / n if n else None, "ci_low": lo, "ci_high": hi,
            "wins": sum(s > 0.5 for s in scores), "ties": sum(s == 0.5 for s in scores),
            "losses": sum(s < 0.5 for s in scores)}
