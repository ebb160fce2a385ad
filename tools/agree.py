"""`stratagem.py agree`: the cross-judge agreement check of the paper's Table 1 (Cohen's kappa on
the levels, Spearman's rho on phi and psi)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from pathlib import Path

import judge_prompts
from machinery import UserError
from machinery.flags import FriendlyParser, field_docs
from machinery.runfiles import JudgeCache, check_writable_file
from stratagem import Args, HeuristicJudge, JudgeRunner, OpenAIJudge, phi, psi, validate
from tools.eval import openai_spec
from tools.runs import read_trajectories


def cohen_kappa(a: list, b: list) -> float:
    """Unweighted Cohen's kappa of two raters' labels; nan when chance agreement is 1 (no variation) or
    there is nothing to compare."""
    n, labels = len(a), set(a) | set(b)
    if n == 0:
        return float("nan")
    p_observed = sum(x == y for x, y in zip(a, b)) / n
    p_chance = sum((a.count(v) / n) * (b.count(v) / n) for v in labels)
    return float("nan") if p_chance == 1 else (p_observed - p_chance) / (1 - p_chance)


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            out[k] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (Pearson on average ranks); nan when either side is constant or empty."""
    if not x:
        return float("nan")
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return float("nan") if var == 0 else cov / var


def judge_from_spec(spec: str, args: Args) -> HeuristicJudge | OpenAIJudge:
    if spec == "heuristic":
        return HeuristicJudge()
    judge = OpenAIJudge(*openai_spec(spec, "heuristic"), args)
    judge.check_reachable()
    return judge


def main(argv: list[str]) -> int:
    p = FriendlyParser(prog="stratagem.py agree", description=(
        "Re-score a sample of a run's trajectories with two or more judges and print, per rubric dimension, "
        "Cohen's kappa on the discrete levels and Spearman's rho for phi and psi (as in the paper's Table 1)."))
    p.add_argument("run", help="run directory (its trajectories.jsonl is read, its judge_cache.jsonl reused)")
    p.add_argument("--judges", nargs="+", required=True, metavar="JUDGE",
                   help="two or more of: heuristic, openai:MODEL, openai:MODEL@BASE_URL (key from OPENAI_API_KEY)")
    p.add_argument("--sample", type=int, default=200, help="trajectories to re-score (default: 200, as in the paper)")
    p.add_argument("--seed", type=int, default=1, help="seed of the sample (default: 1)")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    docs = field_docs(Args)
    for name in ("judge_temperature", "judge_max_tokens", "judge_concurrency", "judge_timeout", "judge_retries"):
        default = Args.__dataclass_fields__[name].default
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                       help=f"{docs[name][1]} (default: {default})")
    ns = p.parse_args(argv)
    if len(ns.judges) < 2 or ns.sample < 2:
        raise UserError("agree needs at least two --judges and --sample >= 2")
    run = Path(ns.run)
    args = dataclasses.replace(Args(), judge_temperature=ns.judge_temperature, judge_max_tokens=ns.judge_max_tokens,
                               judge_concurrency=ns.judge_concurrency, judge_timeout=ns.judge_timeout,
                               judge_retries=ns.judge_retries)
    validate(args)  # NaN or negative judge settings end here, in one line
    if ns.json:
        check_writable_file(Path(ns.json), "--json")
    pool = read_trajectories(run)
    trajs = [pool[i] for i in sorted(random.Random(ns.seed).sample(range(len(pool)), min(ns.sample, len(pool))))]
    cache = JudgeCache(run / "judge_cache.jsonl")
    judges = [judge_from_spec(spec, args) for spec in ns.judges]  # every judge is checked before any is paid
    verdicts, ruled = [], set()
    for spec, judge in zip(ns.judges, judges):
        judgements, usage = JudgeRunner(judge, args, cache).judge(trajs, list(judge_prompts.RUBRICS))
        verdicts.append([j.scores for j in judgements])
        ruled |= {i for i, j in enumerate(judgements) if j.rule}  # d, a, c set by the rules, not by the judge
        print(f"{spec}: {usage.get('requests', 0)} requests, {usage.get('cache_hits', 0)} from cache, "
              f"{sum(j.failure is not None for j in judgements)} failed", file=sys.stderr)
    keep = [i for i in range(len(trajs)) if all(v[i] is not None for v in verdicts)]
    if len(keep) < 2:
        raise UserError(f"only {len(keep)} trajectories were scored by every judge; nothing to compare")
    names = [chr(ord("A") + k) for k in range(len(ns.judges))]
    pairs = [(x, y) for x in range(len(names)) for y in range(x + 1, len(names))]
    table: dict[str, dict[str, float]] = {}
    free = [i for i in keep if i not in ruled]  # evolution agrees only where the judges decided
    for dim in ("alpha", "sigma", "rho", "d", "a", "c"):
        rows = keep if dim in ("alpha", "sigma", "rho") else free
        table[f"kappa {dim}"] = {f"{names[x]}~{names[y]}": cohen_kappa([verdicts[x][i][dim] for i in rows],
                                                                     [verdicts[y][i][dim] for i in rows])
                                 for x, y in pairs}
    for label, fn, keys, rows in (("phi", phi, ("alpha", "sigma", "rho"), keep), ("psi", psi, ("d", "a", "c"), free)):
        values = [[fn(*(v[i][k] for k in keys)) for i in rows] for v in verdicts]
        table[f"spearman {label}"] = {f"{names[x]}~{names[y]}": spearman(values[x], values[y]) for x, y in pairs}
    print(f"agreement on {len(keep)} of {len(trajs)} sampled trajectories of {run} "
          f"({len(trajs) - len(keep)} dropped: a judge failed); d, a, c and psi on the {len(free)} whose evolution "
          f"no rule decided (one turn, stagnation: judge_prompts.evolution_rules)")
    for name, spec in zip(names, ns.judges):
        print(f"  {name} = {spec}")
    columns = list(next(iter(table.values())))
    print(f"{'':16}" + "".join(f"{c:>10}" for c in columns))
    for row, values in table.items():
        print(f"{row:16}" + "".join(f"{'n/a' if math.isnan(values[c]) else f'{values[c]:.3f}':>10}" for c in columns))
    print("paper (Table 1): kappa > 0.60, Spearman > 0.70; n/a: a judge gave one level to every trajectory")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"run": str(run), "judges": dict(zip(names, ns.judges)),
                                             "n": len(keep), "sampled": len(trajs),
                                             "table": {r: {c: (None if math.isnan(v) else v) for c, v in vals.items()}
                                                       for r, vals in table.items()}}, indent=2))
    return 0
