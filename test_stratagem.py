"""Tests of the algorithm, in stratagem.py's own order: the flags (Args), Algorithm 1's step 1 (self-play: the
prompt, the action, the games), step 2 (RAE), step 3 (modulation: phi, psi, A_mod, imputation, adaptive beta),
step 4 (REINFORCE: the losses, the log-probs, policy_update), the policy backends (the tiny model, HF generation),
evaluation (play_matches) and train() as a whole run (the seeded reference runs, a tiny run's formulas).

Everything runs on the CPU and offline. The rest of the suite, one file per subject, is in tests/; the helpers
all of it shares are tests/common.py's. The README's test command runs both.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import stratagem as S
from machinery import adaptive_beta, distributed, lifecycle, matches, modulation, watch
from machinery import judge as J
from machinery.flags import CHOICES, field_docs
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    REFERENCE,
    REFERENCE_RUNS,
    SMALL,
    JudgeServer,
    ScriptedPolicy,
    assert_as_recorded,
    assert_resumed_exactly,
    check_run,
    completion,
    error_of,
    first_free,
    fresh,
    judge_server_fixture,
    learner,
    make_batch,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    rubric_of,
    run,
    run_fingerprint,
    secret_key_fixture,
    self_play,
    talkers_fixture,
    tiny_fixture,
)


# ==== Args: the flags, parsed and checked in one line (parse_args, validate, field_docs) ====
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--beta", "abc"], "invalid float value: 'abc'"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--ema", "1.5"], "--ema must be in [0, 1)"),
        (["--judge-sample-rate", "2"], "--judge-sample-rate must be in [0, 1]"),
        (["--lr", "nan"], "--lr must be in (0, 1], got nan"),
        (["--beta", "inf"], "--beta must be >= 0, got inf"),
        (["--mode", "ppo"], "invalid choice: 'ppo'"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--games", "TicTacToe-v0,Chess-v9"], "unknown game id 'Chess-v9'"),
        (["--games", "Sudoku-v0"], "cannot be played by two players"),
        (
            ["--model", "/nonexistent/model", "--judge", "heuristic"],
            "/nonexistent/model: no such directory",
        ),
        (["--tiny", "--model", "x"], "--tiny builds its own model"),
        (["--resume"], "--resume needs --out"),
        (
            ["--tiny", "--distill", "--mode", "spiral"],
            "--distill learns the judge of --mode stratagem; --mode spiral has none",
        ),
        (["--tiny", "--distill-kappa", "1.5"], "--distill-kappa must be in [0, 1], got 1.5"),
        (["--tiny", "--distill-audit-rate", "-0.1"], "--distill-audit-rate must be in [0, 1]"),
        (["--tiny", "--distill-window", "0"], "--distill-window must be >= 1"),
        (["--tiny", "--distill-lr", "0"], "--distill-lr must be in (0, 1]"),
        (
            ["--tiny", "--judge-shadow"],
            "--judge-shadow scores what does not enter A_mod: give --mode spiral or --no-psi",
        ),
        (
            ["--tiny", "--centre-psi", "--mode", "spiral"],
            "--centre-psi centres psi in A_mod, which --mode spiral",
        ),
        (["--tiny", "--centre-psi", "--no-psi"], "--centre-psi centres psi in A_mod"),
        (["--tiny", "--judge-structured", "maybe"], "invalid choice: 'maybe'"),
        (
            ["--tiny", "--keep-best", "--eval-every", "1", "--lora-rank", "4"],
            "--keep-best keeps whole models",
        ),
        (["--tiny", "--best-eval-n", "-1"], "--best-eval-n must be >= 0"),
        (["--mode", "spyrl"], "SpyRL has its own script: python spyrl.py --help"),
    ],
)
def test_parse_args_refuses_a_bad_flag_in_one_line_and_makes_no_folder(
    capsys, tmp_path, argv, message
):
    assert message in error_of(
        capsys, argv + ["--out", str(tmp_path / "never")] if argv != ["--resume"] else argv
    )
    assert not (tmp_path / "never").exists()


def test_FriendlyParser_names_the_nearest_flag_and_resume_of_a_folder_that_is_no_run_says_so(
    capsys, tmp_path
):
    assert error_of(capsys, ["--tiny", "--step", "3"]) == (
        "stratagem: error: unrecognized arguments: --step 3 (did you mean --steps?)\n"
    )
    assert "(did you mean --judge-base-url?)" in error_of(capsys, ["--judge-base-ulr=http://x/v1"])
    assert error_of(capsys, ["bench", "--tiny", "--stpes", "2"]).endswith(
        "(did you mean --steps?)\n"
    )
    assert error_of(capsys, ["--judge-sample", "0.5"]).endswith(
        "(did you mean --judge-sample-rate?)\n"
    )  # takes 0.5
    assert error_of(capsys, ["--judge-sample", "3"]).endswith(
        "(did you mean --judge-samples or --judge-sample-rate?)\n"
    )
    for folder, why in (
        (tmp_path, "it has no config.json"),
        (tmp_path / "missing", "it does not exist"),
    ):
        assert error_of(capsys, ["--resume", "--out", str(folder)]) == (
            f"stratagem: error: --resume --out {folder}: not a run folder ({why}); --out names the run to continue\n"
        )


def test_field_docs_give_every_flag_its_help_text():
    docs = field_docs(S.Args)
    assert set(docs) == {f.name for f in S.dataclasses.fields(S.Args)} and all(
        len(d) > 10 for _, d in docs.values()
    )
    paper, spiral = (
        "the paper's (STRATAGEM, Algorithm 1)",
        "SPIRAL's (the base; its paper and code)",
    )
    assert docs["beta"][0] == docs["lr"][0] == paper and docs["ppo_epochs"][0] == spiral
    assert docs["judge_timeout"][0] == "judge" and docs["lora_rank"][0] == "LoRA"
    groups = list(dict.fromkeys(group for group, _ in docs.values()))
    assert groups[:2] == [paper, spiral]  # --help opens on the paper's hyperparameters
    text = S.build_parser().format_help()
    assert "--judge-sample-rate" in text and "(default: 0.25)" in text and "--no-psi" in text


# ==== Algorithm 1, step 1: self-play (the prompt, the action read from a response, the games played in lockstep) ====
def test_format_prompt_writes_spirals_qwen_markup_and_other_families_use_their_template(
    tiny, tmp_path
):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _, tok = fresh(tiny)  # a Qwen3: SPIRAL's markup, whatever template the checkpoint ships
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )  # Qwen3's own, thinking switched off
    assert S.format_prompt(tok, "OBS", 1) == (
        "<|im_start|>user\nYou are playing a two-player zero-sum game as Player 1. Make valid actions to win.\n"
        "Observation: OBS\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    other = AutoTokenizer.from_pretrained(tiny)
    other.chat_template = "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(other),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(tmp_path / "llama")
    other.save_pretrained(tmp_path / "llama")
    _, llama_tok = S.load_policy(str(tmp_path / "llama"), torch.device("cpu"))
    assert not llama_tok.qwen_markup and S.format_prompt(llama_tok, "OBS", 0).startswith(
        "[INST] You are playing"
    )


@pytest.mark.parametrize(
    "response, action",
    [
        ("I take the centre. \\boxed{4}", "[4]"),
        ("first \\boxed{0} then no, \\boxed{[8]}", "[8]"),
        ("\\boxed{\\text{bet}}", "[bet]"),
        ("\\boxed{[Offer: 3 Sheep, 2 Ore -> 5 Brick]}", "[Offer: 3 Sheep, 2 Ore -> 5 Brick]"),
        ("\\boxed{f(x{1})}", "[f(x{1})]"),  # nested braces are matched
        ("no box, but I will [call] now", "[call]"),
        ("\\boxed{} then [fold]", "[fold]"),  # an empty box falls back to brackets
        ("\\boxed{unclosed [check]", "[check]"),
        ("asdf qwer ] [ zxcv", ""),
        ("", ""),
    ],
)
def test_parse_action_reads_the_last_box_else_the_last_bracket(response, action):
    assert S.parse_action(response) == action


def test_parse_action_of_a_very_long_output():
    junk = "{[" * 200_000 + "x" * 500_000
    assert S.parse_action(junk + "\\boxed{2}") == "[2]"
    assert S.parse_action("\\boxed{" + junk) == ""  # unclosed box, no closing bracket anywhere


def test_read_action_reads_moves_by_the_rule_it_is_given():
    """--action-rule spiral reads the trainer's move exactly as SPIRAL's code does, against the mover's legal moves;
    --action-rule lenient (the default) reads the last box, else the last bracket, and lets the game judge."""
    from games import actions

    kuhn = S.make_env("KuhnPoker-v1", 1, 0)
    pid, obs = kuhn.get_observation()
    read = {
        r: (lambda text, r=r: S.read_action(r, "KuhnPoker-v1", kuhn, pid, obs, text))
        for r in ("spiral", "lenient")
    }
    assert [
        read["spiral"](t) for t in ("[check]", "check", "\\boxed{Bet}", "\\boxed{ check }")
    ] == [
        "[check]",
        "[check]",
        actions.INVALID_ACTION,
        actions.INVALID_ACTION,
    ]
    assert [read["lenient"](t) for t in ("[check]", "check", "\\boxed{Bet}")] == [
        "[check]",
        actions.INVALID_ACTION,
        "[Bet]",
    ]
    assert S.Args().action_rule == "lenient" and CHOICES["action_rule"] == ("lenient", "spiral")


@pytest.mark.parametrize(
    "game", ["TicTacToe-v0", "KuhnPoker-v1", "SimpleNegotiation-v1", "SimpleNegotiation-v0"]
)
def test_self_play_a_response_without_an_action_loses_and_the_idle_seat_still_has_its_return(
    tiny, game
):
    """SPIRAL's code: no readable action is INVALID_ACTION, the game ends and the mover loses, in every game
    (TextArena's SimpleNegotiation-v0 took it as talk, "[]", and went on). The other seat never moved: its
    trajectory has no turns but carries its return, for RAE."""
    _, tok = fresh(tiny)
    args = S.Args(tiny=True, batch_size=5, num_envs=3)
    trajs, counts, _ = self_play(
        ScriptedPolicy(lambda p: "I have no idea"),
        tok,
        args,
        [game],
        random.Random(0),
        watch.Timer(),
        {},
        args.batch_size,
    )
    first = 1 if game == "KuhnPoker-v1" else 0  # SPIRAL's Kuhn Poker: Player 1 opens round 1
    assert len(trajs) >= 10 and [t.role for t in trajs[:2]] == [0, 1]
    for t in trajs:
        moved = t.role == first
        assert (len(t.turns), t.reward) == ((1, -1.0) if moved else (0, 1.0)) and (
            not moved or t.turns[0].action == ""
        )
    assert (
        counts[game][f"player{first}"]["invalid"]
        == len(trajs) // 2
        == counts[game][f"player{1 - first}"]["win"]
    )


def test_self_play_lockstep_one_call_per_turn_and_turn_cap_draw(tiny):
    _, tok = fresh(tiny)
    args = S.Args(tiny=True, batch_size=6, num_envs=2, max_turns=3)
    policy = ScriptedPolicy(lambda p: "I deny. \\boxed{Deny}")
    lengths: dict = {}
    trajs, counts, _ = self_play(
        policy,
        tok,
        args,
        ["SimpleNegotiation-v0"],
        random.Random(0),
        watch.Timer(),
        lengths,
        args.batch_size,
    )
    assert policy.calls[:3] == [2, 2, 2]  # both games in one call per turn
    assert all(t.reward == 0.0 for t in trajs) and sum(len(t.turns) for t in trajs) == 6
    assert (
        counts["SimpleNegotiation-v0"]["player0"]["draw"] == 2
        and lengths["SimpleNegotiation-v0"] == 3
    )


def test_past_context_ends_a_game_whose_prompt_leaves_no_room_as_a_draw_said_once(tiny, capsys):
    """A negotiation's prompt grows every turn; past the model's context less --max-new-tokens
    (policy.room) the game ends, a draw, before the policy is asked: the engine is never given a
    prompt it cannot answer (vLLM refuses one; HF ran past its positions without a word)."""
    _, tok = fresh(tiny)
    args = S.Args(tiny=True, batch_size=8, num_envs=2, max_turns=50)
    policy = ScriptedPolicy(lambda p: "I deny, and I say so at some length. \\boxed{Deny}")
    first = S.format_prompt(tok, S.make_env("SimpleNegotiation-v0", 1, 0).get_observation()[1], 0)
    policy.room = len(tok(first).input_ids) + 200  # a few turns of room
    trajs, counts, _ = self_play(
        policy, tok, args, ["SimpleNegotiation-v0"], random.Random(0), watch.Timer(), {}, 8
    )
    turns = [t for traj in trajs for t in traj.turns]
    assert turns and max(len(tok(t.prompt).input_ids) for t in turns) <= policy.room
    assert 2 <= max(len(traj.turns) for traj in trajs) < 25 and all(t.reward == 0.0 for t in trajs)
    assert counts["SimpleNegotiation-v0"]["player0"]["draw"] == len(trajs) // 2
    err = capsys.readouterr().err
    assert err.count(f"a prompt reached {policy.room} tokens, the model's context less") == 1


def test_self_play_plays_a_real_game_to_the_end(tiny):
    _, tok = fresh(tiny)
    args = S.Args(tiny=True, batch_size=1, num_envs=1)

    def first_free(prompt):  # take the first free cell listed in the last board
        moves = prompt.rsplit("Available Moves:", 1)[1]
        return "\\boxed{" + moves.split("'[")[1].split("]")[0] + "}"

    trajs, counts, _ = self_play(
        ScriptedPolicy(first_free),
        tok,
        args,
        ["TicTacToe-v0"],
        random.Random(0),
        watch.Timer(),
        {},
        args.batch_size,
    )
    assert [t.role for t in trajs] == [0, 1] and {t.reward for t in trajs} == {1.0, -1.0}
    assert [t.action for t in trajs[0].turns] == [
        "[0]",
        "[2]",
        "[4]",
        "[6]",
    ]  # 0-1-2 / 3-4-5 / 6: player 0 wins


def hacking_blocks() -> list[str]:
    """The python blocks of docs/hacking.md, in order: a new game, a new rubric dimension, a third rubric (only
    logged), a new estimator."""
    return re.findall(r"```python\n(.*?)```", (HERE / "docs" / "hacking.md").read_text(), re.DOTALL)


def project_copy(tmp_path: Path) -> Path:
    """A copy of the project to paste a recipe into, as a reader would edit theirs."""
    repo = tmp_path / "repo"
    shutil.copytree(
        HERE,
        repo,
        ignore=shutil.ignore_patterns(".git", ".venv*", ".ci-venv*", "runs", "__pycache__"),
    )
    return repo


def paste(path: Path, anchor: str, block: str, before: bool = False) -> None:
    """`block` pasted verbatim after (or before) the one place `anchor` stands in `path`."""
    text = path.read_text()
    assert text.count(anchor) == 1, f"{anchor!r} is not once in {path}"
    path.write_text(text.replace(anchor, block + anchor if before else anchor + block))


def python_in(repo: Path, *argv: str) -> str:
    """A command of the copy, which must succeed; its stdout."""
    proc = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=repo, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_make_env_takes_the_new_game_of_hacking_md_which_plays_trains_and_is_evaluated(tmp_path):
    """The recipe as written: the block saved as games/pile.py, `pile` added to games/__init__.py's import."""
    repo = project_copy(tmp_path)
    (repo / "games" / "pile.py").write_text(hacking_blocks()[0])
    init = repo / "games" / "__init__.py"
    assert init.read_text().count("from games import perfect, spiral, spy") == 1
    init.write_text(
        init.read_text().replace(
            "from games import perfect, spiral, spy", "from games import perfect, pile, spiral, spy"
        )
    )
    played = python_in(
        repo,
        "-c",
        "import stratagem as S\nenv = S.make_env('Pile-v0', 0, 0)\n"
        "for pid, action in [(0, '[2]'), (1, '[2]'), (0, '[2]'), (1, '[1]')]:\n"
        "    assert env.get_observation()[0] == pid and 'Pile' in env.get_observation()[1]\n"
        "    done, _ = env.step(action)\n"
        "print(done, S.game_result(env, done)[0])\n",
    )
    assert played.strip() == "True {0: -1.0, 1: 1.0}"  # Player 1 took the last stone
    flags = [
        "--games",
        "Pile-v0",
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--eval-games",
        "Pile-v0",
        "--out",
        "run",
    ]
    python_in(repo, "stratagem.py", *SMALL, *flags)
    last = read_jsonl(repo / "run" / "metrics.jsonl")[-1]
    assert set(last["games"]) == {"Pile-v0"} and {"Pile-v0/player0", "Pile-v0/player1"} <= set(
        last["baselines"]
    )
    assert (
        last["eval"]["games"]["Pile-v0"]["both"]["n"] == 4
    )  # against the random legal player, both seats
    # the warm start for the new game, then training from it: the recipe's two commands as printed, each
    # with a shorter budget appended (a flag given twice: the last wins)
    block = (HERE / "docs" / "hacking.md").read_text().split("Teach it the new game first")[1]
    commands = re.findall(r"```bash\n(.*?)```", block, re.DOTALL)[0].replace("\\\n", " ")
    build, training = [shlex.split(line) for line in commands.strip().splitlines()]
    assert build[:3] == ["python", "stratagem.py", "warmstart"] and training[:2] == build[:2]
    shorter = ["--steps", "40", "--moves", "300", "--eval-n", "4"]
    measured = python_in(repo, *build[1:], *shorter)
    assert "Pile-v0" in measured
    python_in(repo, *training[1:], "--steps", "1", "--out", "from-warm")
    (m,) = read_jsonl(repo / "from-warm" / "metrics.jsonl")
    assert m["games"].keys() == {"Pile-v0", "KuhnPoker-v1"}


# ==== Algorithm 1, step 2: the game advantage (RAE) ====
def test_rae_step_reads_the_baseline_before_updating_it():
    a, b = S.rae_step(0.0, 1.0, 0.95)
    assert (a, b) == (
        1.0,
        pytest.approx(0.05),
    )  # first return: advantage against b = 0, not against itself
    a, b = S.rae_step(b, 1.0, 0.95)
    assert a == pytest.approx(0.95) and b == pytest.approx(0.0975)
    a, b = S.rae_step(b, -1.0, 0.95)
    assert a == pytest.approx(-1.0975) and b == pytest.approx(0.95 * 0.0975 - 0.05)


def test_rae_advantages_update_the_idle_seats_baseline_as_spiral_does(tmp_path):
    """SPIRAL's prepare_trajectories folds both roles' returns into their baselines, a role that never moved
    included. In Kuhn Poker Player 1 opens; a random model writes no action, so Player 0 never moves."""
    out = tmp_path / "run"
    assert run(SMALL + ["--steps", "1", "--out", str(out), "--games", "KuhnPoker-v1"]) == 0
    metrics, trajs = check_run(
        out, 1, beta=0.2
    )  # replays RAE over every row, the turnless ones included
    idle = [t for t in trajs if not t["turns"]]
    assert idle and all(t["role"] == 0 and t["reward"] == 1.0 for t in idle)
    assert metrics[0]["baselines"]["KuhnPoker-v1/player0"] == pytest.approx(1 - 0.95 ** len(idle))
    assert metrics[0]["idle_seats"] == len(idle) and not any(t["judged"] for t in idle)


def replace_function(path: Path, name: str, block: str) -> None:
    """The top-level function `name` of `path` replaced by `block`, as a reader replaces it."""
    text = path.read_text()
    start = text.index(f"\ndef {name}(") + 1
    end = text.index("\n\n\n", start)
    path.write_text(text[:start] + block.rstrip("\n") + text[end:])


def test_validate_refuses_a_flag_the_advantage_estimator_no_longer_reads(monkeypatch):
    """A fork whose step 2 reads neither --ema nor --opponent-baselines (ADVANTAGE_FLAGS emptied) refuses
    them in one line, and only when they are given away from their defaults."""
    monkeypatch.setattr(S, "ADVANTAGE_FLAGS", ())
    assert S.parse_args(["--tiny", "--dry-run"]).ema == 0.95  # the default is no choice
    mix = ["--opponents", "self=0.8,random=0.2"]
    for given in (["--ema", "0.9"], [*mix, "--opponent-baselines"]):
        with pytest.raises(S.UserError) as e:
            S.parse_args(["--tiny", *given])
        assert str(e.value) == (
            f"--{given[-1].lstrip('-') if given[-1].startswith('--') else 'ema'} does nothing here: "
            "step 2's estimator does not read it (stratagem.ADVANTAGE_FLAGS); drop it"
        )
    monkeypatch.setattr(S, "ADVANTAGE_FLAGS", ("ema", "opponent_baselines"))
    assert S.parse_args(["--tiny", *mix, "--opponent-baselines", "--ema", "0.9"]).ema == 0.9


@pytest.mark.slow
def test_group_advantages_in_the_grpo_fork_of_hacking_md_touch_four_places_and_train(tmp_path):
    """The recipe as written: step 2's call replaced by the first block, token_weights and normaliser by the
    next two; a SPIRAL run of the warm start on Kuhn Poker, whose games have varied outcomes. Its advantages are
    group-relative, and its loss is the mean over responses of each response's mean token term."""
    repo = project_copy(tmp_path)
    source = repo / "stratagem.py"
    said = re.search(r"replace the line `([^`]+)`", (HERE / "docs" / "hacking.md").read_text())[1]
    (call,) = [x for x in source.read_text().splitlines(keepends=True) if said in x]  # once
    grouped, weights, divisor, reads = hacking_blocks()[3:7]
    source.write_text(source.read_text().replace(call, grouped))
    replace_function(source, "token_weights", weights)
    replace_function(source, "normaliser", divisor)
    line = 'ADVANTAGE_FLAGS = ("ema", "opponent_baselines")\n'
    assert source.read_text().count(line) == 1
    source.write_text(source.read_text().replace(line, reads))
    for unread in (["--ema", "0.9"], ["--opponent-baselines"]):  # the README's anti-collapse flag
        proc = subprocess.run(
            [sys.executable, "stratagem.py", "--tiny", "--mode", "spiral", *unread, "--dry-run"],
            capture_output=True,
            text=True,
            cwd=repo,
        )
        assert proc.returncode == 2 and proc.stderr == (
            f"stratagem: error: {unread[0]} does nothing here: step 2's estimator does not read it "
            "(stratagem.ADVANTAGE_FLAGS); drop it\n"
        )
    flags = [
        "--tiny",
        "--games",
        "KuhnPoker-v1",
        "--mode",
        "spiral",
        "--steps",
        "2",
        "--batch-size",
        "24",
    ]
    kept = ["--opponents", "self=0.6,past=0.2,random=0.2", "--kl-coef", "0.05"]  # they still act
    python_in(repo, "stratagem.py", *flags, *kept, "--num-envs", "8", "--out", "run")
    groups: dict = {}
    for r in read_jsonl(repo / "run" / "trajectories.jsonl"):
        if r["turns"]:
            groups.setdefault((r["step"], r["game"], r["role"]), []).append(r)
    assert any(
        len({r["reward"] for r in g}) > 1 for g in groups.values()
    )  # outcomes vary: not all zero
    for g in groups.values():
        rewards = [r["reward"] for r in g]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
        assert [r["a_game"] for r in g] == pytest.approx(
            [(x - mean) / (std + 1e-6) for x in rewards]
        )
        assert all(r["a_mod"] == r["a_game"] for r in g)  # SPIRAL: A_mod = A_game
    assert all(
        m["baselines"] == {} for m in read_jsonl(repo / "run" / "metrics.jsonl")
    )  # no table carried
    loss = python_in(
        repo,
        "-c",
        "import torch, stratagem as S\n"
        "logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])\n"
        "mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])\n"
        "w = S.token_weights(torch.tensor([2.0, -1.0]), mask)\n"
        "print(S.reinforce_loss(logps, w, S.normaliser(2, 48)).item())\n",
    )
    # -(2 * mean(-2, -3) + (-1) * mean(-0.5, -0.5)) / 2 = -(-5 + 0.5) / 2 = 2.25
    assert float(loss) == pytest.approx(2.25)


# ==== Algorithm 1, step 3: modulation (phi, psi, A_mod, imputation, the judged sample, adaptive beta) ====
def test_phi_psi_exact_values():
    def phi(alpha, sigma, rho):
        return S.phi({"alpha": alpha, "sigma": sigma, "rho": rho})

    def psi(d, a, c):
        return S.psi({"d": d, "a": a, "c": c})

    assert phi(0, 0, 0) == 0.0
    assert phi(1, 1, 1) == pytest.approx(1.0)
    assert phi(1, 0.5, 0) == pytest.approx(0.525)
    assert phi(0, 0, 1) == pytest.approx(0.30)
    assert psi(1, 1, 1) == pytest.approx(1.0)
    assert psi(-1, -1, -1) == pytest.approx(-1.0)
    assert psi(1, 0, -1) == pytest.approx(-0.05)
    assert psi(0, 1, 0) == pytest.approx(0.25)
    assert phi(1, 0.5, 0) == 0.35 * 1 + 0.35 * 0.5 + 0.30 * 0  # the paper's formula, bit for bit
    assert psi(1, 0, -1) == 0.35 * 1 + 0.25 * 0 + 0.40 * -1


def test_a_mod_exact_and_degenerate_cases():
    assert S.a_mod(0.5, 0.525, -0.05, 0.2) == pytest.approx(0.5 * 0.525 - 0.01)
    assert S.a_mod(-1.0, 1.0, 0.0, 0.2) == -1.0  # phi = 1, psi = 0: SPIRAL's advantage
    assert S.a_mod(0.7, 0.0, 1.0, 0.2) == pytest.approx(
        0.2
    )  # zero transferability: only beta*psi is left


def test_impute_with_mean_and_with_nothing_judged():
    filled, mean = S.impute([0.5, None, 1.0, None], default=1.0)
    assert filled == [0.5, 0.75, 1.0, 0.75] and mean == 0.75
    filled, mean = S.impute([None, None], default=0.0)
    assert filled == [0.0, 0.0] and mean is None


def test_sample_for_judging_is_a_seeded_fraction():
    assert S.sample_for_judging(10, 0.25, random.Random(0)) == S.sample_for_judging(
        10, 0.25, random.Random(0)
    )
    assert len(S.sample_for_judging(10, 0.25, random.Random(0))) == 3  # ceil(2.5)
    assert len(S.sample_for_judging(3, 0.01, random.Random(0))) == 1
    assert S.sample_for_judging(7, 0.0, random.Random(0)) == []
    assert S.sample_for_judging(7, 1.0, random.Random(0)) == list(range(7))


def test_modulate_imputes_failures_and_unjudged():
    args = S.Args(beta=0.2)
    trajs = [
        S.Trajectory("G", p % 2, [], 1.0, a_game=a) for p, a in enumerate([1.0, -1.0, 0.5, 0.0])
    ]
    ok = J.Judgement({"alpha": 1, "sigma": 1, "rho": 1, "d": 1, "a": 1, "c": 1}, None)
    ok2 = J.Judgement({"alpha": 0, "sigma": 0, "rho": 0, "d": -1, "a": -1, "c": -1}, None)
    failed = J.Judgement(None, "timeout")
    info = S.modulate(trajs, {0: ok, 1: ok2, 2: failed}, args.entering, args.beta)
    assert info == {"modulated": True, "phi_mean": 0.5, "psi_mean": 0.0}
    assert [t.judged for t in trajs] == [True, True, True, False]
    assert trajs[2].scores is None and trajs[2].phi == 0.5 and trajs[3].phi == 0.5
    assert trajs[0].a_mod == pytest.approx(1.0 * 1.0 + 0.2 * 1.0)
    assert trajs[1].a_mod == pytest.approx(-1.0 * 0.0 + 0.2 * -1.0)
    assert trajs[2].a_mod == pytest.approx(0.5 * 0.5)
    none = S.modulate(trajs, {3: failed}, args.entering, args.beta)  # only the verdicts given count
    assert none == {"modulated": False, "phi_mean": None, "psi_mean": None}
    assert [t.a_mod for t in trajs] == [t.a_game for t in trajs]


def test_modulate_with_no_rubric_entering_is_spiral_whatever_the_verdicts():
    trajs = [S.Trajectory("G", 0, [], 1.0, a_game=0.7)]
    ok = J.Judgement({"alpha": 0, "sigma": 0, "rho": 0, "d": 1, "a": 1, "c": 1}, None)
    info = S.modulate(trajs, {0: ok}, S.entering("spiral", False), 0.2)
    assert info["modulated"] is False and (trajs[0].phi, trajs[0].psi, trajs[0].a_mod) == (
        1.0,
        0.0,
        0.7,
    )


def test_centre_psi_centres_beta_psi_on_its_judged_mean():
    args = S.Args(beta=0.5, centre_psi=True)
    trajs = [S.Trajectory("G", p % 2, [], 1.0, a_game=a) for p, a in enumerate([1.0, -1.0, 0.5])]
    high = J.Judgement({"alpha": 1, "sigma": 1, "rho": 1, "d": 1, "a": 1, "c": 1}, None)  # psi 1
    low = J.Judgement(
        {"alpha": 1, "sigma": 1, "rho": 1, "d": -1, "a": 0, "c": 0}, None
    )  # psi -0.35
    info = S.modulate(trajs, {0: high, 1: low}, args.entering, args.beta)
    trajs[2].phi, trajs[2].psi = (
        0.0,
        1.0,
    )  # as --distill's trusted heads set them: psi 1, not the mean
    run = SimpleNamespace(args=args, runner=None, recent=[], distiller=None)
    info |= S.final_a_mod(run, trajs, [None] * 3, {}, args.beta)
    centre = (1.0 - 0.35) / 2  # over the judged: the heads' own levels are not a verdict
    assert info["psi_centre"] == pytest.approx(centre) and info["psi_mean"] == pytest.approx(centre)
    assert [t.psi for t in trajs] == pytest.approx(
        [1.0, -0.35, 1.0]
    )  # psi as judged, or as the heads say
    assert [t.a_mod for t in trajs] == pytest.approx(
        [1.0 + 0.5 * (1 - centre), -1.0 + 0.5 * (-0.35 - centre), 0.5 * 0 + 0.5 * (1 - centre)]
    )
    assert sum(t.a_mod - t.a_game * t.phi for t in trajs[:2]) == pytest.approx(
        0.0
    )  # the term adds nothing on average
    assert modulation.psi_centre(S.Args(), trajs) is None  # off: psi is the paper's


def test_judge_shadow_logs_the_scores_and_leaves_a_game_alone():
    args = S.Args(mode="spiral", judge_shadow=True)
    assert args.asked == ["transferability", "evolution"] and args.entering == []
    trajs = [S.Trajectory("G", 0, [], 1.0, a_game=0.7), S.Trajectory("G", 1, [], -1.0, a_game=-0.7)]
    ok = J.Judgement({"alpha": 1, "sigma": 0, "rho": 0, "d": 1, "a": 1, "c": 1}, None)
    info = S.modulate(trajs, {0: ok}, args.entering, args.beta)
    info |= modulation.rubric_scores(args, trajs, None, S.impute)
    assert info == {"modulated": False, "phi_mean": 0.35, "psi_mean": 1.0}
    assert [(t.phi, t.psi, t.a_mod) for t in trajs] == [(1.0, 0.0, 0.7), (1.0, 0.0, -0.7)]
    assert [t.logged for t in trajs] == [
        {"phi": 0.35, "psi": 1.0}
    ] * 2  # the unjudged: the judged mean
    no_psi = S.Args(no_psi=True, judge_shadow=True)
    assert no_psi.entering == ["transferability"] and len(no_psi.asked) == 2
    assert S.Args(no_psi=True).asked == ["transferability"]


def test_entering_and_asked_decide_what_each_mode_means():
    assert S.entering("stratagem", False) == ["transferability", "evolution"]
    assert S.entering("stratagem", True) == ["transferability"]
    assert S.entering("spiral", False) == [] and S.asked("spiral", False, False) == []
    assert S.asked("spiral", False, True) == list(S.RUBRICS) and S.asked(
        "stratagem", True, False
    ) == ["transferability"]


def by_role(body: dict):
    """Player 0's trajectories score phi 0.35, Player 1's phi 1: the batch means move with the mix of seats."""
    levels = (1, 1, 1) if "The player is Player 1" in body["messages"][-1]["content"] else (1, 0, 0)
    return 200, completion(json.dumps(dict(zip(("alpha", "sigma", "rho"), levels))))


def test_after_budget_gives_the_unjudged_the_recent_judged_means_and_resume_keeps_them(
    tmp_path, secret_key
):
    server = JudgeServer(by_role)
    flags = [
        "--judge",
        "openai",
        "--judge-base-url",
        server.url,
        "--judge-sample-rate",
        "1",
        "--no-psi",
    ]
    flags += [
        "--judge-concurrency",
        "1",
        "--judge-price-in",
        "10",
        "--judge-price-out",
        "20",
        "--judge-budget",
        "0.029",
    ]
    whole, part = tmp_path / "whole", tmp_path / "part"
    try:  # 0.0012 a request: the 25th, about step 3 of 12-transition steps, passes the budget
        assert run(SMALL + ["--steps", "6", "--out", str(whole)] + flags) == 0
        assert run(SMALL + ["--steps", "4", "--save-every", "1", "--out", str(part)] + flags) == 0
        assert (
            run(["--resume", "--out", str(part), "--steps", "6", "--judge-base-url", server.url])
            == 0
        )
    finally:
        server.close()
    metrics, trajs = check_run(
        whole, 6, beta=0.2, no_psi=True
    )  # replays the rule: the last 10 judged steps' means
    judged = [m for m in metrics if m["modulated"]]
    spent = [m for m in metrics if "imputed_after_budget" in m]
    last = len(
        judged
    )  # the step whose requests passed the budget: judged in part, the batch mean still
    assert (
        2 <= last <= 4
        and judged == metrics[:last]
        and spent == metrics[last:]
        and metrics[last - 1]["judge_skipped_budget"]
    )
    mean = sum(m["phi_mean"] for m in judged) / last
    assert all(m["imputed_after_budget"] == {"phi": pytest.approx(mean), "psi": 0.0} for m in spent)
    for t in (
        trajs
    ):  # the scale of A_mod over A_game: phi, continuous across the switch (phi = 1 would jump)
        if t["step"] > last and t["turns"]:
            assert t["phi"] == pytest.approx(mean) and t["a_mod"] == pytest.approx(
                t["a_game"] * mean
            )
    assert min(m["phi_mean"] for m in judged) <= mean <= max(m["phi_mean"] for m in judged) < 1
    assert_resumed_exactly(whole, part, 6)  # the recent means ride in the checkpoint


def judged_batch(a_games: list[float], phis: list[float], psis: list[float]) -> list:
    trajs = []
    for g, f, s in zip(a_games, phis, psis):
        t = S.Trajectory(
            "KuhnPoker-v1", 0, [S.Turn("", "", "[bet]", [], [])], 0.0, a_game=g, phi=f, psi=s
        )
        t.scores = {"alpha": 1.0}  # judged (the share reads the judged ones only)
        trajs.append(t)
    return trajs


def test_evolution_share_is_the_rms_ratio_over_the_judged_trajectories():
    trajs = judged_batch(
        [1.0, -1.0], [0.5, 0.5], [0.5, -0.5]
    )  # RMS(A_game*phi) = 0.5, RMS(psi) = 0.5
    unjudged = S.Trajectory(
        "KuhnPoker-v1", 1, [S.Turn("", "", "[bet]", [], [])], 0.0, a_game=9.0, phi=1.0, psi=1.0
    )
    assert adaptive_beta.evolution_share(trajs + [unjudged], 0.2) == pytest.approx(
        0.1 / (0.5 + 0.1)
    )  # the imputed left out
    assert (
        adaptive_beta.evolution_share([unjudged], 0.2) is None
        and adaptive_beta.evolution_share(judged_batch([0.0], [1.0], [0.0]), 1) is None
    )
    assert adaptive_beta.evolution_share(judged_batch([1.0], [1.0], [0.0]), 0.2) == 0.0


def test_next_beta_converges_to_the_share_moves_within_its_clip_and_holds_without_a_signal():
    """Synthetic batches whose A_game shrinks as RAE's baseline converges: a fixed beta's share drifts up, the
    controller's stays at the target; no step moves beta by more than 0.2 / horizon, nor out of [min, max]."""
    args = S.dataclasses.replace(
        S.Args(), beta_share=0.3, beta_horizon=5.0, beta_min=0.01, beta_max=2.0
    )
    run_, shares, fixed = SimpleNamespace(args=args, beta=0.2), [], []
    for step in range(400):
        scale = 1.0 / (1 + step / 50)  # |A_game| shrinks over the run
        batch = judged_batch([scale, -scale, 0.5 * scale], [0.6, 0.8, 0.7], [0.5, -0.5, 1.0])
        fixed.append(adaptive_beta.evolution_share(batch, 0.2))
        beta = run_.beta
        logged = adaptive_beta.step(run_, batch, beta)
        after = run_.beta
        assert (
            logged["value"] == beta
            and logged["target"] == 0.3
            and logged["share"] == adaptive_beta.evolution_share(batch, beta)
        )
        assert abs(after / beta - 1) <= 0.2 / 5.0 + 1e-12 and 0.01 <= after <= 2.0
        shares.append(logged["share"])
    assert fixed[-1] > fixed[0] + 0.2  # a fixed beta drifts with RAE's convergence
    assert all(abs(s - 0.3) < 0.01 for s in shares[-100:])  # the controller holds the target
    assert (
        adaptive_beta.next_beta(0.5, None, 0.3, 5.0, 0.05, 2.0) == 0.5
        and adaptive_beta.next_beta(0.5, 0.0, 0.3, 5.0, 0.05, 2.0) == 0.5
    )
    assert (
        adaptive_beta.next_beta(1.99, 0.01, 0.3, 1.0, 0.05, 2.0) == 2.0
        and adaptive_beta.next_beta(0.06, 0.9, 0.3, 1.0, 0.05, 2.0) == 0.05
    )
    off = SimpleNamespace(
        args=S.Args(), beta=None
    )  # --beta-share 0: beta fixed, the share measured all the same
    assert adaptive_beta.step(off, batch, 0.2) == {"value": 0.2, "share": fixed[-1], "target": None}
    assert off.beta is None  # a fixed beta is a value: nothing keeps it but Args


def test_beta_share_runs_logs_and_resumes_exactly(tmp_path, talkers):
    flags = (
        SMALL
        + talkers
        + ["--beta-share", "0.05", "--beta-horizon", "1", "--judge-sample-rate", "1"]
    )
    assert run(flags + ["--steps", "3", "--out", str(tmp_path / "whole")]) == 0
    metrics = read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    betas = [m["beta"]["value"] for m in metrics]
    assert (
        betas[0] == 0.2
        and len(set(betas)) == 3
        and all(m["beta"]["target"] == 0.05 for m in metrics)
    )
    for m, nxt in zip(
        metrics, betas[1:]
    ):  # each step's beta follows from the share the step before measured
        assert nxt == adaptive_beta.next_beta(
            m["beta"]["value"], m["beta"]["share"], 0.05, 1.0, 0.01, 1.0
        )
    trajs = read_jsonl(tmp_path / "whole" / "trajectories.jsonl")
    for r in trajs:  # A_mod with the step's own beta
        assert r["a_mod"] == pytest.approx(r["a_game"] * r["phi"] + betas[r["step"] - 1] * r["psi"])
    assert "adv/beta/value" in watch.scalars(metrics[0]) and "adv/beta/share" in watch.scalars(
        metrics[0]
    )
    assert run(flags + ["--steps", "2", "--save-every", "1", "--out", str(tmp_path / "part")]) == 0
    assert run(["--resume", "--out", str(tmp_path / "part"), "--steps", "3"]) == 0
    assert_resumed_exactly(tmp_path / "whole", tmp_path / "part", 3)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--beta-share", "1"], "--beta-share must be in [0, 1), got 1.0"),
        (["--beta-horizon", "0.5"], "--beta-horizon must be in [1, 1000000], got 0.5"),
        (
            ["--beta-share", "0.3", "--beta-max", "0.1"],
            "--beta 0.2 must lie in [--beta-min, --beta-max] = [0.01, 0.1]",
        ),
    ],
)
def test_beta_share_flags_out_of_range_are_refused_in_one_line(capsys, tmp_path, argv, message):
    assert message in error_of(capsys, ["--tiny", *argv, "--out", str(tmp_path / "never")])


