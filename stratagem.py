"""STRATAGEM: LLM reasoning learned by game self-play with a
trajectory-modulated advantage.

One policy plays both seats of two-player zero-sum text games
(SPIRAL: Liu et al. 2025, arXiv 2506.24119). Each player's
trajectory gets the role-conditioned advantage A_game = R - b[G, p]
(RAE). An LLM judge scores a sample of trajectories for
transferability (phi) and evolution (psi); the rest get the batch
mean. REINFORCE runs on the modulated advantage (STRATAGEM: Feng et
al. 2026, "Stratagem: Learning Transferable Reasoning via
Trajectory-Modulated Game Self-Play"):

    A_mod(tau) = A_game(tau) * phi(tau) + beta * psi(tau)

--mode spiral is SPIRAL (A_mod = A_game); --no-psi is the paper's
"w/o psi" ablation. SpyRL ("who is the spy", judge-free) is
spyrl.py, which imports from here.

The file follows Algorithm 1: Args, self-play (step 1), RAE (2), the
judge and modulation (3), REINFORCE (4); then generation,
evaluation, train() and the command line. machinery/ holds what a
reader can skip; tools/ the commands around the trainer
(`python stratagem.py COMMAND`); docs/hacking.md how to change a
game, a rubric or an advantage estimator.

    python stratagem.py --tiny --steps 3  # offline CPU, warm tiny Qwen3
    python stratagem.py --dry-run         # the paper's run: plan, judge cost
    python stratagem.py --beta 0.2        # the paper's run (GPU; judge key in env)
    python stratagem.py --help            # every flag, paper defaults
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import os
import random
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import judge_prompts
from games import check_flags, first_last_ids, perfect, spiral
from games.actions import INVALID_ACTION, spiral_action, spiral_moves
from games.spots import spot
from judge_prompts import RUBRICS, role, weighted
from machinery import (
    UserError,
    adaptive_beta,
    checks,
    cli,
    distill,
    distributed,
    flags,
    lifecycle,
    lora,
    memory,
    modelfiles,
    modulation,
    opponents,
    overlap,
    watch,
)
from machinery.judge import JudgeFlags, fill_prices, parse_scores
from machinery.matches import EvalFlags, RandomPlayer, summarize_matches
from machinery.saved_config import saved_config
from machinery.vllm_engine import VLLMPolicy

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the games run in this process


# ========================
# Arguments. Each field's docstring is its --help
# line (docs/flags.md: the long version).
# ========================
@dataclass
class Args(
    lifecycle.RunFlags,
    memory.EngineFlags,
    lora.LoraFlags,
    opponents.OpponentFlags,
    EvalFlags,
    JudgeFlags,
    modulation.ModulationFlags,
    distill.DistillFlags,
    adaptive_beta.AdaptiveBetaFlags,
    overlap.OverlapFlags,
):
    """The paper's hyperparameters, SPIRAL's, then the trainer's own;
    the others beside their machinery (inherited: flat flags)."""

    # --- the paper's (STRATAGEM, Algorithm 1) ---
    mode: str = "stratagem"  # Algorithm 1; spiral: ablation
    """stratagem (A_mod = A_game*phi + beta*psi) or spiral
    (A_mod = A_game, no judge)"""
    no_psi: bool = False  # the ablation 'w/o psi'
    """ablation 'w/o psi': A_mod = A_game*phi; the evolution
    rubric is not requested"""
    model: str = "Qwen/Qwen3-4B-Base"  # the paper's policy
    """policy: a hub id or a local directory (paper:
    Qwen3-4B-Base)"""
    steps: int = 400  # Algorithm 1's loop
    """number of policy updates (paper: 400)"""
    batch_size: int = 128  # step 4's batch
    """transitions (turns) per policy update; games still
    running finish first (paper: 128)"""
    lr: float = 1e-6  # step 4's Adam
    """Adam learning rate, constant (paper: 1e-6)"""
    # step 1: G sampled per episode
    games: str = "TicTacToe-v0,KuhnPoker-v1,SimpleNegotiation-v1"
    """comma-separated two-player game ids, one sampled per
    episode (SPIRAL's training set; any TextArena id works
    too)"""
    ema: float = 0.95  # step 2, RAE
    """RAE baseline decay eta: b <- eta*b + (1-eta)*R (paper:
    0.95)"""
    beta: float = 0.2  # step 3; sensitivity 0.1-0.3
    """weight of the evolution reward psi in A_mod (paper:
    0.2); with --beta-share, the first"""
    judge_model: str = "gpt-4o"  # step 3's judge
    """judge model name (paper: GPT-4)"""
    judge_sample_rate: float = 0.25  # step 3
    """share of player-trajectories judged a step (paper: 'a
    sample'; the rest: the batch mean)"""
    judge_temperature: float = 1.0  # step 3's judge
    """judge sampling temperature (paper: 1.0)"""
    seed: int = 1
    """seeds Python, NumPy, torch, the games, judge sampling
    and token sampling"""
    # --- SPIRAL's (the base; its paper and code) ---
    temperature: float = 1.0  # SPIRAL's sampling
    """sampling temperature (SPIRAL: 1.0); the learner scores
    tokens at the same temperature"""
    max_new_tokens: int = 4096
    """longest response per turn (SPIRAL: 4096)"""
    max_turns: int = 50
    """turn cap per game (both players, retries included); a
    capped game is a draw (SPIRAL: 50)"""
    error_allowance: int = 0
    """invalid moves a player may retry before it loses
    (SPIRAL: 0); no move at all loses at once"""
    action_rule: str = "lenient"
    """how a move is read: lenient (the last \\boxed{}, else
    the last [...]) or spiral (SPIRAL's extract_action: kept
    only if it is exactly one of the mover's legal moves)"""
    invalid_rewards: str = "-1,1"
    """OFFENDER,OPPONENT rewards when a response gives no move
    (SPIRAL's code: -1.5,0.5; write
    --invalid-rewards=-1.5,0.5)"""
    rejected_rewards: str = "-1,1"
    """OFFENDER,OPPONENT rewards when the game rejects a move
    and no retry is left (TextArena 0.7.4: -1,1; SPIRAL's
    TextArena 0.6.4: -1,0)"""
    ppo_epochs: int = 1
    """Adam steps per batch: 1 = REINFORCE (the paper); N > 1:
    PPO's ratio clipping (SPIRAL: 2)"""
    clip_range: float = 0.2
    """with --ppo-epochs > 1: pi/pi_old is clipped to [1 - eps,
    1 + eps] (SPIRAL's code: 0.2)"""
    adam_betas: str = "0.9,0.95"
    """B1,B2 of Adam (SPIRAL's code, through oat: 0.9,0.95;
    torch's default: 0.9,0.999)"""
    # --- the trainer's own ---
    tiny: bool = False
    """a tiny Qwen3 with a byte-level tokenizer, offline on a
    CPU (smaller defaults; --tiny-init)"""
    tiny_init: str = "warm"
    """--tiny's weights: warm (warmstart/tiny, taught the
    games' rules on random legal play) or random (built from
    --seed: its games end on the first move)"""
    num_envs: int = 32
    """games played at once in lockstep (one batched
    generation call per turn)"""
    kl_coef: float = 0.0
    """weight of a per-token k3 KL penalty to the initial
    policy (STRATAGEM, SPIRAL: none)"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this value"""

    def __post_init__(self):  # defaults that hang on other flags
        fill_prices(self)  # -1: a known model's dated price, else 0
        self.lora_alpha = self.lora_alpha or 2.0 * self.lora_rank  # 2R

    @property
    def rules(self) -> Rules:
        """How this run's games are played and paid, in self-play
        and in the evaluation."""
        return Rules(
            self.action_rule,
            self.error_allowance,
            self.max_turns,
            flags.number_pair(self.invalid_rewards, "--invalid-rewards"),
            flags.number_pair(self.rejected_rewards, "--rejected-rewards"),
        )

    @property
    def betas(self) -> tuple[float, float]:
        return flags.number_pair(self.adam_betas, "--adam-betas")

    @property
    def entering(self) -> list[str]:
        """The rubrics whose scores enter A_mod (step 3)."""
        return entering(self.mode, self.no_psi)

    @property
    def asked(self) -> list[str]:
        """The rubrics the judge is asked (step 3)."""
        return asked(self.mode, self.no_psi, self.judge_shadow)


# ========================
# Algorithm 1, step 1: self-play. The role-conditioned
# prompt, how a move is read and paid, and lockstep play
# of many games (one batched generation call per turn).
# ========================
# SPIRAL's prompt, the role made explicit: the same
# weights play both seats.
PROMPT = (
    "You are playing a two-player zero-sum game as Player {role}. Make valid actions to win.\n"
    "Observation: {observation}\n"
    "Please reason step by step, and put your final answer within \\boxed{{}}."
)


def make_env(game_id: str, seed: int, error_allowance: int, first_last: bool = False):
    """A game as SPIRAL's make_env builds it: the whole history, or
    the first and latest messages. `random` is seeded first: two of
    SPIRAL's games draw before reset."""
    random.seed(seed)
    env = spiral.make(game_id, first_last)
    env.reset(num_players=2, seed=seed)
    env.state.error_allowance = error_allowance  # TextArena: 1, SPIRAL: 0
    return env


# SPIRAL writes Qwen's chat markup itself
# (spiral/template.py), whatever a checkpoint ships.
QWEN_MARKUP = "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def format_prompt(tokenizer, observation: str, role: int, template: str = PROMPT) -> str:
    """The policy's input: `template` in SPIRAL's Qwen markup for a
    Qwen model, in its own chat template for another family (the
    text around one message, rendered once by load_policy in a
    bounded child process), else bare."""
    text = template.format(role=role, observation=observation)
    if tokenizer.qwen_markup:
        return QWEN_MARKUP.format(text=text)
    if tokenizer.markup:
        prefix, suffix, trimmed = tokenizer.markup
        return prefix + (text.strip() if trimmed else text) + suffix
    return text + "\n"


_TEXT_WRAPPER = re.compile(r"\\text\{(.*)\}", re.DOTALL)


def boxed_action(response: str) -> str:
    """The last \\boxed{...}'s content as "[...]", braces matched,
    a \\text{} unwrapped; "" if none or empty. A linear scan: no
    regex backtracking."""
    start = response.rfind("\\boxed{")
    if start >= 0:
        i, depth = start + len("\\boxed{"), 1
        for j in range(i, len(response)):
            depth += {"{": 1, "}": -1}.get(response[j], 0)
            if depth == 0:
                content = response[i:j].strip()
                wrapped = _TEXT_WRAPPER.fullmatch(content)
                content = wrapped.group(1).strip() if wrapped else content
                if content:
                    bracketed = content.startswith("[") and content.endswith("]")
                    return content if bracketed else f"[{content}]"
                break
    return ""


def parse_action(response: str) -> str:
    """The last \\boxed{...} as "[...]", else the last [...], else
    "" (the game reads the text)."""
    if boxed := boxed_action(response):
        return boxed
    close = response.rfind("]")
    open_ = response.rfind("[", 0, close) if close >= 0 else -1
    return response[open_ : close + 1] if open_ >= 0 else ""


def read_action(rule: str, game: str, env, pid: int, observation: str, response: str) -> str:
    """The move --action-rule reads, or INVALID_ACTION: lenient
    is parse_action; spiral is SPIRAL's extract_action, matched
    against the mover's legal moves (games/actions.py)."""
    if rule == "spiral":
        return spiral_action(response, spiral_moves(game, env, pid, observation))
    return parse_action(response) or INVALID_ACTION


@dataclass(frozen=True)
class Rules:
    """How a game is played and paid, the same in self-play and
    in the evaluation (Args.rules)."""

    action_rule: str = "lenient"
    error_allowance: int = 0
    max_turns: int = 50
    invalid_rewards: tuple[float, float] = (-1.0, 1.0)  # no move
    rejected_rewards: tuple[float, float] = (-1.0, 1.0)  # refused


@dataclass
class Turn:
    observation: str
    response: str
    action: str
    prompt_ids: list[int]
    response_ids: list[int]
    prompt: str = ""  # the policy's whole input (format_prompt)
    behaviour: torch.Tensor | None = None  # --async-level: log mu [r]


@dataclass
class Trajectory:
    """One player's whole game: the unit of RAE, the judge and
    A_mod."""

    game: str
    role: int
    turns: list[Turn]
    reward: float
    baseline: float = 0.0
    a_game: float = 0.0
    judged: bool = False
    scores: dict | None = None  # the judge's levels, every rubric key
    phi: float = 1.0  # what multiplied A_game (1: nothing)
    psi: float = 0.0  # what was added with beta (0: nothing)
    a_mod: float = 0.0
    logged: dict = field(default_factory=dict)  # scores not in A_mod
    info: dict = field(default_factory=dict)  # SpyRL: spy.results
    predicted: dict | None = None  # --distill: the heads' levels
    opponent: str = ""  # --opponents: past or random ("": self-play)

    def record(self, step: int) -> dict:
        """The trajectories.jsonl line: no token ids; logged, info,
        predicted and opponent only when set."""
        optional = ("logged", "info", "predicted", "opponent")
        fields = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "turns" and (f.name not in optional or getattr(self, f.name))
        }
        keys = ("observation", "response", "action", "prompt")
        turns = [{k: getattr(t, k) for k in keys} for t in self.turns]
        return {"step": step, **fields, "turns": turns}


