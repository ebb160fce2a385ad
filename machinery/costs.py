"""What the judge will cost, known before anything is paid: a dated price table, the projection of a run's
judge requests, tokens and money (project(), pure arithmetic), the dry render it is estimated from, and the
plan `--dry-run` prints (with the memory a run takes, machinery/memory.py).

The projection: a step holds --batch-size transitions, so about batch / T player-trajectories, T the turns of
a trajectory; ceil(--judge-sample-rate x that) are judged, each asked --judge-samples times per rubric, the
evolution rubric only of those with two turns or more (a one-turn trajectory is 0 by rule, never sent).
A request's prompt is the rubric and the rendered trajectory: its observations and headers (measured on a
dry render, at CHARS_PER_TOKEN) plus T responses of R tokens each. R is not known before the policy
writes them: the plan gives the bound (R = --max-new-tokens, replies of --judge-max-tokens) and an example.

The trajectory counts (trajectories a step, T, the one-turn share) come from the dry render's random players
until the run has played: a resumed run, and every run after its step 1, project from what its own policy played
(measured(): its metrics.jsonl lines). A policy that loses its games on the first move plays many more, shorter
trajectories than random players do.
"""

from __future__ import annotations

import math
import random

import judge_prompts
from machinery import opponents, watch
from machinery.judge import PRICES, PRICES_DATE
from machinery.matches import accepts, candidate_actions

CHARS_PER_TOKEN = 4  # English text in GPT-4-class tokenizers; the judge's tokenizer is not at hand
EXAMPLE = (
    1000,
    200,
)  # response and reply tokens of the plan's example (an illustration, not a measurement)
PAPER_MONEY = 100  # "about $100 a run" (the STRATAGEM paper, as its reviews report it)


def project(
    steps: int,
    batch_size: int,
    sample_rate: float,
    rubrics: list[str],
    samples: int,
    turns: float,
    one_turn: float,
    chars: dict[str, float],
    response_tokens: float,
    reply_tokens: float,
    prices: tuple[float, float],
    per_step: float | None = None,
) -> dict:
    """The judge's requests, prompt and completion tokens and money over `steps` steps. `turns`: mean turns of
    a player-trajectory; `one_turn`: the share with one turn; `chars[rubric]`: mean characters of a request
    before the responses are added; `prices`: USD per million (prompt, completion) tokens; `per_step`: the
    trajectories a step, where a run measured them (default: batch / turns)."""
    trajectories = per_step or batch_size / turns  # a step's player-trajectories
    judged = math.ceil(sample_rate * trajectories)  # as sample_for_judging counts them
    multi = {
        r: judge_prompts.RUBRICS[r]["turns"] > 1 for r in rubrics
    }  # not asked of one-turn trajectories
    asked = {
        r: judged * samples * (1 - one_turn if multi[r] else 1) for r in rubrics
    }  # requests a step
    requests = steps * sum(asked.values())
    prompt = steps * sum(
        n * (chars[r] / CHARS_PER_TOKEN + turns * response_tokens) for r, n in asked.items()
    )
    completion = requests * reply_tokens
    return {
        "trajectories": trajectories,
        "judged": judged,
        "requests": requests,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "money": (prompt * prices[0] + completion * prices[1]) / 1e6,
    }


def sample_games(
    make_env, games: list[str], seed: int, max_turns: int, n: int = 4
) -> list[tuple[str, int, list[dict]]]:
    """The dry render's games: n seeded games of each id, both seats played by a random legal player (the
    first legal move of the shuffled candidates: uniform over the legal ones without trying them all).
    Returns (game, seat, turns) per seat that moved. The global `random`, which games reseed, is left as it was."""
    state, rng, out = random.getstate(), random.Random(seed), []
    for game in games:
        for _ in range(n):
            env, turns, done = make_env(game, rng.randrange(2**31), 0), {0: [], 1: []}, False
            while not done and len(turns[0]) + len(turns[1]) < max_turns:
                pid, obs = env.get_observation()
                candidates = candidate_actions(obs)
                rng.shuffle(candidates)
                action = next((a for a in candidates if accepts(env, pid, a)), "")
                turns[pid].append({"observation": obs, "response": "", "action": action})
                done = not action or env.step(action)[0]
            out += [(game, p, t) for p, t in turns.items() if t]
    random.setstate(state)
    return out


def measured(metrics: list[dict]) -> dict | None:
    """The trajectory counts a run's own policy played, from its metrics.jsonl lines: trajectories a step (seats
    that moved), their mean turns, and the share of one-turn ones among the validly judged (None when none was, or
    the evolution rubric is off: judge_prompts' one_turn rule is counted only where it applies). None: no line."""
    if not metrics:
        return None
    played = sum(m["trajectories"] for m in metrics)
    valid = sum(m["judge_judged"] - m["judge_failed"] for m in metrics)
    one_turn = sum(m["judge_evolution_rules"].get("one_turn", 0) for m in metrics)
    return {
        "steps": len(metrics),
        "trajectories": played / len(metrics),
        "turns": sum(m["transitions"] for m in metrics) / max(1, played),
        "one_turn": one_turn / valid
        if valid and any(m["judge_evolution_rules"] for m in metrics)
        else None,
    }


