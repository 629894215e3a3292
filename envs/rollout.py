"""The episode runner: all live episodes step in lockstep, one batched generate call per turn.

Each turn every live episode's conversation goes to the backend in one `generate` call; each
sampled action is applied to that episode's env. An episode whose env raises (on reset or on a
step) is closed with status "error" and the reason; the others go on. A backend failure is not
an episode's fault and propagates.

The conversation the model sees: a prefix (a system message with the env's instructions and,
with `few_shot`, the env's demonstration turns as earlier user/assistant messages), then per
turn a user message (the observation, plus the admissible actions when `show_admissible`) and
the model's action as the assistant message. The same prefix is rebuilt from the env for
training, and the observations are stored as shown, so training sees what generation saw;
only the episode's own actions (after the prefix) are trained.
"""

from __future__ import annotations

import difflib
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from rsiflow.envs import make_env
from rsiflow.envs.base import Env, TaskSpec
from rsiflow.models.backend import GenerationBackend, SamplingParams

ACTION_STOP = ("\n",)


@dataclass
class Turn:
    observation: str          # the user message shown before this action
    action_text: str          # the action executed (and, for ExIt, trained on)
    raw_text: str | None      # the generated text when projection changed it, else None
    action_symbol: str
    token_ids: list[int]
    logprobs: list[float]     # sampling logprobs (after temperature and top-p)
    reward: float = 0.0
    done: bool = False
    valid: bool = True
    feedback: str = "ok"
    wall_s: float = 0.0
    temp_logprobs: list[float] = field(default_factory=list)  # after temperature only (models/backend.py)


@dataclass
class Episode:
    traj_id: str
    task: TaskSpec
    group_id: str
    sample_idx: int
    messages: list[dict] = field(default_factory=list)   # prefix + the episode's own turns
    n_prefix: int = 0                                      # messages[:n_prefix] are the prompt prefix
    turns: list[Turn] = field(default_factory=list)
    status: str = "running"   # running | success | failure | error
    success: bool = False
    reward: float = 0.0
    error: str | None = None
    hindsight: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    gen_tokens: int = 0
    wall_s: float = 0.0

    @property
    def live(self) -> bool:
        return self.status == "running"


_ADMISSIBLE_HEAD = "\nValid actions:\n"
_ACTION_PROMPT = "\nYour action:"


def render_observation(observation: str, admissible: list[str] | None, show_admissible: bool) -> str:
    """The user message of a turn: the env's observation, the admissible actions (one a line) when shown,
    then "Your action:". `env_observation` inverts it."""
    if show_admissible and admissible:
        return observation + _ADMISSIBLE_HEAD + "\n".join(admissible) + _ACTION_PROMPT
    return observation + _ACTION_PROMPT


def env_observation(rendered: str) -> str:
    """The env's own observation inside a message `render_observation` made (the action list and prompt cut off)."""
    text = rendered.removesuffix(_ACTION_PROMPT)
    head = text.rfind(_ADMISSIBLE_HEAD)
    return text[:head] if head >= 0 else text


def project_action(text: str, admissible: list[str] | None) -> str:
    """The admissible action closest to `text` (difflib similarity, ties: the first in the env's
    order); `text` itself when it is admissible, or when the env lists no actions."""
    if not admissible:
        return text
    norm = " ".join(text.lower().split()).rstrip(".")
    if norm in admissible:
        return norm
    return max(admissible, key=lambda a: difflib.SequenceMatcher(None, norm, a).ratio())


def prompt_prefix(env: Env, show_admissible: bool = True, few_shot: bool = True) -> list[dict]:
    """The system message and (with `few_shot`) the env's demonstration as earlier chat turns."""
    msgs = [{"role": "system", "content": env.instructions()}]
    if few_shot:
        for observation, admissible, action in env.demonstration():
            msgs.append({"role": "user", "content": render_observation(observation, admissible, show_admissible)})
            msgs.append({"role": "assistant", "content": action})
    return msgs


def _fail(ep: Episode, env: Env, exc: BaseException) -> None:
    ep.status = "error"
    ep.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    try:
        ep.hindsight = env.hindsight()
    except Exception as hindsight_exc:  # the env is already broken: keep the first error, note this one
        ep.hindsight = []
        ep.error += f"(hindsight() also failed: {type(hindsight_exc).__name__}: {hindsight_exc})"