def with_dimension_e(repo: Path) -> None:
    """docs/hacking.md's dimension, pasted verbatim into a copy's judge_prompts.RUBRICS as the recipe says: after
    "c", whose weight goes from 0.40 to 0.30. Nothing else is edited."""
    path = repo / "judge_prompts.py"
    paste(
        path, 'never more than one coherent throughout.""",\n            },\n', hacking_blocks()[1]
    )
    assert path.read_text().count('"weight": 0.40') == 1
    path.write_text(path.read_text().replace('"weight": 0.40', '"weight": 0.30'))


@pytest.mark.slow
def test_psi_takes_the_new_rubric_dimension_of_hacking_md_as_one_entry_in_the_table(tmp_path):
    """A copy of the project whose only change is the table: a tiny --distill run with multi-turn games (the
    policy's words end in talk SimpleNegotiation-v1 takes as a move), then `show` and `agree` on it."""
    repo = project_copy(tmp_path)
    with_dimension_e(repo)
    (repo / "drive.py").write_text(
        "import sys\nimport stratagem as S\n\ngenerate = S.HFPolicy.generate\n"
        "S.HFPolicy.generate = lambda self, prompts: [(p, r, t + ' \\\\boxed{Let us talk}') "
        "for p, r, t in generate(self, prompts)]\nsys.exit(S.main(sys.argv[1:]))\n"
    )
    flags = [
        "--games",
        "SimpleNegotiation-v1",
        "--distill",
        "--judge-sample-rate",
        "1",
        "--steps",
        "2",
    ]
    python_in(repo, "drive.py", *SMALL, *flags, "--out", "run")
    rows = [r for r in read_jsonl(repo / "run" / "trajectories.jsonl") if r["scores"]]
    assert rows and all(
        set(r["scores"]) == {"alpha", "sigma", "rho", "d", "a", "c", "e"} for r in rows
    )
    for r in (
        rows
    ):  # psi with the new weights; the stand-in gives "e", a dimension it has no feature for, 0
        s = r["scores"]
        assert (
            r["psi"] == pytest.approx(0.35 * s["d"] + 0.25 * s["a"] + 0.30 * s["c"] + 0.10 * s["e"])
            and s["e"] == 0
        )
        assert "e" in r["predicted"]["levels"]  # a seventh head
    shown = python_in(repo, "stratagem.py", "show", "run", "--judged", "--index", "0")
    assert re.search(r"d -?\d  a -?\d  c -?\d  e 0  -> psi", shown)
    agreed = python_in(
        repo,
        "stratagem.py",
        "agree",
        "run",
        "--judges",
        "heuristic",
        "distilled:run",
        "--sample",
        "20",
    )
    assert "kappa e" in agreed and "kappa alpha" in agreed


