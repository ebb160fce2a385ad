"""`stratagem.py plot`: PNG figures of one or more runs over steps, overlaid."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import judge_prompts
from machinery import UserError
from machinery.flags import FriendlyParser
from machinery.matches import CEILINGS
from machinery.runfiles import check_writable_dir, open_folder, refuse_link, write_in
from tools.runs import number as runs_number
from tools.runs import read_metrics, run_config, run_label, run_mode

TRAINING_GAMES = (
    "TicTacToe-v0",
    "KuhnPoker-v1",
    "SimpleNegotiation-v1",
)  # SPIRAL's, the evaluation's series


def eval_cell(m: dict, game: str, key: str) -> float | None:
    """One game's figure in a line's --eval-every result (both seats): a rate (win, invalid) or turns_mean. A win rate
    of the only game evaluated is the "all games" line already: None."""
    games = m.get("eval", {}).get("games", {})
    cell = None if key == "win" and len(games) == 1 else games.get(game, {}).get("both")
    return (
        None
        if cell is None or key not in cell
        else cell[key]
        if key == "turns_mean"
        else cell[key]["rate"]
    )


PLOTS = {  # file name -> (title, y label, [(series label, value of one metrics line or None: not there)])
    "eval_win_rate": (
        "Win rate against a random legal player (--eval-every; step 0: before any update)",
        "win rate",
        [("all games", lambda m: m.get("eval", {}).get("win_rate"))]
        + [(game, lambda m, g=game: eval_cell(m, g, "win")) for game in TRAINING_GAMES],
    ),
    "exploitability": (
        "Kuhn Poker: the exact best response's win rate against the policy (--eval-every)",
        "win rate of the best reply",
        [
            ("best response", lambda m: m["eval"]["best_response"]["win_rate"]),
            ("its 95 % interval, low", lambda m: m["eval"]["best_response"]["ci95"][0]),
            ("its 95 % interval, high", lambda m: m["eval"]["best_response"]["ci95"][1]),
        ],
    ),
    "judge_vs_truth": (
        "The judge against the game's truth: Kuhn Poker's best reply (left), the judged means (right)",
        "win rate of the best reply",
        [("best reply", lambda m: reply(m["eval"]["best_response"]))]
        + [
            (f"judged {name} mean", lambda m, n=name: m["eval"]["judged"][f"{n}_mean"])
            for name in judge_prompts.SCORES
        ],  # drawn by draw_truth: the judged means on an axis of their own
    ),
    "eval_invalid_rate": (
        "Evaluation games the model lost by an invalid move (--eval-every)",
        "share of games",
        [(game, lambda m, g=game: eval_cell(m, g, "invalid")) for game in TRAINING_GAMES],
    ),
    "eval_game_length": (
        "Mean evaluation game length (--eval-every)",
        "moves, both players",
        [(game, lambda m, g=game: eval_cell(m, g, "turns_mean")) for game in TRAINING_GAMES],
    ),
    "invalid_rate": (
        "Invalid-action rate in self-play",
        "lost by an invalid move, per seat that moved",
        [("", lambda m: invalid_rate(m))],
    ),
    "coverage": (
        "Decision spots in self-play: each one's share of its game's turns, its moves' entropy",
        "",
        [],  # drawn by draw_coverage: its series are the spots the lines name
    ),
    "response_length": (
        "Mean response length",
        "tokens",
        [("", lambda m: m.get("response_tokens_mean"))],
    ),
    "phi_psi": (
        "Judge scores, batch means of the judged trajectories (the paper's Figure 11)",
        "value",
        [(name, lambda m, n=name: m.get(f"{n}_mean")) for name in judge_prompts.SCORES],
    ),
    "levels": (
        "Judge levels per rubric dimension, batch means of the judged (beside Figure 11)",
        "level",
        [
            (key, lambda m, k=key: (m.get("levels_mean") or {}).get(k))
            for key in judge_prompts.ALL_KEYS
        ],
    ),
    "a_mod_spread": (
        "Advantage spread",
        "std over trajectories",
        [("A_mod", lambda m: m.get("a_mod_std")), ("A_game", lambda m: m.get("a_game_std"))],
    ),
    "loss": ("REINFORCE loss", "loss", [("", lambda m: m.get("loss"))]),
    "beta": (
        "beta, and the evolution term's share of A_mod (judged trajectories)",
        "value",
        [
            ("beta", lambda m: (m.get("beta") or {}).get("value")),
            ("share", lambda m: (m.get("beta") or {}).get("share")),
            ("target (--beta-share)", lambda m: (m.get("beta") or {}).get("target")),
        ],
    ),
    "distill": (
        "Distilled heads against the judge on held-out verdicts (--distill)",
        "kappa",
        [
            ("lowest kappa of a used dimension", lambda m: min_kappa(m.get("distill"))),
            ("the bar (--distill-kappa)", lambda m: m.get("distill", {}).get("bar")),
            (
                "trusted (1 = yes)",
                lambda m: (
                    float(m["distill"]["trusted"]) if "trusted" in m.get("distill", {}) else None
                ),
            ),
        ],
    ),
    "judge_requests": (
        "Judge requests per step",
        "per step",
        [
            ("judge requests", lambda m: m.get("judge_requests")),
            (
                "scored by the heads (--distill)",
                lambda m: m.get("distill", {}).get("scored", {}).get("heads"),
            ),
        ],
    ),
    "spy": (
        "SpyRL: who is the spy (spyrl.py)",
        "rate",
        [
            (label, lambda m, key=key: m.get("spy", {}).get(key))
            for label, key in (
                ("detection accuracy", "detection_accuracy"),
                ("spy caught", "caught_rate"),
                ("invalid votes", "invalid_vote_rate"),
                ("ROUGE-L", "rouge_l"),
            )
        ],
    ),
}


NEEDS = {
    "eval_win_rate": " (train with --eval-every N)",
    "eval_invalid_rate": " (train with --eval-every N)",
    "exploitability": " (--eval-every with KuhnPoker-v1 shown whole)",
    "judge_vs_truth": " (--eval-every with KuhnPoker-v1 shown whole, and a judge)",
    "eval_game_length": " (train with --eval-every N)",
    "distill": " (--distill)",
    "judge_requests": " (a judge)",
    "beta": " (a judge)",
    "spy": " (a spyrl.py run)",
    "coverage": " (self-play of a game whose spots are tracked)",
}  # what a run needs for the figures that only some runs have data for


JUDGED = ("judge_requests",)  # figures drawn only for runs that have a judge (--mode stratagem)
PANELS = (
    "levels",
)  # figures drawn as one panel per series (six dimensions on one axis are unreadable)


def invalid_rate(m: dict) -> float | None:
    """The share of the step's seats that moved and lost by an invalid move (a SpyRL seat: voted invalidly). A seat
    that never moved (its opponent lost on the first move) made no move, valid or not: it is not counted. None for
    a line without outcome counts."""
    if not isinstance(m.get("games"), dict):
        return None
    seats = sum(c[p][k] for c in m["games"].values() for p in c for k in ("win", "draw", "loss"))
    return sum(c[p]["invalid"] for c in m["games"].values() for p in c) / max(
        1, seats - m.get("idle_seats", 0)
    )


def reply(best: dict) -> float | None:
    """The best reply's win rate, where it replied to a move of the model (n 0: none was read, and
    every spot counts as uniform; machinery/truth.py's warning skips it too)."""
    return best["win_rate"] if best["n"] else None