@dataclass
class Episode:
    """A game in flight. In an evaluation, or against a fixed
    opponent, `seat` is the policy's; the opponent has the other."""

    game: str
    env: object
    seat: int | None = None  # None: self-play, both seats
    opponent: object = None  # --opponents' player (None: play_turn's)
    kind: str = "self"  # --opponents: self, past or random
    index: int = 0  # an evaluation game's place
    turns: dict[int, list[Turn]] = field(default_factory=lambda: {0: [], 1: []})
    moves: int = 0  # both seats, retries included
    done: bool = False
    forfeit: int | None = None  # the seat that gave no move: it lost


_OVERSIZED_NUMBER = re.compile(r"\d{101}")  # int() refuses 4300+ digits


def play_move(env, pid: int, action: str, game: str) -> tuple[bool, int | None]:
    """(done, the seat that forfeits). No move, or a number of over
    100 digits, loses at once, as in SPIRAL's code; so does a move
    whose step() raises."""
    if action == INVALID_ACTION or _OVERSIZED_NUMBER.search(action):
        return True, pid
    try:
        return env.step(action)[0], None
    except Exception as e:  # noqa: BLE001 - one game's bug must not end a run
        move = f"Player {pid}'s move {action!r:.80}"
        watch.warn(f"{game} raised {e!r:.200} on {move}; it counts as an invalid move")
        return True, pid


def game_result(env, done: bool, forfeit: int | None = None) -> tuple[dict, dict]:
    """Outcomes in {-1, 0, 1}, and which seat lost by an invalid
    move. The turn cap makes a draw. An invalid move (`forfeit`,
    or rejected with no retry left) loses for its maker and wins
    for the other seat, whatever the game pays it (SPIRAL's: 0);
    the pay is training_rewards'."""
    if forfeit is not None:
        invalid = {p: p == forfeit for p in (0, 1)}
    elif not done:
        return {0: 0.0, 1: 0.0}, {0: False, 1: False}
    else:
        rewards, info = env.close()
        invalid = {p: bool(info[p].get("invalid_move")) for p in (0, 1)}
        if not any(invalid.values()):
            return {p: float((rewards[p] > 0) - (rewards[p] < 0)) for p in (0, 1)}, invalid
    return {p: -1.0 if invalid[p] else 1.0 for p in (0, 1)}, invalid