@pytest.mark.slow
def test_modulate_logs_the_third_rubric_of_hacking_md_and_every_tool_sees_it(tmp_path):
    """The recipe as written: a rubric of role "logged" pasted at the end of RUBRICS, PROMPT_VERSION bumped. A tiny
    run asks it and records its score beside phi and psi, which it leaves alone; show, agree and --dry-run's cost
    see it; the stand-in gives a rubric it has no feature for the middle level."""
    repo = project_copy(tmp_path)
    path = repo / "judge_prompts.py"
    paste(
        path, "\n}\n\n# Where a rubric's levels", hacking_blocks()[2], before=True
    )  # RUBRICS' end
    path.write_text(
        path.read_text().replace('PROMPT_VERSION = "stratagem-rubric-', 'PROMPT_VERSION = "forked-')
    )
    flags = [
        "--tiny",
        "--games",
        "KuhnPoker-v1",
        "--judge-sample-rate",
        "1",
        "--steps",
        "2",
        "--batch-size",
        "24",
    ]
    kept = ["--opponents", "self=0.6,past=0.2,random=0.2", "--kl-coef", "0.05"]  # they still act
    python_in(repo, "stratagem.py", *flags, *kept, "--num-envs", "8", "--out", "run")
    rows = [r for r in read_jsonl(repo / "run" / "trajectories.jsonl") if r["scores"]]
    assert rows and all(r["scores"]["m"] == 0.5 and r["logged"] == {"f": 0.5} for r in rows)
    for r in rows:  # phi and psi as the paper's table makes them; A_mod ignores f
        s = r["scores"]
        assert r["phi"] == pytest.approx(0.35 * s["alpha"] + 0.35 * s["sigma"] + 0.30 * s["rho"])
        assert r["a_mod"] == pytest.approx(r["a_game"] * r["phi"] + 0.2 * r["psi"])
    metrics = [m for m in read_jsonl(repo / "run" / "metrics.jsonl") if "loss" in m]
    assert all(m["f_mean"] == 0.5 and m["levels_mean"]["m"] == 0.5 for m in metrics)
    shown = python_in(repo, "stratagem.py", "show", "run", "--judged", "--index", "0")
    assert "m 0.5  -> f = 0.5000" in shown
    agreed = python_in(
        repo, "stratagem.py", "agree", "run", "--judges", "heuristic", "heuristic", "--sample", "10"
    )
    assert "kappa m" in agreed and "spearman f" in agreed
    planned = python_in(
        repo, "stratagem.py", "--dry-run", "--judge-model", "gpt-4o", "--out", "never"
    )
    assert "transferability + evolution + faithfulness" in planned


