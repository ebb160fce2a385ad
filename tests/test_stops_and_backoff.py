"""Tests of how a run stops and backs off, in-process on the tiny model: a stop signal held during an updated
step and a second one that breaks the hold (machinery/distributed.py's handler and hold), the step kept on a
stop (lifecycle's keep_step) and a save that a stop interrupted, the out-of-memory retry (halve_on_oom), the
coverage guard's repeated warning (guard), and the KL reference of a resumed run."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch

import stratagem as S
from machinery import distributed, lifecycle, truth
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    SMALL,
    assert_resumed_exactly,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    run,
)

# SPIRAL's advantages are the games' own (no judge), never all zero: every step moves the weights
SPIRAL = SMALL + ["--mode", "spiral", "--seed", "5"]
HELD = distributed.HELD.decode()


@pytest.fixture(autouse=True)
def stop_signals_given_back():
    """A run stopped in this process keeps its stop handler (cli.main leaves it till exit): this module's tests
    give the test session its own handlers back."""
    before = {s: signal.getsignal(s) for s in distributed.STOP_SIGNALS}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.fixture(scope="module", name="whole")
def whole_fixture(tmp_path_factory):
    """The uninterrupted run of five steps the stopped ones resume to."""
    out = tmp_path_factory.mktemp("whole") / "run"
    assert run(SPIRAL + ["--steps", "5", "--out", str(out)]) == 0
    return out


def signalled_after_update(monkeypatch, step: int, signals: int) -> None:
    """`signals` real Ctrl-Cs sent to this process right after step `step`'s update changed the weights."""
    update, calls = S.policy_update, []

    def update_then_signal(*a, **kw):
        result = update(*a, **kw)
        calls.append(1)
        if len(calls) == step:
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(S, "policy_update", update_then_signal)


def advice(out, step: int) -> str:
    return (
        f"stratagem: stopped by Ctrl-C (continue from step-{step:06d} with: python stratagem.py "
        f"--resume --out {out})\n"
    )


def checkpoints(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


# ---- a stop held during an updated step, and a second signal that stops at once
def test_stop_handler_stops_at_once_on_a_second_signal_after_an_update_with_no_later_step_line(
    tmp_path, monkeypatch, capfd
):
    """Two Ctrl-Cs after step 4's update: the first is held (the step would end and be saved), the second
    stops the run there, exit code 130, before step 4's line; steps 1-3 are what the files hold."""
    out = tmp_path / "run"
    signalled_after_update(monkeypatch, step=4, signals=2)
    assert run(SPIRAL + ["--steps", "5", "--save-every", "2", "--out", str(out)]) == 130
    printed, err = capfd.readouterr()
    steps = [x.split()[1] for x in printed.splitlines() if x.startswith("step ")]
    assert steps == ["1/5", "2/5", "3/5"], printed
    assert err == HELD + advice(out, 2), err
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize(("signals", "kept"), [(1, 4), (2, 2)], ids=["held", "held-then-again"])
def test_keep_step_after_a_stop_in_an_updated_step_keeps_no_changed_weights_and_resumes_exactly(
    tmp_path, monkeypatch, capfd, whole, signals, kept
):
    """A Ctrl-C after step 4's update (--save-every 2): held, step 4 ends and is saved; a second Ctrl-C stops
    before step 4 ends, so the checkpoint of step 2 stands (step 3, finished but unsaved, is not saved then:
    the weights in memory are step 4's). Either way --resume replays the uninterrupted run exactly."""
    out = tmp_path / "run"
    signalled_after_update(monkeypatch, step=4, signals=signals)
    assert run(SPIRAL + ["--steps", "5", "--save-every", "2", "--out", str(out)]) == 130
    assert capfd.readouterr().err == HELD + advice(out, kept)
    assert checkpoints(out) == [f"step-{kept:06d}"]
    monkeypatch.undo()
    assert run(["--resume", "--out", str(out)]) == 0
    assert_resumed_exactly(whole, out, 5)


def test_keep_step_does_not_try_again_a_save_that_a_stop_interrupted_and_the_run_resumes_exactly(
    tmp_path, monkeypatch, capfd, whole
):
    """A Ctrl-C while step 2's checkpoint is written: that save is given up, not begun again on the way out
    (the user asked to stop), step 1's checkpoint stands, and --resume replays the uninterrupted run."""
    out, save, begun = tmp_path / "run", torch.save, []

    def save_interrupted(obj, f, *a, **kw):
        if str(f).endswith(".tmp-step-000002/trainer_state.pt"):
            begun.append(1)
            if len(begun) == 1:
                os.kill(os.getpid(), signal.SIGINT)
        return save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save_interrupted)
    assert run(SPIRAL + ["--steps", "5", "--save-every", "1", "--out", str(out)]) == 130
    assert capfd.readouterr().err == advice(out, 1)
    assert begun == [1] and checkpoints(out) == ["step-000001"]
    monkeypatch.undo()
    assert run(["--resume", "--out", str(out)]) == 0
    assert_resumed_exactly(whole, out, 5)