def run_episodes(
    make_env: Callable[[], Env],
    episodes: list[Episode],
    backend: GenerationBackend,
    params: SamplingParams,
    max_turns: int,
    show_admissible: bool = True,
    few_shot: bool = True,
    project: bool = False,
    on_turn: Callable[[int, int], None] | None = None,
    max_live: int | None = None,
) -> list[Episode]:
    """Play `episodes` (fresh Episode objects naming their task) to the end, in lockstep.

    With `project`, a generated action that is not admissible is replaced by the closest admissible
    one (an agent-harness choice for models too small to copy actions reliably; the raw text is kept
    in `Turn.raw_text`, and the conversation continues with the executed action).
    `on_turn(tokens_generated_this_turn, live_episodes)` is called after every batched turn
    (progress bars). Returns the same Episode objects, filled in.

    `max_live` (default: the backend's `max_live_episodes` attribute, where it has one; None = no limit): at most
    this many episodes play at once; more are played in waves of that many consecutive episodes, one wave after
    the other (`waves`). A backend that keeps each live conversation's keys/values between turns (hf with
    kv_reuse) has room for so many tokens; past it, the conversations it could not keep are prefilled again in
    full every turn. Each later wave's calls are seeded apart from the first's (`wave_params`), so no two waves
    draw the same random numbers.
    """
    limit = max_live if max_live is not None else getattr(backend, "max_live_episodes", None)
    for w, wave in enumerate(waves(episodes, limit)):
        _lockstep(make_env, wave, backend, wave_params(params, w), max_turns, show_admissible, few_shot, project,
                  on_turn)
    return episodes


WAVE_SEED_STRIDE = 104_729  # a prime: wave w of a seeded play samples with seed + w * stride