# ==== Algorithm 1, step 4: REINFORCE (the losses, the log-probs, policy_update) ====
def test_reinforce_loss_exact_value():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    # -(2 * (-5) + (-1) * (-1)) / 10 = 0.9
    assert S.reinforce_loss(logps, S.token_weights(adv, mask), 10.0).item() == pytest.approx(0.9)


def test_ppo_clip_loss_against_hand_computed_ratios_and_clipping():
    logps = torch.log(
        torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]])
    ).requires_grad_()  # old = 0: r = these
    mask, adv = torch.ones(2, 3), torch.tensor([1.0, -1.0])
    loss, ratio, clipped = S.ppo_clip_loss(
        logps, torch.zeros(2, 3), S.token_weights(adv, mask), 1.0, 0.2
    )
    # A=+1: min(r, clip r) = 1.2 (clipped), 0.5, 1.1; A=-1: min(-r, -clip r) = -1.5, -0.8 (clipped), -1.1
    assert loss.item() == pytest.approx(-(1.2 + 0.5 + 1.1 - 1.5 - 0.8 - 1.1))
    assert torch.allclose(ratio, torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]]))
    assert clipped.tolist() == [[True, False, False], [False, True, False]]
    loss.backward()  # d/dlogp of -A r is -A r where the clip is not binding, 0 where it is
    assert torch.allclose(logps.grad, torch.tensor([[0.0, -0.5, -1.1], [1.5, 0.0, 1.1]]))