# ---- the out-of-memory retry
def test_halve_on_oom_a_second_out_of_memory_says_one_retry_and_records_the_micro_batch_it_ran_at(
    tmp_path, monkeypatch, capsys
):
    """Out of memory at micro-batch 4, then again at 2: one "trying again" line, config.json and the run's
    arguments say 2 (the micro-batch the last try ran at), and the error line says the same."""
    sizes = []

    def always_out_of_memory(model, ids, *rest):
        sizes.append(ids.shape[0])
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB")

    monkeypatch.setattr(S, "sequence_logprobs", always_out_of_memory)
    out = tmp_path / "run"
    argv = SPIRAL + ["--micro-batch-size", "4", "--steps", "2", "--out", str(out)]
    assert run(argv) == 2
    printed, err = capsys.readouterr()
    retries = [x for x in printed.splitlines() if "trying the step again" in x]
    assert retries == [
        "step 1: out of memory at micro-batch 4: trying the step again at micro-batch 2, kept for the steps "
        "after (config.json)"
    ]
    assert err.startswith(
        "stratagem: error: step 1: out of memory in the update again at micro-batch 2 (after 4); "
    ) and ("resume with --micro-batch-size 1 " in err)
    assert set(sizes) == {4, 2} and sizes[0] == 4 and sizes[-1] == 2
    assert json.loads((out / "config.json").read_text())["micro_batch_size"] == 2
    assert read_jsonl(out / "config_history.jsonl") == [
        {"step": 1, "changed": {"micro_batch_size": [4, 2]}}
    ]


# ---- the coverage guard
def test_guard_warns_again_when_an_invalid_move_share_recovers_and_falls_again(capsys):
    """An evaluation's invalid-move share over 10 %: a warning; still over: none; back under, then over again:
    a warning again (once a spell over, not once a run)."""
    game = "KuhnPoker-v1"
    guarded = SimpleNamespace(first_spots=None, warned=set(), truth=truth.History())

    def evaluated(step: int, rate: float) -> list[str]:
        evaluation = {"games": {game: {"both": {"invalid": {"rate": rate}}}}, "spots": {}}
        lifecycle.guard(guarded, {"step": step, "coverage": {}, "eval": evaluation})
        return capsys.readouterr().err.splitlines()

    said = (
        "stratagem: warning: step {}: evaluation: KuhnPoker-v1 lost {} of its games by an invalid "
        "move (over 0.1)"
    )
    assert evaluated(1, 0.5) == [said.format(1, 0.5)]
    assert evaluated(2, 0.4) == []
    assert evaluated(3, 0.05) == []
    assert evaluated(4, 0.3) == [said.format(4, 0.3)]
    assert evaluated(5, 0.3) == []


# ---- the KL reference of a resumed run
@pytest.fixture(scope="module", name="kl_whole")
def kl_whole_fixture(tmp_path_factory):
    out = tmp_path_factory.mktemp("kl") / "run"
    assert run(SPIRAL + ["--kl-coef", "0.5", "--steps", "3", "--out", str(out)]) == 0
    return out


def test_resume_with_kl_coef_takes_the_initial_policy_as_the_reference_and_resumes_exactly(
    tmp_path, kl_whole
):
    """--kl-coef's reference after --resume is the run's initial policy (rebuilt), not the checkpoint's
    weights: the KL at the step after the checkpoint is the uninterrupted run's, above 0."""
    out = tmp_path / "run"
    assert run(SPIRAL + ["--kl-coef", "0.5", "--steps", "2", "--out", str(out)]) == 0
    assert run(["--resume", "--out", str(out), "--steps", "3"]) == 0
    kl = [m["kl"] for m in read_jsonl(out / "metrics.jsonl")]
    assert kl[2] > 0 and kl[2] == read_jsonl(kl_whole / "metrics.jsonl")[2]["kl"]
    assert_resumed_exactly(kl_whole, out, 3)
