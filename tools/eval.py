"""`stratagem.py eval`: a model against a fixed opponent (a random legal player, or any
OpenAI-compatible model) on training and out-of-distribution games, each seat in turn."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

from games import check_ids, first_last_ids
from machinery import UserError
from machinery.distributed import pick_device
from machinery.flags import FriendlyParser, field_docs, number_pair
from machinery.matches import RandomPlayer, summarize_matches
from machinery.openai_api import check_base_url, check_reachable, concurrently, openai_client
from machinery.runfiles import check_writable_file, latest_checkpoint
from machinery.vllm_engine import VLLMPolicy
from machinery.watch import quiet_transformers
from stratagem import (
    CHOICES,
    PROMPT,
    Args,
    HFPolicy,
    load_policy,
    parse_action,
    play_matches,
    seed_everything,
    stop_ids,
)


class LLMPlayer:
    """Any OpenAI-compatible chat model as the opponent, with the policy's prompt and action parser.
    A request that fails after the client's retries plays no action (an invalid move) and is counted."""

    def __init__(self, model: str, base_url: str, args: Args):
        self.model, self.args, self.name, self.failures = model, args, f"openai:{model}", 0
        self.client = openai_client(
            base_url, args.judge_timeout, args.judge_retries, "an openai opponent", args.max_new_tokens
        )
        check_reachable(self.client, base_url, args.judge_timeout, "opponent")

    def _one(self, pid: int, obs: str) -> str:
        import openai

        try:
            resp = self.client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": PROMPT.format(role=pid, observation=obs)}],
                temperature=self.args.temperature,
                max_tokens=self.args.max_new_tokens,
            )
            return parse_action(resp.choices[0].message.content or "") if resp.choices else ""
        except openai.APIError:
            self.failures += 1
            return ""

    def act(self, jobs: list[tuple[object, int, str]]) -> list[str]:
        return concurrently(lambda job: self._one(job[1], job[2]), jobs, self.args.judge_concurrency)


def openai_spec(spec: str, alternative: str) -> tuple[str, str]:
    """'openai:MODEL' or 'openai:MODEL@BASE_URL' -> (model, base URL or "")."""
    model, _, url = spec.removeprefix("openai:").partition("@")
    if not spec.startswith("openai:") or not model:
        raise UserError(f"{spec!r}: use {alternative}, openai:MODEL or openai:MODEL@BASE_URL")
    check_base_url(url, f"openai:{model}: the base URL")
    return model, url


def print_matches(summary: dict, opponent: str) -> None:
    print(
        f"model vs {opponent}: {summary['n']} games, win rate {summary['win_rate']:.2f} "
        f"[{summary['win_ci95'][0]:.2f}, {summary['win_ci95'][1]:.2f}] (95 % Wilson intervals below)"
    )
    print(f"{'game':22}{'seat':>6}{'n':>5}" + "".join(f"{k:>19}" for k in ("win", "draw", "loss", "invalid")))
    for game, seats in summary["games"].items():
        for seat, cell in seats.items():
            print(
                f"{game:22}{seat.removeprefix('seat'):>6}{cell['n']:>5}"
                + "".join(
                    f"{cell[k]['rate']:>7.2f} [{cell[k]['ci95'][0]:.2f},{cell[k]['ci95'][1]:.2f}]"
                    for k in ("win", "draw", "loss", "invalid")
                )
            )


def resolve_model_path(path: str) -> str:
    """A run directory stands for its newest checkpoint."""
    ckpt = latest_checkpoint(Path(path)) if (Path(path) / "checkpoints").is_dir() else None
    return str(ckpt) if ckpt else path


