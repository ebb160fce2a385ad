"""Tests of what a shared run folder's files may hold (the fifth attack, docs/reliability.md): a
recorded judge URL gets no request until the user confirms it, config.json's and the checkpoint's
values are typed and bounded as their flags are, and their strings reach the terminal neutralised.
Each failed before its fix (or, for the two survivors, fails with the mutant that passed before)."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch

import stratagem as S
from machinery import cli, runfiles
from tests.common import (  # noqa: F401  (fixtures, found by name; the autouse two by import)
    SMALL,
    JudgeServer,
    error_of,
    no_process_left_behind,
    not_for_the_vllm_tests,
    one_step_run_fixture,
    only_the_vllm_tests,
    run,
    secret_key_fixture,
)

# A terminal title, a clear screen, a right-to-left override; and the same neutralised.
ESCAPES = "\x1b]0;owned\x07\x1b[2J\u202e"
SHOWN = "\\x1b]0;owned\\x07\\x1b[2J\\u202e"


def copy_run(one_step_run: Path, tmp_path: Path, **config) -> Path:
    """A copy of the one-step run, its config.json's `config` keys set as a colleague's might be."""
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return out


def resume(out: Path, *flags: str) -> list[str]:
    return ["--resume", "--out", str(out), "--steps", "2", *flags]


# ---- the judge URL of a resumed run: the user's to confirm
class Listener:
    """A port that listens and never answers: whether anything connected, read from its backlog."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"

    def connected(self) -> bool:
        try:
            self.sock.accept()[0].close()
        except BlockingIOError:
            return False
        return True


def test_resume_sends_nothing_to_a_recorded_judge_url_until_the_command_line_confirms_it(
    one_step_run, tmp_path, capsys, secret_key
):
    listener = Listener()
    judged = {"judge": "openai", "judge_timeout": 2.0, "judge_retries": 0}
    out = copy_run(one_step_run, tmp_path, judge_base_url=listener.url, **judged)
    try:
        assert error_of(capsys, resume(out)) == (
            f"stratagem: error: --resume: {out}/config.json sends the judge's requests, with your "
            f"API key, to {listener.url}: if that is your judge, confirm it with "
            f"--judge-base-url {listener.url} (or name another)\n"
        )
        assert not listener.connected()  # not a request, not a connection
    finally:
        listener.sock.close()
    planted = "http://127.0.0.1:9/v1" + ESCAPES  # neutralised in the line, as any file's string
    out = copy_run(one_step_run, tmp_path / "escapes", judge_base_url=planted, **judged)
    assert f"to http://127.0.0.1:9/v1{SHOWN}: if" in error_of(capsys, resume(out))
    server = JudgeServer()  # the URL given again on the command line: the user's choice, used
    try:
        out = copy_run(one_step_run, tmp_path / "confirmed", judge_base_url=server.url, **judged)
        assert run(resume(out, "--judge-base-url", server.url)) == 0
        assert server.probes == 1 and all(
            r["auth"] == f"Bearer {secret_key}" for r in server.requests
        )
    finally:
        server.close()


# ---- config.json: every value as its flag takes it, else one line naming the file, key and value
@pytest.mark.parametrize(
    "key, value, wording",
    [
        ("batch_size", "16", '"16", but --batch-size must be an integer'),
        ("games", ["TicTacToe-v0"], '["TicTacToe-v0"], but --games must be a string'),
        ("seed", 1.5, "1.5, but --seed must be an integer"),
        ("beta", None, "null, but --beta must be a number"),
        ("max_new_tokens", "48", '"48", but --max-new-tokens must be an integer'),
        ("eval_games", 5, "5, but --eval-games must be a string"),
        ("invalid_rewards", 5, "5, but --invalid-rewards must be a string"),
        ("temperature", "hot", '"hot", but --temperature must be a number'),
        ("no_psi", 1, "1, but --no-psi must be true or false"),
        ("steps", True, "true, but --steps must be an integer"),
        ("mode", "bogus", '"bogus", but --mode must be one of stratagem, spiral, spyrl'),
        ("batch_size", 0, "0, but --batch-size must be >= 1"),
        ("temperature", 1e-9, "1e-09, but --temperature must be in [0.001, 100]"),
        ("judge_sample_rate", float("nan"), "NaN, but --judge-sample-rate must be in [0, 1]"),
    ],
)
def test_resume_refuses_a_config_value_its_flag_would_refuse_naming_the_file_key_and_value(
    one_step_run, tmp_path, capsys, key, value, wording
):
    out = copy_run(one_step_run, tmp_path, **{key: value})
    before = (out / "config.json").read_bytes()
    assert error_of(capsys, resume(out)) == (
        f"stratagem: error: {out}/config.json: {key} is {wording}; correct it, or restore the file "
        "from a copy\n"
    )
    assert (out / "config.json").read_bytes() == before  # nothing written
    assert not (out / "config_history.jsonl").exists()


def test_resume_takes_a_whole_number_where_a_number_is_recorded(one_step_run, tmp_path):
    """What float() takes of a flag, a config may hold: 0 where 0.0 is meant (the price table's)."""
    out = copy_run(one_step_run, tmp_path, temperature=1, judge_price_in=0)
    assert run(resume(out)) == 0


def test_show_and_plot_refuse_a_config_value_of_the_wrong_type_in_one_line(
    one_step_run, tmp_path, capsys
):
    out = copy_run(one_step_run, tmp_path, beta="0.2" + ESCAPES)
    for command in (["show", str(out)], ["plot", str(out), "--out", str(tmp_path / "plots")]):
        assert error_of(capsys, command) == (
            f"stratagem: error: {out}/config.json: beta is "
            '"0.2\\u001b]0;owned\\u0007\\u001b[2J\\u202e", but --beta must be a number; correct '
            "it, or restore the file from a copy\n"
        )


