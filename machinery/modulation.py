"""The project's extensions of step 3, called by stratagem.final_a_mod after modulate(). Each is
off unless its flag is given, and each returns what it changes (the means to use, the centre)
without touching A_mod: stratagem.py alone computes it, with the paper's a_mod.

    after_budget   --judge-budget spent: the unjudged get the recent judged means
    psi_centre     --centre-psi: psi's mean over the judged, taken off psi in A_mod
    rubric_scores  the score of every rubric asked, the logged ones and --judge-shadow's too
"""

from __future__ import annotations

from dataclasses import dataclass

import judge_prompts


@dataclass
class ModulationFlags:
    """The project's remedies in step 3: stratagem.Args's modulation flags."""

    # --- modulation ---
    centre_psi: bool = False
    """a remedy for beta*psi's offset (the project's; off: the paper's
    formula): psi less its mean over the judged, so the term keeps its
    relative signal and adds nothing on average"""


RECENT = 10  # judged steps whose batch means after_budget averages


def recent_means(recent: list[dict]) -> dict[str, float] | None:
    """{score: value}: the mean of the last RECENT judged steps' batch means; None before any."""
    if not recent:
        return None
    last = recent[-RECENT:]
    names = dict.fromkeys(name for means in last for name in means)
    return {n: sum(m[n] for m in last if n in m) / sum(n in m for m in last) for n in names}


def after_budget(run, trajs: list) -> dict | None:
    """Once --judge-budget is spent nothing is judged, and the batch mean of the judged is unknown.
    Then every trajectory gets the mean of the recent judged steps' phi and psi instead of the
    neutral 1 and 0, so that A_mod keeps its scale (docs/judge.md: Cost). Returns {score: mean},
    or None where the budget is not spent or something was judged."""
    spent = run.runner is not None and run.runner.budget_exhausted()
    means = recent_means(run.recent) if spent else None
    if means is None or any(t.scores is not None for t in trajs):
        return None
    return {n: means[n] for n in judge_prompts.SCORES if n in means}


def psi_centre(args, trajs: list) -> float | None:
    """--centre-psi, a remedy for beta*psi's offset: the mean psi of the judged (0 with none), which
    A_mod takes off psi so that the term keeps its relative signal and adds nothing on average.
    None without the flag."""
    if not args.centre_psi:
        return None
    judged = [t.psi for t in trajs if t.scores is not None]
    return sum(judged) / len(judged) if judged else 0.0


def rubric_scores(args, trajs: list, spent: dict | None, impute) -> dict:
    """Each rubric's score, whether it enters A_mod or not: the batch mean of the judged
    ({score}_mean in metrics.jsonl), and for a rubric asked but left out of A_mod (a logged one, or
    --judge-shadow's control) the score of every trajectory in t.logged. As in step 3, the unjudged
    get the batch mean of the judged (`impute`, the paper's), or the trusted heads' levels (--distill),
    or after_budget's means (`spent`) on a step with nothing judged."""
    asked, entering = args.asked, args.entering
    judged = any(t.scores is not None for t in trajs)
    means = {}
    for rubric, spec in judge_prompts.RUBRICS.items():
        name, neutral = spec["score"], judge_prompts.NEUTRAL[spec["role"]]
        if rubric not in asked:  # switched off (--no-psi): neutral on the judged
            means[name] = neutral if judged else None
            continue
        scores = [
            judge_prompts.weighted(rubric, t.scores) if t.scores is not None else None
            for t in trajs
        ]
        filled, means[name] = impute(scores, (spent or {}).get(name, neutral))
        if rubric in entering:
            continue
        for t, value in zip(trajs, filled):
            heads = t.predicted["levels"] if t.predicted and t.predicted.get("used") else None
            t.logged[name] = judge_prompts.weighted(rubric, heads) if heads else value
    return {f"{name}_mean": mean for name, mean in means.items()}
