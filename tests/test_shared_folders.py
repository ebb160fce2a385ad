"""Tests of what a shared run folder, the environment or a server's reply can make a command do: it writes only
inside the run folder or where the command line says, never through a link planted while it works; the API key
goes only where the start line says; no request freezes serve-judge; no reply of an opponent's server or flag
combination fakes a result."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
from pathlib import Path

import pytest

import judge_prompts
import stratagem as S
from machinery import UserError, flags, runfiles
from machinery.openai_api import openai_client
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    SMALL,
    completion,
    error_of,
    judge_server_fixture,
    no_process_left_behind,
    one_step_run_fixture,
    only_the_vllm_tests,
    run,
    secret_key_fixture,
    spawn,
    tiny_fixture,
)
from tools import ablation, agree, bench, plot, serve_judge, sync_check
from tools import eval as eval_tool


# ---- 1. writes stay in the run folder (or where the command line says), never through a link
def recorded_run(out: Path, **config) -> Path:
    """A run folder as a run leaves it before its first step: its config.json, with `config` set as a colleague's
    hand might set it."""
    args = S.parse_args(SMALL + ["--out", str(out)])
    out.mkdir()
    runfiles.write_config(out, {**flags.as_config(args), **config}, 0)
    return out


def test_resume_refuses_a_judge_cache_outside_the_run_folder_unless_the_command_line_names_it(
    tmp_path, capsys
):
    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir()
    victim.write_text("export PATH=~/bin:$PATH")  # no newline at its end: a resume would add one
    out = recorded_run(tmp_path / "run", judge_cache=str(victim))
    err = error_of(capsys, ["--resume", "--out", str(out), "--steps", "2"])
    assert err == (
        f"stratagem: error: --resume: {out / 'config.json'} keeps the judge's verdicts in {victim}, not in the "
        "run folder's own judge_cache.jsonl, and the run would read that file and append to it: if it is your "
        f"cache, confirm it with --judge-cache {victim}\n"
    )
    assert victim.read_text() == "export PATH=~/bin:$PATH"
    assert f"--judge-cache {victim}" in runfiles.resume_advice(out)  # the advice names it again
    confirmed = S.parse_args(["--resume", "--out", str(out), "--judge-cache", str(victim)])
    assert confirmed.judge_cache == str(victim)
    own = recorded_run(tmp_path / "own", judge_cache=str(tmp_path / "own" / "judge_cache.jsonl"))
    assert S.parse_args(["--resume", "--out", str(own)]).out == str(
        own
    )  # its own cache: nothing to confirm


def test_eval_writes_its_results_never_through_a_link_planted_while_the_games_play(
    tiny, tmp_path, monkeypatch, capsys
):
    victim, out = tmp_path / "thesis.tex", tmp_path / "shared" / "eval-1.json"
    victim.write_text("four years of work")
    out.parent.mkdir()
    play = eval_tool.play_matches

    def planting(*a, **kw):  # a colleague's link, made after eval checked the name
        out.symlink_to(victim)
        return play(*a, **kw)

    monkeypatch.setattr(eval_tool, "play_matches", planting)
    argv = ["eval", str(tiny), "--games", "TicTacToe-v0", "--n", "2", "--max-new-tokens", "8"]
    assert run(argv + ["--json", str(out)]) == 0
    assert victim.read_text() == "four years of work" and os.readlink(out) == str(victim)
    written = out.with_name("eval-1-2.json")
    assert json.loads(written.read_text())["opponent"] == "random"
    said = capsys.readouterr().out
    assert f"{out} appeared while the games played" in said and f"wrote {written}\n" in said


def test_plot_draws_into_the_folder_it_opened_never_one_linked_in_its_place(
    tmp_path, monkeypatch, capsys
):
    shared = tmp_path / "run"
    shared.mkdir()
    lines = [{"step": k, "loss": 1.0 / k, "response_tokens_mean": 4.0 + k} for k in (1, 2, 3)]
    (shared / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    draw = plot.draw_plot

    def swapping(plt, name, runs):  # plots/ swapped for a link while the first figure is drawn
        if not (shared / "plots").is_symlink():
            (shared / "plots").rename(shared / "plots-opened")
            (shared / "plots").symlink_to(victim)
        return draw(plt, name, runs)

    monkeypatch.setattr(plot, "draw_plot", swapping)
    assert run(["plot", str(shared)]) == 0
    assert list(victim.iterdir()) == []
    assert {p.name for p in (shared / "plots-opened").iterdir()} == {
        "loss.png",
        "response_length.png",
    }


def test_write_in_refuses_a_link_at_the_name_and_leaves_its_target(tmp_path):
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"theirs")
    folder = tmp_path / "plots"
    folder.mkdir()
    (folder / "loss.png").symlink_to(victim)
    fd = runfiles.open_folder(folder, follow=False)
    try:
        with pytest.raises(UserError, match="loss.png is a symbolic link"):
            runfiles.write_in(fd, folder / "loss.png", b"ours")
        runfiles.write_in(fd, folder / "beta.png", b"ours")
    finally:
        os.close(fd)
    assert victim.read_bytes() == b"theirs" and (folder / "beta.png").read_bytes() == b"ours"
    assert sorted(p.name for p in folder.iterdir()) == [
        "beta.png",
        "loss.png",
    ]  # no temporary file left
    (tmp_path / "linked").symlink_to(folder)
    with pytest.raises(UserError, match="linked is a symbolic link"):
        runfiles.open_folder(tmp_path / "linked", follow=False)


@pytest.mark.parametrize("tool", ["agree", "sync-check"])
def test_write_atomic_replaces_a_link_planted_at_agree_or_sync_check_json_and_leaves_its_target(
    one_step_run, tool, tmp_path, monkeypatch
):
    """The link at --json is replaced by the results (renamed into place), never written through. sync-check
    needs vLLM, so its last lines run here with the figures it would have measured."""
    victim, out = tmp_path / "thesis.tex", tmp_path / "shared" / "results.json"
    victim.write_text("four years of work")
    out.parent.mkdir()
    if tool == "agree":
        kappa = agree.cohen_kappa

        def planting(*a):  # a colleague's link, made after agree checked the name
            if not out.is_symlink():
                out.symlink_to(victim)
            return kappa(*a)

        monkeypatch.setattr(agree, "cohen_kappa", planting)
        argv = ["agree", str(one_step_run), "--judges", "heuristic", "heuristic"]
        assert run(argv + ["--json", str(out)]) == 0
        assert json.loads(out.read_text())["judges"] == {"A": "heuristic", "B": "heuristic"}
    else:
        out.symlink_to(victim)
        sync_check.write_results(out, {"lm_head": (0.001, 0.0001)}, True, "0.0-test")
        assert json.loads(out.read_text())["pass"] is True
    assert victim.read_text() == "four years of work" and not out.is_symlink()


def test_bench_refuses_to_append_through_a_link_planted_while_it_ran(tmp_path, monkeypatch, capsys):
    victim, out = tmp_path / "thesis.tex", tmp_path / "bench.jsonl"
    victim.write_text("four years of work")
    summary = bench.bench_summary

    def planting(metrics):  # made after bench checked --json, while it measured
        if not out.is_symlink():
            out.symlink_to(victim)
        return summary(metrics)

    monkeypatch.setattr(bench, "bench_summary", planting)
    small = ["--tiny", "--steps", "1", "--batch-size", "8", "--num-envs", "4"]
    err = error_of(capsys, ["bench", "--json", str(out), *small, "--max-new-tokens", "8"])
    assert f"{out} is a symbolic link (to {victim}); a run never writes through a link" in err
    assert victim.read_text() == "four years of work"


def test_ablation_writes_its_logs_and_table_never_through_a_planted_link(tmp_path, monkeypatch):
    victim = tmp_path / "thesis.tex"
    victim.write_text("four years of work")
    abl = tmp_path / "abl"
    abl.mkdir()
    (abl / "stratagem-s1.log").symlink_to(victim)
    monkeypatch.setattr(ablation.subprocess, "run", lambda *a, **kw: pytest.fail("trained"))
    with pytest.raises(UserError, match="stratagem-s1.log is a symbolic link"):
        ablation.train(abl / "stratagem-s1", "stratagem", 1, 2)
    (abl / "stratagem-s1.log").unlink()
    for arm in ablation.DEFAULT_ARMS:  # every run finished: main only writes the table
        (abl / f"{arm}-s1").mkdir()
        (abl / f"{arm}-s1" / "metrics.jsonl").write_text(
            json.dumps({"step": 2, "loss": 0.5}) + "\n"
        )

    def planting(rows, seeds, steps):  # the table's name linked while the runs were read
        (abl / "table.md").symlink_to(victim)
        return "| arm |\n"

    monkeypatch.setattr(ablation, "arm_row", lambda arm, runs: {"arm": arm})
    monkeypatch.setattr(ablation, "table", planting)
    assert ablation.main([str(abl), "--seeds", "1", "--steps", "2"]) == 0
    assert (
        victim.read_text() == "four years of work" and (abl / "table.md").read_text() == "| arm |\n"
    )


def test_append_jsonl_open_log_and_write_atomic_are_the_only_writers_outside_runfiles():
    """The class, not only its cases: outside machinery/runfiles.py, nothing opens a file to write with
    Path.write_text/write_bytes or open(..., "w"/"a"), which follow a link at the name. Exempt: refresh_docs,
    which rewrites the project's own docs, and real_model, which writes in a folder it has just made private."""
    import re

    pattern = re.compile(r"\.write_(text|bytes)\(|\bopen\([^)]*[\"'][wax]b?\+?[\"']")
    exempt = {"machinery/runfiles.py", "tools/refresh_docs.py", "tools/real_model.py"}
    root = Path(__file__).resolve().parents[1]
    files = [root / "stratagem.py", root / "spyrl.py", root / "judge_prompts.py"]
    files += [*root.glob("machinery/*.py"), *root.glob("games/*.py"), *root.glob("tools/*.py")]
    found = [
        f"{f.relative_to(root)}:{n}"
        for f in files
        if str(f.relative_to(root)) not in exempt
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


# ---- 2. the key goes where the start line says: OPENAI_BASE_URL is never taken silently
def test_validate_refuses_openai_base_url_from_the_environment_before_a_request(
    tmp_path, capsys, monkeypatch, judge_server, secret_key
):
    monkeypatch.setenv("OPENAI_BASE_URL", judge_server.url)
    argv = SMALL + ["--judge", "openai", "--steps", "1", "--out", str(tmp_path / "run")]
    err = error_of(capsys, argv)
    assert err == (
        f"stratagem: error: --judge openai: OPENAI_BASE_URL is set ({judge_server.url}), but requests go only "
        "to a base URL given (--judge-base-url), else to https://api.openai.com/v1, so that what is said and "
        "recorded is where the API key goes: give that URL there, or unset OPENAI_BASE_URL\n"
    )
    assert (
        judge_server.probes == 0 and judge_server.requests == [] and not (tmp_path / "run").exists()
    )
    named = S.parse_args(
        argv + ["--judge-base-url", judge_server.url]
    )  # said and recorded as given
    assert flags.as_config(named)["judge_base_url"] == judge_server.url


def test_openai_client_of_every_tool_refuses_openai_base_url_from_the_environment(
    tiny, tmp_path, capsys, monkeypatch, judge_server, secret_key
):
    monkeypatch.setenv("OPENAI_BASE_URL", judge_server.url)
    with pytest.raises(UserError, match=r"^an openai opponent: OPENAI_BASE_URL is set"):
        openai_client("", 5.0, 0, "an openai opponent", 16)
    argv = [
        "eval",
        str(tiny),
        "--games",
        "TicTacToe-v0",
        "--n",
        "2",
        "--opponent",
        "openai:judge-test",
    ]
    assert "OPENAI_BASE_URL is set" in error_of(capsys, argv + ["--json", str(tmp_path / "e.json")])
    assert judge_server.requests == [] and not (tmp_path / "e.json").exists()
    monkeypatch.setenv("OPENAI_BASE_URL", "https://api.openai.com/v1/")  # where requests go anyway
    assert openai_client("", 5.0, 0, "x", 16).base_url.host == "api.openai.com"


# ---- 3. no request freezes serve-judge
def test_serve_judge_answers_a_body_of_blank_quoted_lines_and_others_meanwhile(tmp_path):
    """400,000 blank quoted lines (0.8 MB) in one turn's response: the stand-in's structure count was quadratic in
    them (hours of one CPU, the lock of every thread held), so neither request below was answered."""
    text = (
        "Game: TicTacToe-v0. The player is Player 0.\n\n--- Turn 1 of 1 ---\nPlayer's response:\n"
    )
    text += "|\n" * 400_000 + "\nAction sent to the game:\n| [4]"
    body = json.dumps(
        {"model": "m", "messages": judge_prompts.build_messages("transferability", text)}
    )
    proc = spawn(["serve-judge", "--port", "0"], tmp_path)
    try:
        port = int(proc.stdout.readline().split("http://127.0.0.1:")[1].split("/")[0])
        posting = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        posting.request("POST", "/v1/chat/completions", body=body)  # returns once the body is sent
        listing = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        listing.request("GET", "/v1/models")  # while the stand-in reads the long one
        answers = {}
        for name, conn in (("models", listing), ("chat", posting)):
            resp = conn.getresponse()
            answers[name] = (resp.status, json.loads(resp.read()))
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert answers["models"] == (
        200,
        {
            "object": "list",
            "data": [{"id": "heuristic", "object": "model", "owned_by": "stratagem"}],
        },
    )
    status, reply = answers["chat"]
    verdict = json.loads(reply["choices"][0]["message"]["content"])
    assert status == 200 and verdict == {"alpha": 0.0, "sigma": 0.0, "rho": 0.0}
    assert err == "serve-judge: stopped\n"


@pytest.mark.parametrize("rubric", ["transferability", "evolution"])
def test_serve_judge_answers_a_rubric_request_without_turns_400_in_one_line(rubric, capfd):
    server = serve_judge.make_judge_server("127.0.0.1", 0, noise=0.0, seed=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        messages = judge_prompts.build_messages(rubric, "Game: Nim-v0. The player is Player 1.")
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"messages": messages}))
        resp = conn.getresponse()
        assert (resp.status, json.loads(resp.read())) == (
            400,
            {"error": {"message": "the trajectory has no turns"}},
        )
    finally:
        server.shutdown()
        server.server_close()
    assert capfd.readouterr().err == ""  # no traceback


