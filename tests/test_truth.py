"""Tests of the judge checked against the game's truth (machinery/truth.py): the periodic
evaluation's best reply to the model's own KuhnPoker-v1 moves whatever the opponent, the judged
means each evaluation carries, the warning when the judge's scores rise while the best reply gains,
its plot."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

import stratagem as S
from games import perfect
from machinery import lifecycle, runfiles, truth, watch
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    ScriptedPolicy,
    fresh,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    tiny_fixture,
)


# ---- the periodic evaluation reports the best reply, whatever its opponent
def kuhn_answer(prompt: str) -> str:
    """A scripted model: one of the moves it is offered, drawn by what it is shown (any move
    elsewhere: TicTacToe-v0 loses on it)."""
    offered = prompt.rsplit("available actions are: ", 1)[-1].split("\n")[0]
    return "\\boxed{" + random.Random(prompt).choice(offered.split(", ")) + "}"


def evaluate(tiny, monkeypatch, step: int = 5, **flags) -> tuple[dict | None, list[dict]]:
    """periodic_eval of a scripted model on KuhnPoker-v1 and TicTacToe-v0 (random opponent): its
    result and the records it played. Each TicTacToe-v0 record gets a deciding-round KuhnPoker-v1
    move planted in its moves: were it counted, the best reply would differ."""
    _, tok = fresh(tiny)
    games = ["KuhnPoker-v1", "TicTacToe-v0"]
    args = S.Args(eval_every=5, eval_n=4, eval_games=",".join(games), max_new_tokens=8, **flags)
    played, play = [], S.play_matches

    def recorded(*a, **k):
        played.extend(play(*a, **k))
        kuhn = [pair for r in played if r["game"] == "KuhnPoker-v1" for pair in r["moves"]]
        planted = next(p for p in kuhn if perfect.kuhn_infoset(p[0]) is not None)
        for r in played:
            if r["game"] == "TicTacToe-v0":
                r["moves"] = r["moves"] + [[planted[0], "[fold]"]] * 5
        return played

    monkeypatch.setattr(S, "play_matches", recorded)
    run_ = SimpleNamespace(args=args, eval_games=games, policy=ScriptedPolicy(kuhn_answer))
    run_.tokenizer, run_.dist = tok, SimpleNamespace(main=True)
    return S.periodic_eval(run_, step, watch.Timer()), played


def test_periodic_eval_reports_the_best_reply_to_its_kuhn_moves_against_random(tiny, monkeypatch):
    result, played = evaluate(tiny, monkeypatch)
    assert result["opponent"] == "random" and {r["game"] for r in played} == {
        "KuhnPoker-v1",
        "TicTacToe-v0",
    }
    assert all(r["moves"] for r in played)  # every record carries the model's moves
    kuhn = [pair for r in played if r["game"] == "KuhnPoker-v1" for pair in r["moves"]]
    counts = perfect.strategy_counts(kuhn)
    assert counts  # the model's deciding-round moves were read
    assert result["best_response"] == perfect.exploitability(counts, random.Random(5))
    everything = [pair for r in played for pair in r["moves"]]
    assert perfect.strategy_counts(everything) != counts  # TicTacToe-v0's plant left out
    assert "KuhnPoker-v1's best reply wins" in watch.eval_text(result)
    none_read = result | {"best_response": result["best_response"] | {"n": 0}}
    assert watch.eval_text(none_read).endswith(
        "; KuhnPoker-v1: no move of its deciding round to reply to"
    )  # every spot would count as uniform: no figure of the model's play


@pytest.mark.parametrize(
    "flags",
    [{"eval_first_last": "KuhnPoker-v1"}, {"error_allowance": 1}],
    ids=["first-last", "error-allowance"],
)
def test_periodic_eval_skips_the_best_reply_where_it_cannot_read_the_moves(
    tiny, monkeypatch, flags
):
    """The first/last format drops the bets the information set is read from; with an error
    allowance an answer the game refused and asked again would read as a move lost."""
    result, _ = evaluate(tiny, monkeypatch, **flags)
    assert "best_response" not in result and result["n"] == 8
    assert "best reply" not in watch.eval_text(result)


# ---- the judged means each evaluation carries, and the warning
def best(win: float, low: float, high: float, n: int = 60) -> dict:
    """A best reply of `n` moves of the model."""
    return {"win_rate": win, "ci95": [low, high], "n": n}


def planted(evals: list[tuple], steps_between: int = 2) -> list[dict]:
    """metrics.jsonl lines of a run: step 0's evaluation, then per (phi, psi, best reply) a stretch
    of `steps_between` step lines judged at phi, psi, the last with its evaluation."""
    e = {"games": {}, "spots": {}, "win_rate": 0.5, "win_ci95": [0.3, 0.7], "n": 10}
    lines = [{"step": 0, "eval": e | {"best_response": best(0.6, 0.55, 0.7)}}]
    step = 0
    for phi, psi, reply in evals:
        for k in range(steps_between):
            step += 1
            line = {"step": step, "transitions": 4, "phi_mean": phi + k / 100, "psi_mean": psi}
            lines.append(line | ({"eval": e | {"best_response": reply}} if k else {}))
    return lines


RISING = [  # the judge's phi rises, the best reply gains beyond its noise at the third
    (0.40, 0.0, best(0.60, 0.55, 0.70)),
    (0.50, 0.0, best(0.65, 0.58, 0.75)),
    (0.60, 0.0, best(0.80, 0.72, 0.90)),
]


def guarded(lines: list[dict], capsys) -> tuple[list[str], SimpleNamespace]:
    """Each line through the run's history and guard, as end_step does: the warning lines said."""
    run_ = SimpleNamespace(first_spots=None, warned=set(), truth=truth.History())
    for line in lines:
        run_.truth.add(line)
        lifecycle.guard(run_, line)
    return capsys.readouterr().err.splitlines(), run_


