"""Tests of the commands in tools/, run through stratagem.py: eval, plot, show, agree, serve-judge, bench and
random-model, and the commands a finished run suggests."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading

import pytest
import torch

import spyrl
import stratagem as S
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    SMALL,
    check_run,
    completion,
    error_of,
    free_port,
    judge_server_fixture,
    no_process_left_behind,
    not_for_the_vllm_tests,
    one_step_run_fixture,
    only_the_vllm_tests,
    python,
    read_jsonl,
    run,
    secret_key_fixture,
    spawn,
    tiny_fixture,
)
from tools import plot, serve_judge, show
from tools import runs as tools_runs


# ---- eval: the model against a random player or a served model
def test_eval_against_random_and_against_a_served_model(
    tiny, tmp_path, capsys, judge_server, secret_key
):
    out = tmp_path / "eval.json"
    assert (
        run(
            [
                "eval",
                str(tiny),
                "--games",
                "TicTacToe-v0,Nim-v0,PigDice-v0",
                "--n",
                "2",
                "--max-new-tokens",
                "8",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["opponent"] == "random" and len(result["games"]) == 6
    assert set(result["summary"]["games"]) == {"TicTacToe-v0", "Nim-v0", "PigDice-v0"}
    printed = capsys.readouterr().out
    assert (
        "model vs random, trained games (TicTacToe-v0): 2 games, win rate" in printed
        and "invalid" in printed
    )
    assert "model vs random, unseen games (Nim-v0, PigDice-v0): 4 games, win rate" in printed
    assert (
        "trained on TicTacToe-v0; unseen: Nim-v0, PigDice-v0" in printed
    )  # the header says which is which
    assert result["summary"]["trained"]["n"] == 2 and result["summary"]["unseen"]["n"] == 4
    assert "already exists" in error_of(capsys, ["eval", str(tiny), "--json", str(out)])
    judge_server.behaviour = lambda body: (200, completion("I take the centre. \\boxed{4}"))
    out2 = tmp_path / "eval2.json"
    assert (
        run(
            [
                "eval",
                str(tiny),
                "--games",
                "TicTacToe-v0",
                "--n",
                "2",
                "--max-new-tokens",
                "8",
                "--greedy",
                "--opponent",
                f"openai:judge-test@{judge_server.url}",
                "--json",
                str(out2),
            ]
        )
        == 0
    )
    assert json.loads(out2.read_text())["opponent"] == "openai:judge-test" and judge_server.requests


def test_eval_refuses_games_that_need_the_network(tiny, tmp_path, capsys):
    err = error_of(
        capsys, ["eval", str(tiny), "--games", "WordChains-v0", "--json", str(tmp_path / "e.json")]
    )
    assert "needs data it downloads from the network" in err and not (tmp_path / "e.json").exists()


# ---- The commands a finished run suggests, as printed
def test_closing_line_commands_run_on_the_finished_run(tmp_path, capsys):
    """The closing line's next commands work as printed (a path with a space is quoted for the shell)."""
    out = tmp_path / "my run"
    assert run(SMALL + ["--steps", "1", "--out", str(out), "--judge-sample-rate", "1"]) == 0
    closing = capsys.readouterr().out.splitlines()[-1]
    commands = closing.split("Next: ", 1)[1].split("  |  ")
    assert [c.split()[2] for c in commands] == ["plot", "show", "eval"]
    for command in commands:
        argv = shlex.split(command)[2:]
        if argv[0] == "eval":
            argv += [
                "--n",
                "2",
                "--games",
                "TicTacToe-v0",
                "--max-new-tokens",
                "8",
                "--json",
                str(tmp_path / "e.json"),
            ]
        assert S.main(argv) == 0, command
    assert (out / "plots" / "loss.png").exists() and json.loads((tmp_path / "e.json").read_text())[
        "summary"
    ]["n"] == 2


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory):
    """A finished tiny run of each script, as a user starts it from the repository's root, and what it printed."""
    not_for_the_vllm_tests()
    tmp = tmp_path_factory.mktemp("finished")
    runs = {}
    for script in ("stratagem.py", "spyrl.py"):
        out = tmp / script.removesuffix(".py")
        proc = python([script] + SMALL + ["--steps", "1", "--out", str(out)], HERE)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[script] = (out, proc.stdout.splitlines())
    return runs


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory):
    """A finished tiny run of each script, trained in this process (the fast tier's; finished_runs starts them as a
    user does, for the tests of what they print)."""
    not_for_the_vllm_tests()
    tmp = tmp_path_factory.mktemp("trained")
    runs = {}
    for script, main in (("stratagem.py", S.main), ("spyrl.py", spyrl.main)):
        out = tmp / script.removesuffix(".py")
        assert main(SMALL + ["--steps", "1", "--out", str(out)]) == 0
        runs[script] = out
    return runs


