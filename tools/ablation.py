"""`stratagem.py ablation`: the paper's ablation in miniature, on a CPU (docs/learning.md). The learning recipe
(LEARNING: the warm-started tiny policy on Kuhn Poker, evaluated against the random legal player) is run for each
arm of ARMS and each seed, on the same budget; then one table says what each arm reached. The stand-in judge scores
surface features: the table shows that every path of the method runs end to end and how beta moves the advantage,
not the paper's transfer claim, which needs a real model and a real judge."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from machinery import UserError
from machinery.flags import FriendlyParser
from machinery.lifecycle import read_best
from machinery.matches import wilson
from machinery.runfiles import check_writable_dir, open_log, read_jsonl, write_atomic
from tools.runs import evaluation_ok, keep, read_metrics
from tools.runs import number as runs_number

HERE = Path(__file__).resolve().parent.parent

# The learning recipe (docs/learning.md): `python stratagem.py <LEARNING> --seed S --out DIR`. Its budget, --steps,
# is LEARNING's too; the evaluation every 5 steps plays 200 Kuhn Poker games (100 a seat) and is the curve's point.
LEARNING = (
    "--tiny --games KuhnPoker-v1 --steps 30 --lr 1e-3 --batch-size 128 --micro-batch-size 32 --num-envs 32 "
    "--eval-games KuhnPoker-v1 --eval-every 5 --eval-n 200 --keep-best --judge-sample-rate 1"
).split()
MIX = ["--opponents", "self=0.6,past=0.2,random=0.2"]  # the mix's shares
TUNED = ["--opponent-baselines", "--centre-psi"]  # a baseline per opponent kind, beta*psi centred
ARMS = {  # name -> the flags that make the arm; the names are the run folders' and the table's rows
    "stratagem": [],
    "spiral-shadow": ["--mode", "spiral", "--judge-shadow"],
    "no-psi": [
        "--no-psi",
        "--judge-shadow",
    ],  # psi logged, not in A_mod: every arm measured on one scale
    "centre-psi": ["--centre-psi"],
    "spiral": ["--mode", "spiral"],
    "beta-0.5": ["--beta", "0.5"],
    "beta-share": [
        "--beta-share",
        "0.075",
    ],  # the share beta = 0.2 has at the start (docs/learning.md), held
    "mix": MIX,  # docs/learning.md#opponents
    "mix-baselines": [*MIX, "--opponent-baselines"],
    "mix-centred": [*MIX, *TUNED],
    "mix-more-random": ["--opponents", "self=0.4,past=0.2,random=0.4", *TUNED],
    "mix-anchored": [*MIX, *TUNED, "--kl-coef", "0.05"],  # a KL penalty to the warm start
    "mix-anchored-0.02": [*MIX, *TUNED, "--kl-coef", "0.02"],
    "self-anchored": ["--centre-psi", "--kl-coef", "0.05"],  # is the mix needed with the anchor?
    "lagged-anchored": ["--opponents", "self=0.8,past=0.2", *TUNED, "--kl-coef", "0.05"],
}
DEFAULT_ARMS = (
    "stratagem",
    "spiral-shadow",
    "no-psi",
)  # the paper's ablation, every arm judged on one scale
WHAT = {
    "stratagem": "STRATAGEM, beta 0.2, the stand-in judge",
    "spiral-shadow": "SPIRAL (A_game), the judge's scores only logged",
    "no-psi": "STRATAGEM without psi (A_game * phi), psi only logged",
    "centre-psi": "STRATAGEM, beta*psi centred on its batch mean",
    "spiral": "SPIRAL: A_game, no judge",
    "beta-0.5": "STRATAGEM, beta 0.5",
    "beta-share": "STRATAGEM, --beta-share 0.075 (adaptive beta)",
    "mix": "STRATAGEM against 0.6 itself, 0.2 past policies, 0.2 the random player",
    "mix-baselines": "the mix, with a baseline per opponent kind",
    "mix-centred": "the mix, a baseline per opponent kind, beta*psi centred",
    "mix-more-random": "as mix-centred, with 0.4 of the games against the random player",
    "mix-anchored": "as mix-centred, with a KL anchor to the warm start (--kl-coef 0.05)",
    "mix-anchored-0.02": "as mix-anchored, with --kl-coef 0.02",
    "self-anchored": "pure self-play, beta*psi centred, the KL anchor (--kl-coef 0.05)",
    "lagged-anchored": "as mix-anchored, without the random player (self=0.8, past=0.2)",
}


def finished(run: Path, steps: int) -> bool:
    path = run / "metrics.jsonl"
    return path.is_file() and any(m.get("step") == steps and "loss" in m for m in read_jsonl(path))


def train(run: Path, arm: str, seed: int, steps: int) -> int:
    """One arm and seed: a fresh run, or the rest of an interrupted one (--resume); its output in <run>.log."""
    cmd = [sys.executable, str(HERE / "stratagem.py"), *LEARNING, *ARMS[arm], "--seed", str(seed)]
    cmd += ["--steps", str(steps)]
    # absolute: the runs start in the project's folder, whatever folder DIR was named from
    cmd += ["--out", str(run.absolute())] + (["--resume"] if (run / "config.json").exists() else [])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
    }  # one thread a run: two runs at once use the two cores
    with open_log(Path(f"{run}.log")) as log:  # never through a link in a shared folder
        return subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE
        ).returncode


COLLAPSE = (
    0.2  # a run collapsed: an evaluation lost more than this share of its games on an invalid move
)
WINDOW = 5  # psi's rise: from the mean of the first WINDOW steps to the best mean of WINDOW steps in a row


def invalid_share(evaluation: dict) -> float | None:
    """The share of an evaluation's games (every game id, both seats) lost on an invalid move; None without counts."""
    cells = [c.get("both") for c in (evaluation.get("games") or {}).values() if isinstance(c, dict)]
    counts = [
        (c["invalid"]["count"], c["n"])
        for c in cells
        if isinstance(c, dict) and "invalid" in c and "n" in c
    ]
    return (
        sum(i for i, _ in counts) / sum(n for _, n in counts)
        if counts and sum(n for _, n in counts)
        else None
    )


