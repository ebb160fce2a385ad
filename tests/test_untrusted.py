"""Tests of what a run reads from folders it was handed (a colleague's run, a downloaded model, an adapter): nothing
in them runs code, writes outside them, or crashes a command. Each class of the fourth attack (docs/reliability.md)
has a test here that failed before its fix."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import stratagem as S
from machinery import UserError, memory, runfiles
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    SMALL,
    error_of,
    judge_server_fixture,
    no_process_left_behind,
    not_for_the_vllm_tests,
    one_step_run_fixture,
    only_the_vllm_tests,
    python,
    read_jsonl,
    run,
    secret_key_fixture,
    tiny_fixture,
)


def copy_run(one_step_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    return out


def last_checkpoint(out: Path) -> Path:
    return out / "checkpoints" / "step-000001"


# ---- 1. no code from a run folder, ever
class Planted:
    """A pickle that runs a command when it is unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("name", ["trainer_state.pt", "rank0.pt"])
def test_load_state_runs_no_code_planted_in_a_checkpoint(one_step_run, tmp_path, capsys, name):
    out = copy_run(one_step_run, tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "payload": Planted(marker)}, last_checkpoint(out) / name)
    err = error_of(capsys, ["--resume", "--out", str(out), "--steps", "2"])
    assert not marker.exists()  # nothing ran
    assert f"{name} is damaged (UnpicklingError" in err and err.count("\n") == 1
    with pytest.raises(
        UserError, match="is damaged"
    ):  # agree's distilled judge reads it the same way
        runfiles.load_state(last_checkpoint(out) / name, runfiles.TRAINER_STATE, "distilled:x")
    assert not marker.exists()


@pytest.mark.parametrize(
    "name, damage, message",
    [
        ("trainer_state.pt", lambda s: s.pop("baselines"), "'baselines' is missing"),
        ("trainer_state.pt", lambda s: s.update(step="one"), "'step' is not a step number"),
        ("trainer_state.pt", lambda s: s.update(elapsed=float("nan")), "'elapsed' is not seconds"),
        ("rank0.pt", lambda s: s.pop("lengths"), "'lengths' is missing"),
        ("rank0.pt", lambda s: s["rng"].pop("numpy"), "'rng' is not the RNG states"),
        # numbers of no sane size: refused here, not an OverflowError steps later
        ("trainer_state.pt", lambda s: s["baselines"].update(k=10**400), "'baselines' is not"),
        ("trainer_state.pt", lambda s: s.update(elapsed=10**400), "'elapsed' is not seconds"),
        ("rank0.pt", lambda s: s["lengths"].update(g=10**400), "'lengths' is not game lengths"),
        (
            "trainer_state.pt",
            lambda s: s.update(first_spots={"KuhnPoker-v1": {"K": {"share": 10**400, "n": 1}}}),
            "'first_spots' is not the coverage guard's step-1 spots",
        ),
        # tensors that would fail inside the optimizer once the run had started
        *(
            (
                "trainer_state.pt",
                lambda s, make=make: next(iter(s["optimizer"]["state"].values())).update(
                    exp_avg=make()
                ),
                "'optimizer' is not an optimizer state of dense CPU tensors",
            )
            for make in (
                lambda: torch.empty(3, device="meta"),
                lambda: torch.zeros(3).to_sparse(),
            )
        ),
    ],
)
def test_load_state_names_the_file_and_the_key_it_lacks(
    one_step_run, tmp_path, capsys, name, damage, message
):
    out = copy_run(one_step_run, tmp_path)
    path = last_checkpoint(out) / name
    state = torch.load(path, weights_only=True)
    damage(state)
    torch.save(state, path)
    err = error_of(capsys, ["--resume", "--out", str(out), "--steps", "2"])
    assert f"{path} is not a checkpoint of this project: {message}" in err and err.count("\n") == 1


def test_rng_states_round_trip_through_weights_only_loading(tmp_path):
    """The checkpoint holds NumPy's state as plain values: weights_only reads it, and it restores the stream."""
    import random

    import numpy as np

    rng = random.Random(3)
    np.random.seed(5)
    torch.save(runfiles.rng_states(rng), tmp_path / "s.pt")
    expected = (rng.random(), random.random(), np.random.rand(), torch.rand(1).item())
    runfiles.set_rng_states(rng, torch.load(tmp_path / "s.pt", weights_only=True))
    assert (rng.random(), random.random(), np.random.rand(), torch.rand(1).item()) == expected