# ---- 4. no reply of an opponent's server, no flag combination fakes a result
MALFORMED = {
    "choices null": {"choices": None},
    "choices a string": {"choices": "\\boxed{4}"},
    "content a list of parts": {
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": [{"type": "text", "text": "[4]"}]},
            }
        ]
    },
    "no message": {"choices": [{"index": 0, "finish_reason": "stop"}]},
}


@pytest.mark.parametrize("reply", MALFORMED.values(), ids=MALFORMED)
def test_eval_counts_a_malformed_opponent_reply_as_its_failure_never_the_models_win(
    tiny, tmp_path, capsys, judge_server, reply
):
    judge_server.behaviour = lambda body: (200, {**completion(""), **reply})
    out = tmp_path / "e.json"
    argv = ["eval", str(tiny), "--games", "TicTacToe-v0", "--n", "2", "--max-new-tokens", "8"]
    opponent = f"openai:judge-test@{judge_server.url}"
    err = error_of(capsys, argv + ["--opponent", opponent, "--json", str(out)])
    assert err.startswith(
        f"stratagem: error: the opponent openai:judge-test at {judge_server.url} failed a request ("
    )
    assert err.endswith(
        ") after 3 retries: the game would count as the model's win, so the evaluation ends here and writes "
        "nothing; check that server\n"
    )
    assert judge_server.requests and not out.exists()


