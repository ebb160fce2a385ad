"""The project's extensions of step 3, each one call in train() after modulate(). Each is off
unless its flag is given, and each recomputes A_mod with the paper's own functions, which
stratagem.py hands in as `paper` (phi, psi, impute, a_mod): nothing here imports stratagem.py.

    after_budget   --judge-budget spent: the unjudged get the recent judged means
    centre_psi     --centre-psi: psi less its mean over the judged
    rubric_scores  the score of every rubric asked, the logged ones and --judge-shadow's too
"""

from __future__ import annotations

import judge_prompts

RECENT = 10  # judged steps whose batch means after_budget averages


def recent_means(recent: list[dict]) -> dict[str, float] | None:
    """{score: value}: the mean of the last RECENT judged steps' batch means; None before any."""
    if not recent:
        return None
    last = recent[-RECENT:]
    names = dict.fromkeys(name for means in last for name in means)
    return {n: sum(m[n] for m in last if n in m) / sum(n in m for m in last) for n in names}


def after_budget(run, trajs: list, beta: float, paper) -> dict:
    """Once --judge-budget is spent nothing is judged, and the batch mean of the judged is unknown.
    Then every trajectory gets the mean of the recent judged steps' phi and psi instead of the
    neutral 1 and 0, so that A_mod keeps its scale (docs/judge.md: Cost)."""
    spent = run.runner is not None and run.runner.budget_exhausted()
    means = recent_means(run.recent) if spent else None
    if means is None or any(t.scores is not None for t in trajs):
        return {}
    for t in trajs:
        t.phi, t.psi = means.get("phi", t.phi), means.get("psi", t.psi)
        t.a_mod = paper.a_mod(t.a_game, t.phi, t.psi, beta)
    return {"imputed_after_budget": {n: means[n] for n in judge_prompts.SCORES if n in means}}


def centre_psi(args, trajs: list, beta: float, paper) -> dict:
    """--centre-psi, a remedy for beta*psi's offset: psi less its mean over the judged, so that the
    term keeps its relative signal and adds nothing on average. t.psi keeps the uncentred value."""
    if not args.centre_psi:
        return {}
    judged = [t.psi for t in trajs if t.scores is not None]
    centre = sum(judged) / len(judged) if judged else 0.0
    for t in trajs:
        t.a_mod = paper.a_mod(t.a_game, t.phi, t.psi - centre, beta)
    return {"psi_centre": centre}


def rubric_scores(args, trajs: list, mod: dict, paper) -> dict:
    """Each rubric's score, whether it enters A_mod or not: the batch mean of the judged
    ({score}_mean in metrics.jsonl), and for a rubric asked but left out of A_mod (a logged one, or
    --judge-shadow's control) the score of every trajectory in t.logged. As in step 3, the unjudged
    get the batch mean of the judged, or the trusted heads' levels (--distill), or after_budget's means
    (in `mod`) on a step with nothing judged."""
    asked, entering, spent = args.asked, args.entering, mod.get("imputed_after_budget")
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
        filled, means[name] = paper.impute(scores, (spent or {}).get(name, neutral))
        if rubric in entering:
            continue
        for t, value in zip(trajs, filled):
            heads = t.predicted["levels"] if t.predicted and t.predicted.get("used") else None
            t.logged[name] = judge_prompts.weighted(rubric, heads) if heads else value
    return {f"{name}_mean": mean for name, mean in means.items()}
