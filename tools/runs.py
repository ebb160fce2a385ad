"""Reading a run directory: its files, its trajectories, its metrics and a label for it
(shared by plot, show, agree and bench)."""

from __future__ import annotations

from pathlib import Path

from machinery import UserError, saved_config
from machinery.runfiles import read_jsonl, warn
from stratagem import Args, Trajectory, Turn


def run_file(run: Path, name: str) -> Path:
    path = run / name
    if not path.exists():
        raise UserError(f"{path} not found (is {run} a stratagem run directory?)")
    return path


def keep(rows: list[dict], path: Path, ok, what: str) -> list[dict]:
    """The lines of a run file that `ok` accepts (a line it raises on is of the wrong shape too); the others are
    skipped, counted in one warning that says what they lack: a hand-edited or foreign file ends no command."""
    kept = []
    for r in rows:
        try:
            good = bool(ok(r))
        except (KeyError, TypeError, AttributeError, IndexError, ValueError):
            good = False
        kept += [r] if good else []
    if len(kept) < len(rows):
        warn(f"skipped {len(rows) - len(kept)} line(s) of {path} that hold no {what}")
    return kept


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def evaluation_ok(e) -> bool:
    """An --eval-every result with what a table reads of it: n games and a win rate."""
    return isinstance(e.get("n"), int) and not isinstance(e["n"], bool) and number(e["win_rate"])


def read_trajectories(run: Path) -> list[Trajectory]:
    """The player-trajectories with turns (what the judge can score; a seat that never moved has nothing). A line
    that holds no whole trajectory (a hand-edited or foreign file: no game, no turns, ...) is skipped and counted
    in one warning; its scores, whole or not, are not read."""
    path = run_file(run, "trajectories.jsonl")
    out, skipped = [], 0
    for r in read_jsonl(path):
        try:
            turns = [
                Turn(t["observation"], t["response"], t["action"], [], [], t.get("prompt", ""))
                for t in r["turns"]
            ]
            trajectory = Trajectory(r["game"], r["role"], turns, r["reward"])
            texts = [x for t in turns for x in (t.observation, t.response, t.action, t.prompt)]
            if not (
                all(isinstance(x, str) for x in [*texts, r["game"]]) and isinstance(r["role"], int)
            ):
                raise TypeError("not a trajectory's text")
        except (KeyError, TypeError, AttributeError):
            skipped += 1
            continue
        if turns:
            out.append(trajectory)
    if skipped:
        warn(f"skipped {skipped} line(s) of {path} that hold no whole trajectory")
    return out


def run_config(run: Path) -> dict:
    """The run's config.json ({} where it has none), each value checked as a resume checks it."""
    return saved_config.run_config(run, Args)


def run_mode(run: Path) -> str:
    return run_config(run).get("mode", "?")


def run_label(run: Path) -> str:
    """The run's name and what sets it apart: beta (or w/o psi) for STRATAGEM, the task for SpyRL."""
    config = run_config(run)
    mode = config.get("mode", "?")
    detail = {
        "spiral": " judge-shadowed" if config.get("judge_shadow") else "",
        "spyrl": f" {config.get('spy_task')}",
        "stratagem": (" w/o psi" if config.get("no_psi") else f" beta={config.get('beta')}")
        + (" psi centred" if config.get("centre_psi") else ""),
    }.get(mode, "")
    return f"{run.name} ({mode}{detail})"


def read_metrics(run: Path) -> list[dict]:
    """metrics.jsonl's lines that have a step; each figure reads its own values from them as it can (plot.value)."""
    path = run_file(run, "metrics.jsonl")
    return keep(read_jsonl(path), path, lambda m: isinstance(m["step"], int), "step")