def training_rewards(outcomes: dict, invalid: dict, invalid_rewards: tuple) -> dict[int, float]:
    """R_p: the outcome; a game lost by an invalid move pays
    (offender, opponent) = `invalid_rewards` (SPIRAL's code: -1.5,
    0.5 for no move, so that it costs more than a loss)."""
    if not any(invalid.values()):
        return outcomes
    return {p: invalid_rewards[0] if invalid[p] else invalid_rewards[1] for p in outcomes}


RESULTS = {1.0: "win", 0.0: "draw", -1.0: "loss"}


def settle(ep: Episode, rules: Rules) -> tuple[dict, dict, dict]:
    """An ended game's result per seat (win, draw, loss), its
    invalid moves and rewards R_p, from one game_result: what
    training pays and every report of a game cannot disagree."""
    outcomes, invalid = game_result(ep.env, ep.done, ep.forfeit)
    payout = rules.invalid_rewards if ep.forfeit is not None else rules.rejected_rewards
    results = {p: RESULTS[o] for p, o in outcomes.items()}
    return results, invalid, training_rewards(outcomes, invalid, payout)


def play_turn(policy, tokenizer, live: list[Episode], rules: Rules, opponent=None, timer=None):
    """One lockstep turn of every live game: observe; ONE generate
    call where the policy moves (and one per past policy); the
    fixed opponents' moves; each move read and played. Records the
    policy's turns only. Returns (still live, ended)."""
    timer = timer or watch.Timer()
    with timer("game"):
        seen = [ep.env.get_observation() for ep in live]  # (pid, text)
        movers = [
            policy if ep.seat in (None, pid) else ep.opponent or opponent
            for ep, (pid, _) in zip(live, seen)
        ]
        ours = [i for i, m in enumerate(movers) if hasattr(m, "generate")]
        prompts = {i: format_prompt(tokenizer, seen[i][1], seen[i][0]) for i in ours}
        full = past_context(policy, tokenizer, prompts)
        asked = [i for i in ours if i not in full]
    with timer("generate"):
        outputs = {}
        for engine, group in grouped(asked, movers):
            outputs |= zip(group, engine.generate([prompts[i] for i in group]))
    with timer("game"):
        actions = {}
        for player, group in grouped([i for i in range(len(live)) if i not in prompts], movers):
            moves = player.act([(live[i].env, *seen[i]) for i in group])
            actions |= {i: move or INVALID_ACTION for i, move in zip(group, moves)}
        still, ended = [], []
        for i, ep in enumerate(live):
            pid, obs = seen[i]
            if i in full:  # a draw, as at the turn cap
                ended.append(ep)
                continue
            if i in outputs:
                prompt_ids, response_ids, text = outputs[i]
                actions[i] = read_action(rules.action_rule, ep.game, ep.env, pid, obs, text)
                action = "" if actions[i] == INVALID_ACTION else actions[i]
                if movers[i] is policy:
                    turn = Turn(obs, text, action, prompt_ids, response_ids, prompts[i])
                    ep.turns[pid].append(turn)
            ep.done, ep.forfeit = play_move(ep.env, pid, actions[i], ep.game)
            ep.moves += 1
            (ended if ep.done or ep.moves >= rules.max_turns else still).append(ep)
    return still, ended


def grouped(indices: list[int], movers: list) -> list[tuple[object, list[int]]]:
    """The games `indices` by who moves, in order of first move."""
    groups: dict[int, tuple[object, list[int]]] = {}
    for i in indices:
        groups.setdefault(id(movers[i]), (movers[i], []))[1].append(i)
    return list(groups.values())


def past_context(policy, tokenizer, prompts: dict[int, str]) -> set[int]:
    """The games whose prompt leaves no room for a whole response
    (policy.room: the context less --max-new-tokens). They end
    unasked, a draw, as at the turn cap."""
    room = getattr(policy, "room", None)
    # a token is a byte or more: a cheap first cut
    long = {i: p for i, p in prompts.items() if room and len(p.encode()) > room}
    if not long:
        return set()
    ids = tokenizer(list(long.values()), add_special_tokens=False)
    full = {i for i, t in zip(long, ids.input_ids) if len(t) > room}
    if full and not getattr(policy, "warned", False):
        policy.warned = True  # once, not every step
        watch.warn(
            f"a prompt reached {room} tokens, the model's context less "
            "--max-new-tokens: its game ends there as a draw (as at --max-turns)"
        )
    return full


def self_play(run: lifecycle.Run, target: int, timer: watch.Timer, progress=None, policy=None):
    """Play games in lockstep by `policy` (or run.policy) until
    `target` transitions are made. Games are played whole: one starts
    only while the live games' expected transitions fall short.
    Returns the player-trajectories as they ended, self-play's
    outcome counts and the number of generate calls."""
    args, live, finished = run.args, [], []
    outcome = {"win": 0, "draw": 0, "loss": 0, "invalid": 0}
    counts = {g: {f"player{p}": dict(outcome) for p in (0, 1)} for g in run.games}
    collected = calls = 0  # transitions so far (live games too); calls
    run.versus.begin(run.rng)  # --opponents: this step's random player

    def expected(ep: Episode) -> float:  # the learner's turns to come
        left = max(1.0, run.lengths.get(ep.game, float(args.max_turns)) - ep.moves)
        return left if ep.seat is None else left / 2

    def room() -> bool:  # one more game fits in the step
        coming = collected + sum(expected(e) for e in live)
        return len(live) < args.num_envs and coming < target

    while live or collected < target:
        while room():
            game = run.rng.choice(run.games)
            env = make_env(game, run.rng.randrange(2**31), args.error_allowance)
            kind, seat, opponent = run.versus.draw(run.rng)  # --opponents
            live.append(Episode(game, env, seat, opponent, kind))
        collected += sum(e.seat in (None, e.env.state.current_player_id) for e in live)
        live, ended = play_turn(policy or run.policy, run.tokenizer, live, args.rules, timer=timer)
        calls += 1
        with timer("game"):
            for ep in ended:
                finished.extend(finish_episode(ep, counts, args.rules, run.versus))
                length = run.lengths.get(ep.game, ep.moves)
                run.lengths[ep.game] = 0.9 * length + 0.1 * ep.moves
        if progress is not None:
            seats = [c["player0"] for c in counts.values()]
            progress.played(collected, sum(c["win"] + c["draw"] + c["loss"] for c in seats))
    return finished, counts, calls


def finish_episode(ep: Episode, counts: dict, rules: Rules, versus) -> list[Trajectory]:
    """Both seats' trajectories (against a fixed opponent, the
    learner's alone). A seat that never moved has nothing to judge
    or learn, but RAE folds its return into its baseline, as
    SPIRAL's prepare_trajectories does."""
    results, invalid, rewards = settle(ep, rules)
    if ep.seat is not None:  # --opponents: past or random
        versus.tally(ep.kind, ep.game, results[ep.seat], invalid[ep.seat])
        return [Trajectory(ep.game, ep.seat, ep.turns[ep.seat], rewards[ep.seat], opponent=ep.kind)]
    for p in (0, 1):
        c = counts[ep.game][f"player{p}"]
        c[results[p]] += 1
        c["invalid"] += invalid[p]
    return [Trajectory(ep.game, p, ep.turns[p], rewards[p]) for p in (0, 1)]


# ========================
# Algorithm 1, step 2: role-conditioned advantage
# estimation (RAE, SPIRAL).
#   A_game(tau) = R_p(tau) - b[G,p]
#   then b[G,p] <- eta*b[G,p] + (1-eta)*R_p(tau)
# ========================
# The flags step 2's estimator reads. A fork with another
# estimator lists its own; validate() refuses the rest,
# which would do nothing (hacking.md's GRPO reads none).
ADVANTAGE_FLAGS = ("ema", "opponent_baselines")


def rae_step(baseline: float, reward: float, ema: float) -> tuple[float, float]:
    """(A_game, new baseline). A_game uses b from before R is
    folded in: a trajectory never baselines against itself
    (unbiased, as in SPIRAL's code)."""
    return reward - baseline, ema * baseline + (1 - ema) * reward