def min_kappa(report: dict | None) -> float | None:
    """The lowest kappa over the dimensions the run uses (None: not measured yet, or nothing to measure)."""
    report = report or {}
    values = [
        v
        for k, v in report.get("kappa", {}).items()
        if k in report.get("used", ()) and v is not None
    ]
    return min(values, default=None)


def finite(v) -> float | None:
    """A value as a float, where it is a finite number (a 400-digit integer is none: no float holds it)."""
    if not runs_number(v):
        return None
    try:
        v = float(v)
    except OverflowError:
        return None
    return v if math.isfinite(v) else None


def read(value, m: dict) -> float | None:
    """A series' value of one metrics line: a finite number, or None where the line holds none of the right shape
    (a hand-edited or foreign line: "eval": 5, a count of 400 digits) - such a value is skipped, never a crash."""
    try:
        return finite(value(m))
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, OverflowError):
        return None


def eval_band(m: dict) -> tuple[float, float] | None:
    """The evaluation's 95 % interval, where it is two finite numbers, else None."""
    try:
        low, high = (finite(v) for v in m["eval"]["win_ci95"])
    except (KeyError, TypeError, ValueError):
        return None
    return None if low is None or high is None else (low, high)


SERIES_STYLES = [
    ("-", "o"),
    ("--", "s"),
    (":", "^"),
    ("-.", "D"),
    ((0, (5, 1, 1, 1)), "v"),
    ((0, (1, 3)), "P"),
]  # line style and marker of a figure's 1st, 2nd, ... series