def main(argv: list[str]) -> int:
    p = FriendlyParser(
        prog="stratagem.py eval",
        description=(
            "Play a model against a fixed opponent (a random legal player, or any OpenAI-compatible model) on "
            "training and out-of-distribution games, taking each seat in turn; print win/draw/loss/invalid "
            "rates per game and seat with 95 % intervals and write them as JSON."
        ),
    )
    p.add_argument(
        "model", help="a run directory (its newest checkpoint), a checkpoint or model directory, or a hub id"
    )
    p.add_argument("--games", default=Args.eval_games, help=f"comma-separated ids (default: {Args.eval_games})")
    p.add_argument("--n", type=int, default=20, help="games per id, seats alternating (default: 20)")
    p.add_argument(
        "--opponent", default="random", help="random, openai:MODEL or openai:MODEL@BASE_URL (default: random)"
    )
    p.add_argument("--greedy", action="store_true", help="greedy decoding for the model (default: sampled)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=4096, help="longest response per turn (default: 4096)")
    p.add_argument("--max-turns", type=int, default=200, help="turn cap; a capped game is a draw (default: 200)")
    p.add_argument("--error-allowance", type=int, default=0, help="invalid moves allowed before losing (default: 0)")
    docs = field_docs(Args)
    p.add_argument(
        "--action-rule", choices=CHOICES["action_rule"], default=Args.action_rule, help=docs["action_rule"][1]
    )
    p.add_argument("--invalid-rewards", default=Args.invalid_rewards, help=docs["invalid_rewards"][1])
    p.add_argument("--rejected-rewards", default=Args.rejected_rewards, help=docs["rejected_rewards"][1])
    p.add_argument(
        "--first-last",
        default="",
        help="comma-separated --games ids shown in SPIRAL's evaluation format, the first message and the latest one "
        "(SPIRAL's: TicTacToe-v0); default: every game shows the whole history, as in training",
    )
    p.add_argument("--concurrency", type=int, default=64, help="games in flight (default: 64)")
    p.add_argument("--seed", type=int, default=1, help="seeds the games, the opponent and sampling (default: 1)")
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="generation engine (default: hf)")
    p.add_argument("--device", default="auto", help="torch device (default: auto)")
    p.add_argument("--vllm-enforce-eager", action="store_true", help=field_docs(Args)["vllm_enforce_eager"][1])
    p.add_argument("--json", default="", help="write the results here (default: eval-<seed>.json, never overwritten)")
    ns = p.parse_args(argv)
    if min(ns.n, ns.max_new_tokens, ns.max_turns, ns.concurrency) < 1:
        raise UserError("--n, --max-new-tokens, --max-turns and --concurrency must be >= 1")
    if not (ns.temperature == 0 or 1e-3 <= ns.temperature <= 100):  # below 0.001, logits / T overflow to inf
        raise UserError(f"--temperature must be 0 (greedy) or in [0.001, 100], got {ns.temperature}")
    if ns.error_allowance < 0:
        raise UserError("--error-allowance must be >= 0")
    out = Path(ns.json or f"eval-{ns.seed}.json")
    if out.exists():
        raise UserError(f"{out} already exists; choose another --json")
    check_writable_file(out, "--json")  # now, not after every game is played
    device = pick_device(ns.device)  # an unknown or absent device fails before any work
    games = check_ids(ns.games)
    first_last = first_last_ids(ns.first_last, ns.games)
    payouts = (
        number_pair(ns.invalid_rewards, "--invalid-rewards"),
        number_pair(ns.rejected_rewards, "--rejected-rewards"),
    )
    quiet_transformers()
    rng = seed_everything(ns.seed)
    args = dataclasses.replace(
        Args(),
        temperature=0.0 if ns.greedy else ns.temperature,
        seed=ns.seed,
        max_new_tokens=ns.max_new_tokens,
        backend=ns.backend,
        vllm_enforce_eager=ns.vllm_enforce_eager,
    )
    opponent = (
        RandomPlayer(random.Random(ns.seed + 1))
        if ns.opponent == "random"
        else LLMPlayer(*openai_spec(ns.opponent, "random"), args)
    )
    path = resolve_model_path(ns.model)
    model, tokenizer = load_policy(path, device)
    policy = (
        VLLMPolicy(path, tokenizer, stop_ids(tokenizer, model), args, device)
        if ns.backend == "vllm"
        else HFPolicy(model, tokenizer, args, device)
    )
    t0 = time.perf_counter()
    records = play_matches(
        policy,
        tokenizer,
        games,
        ns.n,
        opponent,
        rng,
        ns.max_turns,
        ns.error_allowance,
        ns.concurrency,
        ns.action_rule,
        first_last,
        *payouts,
    )
    policy.close()
    summary = summarize_matches(records)
    print_matches(summary, opponent.name)
    print(f"{len(records)} games in {time.perf_counter() - t0:.1f} s; opponent failures: {opponent.failures}")
    out.write_text(
        json.dumps(
            {
                "model": path,
                "opponent": opponent.name,
                "greedy": ns.greedy,
                "seed": ns.seed,
                "action_rule": ns.action_rule,
                "first_last": first_last,
                "invalid_rewards": payouts[0],
                "rejected_rewards": payouts[1],
                "summary": summary,
                "games": records,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0