def test_ppo_clip_loss_first_epoch_gradient_is_the_reinforce_gradient_exactly():
    torch.manual_seed(0)
    logps = -torch.rand(3, 5) * 4  # [3, 5]
    mask = (torch.rand(3, 5) > 0.3).float()
    adv = torch.tensor([1.3, -0.7, 0.2])
    grads = []
    for ppo in (False, True):
        x = logps.clone().requires_grad_()
        weights = S.token_weights(adv, mask)
        loss = (
            S.ppo_clip_loss(x, x.detach(), weights, 7.0, 0.2)[0]
            if ppo
            else S.reinforce_loss(x, weights, 7.0)
        )
        loss.backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_kl_k3_value_and_gradient_against_a_hand_computation():
    logps = torch.tensor(
        [[math.log(0.5), math.log(0.2)], [math.log(0.3), math.log(0.3)]], requires_grad=True
    )
    ref = torch.tensor([[math.log(0.25), math.log(0.4)], [math.log(0.3), math.log(0.6)]])
    kl = S.kl_k3(logps, ref)  # exp(d) - d - 1, d = log ref - log pi
    assert kl.flatten().tolist() == pytest.approx(
        [0.5 - math.log(0.5) - 1, 2 - math.log(2) - 1, 0.0, 2 - math.log(2) - 1]
    )
    kl.sum().backward()
    # d/d log pi of exp(d) - d - 1 = 1 - exp(d) = 1 - ref / pi
    assert logps.grad.flatten().tolist() == pytest.approx([0.5, -1.0, 0.0, -1.0])