def test_eval_reads_an_opponent_reply_cut_at_its_token_limit_as_a_move(
    tiny, tmp_path, judge_server
):
    cut = completion("I take the centre \\boxed{4}")
    cut["choices"][0]["finish_reason"] = "length"
    judge_server.behaviour = lambda body: (200, cut)
    out = tmp_path / "e.json"
    argv = ["eval", str(tiny), "--games", "TicTacToe-v0", "--n", "2", "--max-new-tokens", "8"]
    assert (
        run(argv + ["--opponent", f"openai:judge-test@{judge_server.url}", "--json", str(out)]) == 0
    )
    assert judge_server.requests and json.loads(out.read_text())["opponent"] == "openai:judge-test"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--eval-opponent", "minimax", "--eval-games", "TicTacToe-v0", "--keep-best"],
            "--keep-best keeps the policy of the highest win rate, and against --eval-opponent minimax no "
            "policy ever wins (a draw is the best there is), so it would keep step 0 whatever is learned: use "
            "--eval-opponent random",
        ),
        (
            ["--eval-opponent", "best-response", "--eval-games", "KuhnPoker-v1", "--keep-best"],
            "--keep-best keeps the policy of the highest win rate, which with --eval-opponent best-response is "
            "the random player's games', not the exploitability it measures: use --eval-opponent random",
        ),
        (
            [
                "--eval-opponent",
                "best-response",
                "--eval-games",
                "KuhnPoker-v1",
                "--error-allowance",
                "1",
            ],
            "--eval-opponent best-response reads each of the model's answers as a move of its play; with "
            "--error-allowance 1 an answer the game refused and asked again would count as one: pass "
            "--error-allowance 0",
        ),
    ],
)
def test_validate_refuses_evaluation_flags_that_cannot_mean_anything(
    tmp_path, capsys, argv, message
):
    out = tmp_path / "run"
    err = error_of(capsys, SMALL + ["--eval-every", "1", *argv, "--out", str(out)])
    assert err == f"stratagem: error: {message}\n" and not out.exists()


