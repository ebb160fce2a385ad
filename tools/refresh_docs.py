"""`stratagem.py refresh-docs`: every captured example and figure of the README and docs/, rebuilt from the commands
the docs name, so that none can go stale unnoticed (a test checks that every figure in docs/ and every captured block
is listed here). Captured blocks sit between `<!-- refresh-docs NAME -->` and `<!-- /refresh-docs -->`; a figure is
a PNG of docs/. The learning figures need the ablation's nine runs (an hour on 2 cores): pass their folder with
--ablation to plot them again without training."""

from __future__ import annotations

import re
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from machinery import UserError
from machinery.flags import FriendlyParser
from machinery.runfiles import read_jsonl

HERE = Path(__file__).resolve().parent.parent
TINY_RUNS = {  # the three 30-step tiny runs of docs/evaluation.md's `plot` section and docs/watching.md
    "stratagem": [],
    "spiral": ["--mode", "spiral"],
    "no-psi": ["--no-psi"],
}
TINY = ["--tiny", "--steps", "30", "--eval-every", "5", "--report-to", "tensorboard", "--seed", "1"]
# figure -> (the group of runs it is drawn from, the `plot` figure, the runs of the group it draws)
FIGURES = {
    "tiny-a_mod_spread.png": ("tiny", "a_mod_spread", list(TINY_RUNS)),
    "tensorboard-readback.png": ("tiny", None, list(TINY_RUNS)),  # read back from the event files
    "learning-kuhn.png": (
        "ablation",
        "eval_win_rate",
        ["stratagem-s1", "stratagem-s2", "stratagem-s3"],
    ),
    "figure11.png": ("ablation", "phi_psi", ["stratagem-s1", "spiral-shadow-s1", "no-psi-s1"]),
    "figure11-levels.png": ("ablation", "levels", ["stratagem-s1", "spiral-shadow-s1"]),
    "spy-detection.png": ("spyrl", "spy", ["spyrl-s1", "spyrl-s2", "spyrl-s3"]),
    "distill-kappa.png": ("distill", "distill", ["distill-demo"]),
    "distill-judge-requests.png": ("distill", "judge_requests", ["distill-demo"]),
}
# captured block -> (its file, the group of runs, how the text is made from them)
BLOCKS = {
    "main-job": "README.md",
    "eval-table": "docs/evaluation.md",
    "show": "docs/evaluation.md",
}
SPY = ["--tiny", "--steps", "30"]  # docs/spyrl.md's documented run, seeds 1-3


