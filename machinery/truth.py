"""The judge checked against the game's truth. On Kuhn Poker the exact best reply to the policy's
own moves (games/perfect.py) measures how exploitable its play is, a figure no judge can bend:
each --eval-every evaluation that plays KuhnPoker-v1 with its whole history carries it
(eval.best_response), and each one after step 0 carries the judge's phi and psi means over the
steps since the previous one (eval.judged). History keeps both; `warning` says when, over the last
WINDOW evaluations, the judge's scores rose while the best reply's win rate rose beyond its noise.

What is measured is handed in (the metrics lines), so nothing here imports games/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import judge_prompts

WINDOW = 3  # evaluations the warning compares, its first with its last
# Deciding-round moves an evaluation's best reply must have read to count: below, most information
# sets hold a move or two, which the bootstrap resamples to themselves, so the interval understates
# the noise (docs/evaluation.md: at 10 games its low lay above the true value in 36 of 60).
MIN_MOVES = 40
WARNING = "the judge rewards what the game punishes"


def real(v) -> float | None:
    """A finite number as a float, else None (a bool, a string, a 400-digit int no float holds)."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return None
    try:
        v = float(v)
    except OverflowError:
        return None
    return v if math.isfinite(v) else None


def best_reply(evaluation: dict) -> dict | None:
    """{"win_rate", "ci95", "n"} of an evaluation's best reply (perfect.exploitability's; n: the
    model's moves it read), or None where it holds none of that shape (not measured, or a
    hand-edited line)."""
    best = evaluation.get("best_response")
    if not isinstance(best, dict) or not isinstance(best.get("ci95"), list | tuple):
        return None
    win, ci, n = real(best.get("win_rate")), [real(v) for v in best["ci95"]], real(best.get("n"))
    if win is None or n is None or n < 0 or len(ci) != 2 or None in ci:
        return None
    if not ci[0] <= win <= ci[1]:  # a hand-edited interval that does not hold its rate
        return None
    return {"win_rate": win, "ci95": ci, "n": n}


@dataclass
class History:
    """The judged means since the last evaluation (sums and counts per score, and the steps that had
    one) and every evaluation as a point: {"step", "best" (best_reply's, or None), "judged"}."""

    sums: dict = field(default_factory=dict)  # score -> [sum of the steps' means, steps]
    steps: int = 0
    points: list = field(default_factory=list)

    def add(self, line: dict) -> None:
        """One metrics.jsonl line, as it is written (lifecycle.end_step, first_eval) or read back on
        a resume (replay): a step's judged means ({score}_mean, None where nothing was judged) join
        those since the last evaluation; an evaluation is given their mean as "judged" (each step
        weighs the same, this step's included; none: no key) and becomes a point."""
        if "transitions" in line:  # a step's line (step 0's evaluation has none)
            means = {s: real(line.get(f"{s}_mean")) for s in judge_prompts.SCORES}
            for s, v in means.items():
                if v is not None:
                    cell = self.sums.setdefault(s, [0.0, 0])
                    cell[0], cell[1] = cell[0] + v, cell[1] + 1
            self.steps += any(v is not None for v in means.values())
        e = line.get("eval")
        if not isinstance(e, dict):
            return
        judged = {f"{s}_mean": total / n for s, (total, n) in self.sums.items()}
        if judged:
            e["judged"] = judged | {"steps": self.steps}
        scores = {s: judged.get(f"{s}_mean") for s in judge_prompts.SCORES}
        point = {"step": line.get("step"), "best": best_reply(e), "judged": scores}
        self.points.append(point)
        self.sums, self.steps = {}, 0

    @classmethod
    def replay(cls, lines) -> History:
        """The history of a run's metrics.jsonl lines (a resume: those up to its checkpoint)."""
        history = cls()
        for line in lines:
            history.add(line)
        return history


def measured(point: dict) -> bool:
    """Whether an evaluation measured both: a best reply to MIN_MOVES moves or more, a judged
    mean."""
    best, judged = point["best"], point["judged"].values()
    return bool(best) and best["n"] >= MIN_MOVES and any(v is not None for v in judged)


def warning(points: list[dict], window: int = WINDOW) -> str | None:
    """The warning where the judge rewards what the game punishes, else None. Over the last `window`
    evaluations that measured both, the first against the last: a judged mean (phi or psi) rose, and
    the best reply's win rate rose beyond the noise of both, the last interval wholly above the
    first (docs/evaluation.md says why this rule and what it misses)."""
    usable = [p for p in points if measured(p)]
    if len(usable) < max(2, window):
        return None
    first, last = usable[-window], usable[-1]
    rose = [
        s
        for s, v in last["judged"].items()
        if v is not None and first["judged"].get(s) is not None and v > first["judged"][s]
    ]
    was, now = first["best"], last["best"]
    if not rose or not now["ci95"][0] > was["ci95"][1]:
        return None
    said = ", ".join(f"{s} {first['judged'][s]:.3f} -> {last['judged'][s]:.3f}" for s in rose)
    then, later = (
        f"{b['win_rate']:.3f} [{b['ci95'][0]:.3f}, {b['ci95'][1]:.3f}]" for b in (was, now)
    )
    return (
        f"{WARNING}: over the evaluations of steps {first['step']} to {last['step']} the judged "
        f"means rose ({said}) while the best reply to the policy's KuhnPoker-v1 play went from "
        f"winning {then} to {later}, the intervals apart "
        "(docs/evaluation.md#the-judge-against-the-games-truth)"
    )