# ---- 2. weights are complete or refused
def weights_of(folder: Path) -> dict:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda w: w.pop("model.layers.0.mlp.up_proj.weight"),
            "tensor model.layers.0.mlp.up_proj.weight is missing",
        ),
        (
            lambda w: w.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}),
            "tensor model.layers.0.mlp.up_proj.weight has shape (3, 3), the model's is (128, 64)",
        ),
        (
            lambda w: w.update({"model.planted.weight": torch.zeros(2)}),
            "tensor model.planted.weight is not one of",
        ),
    ],
)
def test_load_policy_refuses_weights_that_do_not_fit_naming_the_first_tensor(
    tiny, tmp_path, capsys, edit, message
):
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    weights = weights_of(model)
    edit(weights)
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    err = error_of(
        capsys,
        ["eval", str(model), "--n", "1", "--games", "KuhnPoker-v1", "--json", str(tmp_path / "j")],
    )
    assert f"{model / 'model.safetensors'} does not fit its config.json: {message}" in err
    assert err.count("\n") == 1 and not (tmp_path / "j").exists()


def test_resume_refuses_a_checkpoint_whose_layer_was_removed(one_step_run, tmp_path, capsys):
    out = copy_run(one_step_run, tmp_path)
    weights = weights_of(last_checkpoint(out))
    for key in [k for k in weights if k.startswith("model.layers.0.mlp.")]:
        del weights[key]
    save_file(weights, str(last_checkpoint(out) / "model.safetensors"), metadata={"format": "pt"})
    err = error_of(capsys, ["--resume", "--out", str(out), "--steps", "2"])
    assert (
        "does not fit its config.json: tensor model.layers.0.mlp.down_proj.weight is missing (and 2 more)"
        in err
    )


def test_latest_checkpoint_ignores_and_keeps_a_copied_folder_with_another_name(
    one_step_run, tmp_path, capsys
):
    out = copy_run(one_step_run, tmp_path)
    shutil.copytree(last_checkpoint(out), out / "checkpoints" / "step-000001.bak")
    assert run(["--resume", "--out", str(out), "--steps", "2", "--save-every", "1"]) == 0
    assert "holds step-000001.bak: not checkpoints of this project" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-000001.bak",
        "step-000002",
    ]


# ---- 3. best/ is a checkpoint
KEEP = [
    "--eval-every",
    "1",
    "--eval-n",
    "2",
    "--eval-games",
    "KuhnPoker-v1",
    "--keep-best",
    "--best-eval-n",
    "2",
]


@pytest.fixture(scope="module", name="kept_run")
def kept_run_fixture(tmp_path_factory):
    """A finished one-step --keep-best run, copied by the tests that plant something in its best/."""
    not_for_the_vllm_tests()
    out = tmp_path_factory.mktemp("kept") / "run"
    assert run(SMALL + KEEP + ["--steps", "1", "--out", str(out)]) == 0
    return out


def test_keep_best_refuses_a_planted_link_and_writes_nothing_through_it(kept_run, tmp_path, capsys):
    out, elsewhere = copy_run(kept_run, tmp_path), tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("mine")
    (out / ".best-tmp").symlink_to(elsewhere)
    err = error_of(capsys, ["--resume", "--out", str(out), "--steps", "2"])
    assert (
        ".best-tmp is a symbolic link" in err and (elsewhere / "config.json").read_text() == "mine"
    )
    assert (out / "best" / "best.json").is_file() and not (out / "best").is_symlink()


@pytest.mark.parametrize(
    "plant, message",
    [
        (lambda best: (shutil.rmtree(best), best.write_text("x")), "best is not a folder"),
        (
            lambda best: (best / "best.json").write_text("{not json"),
            "best.json is unreadable (JSONDecodeError)",
        ),
        (
            lambda best: (best / "best.json").write_text('{"step": 0, "win_rate": "high"}'),
            "'win_rate' is not a rate",
        ),
        (
            lambda best: ((best / "best.json").unlink(), os.mkfifo(best / "best.json")),
            "is not a plain file",
        ),
    ],
)
def test_read_best_ends_in_one_line_on_a_best_of_the_wrong_kind(
    kept_run, tmp_path, capsys, plant, message
):
    out = copy_run(kept_run, tmp_path)
    plant(out / "best")
    err = error_of(
        capsys, ["--resume", "--out", str(out), "--steps", "2"]
    )  # a fifo would block a plain open()
    assert message in err and err.count("\n") == 1


def test_keep_best_files_follow_the_umask_as_checkpoints_do(tmp_path):
    out = tmp_path / "run"
    mask = os.umask(0o022)
    try:
        assert run(SMALL + KEEP + ["--steps", "1", "--out", str(out)]) == 0
    finally:
        os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (out / "best").iterdir()}
    assert (
        modes["model.safetensors"] == modes["best.json"] == 0o644
        and (out / "best").stat().st_mode & 0o777 == 0o755
    )


