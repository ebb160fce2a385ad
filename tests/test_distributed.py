"""Tests of data parallelism (machinery/distributed.py): torchrun and FSDP2 on the CPU (gloo), collective
timeouts, stop signals that reach a rank blocked in a collective, and the machine's threads and engine."""

from __future__ import annotations

import math
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import stratagem as S
from machinery import distill, distributed, watch
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    SMALL,
    RawJudgeServer,
    check_run,
    endless_body,
    free_port,
    fresh,
    learner,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    run,
    tiny_fixture,
    torchrun,
    torchrun_argv,
    wait_for,
)

# ---- torchrun and FSDP2 on the CPU (gloo): the update, a whole run, features
FSDP_WORKER = """
import sys, torch
from types import SimpleNamespace
sys.path.insert(0, {here!r})
import stratagem as S
from machinery import distributed
dist = distributed.Dist()
model, tok = S.load_policy({model!r}, torch.device("cpu"))
distributed.shard(model)
args = S.Args(tiny=True, max_new_tokens=8, micro_batch_size=1, max_grad_norm=1e9)
items = [([5, 6, 7], [3, 4], 1.0), ([8, 9], [5], -0.5), ([10, 11, 12, 13], [6, 7, 8], 0.25)]
mine = items[:2] if dist.main else items[2:]  # two micro-batches on rank 0, one on rank 1
batch = [S.Trajectory("toy", 0, [S.Turn("", "", "", p, r)], 0.0, a_mod=a) for p, r, a in mine]
before = {{n: t.detach().clone() for n, t in distributed.full_weights(model).items()}}
learner = SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), args=args,
                            device=torch.device("cpu"), tokenizer=tok, dist=dist, reference=None)
S.policy_update(learner, batch, 3 * 8 / dist.world)
after = distributed.full_weights(model)
if dist.main:
    torch.save({{n: after[n] - before[n] for n in before}}, {out!r})
dist.close()
distributed.leave(0)  # as a run's rank leaves: gloo's threads can abort the interpreter's teardown
"""