def python(argv: list[str], cwd: Path = HERE) -> str:
    proc = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=cwd, env=None
    )
    if proc.returncode:
        raise UserError(f"{' '.join(argv[:4])} ... failed: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout


def train_group(group: str, folder: Path, ablation: Path | None) -> Path:
    """The runs a group of figures is drawn from, trained into `folder` (the ablation's: given, or trained)."""
    if group == "tiny":
        for name, flags in TINY_RUNS.items():
            python([str(HERE / "stratagem.py"), *TINY, *flags, "--out", str(folder / name)])
    elif group == "ablation":
        if ablation is not None:
            return ablation
        python([str(HERE / "stratagem.py"), "ablation", str(folder)])
    elif group == "spyrl":
        for seed in (1, 2, 3):
            python(
                [
                    str(HERE / "spyrl.py"),
                    *SPY,
                    "--seed",
                    str(seed),
                    "--out",
                    str(folder / f"spyrl-s{seed}"),
                ]
            )
    elif group == "distill":
        distill_demo(folder)
    return folder


def start_judge(flags: list[str], wait: float = 300.0) -> tuple[subprocess.Popen, str]:
    """A `serve-judge FLAGS` of the demo's own and its URL: the server binds a free port (--port 0) and names
    it in its ready line, so the demo talks to the server it started, never to whatever listens on a fixed port
    (which would get the API key and the trajectories). One line if it does not start within `wait` seconds."""
    server = subprocess.Popen(
        [sys.executable, str(HERE / "stratagem.py"), "serve-judge", "--port", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = select.select([server.stdout], [], [], wait)[0]
    port = re.search(r"http://127\.0\.0\.1:(\d+)/v1 ", server.stdout.readline() if ready else "")
    if port is None:
        said = stop_judge(server).strip().splitlines()[-1:] or [f"not ready in {wait:g} s"]
        raise UserError(f"serve-judge {' '.join(flags)} did not start: {said[0]}")
    return server, f"http://127.0.0.1:{port.group(1)}/v1"


def stop_judge(server: subprocess.Popen) -> str:
    """Stop a demo judge (it keeps nothing worth a clean exit); what it wrote to stderr."""
    server.kill()
    return server.communicate()[1] or ""


def distill_demo(folder: Path) -> None:
    """docs/distill.md's demonstration: two teacher servers, 40 steps, then 20 more against the noisy one."""
    servers: list[subprocess.Popen] = []
    try:
        urls = []
        for extra in ([], ["--noise", "1"]):
            server, url = start_judge(["--teacher", "tokens", *extra])
            servers.append(server)
            urls.append(url)
        run = str(folder / "distill-demo")
        judge = ["--judge", "openai", "--judge-model", "tokens-teacher", "--judge-price-in", "2.5"]
        flags = [
            "--tiny",
            "--tiny-init",
            "random",
            "--no-psi",
            "--steps",
            "40",
            *judge,
            "--judge-price-out",
            "10",
        ]
        flags += [
            "--judge-sample-rate",
            "0.5",
            "--distill",
            "--distill-window",
            "60",
            "--distill-audit-rate",
            "0.125",
        ]
        python([str(HERE / "stratagem.py"), *flags, "--judge-base-url", urls[0], "--out", run])
        python(
            [
                str(HERE / "stratagem.py"),
                "--resume",
                "--out",
                run,
                "--steps",
                "60",
                "--judge-base-url",
                urls[1],
            ]
        )
    finally:
        for server in servers:
            stop_judge(server)


def draw(name: str, runs: list[Path], out: Path) -> None:
    """One figure of docs/ from its runs: a `plot` figure, or the TensorBoard read-back."""
    group, figure, _ = FIGURES[name]
    if figure is not None:
        with tempfile.TemporaryDirectory() as tmp:
            python([str(HERE / "stratagem.py"), "plot", *map(str, runs), "--out", tmp])
            shutil.copy(Path(tmp) / f"{figure}.png", out / name)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), dpi=110, layout="constrained")
    for i, run in enumerate(runs):  # one colour a run in every panel, whichever tags it has
        events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
        events.Reload()
        for ax, tag in zip(axes, ("judge/phi_mean", "judge/psi_mean", "adv/a_mod_std")):
            if tag in events.Tags()["scalars"]:
                ax.plot(
                    *zip(*[(e.step, e.value) for e in events.Scalars(tag)]),
                    label=run.name,
                    color=f"C{i}",
                )
            ax.set(title=tag, xlabel="step")
    axes[-1].legend(fontsize=7)
    fig.suptitle("TensorBoard scalars of three tiny runs, read back from their event files")
    fig.savefig(out / name)
    plt.close(fig)


def as_documented(text: str, folder: Path) -> str:
    """A capture as the docs' commands print it: the runs' folder read as `runs/` (the docs name runs/stratagem),
    and no line about a file written only for the capture (`eval --json`'s)."""
    lines = [line for line in text.splitlines() if not line.startswith(f"wrote {folder}")]
    return "\n".join(lines).replace(f"{folder}/", "runs/").rstrip()


def block(name: str, folder: Path) -> str:
    """A captured block's text, from a run made for it (the tiny runs' STRATAGEM run, or the main job)."""
    if name == "main-job":
        printed = python(
            [str(HERE / "stratagem.py"), "--tiny", "--steps", "20"], cwd=folder
        )  # as a user runs it
        lines = printed.splitlines()
        return "\n".join([*lines[:4], "...", *lines[-2:]])
    run = folder / "stratagem"
    if name == "eval-table":
        printed = python(
            [
                str(HERE / "stratagem.py"),
                "eval",
                str(run),
                "--n",
                "10",
                "--json",
                str(folder / "e.json"),
            ]
        )
        return as_documented(
            "\n".join(printed.splitlines()[1:]), folder
        )  # the header names this machine's paths
    text = python(
        [str(HERE / "stratagem.py"), "show", str(run), "--judged", "--step", "30", "--index", "0"]
    )
    return as_documented(text, folder)


def replace_block(path: Path, name: str, text: str) -> None:
    source = path.read_text()
    pattern = re.compile(
        rf"(<!-- refresh-docs {re.escape(name)} -->\n```\n).*?(\n```\n<!-- /refresh-docs -->)",
        re.DOTALL,
    )
    if not pattern.search(source):
        raise UserError(f"{path} has no refresh-docs block {name!r}")
    path.write_text(pattern.sub(lambda m: m.group(1) + text + m.group(2), source))


def main(argv: list[str]) -> int:
    p = FriendlyParser(prog="stratagem.py refresh-docs", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only", default="", help="comma-separated figures and blocks to rebuild (default: all)"
    )
    p.add_argument(
        "--ablation",
        default="",
        help="a finished `ablation` folder to draw the learning figures from",
    )
    p.add_argument(
        "--keep", default="", help="keep the runs in this folder (default: a temporary one)"
    )
    ns = p.parse_args(argv)
    names = ns.only.split(",") if ns.only else [*FIGURES, *BLOCKS]
    if unknown := [n for n in names if n not in FIGURES and n not in BLOCKS]:
        raise UserError(
            f"--only: unknown {', '.join(unknown)} (known: {', '.join([*FIGURES, *BLOCKS])})"
        )
    ablation = Path(ns.ablation) if ns.ablation else None
    if ablation is not None and not read_jsonl(ablation / "stratagem-s1" / "metrics.jsonl"):
        raise UserError(f"{ablation} holds no finished ablation")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(ns.keep or tmp)
        groups: dict[str, Path] = {}
        for name in names:
            group = (
                FIGURES[name][0] if name in FIGURES else "main" if name == "main-job" else "tiny"
            )
            if group not in groups:
                (root / group).mkdir(parents=True, exist_ok=True)
                groups[group] = train_group(group, root / group, ablation)
            if name in FIGURES:
                draw(name, [groups[group] / r for r in FIGURES[name][2]], HERE / "docs")
            else:
                replace_block(HERE / BLOCKS[name], name, block(name, groups[group]))
            print(f"refreshed {name}", flush=True)
    return 0