def test_guard_says_the_judge_rewards_what_the_game_punishes_once(tmp_path, capsys):
    for line in planted(RISING + [(0.70, 0.1, best(0.9, 0.85, 0.95))]):
        runfiles.append_jsonl(tmp_path / "metrics.jsonl", line)
    said, run_ = guarded(read_jsonl(tmp_path / "metrics.jsonl"), capsys)
    assert said == [
        "stratagem: warning: step 6: the judge rewards what the game punishes: over the "
        "evaluations of steps 2 to 6 the judged means rose (phi 0.405 -> 0.605) while the best "
        "reply to the policy's KuhnPoker-v1 play went from winning 0.600 [0.550, 0.700] to 0.800 "
        "[0.720, 0.900], the intervals apart (docs/evaluation.md#the-judge-against-the-games-truth)"
    ]  # once, though step 8's evaluation says it again
    # each evaluation after step 0 carries the judged means of the steps since the previous one
    judged = [p["judged"] for p in run_.truth.points]
    assert judged[0] == {"phi": None, "psi": None}
    assert judged[1] == {"phi": pytest.approx(0.405), "psi": 0.0}


@pytest.mark.parametrize(
    "evals",
    [
        [(0.4, 0.0, RISING[0][2]), (0.5, 0.0, RISING[1][2]), (0.3, -0.1, RISING[2][2])],
        [
            (0.4, 0.0, best(0.8, 0.7, 0.9)),
            (0.5, 0.0, best(0.7, 0.6, 0.8)),
            (0.6, 0.1, RISING[0][2]),
        ],
        RISING[:2] + [(0.6, 0.0, best(0.74, 0.65, 0.85))],  # above 0.60, not its interval's 0.70
        RISING[1:],
        RISING[:2] + [(0.6, 0.0, best(0.8, 0.72, 0.9, n=truth.MIN_MOVES - 1))],
    ],
    ids=["judge-falls", "best-reply-falls", "within-noise", "fewer-than-the-window", "few-moves"],
)
def test_warning_is_none_unless_the_judge_rises_and_the_best_reply_gains_beyond_noise(
    evals, capsys
):
    assert guarded(planted(evals), capsys)[0] == []


def test_History_add_gives_evaluations_the_judged_means_as_a_resume_replays_them():
    lines = planted(RISING)
    live = truth.History()
    for line in lines:
        live.add(line)
    assert lines[2]["eval"]["judged"] == {
        "phi_mean": pytest.approx(0.405),
        "psi_mean": 0.0,
        "steps": 2,
    }
    assert "judged" not in lines[0]["eval"]  # step 0: nothing judged before it
    again = truth.History.replay(lines[:3])  # resumed at step 2: its evaluation is behind it
    again.add(lines[3])
    again.add(lines[4])
    assert again.points == live.points[:3]
    assert (
        truth.History.replay([{"step": 1, "transitions": 2, "phi_mean": int("9" * 400)}]).sums == {}
    )


# ---- plot
def test_plot_judge_vs_truth_draws_the_best_reply_and_the_judged_means_on_twin_axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tools import plot

    lines = planted(RISING)
    truth.History.replay(lines)  # the judged means each evaluation carries
    fig = plot.draw_plot(plt, "judge_vs_truth", [(Path("r"), lines)])
    left, right = fig.axes
    assert [list(x.get_xdata()) for x in left.get_lines() if len(x.get_xdata()) > 2] == [
        [0, 2, 4, 6]
    ]  # the best reply, at every evaluation
    assert [list(x.get_ydata()) for x in right.get_lines()] == [
        pytest.approx([0.405, 0.505, 0.605]),
        [0.0, 0.0, 0.0],
    ]  # phi and psi, from step 2's evaluation on
    assert left.get_ylabel() == "win rate of the best reply" and right.get_ylabel()
    plt.close(fig)
    without = [{k: v for k, v in m.items() if k != "eval"} for m in lines]
    assert plot.draw_plot(plt, "judge_vs_truth", [(Path("r"), without)]) is None


def test_best_reply_reads_none_from_a_hand_edited_line_whose_interval_misses_its_rate():
    line = {"win_rate": 0.6, "ci95": [0.5, 0.7], "n": 40}
    assert truth.best_reply({"best_response": line}) == line
    for edit in ({"ci95": [0.7, 0.5]}, {"win_rate": 0.9}, {"n": -1}, {"ci95": [0.5, "x"]}):
        assert truth.best_reply({"best_response": line | edit}) is None
