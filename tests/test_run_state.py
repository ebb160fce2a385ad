"""A resumed run's state checked against the run's own flags and step before anything trains
(machinery/lifecycle.py's check_state, machinery/opponents.py's pool_problem and baselines_problem), and
the flags that size memory bounded by what the run can use (machinery/memory.py's bounded and the dry
run's copies of the weights)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import stratagem as S
from machinery import lifecycle, memory, opponents, runfiles
from machinery.distributed import Dist
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    SMALL,
    error_of,
    no_process_left_behind,
    one_step_run_fixture,
    only_the_vllm_tests,
    run,
)

SPEC = "self=0.5,past=0.25,random=0.25"
MIX = ["--opponents", SPEC, "--past-every", "1", "--past-pool", "2"]


@pytest.fixture(scope="module", name="mixed_run")
def mixed_run_fixture(tmp_path_factory) -> Path:
    """Two steps of a mixed run with a baseline per opponent kind, saved at each: its pool holds the
    snapshots of steps 1 and 2."""
    out = tmp_path_factory.mktemp("mixed") / "run"
    argv = [*SMALL, *MIX, "--opponent-baselines", "--steps", "2", "--save-every", "1"]
    assert run([*argv, "--out", str(out)]) == 0
    return out


def tampered(src: Path, tmp_path: Path, name: str, edit) -> tuple[Path, Path]:
    """A copy of the run `src` whose last checkpoint's `name` is edited: (the copy, the file)."""
    out = tmp_path / "run"
    shutil.copytree(src, out)
    path = sorted((out / "checkpoints").glob("step-*"))[-1] / name
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    return out, path


def refused(capsys, out: Path, path: Path, steps: int) -> str:
    """The resume's one line, "--resume: FILE: ...; restore it", with nothing trained: the field's words."""
    metrics = (out / "metrics.jsonl").read_bytes()
    err = error_of(capsys, ["--resume", "--out", str(out), "--steps", str(steps)])
    assert err.startswith(f"stratagem: error: --resume: {path}: ") and err.endswith(
        "; restore it\n"
    )
    assert (out / "metrics.jsonl").read_bytes() == metrics
    assert not (out / "checkpoints" / f"step-{steps:06d}").exists()
    return err.removeprefix(f"stratagem: error: --resume: {path}: ").removesuffix("; restore it\n")


def pool(**changes):
    return lambda s: s["past_pool"].update(changes)


def fifty(state: dict) -> None:  # a --past-pool 2 run's pool of 50 snapshots, each a fitting one
    weights = state["past_pool"]["weights"][0]
    state["past_pool"].update(steps=list(range(50)), weights=[weights] * 50)


# ---- the past pool: its length, its steps, its presence, against --opponents, --past-* and the step
@pytest.mark.parametrize(
    "edit, words",
    [
        (
            lambda s: s.update(past_pool=None),
            f"'past_pool' is null, but --opponents {SPEC} plays past policies from the pool it saves",
        ),
        (
            lambda s: s.pop("past_pool"),
            f"'past_pool' is missing, but --opponents {SPEC} plays past policies from the pool it saves",
        ),
        (fifty, "'past_pool' holds 50 snapshots, more than --past-pool 2 keeps"),
        (
            pool(steps=[900, 1000]),
            "'past_pool' holds a snapshot of step 1000, after the checkpoint's step 2",
        ),
        (pool(steps=[2, 1]), "'past_pool' holds snapshots of steps 2, 1, not increasing"),
        (
            pool(steps=[0, 2]),
            "'past_pool' holds snapshots of steps 0, 2, but a snapshot every 1 steps, the newest 2 "
            "kept, holds those of steps 1, 2 at step 2",
        ),
        (pool(steps=[], weights=[]), "'past_pool' holds no snapshot"),
        (pool(steps="1, 2"), "'past_pool' holds no list of snapshot steps"),
        (
            pool(weights=[{"w": torch.zeros(2)}] * 2),
            "'past_pool' holds snapshots that are not this model's trainable weights (their names, "
            "shapes or dtypes)",
        ),
        (
            lambda s: s["baselines"].update({"TicTacToe-v0/player0/vs-self": 0.5}),
            "'baselines' holds 'TicTacToe-v0/player0/vs-self', but this run's baselines per "
            f"opponent kind are those of --opponents {SPEC}: past, random",
        ),
    ],
)
def test_check_state_refuses_a_past_pool_or_baseline_the_flags_do_not_keep(
    mixed_run, tmp_path, capsys, edit, words
):
    out, path = tampered(mixed_run, tmp_path, "trainer_state.pt", edit)
    assert refused(capsys, out, path, 3) == words