def draw_line(ax, points: list[tuple], where: tuple[int, int, int, int], **kwargs) -> None:
    """One series of one run: `where` is (run: its colour, series: its line style and marker, draw order: where its
    hollow markers start, markers wanted along the line)."""
    run, series, order, marks = where
    style, marker = SERIES_STYLES[series % len(SERIES_STYLES)]
    every = max(1, len(points) // marks)
    ax.plot(
        *zip(*points),
        color=f"C{run % 10}",
        linestyle=style,
        marker=marker,
        fillstyle="none",
        markevery=(order % every, every),
        **kwargs,
    )


def draw_plot(plt, name: str, runs: list[tuple[Path, list[dict]]]):
    """One figure of PLOTS, or None when no run has a value for it: a colour per run, a line style and marker
    per series. Lines that coincide stay visible: each line drawn is thinner and on top of the one before
    (nested stripes), and hollow markers of different shapes sit at shifted steps. The legend sits right of
    the axes, off the data."""
    import matplotlib.ticker

    if name in PANELS:
        return draw_panels(plt, name, runs)
    if name == "coverage":
        return draw_coverage(plt, runs)
    if name == "judge_vs_truth":
        return draw_truth(plt, runs)
    title, ylabel, series = PLOTS[name]
    fig, ax = plt.subplots(figsize=(8.4, 3.6), dpi=110, layout="constrained")
    n = len(runs) * len(series)
    drawn = 0
    for r, (run, metrics) in enumerate(runs):
        judged = run_mode(run) == "stratagem" or run_config(run).get("judge_shadow")
        if name in JUDGED and not judged:  # no judge: its zeros would read as "asked nothing"
            continue
        for s, (label, value) in enumerate(series):
            k = r * len(series) + s  # draw order
            points = [(m["step"], v) for m in metrics if (v := read(value, m)) is not None]
            if points:
                draw_line(
                    ax,
                    points,
                    (r, s, k, 12),
                    markersize=4 + 3 * (n - 1 - k) / max(1, n - 1),
                    linewidth=1.2 + 2.4 * (n - 1 - k) / max(1, n - 1),
                    zorder=2 + k,
                    label=" ".join(x for x in (run_label(run), label) if x),
                )
                drawn += 1
                if (
                    name == "eval_win_rate" and s == 0
                ):  # the 95 % Wilson interval of every point, shaded
                    band = [(m["step"], *ci) for m in metrics if (ci := eval_band(m)) is not None]
                    if band:
                        ax.fill_between(
                            *zip(*band), color=f"C{r % 10}", alpha=0.15, linewidth=0, zorder=1
                        )
    if not drawn:
        plt.close(fig)
        return None
    games = {
        g
        for _, ms in runs
        for m in ms
        if isinstance(m.get("eval"), dict)
        for g in m["eval"].get("games", {})
    }
    if name == "eval_win_rate" and len(games) == 1 and (ceiling := CEILINGS.get(next(iter(games)))):
        label = f"ceiling: the best reply to the random player ({ceiling:.4f})"
        ax.axhline(ceiling, color="0.35", linestyle=(0, (4, 3)), linewidth=1, zorder=1, label=label)
    if name == "exploitability":  # the floor: a policy no reply can beat more than half the time
        label = "the game's value: unexploitable (0.5)"
        ax.axhline(0.5, color="0.35", linestyle=(0, (4, 3)), linewidth=1, zorder=1, label=label)
    players = {run_config(run).get("spy_players") for run, _ in runs} - {None}
    if (
        name == "spy" and len(players) == 1 and runs_number(n := players.pop()) and n > 1
    ):  # a vote drawn at random names the spy 1/(n-1)
        label = f"a random vote's detection accuracy (1/{n - 1})"
        ax.axhline(
            1 / (n - 1), color="0.35", linestyle=(0, (4, 3)), linewidth=1, zorder=1, label=label
        )
    ax.set(xlabel="step", ylabel=ylabel)
    fig.suptitle(
        title
    )  # over the whole figure, legend included: a long legend cannot push it off the left edge
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if name in ("eval_win_rate", "eval_invalid_rate", "invalid_rate", "spy", "exploitability"):
        ax.set_ylim(-0.02, 1.02)
    if name == "distill":
        ax.set_ylim(-0.22, 1.02)
    ax.legend(
        fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, frameon=False
    )
    return fig


def draw_truth(plt, runs: list[tuple[Path, list[dict]]]):
    """The "judge_vs_truth" figure, or None where no run has both a best reply and a judged mean: the
    best reply's win rate on Kuhn Poker with its 95 % interval shaded (0.5: unexploitable) on the
    left axis, the judge's means since the previous evaluation on a twin axis at the right, each on
    its own scale (phi in [0, 1], psi in [-1, 1]: rescaled, a rise of either would read as the
    other's). A colour per run, a line style and marker per series."""
    import matplotlib.ticker

    title, ylabel, series = PLOTS["judge_vs_truth"]
    found = [
        [[(m["step"], v) for m in ms if (v := read(value, m)) is not None] for _, value in series]
        for _, ms in runs
    ]
    if not any(lines[0] for lines in found) or not any(any(lines[1:]) for lines in found):
        return None
    fig, ax = plt.subplots(figsize=(8.4, 4.4), dpi=110, layout="constrained")
    judged = ax.twinx()
    for r, ((run, ms), lines) in enumerate(zip(runs, found)):
        for s, ((label, _), points) in enumerate(zip(series, lines)):
            if points:
                k = r * len(series) + s  # draw order
                name = " ".join(x for x in (run_label(run), label) if x)
                axis = ax if s == 0 else judged
                draw_line(axis, points, (r, s, k, 12), markersize=4, linewidth=1.4, label=name)
        band = [
            (m["step"], low, high)
            for m in ms
            if (low := read(lambda m: m["eval"]["best_response"]["ci95"][0], m)) is not None
            and (high := read(lambda m: m["eval"]["best_response"]["ci95"][1], m)) is not None
        ]
        if band:
            ax.fill_between(*zip(*band), color=f"C{r % 10}", alpha=0.15, linewidth=0, zorder=1)
    label = "the game's value: unexploitable (0.5)"
    ax.axhline(0.5, color="0.35", linestyle=(0, (4, 3)), linewidth=1, zorder=1, label=label)
    ax.set(xlabel="step", ylabel=ylabel, ylim=(0.48, 1.02))
    judged.set(ylabel="judged mean, steps since the last evaluation", ylim=(-1.05, 1.05))
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    handles = [h for a in (ax, judged) for h in zip(*a.get_legend_handles_labels())]
    fig.legend(*zip(*handles), fontsize=7, loc="outside lower center", ncols=3, frameon=False)
    fig.suptitle(title)
    return fig


def draw_panels(plt, name: str, runs: list[tuple[Path, list[dict]]]):
    """One figure of PLOTS as small multiples, or None when no run has a value for it: a panel per series (a
    rubric dimension, titled with its key), a colour and marker per run, one shared y range and legend."""
    import matplotlib.ticker

    title, ylabel, series = PLOTS[name]
    found = [
        [[(m["step"], v) for m in ms if (v := read(value, m)) is not None] for _, ms in runs]
        for _, value in series
    ]
    shown = [(label, lines) for (label, _), lines in zip(series, found) if any(lines)]
    if not shown:
        return None
    cols = min(3, len(shown))
    rows = -(-len(shown) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols + 1.6, 2.4 * rows), dpi=110, layout="constrained"
    )
    axes = list(getattr(axes, "flat", [axes]))
    for ax, (label, lines) in zip(axes, shown):
        for r, points in enumerate(lines):
            if points:
                draw_line(
                    ax,
                    points,
                    (r, r, r, 8),
                    markersize=4,
                    linewidth=1.4,
                    label=run_label(runs[r][0]),
                )
        ax.set_title(label, fontsize=9)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # steps, not 1.5
        ax.set_ylim(-1.05, 1.05)
        ax.axhline(0, color="0.8", linewidth=0.8, zorder=0)
    for ax in axes[len(shown) :]:
        ax.set_visible(False)
    for ax in axes[(rows - 1) * cols :]:
        ax.set_xlabel("step")
    for ax in axes[::cols]:
        ax.set_ylabel(ylabel)
    legend = {}  # label -> handle, over every panel: a run may lack the first panel's dimension
    for ax in axes:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(
        legend.values(),
        legend,
        fontsize=7,
        loc="outside lower center",
        ncols=min(3, len(legend)),
        frameon=False,
    )
    fig.suptitle(title)
    return fig