def test_eval_refuses_best_response_with_an_error_allowance(tmp_path, capsys):
    argv = ["eval", str(tmp_path / "m"), "--opponent", "best-response", "--error-allowance", "1"]
    assert error_of(capsys, argv) == (
        "stratagem: error: --opponent best-response reads each of the model's answers as a move of its play; "
        "with --error-allowance 1 an answer the game refused and asked again would count as one: pass "
        "--error-allowance 0\n"
    )


# ---- 6. plot on numbers no float holds
def test_plot_skips_a_value_of_400_digits_and_a_step_of_400_digits(tmp_path, capsys):
    shared = tmp_path / "run"
    shared.mkdir()
    huge = 10**400
    lines = [
        {
            "step": 1,
            "loss": 0.5,
            "coverage": {"KuhnPoker-v1": {"J": {"share": huge, "entropy": 1.0}}},
        },
        {
            "step": 2,
            "loss": 0.4,
            "eval": {
                "win_rate": huge,
                "win_ci95": [0.1, huge],
                "best_response": {"win_rate": huge},
            },
            "games": {"TicTacToe-v0": {"0": {"win": 1, "draw": 0, "loss": 0, "invalid": huge}}},
        },
        {"step": huge, "loss": 0.3},
    ]
    (shared / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert run(["plot", str(shared), "--out", str(tmp_path / "plots")]) == 0
    said = capsys.readouterr()
    assert "Traceback" not in said.err and "loss.png" in said.out and "coverage.png" in said.out