def judge_projection(
    args, games: list[str], make_env, steps: int, counts: dict | None = None
) -> dict:
    """This run's judge, projected from a dry render (the requests' text) and `counts`, the trajectory counts its
    own policy played (measured()), or without them the dry render's: the bound, the example, and what they rest
    on."""
    rubrics = args.asked
    sampled = sample_games(make_env, games, args.seed, args.max_turns)
    chars = {
        r: sum(
            sum(
                len(m["content"])
                for m in judge_prompts.build_messages(r, judge_prompts.render_trajectory(g, p, t))
            )
            for g, p, t in sampled
        )
        / len(sampled)
        for r in rubrics
    }
    turns = sum(len(t) for _, _, t in sampled) / len(sampled)
    one_turn = sum(len(t) == 1 for _, _, t in sampled) / len(sampled)
    per_step = None
    if counts is not None:  # what this run's policy played replaces the random players' counts
        turns, per_step = counts["turns"], counts["trajectories"]
        one_turn = one_turn if counts["one_turn"] is None else counts["one_turn"]
    prices = args.judge_kind.prices(args)
    common = (
        steps,
        args.batch_size,
        args.judge_sample_rate,
        rubrics,
        args.judge_samples,
        turns,
        one_turn,
        chars,
    )
    example = (
        min(EXAMPLE[0], args.max_new_tokens),
        min(EXAMPLE[1], args.judge_max_tokens),
    )  # never past the bound
    return {
        "rubrics": rubrics,
        "turns": turns,
        "one_turn": one_turn,
        "steps": steps,
        "measured_steps": counts["steps"] if counts else 0,
        "prices": prices,
        "base_tokens": {r: c / CHARS_PER_TOKEN for r, c in chars.items()},
        "example_tokens": example,
        "bound": project(*common, args.max_new_tokens, args.judge_max_tokens, prices, per_step),
        "example": project(*common, *example, prices, per_step),
    }


def dollars(x: float) -> str:
    return f"${x:,.0f}" if x >= 100 else f"${x:,.2f}"


def projection_lines(args, p: dict) -> list[str]:
    """The judge's requests, tokens per request and money, as the start of a run and --dry-run print them."""
    b, e = p["bound"], p["example"]
    if not b["requests"]:  # --judge-sample-rate 0, or no step left: nothing is asked, nothing paid
        why = "--judge-sample-rate 0" if not args.judge_sample_rate else "no step left to train"
        return [
            f"judge requests: none ({why}): every trajectory trains with phi = 1, psi = 0 (A_mod = A_game)",
            "judge money: $0",
        ]
    samples = "" if args.judge_samples == 1 else f", {args.judge_samples} verdicts each"
    n = p["measured_steps"]
    source = (
        f"measured on this run's policy over {n} step{'' if n == 1 else 's'}"
        if n
        else "a random player's games (the dry render): an estimate until this policy has played a step"
    )
    lines = [
        f"judge requests: ~{b['requests']:,.0f} over {p['steps']} step{'' if p['steps'] == 1 else 's'} "
        f"(~{b['trajectories']:.1f} trajectories a step, {b['judged']} judged: {' + '.join(p['rubrics'])}{samples}; "
        f"one-turn ones skip evolution: {p['one_turn']:.0%}; {source})",
        f"judge tokens a request: ~{sum(p['base_tokens'].values()) / len(p['base_tokens']):,.0f} + {p['turns']:.1f} "
        f"turns of responses: at most ~{b['prompt_tokens'] / b['requests']:,.0f} (--max-new-tokens "
        f"{args.max_new_tokens}), ~{e['prompt_tokens'] / e['requests']:,.0f} "
        f"with {p['example_tokens'][0]:,}-token responses; "
        f"replies at most {args.judge_max_tokens:,} (--judge-max-tokens)",
    ]
    if not args.judge_kind.requests:
        return lines + [f"judge money: none (the {args.judge_kind.title} is free and offline)"]
    if not sum(p["prices"]):
        return lines + [
            f"judge money: {args.judge_model} is not in the price table of {PRICES_DATE}; "
            "pass --judge-price-in/out to see money"
        ]
    known = PRICES.get(args.judge_model) == p["prices"]
    return lines + [
        f"judge money: at most {dollars(b['money'])}, ~{dollars(e['money'])} "
        f"with {p['example_tokens'][0]:,}-token responses "
        f"and {p['example_tokens'][1]}-token replies (USD {p['prices'][0]:.2f} in / {p['prices'][1]:.2f} out per 1M "
        f"tokens{f', list prices of {PRICES_DATE}' if known else ''}; the paper: ~${PAPER_MONEY} a run)"
    ]


def plan(
    args,
    out,
    games: list[str],
    device,
    engine: str,
    projection: dict | None,
    memory: list[str] = (),
) -> str:
    """--dry-run: what the run would do and cost, and the memory it would take (`memory`, machinery/memory.py's
    lines). Nothing is loaded, run or written."""
    judge = "none (--mode spiral)" if not args.asked else args.judge_kind.words(args)
    judge += " (--judge-shadow: scores logged only)" if args.judge_shadow else ""
    lines = [
        "stratagem --dry-run: the plan; nothing is loaded, run or written",
        f"run directory: {out}"
        + (
            " (exists: a run needs --resume or another --out)"
            if out.exists() and not args.resume
            else ""
        ),
        f"model: {watch.tiny_model(args) if args.tiny else args.model}",
        f"engine: {args.backend} on {device} ({engine})",
        f"games: {', '.join(games)}, one sampled uniformly per episode, turn cap {args.max_turns}",
        *filter(None, [opponents.planned(args)]),
        f"steps: {args.steps}, batch {args.batch_size} transitions ({args.steps * args.batch_size:,} in all), "
        f"lr {args.lr:g}, mode {args.mode}"
        + ("" if args.mode == "spiral" else f", beta {args.beta}"),
        f"judge: {judge}"
        + (f", {args.judge_sample_rate:.0%} of trajectories" if args.asked else ""),
    ]
    return "\n".join(
        lines + (projection_lines(args, projection) if projection else []) + list(memory)
    )