def suggested(lines: list[str]) -> list[list[str]]:
    """The commands a closing line suggests, as argv lists."""
    assert lines[-1].startswith("done: 1 step in ")  # one step, not "1 steps"
    return [shlex.split(c) for c in lines[-1].split("Next: ", 1)[1].split("  |  ")]


@pytest.mark.parametrize("script", ["stratagem.py", "spyrl.py"])
@pytest.mark.slow
def test_closing_line_commands_work_as_printed_from_the_repository_root_twice(
    finished_runs, script
):
    """Run as printed, from the repository's root, the last one twice: plot, show and eval (a second eval of the same
    run must not collide with the first's output; eval plays with the run's own generation settings, SMALL's 16 new
    tokens); for a SpyRL run, plot, show and spyrl.py to train it further (no eval: it plays two-player games)."""
    out, lines = finished_runs[script]
    before = set(os.listdir(HERE))
    commands = suggested(lines)
    last = ["stratagem.py", "eval"] if script == "stratagem.py" else ["spyrl.py", "--resume"]
    assert [c[1:3] for c in commands] == [["stratagem.py", "plot"], ["stratagem.py", "show"], last]
    for command in commands + [commands[-1]]:
        proc = python(command[1:], HERE)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (
            command,
            proc.stderr[-2000:],
        )
    assert (out / "plots" / "loss.png").exists()
    if script == "stratagem.py":
        first, second = (
            json.loads((out / name).read_text()) for name in ("eval-1.json", "eval-1-2.json")
        )
        assert (
            first["max_new_tokens"] == second["max_new_tokens"] == 16
            and first["summary"]["n"] == 3 * 20  # the three games it trained on
        )
    else:  # trained to twice its steps, then said it was finished
        assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [
            1,
            2,
        ] and "already finished" in proc.stdout
    assert set(os.listdir(HERE)) == before  # every output went into the run's own folder


def test_eval_takes_the_runs_settings_says_so_and_a_given_flag_wins(trained_runs, tmp_path, capsys):
    out = trained_runs["stratagem.py"]
    capsys.readouterr()
    argv = ["eval", str(out / "checkpoints" / "step-000001"), "--n", "1", "--games", "TicTacToe-v0"]
    assert run(argv + ["--max-new-tokens", "4", "--json", str(tmp_path / "e.json")]) == 0
    said = capsys.readouterr().out.splitlines()[0]
    assert said.startswith(
        f"eval: as {out} was trained (its config.json; a flag given wins): --temperature 1.0"
    )
    assert (
        "--max-new-tokens" not in said
        and json.loads((tmp_path / "e.json").read_text())["max_new_tokens"] == 4
    )
    assert "e.json already exists; choose another --json" in error_of(
        capsys, argv + ["--json", str(tmp_path / "e.json")]
    )