def test_keep_best_on_a_full_disk_warns_and_keeps_the_previous_best(tmp_path, capsys):
    """A save that fails midway (the disk full) leaves the best that was there, no .best-tmp, and the run goes on:
    one warning line."""
    out = tmp_path / "run"
    (out / "best").mkdir(parents=True)
    (out / "best" / "best.json").write_text('{"step": 5, "win_rate": 0.4}')

    class Full:
        def save_pretrained(self, folder):
            (Path(folder) / "model.safetensors").write_bytes(b"half")
            raise OSError(28, "No space left on device")

    run_ = type(
        "R",
        (),
        {
            "args": S.Args(keep_best=True, eval_every=5),
            "out": out,
            "model": Full(),
            "tokenizer": Full(),
        },
    )
    S.lifecycle.keep_best(run_, 10, {"win_rate": 0.9})
    err = capsys.readouterr().err
    assert (
        "could not keep step 10's policy" in err
        and "it holds step 5's" in err
        and err.count("\n") == 1
    )
    assert (
        not (out / ".best-tmp").exists()
        and json.loads((out / "best" / "best.json").read_text())["step"] == 5
    )


def test_read_best_puts_back_a_best_a_kill_left_between_its_two_renames(tmp_path):
    out = tmp_path / "run"
    (out / ".best-old").mkdir(parents=True)
    (out / ".best-old" / "best.json").write_text('{"step": 3, "win_rate": 0.5}')
    assert S.lifecycle.read_best(out) == {"step": 3, "win_rate": 0.5} and (out / "best").is_dir()


def test_keep_best_keeps_the_earlier_step_on_a_tie(tmp_path):
    out = tmp_path / "run"
    (out / "best").mkdir(parents=True)
    (out / "best" / "best.json").write_text('{"step": 5, "win_rate": 0.6}')
    args = S.Args(keep_best=True, eval_every=5)
    run_ = type("R", (), {"args": args, "out": out})()
    S.lifecycle.keep_best(run_, 10, {"win_rate": 0.6})  # no model needed: a tie writes nothing
    assert json.loads((out / "best" / "best.json").read_text())["step"] == 5


# ---- 4. hostile model folders
@pytest.mark.parametrize(
    "edit, message",
    [
        ({"hidden_size": -64}, "hidden_size must be a whole number in [1, 65,536], got -64"),
        ({"vocab_size": 10**12}, "vocab_size must be a whole number"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a whole number"),
        (
            {"num_hidden_layers": 2 * 10**6},
            "num_hidden_layers must be a whole number in [1, 1,024]",
        ),
        ({"hidden_size": "64"}, "hidden_size must be a whole number"),
        (
            {"num_key_value_heads": 3},
            "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
        ),
    ],
)
def test_check_folder_refuses_config_sizes_before_anything_is_allocated(
    tiny, tmp_path, capsys, edit, message
):
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edit}))
    err = error_of(
        capsys,
        ["eval", str(model), "--n", "1", "--games", "KuhnPoker-v1", "--json", str(tmp_path / "j")],
    )
    assert message in err and err.count("\n") == 1
    assert run(["--dry-run", "--model", str(model), "--out", str(tmp_path / "n")]) == 2
    dry = capsys.readouterr()
    assert message in dry.err and "fits" not in dry.out


def test_plan_lines_read_a_gpt2_config_and_say_which_key_a_shapeless_one_lacks():
    args = S.Args()
    gpt2 = {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    lines = memory.plan_lines(args, gpt2, torch.device("cpu"), 1, None, "auto")
    assert "parameters" in lines[0] and any("will it fit?" in x for x in lines)
    lines = memory.plan_lines(args, {"vocab_size": 10}, torch.device("cpu"), 1, None, "auto")
    assert lines == [
        "memory: Qwen/Qwen3-4B-Base's config.json gives no hidden_size (nor a known alias): no projection"
    ]


def test_load_policy_of_a_broken_tokenizer_is_one_line(tiny, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    err = error_of(
        capsys,
        ["eval", str(model), "--n", "1", "--games", "KuhnPoker-v1", "--json", str(tmp_path / "j")],
    )
    assert f"cannot load model {str(model)!r}" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda c: (c / "adapter_config.json").write_text("{"),
            "adapter_config.json is unreadable",
        ),
        (
            lambda c: edit_json(c / "adapter_config.json", r=-3),
            "r must be a whole number in [1, 4096], got -3",
        ),
        (
            lambda c: (c / "adapter_model.safetensors").write_bytes(b"\0" * 9),
            "its LoRA adapter cannot be loaded",
        ),
    ],
)
def test_load_adapters_of_a_damaged_adapter_is_one_line_on_resume_and_in_merge_lora(
    tmp_path, capsys, damage, message
):
    out = tmp_path / "run"
    assert run(SMALL + ["--steps", "1", "--lora-rank", "4", "--out", str(out)]) == 0
    damage(last_checkpoint(out))
    assert message in error_of(capsys, ["--resume", "--out", str(out), "--steps", "2"])
    assert message in error_of(capsys, ["merge-lora", str(out), str(tmp_path / "merged")])
    assert not (tmp_path / "merged").exists()


def edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


# ---- 5. bounded flags and commands
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--moves", "0,0,0"], "--moves must each be in [1, 1000000]"),
        (["--moves", "a,b,c"], "--moves takes comma-separated whole numbers"),
        (["--steps", "0"], "--steps must be in [1, 1000000], got 0"),
        (["--steps", "1000000000"], "--steps must be in [1, 1000000]"),
        (["--batch-size", "0"], "--batch-size must be in [1, 4096], got 0"),
        (["--arch", "nope"], "--arch must be one of"),
        (["--games", "Nope-v0", "--moves", "5"], "unknown game id 'Nope-v0'"),
    ],
)
def test_warmstart_refuses_a_bad_flag_before_it_makes_its_folder(tmp_path, capsys, flags, message):
    assert message in error_of(capsys, ["warmstart", str(tmp_path / "w"), *flags])
    assert not (tmp_path / "w").exists()


def test_warmstart_that_fails_midway_leaves_no_folder(tmp_path, monkeypatch, capsys):
    from tools import warmstart

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(warmstart, "fit", broken)
    error_of(capsys, ["warmstart", str(tmp_path / "w"), "--steps", "1", "--moves", "5,5,5"])
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-rank", "1000000000"], "--lora-rank must be <= 4096"),
        (["--lora-rank", "4", "--lora-alpha", "1e300"], "--lora-alpha must be <= 65536"),
    ],
)
def test_validate_bounds_lora_flags(capsys, tmp_path, argv, message):
    assert message in error_of(capsys, SMALL + argv + ["--out", str(tmp_path / "never")])


def test_policy_update_that_diverges_stops_the_run_naming_the_step_and_keeps_the_checkpoint(
    tmp_path, capsys
):
    out = tmp_path / "run"
    assert run(SMALL + ["--steps", "1", "--out", str(out)]) == 0
    real = S.sequence_logprobs
    S.sequence_logprobs = lambda *a: real(*a) * float("nan")
    try:
        err = error_of(capsys, ["--resume", "--out", str(out), "--steps", "3"])
    finally:
        S.sequence_logprobs = real
    assert (
        err.startswith("stratagem: error: step 2: the policy diverged, the gradient norm is nan")
        and err.count("\n") == 1
    )
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]


# ---- 6. every OS error a user can cause is one line
@pytest.mark.parametrize("command", [[], ["show"], ["plot"], ["eval"]])
def test_main_of_a_name_too_long_is_one_line_in_every_command(tmp_path, capsys, command):
    long = str(tmp_path / ("x" * 300))
    argv = (SMALL + ["--steps", "1", "--out", long]) if not command else [*command, long]
    err = error_of(capsys, argv)
    assert (
        "a file name is too long" in err or "not found" in err or "no such directory" in err
    ) and err.count("\n") == 1