def rae_advantages(trajs: list[Trajectory], baselines: dict, ema: float, key=None) -> None:
    """Step 2 over a batch, in trajectories.jsonl order: A_game and
    its baseline b[G, p] (keyed "game/playerP", or `key(t)`),
    updated after each trajectory."""
    for t in trajs:
        k = key(t) if key else f"{t.game}/player{t.role}"
        t.baseline = baselines.get(k, 0.0)
        t.a_game, baselines[k] = rae_step(t.baseline, t.reward, ema)


def group_advantages(groups: list[list[Trajectory]], eps: float = 1e-6) -> None:
    """GRPO's group-relative A_game (DeepSeekMath, arXiv
    2402.03300): (R - mean) / (std + eps) over each group that
    answered one situation; a seat that never moved is in none.
    spyrl.py uses it for its votes."""
    for group in groups:
        moved = [t for t in group if t.turns]
        rewards = [t.reward for t in moved]
        mean = sum(rewards) / max(len(rewards), 1)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards), 1))
        for t in moved:
            t.a_game = (t.reward - mean) / (std + eps)


# ========================
# Algorithm 1, step 3: STRATAGEM modulation. The paper's
# formulas (judge_prompts.formulas() prints the table's):
#   phi(tau) = 0.35*alpha + 0.35*sigma + 0.30*rho
#       each level in {0, 0.5, 1}
#   psi(tau) = 0.35*d + 0.25*a + 0.40*c
#       each level in {-1, 0, 1}
#   A_mod(tau) = A_game(tau)*phi(tau) + beta*psi(tau)
# Keys, levels and weights: judge_prompts.RUBRICS, the one
# place to change them. Only a sample is judged; the rest
# and the failed get the judged batch mean. Transport,
# cache, budget, ledger: machinery/judge.py.
# ========================
def entering(mode: str, no_psi: bool) -> list[str]:
    """The rubrics whose scores enter A_mod: none for SPIRAL
    (A_mod = A_game); 'w/o psi' those that multiply A_game;
    STRATAGEM those too and the ones added with beta."""
    if mode != "stratagem":
        return []
    adds = not no_psi
    return [r for r in RUBRICS if role(r) == "multiplies" or (role(r) == "adds" and adds)]


def asked(mode: str, no_psi: bool, shadow: bool) -> list[str]:
    """The rubrics the judge is asked: those entering A_mod, and
    in STRATAGEM the logged ones. --judge-shadow asks all, a
    judged control for SPIRAL or 'w/o psi'."""
    if shadow:
        return list(RUBRICS)
    used = entering(mode, no_psi)
    return [r for r in RUBRICS if r in used or (mode == "stratagem" and role(r) == "logged")]


def sample_for_judging(n: int, rate: float, rng: random.Random) -> list[int]:
    """ceil(rate * n) distinct indices: a rate above 0 judges at
    least one."""
    return sorted(rng.sample(range(n), math.ceil(rate * n)))


def verdict(chat, rubric: str, text: str) -> dict[str, float]:
    """One judge request: the rubric and the rendered trajectory
    as chat messages, sent by `chat` (it retries and pays), and
    the reply's levels. No valid verdict raises JudgeFailure,
    which the runner counts."""
    messages = judge_prompts.build_messages(rubric, text)  # quoted, as data
    reply = chat(messages)
    return parse_scores(reply, rubric)  # the last JSON with every key


def judge_trajectories(runner, trajs: list[Trajectory], rubrics: list[str], progress=None):
    """Each trajectory asked each rubric it has the turns for
    (evolution needs two), all at once; then the rules code
    decides, whatever the judge said: one turn has no evolution
    (all 0), stagnation is degradation (d = a = -1). A Judgement
    each, and the usage (requests, tokens, money)."""
    judgements, usage = runner.judge(trajs, rubrics, verdict, progress)
    for t, j in zip(trajs, judgements):
        seen, said = [x.observation for x in t.turns], [x.response for x in t.turns]
        for rubric in [r for r in rubrics if r in judge_prompts.RULES and j.scores is not None]:
            j.scores, j.rule = judge_prompts.RULES[rubric](seen, said, j.scores)
    return judgements, usage


def judge_sample(run: lifecycle.Run, trajs: list[Trajectory], progress) -> tuple[dict, dict]:
    """A step's judge call: a --judge-sample-rate sample of the
    played trajectories, each asked every rubric the run uses.
    Returns {index: Judgement} and the usage. Nothing is asked
    without a judge (spiral) or once --judge-budget is spent."""
    if run.runner is None or run.runner.budget_exhausted():
        return {}, {}
    # a seat that never moved wrote nothing
    played = [i for i, t in enumerate(trajs) if t.turns]
    rate = run.distiller.sample_rate() if run.distiller else run.args.judge_sample_rate
    picked = [played[k] for k in sample_for_judging(len(played), rate, run.rng)]
    sample = [trajs[i] for i in picked]
    judgements, usage = judge_trajectories(run.runner, sample, run.args.asked, progress)
    return dict(zip(picked, judgements)), usage


def phi(levels: dict[str, float], rubrics=tuple(RUBRICS)) -> float:
    """The transferability coefficient phi(tau) in [0, 1]: the
    weighted levels of each of `rubrics` that multiplies A_game
    (the paper's one: transferability)."""
    return math.prod((weighted(r, levels) for r in rubrics if role(r) == "multiplies"), start=1.0)


def psi(levels: dict[str, float], rubrics=tuple(RUBRICS)) -> float:
    """The evolution reward psi(tau) in [-1, 1], zero-centred: the
    weighted levels of each of `rubrics` added with beta (the
    paper's one: evolution)."""
    return sum((weighted(r, levels) for r in rubrics if role(r) == "adds"), 0.0)


def impute(values: list[float | None], default: float | None) -> tuple[list, float | None]:
    """The Nones filled with the others' mean (the judged batch
    mean), else `default`. Returns the list and the mean (None:
    nothing judged)."""
    known = [v for v in values if v is not None]
    mean = sum(known) / len(known) if known else None
    fill = default if mean is None else mean
    return [fill if v is None else v for v in values], mean


def a_mod(a_game: float, phi_: float, psi_: float, beta: float) -> float:
    """The modulated advantage: A_game * phi + beta * psi."""
    return a_game * phi_ + beta * psi_


def modulate(trajs: list[Trajectory], judgements: dict, rubrics: list[str], beta: float) -> dict:
    """Step 3 on a batch: phi and psi of the judged, the judged
    batch mean for the rest, then A_mod. `rubrics`: those that
    enter A_mod (entering; none for SPIRAL)."""
    levels = [None] * len(trajs)  # the judge's levels, where it gave them
    for i, j in judgements.items():
        trajs[i].judged = not j.skipped  # skipped for the budget: unsampled
        if j.scores is not None:
            levels[i] = trajs[i].scores = {k: j.scores.get(k) for k in judge_prompts.ALL_KEYS}
    phis, phi_mean = impute([None if x is None else phi(x, rubrics) for x in levels], 1.0)
    psis, psi_mean = impute([None if x is None else psi(x, rubrics) for x in levels], 0.0)
    for t, phi_t, psi_t in zip(trajs, phis, psis):
        t.phi, t.psi = phi_t, psi_t
        t.a_mod = a_mod(t.a_game, phi_t, psi_t, beta)
    modulated = bool(rubrics) and phi_mean is not None
    return {"modulated": modulated, "phi_mean": phi_mean, "psi_mean": psi_mean}


