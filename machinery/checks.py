"""stratagem.py's flags checked before any work: each in its range and consistent with the others,
else one line naming it. The games' own flags (ids, the perfect players' games) are checked in
games/ (check_flags), which the trainer calls beside this."""

from __future__ import annotations

import re
from pathlib import Path

from machinery import UserError, flags, opponents, overlap
from machinery.distributed import pick_device
from machinery.openai_api import check_base_url, check_env_base_url


def validate(args, context: int | None, warm_start: Path) -> None:
    """Every flag of a run's Args in its range and consistent with the others, else one line naming
    it (UserError); the games' flags are the games' to check (games.check_flags). `context`: the
    policy's context length, if known; `warm_start`: --tiny's weights."""
    if args.tiny and args.model != "tiny":
        raise UserError("--tiny builds its own model; drop --model")
    if context is not None and args.max_new_tokens >= context:
        raise UserError(
            f"--max-new-tokens must be < {context}, the model's context, got {args.max_new_tokens}"
        )
    flags.check_bounds(args, flags.BOUNDS)
    for name in ("invalid_rewards", "rejected_rewards"):  # not two numbers: number_pair's UserError
        text, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        if not all(-1000 <= r <= 1000 for r in flags.number_pair(text, flag)):
            raise UserError(f"{flag} must be two numbers in [-1000, 1000], got {text!r}")
    opponents.check(args)
    overlap.check(args)  # --async-level 1: what cannot overlap
    if not all(0 <= b < 1 for b in args.betas):
        raise UserError(f"--adam-betas must both be in [0, 1), got {args.adam_betas}")
    if args.distill and args.mode != "stratagem":
        raise UserError(
            f"--distill learns the judge of --mode stratagem; --mode {args.mode} has none"
        )
    lora_flags = {"lora_alpha": 0.0, "lora_dropout": 0.0, "lora_targets": type(args).lora_targets}
    if not args.lora_rank and any(getattr(args, k) != v for k, v in lora_flags.items()):
        raise UserError(
            "--lora-alpha, --lora-dropout and --lora-targets shape LoRA's adapters: give --lora-rank R"
        )
    if args.lora_rank and not all(
        re.fullmatch(r"[A-Za-z_][\w.]*", t) for t in args.lora_targets.split(",")
    ):
        raise UserError(
            f"--lora-targets must be comma-separated layer names, got {args.lora_targets!r}"
        )
    if args.judge_budget and not args.judge_price_in + args.judge_price_out:
        raise UserError(
            "--judge-budget needs --judge-price-in and/or --judge-price-out to estimate the cost"
        )
    if args.beta_share and not args.beta_min <= args.beta <= args.beta_max:
        raise UserError(
            f"--beta {args.beta} must lie in [--beta-min, --beta-max] = [{args.beta_min}, {args.beta_max}]"
        )
    if args.keep_best and not args.eval_every:
        raise UserError("--keep-best keeps the best evaluated policy: give --eval-every N")
    if args.best_eval_n and not args.keep_best:
        raise UserError("--best-eval-n sizes the kept best's fresh evaluation: give --keep-best")
    if args.eval_every:
        check_eval_opponent(args.eval_opponent, args.error_allowance, "--eval-opponent")
    if args.keep_best and args.eval_opponent != "random":
        raise UserError(KEEP_BEST[args.eval_opponent])
    if args.keep_best and args.lora_rank:
        raise UserError(
            "--keep-best keeps whole models; with --lora-rank, merge a checkpoint: stratagem.py merge-lora"
        )
    if args.judge_shadow and not (args.mode == "spiral" or args.no_psi):
        raise UserError(
            "--judge-shadow scores what does not enter A_mod: give --mode spiral or --no-psi"
        )
    if args.centre_psi and (args.mode == "spiral" or args.no_psi):
        raise UserError(
            "--centre-psi centres psi in A_mod, which --mode spiral and --no-psi leave out"
        )
    if args.tiny and args.tiny_init == "warm" and not (warm_start / "config.json").is_file():
        raise UserError(
            f"the warm start {warm_start} is missing: python stratagem.py warmstart {warm_start}"
        )
    check_base_url(args.judge_base_url, "--judge-base-url")
    if args.asked and args.judge_kind.requests:  # what the start line says and config.json records
        check_env_base_url(args.judge_base_url, "--judge openai", "--judge-base-url")
    pick_device(args.device)  # an unknown device, or a GPU that is not there, fails before any work


# --keep-best keeps the policy of the highest evaluation win rate: against each opponent but random, why that
# picks nothing.
KEEP_BEST = {
    "minimax": (
        "--keep-best keeps the policy of the highest win rate, and against --eval-opponent minimax no policy "
        "ever wins (a draw is the best there is), so it would keep step 0 whatever is learned: use "
        "--eval-opponent random"
    ),
    "best-response": (
        "--keep-best keeps the policy of the highest win rate, which with --eval-opponent best-response is "
        "the random player's games', not the exploitability it measures: use --eval-opponent random"
    ),
}


def check_eval_opponent(opponent: str, error_allowance: int, flag: str) -> None:
    """best-response reads the model's answers in the deciding round as its moves: with an error allowance,
    an answer the game refused and asked again would be read as a move the model played (and lost with)."""
    if opponent == "best-response" and error_allowance:
        raise UserError(
            f"{flag} best-response reads each of the model's answers as a move of its play; with "
            f"--error-allowance {error_allowance} an answer the game refused and asked again would count as "
            "one: pass --error-allowance 0"
        )


def unread(args, names: set[str], reader: str) -> None:
    """A flag among `names` given away from its default is refused in one line: `reader` (a fork's
    replacement of a step) does not read it, so it would do nothing."""
    for name in sorted(names):
        default = type(args).__dataclass_fields__[name].default
        if getattr(args, name) != default:
            raise UserError(
                f"--{name.replace('_', '-')} does nothing here: {reader} does not read it "
                "(stratagem.ADVANTAGE_FLAGS); drop it"
            )