def test_main_runs_a_command_as_a_script_sharing_the_trainer_module_and_its_one_line_errors(
    tmp_path,
):
    """`python stratagem.py COMMAND` runs tools/COMMAND with stratagem.py as `__main__`: the tool must get
    that module, not a second copy whose UserError main() would not catch (a traceback instead of a line)."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "stratagem.py"), "show", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr == f"stratagem: error: {tmp_path / 'none' / 'trajectories.jsonl'} not found "
        f"(is {tmp_path / 'none'} a stratagem run directory?)\n"
    )


# ---- plot
def test_periodic_eval_is_logged_and_plot_and_show_read_the_runs(tmp_path, capsys):
    runs = []
    for mode in ("stratagem", "spiral"):
        runs.append(tmp_path / mode)
        assert (
            run(
                SMALL
                + [
                    "--steps",
                    "2",
                    "--mode",
                    mode,
                    "--eval-every",
                    "1",
                    "--eval-games",
                    "TicTacToe-v0,Snake-v0",
                    "--eval-n",
                    "2",
                    "--out",
                    str(runs[-1]),
                ]
            )
            == 0
        )
        metrics, _ = check_run(runs[-1], 2, beta=0.2, mode=mode)
        assert all(m["eval"]["n"] == 4 and 0 <= m["eval"]["win_rate"] <= 1 for m in metrics)
    capsys.readouterr()
    assert run(["plot", *map(str, runs), "--out", str(tmp_path / "plots")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == sorted(
        f"{n}.png"
        for n in plot.PLOTS
        if n not in ("exploitability", "judge_vs_truth", "distill", "spy")
    )  # no empty figures
    assert capsys.readouterr().out.endswith(
        "; no data for exploitability.png (--eval-every with KuhnPoker-v1 shown whole), "
        "judge_vs_truth.png (--eval-every with KuhnPoker-v1 shown whole, and a judge), distill.png "
        "(--distill), spy.png (a spyrl.py run)\n"
    )
    assert all((tmp_path / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    capsys.readouterr()
    assert run(["show", str(runs[0]), "--judged", "--index", "0"]) == 0
    printed = capsys.readouterr().out
    row = next(r for r in read_jsonl(runs[0] / "trajectories.jsonl") if r["scores"])
    assert (
        f"= {row['a_mod']:+.4f}" in printed
        and "--- turn 1 ---" in printed
        and f"phi = {row['phi']:.4f}" in printed
    )
    assert "--index must be in" in error_of(capsys, ["show", str(runs[0]), "--index", "9999"])


def test_plot_without_matplotlib_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    (tmp_path / "metrics.jsonl").write_text("")
    assert "pip install matplotlib" in error_of(capsys, ["plot", str(tmp_path)])


def test_draw_plot_colour_per_run_style_per_series_coinciding_lines_visible_legend_outside(
    tmp_path,
):
    import matplotlib
    import matplotlib.colors
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        {"step": s, "a_mod_std": 0.5 + 0.01 * s, "a_game_std": 0.5 + 0.01 * s} for s in range(1, 41)
    ]
    runs = [
        (tmp_path / "a", rows),
        (tmp_path / "b", rows),
    ]  # two identical runs whose two series coincide too
    fig = plot.draw_plot(plt, "a_mod_spread", runs)
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert len(lines) == 4 == len(ax.get_legend().get_texts())
    assert [matplotlib.colors.to_hex(ln.get_color()) for ln in lines] == [
        matplotlib.colors.to_hex(c) for c in ("C0", "C0", "C1", "C1")
    ]
    assert [ln.get_linestyle() for ln in lines] == ["-", "--", "-", "--"]
    assert [ln.get_marker() for ln in lines] == ["o", "s", "o", "s"] and all(
        ln.get_fillstyle() == "none" for ln in lines
    )
    widths, zorders = [ln.get_linewidth() for ln in lines], [ln.get_zorder() for ln in lines]
    assert (
        widths == sorted(widths, reverse=True) and len(set(widths)) == 4
    )  # each later line thinner ...
    assert zorders == sorted(zorders) and len(set(zorders)) == 4  # ... and on top: nested stripes
    fig.canvas.draw()
    assert (
        ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1
    )  # the legend is off the data
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].reshape(-1, 3)
    for colour in ("C0", "C1"):  # both runs are seen although their lines coincide
        rgb = (np.array(matplotlib.colors.to_rgb(colour)) * 255).round()
        assert (np.abs(pixels - rgb).max(axis=1) <= 2).sum() > 200, colour
    plt.close(fig)


def test_draw_plot_draws_the_levels_as_one_panel_per_dimension_with_a_line_per_run(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["alpha", "sigma", "rho", "d", "a", "c"]
    rows = [{"step": s, "levels_mean": {k: 0.1 * i for i, k in enumerate(keys)}} for s in (1, 2, 3)]
    others = [
        {"step": s, "levels_mean": {"d": -0.5}} for s in (1, 2)
    ]  # a run that logged one dimension
    fig = plot.draw_plot(plt, "levels", [(tmp_path / "a", rows), (tmp_path / "b", others)])
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == keys
    assert [len(ax.get_lines()) for ax in panels] == [
        2,
        2,
        2,
        3,
        2,
        2,
    ]  # d: both runs; each: a line at 0
    assert list(panels[3].get_lines()[0].get_ydata()) == pytest.approx([0.3, 0.3, 0.3])
    assert list(panels[3].get_lines()[1].get_ydata()) == [-0.5, -0.5]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "a (?)",
        "b (?)",
    ]  # b, though alpha has no b
    plt.close(fig)
    assert plot.draw_plot(plt, "levels", [(tmp_path / "c", [{"step": 1}])]) is None


def test_draw_plot_keeps_its_title_in_the_figure_and_draws_judge_figures_for_judged_runs_only(
    trained_runs, tmp_path
):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    long = tmp_path / ("stratagem-distill-tiny-s1-20261201-072413-" + "x" * 40)
    shutil.copytree(trained_runs["stratagem.py"], long)
    spy = trained_runs["spyrl.py"]
    runs = [(r, tools_runs.read_metrics(r)) for r in (long, spy)]
    fig = plot.draw_plot(plt, "judge_requests", runs)
    fig.canvas.draw()
    title = next(t for t in (fig._suptitle, fig.axes[0].title) if t is not None and t.get_text())
    box = title.get_window_extent()
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width  # not cut off at the left by a long legend
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels and all(
        long.name in x for x in labels
    )  # the SpyRL run has no judge: no line of zeros for it
    plt.close(fig)
    assert plot.draw_plot(plt, "judge_requests", runs[1:]) is None
    assert tools_runs.run_label(
        spy
    ) == f"{spy.name} (spyrl summarize)" and "beta" not in tools_runs.run_label(spy)


def test_invalid_rate_counts_the_seats_that_moved():
    """Every move invalid: a rate of 1, not 0.5 (the seat that never moved, because its opponent's first move lost
    the game, made no move at all). A SpyRL step has no idle seat: its invalid votes over its seats."""
    seats = {
        "player0": {"win": 0, "draw": 0, "loss": 7, "invalid": 7},
        "player1": dict(win=7, draw=0, loss=0, invalid=0),
    }
    assert plot.invalid_rate({"games": {"TicTacToe-v0": seats}, "idle_seats": 7}) == 1.0
    roles = {
        "spy": dict(win=0, draw=1, loss=0, invalid=1),
        "civilian": dict(win=0, draw=4, loss=0, invalid=2),
    }
    assert plot.invalid_rate({"games": {"WhoIsTheSpy-v0": roles}, "idle_seats": 0}) == 3 / 5


# ---- show
def test_show_makes_control_characters_visible(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"beta": 0.2}))
    turn = {
        "observation": "board\x1b[2J",
        "response": "I \x1b[31mwin\x1b[0m\r\u202eevil\x07",
        "action": "[4]\x1b]0;title\x07",
    }
    record = {
        "step": 1,
        "game": "TicTacToe-v0\x1b[1m",
        "role": 0,
        "reward": 1.0,
        "baseline": 0.0,
        "a_game": 1.0,
        "judged": False,
        "scores": None,
        "phi": 1.0,
        "psi": 0.0,
        "a_mod": 1.0,
        "turns": [turn],
    }
    (run_dir / "trajectories.jsonl").write_text(json.dumps(record) + "\n")
    capsys.readouterr()
    assert run(["show", str(run_dir), "--index", "0"]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f\u202e]", out)
    assert (
        "I \\x1b[31mwin\\x1b[0m\\r\\u202eevil\\x07" in out
        and "[action sent] [4]\\x1b]0;title\\x07" in out
    )
    assert "board\\x1b[2J" in out and "TicTacToe-v0\\x1b[1m, Player 0" in out


def test_show_advantage_line_says_r_minus_b_only_where_a_game_is_r_minus_b():
    """RAE's A_game is R - b; another estimator's (docs/hacking.md's GRPO fork, SpyRL's votes) is not, and
    show says so rather than print a false equation."""
    assert show.advantage_line({"reward": 1, "baseline": 0.25, "a_game": 0.75}) == (
        "reward R = +1   baseline b = +0.2500   A_game = R - b = +0.7500"
    )
    grouped = show.advantage_line({"reward": 1, "baseline": 0.0, "a_game": 0.0})
    assert grouped == (
        "reward R = +1   baseline b = +0.0000   A_game = +0.0000 (not R - b: set by the run's advantage estimator)"
    )


def test_show_modulation_line_takes_the_steps_beta_and_psis_centre():
    """A_mod as the step computed it: --beta-share's beta of that step, --centre-psi's centre; a value the
    numbers do not give is said to come from an extension of step 3. metrics.jsonl is read only when the run's
    --beta alone does not give A_mod."""
    r = {"a_game": 0.5, "phi": 0.5, "psi": 1.0, "a_mod": 0.25 + 0.3 * (1.0 - 0.4)}
    line = show.modulation_line(r, 0.2, lambda: {"beta": {"value": 0.3}, "psi_centre": 0.4})
    assert (
        line
        == "A_mod = A_game*phi + beta*(psi - centre) = +0.5000*0.5000 + 0.3*(+1.0000 - 0.4000) = +0.4300"
    )
    plain = show.modulation_line(
        {**r, "a_mod": 0.45}, 0.2, lambda: pytest.fail("read metrics.jsonl")
    )
    assert plain == "A_mod = A_game*phi + beta*psi = +0.5000*0.5000 + 0.2*+1.0000 = +0.4500"
    assert show.modulation_line({**r, "a_mod": 9.0}, 0.2).endswith(
        "= +9.0000  (not from these numbers: an extension of step 3 set it)"
    )


def test_show_into_a_pipe_closed_early_ends_quietly(tmp_path):
    turn = {"observation": "board\n" * 50, "response": "I think\n" * 2000, "action": "[4]"}
    record = {
        "step": 1,
        "game": "TicTacToe-v0",
        "role": 0,
        "reward": 1.0,
        "baseline": 0.0,
        "a_game": 1.0,
        "judged": False,
        "scores": None,
        "phi": 1.0,
        "psi": 0.0,
        "a_mod": 1.0,
        "turns": [turn] * 5,
    }
    (tmp_path / "config.json").write_text(json.dumps({"beta": 0.2}))
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(record) + "\n")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "stratagem.py"), "show", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.readline().startswith(str(tmp_path).encode())
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and err == b""


def test_show_prints_each_turns_prompt_as_format_prompt_wrote_it_and_the_run_saved_it(
    one_step_run, capsys
):
    _, tok = S.load_policy(str(one_step_run / "checkpoints" / "step-000001"), torch.device("cpu"))
    rows = [r for r in read_jsonl(one_step_run / "trajectories.jsonl") if r["turns"]]
    assert rows and all(
        t["prompt"] == S.format_prompt(tok, t["observation"], r["role"])
        for r in rows
        for t in r["turns"]
    )
    capsys.readouterr()
    assert (
        run(
            [
                "show",
                str(one_step_run),
                "--index",
                str(read_jsonl(one_step_run / "trajectories.jsonl").index(rows[0])),
            ]
        )
        == 0
    )
    assert (
        f"[prompt, as the policy got it]\n{rows[0]['turns'][0]['prompt']}"
        in capsys.readouterr().out
    )


def test_show_spy_game_shows_each_vote_with_its_own_label_and_no_negative_zero(
    trained_runs, capsys
):
    capsys.readouterr()
    assert run(["show", str(trained_runs["spyrl.py"]), "--index", "0"]) == 0
    printed = capsys.readouterr().out
    assert "-0.0000" not in printed and show.signed(-0.0) == show.signed(-4e-9) == "+0.0000"
    lines = printed.splitlines()
    votes = [k for k, x in enumerate(lines) if x.startswith("[vote, detection] ")]
    assert len(votes) == 4 and not any(x.startswith("[vote] invalid  |") for x in lines)
    for k in votes:  # the vote's label, then its text, before the next player's block
        assert re.match(
            r"\[vote, detection\] (Player \d|invalid \(it names no other player\))  \|  r\^D = ",
            lines[k],
        )
        assert lines[k - 1].startswith("[output, performance] votes drawn s = ")
    assert sum(x.startswith("[vote] ") and "the spy's vote" in x for x in lines) == 1


def test_show_plot_and_agree_read_partial_and_missing_scores(one_step_run, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    rows = [r for r in read_jsonl(out / "trajectories.jsonl") if r["turns"]][:6]
    rows[0]["scores"] = {
        "alpha": 1.0
    }  # a judge's partial verdict, as a hand-edited or foreign file can hold
    rows[1]["scores"] = {
        "alpha": 1.0,
        "sigma": 0.5,
        "rho": 0.0,
        "d": None,
        "a": None,
        "c": None,
    }  # --no-psi
    rows[2]["scores"] = {"d": 1.0}
    rows[2]["predicted"] = {"levels": {"alpha": 0.5}, "used": False}
    del rows[3]["phi"], rows[3]["psi"], rows[3]["a_mod"]
    rows[4]["scores"] = {}
    del rows[5]["scores"]
    (out / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    said = []
    for index in range(len(rows)):
        assert run(["show", str(out), "--index", str(index)]) == 0, index
        said.append(capsys.readouterr().out)
    assert "\njudge: alpha 1  (sigma, rho: not given)\n" in said[0]
    assert (
        "\njudge: alpha 1  sigma 0.5  rho 0  -> phi = " in said[1] and "\n       d" not in said[1]
    )
    assert "\njudge: (alpha, sigma, rho: not given)\n       d 1  (a, c: not given)\n" in said[2]
    assert "\nheads: alpha 0.5  (sigma, rho: not given)  (the judge's verdict stands)\n" in said[2]
    assert "\nA_mod = A_game*phi + beta*psi = " in said[3] and "*? + 0.2*? = ?\n" in said[3]
    assert (
        "judge: not sampled; batch means used" in said[4] + said[5]
        or "judge: failed" in said[4] + said[5]
    )
    metrics = read_jsonl(out / "metrics.jsonl")
    for key in ("phi_mean", "a_mod_std", "loss", "games", "response_tokens_mean"):
        del metrics[0][key]
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    assert run(["plot", str(out), "--out", str(tmp_path / "plots")]) == 0
    assert "wrote " in capsys.readouterr().out
    (out / "plots").symlink_to(
        tmp_path / "plots", target_is_directory=True
    )  # its figures would be replaced
    assert "plots is a symbolic link" in error_of(capsys, ["plot", str(out)])
    with open(out / "trajectories.jsonl", "a") as f:
        f.write(
            json.dumps({"step": 1, "scores": {"alpha": 1.0}}) + "\n"
        )  # no turns, no game: nothing to judge
    assert run(["agree", str(out), "--judges", "heuristic", "heuristic", "--sample", "6"]) == 0
    assert "agreement on 6 of 6 sampled trajectories" in capsys.readouterr().out


# ---- agree
@pytest.fixture
def varied_run(tmp_path):
    """A run directory whose trajectories differ in every rubric dimension of the heuristic judge."""
    texts = [
        "I bet.",
        "First, compare the expected value of each case: if I bet then the payoff is higher, "
        "because the probability is 2/3. Therefore bet.",
        "Since my card is high, I call; in general calling wins. Step 1: read the state.",
        "random words",
    ]
    rows = []
    for i in range(24):
        turns = [
            {
                "observation": f"obs {i} {k}",
                "response": texts[(i + k) % 4] + " " * (k * (i % 3)),
                "action": ["[bet]", "", "[call]"][(i + k) % 3],
            }
            for k in range(1 + i % 3)
        ]
        rows.append(
            {"step": 1, "game": "KuhnPoker-v0", "role": i % 2, "reward": 1.0, "turns": turns}
        )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_agree_matches_itself_through_a_served_judge(varied_run, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server = serve_judge.make_judge_server("127.0.0.1", 0, noise=0.0, seed=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        out_json = varied_run / "agreement.json"
        assert (
            run(
                [
                    "agree",
                    str(varied_run),
                    "--judges",
                    "heuristic",
                    f"openai:served-heuristic@{url}",
                    "--sample",
                    "20",
                    "--json",
                    str(out_json),
                ]
            )
            == 0
        )
    finally:
        server.shutdown()
        server.server_close()
    result = json.loads(out_json.read_text())
    assert result["n"] == 20 and result["judges"]["B"] == f"openai:served-heuristic@{url}"
    values = [v["A~B"] for v in result["table"].values()]
    assert (
        all(v in (None, pytest.approx(1.0)) for v in values)
        and values.count(None) < len(values) - 3
    )
    printed = capsys.readouterr().out
    assert (
        "agreement on 20 of 20" in printed
        and "kappa alpha" in printed
        and "spearman psi" in printed
    )


def test_agree_against_a_judge_that_always_says_the_same(
    varied_run, judge_server, secret_key, capsys
):
    assert (
        run(
            [
                "agree",
                str(varied_run),
                "--judges",
                "heuristic",
                f"openai:judge-test@{judge_server.url}",
                "--sample",
                "12",
                "--json",
                str(varied_run / "a.json"),
            ]
        )
        == 0
    )
    table = json.loads((varied_run / "a.json").read_text())["table"]
    assert (
        table["kappa d"]["A~B"] in (0.0, None) and table["spearman phi"]["A~B"] is None
    )  # B is constant (where
    # the judges decide: a level the rules set, as d = a = c = 0 for a one-turn game, is not an agreement)
    assert run(["agree", str(varied_run), "--judges", "heuristic"]) == 2
    assert "at least two --judges" in capsys.readouterr().err


def test_agree_says_when_a_statistic_is_undefined_without_blaming_one_judge(
    varied_run, capsys, monkeypatch
):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert (
        run(["agree", str(varied_run), "--judges", "heuristic", "heuristic", "--sample", "6"]) == 0
    )
    footnote = capsys.readouterr().out.splitlines()[-1]
    assert footnote.endswith(
        "n/a: undefined, for kappa when both judges of the pair gave every trajectory one and the same level (or "
        "none was compared), for Spearman when either judge gave one value throughout"
    )


def test_agree_checks_every_judge_before_paying_any(one_step_run, judge_server, secret_key, capsys):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    err = error_of(
        capsys,
        [
            "agree",
            str(one_step_run),
            "--judges",
            f"openai:judge-test@{judge_server.url}",
            f"openai:judge-test@{dead}",
            "--judge-retries",
            "0",
        ],
    )
    assert f"the judge at {dead} is unreachable" in err
    assert judge_server.requests == []  # the first, reachable (and paid) judge was not run


# ---- serve-judge
def test_serve_judge_stops_on_ctrl_c_without_training_advice(tmp_path):
    import signal

    proc = spawn(["serve-judge", "--port", "0"], tmp_path)
    assert proc.stdout.readline().startswith("heuristic judge on http://127.0.0.1:")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == "serve-judge: stopped\n"


@pytest.mark.parametrize(
    "body, headers",
    [
        (b"{not json", {}),
        (b"[1, 2]", {}),
        (b'{"messages": "x"}', {}),
        (b'{"messages": [{"content": 3}]}', {}),
        (b"{" * 100_000, {}),
        (b"", {"Content-Length": "-5"}),
        (b"", {"Content-Length": "abc"}),
    ],
)
@pytest.mark.slow
def test_serve_judge_answers_400_to_what_is_not_a_chat_request(tmp_path, body, headers):
    import http.client
    import signal

    proc = spawn(["serve-judge", "--port", "0"], tmp_path)
    try:
        port = int(proc.stdout.readline().split("http://127.0.0.1:")[1].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=body,
            headers={"Content-Length": str(len(body)), **headers},
        )
        resp = conn.getresponse()
        assert resp.status == 400 and "error" in json.loads(resp.read())
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert err == "serve-judge: stopped\n"  # no traceback on stderr


@pytest.mark.slow
def test_serve_judge_with_the_teacher_prints_nothing_before_its_ready_line(tmp_path):
    import signal

    proc = spawn(["serve-judge", "--teacher", "tokens", "--port", "0"], tmp_path)
    try:
        ready = proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert ready.startswith("tokens judge on http://127.0.0.1:") and err == "serve-judge: stopped\n"


# ---- bench and random-model
def test_bench_reports_rates_split_and_appends_json(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    argv = [
        "bench",
        "--json",
        str(out),
        "--judgements",
        "6",
        "--tiny",
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--num-envs",
        "4",
        "--max-new-tokens",
        "8",
    ]
    assert run(argv) == 0 and run(argv) == 0
    records = read_jsonl(out)
    assert [r["argv"] for r in records] == [argv[1:]] * 2 and records[0]["config"][
        "batch_size"
    ] == 8
    res = records[0]["results"]
    for mode in ("lockstep", "sequential"):
        r = res[mode]
        assert r["steps_measured"] == 1 and r["games_per_s"] > 0 and r["tokens_per_s"] > 0
        assert set(r["time_split"]) == {"generate", "game", "judge", "learn", "sync", "other"}
        assert sum(r["time_split"].values()) == pytest.approx(1.0)
    assert (
        res["sequential"]["live_games_per_call"] == 1.0
        and res["lockstep"]["live_games_per_call"] > 1.0
    )
    assert res["judge"]["judgements"] == 6 and res["judge"]["failed"] == 0
    assert (
        res["judge"]["requests"] == 12 - res["judge"]["one_turn"]
    )  # one-turn games skip the evolution rubric
    printed = capsys.readouterr().out
    assert "lockstep / sequential games/s" in printed and "time: learn %" in printed
    assert "drop --out" in error_of(capsys, ["bench", "--tiny", "--out", str(tmp_path / "x")])


def test_bench_suggests_no_command_on_its_deleted_folder_and_names_what_it_extrapolates(
    tmp_path, capsys
):
    argv = (
        ["bench", "--rollout", "lockstep", "--json", str(tmp_path / "b.jsonl")]
        + SMALL
        + ["--steps", "1"]
    )
    assert run(argv) == 0
    printed = capsys.readouterr().out
    assert (
        "Next:" not in printed
        and "done:" not in printed
        and "the paper's run) at this rate" not in printed
    )
    assert (
        "lockstep: 400 steps of this configuration (batch 12, up to 16 new tokens a turn) would take "
        in printed
    )
    [record] = read_jsonl(tmp_path / "b.jsonl")
    threads = record["machine"]["threads"]
    assert threads == torch.get_num_threads() and f"torch threads {threads} (" in printed
    assert {"load_before", "load_after"} <= set(record["machine"]) and "load average " in printed
    assert set(record["results"]) == {"lockstep"}


def test_random_model_builds_the_tiny_qwen3_and_refuses_an_existing_folder(tmp_path, capsys):
    assert run(["random-model", str(tmp_path / "m")]) == 0
    model, tok = S.load_policy(str(tmp_path / "m"), torch.device("cpu"))
    assert model.config.hidden_size == 64 and len(tok) > 256
    assert "already exists" in error_of(capsys, ["random-model", str(tmp_path / "m")])
    assert (
        S.ARCHS["qwen3-4b"]["hidden_size"] == 2560
        and S.ARCHS["qwen3-4b"]["num_hidden_layers"] == 36
    )
    assert model.config.head_dim == 32  # the smallest head vLLM's CPU attention takes


def test_show_decided_names_the_rule_of_code_that_set_evolution_levels_and_only_then(
    one_step_run, capsys
):
    from tools import show

    levels = {"d": 0.0, "a": 0.0, "c": 1.0}
    one = [{"observation": "o1", "response": "I bet. \\boxed{[bet]}"}]
    same = one + [{"observation": "o2", "response": "I bet. \\boxed{[bet]}"}]
    moved = one + [{"observation": "o2", "response": "They called; now I check. \\boxed{[check]}"}]
    assert show.decided(one, levels) == show.RULE_WORDS["one_turn"]
    assert show.decided(same, levels) == show.RULE_WORDS["stagnant"]
    assert show.decided(moved, levels) is None
    assert show.decided(one, {"alpha": 1.0}) is None  # no evolution verdict: nothing to say
    assert S.main(["show", str(one_step_run), "--judged", "--index", "0"]) == 0
    assert "(d, a and c set by code, not the judge: one turn has nothing to compare" in (
        capsys.readouterr().out
    )


def test_eval_of_a_model_folder_names_each_default_it_plays_with_and_not_the_flags_given(
    tiny, tmp_path, capsys
):
    argv = ["eval", str(tiny), "--n", "1", "--games", "TicTacToe-v0", "--max-new-tokens", "8"]
    assert S.main([*argv, "--json", str(tmp_path / "e.json")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(
        "eval: no run, so the trainer's defaults: --temperature 1.0, --max-turns 200, "
        "--error-allowance 0, --action-rule lenient, --invalid-rewards -1,1, --rejected-rewards -1,1; "
    ), first
    assert "--max-new-tokens" not in first


def test_draw_plot_puts_whole_steps_on_every_x_axis_of_a_short_run(one_step_run):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tools import plot

    (m,) = [x for x in read_jsonl(one_step_run / "metrics.jsonl") if "loss" in x]
    runs = [(one_step_run, [m, {**m, "step": 2}])]  # two steps: fractional ticks where not asked
    drawn = 0
    for name in plot.PLOTS:
        fig = plot.draw_plot(plt, name, runs)
        for ax in fig.axes if fig is not None else []:
            if ax.get_visible() and ax.has_data():
                ticks = [t for t in ax.get_xticks() if 1 <= t <= 2]
                assert ticks and all(t == int(t) for t in ticks), (name, ticks)
                drawn += 1
        plt.close("all")
    assert drawn >= 5


LOADED = (
    "import atexit, runpy, sys\n"
    "def said():\n"
    "    names = sorted(m for m in sys.modules if m.split('.')[0] in ('tools', 'stratagem'))\n"
    "    trainer = sys.modules.get('stratagem')\n"
    "    print(names, getattr(trainer, '__name__', None), file=sys.stderr)\n"
    "atexit.register(said)\n"
    "sys.argv = ['stratagem.py', *sys.argv[1:]]\n"
    "runpy.run_path('stratagem.py', run_name='__main__')\n"
)


def imported_by(*argv: str) -> tuple[list[str], str | None]:
    """The modules of tools/ and the trainer that `python stratagem.py ARGV` has loaded when it exits,
    and the __name__ of the module `import stratagem` finds (the script's own: __main__)."""
    proc = subprocess.run(
        [sys.executable, "-c", LOADED, *argv],
        capture_output=True,
        text=True,
        cwd=HERE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    names, trainer = proc.stderr.strip().splitlines()[-1].rsplit(" ", 1)
    return json.loads(names.replace("'", '"')), trainer


def test_main_loads_no_tool_for_help_or_a_run_and_a_tool_shares_the_loaded_trainer():
    """--help and a run (here --dry-run) load no module of tools/; a command loads its own module only,
    and its `import stratagem` finds the trainer already loaded as the script, not a second copy."""
    for argv in (["--help"], ["--dry-run"]):
        assert imported_by(*argv) == (["stratagem"], "__main__"), argv
    assert imported_by("show", "--help") == (
        ["stratagem", "tools", "tools.runs", "tools.show"],
        "__main__",
    )