def psi_rise(psi: list[float]) -> float | None:
    """The best mean of WINDOW steps in a row less the mean of the first WINDOW (docs/learning.md's Figure 11
    measure); None for a run shorter than WINDOW steps."""
    if len(psi) < WINDOW:
        return None
    means = [sum(psi[k : k + WINDOW]) / WINDOW for k in range(len(psi) - WINDOW + 1)]
    return max(means) - means[0]


def fresh_win(run: Path) -> float | None:
    """The kept best's win rate on fresh games (best/best.json's "fresh"), or None where none was measured."""
    fresh = (read_best(run) or {}).get("fresh")
    return (
        fresh["win_rate"]
        if isinstance(fresh, dict) and runs_number(fresh.get("win_rate"))
        else None
    )


def arm_row(arm: str, runs: list[Path]) -> dict:
    """An arm over its seeds: the final evaluation pooled (wins over games, with its Wilson interval), each seed's
    final win rate and its kept best's on fresh games, how many seeds collapsed, each seed's psi rise, phi's mean
    over the first and the last WINDOW steps, the mean over steps of the spread (std) of A_game and A_mod, and the
    share of judged trajectories whose psi (entering A_mod or only logged) was not 0."""
    metrics = [read_metrics(r) for r in runs]
    evals = [
        keep(
            [m for m in ms if "eval" in m],
            r / "metrics.jsonl",
            lambda m: evaluation_ok(m["eval"]),
            "evaluation",
        )
        for r, ms in zip(runs, metrics)
    ]
    if missing := [str(r) for r, e in zip(runs, evals) if not e]:
        raise UserError(
            f"{missing[0]} has no evaluation in its metrics.jsonl: the ablation's runs use --eval-every"
        )
    finals, starts = [e[-1]["eval"] for e in evals], [e[0]["eval"] for e in evals]
    step_ok = lambda m: all(runs_number(m[k]) for k in ("a_game_std", "a_mod_std", "judge_judged"))  # noqa: E731
    steps = keep(
        [m for ms in metrics for m in ms if "loss" in m], runs[0].parent, step_ok, "whole step"
    )
    wins, n = sum(round(e["win_rate"] * e["n"]) for e in finals), sum(e["n"] for e in finals)
    judged = sum(m["judge_judged"] for m in steps)
    scores = {  # the judged means of each seed's steps, where the judge scored (entering A_mod or logged)
        key: [[m[key] for m in ms if "loss" in m and runs_number(m.get(key))] for ms in metrics]
        for key in ("phi_mean", "psi_mean")
    }
    phi = [
        (sum(ms[:WINDOW]) / WINDOW, sum(ms[-WINDOW:]) / WINDOW)
        for ms in scores["phi_mean"]
        if len(ms) >= WINDOW
    ]
    return {
        "arm": arm,
        "start": sum(e["win_rate"] * e["n"] for e in starts) / sum(e["n"] for e in starts),
        "final": wins / n,
        "final_ci95": wilson(wins, n),
        "seeds_final": [e["win_rate"] for e in finals],
        "seeds_fresh": [fresh_win(r) for r in runs],
        "collapsed": sum(any((invalid_share(m["eval"]) or 0) > COLLAPSE for m in e) for e in evals),
        "psi_rise": [psi_rise(ms) for ms in scores["psi_mean"]],
        "phi": [sum(p[k] for p in phi) / len(phi) for k in (0, 1)]
        if phi
        else None,  # the seeds' means
        "a_game_std": sum(m["a_game_std"] for m in steps) / len(steps),
        "a_mod_std": sum(m["a_mod_std"] for m in steps) / len(steps),
        "psi_nonzero": sum(m.get("psi_nonzero", 0) for m in steps) / judged if judged else None,
        "beta_share": [
            mean_of(metrics, k, key) for k in (0, -1) for key in ("value", "share")
        ],  # first, last step
        "multi_turn": sum(m.get("judged_multi_turn", 0) for m in steps) / judged
        if judged
        else None,
    }