def coverage_series(runs: list[tuple[Path, list[dict]]]) -> dict:
    """{game: {spot: {(run index, "share" or "entropy"): [(step, value)]}}} of the lines' "coverage"
    (machinery/coverage.of_step); a game or spot of the wrong shape is skipped."""
    found: dict = {}
    for r, (_, metrics) in enumerate(runs):
        for m in metrics:
            coverage = m.get("coverage")
            for game, spots in coverage.items() if isinstance(coverage, dict) else ():
                for spot in spots if isinstance(spots, dict) else ():
                    for key in ("share", "entropy"):
                        v = read(lambda m, g=game, s=spot, k=key: m["coverage"][g][s][k], m)
                        if v is not None:
                            cell = found.setdefault(game, {}).setdefault(spot, {})
                            cell.setdefault((r, key), []).append((m["step"], v))
    return found


def draw_coverage(plt, runs: list[tuple[Path, list[dict]]], most: int = 20):
    """The "coverage" figure, or None when no run has a value for it: a row per game (share |
    entropy), a colour per spot (the first `most` by name), a line style and marker per run."""
    import matplotlib.ticker

    found = coverage_series(runs)
    if not found:
        return None
    games = sorted(found)[:8]
    fig, axes = plt.subplots(
        len(games), 2, figsize=(11, 2.6 * len(games)), dpi=110, layout="constrained", squeeze=False
    )
    text = lambda x: str(x)[:40].replace("$", r"\$")  # noqa: E731 - a file's words, never mathtext
    for (share_ax, entropy_ax), game in zip(axes, games):
        for s, spot in enumerate(sorted(found[game])[:most]):
            labelled = set()  # an axis' legend names a spot once: its colour, whatever the run
            for (r, key), points in sorted(found[game][spot].items()):
                ax = share_ax if key == "share" else entropy_ax
                style, marker = SERIES_STYLES[r % len(SERIES_STYLES)]
                label = "_" if ax in labelled else text(spot)  # "_...": left out of the legend
                labelled.add(ax)
                ax.plot(
                    *zip(*points),
                    color=plt.get_cmap("tab20")(s % 20),
                    linestyle=style,
                    marker=marker,
                    markersize=3,
                    fillstyle="none",
                    linewidth=1.2,
                    label=label,
                )
        share_ax.set(title=f"{text(game)}: share of its turns", ylabel="share", ylim=(-0.02, 1.02))
        entropy_ax.set(title=f"{text(game)}: entropy of the moves", ylabel="bits")
        for r, (run, _) in enumerate(runs if len(runs) > 1 else []):  # the runs' styles
            style, marker = SERIES_STYLES[r % len(SERIES_STYLES)]
            kwargs = dict(linestyle=style, marker=marker, markersize=3, fillstyle="none")
            entropy_ax.plot([], [], color="0.4", label=run_label(run), **kwargs)
        entropy_ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    for ax in axes.flat:
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(PLOTS["coverage"][0])
    return fig


