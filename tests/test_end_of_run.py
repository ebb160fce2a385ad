"""Tests of the work a command does at its end, and of what the fifth attack's surviving mutants changed unseen:
--keep-best's fresh games (a stop there is finished by --resume, a finished run never measures again, --best-eval-n
games per id), the warm start's folder (a stop leaves none), the move-size check, eval's headline and SpyRL's warm
start. Each class is listed in docs/reliability.md with what its test plants."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import spyrl
import stratagem as S
from machinery.distributed import Terminated
from machinery.matches import wilson
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    SMALL,
    no_process_left_behind,
    not_for_the_vllm_tests,
    only_the_vllm_tests,
    run,
)

KEEP = [
    "--eval-every",
    "1",
    "--eval-n",
    "2",
    "--eval-games",
    "KuhnPoker-v1,TicTacToe-v0",
    "--keep-best",
    "--best-eval-n",
    "7",
    "--steps",
    "1",
]


def fresh_games(games: list[tuple]) -> int:
    """How many of play_matches' scheduled games are fresh ones (FreshSeeds: seeds from 2**31 on)."""
    return sum(seed >= 2**31 for _, _, seed, _ in games)


def counting_fresh_games(monkeypatch, stop: bool = False) -> list[int]:
    """play_matches, recording the fresh games of each call (the kept best's measurement); with `stop`, SIGTERM
    arrives as the measurement starts (Terminated is what the stop handler raises there)."""
    play, counted = S.play_matches, []

    def counting(policy, tokenizer, opponent, games, *rest):
        if fresh_games(games):
            counted.append(fresh_games(games))
            if stop:
                raise Terminated("SIGTERM")
        return play(policy, tokenizer, opponent, games, *rest)

    monkeypatch.setattr(S, "play_matches", counting)
    return counted


def best_of(out: Path) -> dict:
    return json.loads((out / "best" / "best.json").read_text())


@pytest.fixture(scope="module", name="kept")
def kept_fixture(tmp_path_factory):
    """A --keep-best run of one step, never stopped: its best/ measured on fresh games at the end."""
    not_for_the_vllm_tests()
    out = tmp_path_factory.mktemp("kept") / "run"
    assert run(SMALL + KEEP + ["--out", str(out)]) == 0
    return out


# ---- --keep-best's fresh games: --best-eval-n of them, finished by --resume after a stop, never twice
def test_best_eval_n_plays_exactly_that_many_fresh_games_per_id(kept):
    fresh = best_of(kept)["fresh"]
    assert fresh["n"] == 14  # 7 per id, not 5 x --eval-n
    assert {g: c["both"]["n"] for g, c in fresh["games"].items()} == {
        "KuhnPoker-v1": 7,
        "TicTacToe-v0": 7,
    }


