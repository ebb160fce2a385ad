"""`stratagem.py eval`: a model against a fixed opponent (a random legal player, a perfect player
(minimax on TicTacToe-v0), or any OpenAI-compatible model) on training and out-of-distribution games,
each seat in turn; on KuhnPoker-v1, also the exact best response to the model's play."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import random
import time
from pathlib import Path

from games import check_ids, first_last_ids, perfect
from games.perfect import INFOSETS
from machinery import UserError, flags, lora, saved_config, watch
from machinery.checks import check_eval_opponent
from machinery.distributed import pick_device, pick_threads
from machinery.flags import FriendlyParser, field_docs, number_pair
from machinery.matches import wilson
from machinery.openai_api import (
    OPENAI_BASE,
    JudgeFailure,
    chat,
    check_base_url,
    check_reachable,
    clipped,
    concurrently,
    openai_client,
)
from machinery.runfiles import check_writable_file, latest_checkpoint, write_new
from machinery.vllm_engine import VLLMPolicy
from machinery.watch import quiet_transformers
from stratagem import (
    PROMPT,
    Args,
    HFPolicy,
    Rules,
    load_policy,
    parse_action,
    play_matches,
    schedule,
    seed_everything,
    stop_ids,
)
from tools import merge_lora


class LLMPlayer:
    """Any OpenAI-compatible chat model as the opponent, with the policy's prompt and action parser. A request
    that fails after the client's retries, or a reply that is no chat completion (machinery/openai_api.chat_reply:
    `choices` not a list, no message, content not a string), ends the evaluation in one line: the game would be
    the model's win by the opponent's forfeit, which measures the server, not the model."""

    def __init__(self, model: str, base_url: str, args: Args):
        self.model, self.args, self.name = model, args, f"openai:{model}"
        self.where = base_url or OPENAI_BASE
        self.client = openai_client(
            base_url,
            args.judge_timeout,
            args.judge_retries,
            "an openai opponent",
            args.max_new_tokens,
        )
        check_reachable(self.client, base_url, args.judge_timeout, "opponent")

    def _one(self, pid: int, obs: str) -> str:
        try:
            reply, _, _ = chat(
                self.client,
                cut_ok=True,  # a reply cut at --max-new-tokens is read as the policy's is
                model=self.model,
                messages=[{"role": "user", "content": PROMPT.format(role=pid, observation=obs)}],
                temperature=self.args.temperature,
                max_tokens=self.args.max_new_tokens,
            )
        except JudgeFailure as e:
            raise UserError(
                f"the opponent {self.name} at {self.where} failed a request ({clipped(str(e), 160)}) after "
                f"{self.args.judge_retries} retries: the game would count as the model's win, so the evaluation "
                "ends here and writes nothing; check that server"
            ) from None
        return parse_action(reply)

    def act(self, jobs: list[tuple[object, int, str]]) -> list[str]:
        return concurrently(
            lambda job: self._one(job[1], job[2]), jobs, self.args.judge_concurrency
        )


def openai_spec(spec: str, alternative: str) -> tuple[str, str]:
    """'openai:MODEL' or 'openai:MODEL@BASE_URL' -> (model, base URL or "")."""
    model, _, url = spec.removeprefix("openai:").partition("@")
    if not spec.startswith("openai:") or not model:
        raise UserError(f"{spec!r}: use {alternative}, openai:MODEL or openai:MODEL@BASE_URL")
    check_base_url(url, f"openai:{model}: the base URL")
    return model, url


def pooled(records: list[dict], games: list[str]) -> dict | None:
    """The win rate over the games of `games` (n, rate, 95 % interval), or None where none was played."""
    rows = [r for r in records if r["game"] in games]
    if not rows:
        return None
    wins = sum(r["outcome"] == "win" for r in rows)
    return {
        "games": games,
        "n": len(rows),
        "win_rate": wins / len(rows),
        "win_ci95": wilson(wins, len(rows)),
    }


def print_matches(summary: dict, opponent: str, groups: dict[str, dict | None]) -> None:
    """A headline per group (the games the model was trained on, the unseen ones), then the table per game."""
    for name, g in groups.items():
        if g is not None:
            print(
                f"model vs {opponent}, {name} ({', '.join(g['games'])}): {g['n']} games, win rate "
                f"{g['win_rate']:.2f} [{g['win_ci95'][0]:.2f}, {g['win_ci95'][1]:.2f}]"
            )
    print("per game and seat (95 % Wilson intervals):")
    print(
        f"{'game':22}{'seat':>6}{'n':>5}"
        + "".join(f"{k:>19}" for k in ("win", "draw", "loss", "invalid"))
    )
    for game, seats in summary["games"].items():
        for seat, cell in seats.items():
            print(
                f"{game:22}{seat.removeprefix('seat'):>6}{cell['n']:>5}"
                + "".join(
                    f"{cell[k]['rate']:>7.2f} [{cell[k]['ci95'][0]:.2f},{cell[k]['ci95'][1]:.2f}]"
                    for k in ("win", "draw", "loss", "invalid")
                )
            )
    won = {
        g: s["both"] for g, s in summary["games"].items() if s["both"]["opponent_invalid"]["count"]
    }
    if won:  # wins the model did not play for: the opponent's invalid move ended the game
        print(
            "won on the opponent's invalid move: "
            + ", ".join(f"{g} {c['opponent_invalid']['count']} of {c['n']}" for g, c in won.items())
        )


def print_best_response(report: dict) -> None:
    """The best response's win rate against the model's deciding-round play, then its frequencies."""
    low, high = report["ci95"]
    print(
        f"best response to the model on KuhnPoker-v1's deciding round ({report['n']} moves of the "
        f"model): win rate {report['win_rate']:.3f} [{low:.3f}, {high:.3f}] (95 %, "
        f"{report['method']}); exploitability {report['exploitability']:.3f} above the game's "
        f"value {report['game_value']}; vs the model as opener "
        f"{report['by_role']['opener']:.3f}, as responder {report['by_role']['responder']:.3f}"
    )
    if not report["n"]:
        print("no deciding-round move of the model was recorded: every spot is taken as uniform")
    moves = ("check", "bet", "fold", "call", "invalid")
    print(f"{'information set':24}{'n':>5}" + "".join(f"{m:>8}" for m in moves))
    for spot in INFOSETS:
        cell = report["infosets"][spot]
        shares = "".join(
            f"{cell['freq'][m]:>8.2f}" if m in cell["freq"] else f"{'-':>8}" for m in moves
        )
        print(f"{spot:24}{cell['n']:>5}{shares}")


def resolve_model_path(path: str) -> str:
    """A run directory stands for its newest checkpoint."""
    ckpt = latest_checkpoint(Path(path)) if (Path(path) / "checkpoints").is_dir() else None
    return str(ckpt) if ckpt else path


def load_model(path: str, run: Path | None, backend: str, device):
    """The model and tokenizer to play: a whole model's folder as it is; a LoRA run's checkpoint (an adapter
    alone) merged into the run's base in memory (merge-lora's merge, written nowhere), for the HF engine."""
    if (
        not all((Path(path) / name).is_file() for name in lora.FILES)
        or Path(path, "config.json").exists()
    ):
        return load_policy(path, device)
    if backend == "vllm":
        merge = f"python stratagem.py merge-lora {path} OUT"
        raise UserError(
            f"{path} holds a LoRA adapter: vLLM loads whole models; write one with {merge}"
        )
    model, tokenizer, _ = merge_lora.merged_model(Path(path), run)
    return model.to(device), tokenizer


def run_of(path: str) -> Path | None:
    """The run folder a model path belongs to: the run directory itself, the run of one of its checkpoints, or
    that of its best/ (--keep-best)."""
    for folder in (Path(path), Path(path).parent.parent, Path(path).parent):
        if (folder / "config.json").is_file() and (folder / "checkpoints").is_dir():
            return folder
    return None


# eval's flags that a run's config.json fills when they are not given: {eval flag: the run's config key}
FROM_RUN = {
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "games": "eval_games",
    "max_turns": "eval_max_turns",
    "error_allowance": "error_allowance",
    "action_rule": "action_rule",
    "invalid_rewards": "invalid_rewards",
    "rejected_rewards": "rejected_rewards",
    "first_last": "eval_first_last",
}
# and where there is no run (a model directory, a hub id): the trainer's own defaults (the paper's run)
DEFAULTS = {
    "max_new_tokens": Args.max_new_tokens,
    "temperature": Args.temperature,
    "games": Args.eval_games,
    "max_turns": Args.eval_max_turns,
    "error_allowance": Args.error_allowance,
    "action_rule": Args.action_rule,
    "invalid_rewards": Args.invalid_rewards,
    "rejected_rewards": Args.rejected_rewards,
    "first_last": Args.eval_first_last,
}


def settings(ns, run: Path | None) -> list[str]:
    """Fill each of FROM_RUN's flags not given on the command line: from the run's config.json where the model is
    a run (its generation settings, how it reads and pays moves, its --eval-* games), else the trainer's
    defaults. The run's --eval-first-last keeps the games played here (a --games given may leave some out).
    Returns the flags taken from the run, or from the defaults where there is no run, as `--flag value`, to be
    said."""
    config = saved_config.run_config(run, Args) if run is not None else {}
    taken = []
    for flag, key in FROM_RUN.items():  # the games before first_last
        if getattr(ns, flag) is None:
            value = config.get(key, DEFAULTS[flag])
            if flag == "first_last":
                value = ",".join(g for g in flags.items(value) if g in flags.items(ns.games))
            setattr(ns, flag, value)
            said = key in config or run is None
            if said and value != "" and flag != "games":  # the games: said as trained and unseen
                taken.append(f"--{flag.replace('_', '-')} {value}")
    return taken


def refuse_the_runs_games(opponent: str, run: Path | None) -> None:
    """A perfect player with no --games plays its own game, unless a run's --eval-games name another: the run is
    evaluated on those (or on the --games given), and a perfect player cannot play them (one line, before anything
    loads)."""
    config = saved_config.run_config(run, Args) if run is not None else {}
    own = perfect.PERFECT[opponent]
    if other := [g for g in flags.items(config.get("eval_games", ",".join(own))) if g not in own]:
        raise UserError(
            f"{run} is evaluated on its --eval-games, and {opponent} plays {', '.join(own)} only, not "
            f"{', '.join(other)}: give --games {','.join(own)}"
        )


def names(path: Path):
    """`path`, then the names beside it that stand in for it when it is taken: NAME-2.json, NAME-3.json, ..."""
    yield path
    for k in itertools.count(2):
        yield path.with_name(f"{path.stem}-{k}{path.suffix}")


def free_name(folder: Path, seed: int) -> Path:
    """eval-<seed>.json in `folder`, or eval-<seed>-2.json, -3, ...: the first name not taken (a link is one)."""
    return next(p for p in names(folder / f"eval-{seed}.json") if not os.path.lexists(p))


def write_results(out: Path, data: bytes) -> Path:
    """`data` written to `out`, created at that moment (runfiles.write_new); where something appeared there while
    the games played (another evaluation's results, a link planted in a shared run folder), to the first free
    name beside it (names), never over it or through it. Returns where it went."""
    for path in names(out):
        with contextlib.suppress(FileExistsError):
            write_new(path, data)
            return path
    raise AssertionError("unreachable")  # names() never ends


def main(argv: list[str]) -> int:
    p = FriendlyParser(
        prog="stratagem.py eval",
        description=(
            "Play a model against a fixed opponent (a random legal player, minimax on TicTacToe-v0, or any "
            "OpenAI-compatible model) on training and out-of-distribution games, taking each seat in turn; "
            "print win/draw/loss/invalid rates per game and seat with 95 % intervals and write them as "
            "JSON. On KuhnPoker-v1, --opponent best-response also measures how exploitable the model's "
            "play is."
        ),
    )
    p.add_argument(
        "model",
        help="a run directory (its newest checkpoint), a checkpoint or model directory, or a hub id",
    )
    p.add_argument(
        "--games",
        help=f"comma-separated ids (default: the run's --eval-games; without a run: {Args.eval_games})",
    )
    p.add_argument(
        "--n", type=int, default=20, help="games per id, seats alternating (default: 20)"
    )
    p.add_argument(
        "--opponent",
        default="random",
        help="random; minimax (exact, TicTacToe-v0 only); best-response (KuhnPoker-v1 only: plays "
        "random, and reports the model's move frequencies in the deciding round and the win rate of "
        "the exact best response to them, with a bootstrap interval); openai:MODEL or "
        "openai:MODEL@BASE_URL (default: random; minimax and best-response play their game: a run "
        "whose --eval-games name another needs --games)",
    )
    p.add_argument(
        "--greedy", action="store_true", help="greedy decoding for the model (default: sampled)"
    )
    run_default = "(default: the run's {}; without a run: {!r})"
    p.add_argument(
        "--temperature",
        type=float,
        help="sampling temperature " + run_default.format("--temperature", 1.0),
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help="longest response per turn "
        + run_default.format("--max-new-tokens", Args.max_new_tokens),
    )
    p.add_argument(
        "--max-turns",
        type=int,
        help="turn cap; a capped game is a draw "
        + run_default.format("--eval-max-turns", Args.eval_max_turns),
    )
    p.add_argument(
        "--error-allowance",
        type=int,
        help="invalid moves allowed before losing "
        + run_default.format("--error-allowance", Args.error_allowance),
    )
    docs = field_docs(Args)
    for name in ("action_rule", "invalid_rewards", "rejected_rewards"):
        p.add_argument(
            "--" + name.replace("_", "-"),
            choices=flags.CHOICES.get(name),
            help=f"{docs[name][1]} "
            + run_default.format("--" + name.replace("_", "-"), getattr(Args, name)),
        )
    p.add_argument(
        "--first-last",
        help="comma-separated --games ids shown in SPIRAL's evaluation format, the first message and the latest one "
        "(SPIRAL's: TicTacToe-v0); default: the run's --eval-first-last; without a run, every game shows the whole "
        "history, as in training",
    )
    p.add_argument("--concurrency", type=int, default=64, help="games in flight (default: 64)")
    p.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seeds the games, the opponent and sampling (default: 1)",
    )
    p.add_argument(
        "--backend", choices=("hf", "vllm"), default="hf", help="generation engine (default: hf)"
    )
    p.add_argument("--device", default="auto", help="torch device (default: auto)")
    p.add_argument(
        "--vllm-enforce-eager", action="store_true", help=field_docs(Args)["vllm_enforce_eager"][1]
    )
    p.add_argument(
        "--json",
        default="",
        help="write the results here, never over an existing file (default: eval-<seed>.json in the run directory, "
        "else in the current one; eval-<seed>-2.json, -3, ... when it is taken)",
    )
    ns = p.parse_args(argv)
    run = run_of(ns.model)
    if ns.opponent in perfect.PERFECT and ns.games is None:
        refuse_the_runs_games(ns.opponent, run)
        ns.games = ",".join(perfect.PERFECT[ns.opponent])
    taken = settings(ns, run)
    if min(ns.n, ns.max_new_tokens, ns.max_turns, ns.concurrency) < 1:
        raise UserError("--n, --max-new-tokens, --max-turns and --concurrency must be >= 1")
    if not (
        ns.temperature == 0 or 1e-3 <= ns.temperature <= 100
    ):  # below 0.001, logits / T overflow to inf
        raise UserError(
            f"--temperature must be 0 (greedy) or in [0.001, 100], got {ns.temperature}"
        )
    if ns.error_allowance < 0:
        raise UserError("--error-allowance must be >= 0")
    check_eval_opponent(ns.opponent, ns.error_allowance, "--opponent")
    if ns.json and Path(ns.json).exists():
        raise UserError(f"{ns.json} already exists; choose another --json")
    out = Path(ns.json) if ns.json else free_name(run if run is not None else Path("."), ns.seed)
    check_writable_file(out, "--json")  # now, not after every game is played
    games = check_ids(ns.games)
    first_last = first_last_ids(ns.first_last, ns.games)
    perfect.check(ns.opponent, games, first_last, "--games")
    device = pick_device(ns.device)  # an unknown or absent device fails before any work
    pick_threads(device)  # as in training: OMP_NUM_THREADS, else half the cores on a CPU
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
    if ns.opponent in ("random", *perfect.PERFECT):
        opponent = perfect.player(ns.opponent, random.Random(ns.seed + 1))
    else:
        opponent = LLMPlayer(*openai_spec(ns.opponent, "random, minimax, best-response"), args)
    path = resolve_model_path(ns.model)
    trained = flags.items(
        saved_config.run_config(run, Args).get("games", Args.games)
        if run is not None
        else Args.games
    )
    unseen = [g for g in games if g not in trained]
    said = f"{', '.join(taken)}; " if taken else ""
    where = (
        f"as {run} was trained (its config.json; a flag given wins): "
        if run is not None
        else "no run, so the trainer's defaults: "
    )
    print(
        f"eval: {where}{said}trained on {', '.join(g for g in games if g in trained) or 'none of these'}; "
        f"unseen: {', '.join(unseen) or 'none'}; {len(games) * ns.n} games, {ns.n} of each",
        flush=True,
    )
    model, tokenizer = load_model(path, run, ns.backend, device)
    policy = (
        VLLMPolicy(path, tokenizer, stop_ids(tokenizer, model), args, device)
        if ns.backend == "vllm"
        else HFPolicy(model, tokenizer, args, device)
    )
    t0 = time.perf_counter()
    rules = Rules(ns.action_rule, ns.error_allowance, ns.max_turns, *payouts)
    matches = schedule(games, ns.n, rng, first_last)
    lines = watch.Lines(f"eval vs {opponent.name}", len(matches), "games")
    with watch.Games(f"eval vs {opponent.name}", len(matches)) as bar:

        def finished(done: int) -> None:  # a bar on a terminal, a line now and then off one
            bar(done)
            lines(done)

        records = play_matches(
            policy, tokenizer, opponent, matches, rules, ns.concurrency, finished
        )
    policy.close()
    summary = perfect.report(records, ns.opponent, random.Random(ns.seed + 2))
    summary["trained"] = pooled(records, [g for g in games if g in trained])
    summary["unseen"] = pooled(records, unseen)
    print_matches(
        summary,
        opponent.name,
        {"trained games": summary["trained"], "unseen games": summary["unseen"]},
    )
    print(f"{len(records)} games in {time.perf_counter() - t0:.1f} s")
    if best := summary.get("best_response"):
        print_best_response(best)
    data = json.dumps(
        {
            "model": path,
            "opponent": opponent.name,
            "greedy": ns.greedy,
            "seed": ns.seed,
            "action_rule": ns.action_rule,
            "first_last": first_last,
            "max_new_tokens": ns.max_new_tokens,
            "temperature": args.temperature,
            "max_turns": ns.max_turns,
            "invalid_rewards": payouts[0],
            "rejected_rewards": payouts[1],
            "summary": summary,
            "best_response": best,
            "games": [r | {"moves": [a for _, a in r["moves"]]} for r in records],  # no texts
        },
        indent=2,
    )
    written = write_results(out, data.encode())
    if written != out:
        print(f"{out} appeared while the games played; it is never written over or through")
    print(f"wrote {written}")
    return 0