@pytest.mark.slow
def test_policy_update_under_fsdp_equals_the_single_process_update(tiny, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(
        FSDP_WORKER.format(here=str(HERE), model=str(tiny), out=str(tmp_path / "deltas.pt"))
    )
    torchrun([str(script)], tmp_path)
    sharded = torch.load(tmp_path / "deltas.pt")
    model, _ = fresh(tiny)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = [
        S.Trajectory("toy", 0, [S.Turn("", "", "", p, r)], 0.0, a_mod=a)
        for p, r, a in [
            ([5, 6, 7], [3, 4], 1.0),
            ([8, 9], [5], -0.5),
            ([10, 11, 12, 13], [6, 7, 8], 0.25),
        ]
    ]
    args = S.Args(tiny=True, max_new_tokens=8, micro_batch_size=1, max_grad_norm=1e9)
    S.policy_update(
        learner(model, torch.optim.SGD(model.parameters(), lr=1.0), args, distributed.Dist()),
        batch,
        24.0,
    )
    for n, p in model.named_parameters():
        assert torch.allclose(sharded[n], p.detach() - before[n], atol=1e-6), n
    assert max(d.abs().max() for d in sharded.values()) > 0


@pytest.mark.slow
def test_train_under_torchrun_obeys_the_formulas_and_resumes_exactly(tmp_path):
    flags = SMALL + ["--batch-size", "16"]
    torchrun([str(HERE / "stratagem.py"), *flags, "--steps", "2", "--out", "whole"], tmp_path)
    check_run(tmp_path / "whole", 2, beta=0.2)
    torchrun([str(HERE / "stratagem.py"), *flags, "--steps", "1", "--out", "part"], tmp_path)
    torchrun([str(HERE / "stratagem.py"), "--resume", "--out", "part", "--steps", "2"], tmp_path)
    assert read_jsonl(tmp_path / "part/trajectories.jsonl") == read_jsonl(
        tmp_path / "whole/trajectories.jsonl"
    )
    assert sorted(
        p.name for p in (tmp_path / "whole/checkpoints/step-000002").glob("rank*.pt")
    ) == [
        "rank0.pt",
        "rank1.pt",
    ]
    assert (
        run(["--resume", "--out", str(tmp_path / "whole"), "--steps", "3"]) == 2
    )  # one process cannot resume it


FSDP_FEATURES_WORKER = """
import sys, torch
sys.path.insert(0, {here!r})
import stratagem as S
from machinery import distill, distributed, watch
dist = distributed.Dist()
model, tok = S.load_policy({model!r}, torch.device("cpu"))
distributed.shard(model)
trajs = [S.Trajectory("toy", 0, [S.Turn("", "", "", p, r) for p, r in turns], 0.0) for turns in {trajs!r}]
mine = trajs[:2] if dist.main else trajs[2:]  # rank 1: one trajectory, one micro-batch; rank 0: three
feats = distill.features(model, mine, S.collate, 0, 1, torch.device("cpu"), dist, watch.Timer())
if dist.main:
    torch.save(feats, {out!r})
dist.close()
distributed.leave(0)  # as a run's rank leaves: gloo's threads can abort the interpreter's teardown
"""


@pytest.mark.slow
def test_features_under_fsdp_equal_the_single_process_features(tiny, tmp_path):
    trajs = [
        [([5, 6, 7], [3, 4]), ([8], [9])],
        [([10, 11], [12])],
        [([13, 14, 15, 16], [17, 18, 19])],
    ]
    script = tmp_path / "worker.py"
    script.write_text(
        FSDP_FEATURES_WORKER.format(
            here=str(HERE), model=str(tiny), trajs=trajs, out=str(tmp_path / "f.pt")
        )
    )
    torchrun([str(script)], tmp_path)
    sharded = torch.load(tmp_path / "f.pt")
    model, _ = fresh(tiny)
    alone = distill.features(
        model,
        [
            S.Trajectory("toy", 0, [S.Turn("", "", "", p, r) for p, r in turns], 0.0)
            for turns in trajs
        ],
        S.collate,
        0,
        1,
        torch.device("cpu"),
        distributed.Dist(),
        watch.Timer(),
    )
    assert len(sharded) == 3 and all(
        torch.allclose(a, b, atol=1e-5) for a, b in zip(sharded, alone)
    )


# ---- Collective timeouts and stop signals that reach a rank blocked in a collective
def test_collective_timeout_rule():
    args = (
        S.Args()
    )  # 128 transitions, 32 games of up to 50 turns, 25 %, 2 rubrics, 64 at once, 60 s, 3 retries
    most = 2 * (64 + 32 * 50)
    requests = math.ceil(0.25 * most) * 2
    judging = math.ceil(requests / 64) * (4 * 60 + 3 * 60)
    assert distributed.collective_timeout(args, 2) == 1800 + judging == 1800 + 26 * 420
    assert distributed.collective_timeout(S.dataclasses.replace(args, mode="spiral"), 2) == 1800
    assert distributed.collective_timeout(S.dataclasses.replace(args, judge="heuristic"), 2) == 1800
    assert (
        distributed.collective_timeout(S.dataclasses.replace(args, dist_timeout=20000.0), 2)
        == 20000
    )
    with pytest.raises(
        S.UserError, match=r"--dist-timeout 600 is shorter than a step's judging can take \(10920 s"
    ):
        distributed.collective_timeout(S.dataclasses.replace(args, dist_timeout=600.0), 2)
    assert (
        distributed.collective_timeout(S.dataclasses.replace(args, dist_timeout=600.0), 1) == 600
    )  # no ranks


def child_pids(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def rank_pids(agent: int) -> dict[int, int]:
    """{rank: pid} of torchrun's workers."""
    pids = {}
    for pid in child_pids(agent):
        env = dict(
            kv.split("=", 1)
            for kv in Path(f"/proc/{pid}/environ").read_text().split("\0")
            if "=" in kv
        )
        pids[int(env["RANK"])] = pid
    return pids


def torchrun_spawn(args: list[str], cwd: Path) -> subprocess.Popen:
    cmd = [*torchrun_argv(), str(HERE / "stratagem.py"), *args]
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # so that the test can end every rank, a stopped one too
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "OPENAI_API_KEY": "x"},
    )


def kill_group(proc: subprocess.Popen) -> None:
    """torchrun and every rank, a stopped one too. torchrun starts each rank in a session of its own, which a signal
    to torchrun's group does not reach: the ranks are killed first, while they are still torchrun's children (their
    pids cannot have been reused), then torchrun's group."""
    import signal

    try:
        ranks = child_pids(proc.pid)
    except OSError:  # torchrun has ended
        ranks = []
    for pid in [*ranks, -proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)  # a negative pid: the process group
        except ProcessLookupError:
            pass
    proc.wait()