def test_main_in_a_read_only_folder_is_one_line(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    (tmp_path / "ro").mkdir(mode=0o555)
    err = error_of(capsys, SMALL + ["--steps", "1", "--out", str(tmp_path / "ro" / "run")])
    assert err.count("\n") == 1


# ---- 7. logs are read in bounded memory; 8. strings from files are neutralised
def test_iter_jsonl_skips_a_line_longer_than_its_limit_in_bounded_memory(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(runfiles, "LINE_LIMIT", 1024)
    path = tmp_path / "t.jsonl"
    path.write_bytes(
        b'{"a": 1}\n'
        + b'{"x": "'
        + b"y" * 100_000
        + b'"}\n{"b": 2}\n'
        + b'{"torn": "'
        + b"z" * 5000
    )
    assert runfiles.read_jsonl(path) == [{"a": 1}, {"b": 2}]
    assert (
        "skipped 2 line(s)" in capsys.readouterr().err
    )  # the long one and the torn one, each said


def test_lines_never_reads_more_than_its_limit_at_once():
    import io

    class Counted(io.BytesIO):
        most = 0

        def readline(self, size=-1):
            line = super().readline(size)
            Counted.most = max(Counted.most, len(line))
            return line

    found = list(runfiles.lines(Counted(b"short\n" + b"x" * 10_000 + b"\nend\n"), limit=100))
    assert found == [(b"short\n", True), (b"", False), (b"end\n", True)] and Counted.most <= 101


def test_show_of_a_torn_gigabyte_line_takes_bounded_memory(one_step_run, tmp_path):
    out = copy_run(one_step_run, tmp_path)
    with open(
        out / "trajectories.jsonl", "ab"
    ) as f:  # 160 MiB, longer than LINE_LIMIT: skipped in chunks
        for _ in range(160):
            f.write(b"x" * (1 << 20))
    code = "import resource, sys, stratagem\nresource.setrlimit(resource.RLIMIT_AS, (1 << 31, 1 << 31))\n"
    code += f"sys.exit(stratagem.main(['show', {str(out)!r}]))"
    proc = python(["-c", code], HERE)
    assert proc.returncode == 0 and "MemoryError" not in proc.stderr


def test_main_neutralises_control_characters_from_a_file_in_its_error_line(
    one_step_run, tmp_path, capsys
):
    out = copy_run(one_step_run, tmp_path)
    edit_json(out / "config.json", **{"\x1b]0;pwned\x07\x1b[2J": 1})
    err = error_of(capsys, ["--resume", "--out", str(out), "--steps", "2"])
    assert "\x1b" not in err and "\x07" not in err and "\\x1b]0;pwned\\x07" in err


# ---- 9. tools take hostile lines
@pytest.mark.parametrize(
    "line",
    [
        {"step": 3, "eval": 5},
        {"step": 3, "beta": 0.2},
        {"step": 3, "distill": [1]},
        {"step": 3, "games": {"g": 5}},
    ],
)
def test_plot_skips_a_metrics_value_of_the_wrong_shape(one_step_run, tmp_path, capsys, line):
    out = copy_run(one_step_run, tmp_path)
    runfiles.append_jsonl(out / "metrics.jsonl", line)
    assert run(["plot", str(out), "--out", str(tmp_path / "plots")]) == 0


def test_ablation_of_runs_without_an_evaluation_is_one_line(one_step_run, tmp_path, capsys):
    from tools import ablation

    runs = tmp_path / "ablation"
    shutil.copytree(one_step_run, runs / "stratagem-s1")
    with pytest.raises(UserError, match="has no evaluation in its metrics.jsonl"):
        ablation.arm_row("stratagem", [runs / "stratagem-s1"])


# ---- 10. commands keep a run's settings; resume writes step 0 once
def test_eval_of_a_runs_best_plays_with_the_runs_settings(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(SMALL + KEEP + ["--steps", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    assert run(["eval", str(out / "best"), "--n", "2"]) == 0
    said = capsys.readouterr().out
    assert "--max-new-tokens 16" in said and "trained on KuhnPoker-v1; unseen: none" in said
    assert "Snake-v0" not in said  # the run's --eval-games, not the eight defaults


def test_start_run_after_only_a_step_0_evaluation_writes_step_0_once(tmp_path, monkeypatch):
    out = tmp_path / "run"

    def stop(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(S, "self_play", stop)
        assert run(SMALL + KEEP + ["--steps", "1", "--out", str(out)]) == 130
    assert run(["--resume", "--out", str(out), "--steps", "1"]) == 0
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [0, 1]


def test_measured_so_far_refuses_a_metrics_line_whose_counts_no_float_holds(
    tmp_path, capsys, judge_server, secret_key
):
    """A resumed run with a paid judge projects its cost from its own metrics.jsonl: a planted count of 400
    digits there is one line naming the file and the step, before anything is loaded (not an OverflowError)."""
    out = tmp_path / "run"
    judge = ["--judge", "openai", "--judge-base-url", judge_server.url]
    assert run(SMALL + judge + ["--steps", "1", "--out", str(out)]) == 0
    lines = read_jsonl(out / "metrics.jsonl")
    lines[-1]["transitions"] = 10**400
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    capsys.readouterr()
    err = error_of(capsys, ["--resume", "--out", str(out), "--steps", "2", *judge[2:]])
    assert err == (
        f"stratagem: error: --resume: {out / 'metrics.jsonl'}, step 1: its counts of trajectories, "
        "judgements and transitions are not whole numbers of a sane size; restore the file\n"
    )