def final_a_mod(run, trajs: list[Trajectory], feats, judged: dict, beta: float) -> dict:
    """The project's extensions of step 3, each off unless its flag
    is given, then the A_mod step 4 trains on. --judge-budget spent:
    all get the recent judged means of phi and psi; --distill: the
    trusted heads score the unjudged; --centre-psi: psi loses its
    judged mean. Only here and in modulate() is t.a_mod computed
    (lifecycle.share_advantages copies rank 0's to each rank)."""
    args, info = run.args, {}
    if spent := modulation.after_budget(run, trajs):
        for t in trajs:
            t.phi, t.psi = spent.get("phi", t.phi), spent.get("psi", t.psi)
        info["imputed_after_budget"] = spent
    for i, levels in distill.use_heads(run, trajs, feats, judged).items():
        trajs[i].phi, trajs[i].psi = phi(levels, args.entering), psi(levels, args.entering)
    centre = modulation.psi_centre(args, trajs)
    for t in trajs:
        t.a_mod = a_mod(t.a_game, t.phi, t.psi - (centre or 0.0), beta)
    info |= {} if centre is None else {"psi_centre": centre}
    return info | modulation.rubric_scores(args, trajs, spent, impute)


# ========================
# Algorithm 1, step 4: REINFORCE on the modulated
# advantage.
#   grad J = E_tau[ sum_{t in T_p} A_mod(tau)
#                   * grad log pi(y_t | s_t) ]
# A response token weighs its trajectory's A_mod. The loss
# sums weight * log pi over a normaliser constant over the
# step, N_transitions * max_new_tokens, as in SPIRAL and
# Dr. GRPO (arXiv 2503.20783): every token counts the
# same, whatever its response's length.
# ========================
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log pi(target) per position, in fp32.
    logits [B, T, V], targets [B, T] -> [B, T]"""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]


def token_weights(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A response token's weight in the loss: its trajectory's
    A_mod, 0 on padding. advantages [B], mask [B, R] -> [B, R]"""
    return advantages[:, None] * mask  # [B, R]


def normaliser(transitions: int, max_new_tokens: int) -> float:
    """The loss's divisor, the same for every token of the step."""
    return transitions * max_new_tokens


def reinforce_loss(logps, weights, normaliser: float) -> torch.Tensor:
    """-sum of weight * log pi over the tokens, over the
    normaliser. logps, weights [B, R] -> scalar"""
    return -(weights * logps).sum() / normaliser  # scalar


# --ppo-epochs N > 1 (SPIRAL's code, through oat): N Adam
# steps on one batch, each on PPO's clipped surrogate, with
# r = pi_theta / pi_old per token (pi_old: the player):
#   loss = -sum min(w * r, w * clip(r, 1 - eps, 1 + eps))
#          / normaliser
# In epoch 1, r = 1 and dr/dtheta = d log pi/dtheta: that
# step is exactly REINFORCE's.
def ppo_clip_loss(logps, old_logps, weights, normaliser: float, clip_range: float):
    """PPO's clipped loss, r, and the tokens whose loss the clip
    bounds (oat's pg_clipfrac). logps, old_logps, weights [B, R]"""
    ratio = torch.exp(logps - old_logps)  # [B, R]
    unclipped = weights * ratio  # [B, R]
    clipped = weights * ratio.clamp(1 - clip_range, 1 + clip_range)  # [B, R]
    loss = -torch.minimum(unclipped, clipped).sum() / normaliser  # scalar
    return loss, ratio.detach(), (clipped < unclipped).detach()  # [B, R]


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(d) - d - 1,
    d = log pi_ref - log pi; >= 0 and unbiased, as in DeepSeekMath
    (http://joschu.net/blog/kl-approx.html). [B, T] -> [B, T]"""
    return torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # [B, T]


def collate(items: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Prompt + response, LEFT-padded so every response ends at the
    last column: the learner needs the logits of the last R + 1
    positions only (R: the longest response)."""
    width = max(len(p) + len(r) for p, r in items)
    resp_len = max(len(r) for _, r in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)  # [B, T]
    attn = torch.zeros((len(items), width), dtype=torch.long)  # [B, T]
    resp_mask = torch.zeros((len(items), resp_len), dtype=torch.float32)  # [B, R]
    for i, (p, r) in enumerate(items):
        seq = p + r
        ids[i, width - len(seq) :] = torch.tensor(seq)
        attn[i, width - len(seq) :] = 1
        resp_mask[i, resp_len - len(r) :] = 1
    return ids, attn, resp_mask


def sequence_logprobs(model, ids, attn, resp_len: int, temperature: float) -> torch.Tensor:
    """log pi of each row's last `resp_len` tokens, at the sampling
    temperature. -> [B, R]"""
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, T]: padding shifts none
    keep = resp_len + 1  # the logits that predict the response
    out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, logits_to_keep=keep)
    return token_logprobs(out.logits[:, :-1] / temperature, ids[:, -resp_len:])  # [B, R]


class Diverged(ArithmeticError):
    """A gradient that is not finite (NaN, inf): no step taken."""


def policy_update(run: lifecycle.Run, trajs: list[Trajectory], normaliser: float) -> dict:
    """--ppo-epochs Adam steps (one: REINFORCE) on this rank's
    transitions, micro-batched, gradients accumulated. Returns the
    loss and gradient norm (means over epochs), and each epoch's
    sums."""
    args = run.args
    chunks, real = micro_batches(run, trajs)
    run.model.train()
    old_logps: list[torch.Tensor] = []  # PPO: log pi_old [b, R] each
    epochs = []
    for epoch in range(args.ppo_epochs):
        run.optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "ratio_sum": 0.0, "clipped": 0.0, "tokens": 0.0}
        for k, chunk in enumerate(chunks):
            logps, ref, mask, weights = forward(run, chunk)  # [b, R] each
            weights = overlap.corrected(run, logps, chunk, weights)  # --async-level: IS
            tally = sums if k < real else None  # FSDP's repeats: not ours
            if args.ppo_epochs == 1:
                loss = reinforce_loss(logps, weights, normaliser)  # the paper
            else:  # --ppo-epochs N > 1: PPO's clipped surrogate
                old_logps += [logps.detach()] if epoch == 0 else []
                loss = ppo_term(logps, old_logps[k], weights, mask, normaliser, args, tally)
            if ref is not None:  # --kl-coef: k3 KL to the initial policy
                loss = loss + args.kl_coef * kl_term(logps, ref, mask, normaliser, tally)
            loss.backward()
            sums["loss"] += loss.item()
        epochs.append(adam_step(run, sums))
    run.optimizer.zero_grad(set_to_none=True)
    return {
        "loss": sum(e["loss"] for e in epochs) / len(epochs),
        "grad_norm": sum(e["grad_norm"] for e in epochs) / len(epochs),
        "epochs": epochs,
    }


def micro_batches(run: lifecycle.Run, trajs: list[Trajectory]) -> tuple[list, int]:
    """This rank's transitions (prompt, response, A_mod), sorted by
    length for little padding, cut into --micro-batch-size pieces;
    and how many are real (FSDP: a rank with fewer repeats its last
    at A_mod 0)."""
    turns = [(t.prompt_ids, t.response_ids, traj.a_mod, t) for traj in trajs for t in traj.turns]
    items = sorted(turns, key=lambda x: len(x[0]) + len(x[1]))
    size = run.args.micro_batch_size
    chunks = [items[k : k + size] for k in range(0, len(items), size)]
    return distributed.even_micro_batches(chunks, run.dist)


def forward(run: lifecycle.Run, chunk: list[tuple], model=None) -> tuple:
    """A micro-batch through the learner (or `model`), and the frozen
    reference with --kl-coef, else None: log pi per response token,
    the reference's, the mask and the weights (A_mod). [b, R] each;
    bf16 autocast on a GPU, fp32 on a CPU."""
    args, device = run.args, run.device
    batch = collate([(p, r) for p, r, *_ in chunk], run.tokenizer.pad_token_id)
    ids, attn, mask = (x.to(device) for x in batch)  # [b, T], [b, T], [b, R]
    adv = torch.tensor([x[2] for x in chunk], dtype=torch.float32, device=device)  # [b]
    width, ref = mask.shape[1], None
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logps = sequence_logprobs(model or run.model, ids, attn, width, args.temperature)  # [b, R]
        if run.reference is not None and model is None:
            ref = sequence_logprobs(run.reference, ids, attn, width, args.temperature)  # [b, R]
    return logps, ref, mask, token_weights(adv, mask)


def ppo_term(logps, old_logps, weights, mask, normaliser: float, args: Args, sums) -> torch.Tensor:
    """ppo_clip_loss; `sums` (None: a repeated micro-batch) hears
    of r and the tokens the clip binds."""
    loss, ratio, clipped = ppo_clip_loss(logps, old_logps, weights, normaliser, args.clip_range)
    if sums is not None:
        sums["ratio_sum"] += (ratio * mask).sum().item()
        sums["clipped"] += (clipped * mask).sum().item()
        sums["tokens"] += mask.sum().item()
    return loss


def kl_term(logps, ref_logps, mask, normaliser: float, sums) -> torch.Tensor:
    """The k3 KL over the response tokens, on the loss's
    normaliser; `sums` (None: a repeated micro-batch, whose KL adds
    nothing) hears of it."""
    if sums is None:
        return torch.zeros((), device=logps.device)
    kl = (kl_k3(logps, ref_logps) * mask).sum() / normaliser  # scalar
    sums["kl"] = sums.get("kl", 0.0) + kl.item()  # logged unweighted
    return kl


def adam_step(run: lifecycle.Run, sums: dict) -> dict:
    """The epoch's Adam step on the accumulated gradient, clipped to
    --max-grad-norm; none if it is not finite (Diverged)."""
    grad_norm = distributed.clip_grad_norm(run.model, run.args.max_grad_norm)
    if not math.isfinite(grad_norm):  # every rank alike: no step, no save
        raise Diverged(f"the gradient norm is {grad_norm} (the loss: {sums['loss']})")
    run.optimizer.step()
    return {**sums, "grad_norm": grad_norm}


def reinforce(run: lifecycle.Run, mine: list, transitions: int, timer, progress) -> dict:
    """Step 4 on this rank: policy_update on its own trajectories,
    with the batch's normaliser over the world size (FSDP averages
    gradients). The engine is set aside for it, then synced."""
    progress.phase("learning")
    with timer("sync"):
        # colocated vLLM sleeps: weights to CPU, KV cache freed
        run.policy.before_learn()
    with timer("learn"):  # --async-level 1: beside the next batch's games
        divisor = normaliser(transitions, run.args.max_new_tokens) / run.dist.world
        try:
            oom = lifecycle.halve_on_oom  # OOM: retried
            update = oom(policy_update, run, mine, divisor, progress.step)
        except Diverged as e:  # a NaN is nothing to train on or save
            raise UserError(
                f"step {progress.step}: the policy diverged, {e}; its last checkpoint is kept "
                "(a lower --lr, or --lora-alpha, keeps it finite)"
            ) from None
    overlap.join(run, timer)  # --async-level 1: the next batch waited for
    with timer("sync"):
        run.policy.sync(run.model)  # the next step plays the new weights
    progress.close()
    return update


def make_optimizer(model, args: Args) -> torch.optim.Optimizer:
    """Adam at a constant --lr (paper: 1e-6) over the weights that
    learn (LoRA: the adapters alone)."""
    return torch.optim.Adam(lora.trainable(model), lr=args.lr, betas=args.betas)


# ========================
# The policy: the tiny offline model, loading, and HF
# generation (vLLM: machinery/vllm_engine.py).
# ========================
# Random-weight Qwen3 shapes. "qwen3-4b" is Qwen3-4B-Base's
# config.json (4.02 B parameters), for GPU benchmarks with
# no hub; with the tiny tokenizer most sampled ids decode
# to nothing, so every response runs to --max-new-tokens:
# the worst case for speed.
ARCHS = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention minimum
        max_position_embeddings=16384,
    ),
    "qwen3-4b": dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    ),
}
# The warm start's shape (tools/warmstart.py): tiny with a
# 10x larger init, without which copying a free square off
# TicTacToe's board sits on a plateau for 800+ steps
# (docs/learning.md).
ARCHS["tiny-warm"] = {**ARCHS["tiny"], "initializer_range": 0.2}
# --tiny: small, fast, offline. A flag given explicitly still wins.
TINY_DEFAULTS = dict(
    model="tiny",
    judge="heuristic",
    batch_size=32,
    num_envs=8,
    max_new_tokens=48,
    micro_batch_size=8,
    lr=1e-4,
    max_turns=20,
    eval_n=4,
    eval_max_turns=60,
)
# `stratagem.py warmstart` rebuilds it
WARM_START = Path(__file__).parent / "warmstart" / "tiny"


def tiny_tokenizer(seed: int, texts: tuple[str, ...] = ()):
    """The tiny models' byte-level BPE tokenizer, trained in memory
    on the games' texts and `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        PROMPT,
        "\\boxed{[4]} [check] [bet] [call] [fold] [Accept] [Deny] [Offer: 3 Wood -> 2 Gold]",
    ]
    state = random.getstate()
    corpus += [
        make_env(gid, seed, 0).get_observation()[1] for gid in Args().games.split(",")
    ] + list(texts)
    random.setstate(state)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # ~760 tokens: merges run out
        vocab_size=1024,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