def lines_of(stream) -> list[str]:
    """The lines of a pipe, read on a thread as they come (`lines` grows)."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(stream), daemon=True).start()
    return lines


@pytest.mark.slow
def test_collective_fails_in_one_line_within_dist_timeout_when_a_rank_is_frozen(tmp_path):
    import signal

    proc = torchrun_spawn(
        SMALL
        + [
            "--batch-size",
            "16",
            "--mode",
            "spiral",
            "--steps",
            "500",
            "--dist-timeout",
            "8",
            "--out",
            "run",
        ],
        tmp_path,
    )
    err = lines_of(proc.stderr)
    try:
        for line in proc.stdout:
            if line.startswith("step 1/"):
                break
        os.kill(rank_pids(proc.pid)[1], signal.SIGSTOP)
        took = wait_for(lambda: any("a collective failed" in line for line in err), 60)
    finally:
        kill_group(proc)
    assert took < 8 + 15, took
    [line] = [line for line in err if line.startswith("stratagem: error:")]
    assert line.startswith(
        "stratagem: error: rank 0: a collective failed after waiting up to 8 s (--dist-timeout): "
        "another rank is frozen or gone ("
    )


@pytest.mark.slow
def test_stop_within_ends_a_rank_blocked_in_a_collective_within_seconds_of_sigterm(tmp_path):
    """Rank 1 frozen, rank 0 waits for it inside gloo, where Python's signal handler cannot run: the stop
    signal still ends rank 0 within about 5 s, with its one line, not after the collective timeout."""
    import signal

    proc = torchrun_spawn(
        SMALL + ["--batch-size", "16", "--mode", "spiral", "--steps", "500", "--out", "run"],
        tmp_path,
    )
    err = lines_of(proc.stderr)
    try:
        for line in proc.stdout:
            if line.startswith("step 1/"):
                break
        ranks = rank_pids(proc.pid)
        os.kill(ranks[1], signal.SIGSTOP)
        time.sleep(6)  # rank 0 is in a collective of this step or the next, waiting for rank 1
        os.kill(ranks[0], signal.SIGTERM)
        took = wait_for(
            lambda: (
                not Path(f"/proc/{ranks[0]}").exists()
                or Path(f"/proc/{ranks[0]}/stat").read_text().split()[2] == "Z"
            ),
            30,
        )
    finally:
        kill_group(proc)
    assert took < 5 + 4, took
    assert (
        "stratagem: stopped by SIGTERM; the run did not stop within 5 s (blocked in a collective?), so it was "
        "ended there\n" in err
    ), err[-5:]


@pytest.mark.slow
def test_stop_handler_under_torchrun_stops_every_rank_at_once_while_the_judge_never_answers(
    tmp_path,
):
    import signal

    server = RawJudgeServer(endless_body)
    proc = torchrun_spawn(
        SMALL
        + [
            "--batch-size",
            "16",
            "--steps",
            "3",
            "--out",
            "run",
            "--judge",
            "openai",
            "--judge-base-url",
            server.url,
            "--judge-sample-rate",
            "1",
            "--judge-timeout",
            "300",
            "--judge-retries",
            "0",
        ],
        tmp_path,
    )
    try:
        assert server.posted.wait(180), "rank 0 never asked the judge"
        ranks = list(rank_pids(proc.pid).values())
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        kill_group(proc)
        server.close()
    assert took < 10 and not any(Path(f"/proc/{pid}").exists() for pid in ranks), took


# ---- The machine: threads and the engine
def test_pick_threads_follows_omp_num_threads_else_half_the_cores_on_a_cpu(monkeypatch):
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert (
            distributed.pick_threads(torch.device("cpu")) == (3, "OMP_NUM_THREADS")
            and torch.get_num_threads() == 3
        )
        for unset in ("", "abc", "0"):  # unset, or not a count: the machine's rule
            monkeypatch.setenv("OMP_NUM_THREADS", unset)
            expected = (max(1, cores // 2), f"half of {cores} cores; OMP_NUM_THREADS sets it")
            assert distributed.pick_threads(torch.device("cpu")) == expected
            assert torch.get_num_threads() == expected[0]
    finally:
        torch.set_num_threads(before)


def test_pick_backend_auto_takes_vllm_on_a_gpu_where_it_is_installed(monkeypatch):
    assert distributed.pick_backend("auto", torch.device("cpu")) == ("hf", "auto: cpu, not a GPU")
    assert distributed.pick_backend("hf", torch.device("cuda")) == ("hf", "--backend hf")
    monkeypatch.setattr(distributed.importlib.util, "find_spec", lambda name: None)
    assert distributed.pick_backend("auto", torch.device("cuda")) == (
        "hf",
        "auto: vLLM is not installed",
    )
    monkeypatch.setattr(
        distributed.importlib.util, "find_spec", lambda name: object() if name == "vllm" else None
    )
    assert distributed.pick_backend("auto", torch.device("cuda:0")) == (
        "vllm",
        "auto: a GPU and vLLM",
    )