def mean_of(runs: list[list[dict]], k: int, key: str) -> float | None:
    """The seeds' mean of the k-th step's beta entry `key` (value: beta, share: the evolution term's share of A_mod);
    None without a judge (or before a judged step)."""
    values = [[m for m in ms if "loss" in m][k].get("beta") or {} for ms in runs]
    values = [v[key] for v in values if v.get(key) is not None]
    return sum(values) / len(values) if values else None


def table(rows: list[dict], seeds: list[int], steps: int) -> str:
    """The markdown table of docs/learning.md."""
    pct = "{:.2f}".format
    lines = [
        f"Kuhn Poker against the random legal player; {steps} steps, seeds {', '.join(map(str, seeds))}; the final "
        "evaluation pooled over the seeds (95 % Wilson interval); the kept best (--keep-best) on fresh games; "
        f"collapsed: an evaluation lost more than {COLLAPSE:.0%} of its games on an invalid move; psi rise: the "
        f"best mean of {WINDOW} steps in a row less the first {WINDOW} steps' (the judge's psi, entering A_mod or "
        "only logged); the spreads are means over the steps; beta and the evolution term's share of A_mod, "
        "RMS(beta*psi) / (RMS(A_game*phi) + RMS(beta*psi)), are the seeds' means.",
        "",
        "| arm | start | final, pooled | final per seed | kept best, fresh games | collapsed | psi rise per seed | "
        "phi: first 5 -> last 5 | std A_game | std A_mod | psi != 0 | beta, share: first step -> last |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    either = lambda v, f: "-" if v is None else f(v)  # noqa: E731
    for r in rows:
        low, high = r["final_ci95"]
        nonzero = "n/a (no judge)" if r["psi_nonzero"] is None else f"{r['psi_nonzero']:.0%}"
        phi = (
            either(r["phi"], lambda v: f"{v[0]:.2f} -> {v[1]:.2f}")
            if r["psi_nonzero"] is not None
            else "n/a"
        )
        lines.append(
            f"| {WHAT[r['arm']]} | {pct(r['start'])} | {pct(r['final'])} [{pct(low)}, {pct(high)}] | "
            f"{' '.join(map(pct, r['seeds_final']))} | {' '.join(either(v, pct) for v in r['seeds_fresh'])} | "
            f"{r['collapsed']} of {len(seeds)} | {' '.join(either(v, '{:+.2f}'.format) for v in r['psi_rise'])} | "
            f"{phi} | {r['a_game_std']:.3f} | {r['a_mod_std']:.3f} | {nonzero} | {drift(r['beta_share'])} |"
        )
    return "\n".join(lines) + "\n"


def drift(values: list[float | None]) -> str:
    """beta and the share at the first step -> at the last, or "n/a" without a judge."""
    if None in values:
        return "n/a"
    beta0, share0, beta1, share1 = values
    return f"{beta0:.3f}, {share0:.3f} -> {beta1:.3f}, {share1:.3f}"


def main(argv: list[str]) -> int:
    p = FriendlyParser(prog="stratagem.py ablation", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "out", help="folder of the runs (<arm>-s<seed>, each with its .log) and of table.md"
    )
    p.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (1,2,3)")
    p.add_argument(
        "--steps",
        type=int,
        default=int(LEARNING[LEARNING.index("--steps") + 1]),
        help="the budget: steps a run (LEARNING's: %(default)s)",
    )
    p.add_argument(
        "--arms",
        default=",".join(DEFAULT_ARMS),
        help=f"comma-separated arms (of {', '.join(ARMS)})",
    )
    p.add_argument(
        "--jobs", type=int, default=2, help="runs at once, one thread each (2: a 2-core machine)"
    )
    ns = p.parse_args(argv)
    try:
        seeds = [int(s) for s in ns.seeds.split(",")]
    except ValueError:
        raise UserError(f"--seeds must be comma-separated integers, got {ns.seeds!r}") from None
    arms = ns.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        raise UserError(f"--arms: unknown {', '.join(unknown)} (known: {', '.join(ARMS)})")
    if ns.steps < 1 or ns.jobs < 1:
        raise UserError("--steps and --jobs must be >= 1")
    out = Path(ns.out)
    check_writable_dir(out, "out")
    out.mkdir(parents=True, exist_ok=True)
    todo = [
        (out / f"{a}-s{s}", a, s)
        for a in arms
        for s in seeds
        if not finished(out / f"{a}-s{s}", ns.steps)
    ]
    print(
        f"{len(todo)} run(s) to train, {ns.jobs} at a time; their output in {out}/<arm>-s<seed>.log",
        flush=True,
    )
    with ThreadPoolExecutor(ns.jobs) as pool:
        codes = list(pool.map(lambda job: train(job[0], job[1], job[2], ns.steps), todo))
    if failed := [str(run) for (run, _, _), code in zip(todo, codes) if code]:
        raise UserError(f"{len(failed)} run(s) failed; see {failed[0]}.log")
    text = table([arm_row(a, [out / f"{a}-s{s}" for s in seeds]) for a in arms], seeds, ns.steps)
    write_atomic(out / "table.md", text.encode())
    print(text, end="")
    return 0