def test_best_on_fresh_games_stopped_leaves_a_run_that_resume_finishes(
    kept, tmp_path, monkeypatch, capsys
):
    """SIGTERM while the kept best plays its fresh games: the run says how to resume, and --resume plays them (as
    the run never stopped would have) and writes them to best.json, instead of answering "already finished"."""
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        counting_fresh_games(m, stop=True)
        assert run(SMALL + KEEP + ["--out", str(out)]) == 143
    err = capsys.readouterr().err
    assert err.endswith(
        f"stratagem: stopped by SIGTERM (continue from step-000001 with: "
        f"python stratagem.py --resume --out {out})\n"
    )
    assert "fresh" not in best_of(out)
    counted = counting_fresh_games(monkeypatch)
    assert run(["--resume", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "already finished" not in said and "best/ (step 0): 7 fresh games per id" in said
    assert counted == [14] and best_of(out) == best_of(kept)


def test_best_on_fresh_games_is_not_played_again_when_a_finished_run_is_resumed(
    kept, tmp_path, monkeypatch, capsys
):
    """Resumed as it is, it has nothing to do; resumed for one more step whose evaluation cannot beat the kept best
    (planted at a win rate of 1), the kept best's fresh games are not played again either."""
    out = tmp_path / "run"
    shutil.copytree(kept, out)
    counted = counting_fresh_games(monkeypatch)
    before = (out / "best" / "best.json").read_bytes()
    assert run(["--resume", "--out", str(out)]) == 0
    assert "is already finished (1 of 1 steps); nothing to do" in capsys.readouterr().out
    (out / "best" / "best.json").write_text(json.dumps({**best_of(out), "win_rate": 1.0}))
    planted = (out / "best" / "best.json").read_bytes()
    assert run(["--resume", "--out", str(out), "--steps", "2"]) == 0
    assert counted == [] and (out / "best" / "best.json").read_bytes() == planted != before


# ---- the warm start: a stop leaves no model folder
@pytest.mark.parametrize(
    "stop", [KeyboardInterrupt, Terminated("SIGTERM")], ids=["Ctrl-C", "SIGTERM"]
)
def test_warmstart_stopped_while_measuring_leaves_no_model_folder(
    tmp_path, monkeypatch, capsys, stop
):
    """Ctrl-C (or SIGTERM) while `warmstart DIR --eval-n N` measures what it built: nothing is left that loads as
    --model, neither DIR (with its weights but no warmstart.json, as before) nor a folder beside it."""
    from tools import warmstart

    def stopped(*a, **k):
        raise stop

    monkeypatch.setattr(warmstart, "measure", stopped)
    argv = ["warmstart", str(tmp_path / "w"), "--steps", "1", "--moves", "5,5,5", "--eval-n", "1"]
    assert run(argv) in (130, 143)
    assert "stratagem: stopped by" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_warmstart_renames_its_whole_folder_into_place_last(tmp_path):
    assert run(["warmstart", str(tmp_path / "w"), "--steps", "1", "--moves", "5,5,5"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["w"]
    assert (tmp_path / "w" / "warmstart.json").is_file()
    assert S.load_policy(str(tmp_path / "w"), torch.device("cpu"))[0] is not None


# ---- a move of 150 digits never reaches the game
class RecordingGame:
    """A game that records every move it is given."""

    def __init__(self):
        self.moves = []

    def step(self, action):
        self.moves.append(action)
        return False, {}


def test_play_move_refuses_a_150_digit_number_before_the_game_reaches_it(capsys):
    game = RecordingGame()
    assert S.play_move(game, 1, "[Bid: " + "9" * 150 + ", 3]", "G") == (True, 1)
    assert game.moves == [] and capsys.readouterr().err == ""
    assert S.play_move(game, 0, "[Bid: " + "9" * 99 + ", 3]", "G") == (False, None)
    assert game.moves == ["[Bid: " + "9" * 99 + ", 3]"]  # a long number, but a move


# ---- eval's headline: wins only
def test_eval_headline_counts_wins_only_never_draws(capsys):
    from tools import eval as evaluate

    records = [
        {"game": "KuhnPoker-v1", "outcome": o} for o in ("win", "draw", "draw", "loss", "draw")
    ]
    records.append({"game": "Nim-v0", "outcome": "win"})
    trained = evaluate.pooled(records, ["KuhnPoker-v1"])
    assert trained == {
        "games": ["KuhnPoker-v1"],
        "n": 5,
        "win_rate": 0.2,
        "win_ci95": wilson(1, 5),
    }
    evaluate.print_matches({"games": {}}, "random", {"trained games": trained})
    low, high = wilson(1, 5)
    assert capsys.readouterr().out.startswith(
        f"model vs random, trained games (KuhnPoker-v1): 5 games, win rate 0.20 [{low:.2f}, {high:.2f}]\n"
    )


# ---- SpyRL's --tiny: its shipped warm start
def test_tiny_init_of_spyrl_starts_from_its_shipped_warm_start_not_random_weights(
    tmp_path, monkeypatch
):
    """A SpyRL run given --tiny alone (every other SpyRL run of the suite passes --tiny-init random) starts its
    learner and its KL reference from warmstart/spy's weights, tensor for tensor."""
    load, started = S.load_learner_and_engine, {}

    def recorded(*a):
        model, tokenizer, policy, reference, optimizer = load(*a)
        started["model"] = {k: v.clone() for k, v in model.state_dict().items()}
        started["reference"] = reference.state_dict()
        return model, tokenizer, policy, reference, optimizer

    monkeypatch.setattr(S, "load_learner_and_engine", recorded)
    flags = ["--tiny", "--steps", "1", "--batch-size", "5", "--num-envs", "4"]
    assert spyrl.main(flags + ["--max-new-tokens", "16", "--out", str(tmp_path / "spy")]) == 0
    shipped = load_file(spyrl.WARM_START / "model.safetensors")
    for weights in started.values():
        assert set(shipped) <= set(weights)
        assert all(torch.equal(weights[k], shipped[k]) for k in shipped)


def test_keep_best_in_spyrl_measures_its_kept_best_on_fresh_games_as_stratagem_does(tmp_path):
    """SpyRL keeps a best as stratagem.py does, and measures it on fresh games at its end: without that, a
    resumed SpyRL run would find its best unmeasured, load, and do nothing, every time."""
    flags = ["--tiny", "--tiny-init", "random", "--batch-size", "5", "--num-envs", "4"]
    keep = [
        *KEEP[:6],
        "--keep-best",
        "--best-eval-n",
        "3",
        "--steps",
        "1",
        "--max-new-tokens",
        "16",
    ]
    out = tmp_path / "spy"
    assert spyrl.main(flags + keep + ["--out", str(out)]) == 0
    assert best_of(out)["fresh"]["n"] == 6  # 3 per id, two ids
    before = (out / "best" / "best.json").read_bytes()
    assert spyrl.main(["--resume", "--out", str(out)]) == 0
    assert (out / "best" / "best.json").read_bytes() == before