def build_random_model(
    out_dir: str, seed: int, arch: str = "tiny", texts: tuple[str, ...] = ()
) -> None:
    """A random Qwen3 of shape ARCHS[arch] and the tiny tokenizer,
    saved like any checkpoint, for from_pretrained. Offline."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = tiny_tokenizer(seed, texts)
    config = Qwen3Config(
        **{"vocab_size": len(tok), **ARCHS[arch]},
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    if not arch.startswith("tiny"):
        # as checkpoints ship; tiny ones stay fp32 (exact tests)
        model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def model_shape(args: Args) -> dict | None:
    """The policy's config, read without loading it, for --dry-run's
    memory projection: --tiny's, a local folder's or the hub cache's
    config.json, or ARCHS for Qwen3-4B; else None."""
    if args.tiny and args.tiny_init == "random":
        return {
            **ARCHS["tiny"],
            "vocab_size": len(tiny_tokenizer(args.seed)),
            "tie_word_embeddings": True,
        }
    from huggingface_hub import try_to_load_from_cache

    try:
        local = (WARM_START if args.tiny else Path(os.path.expanduser(args.model))) / "config.json"
        path = local if local.is_file() else try_to_load_from_cache(args.model, "config.json")
        if isinstance(path, str | Path):
            config = json.loads(Path(path).read_text())
            return config if isinstance(config, dict) else None
    except (OSError, ValueError):  # not a hub id, a damaged config.json
        return None
    if args.model.lower().removesuffix("-base").endswith("qwen3-4b"):
        return {**ARCHS["qwen3-4b"], "tie_word_embeddings": True}
    return None


def context_length(args: Args) -> int | None:
    """Tokens the policy's context holds, read before loading
    (model_shape), or None if unknown."""
    if args.tiny:
        return ARCHS["tiny"]["max_position_embeddings"]
    value = (model_shape(args) or {}).get("max_position_embeddings")
    return value if isinstance(value, int) else None


def load_policy(path: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """Model and tokenizer through the real from_pretrained. fp32
    weights: at lr 1e-6 most Adam updates are below one bf16 ulp and
    would round away (CUDA computes in bf16 autocast)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    # untrusted: sizes, code, weights checked first
    folder = modelfiles.check_folder(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        load = dict(dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True)
        model, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False, **load)
    except Exception as e:  # noqa: BLE001 - a damaged folder: one line
        raise modelfiles.unloadable(path, e) from None
    # whole or refused: never a tensor silently initialised
    modelfiles.check_loaded(folder, info)
    modelfiles.check_finite_weights(folder, model)
    vocab = model.get_input_embeddings().num_embeddings
    eos = modelfiles.generation_eos(folder, model.generation_config, vocab)
    # nothing else steers sampling
    model.generation_config = GenerationConfig(eos_token_id=eos)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # format_prompt reads qwen_markup and markup
    tokenizer.qwen_markup = model.config.model_type.startswith("qwen")
    template = None if tokenizer.qwen_markup else tokenizer.chat_template
    tokenizer.markup = modelfiles.chat_markup(path, template, tokenizer.special_tokens_map)
    return model.to(device), tokenizer