def main(argv: list[str]) -> int:
    p = FriendlyParser(
        prog="stratagem.py plot",
        description=(
            "Draw PNG figures of one or more runs over steps (several runs are overlaid, e.g. stratagem vs "
            "spiral vs --no-psi): win rate against a random player (with its invalid-move rate and game length), "
            "invalid-action rate in self-play, its decision spots' coverage, response length, "
            "Kuhn Poker's best reply beside the judged means, "
            "phi and psi, A_mod spread, loss, the distilled heads' agreement and the judge's requests, and SpyRL's "
            "detection figures. Needs matplotlib."
        ),
    )
    p.add_argument("runs", nargs="+", help="run directories")
    p.add_argument(
        "--out",
        default="",
        help="folder for the PNGs (default: <first run>/plots; files are replaced)",
    )
    ns = p.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        raise UserError("plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a line whose step no float holds (400 digits) has no place on an axis: skipped with the rest of its values
    runs = [
        (Path(r), [m for m in read_metrics(Path(r)) if finite(m["step"]) is not None])
        for r in ns.runs
    ]
    out = Path(ns.out) if ns.out else runs[0][0] / "plots"
    check_writable_dir(out, "--out")
    if not ns.out:  # in the run's folder: never through a link planted there
        refuse_link(out)
    out.mkdir(parents=True, exist_ok=True)
    folder = open_folder(
        out, follow=bool(ns.out)
    )  # written there, whatever is linked at `out` later
    written, empty = [], []
    try:
        for name in PLOTS:
            fig = draw_plot(plt, name, runs)
            if fig is None:
                empty.append(f"{name}.png{NEEDS.get(name, '')}")
                continue
            png = io.BytesIO()
            fig.savefig(png, format="png")
            plt.close(fig)
            write_in(folder, out / f"{name}.png", png.getvalue())  # replaced, never written through
            written.append(f"{name}.png")
    finally:
        os.close(folder)
    print(
        f"wrote {len(written)} figures to {out}: "
        + ", ".join(written)
        + (f"; no data for {', '.join(empty)}" if empty else "")
    )
    return 0