def test_sequence_logprobs_of_left_padded_rows_match_unpadded(tiny):
    model, _ = fresh(tiny)
    items = [([5, 6, 7, 8, 9], [10, 11]), ([12, 13], [14, 15, 16, 17])]
    ids, attn, mask = S.collate(items, pad_id=0)
    with torch.no_grad():
        batched = S.sequence_logprobs(model, ids, attn, mask.shape[1], 1.0)  # [2, 4]
        for row, (p, r) in enumerate(items):
            full = torch.tensor([p + r])
            alone = S.token_logprobs(model(full).logits[:, :-1], full[:, 1:])[0, -len(r) :]
            assert torch.allclose(batched[row, -len(r) :], alone, atol=1e-5)
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def logp_of(model, prompt, response) -> float:
    ids, attn, mask = S.collate([(prompt, response)], 0)
    with torch.no_grad():
        return (S.sequence_logprobs(model, ids, attn, mask.shape[1], 1.0) * mask).sum().item()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_policy_update_moves_logprob_in_the_direction_of_the_advantage(tiny, sign):
    model, tok = fresh(tiny)
    args = S.Args(tiny=True, lr=1e-3, max_new_tokens=8, micro_batch_size=2)
    prompt, response = tok("You are playing").input_ids, tok(" [4]").input_ids
    before = logp_of(model, prompt, response)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    S.policy_update(
        learner(model, opt, args, distributed.Dist()), make_batch(prompt, [response], [sign]), 8.0
    )
    assert sign * (logp_of(model, prompt, response) - before) > 0


def test_policy_update_is_the_same_for_any_micro_batch_size(tiny):
    """SGD with lr 1 and no clipping moves each weight by minus its gradient: the accumulated
    gradient must be the same for micro-batches of 1 and of the whole batch."""
    deltas = []
    for mb in (1, 3):
        model, tok = fresh(tiny)
        args = S.Args(tiny=True, max_new_tokens=8, micro_batch_size=mb, max_grad_norm=1e9)
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        batch = make_batch(tok("Obs").input_ids, [[3, 4], [5], [6, 7, 8]], [1.0, -0.5, 0.25])
        S.policy_update(
            learner(model, torch.optim.SGD(model.parameters(), lr=1.0), args, distributed.Dist()),
            batch,
            24.0,
        )
        deltas.append(torch.cat([p.detach().flatten() for p in model.parameters()]) - before)
    assert deltas[0].abs().max() > 0 and torch.allclose(deltas[0], deltas[1], atol=1e-6)


def test_policy_update_scores_tokens_at_the_sampling_temperature(tiny):
    model, _ = fresh(tiny)
    items = [([5, 6, 7], [3, 4], 1.0), ([8, 9], [5, 6, 7], -0.5)]
    trajs = [S.Trajectory("toy", 0, [S.Turn("", "", "", p, r)], 0.0, a_mod=a) for p, r, a in items]
    ids, attn, mask = S.collate([(p, r) for p, r, _ in items], 0)
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)
        ).logits
    expected = {}
    for t in (0.2, 1.0, 1.7):
        logps = (
            torch.log_softmax(logits[:, -4:-1] / t, -1).gather(-1, ids[:, -3:, None]).squeeze(-1)
        )  # by hand
        expected[t] = -(torch.tensor([1.0, -0.5])[:, None] * logps * mask).sum().item() / 30.0
        args = S.Args(tiny=True, temperature=t, micro_batch_size=2, max_grad_norm=1e9)
        got = S.policy_update(
            learner(model, torch.optim.SGD(model.parameters(), lr=0.0), args, distributed.Dist()),
            trajs,
            30.0,
        )["loss"]
        assert got == pytest.approx(expected[t], rel=1e-5), t
    assert expected[0.2] != pytest.approx(expected[1.0], rel=1e-3)  # far beyond the tolerance above