def stop_ids(tokenizer, model) -> list[int]:
    """Where a response ends, as in SPIRAL (vLLM's default): the
    tokenizer's and the generation config's EOS. A base model
    (Qwen3-4B-Base: <|endoftext|>) does not stop at <|im_end|>."""
    eos = model.generation_config.eos_token_id
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    return sorted(i for i in ids if i is not None)


def cut_at_stop(response: list[int], stop: list[int]) -> list[int]:
    """Up to and including the first stop token: the policy learns
    when to stop."""
    return response[: next((i + 1 for i, t in enumerate(response) if t in stop), len(response))]


class HFPolicy:
    """transformers `generate` on the learner's own model (nothing
    to sync), or, when FSDP shards the learner, on a full copy that
    `sync` refreshes after every update."""

    own_weights = False  # it plays the model it is given

    def __init__(self, model, tokenizer, args: Args, device: torch.device):
        self.model, self.tok, self.args, self.device = model, tokenizer, args, device
        self.stop = stop_ids(tokenizer, model)
        context = getattr(model.config, "max_position_embeddings", None)
        self.room = context and context - args.max_new_tokens  # past_context

    @torch.no_grad()
    def generate(self, prompts: list[str]) -> list[tuple[list[int], list[int], str]]:
        self.model.eval()
        enc = self.tok(
            prompts,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        )
        enc = enc.to(self.device)
        sampled = self.args.temperature > 0  # 0: greedy (eval --greedy)
        sampling = dict(do_sample=True, temperature=self.args.temperature, top_k=0, top_p=1.0)
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"
        ):
            out = self.model.generate(
                **enc,
                **(sampling if sampled else dict(do_sample=False)),
                max_new_tokens=self.args.max_new_tokens,
                eos_token_id=self.stop,
                pad_token_id=self.tok.pad_token_id,
            )  # [B, T + new]
        width = enc.input_ids.shape[1]
        results = []
        for row, mask in zip(out, enc.attention_mask):
            response = cut_at_stop(row[width:].tolist(), self.stop)
            text = self.tok.decode(response, skip_special_tokens=True)
            results.append((row[:width][mask.bool()].tolist(), response, text))
        return results

    def before_learn(self) -> None:
        """Nothing to free: generation and learning share one model."""

    def sync(self, model) -> None:
        if model is not self.model:
            self.model.load_state_dict(distributed.full_weights(model))

    def close(self) -> None:
        """Nothing to tear down."""


# ========================
# The evaluation (--eval-every; the `eval` command): the
# model against a fixed opponent on the training games and
# unseen ones, through self-play's lockstep turn.
# ========================
def schedule(games: list[str], n: int, rng: random.Random, first_last=()) -> list[tuple]:
    """n games of each id, in order, the model in seat 0 in even
    games, 1 in odd: (game, seat, seed, whether it shows SPIRAL's
    first and last messages only)."""
    pairs = itertools.product(games, range(n))
    return [(g, k % 2, rng.randrange(2**31), g in first_last) for g, k in pairs]


def play_matches(
    policy, tokenizer, opponent, games: list[tuple], rules: Rules, concurrency: int, finished=None
):
    """The `schedule`d games, the model against `opponent`, played
    and paid as in training. One record per game, from the model's
    seat, in schedule order; `finished` hears the count ended after
    each turn."""
    queue = list(enumerate(games))
    live: list[Episode] = []
    records = []
    while queue or live:
        while queue and len(live) < concurrency:
            index, (game, seat, seed, first_last) = queue.pop(0)
            env = make_env(game, seed, rules.error_allowance, first_last)
            live.append(Episode(game, env, seat=seat, index=index))
        live, ended = play_turn(policy, tokenizer, live, rules, opponent)
        for ep in ended:
            results, invalid, paid = settle(ep, rules)
            records.append(
                {
                    "index": ep.index,
                    "game": ep.game,
                    "seat": ep.seat,
                    "turns": ep.moves,
                    "capped": not ep.done,
                    "outcome": results[ep.seat],
                    "invalid": invalid[ep.seat],
                    "opponent_invalid": invalid[1 - ep.seat],
                    "reward": paid[ep.seat],
                    "moves": [[t.observation, t.action] for t in ep.turns[ep.seat]],
                }
            )
        if finished is not None:
            finished(len(records))
    return sorted(records, key=lambda r: r["index"])


def periodic_eval(run: lifecycle.Run, step: int, timer: watch.Timer) -> dict | None:
    """--eval-every: the model against --eval-opponent (rank 0), on
    RNG streams of its own."""
    if not run.eval_games or step % run.args.eval_every or not run.dist.main:
        return None
    args = run.args
    rules = dataclasses.replace(args.rules, max_turns=args.eval_max_turns)
    first_last = first_last_ids(args.eval_first_last, args.eval_games)
    opponent = perfect.player(args.eval_opponent, random.Random(step))
    games = schedule(run.eval_games, args.eval_n, random.Random(args.seed + step), first_last)
    bar = watch.Games(f"step {step}/{args.steps}: eval vs {args.eval_opponent}", len(games))
    with timer("eval"), torch.random.fork_rng(), bar:  # nothing drawn from training's streams
        records = play_matches(
            run.policy, run.tokenizer, opponent, games, rules, args.num_envs, bar
        )
    every = perfect.readable(first_last, rules.error_allowance)  # KuhnPoker-v1's best reply
    return perfect.report(records, args.eval_opponent, random.Random(step), every)


class FreshSeeds(random.Random):
    """Game seeds in [2**31, 2**32): never one the run's evaluations
    drew (below 2**31)."""

    def randrange(self, n: int) -> int:  # schedule() draws randrange(2**31)
        return n + super().randrange(n)


def best_on_fresh_games(run: lifecycle.Run) -> None:
    """--keep-best: the kept policy against the random player on
    fresh games, the figure to report (the best of several
    evaluations is biased up by the choice). Written last, to
    best/best.json: a run stopped before does it on --resume."""
    args = run.args
    chosen = lifecycle.read_best(run.out) if args.keep_best and run.dist.main else None
    # none kept, or measured already
    if chosen is None or "fresh" in chosen:
        return
    n = args.best_eval_n or 5 * args.eval_n
    first_last = first_last_ids(args.eval_first_last, args.eval_games)
    games = schedule(run.eval_games, n, FreshSeeds(args.seed), first_last)
    why = f"--best-eval-n {n}" if args.best_eval_n else f"5 x --eval-n {args.eval_n}"
    print(
        f"best/ (step {chosen['step']}): {n} fresh games per id vs random, {len(games)} in "
        f"all ({why}) ...",
        flush=True,
    )
    best = load_policy(str(run.out / "best"), run.device)[0]
    policy = run.policy
    if isinstance(policy, HFPolicy):
        policy = HFPolicy(best, run.tokenizer, args, run.device)
    # vLLM: its engine plays the kept policy
    policy.sync(best)
    rules = dataclasses.replace(args.rules, max_turns=args.eval_max_turns)
    opponent = RandomPlayer(random.Random(f"fresh:{args.seed}"))
    lines = watch.Lines("best/: fresh games", len(games), "games")  # off a tty
    with torch.random.fork_rng(), watch.Games("best/: fresh games", len(games)) as bar:
        torch.manual_seed(args.seed)

        def finished(done: int) -> None:  # a bar on a tty, else a line
            bar(done)
            lines(done)

        records = play_matches(
            policy, run.tokenizer, opponent, games, rules, args.num_envs, finished
        )
    lifecycle.write_best(run.out, {**chosen, "fresh": summarize_matches(records)})