@pytest.mark.parametrize(
    "name, edit, words",
    [
        (
            "trainer_state.pt",
            lambda s: s.update(past_pool={"steps": [0], "weights": []}),
            "'past_pool' holds a pool, but --opponents self=1 has no past share",
        ),
        (
            "trainer_state.pt",
            lambda s: s["baselines"].update({"KuhnPoker-v1/player1/vs-random": 0.5}),
            "'baselines' holds 'KuhnPoker-v1/player1/vs-random', but this run's baselines per "
            "opponent kind are none (no --opponent-baselines)",
        ),
        (
            "trainer_state.pt",
            lambda s: s.update(beta=0.3),
            "'beta' is 0.3, but this run's beta is fixed (no --beta-share)",
        ),
        (
            "trainer_state.pt",
            lambda s: s.update(judge_totals=None),
            "'judge_totals' is null, but this run asks a judge",
        ),
        (
            "trainer_state.pt",
            lambda s: s["judge_totals"].update(cost=-5.0),
            "'judge_totals' holds 'cost' -5, below 0",
        ),
        ("trainer_state.pt", lambda s: s.update(elapsed=-1.0), "'elapsed' is -1 seconds, below 0"),
        (
            "trainer_state.pt",
            lambda s: s.update(distill={"heads": 1}),
            "'distill' holds --distill's heads, but this run has no --distill",
        ),
        (
            "trainer_state.pt",
            lambda s: s["optimizer"]["param_groups"][0].update(lr=1000.0),
            "'optimizer' has lr 1000.0, but this run's is 0.0001",
        ),
        (
            "trainer_state.pt",
            lambda s: s["optimizer"]["param_groups"][0].update(maximize=True),
            "'optimizer' has maximize True, but this run's is False",
        ),
        (
            "rank0.pt",
            lambda s: s["lengths"].update({"Chess-v0": 3.0}),
            "'lengths' holds 'Chess-v0', a game this run does not play (--games)",
        ),
        (
            "rank0.pt",
            lambda s: s["lengths"].update({"TicTacToe-v0": 1e9}),
            "'lengths' holds 1e+09 moves for TicTacToe-v0, outside [1, --max-turns 20]",
        ),
    ],
)
def test_check_state_refuses_each_field_the_runs_flags_contradict(
    one_step_run, tmp_path, capsys, name, edit, words
):
    out, path = tampered(one_step_run, tmp_path, name, edit)
    assert refused(capsys, out, path, 2) == words


def test_check_state_refuses_a_beta_outside_the_controllers_bounds(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*SMALL, "--beta-share", "0.3", "--steps", "1", "--out", str(out)]
    assert run(argv) == 0
    path = out / "checkpoints" / "step-000001" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    state["beta"] = 5.0
    torch.save(state, path)
    words = refused(capsys, out, path, 2)
    assert words == "'beta' is 5.0, not in this run's [--beta-min, --beta-max] = [0.01, 1.0]"


class Engine:
    """A stand-in engine: Versus builds the past policies' one from the learner's type."""

    def __init__(self, model, tokenizer, args, device):
        self.room = None


def test_kept_names_the_steps_whose_snapshots_Versus_snapshot_keeps():
    model = torch.nn.Linear(2, 2)
    for every, size in ((1, 2), (3, 2), (10, 3), (2, 64)):
        args = S.Args(tiny=True, opponents=SPEC, past_every=every, past_pool=size)
        fake = SimpleNamespace(args=args, dist=Dist(), model=model, tokenizer=None, device=None)
        fake.policy = Engine(model, None, args, None)
        mix = opponents.Versus(fake)
        for step in range(1, 31):
            mix.snapshot(step, model)
            assert [s for s, _ in mix.pool] == opponents.kept(every, size, step), (
                every,
                size,
                step,
            )
    assert opponents.kept(10, 3, 0) == [0] and opponents.kept(10, 3, 40) == [20, 30, 40]