def test_read_config_of_json_nested_past_pythons_limit_is_damaged_in_one_line(
    one_step_run, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    (out / "config.json").write_text("[" * 100_000)
    assert "config.json is damaged (maximum recursion depth exceeded" in error_of(
        capsys, resume(out)
    )


# ---- trainer_state.pt and rank0.pt: typed, and a checkpoint's step is its folder's
def edit_state(out: Path, name: str, edit) -> Path:
    path = out / "checkpoints" / "step-000001" / name
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    return path


BAD_NUMPY = ["MT19937", [2**40] * 624, 0, 0, 0.0]  # a key past uint32: NumPy raises OverflowError


@pytest.mark.parametrize(
    "name, edit, message",
    [
        (
            "trainer_state.pt",
            lambda s: s.update(judge_totals={"requests": 3, "cost": "0.5"}),
            "is not a checkpoint of this project: 'judge_totals' is not the judge's totals or null",
        ),
        (
            "trainer_state.pt",
            lambda s: s.update(beta="0.2"),
            "'beta' is not --beta-share's beta (null, or a number --beta takes)",
        ),
        (
            "trainer_state.pt",
            lambda s: s.update(beta=1e300),
            "'beta' is not --beta-share's beta (null, or a number --beta takes)",
        ),
        (
            "trainer_state.pt",
            lambda s: s.update(recent=5),
            "'recent' is not the recent judged steps' means, [{score: number}]",
        ),
        (
            "trainer_state.pt",
            lambda s: s.update(recent=[{"phi": "high"}]),
            "'recent' is not the recent judged steps' means, [{score: number}]",
        ),
        ("rank0.pt", lambda s: s["rng"].update(numpy=BAD_NUMPY), "'rng' is not the RNG states"),
        (
            "rank0.pt",
            lambda s: s["rng"].update(numpy=["MT19937", [1] * 3, 0, 0, 0.0]),
            "'rng' is not the RNG states",
        ),
        ("rank0.pt", lambda s: s["rng"].update(python=(3, {"a": 1}, None)), "'rng' is not"),
        (
            "trainer_state.pt",
            lambda s: s.update(step=10**15),
            "records step 1000000000000000, but its folder is step-000001: a checkpoint's step is "
            "its folder's name",
        ),
        (
            "trainer_state.pt",
            lambda s: s.update(step=0),
            "records step 0, but its folder is step-000001",
        ),
    ],
)
def test_resume_refuses_a_checkpoint_value_of_the_wrong_kind_in_one_line(
    one_step_run, tmp_path, capsys, name, edit, message
):
    out = copy_run(one_step_run, tmp_path)
    path = edit_state(out, name, edit)
    err = error_of(capsys, resume(out))
    assert err.startswith(f"stratagem: error: --resume: {path} ") and message in err
    assert err.endswith("; restore it\n")


def test_resume_of_a_checkpoint_written_before_beta_and_recent_were_kept(one_step_run, tmp_path):
    out = copy_run(one_step_run, tmp_path)
    edit_state(out, "trainer_state.pt", lambda s: [s.pop("beta"), s.pop("recent")])
    assert run(resume(out)) == 0


# ---- escapes from a file's string, neutralised in every line
def test_latest_checkpoint_warning_neutralises_a_folder_names_escapes(tmp_path, capsys):
    (tmp_path / "checkpoints" / f"step-{ESCAPES}").mkdir(parents=True)
    assert runfiles.latest_checkpoint(tmp_path) is None
    err = capsys.readouterr().err
    assert f"step-{SHOWN}" in err and "\x1b" not in err and "\u202e" not in err


def test_resume_start_line_neutralises_a_recorded_models_escapes(one_step_run, tmp_path, capsys):
    model = tmp_path / f"model{ESCAPES}"
    shutil.copytree(one_step_run / "checkpoints" / "step-000001", model)
    out = copy_run(one_step_run, tmp_path, tiny=False, model=str(model))
    assert run(resume(out)) == 0
    said = capsys.readouterr().out
    assert f"model {tmp_path}/model{SHOWN}," in said and "\x1b" not in said and "\u202e" not in said


def test_closing_line_neutralises_the_escapes_of_best_json(tmp_path, capsys):
    (tmp_path / "best").mkdir()
    fresh = {"win_rate": 0.5, "win_ci95": [0.2, 0.8], "n": 4}
    best = {"step": ESCAPES, "win_rate": 0.75, "fresh": fresh}
    (tmp_path / "best" / "best.json").write_text(json.dumps(best))
    args = S.Args(out=str(tmp_path), keep_best=True, eval_every=1)
    assert cli.main("stratagem", [], lambda argv: args, lambda a: tmp_path, {}) == 0
    said = capsys.readouterr().out
    assert f"best/: step {SHOWN}, win 0.500" in said and "\x1b" not in said


# ---- flag hygiene
@pytest.mark.parametrize("more", [[], ["--eval-every", "1"]])
def test_best_eval_n_without_keep_best_is_refused_like_its_siblings(tmp_path, capsys, more):
    argv = SMALL + ["--best-eval-n", "7", *more, "--out", str(tmp_path / "never")]
    assert error_of(capsys, argv) == (
        "stratagem: error: --best-eval-n sizes the kept best's fresh evaluation: give --keep-best\n"
    )
    assert not (tmp_path / "never").exists()
