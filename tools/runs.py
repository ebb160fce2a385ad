"""Reading a run directory: its files, its trajectories, its metrics and a label for it
(shared by plot, show, agree and bench)."""

from __future__ import annotations

import sys
from pathlib import Path

from machinery import UserError
from machinery.runfiles import read_config, read_jsonl
from stratagem import Trajectory, Turn


def run_file(run: Path, name: str) -> Path:
    path = run / name
    if not path.exists():
        raise UserError(f"{path} not found (is {run} a stratagem run directory?)")
    return path


def read_trajectories(run: Path) -> list[Trajectory]:
    """The player-trajectories with turns (what the judge can score; a seat that never moved has nothing). A line
    that holds no whole trajectory (a hand-edited or foreign file: no game, no turns, ...) is skipped and counted
    in one warning; its scores, whole or not, are not read."""
    path = run_file(run, "trajectories.jsonl")
    out, skipped = [], 0
    for r in read_jsonl(path):
        try:
            turns = [
                Turn(t["observation"], t["response"], t["action"], [], [], t.get("prompt", "")) for t in r["turns"]
            ]
            trajectory = Trajectory(r["game"], r["role"], turns, r["reward"])
        except (KeyError, TypeError, AttributeError):
            skipped += 1
            continue
        if turns:
            out.append(trajectory)
    if skipped:
        print(f"stratagem: warning: skipped {skipped} line(s) of {path} that hold no whole trajectory", file=sys.stderr)
    return out


def run_config(run: Path) -> dict:
    return read_config(run) if (run / "config.json").exists() else {}


def run_mode(run: Path) -> str:
    return run_config(run).get("mode", "?")


def run_label(run: Path) -> str:
    """The run's name and what sets it apart: beta (or w/o psi) for STRATAGEM, the task for SpyRL."""
    config = run_config(run)
    mode = config.get("mode", "?")
    detail = {
        "spiral": "",
        "spyrl": f" {config.get('spy_task')}",
        "stratagem": " w/o psi" if config.get("no_psi") else f" beta={config.get('beta')}",
    }.get(mode, "")
    return f"{run.name} ({mode}{detail})"


def read_metrics(run: Path) -> list[dict]:
    return read_jsonl(run_file(run, "metrics.jsonl"))