def test_policy_update_with_two_ppo_epochs_matches_a_hand_computed_update(tiny):
    """SGD, lr 20, no gradient clipping: epoch 1 is one REINFORCE step; epoch 2 is one step on the clipped
    surrogate with r = pi_1 / pi_0 per token. Replayed by hand with per-token log-probs, and the logged
    ratio mean and clip fraction checked against the hand-computed ratios."""
    prompt, responses, advs = [5, 6, 7], [[8, 9, 10], [11], [12, 13]], [1.0, -0.5, 0.8]
    lr, eps, norm = 20.0, 0.05, 24.0
    args = S.Args(
        tiny=True,
        max_new_tokens=8,
        micro_batch_size=2,
        max_grad_norm=1e9,
        ppo_epochs=2,
        clip_range=eps,
    )
    model, _ = fresh(tiny)
    upd = S.policy_update(
        learner(model, torch.optim.SGD(model.parameters(), lr=lr), args, distributed.Dist()),
        make_batch(prompt, responses, advs),
        norm,
    )

    hand, _ = fresh(tiny)
    opt = torch.optim.SGD(hand.parameters(), lr=lr)
    items = [(prompt, r) for r in responses]
    ids, attn, mask = S.collate(items, 0)
    adv = torch.tensor(advs)

    def logps():
        return S.sequence_logprobs(hand, ids, attn, mask.shape[1], 1.0)  # [3, R]

    old = logps().detach()
    opt.zero_grad()
    (-(adv[:, None] * logps() * mask).sum() / norm).backward()  # epoch 1: REINFORCE
    opt.step()
    new = logps()
    r = torch.exp(new - old)  # [3, R]
    bound = torch.where(adv[:, None] > 0, torch.clamp(r, max=1 + eps), torch.clamp(r, min=1 - eps))
    binding = torch.where(adv[:, None] > 0, r > 1 + eps, r < 1 - eps) & mask.bool()
    opt.zero_grad()
    (
        -(adv[:, None] * bound * mask).sum() / norm
    ).backward()  # epoch 2: min(A r, A clip r) written out by case
    opt.step()
    for p, q in zip(model.parameters(), hand.parameters()):
        assert torch.allclose(p, q, atol=1e-5)
    [epochs] = [upd["epochs"]]
    summary = lifecycle.ppo_summary([epochs], 1)
    assert summary["ratio_mean"][0] == pytest.approx(1.0) and summary["clip_frac"][0] == 0.0
    assert summary["ratio_mean"][1] == pytest.approx(
        ((r * mask).sum() / mask.sum()).item(), rel=1e-5
    )
    assert summary["clip_frac"][1] == pytest.approx((binding.sum() / mask.sum()).item())
    assert (
        0 < summary["clip_frac"][1] < 1 and abs(summary["ratio_mean"][1] - 1) > 1e-3
    )  # both branches exercised
    assert upd["loss"] == pytest.approx(sum(summary["loss"]) / 2)


def test_policy_update_with_kl_coef_matches_a_hand_written_loss(tiny):
    """Zero advantages: the update is the KL term alone. SGD with lr 1 moves each weight by minus its
    gradient, which must equal the gradient of kl_coef * sum_t mask * (exp(d) - d - 1) / normaliser."""
    model, tok = fresh(tiny)
    reference, _ = fresh(tiny)
    with torch.no_grad():  # a reference that differs from the policy
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference.requires_grad_(False)
    args = S.Args(tiny=True, max_new_tokens=8, micro_batch_size=2, max_grad_norm=1e9, kl_coef=0.3)
    prompt = tok("Obs").input_ids
    batch = make_batch(prompt, [[3, 4], [5], [6, 7, 8]], [0.0, 0.0, 0.0])
    expected = fresh(tiny)[0]
    ids, attn, mask = S.collate([(prompt, r) for r in ([3, 4], [5], [6, 7, 8])], 0)
    logps = S.sequence_logprobs(expected, ids, attn, mask.shape[1], 1.0)
    with torch.no_grad():
        ref = S.sequence_logprobs(reference, ids, attn, mask.shape[1], 1.0)
    d = ref - logps
    (0.3 * ((torch.exp(d) - d - 1) * mask).sum() / 24.0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    S.policy_update(
        learner(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),
            args,
            distributed.Dist(),
            reference=reference,
        ),
        batch,
        24.0,
    )
    moved = [b - p.detach() for b, p in zip(before, model.parameters())]
    assert max(m.abs().max() for m in moved) > 0
    assert all(torch.allclose(m, p.grad, atol=1e-6) for m, p in zip(moved, expected.parameters()))
    same = fresh(tiny)[0].requires_grad_(
        False
    )  # the reference equal to the policy: no KL gradient at all
    S.policy_update(
        learner(
            model := fresh(tiny)[0],
            torch.optim.SGD(model.parameters(), lr=1.0),
            args,
            distributed.Dist(),
            reference=same,
        ),
        batch,
        24.0,
    )
    assert all(
        torch.allclose(p, q, atol=1e-6)
        for p, q in zip(model.parameters(), fresh(tiny)[0].parameters())
    )


def test_policy_update_learns_a_toy_one_turn_task_with_hf_sampling(tiny):
    """REINFORCE with the real update and the real HF sampler: reward responses whose first token is
    even; within a few dozen updates the policy puts much more mass on even first tokens."""
    model, tok = fresh(tiny)
    args = S.Args(tiny=True, lr=1e-2, max_new_tokens=2, micro_batch_size=32, temperature=1.0)
    policy = S.HFPolicy(model, tok, args, torch.device("cpu"))
    prompt_text = S.format_prompt(tok, "Pick a move.", 0)
    prompt = tok(prompt_text, add_special_tokens=False).input_ids
    even = torch.arange(model.config.vocab_size) % 2 == 0

    def p_even() -> float:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1]
        return torch.softmax(logits, -1)[even].sum().item()

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    before = p_even()
    torch.manual_seed(0)
    for _ in range(30):
        samples = policy.generate([prompt_text] * 16)
        rewards = [1.0 if r[0] % 2 == 0 else 0.0 for _, r, _ in samples]
        mean = sum(rewards) / len(rewards)
        S.policy_update(
            learner(model, opt, args, distributed.Dist(), pad=tok.pad_token_id),
            make_batch(prompt, [r for _, r, _ in samples], [x - mean for x in rewards]),
            32.0,
        )
    after = p_even()
    assert before < 0.7 and after > 0.9, (before, after)