# ---- the flags that size memory: bounded by what the run can use, and every copy of the weights counted
def test_bounded_clamps_a_micro_batch_above_the_batch_per_rank_and_the_start_line_says_so(
    tmp_path, capsys
):
    args = S.Args(tiny=True, batch_size=16, micro_batch_size=10**9)
    assert memory.bounded(args, 2) == (
        "micro-batch 8 (--micro-batch-size 1000000000 clamped: at most the batch per rank, 8)"
    )
    assert args.micro_batch_size == 8 and memory.bounded(args, 2) is None
    kept = S.Args(tiny=True, batch_size=16, micro_batch_size=16)
    assert memory.bounded(kept, 1) is None and kept.micro_batch_size == 16
    out = tmp_path / "run"
    argv = [*SMALL, "--batch-size", "8", "--micro-batch-size", "1000000000", "--steps", "1"]
    assert run([*argv, "--out", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(
        "| micro-batch 8 (--micro-batch-size 1000000000 clamped: at most the batch per rank, 8)"
    )
    assert runfiles.read_config(out)["micro_batch_size"] == 8


def test_plan_lines_never_project_a_micro_batch_the_run_cannot_reach(capsys):
    argv = ["--tiny", "--batch-size", "16", "--micro-batch-size", "1000000000", "--dry-run"]
    assert run(argv) == 0
    said = capsys.readouterr().out
    assert "micro-batch 16 x 1,072 tokens" in said and "does NOT fit" not in said
    assert (
        "micro-batch 16 (--micro-batch-size 1000000000 clamped: at most the batch per rank, 16)"
        in said
    )


def test_plan_lines_count_the_past_pools_snapshots_in_host_memory_and_in_each_checkpoint(
    monkeypatch,
):
    monkeypatch.setattr(memory, "free_memory", lambda: 128 * memory.GiB)
    args = S.Args(opponents="self=0.5,past=0.5", past_pool=64, device_memory=141)
    lines = memory.plan_lines(args, S.model_shape(args), torch.device("cpu"), 1, None, "auto")
    p = memory.parameters(memory.checked(args, S.model_shape(args))[0])  # all of them trained
    assert (
        f"host memory: the past pool {memory.gb(64 * 4 * p)} GiB (64 fp32 snapshots of the trained "
        "weights, --past-pool): does NOT fit this machine's 128.0 GiB free now"
    ) in lines
    assert memory.gb(64 * 4 * p) == "959.0"
    assert (
        f"disk: a checkpoint {memory.gb((4 + 8 + 64 * 4) * p)} GiB (the weights it saves, Adam's "
        "moments and the past pool's snapshots)"
    ) in lines
    assert "frozen copies 15.0" in lines[0]  # the copy that plays the past policies, on the device
    few = S.Args(opponents="self=0.5,past=0.5", device_memory=141)  # --past-pool 0: 3
    lines = memory.plan_lines(few, S.model_shape(few), torch.device("cpu"), 1, None, "auto")
    assert any(x.startswith("host memory: the past pool 45.0 GiB (3 fp32 snapshots") for x in lines)
    alone = memory.plan_lines(S.Args(device_memory=141), None, torch.device("cpu"), 1, None, "auto")
    assert not any(x.startswith(("host memory", "disk")) for x in alone)


def test_state_problems_refuses_a_judges_totals_in_a_run_that_asks_no_judge():
    args = S.Args(tiny=True, mode="spiral")
    model = torch.nn.Linear(2, 2)
    fake = SimpleNamespace(args=args, model=model)
    fake.optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=args.betas)
    state = {"step": 1, "baselines": {}, "elapsed": 0.0, "past_pool": None}
    state["optimizer"] = fake.optimizer.state_dict()
    assert lifecycle.state_problems(fake, state | {"judge_totals": None}) == []
    assert lifecycle.state_problems(fake, state | {"judge_totals": {}}) == [
        "'judge_totals' is a judge's totals, but this run asks no judge"
    ]