def play_and_judge(run: lifecycle.Run, policy, step: int, timer, progress) -> tuple:
    """Steps 1-3 on a batch played by `policy`: the step's record so
    far (lifecycle.Step) and this rank's trajectories (--async-level
    1: on a thread, beside the update, machinery/overlap.py)."""
    args, target = run.args, math.ceil(run.args.batch_size / run.dist.world)
    # ---- Algorithm 1, step 1: self-play (one policy, both seats) ----
    mine, outcomes, calls = self_play(run, target, timer, progress, policy)
    overlap.behaviour(run, policy, mine, micro_batches, forward)  # log mu
    trajs, parts = lifecycle.whole_batch(run.dist, mine)  # rank by rank
    feats = distill.features_of(run, mine, collate, timer)  # --distill
    judged, usage, mod = {}, {}, {}
    if run.dist.main:
        # ---- Algorithm 1, step 2: RAE, A_game = R - b[G,p] ----
        rae_advantages(trajs, run.baselines, args.ema, run.versus.key)

        # ---- Algorithm 1, step 3: A_mod = A_game*phi + beta*psi ----
        with timer("judge"):
            judged, usage = judge_sample(run, trajs, progress)
        beta = run.beta if args.beta_share else args.beta  # --beta-share
        mod = modulate(trajs, judged, args.entering, beta)
        mod |= final_a_mod(run, trajs, feats, judged, beta)  # extensions
        mod["beta"] = adaptive_beta.step(run, trajs, beta)  # the next beta
    lifecycle.share_advantages(run.dist, parts, mine)  # to their ranks
    return lifecycle.Step(step, timer, trajs, (outcomes, calls), judged, usage, mod, {}), mine


# ========================
# train(): Algorithm 1. Setting a run up (fresh or
# resumed), the step's metrics and the checkpoint are
# machinery/lifecycle.py's: the loop reads like the paper.
# ========================
def train(args: Args) -> Path | None:
    """Algorithm 1: run (or resume) a training run; its folder on
    rank 0 once trained. Under torchrun every rank plays its share
    of the batch; rank 0 alone judges, writes and prints."""
    pieces = lifecycle.Pieces(load_learner_and_engine, make_env, seed_everything, model_shape, spot)
    run = lifecycle.start_run(args, pieces)
    if run is None:  # --dry-run, or a resumed run already finished
        return None
    # --eval-every: the curve starts before any update
    if run.start == 0:
        lifecycle.first_eval(run, periodic_eval(run, 0, watch.Timer()))
    for step in range(run.start + 1, args.steps + 1):
        timer, target = watch.Timer(), math.ceil(args.batch_size / run.dist.world)
        progress = watch.Progress(step, args.steps, target, show=run.dist.main)
        # ---- Algorithm 1, steps 1-3 (--async-level 1: beside the last update) ----
        done, mine = overlap.batch(run, step, play_and_judge, timer, progress)

        # ---- Algorithm 1, step 4: REINFORCE on A_mod ----
        # grad J = E[ sum_t A_mod grad log pi(y_t|s_t) ]
        done.update = reinforce(run, mine, sum(len(t.turns) for t in done.trajs), timer, progress)
        run.versus.snapshot(step, run.model)  # --opponents: the past pool
        done.evaluation = periodic_eval(run, step, timer)
        lifecycle.end_step(run, done)
    best_on_fresh_games(run)  # --keep-best: on games it was not chosen on
    return lifecycle.finish_run(run)


def seed_everything(seed: int) -> random.Random:
    """Seed Python, NumPy and torch; return a private Random for our
    draws, since TextArena's reset() reseeds the global `random`
    (game sampling would follow game seeds)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return random.Random(seed)


def load_learner_and_engine(
    args: Args, ckpt: Path | None, dist: distributed.Dist, device: torch.device
):
    """The learner, its tokenizer, the generation engine, the frozen
    initial policy (--kl-coef, else None) and the optimizer. Weights:
    the checkpoint resumed, the tiny model or --model; with
    --lora-rank, the base and its adapters. Under torchrun the
    learner is sharded."""
    with tempfile.TemporaryDirectory() as tiny_dir:
        initial = args.model
        if args.tiny and args.tiny_init == "warm":
            initial = str(WARM_START)
        elif args.tiny and (ckpt is None or args.kl_coef or args.lora_rank):
            if dist.main:  # one copy for every rank (HF saves on rank 0)
                build_random_model(tiny_dir, args.seed)
            initial = dist.broadcast(tiny_dir)
        model_path = str(ckpt) if ckpt is not None and not args.lora_rank else initial
        frozen_bf16 = args.lora_rank and device.type == "cuda"  # LoRA's base
        dtype = torch.bfloat16 if frozen_bf16 else torch.float32
        model, tokenizer = load_policy(model_path, device, dtype)
        reference = None
        if args.kl_coef:
            reference = load_policy(initial, device, dtype)[0].requires_grad_(False)
        if args.gradient_checkpointing:
            # --async-level 1: recompute leaves the RNG alone
            model.gradient_checkpointing_enable(overlap.checkpointing(args))
        if args.lora_rank:
            model = lora.add_adapters(model, args, ckpt)
        generator = model
        # the learner sharded; HF generates on a synced full copy
        if dist.world > 1:
            generator = copy.deepcopy(model) if args.backend == "hf" else None
            distributed.shard(model)
        if args.backend == "vllm":
            stop = stop_ids(tokenizer, model)
            policy = VLLMPolicy(
                model_path, tokenizer, stop, args, device, dist.local_rank, dist.world
            )
        else:
            policy = HFPolicy(generator, tokenizer, args, device)
        dist.gather(None)  # all ranks loaded before the tiny folder goes
    return model, tokenizer, policy, reference, make_optimizer(model, args)


# ========================
# The command line: parse, validate, run. A user's mistake
# ends in one line and exit code 2. Choices, bounds and
# checks of the flags: machinery/flags.py.
# ========================
def validate(args: Args) -> None:
    """Every flag in range and consistent with the others, else one
    line naming it."""
    checks.unread(args, {"ema", "opponent_baselines"} - set(ADVANTAGE_FLAGS), "step 2's estimator")
    checks.validate(args, context_length(args), WARM_START)
    check_flags(args)


def build_parser() -> flags.FriendlyParser:
    """The trainer's command line: a flag per field of Args, its
    docstring the help."""
    epilog = "other commands: " + ", ".join(f"stratagem.py {c} --help" for c in cli.TOOLS)
    hints = {("mode", "spyrl"): "SpyRL has its own script: python spyrl.py --help"}
    about = dict(prog="stratagem.py", description=__doc__.split("\n\n")[0], epilog=epilog)
    presets = {"--tiny": TINY_DEFAULTS}
    return flags.dataclass_parser(Args, flags.CHOICES, presets, hints=hints, **about)


def resolve_args(explicit: dict, saved: dict | None = None) -> Args:
    """The run's Args: the defaults, then --tiny's, a resumed run's
    saved config, the flags given, each over the one before; then
    validated."""
    presets = {("tiny", True): TINY_DEFAULTS}
    return flags.resolve(Args, explicit, saved, flags.RESUMABLE, presets, validate)


def parse_args(argv: list[str]) -> Args:
    """The run's Args from a command line (with --resume, over its
    folder's config.json)."""
    explicit = vars(build_parser().parse_args(argv))
    return resolve_args(explicit, saved_config(explicit, Args, "stratagem.py"))


def main(argv: list[str] | None = None) -> int:
    """`stratagem.py [flags]` trains; `stratagem.py COMMAND ...`
    runs a command of tools/."""
    argv = sys.argv[1:] if argv is None else argv
    return cli.main("stratagem", argv, parse_args, train, cli.TOOLS)


if __name__ == "__main__":
    # a tool's `import stratagem` is this module
    sys.modules.setdefault("stratagem", sys.modules[__name__])
    # a finished torchrun rank leaves without teardown
    distributed.leave(main())