def test_ppo_epochs_are_logged_by_a_tiny_run(tmp_path):
    out = tmp_path / "run"
    assert (
        run(
            SMALL
            + [
                "--steps",
                "1",
                "--mode",
                "spiral",
                "--out",
                str(out),
                "--ppo-epochs",
                "3",
                "--adam-betas",
                "0.9,0.95",
                "--lr",
                "0.01",
            ]
        )
        == 0
    )
    [m] = read_jsonl(out / "metrics.jsonl")
    assert len(m["ppo"]["loss"]) == len(m["ppo"]["ratio_mean"]) == len(m["ppo"]["clip_frac"]) == 3
    assert m["ppo"]["ratio_mean"][0] == pytest.approx(1.0) and m["ppo"]["clip_frac"][0] == 0.0
    assert m["ppo"]["ratio_mean"][2] != pytest.approx(1.0, abs=1e-6)
    assert m["loss"] == pytest.approx(sum(m["ppo"]["loss"]) / 3)
    state = torch.load(out / "checkpoints" / "step-000001" / "trainer_state.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)


# ==== Policy backends: the tiny model, loading a policy, HF generation ====
def test_build_random_model_loads_with_plain_from_pretrained_and_generates(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    assert model.config.model_type == "qwen3"
    ids = tok("Observation: [4]", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]


def test_load_policy_takes_a_mistyped_local_model_path_as_one_line_without_asking_the_hub(
    tmp_path, capsys, monkeypatch
):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    for path in ("runs/stratagem-tiny-s1-typo", "runs/a/b", "./typo"):
        assert error_of(capsys, ["eval", path]) == f"stratagem: error: {path}: no such directory\n"


def test_stop_ids_are_spirals_eos_only_for_a_base_model(tiny):
    """SPIRAL's run sets no stop: vLLM stops at the tokenizer's EOS and the generation config's. A base
    checkpoint (EOS <|endoftext|>) is not stopped at <|im_end|>; a chat one (EOS <|im_end|>) is."""
    model, tok = fresh(tiny)
    end, im_end = (
        tok.convert_tokens_to_ids("<|endoftext|>"),
        tok.convert_tokens_to_ids("<|im_end|>"),
    )
    tok.eos_token = "<|endoftext|>"
    model.generation_config.eos_token_id = end
    assert S.stop_ids(tok, model) == [end]
    tok.eos_token = "<|im_end|>"
    model.generation_config.eos_token_id = [im_end, end]
    assert S.stop_ids(tok, model) == sorted([im_end, end])


def test_stop_ids_keep_the_tokenizers_eos_when_the_generation_config_names_another(tiny):
    model, tok = fresh(tiny)
    end, im_end = (
        tok.convert_tokens_to_ids("<|endoftext|>"),
        tok.convert_tokens_to_ids("<|im_end|>"),
    )
    tok.eos_token = "<|im_end|>"
    for eos in (end, [end]):
        model.generation_config.eos_token_id = eos
        assert S.stop_ids(tok, model) == sorted([im_end, end])


# ==== Evaluation: matches against a fixed opponent (play_matches) ====
def test_legal_actions_are_read_off_the_game_and_leave_its_dice_alone():
    env = S.make_env("TicTacToe-v0", 1, 0)
    pid, obs = env.get_observation()
    assert sorted(matches.legal_actions(env, pid, obs)) == sorted(f"[{i}]" for i in range(9))
    env = S.make_env("ConnectFour-v0", 1, 0)
    pid, obs = env.get_observation()
    assert sorted(matches.legal_actions(env, pid, obs)) == [f"[col {i}]" for i in range(7)]
    env = S.make_env("PigDice-v0", 1, 0)
    pid, obs = env.get_observation()
    state = random.getstate()
    assert (
        sorted(matches.legal_actions(env, pid, obs)) == ["[hold]", "[roll]"]
        and random.getstate() == state
    )
    assert "[Bid: 3, 4]" in matches.candidate_actions(
        "make a bid like '[Bid: 3, 4]' or '[Call]' [GAME] [Player 1]"
    )
    assert "[GAME]" not in matches.candidate_actions("[GAME] [Player 0] [roll]")


def test_wilson_interval_known_values():
    lo, hi = matches.wilson(5, 10)
    assert (round(lo, 3), round(hi, 3)) == (0.237, 0.763)
    assert (
        matches.wilson(0, 10)[0] == 0.0
        and matches.wilson(10, 10)[1] == 1.0
        and matches.wilson(0, 0) == (0.0, 1.0)
    )


def test_FreshSeeds_draws_seeds_no_evaluation_draws():
    fresh, evaluation = S.FreshSeeds(1), random.Random(1)
    drawn = [fresh.randrange(2**31) for _ in range(1000)]
    assert all(2**31 <= x < 2**32 for x in drawn) and not set(drawn) & {
        evaluation.randrange(2**31) for _ in range(1000)
    }
    again = S.FreshSeeds(1)
    assert drawn == [again.randrange(2**31) for _ in range(1000)]  # seeded


def test_play_matches_alternates_seats_and_scores_from_the_models_seat(tiny):
    _, tok = fresh(tiny)
    games = S.schedule(["TicTacToe-v0"], 6, random.Random(0))
    assert [seat for _, seat, _, _ in games] == [0, 1, 0, 1, 0, 1]  # the model's seat alternates
    opponent = matches.RandomPlayer(random.Random(0))
    records = S.play_matches(
        ScriptedPolicy(first_free), tok, opponent, games, S.Rules(max_turns=50), 4
    )
    assert [r["seat"] for r in sorted(records, key=lambda r: r["seat"])] == [0, 0, 0, 1, 1, 1]
    assert not any(r["invalid"] or r["opponent_invalid"] for r in records)
    summary = matches.summarize_matches(records)
    cell = summary["games"]["TicTacToe-v0"]["both"]
    assert cell["n"] == 6 and sum(cell[k]["count"] for k in ("win", "draw", "loss")) == 6
    assert summary["win_rate"] == cell["win"]["count"] / 6


# ==== train(): Algorithm 1 as a whole run ====
def test_train_runs_the_four_steps_of_algorithm_1_in_order_and_step_4_learns_step_3s_a_mod(
    tmp_path, monkeypatch, talkers
):
    """train() is Algorithm 1: every step of a tiny run calls self-play (1), RAE (2), the judge and the modulation
    (3) and REINFORCE (4) in that order, each on what the one before made: RAE, the judge and REINFORCE take the
    trajectories self-play played, modulate takes the judge's verdicts, and step 4's loss weighs each turn of a
    player by the A_mod = A_game * phi + beta * psi that step 3 gave its trajectory, not by A_game (games of ten
    turns give psi a say). The real functions run, each wrapped only to see what it is given and gives."""
    calls, seen = [], {}

    def watch_calls(name, check):
        original = getattr(S, name)

        def wrapped(*args, **kwargs):
            calls.append(name)
            out = original(*args, **kwargs)
            check(out, *args)
            return out

        monkeypatch.setattr(S, name, wrapped)

    def played(out, *args):
        seen.update(played=list(out[0]), weighed=[])

    def takes_the_played(trajs):
        assert [id(t) for t in trajs] == [id(t) for t in seen["played"]]

    def judged(out, run, trajs, *args):
        takes_the_played(trajs)
        seen["judged"] = out[0]

    def modulated(out, trajs, judgements, rubrics, beta):
        assert judgements is seen["judged"]
        assert all(t.a_mod == pytest.approx(t.a_game * t.phi + beta * t.psi) for t in trajs)
        # each turn of a trajectory weighs the trajectory's A_mod
        seen["a_mod"] = sorted(t.a_mod for t in trajs for _ in t.turns)

    def learned(out, run, mine, *args):
        takes_the_played(mine)
        assert seen["a_mod"] and sorted(seen["weighed"]) == pytest.approx(seen["a_mod"], abs=1e-6)

    watch_calls("self_play", played)
    watch_calls("rae_advantages", lambda out, trajs, *args: takes_the_played(trajs))
    watch_calls("judge_sample", judged)
    watch_calls("modulate", modulated)
    watch_calls("reinforce", learned)
    token_weights = S.token_weights

    def weighed(advantages, mask):
        seen["weighed"] += advantages.tolist()
        return token_weights(advantages, mask)

    monkeypatch.setattr(S, "token_weights", weighed)
    out = tmp_path / "run"
    flags = ["--steps", "2", "--judge-sample-rate", "0.5", "--out", str(out)]
    assert run(SMALL + talkers + flags) == 0
    assert calls == ["self_play", "rae_advantages", "judge_sample", "modulate", "reinforce"] * 2
    trajs = read_jsonl(out / "trajectories.jsonl")
    assert any(t["a_mod"] != pytest.approx(t["a_game"]) for t in trajs if t["turns"])


GOOD_PHI, GOOD_PSI = 0.35 * 1 + 0.35 * 0.5 + 0.30 * 0, 0.35 * 1 + 0.25 * 0 + 0.40 * -1


def test_train_tiny_run_stratagem_with_a_real_local_judge(
    tmp_path, judge_server, secret_key, capsys, talkers
):
    out = tmp_path / "run"
    assert (
        run(
            SMALL
            + talkers
            + [
                "--steps",
                "2",
                "--out",
                str(out),
                "--judge",
                "openai",
                "--judge-base-url",
                judge_server.url,
                "--judge-model",
                "judge-test",
                "--judge-sample-rate",
                "0.5",
                "--beta",
                "0.3",
            ]
        )
        == 0
    )
    metrics, trajs = check_run(out, 2, beta=0.3)
    judged = [t for t in trajs if t["judged"]]
    assert judged and all(len(t["turns"]) == 5 for t in trajs)
    assert all(
        t["phi"] == pytest.approx(GOOD_PHI) and t["psi"] == pytest.approx(GOOD_PSI) for t in judged
    )
    assert len(judge_server.requests) == 2 * len(judged)  # one request per rubric
    lines = (
        capsys.readouterr().out.splitlines()
    )  # the projection follows the start line, before anything is paid
    assert lines[1].startswith("judge requests: ~") and lines[2].startswith(
        "judge tokens a request: ~"
    )
    assert (
        lines[3]
        == "judge money: judge-test is not in the price table of 2025-06; pass --judge-price-in/out to see money"
    )
    assert all(r["auth"] == f"Bearer {secret_key}" for r in judge_server.requests)
    assert sum(m["judge_prompt_tokens"] for m in metrics) == 100 * len(judge_server.requests)
    everything = "".join(
        p.read_text(errors="ignore") for p in out.rglob("*") if p.is_file() and p.suffix != ".pt"
    )
    assert secret_key not in everything + "\n".join(lines)


def test_mode_spiral_tiny_run_sends_no_judge_request(tmp_path, judge_server, secret_key):
    out = tmp_path / "run"
    assert (
        run(
            SMALL
            + [
                "--steps",
                "2",
                "--out",
                str(out),
                "--mode",
                "spiral",
                "--judge",
                "openai",
                "--judge-base-url",
                judge_server.url,
            ]
        )
        == 0
    )
    check_run(out, 2, beta=0.2, mode="spiral")
    assert judge_server.requests == []


def test_no_psi_tiny_run_requests_only_transferability(tmp_path, judge_server, secret_key):
    out = tmp_path / "run"
    assert (
        run(
            SMALL
            + [
                "--steps",
                "2",
                "--out",
                str(out),
                "--no-psi",
                "--judge",
                "openai",
                "--judge-base-url",
                judge_server.url,
                "--judge-sample-rate",
                "1",
            ]
        )
        == 0
    )
    _, trajs = check_run(out, 2, beta=0.2, no_psi=True)
    assert all(
        t["psi"] == 0.0 and t["a_mod"] == pytest.approx(t["a_game"] * GOOD_PHI) for t in trajs
    )
    assert {rubric_of(r["body"]) for r in judge_server.requests} == {"transferability"}


@pytest.mark.parametrize("mode", sorted(REFERENCE_RUNS))
def test_train_seeded_runs_match_the_recorded_reference(tmp_path, mode):
    """A change that adds a mode or a flag must leave STRATAGEM and SPIRAL exactly as they were. The reference
    was recorded by the code before such changes; a change that is meant to alter these runs (a new default,
    a rule fixed) records it again with STRATAGEM_RECORD_REFERENCE=1 and says why in its commit."""
    assert run(REFERENCE_RUNS[mode] + ["--out", str(tmp_path / "run")]) == 0
    got = json.loads(json.dumps(run_fingerprint(tmp_path / "run")))  # as JSON stores it
    if os.environ.get("STRATAGEM_RECORD_REFERENCE") == "1":
        recorded = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
        REFERENCE.write_text(json.dumps({**recorded, mode: got}, indent=1, sort_keys=True) + "\n")
    assert_as_recorded(got, json.loads(REFERENCE.read_text())[mode])
