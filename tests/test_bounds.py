"""Tests of the bounds on what a client or a file can make a command spend (the fifth attack's
class 4, docs/reliability.md): serve-judge's body cap, deadlines and threads; the stagnation rule
linear in the turns; --spy-data read as the run files are (a plain file, a line and a total bound,
blank lines in bounded memory). Each failed before its fix."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import os
import random
import select
import signal
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

import judge_prompts
import spyrl
from games import spy
from machinery import UserError, runfiles
from tests.common import (  # noqa: F401  (the autouse fixtures apply by being imported)
    no_process_left_behind,
    only_the_vllm_tests,
)
from tools import serve_judge


# ---- the stagnation rule: one pass over the turns
def every_pair_stagnant(observations: list[str], responses: list[str]) -> bool:
    """The rule as it reads: a turn reasons as an earlier one did, and their observations differ."""
    return any(
        observations[k] != observations[j]
        and judge_prompts.reasoning_key(responses[k]) == judge_prompts.reasoning_key(responses[j])
        for k in range(1, len(responses))
        for j in range(k)
    )


def test_stagnant_agrees_with_every_pair_compared_on_random_games():
    said = [
        "I take cell 4.",
        "i  take cell 7. ",
        "I block.",
        "Plan \\boxed{[3]}",
        "plan \\boxed{x}",
    ]
    found = set()
    for seed in range(300):
        rng = random.Random(seed)
        n = rng.randint(0, 7)
        observations = [rng.choice(["board A", "board B", "board C"]) for _ in range(n)]
        responses = [rng.choice(said) for _ in range(n)]
        got = judge_prompts.stagnant(observations, responses)
        assert got == every_pair_stagnant(observations, responses), (observations, responses)
        found.add(got)
    assert found == {True, False}


def test_stagnant_reads_each_of_8000_turns_once(monkeypatch):
    """8,000 turns (the attack's evolution request to serve-judge): each response is read once,
    never compared with every other; the first turn's reasoning repeated in the last is found."""
    calls = []
    read = judge_prompts.reasoning_text

    def counted(response: str) -> str:
        calls.append(1)
        assert len(calls) <= 8000, "a response was read more than once"
        return read(response)

    monkeypatch.setattr(judge_prompts, "reasoning_text", counted)
    words = ["".join("abcdefghij"[int(d)] for d in str(k)) for k in range(8000)]
    responses = [f"I weigh the option {w} \\boxed{{[{k}]}}" for k, w in enumerate(words)]
    observations = [f"board {k}" for k in range(8000)]
    assert not judge_prompts.stagnant(observations, responses) and len(calls) == 8000
    calls.clear()
    assert judge_prompts.stagnant(observations, responses[:-1] + [responses[0]])


# ---- serve-judge: a body cap, deadlines, a thread cap
@contextlib.contextmanager
def served(monkeypatch, **bounds):
    """The stand-in judge on a free port, in this process, JudgeHTTPServer's `bounds` lowered."""
    for name, value in bounds.items():
        monkeypatch.setattr(serve_judge.JudgeHTTPServer, name, value)
    server = serve_judge.make_judge_server("127.0.0.1", 0, noise=0.0, seed=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def status_of(port: int, request: bytes) -> int:
    """The status the server answers to `request`, read to the end of its reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


def post(length: str | None) -> bytes:
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    return (
        head + (f"Content-Length: {length}\r\n" if length is not None else "") + "\r\n"
    ).encode()


def test_serve_judge_answers_a_body_over_its_cap_413_unread_and_a_bad_length_400(
    monkeypatch, capfd
):
    assert serve_judge.MAX_BODY == 8 << 20
    with served(monkeypatch) as port:
        # no byte of these bodies is sent: an answer means the server did not wait to read them
        assert status_of(port, post(str(serve_judge.MAX_BODY + 1))) == 413
        assert status_of(port, post(str(300 << 20))) == 413
        assert status_of(port, post(str(10**20))) == 413
        assert status_of(port, post("9" * 5000)) == 413
        assert status_of(port, post("abc")) == 400
        assert status_of(port, post("-5")) == 400
        assert status_of(port, post(None)) == 400
        assert status_of(port, post("2") + b"{}") == 400  # read, and not a chat request
    assert "Traceback" not in capfd.readouterr().err


def cut_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server ends the connection within `seconds` while the client sends `trickle` a
    byte every 0.1 s (nothing: an idle client)."""
    deadline = time.monotonic() + seconds
    for k in itertools.count():
        if time.monotonic() > deadline:
            return False
        if select.select([sock], [], [], 0.1)[0]:  # the server answered or closed
            return True
        with contextlib.suppress(OSError):  # already cut
            sock.sendall(trickle[k : k + 1])
    return False


@pytest.mark.parametrize(
    "sent, trickle",
    [
        (b"", b""),
        (b"POST /v1/chat/completions HTTP/1.1\r\n", b"X-Slow: " + b"a" * 1000),
        (post("1000"), b"{" * 1000),
    ],
    ids=["idle", "trickled headers", "trickled body"],
)
def test_serve_judge_cuts_a_connection_that_does_not_deliver_its_request_in_time(
    monkeypatch, capfd, sent, trickle
):
    assert serve_judge.JudgeHTTPServer.read_seconds == 30
    with served(monkeypatch, read_seconds=0.5) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(sent)
            assert cut_within(s, 5, trickle)
    assert "Traceback" not in capfd.readouterr().err


def handler_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def test_serve_judge_serves_at_most_its_threads_and_then_the_next_connection(monkeypatch):
    """Idle connections beyond the cap wait in the backlog without a thread; once the deadline cuts
    the idle ones, a real request is served."""
    assert serve_judge.JudgeHTTPServer.threads == 64
    with served(monkeypatch, threads=2, read_seconds=0.5) as port:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(6)]
        try:
            most = 0
            for _ in range(10):
                time.sleep(0.05)
                most = max(most, handler_threads())
            assert most == 2
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
            conn.request("GET", "/v1/models")
            assert conn.getresponse().status == 200
        finally:
            for s in idle:
                s.close()


# ---- --spy-data: a plain file, a line bound and a total bound, blank lines in bounded memory
TEXT = b'{"text": "One is here. Two is here. Three is here. Four is here. Five is here."}\n'


@contextlib.contextmanager
def within(seconds: int):
    """Fails the test where its body still runs after `seconds` (a fifo without a writer waits
    forever)."""

    def late(*_):
        raise TimeoutError(f"still running after {seconds} s")

    before = signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def spy_error_of(capsys, argv) -> str:
    assert spyrl.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("spyrl: error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_spy_data_that_is_not_a_plain_file_is_refused_in_one_line_without_waiting(
    capsys, tmp_path, kind
):
    data = tmp_path / "data.jsonl"
    if kind == "fifo":
        os.mkfifo(data)
    else:
        data.symlink_to("/dev/null")  # a link is followed: to a device
    with within(5):
        err = spy_error_of(
            capsys, ["--tiny", "--spy-data", str(data), "--out", str(tmp_path / "r")]
        )
    assert err == (
        f"spyrl: error: --spy-data {data}: not a plain file (a fifo, a device or a socket)\n"
    )
    assert not (tmp_path / "r").exists()


def loaded(data: Path) -> tuple[list[dict] | str, int]:
    """What spy.load_texts makes of `data` (its texts, or its one-line refusal), and the most bytes
    Python held at once meanwhile."""
    tracemalloc.start()
    try:
        got = spy.load_texts(str(data), 0.2, True)
    except UserError as e:
        got = str(e)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return got, peak


def test_spy_data_line_longer_than_its_bound_is_refused_unkept(tmp_path, monkeypatch):
    assert runfiles.LINE_LIMIT == 32 << 20
    monkeypatch.setattr(runfiles, "LINE_LIMIT", 1 << 20)
    data = tmp_path / "data.jsonl"
    data.write_bytes(TEXT)
    with open(data, "ab") as f:
        f.truncate(len(TEXT) + (64 << 20))  # a 64 MiB second line of NUL bytes, sparse
    refusal, peak = loaded(data)
    assert refusal == (
        f"--spy-data {data}, line 2: longer than 1,048,576 bytes, more than a game's prompts hold"
    )
    assert peak < 4 << 20


def test_spy_data_skips_millions_of_blank_lines_in_bounded_memory_and_counts_them(tmp_path):
    data = tmp_path / "data.jsonl"
    blank = b"\n" * 3_000_000 + b"  \r\n\t\n \n"
    data.write_bytes(TEXT + blank + TEXT)
    texts, peak = loaded(data)
    assert texts == [{"text": TEXT[10:-3].decode()}] * 2 and peak < 1 << 20
    data.write_bytes(TEXT + blank + TEXT + b"{oops\n")
    refusal, peak = loaded(data)
    assert refusal.startswith(f"--spy-data {data}, line 3000006: not JSON") and peak < 1 << 20


def test_spy_data_larger_than_its_bound_is_refused_before_or_while_it_is_read(
    tmp_path, monkeypatch
):
    assert spy.DATA_LIMIT == 4 << 30
    monkeypatch.setattr(spy, "DATA_LIMIT", 10 * len(TEXT))
    data = tmp_path / "data.jsonl"
    refusal = (
        f"--spy-data {data}: larger than {10 * len(TEXT):,} bytes, more text than a run holds in "
        "memory: give it a part of the file"
    )
    data.write_bytes(TEXT * 11)
    with pytest.raises(UserError) as refused:
        spy.load_texts(str(data), 0.2, True)
    assert str(refused.value) == refusal
    data.write_bytes(TEXT * 5)
    opened = spy.open_data

    def grown(path: str):  # the file passes the check, then grows while it is read
        f = opened(path)
        with open(path, "ab") as more:
            more.write(TEXT * 20)
        return f

    monkeypatch.setattr(spy, "open_data", grown)
    with pytest.raises(UserError) as refused:
        spy.load_texts(str(data), 0.2, True)
    assert str(refused.value) == refusal