def waves(episodes: list, max_live: int | None) -> list[list]:
    """`episodes` cut into as few consecutive waves of at most `max_live` as there can be, of sizes as equal as
    they can be (128 at 40: 4 of 32, not 40, 40, 40 and 8); one wave when None."""
    if not max_live or len(episodes) <= max_live:
        return [episodes]
    n = -(-len(episodes) // max_live)
    size, extra = divmod(len(episodes), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [episodes[a:b] for a, b in zip(bounds, bounds[1:])]


def wave_params(params: SamplingParams, wave: int) -> SamplingParams:
    """The sampling parameters of wave `wave`: the first keeps the seed, later ones shift it (unseeded: as given)."""
    if wave == 0 or params.seed is None:
        return params
    return SamplingParams(**{**params.__dict__, "seed": (params.seed + wave * WAVE_SEED_STRIDE) % (2**31)})


def _lockstep(make_env: Callable[[], Env], episodes: list[Episode], backend: GenerationBackend,
              params: SamplingParams, max_turns: int, show_admissible: bool, few_shot: bool, project: bool,
              on_turn: Callable[[int, int], None] | None) -> list[Episode]:
    """`run_episodes` of one wave: every episode in each batched call until all have ended."""
    params = SamplingParams(**{**params.__dict__, "stop": tuple(params.stop) or ACTION_STOP})
    envs: list[Env | None] = []
    start = time.perf_counter()
    for ep in episodes:
        env = None
        try:
            env = make_env()
            obs = env.reset(ep.task)
            ep.messages = prompt_prefix(env, show_admissible, few_shot)
            ep.n_prefix = len(ep.messages)
            first = render_observation(obs, env.admissible_actions(), show_admissible)
            ep.messages.append({"role": "user", "content": first})
        except Exception as exc:
            if env is None:
                raise  # the env can't even be built: a config error, not an episode's
            _fail(ep, env, exc)
        envs.append(env)

    tools = next((env.tools() for env in envs if env is not None), None)  # one env class: the same schemas
    for turn_idx in range(max_turns):
        live = [i for i, ep in enumerate(episodes) if ep.live]
        if not live:
            break
        t0 = time.perf_counter()
        gens = backend.generate([episodes[i].messages for i in live], params, tools=tools)
        dt = (time.perf_counter() - t0) / len(live)
        for i, gen in zip(live, gens):
            ep, env = episodes[i], envs[i]
            raw = gen.text.strip()
            ep.prompt_tokens += gen.prompt_tokens
            ep.gen_tokens += len(gen.token_ids)
            try:
                action = project_action(raw, env.admissible_actions()) if project else raw
                res = env.step(action)
                symbol = env.canonicalize(action)
                observation = ep.messages[-1]["content"]
                ep.messages.append({"role": "assistant", "content": action})
                done = res.done or turn_idx == max_turns - 1
                ep.turns.append(Turn(
                    observation=observation, action_text=action, raw_text=raw if raw != action else None,
                    action_symbol=symbol,
                    token_ids=list(gen.token_ids), logprobs=list(gen.logprobs),
                    temp_logprobs=list(gen.temp_logprobs), reward=float(res.reward),
                    done=done, valid=bool(res.info.get("valid", True)), feedback=str(res.info.get("feedback", "ok")),
                    wall_s=dt,
                ))
                ep.reward += float(res.reward)
                if done:
                    ep.success = bool(res.success)
                    ep.status = "success" if res.success else "failure"
                    ep.hindsight = env.hindsight()
                else:
                    ep.messages.append({"role": "user", "content": render_observation(
                        res.observation, env.admissible_actions(), show_admissible)})
            except Exception as exc:
                _fail(ep, env, exc)
        if on_turn:
            on_turn(sum(len(g.token_ids) for g in gens), len(live))

    elapsed = time.perf_counter() - start
    for ep, env in zip(episodes, envs):
        ep.wall_s = elapsed
        if env is not None:
            env.close()
    return episodes


# ---- a config's rollouts (`cfg`: configs.schema.Config; the steps and the methods play through these) ----------


def env_factory(cfg) -> Callable[[], Env]:
    """A fresh env of the config (`env.name` with `env.kwargs`) per call."""
    return partial(make_env, cfg.env.name, **cfg.env.kwargs)


def sampling(cfg, temperature: float, seed: int, temp_logprobs: bool = True) -> SamplingParams:
    """The config's sampling parameters at `temperature` (top-p only when sampling)."""
    return SamplingParams(max_new_tokens=cfg.backend.max_new_tokens, temperature=temperature,
                          top_p=cfg.backend.top_p if temperature > 0 else 1.0, seed=seed, temp_logprobs=temp_logprobs)


def round_seed(cfg, round_no: int, salt: int = 0) -> int:
    """The sampling seed of a round's use `salt` (deterministic in run.seed, the round and the salt)."""
    return (cfg.run.seed * 1_000_003 + round_no * 7919 + salt) % (2**31)


def prompt_setup(cfg) -> tuple[list[dict], list[dict] | None]:
    """The prompt prefix every episode of this config starts with (system + few-shot turns) and the env's
    tool schemas for the chat template (None where it has none)."""
    env: Env = env_factory(cfg)()
    try:
        return prompt_prefix(env, cfg.env.show_admissible, cfg.env.few_shot), env.tools()
    finally:
        env.close()


def play_episodes(cfg, backend: GenerationBackend, episodes: list[Episode], temperature: float, seed: int, *,
                  make_env: Callable[[], Env] | None = None, on_turn: Callable[[int, int], None] | None = None,
                  temp_logprobs: bool = True) -> list[Episode]:
    """Run episodes in lockstep with the config's env settings and sampling (`make_env`: another env factory,
    e.g. one that wraps the config's; `temp_logprobs`: whether training will read them)."""
    return run_episodes(make_env or env_factory(cfg), episodes, backend,
                        sampling(cfg, temperature, seed, temp_logprobs), cfg.env.max_turns, cfg.env.show_admissible,
                        cfg.env.few_shot, cfg.env.project_actions, on_turn=on_turn)


def episode_rows(episodes: list[Episode], model_id: str, purpose: str) -> tuple[list[dict], list[dict]]:
    """Rows for the trajectories and turns tables."""
    trajs, turns = [], []
    for ep in episodes:
        trajs.append({
            "traj_id": ep.traj_id, "task_id": ep.task.task_id, "model_id": model_id, "group_id": ep.group_id,
            "sample_idx": ep.sample_idx, "purpose": purpose, "status": ep.status, "success": ep.success,
            "reward": ep.reward, "n_turns": len(ep.turns), "error": ep.error, "hindsight": ep.hindsight,
            "prompt_tokens": ep.prompt_tokens, "gen_tokens": ep.gen_tokens, "wall_s": ep.wall_s,
        })
        for i, t in enumerate(ep.turns):
            turns.append({
                "traj_id": ep.traj_id, "turn_idx": i, "observation": t.observation, "action_text": t.action_text,
                "raw_text": t.raw_text,
                "action_symbol": t.action_symbol, "token_ids": t.token_ids, "logprobs": t.logprobs,
                "temp_logprobs": t.temp_logprobs,
                "reward": t.reward, "done": t.done, "valid": t.valid, "feedback": t.feedback, "wall_s": t.wall_s,
            })
    return trajs, turns
