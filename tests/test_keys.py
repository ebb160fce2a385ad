"""Tests of where the API key may go and of what the judge promises (issue 38): no redirect followed, no key in
anything a server's text reaches, the demo judge on a port of its own, Retry-After capped, no reply taken from a
reused connection, structured verdicts verified; and the stand-in judge's repeat and deepening checks. Each
failed before its fix (docs/reliability.md)."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
import types
import urllib.request

import pytest

import judge_prompts
import stratagem as S
from machinery import UserError, watch
from machinery import judge as J
from machinery.openai_api import RETRY_WAIT_MAX, JudgeFailure, judge_seconds
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    PROBE_ANSWER,
    SMALL,
    JudgeServer,
    RawJudgeServer,
    completion,
    error_of,
    good_judge,
    is_probe,
    judge_args,
    no_process_left_behind,
    only_the_vllm_tests,
    run,
    secret_key_fixture,
)
from tools import serve_judge


class Server:
    """A local HTTP server whose handler is `answer(handler, body or None)` -> (status, payload, headers); the
    body is None for a GET, the payload JSON or raw bytes."""

    def __init__(self, answer):
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, body):
                status, payload, headers = answer(self, body)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                for k, v in {"Content-Length": str(len(data)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply(None)

            def do_POST(self):
                self._reply(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

        self.httpd = serve_judge.JudgeHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def listener(port: int = 0) -> socket.socket:
    """A socket that listens and never accepts: a connection to it waits in its backlog, where connected() sees it."""
    sock = socket.create_server(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


def connected(sock: socket.socket) -> bool:
    try:
        sock.accept()[0].close()
        return True
    except BlockingIOError:
        return False


MODELS = {"object": "list", "data": [{"id": "judge-test", "object": "model"}]}


# ---- 1. the key goes where the command line says, and nowhere a server sends it
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_BoundedClient_follows_no_redirect_and_a_redirecting_judge_is_refused_in_one_line(
    tmp_path, capsys, secret_key, method
):
    """A judge answering 307 towards another server: the start-up check refuses it in one line (the models list or
    the probe), a request is a counted http_307, and the other server never gets a connection."""
    elsewhere = listener()
    target = f"http://127.0.0.1:{elsewhere.getsockname()[1]}/v1/chat/completions"

    def answer(handler, body):
        if handler.command == method or (body is not None and not is_probe(body)):
            return 307, b"", {"Location": target}
        return 200, MODELS, {}

    server = Server(answer)
    try:
        flags = ["--judge", "openai", "--judge-base-url", server.url, "--judge-timeout", "5"]
        err = error_of(capsys, SMALL + ["--steps", "1", *flags, "--out", str(tmp_path / "r")])
        with pytest.raises(JudgeFailure) as failed:
            J.OpenAIJudge("judge-test", server.url, judge_args(server.url)).complete(
                "evolution", judge_prompts.build_messages("evolution", "a trajectory")
            )
    finally:
        server.close()
    said = {
        "GET": f"answered with a redirect (HTTP 307 to {target}); a redirect is never followed",
        "POST": "failed its start-up check: HTTP 307; a redirect is never followed",
    }
    assert said[method] in err and not (tmp_path / "r").exists()
    assert failed.value.kind == "http_307"
    with elsewhere:
        assert not connected(elsewhere)


ECHOES = {
    "header line": "bad request; you sent Authorization: {auth}",
    "json headers": '{{"headers": {{"authorization": "{auth}", "accept": "application/json"}}}}',
    "the key alone": "Incorrect API key provided: {key}. You can find your key elsewhere.",
    "key across the cut": "x" * 140 + " key {key}",
}


def echoing(template: str, probe_too: bool):
    """A judge whose 400 message echoes the request's Authorization header (and the key), as some proxies do."""

    def answer(handler, body):
        if body is None:
            return 200, MODELS, {}
        if is_probe(body) and not probe_too:
            return 200, PROBE_ANSWER, {}
        auth = handler.headers.get("Authorization", "")
        message = template.format(auth=auth, key=auth.removeprefix("Bearer "))
        return 400, {"error": {"message": message}}, {}

    return answer


@pytest.mark.parametrize("echo", ECHOES, ids=list(ECHOES))
def test_scrub_keeps_a_key_a_judge_echoes_out_of_the_error_line(tmp_path, capsys, secret_key, echo):
    server = Server(echoing(ECHOES[echo], probe_too=True))
    try:
        flags = ["--judge", "openai", "--judge-base-url", server.url, "--judge-structured", "off"]
        err = error_of(capsys, SMALL + ["--steps", "1", *flags, "--out", str(tmp_path / "r")])
    finally:
        server.close()
    assert "failed its start-up check: HTTP 400: " in err and "***" in err
    assert secret_key[:10] not in err  # not even a part of it


def test_scrub_keeps_a_key_a_judge_echoes_out_of_a_runs_output_and_files(
    tmp_path, capsys, secret_key
):
    """The probe answered, then every rubric request a 400 echoing the key: the run ends, its failures counted,
    with the key nowhere in what it printed or wrote."""
    server = Server(echoing(ECHOES["header line"], probe_too=False))
    out = tmp_path / "run"
    try:
        flags = ["--judge", "openai", "--judge-base-url", server.url, "--judge-sample-rate", "1"]
        assert run(SMALL + ["--steps", "1", "--out", str(out), "--judge-retries", "0", *flags]) == 0
        with pytest.raises(
            JudgeFailure
        ) as failed:  # the failure's own text, as a fork might log it
            J.OpenAIJudge("judge-test", server.url, judge_args(server.url)).complete(
                "evolution", judge_prompts.build_messages("evolution", "a trajectory")
            )
    finally:
        server.close()
    said = capsys.readouterr()
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["judge_failures"] == {"http_400": metrics["judge_judged"]}
    assert secret_key not in said.out + said.err
    assert not any(secret_key.encode() in p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert "Authorization: Bearer ***" in str(failed.value) and secret_key not in str(failed.value)


def test_Reporter_of_a_wandb_error_that_echoes_the_key_shows_no_key(
    monkeypatch, secret_key, tmp_path
):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-key-0123456789abcdef")
    reporter = watch.Reporter("wandb")

    def init(**kw):
        raise RuntimeError(f"login refused for key wandb-key-0123456789abcdef (also {secret_key})")

    errors = types.SimpleNamespace(Error=RuntimeError)
    reporter.lib = types.SimpleNamespace(init=init, errors=errors, Settings=lambda **kw: None)
    with pytest.raises(UserError) as refused:
        reporter.open(tmp_path, S.Args(), 0)
    assert str(refused.value).startswith("--report-to wandb: login refused for key *** (also ***)")


def test_refresh_docs_start_judge_binds_a_port_of_its_own_never_the_one_another_holds():
    """With another listener on the demo's old port 8741, the demo's judge is the server it started, on the port
    that server names; a judge that cannot start is one line."""
    from tools import refresh_docs

    try:
        held = listener(8741)
    except OSError:  # someone else holds it: the test still shows the demo uses a port of its own
        held = listener()
    server, url = refresh_docs.start_judge(["--teacher", "heuristic"])
    try:
        with urllib.request.urlopen(url + "/models", timeout=30) as r:
            assert json.load(r)["data"][0]["id"] == "heuristic"
    finally:
        refresh_docs.stop_judge(server)
    with held:
        assert f":{held.getsockname()[1]}/" not in url and not connected(held)
    with pytest.raises(
        UserError, match=r"^serve-judge --noise 2 did not start: .*--noise must be in"
    ):
        refresh_docs.start_judge(["--noise", "2"])


# ---- 5. the judge's promises
@pytest.mark.parametrize("retry_after, waited", [("100", RETRY_WAIT_MAX), ("7", 7.0)])
def test_openai_client_waits_at_most_RETRY_WAIT_MAX_whatever_Retry_After_asks(
    monkeypatch, secret_key, retry_after, waited
):
    """A 429 asking for 100 s, then a verdict: the one retry comes after RETRY_WAIT_MAX (60 s), the bound that
    judge_seconds and --dist-timeout's default count; a shorter Retry-After is honoured as asked."""
    asked = []

    def flaky(body):
        if not asked:
            asked.append(body)
            return 429, {"error": {"message": "slow down"}}, {"Retry-After": retry_after}
        return good_judge(body)

    server = JudgeServer(flaky)
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)  # openai sleeps through time.sleep
    try:
        judge = J.OpenAIJudge("judge-test", server.url, judge_args(server.url, judge_retries=1))
        reply, _, _ = judge.complete(
            "evolution", judge_prompts.build_messages("evolution", "a trajectory")
        )
    finally:
        server.close()
    assert slept == [waited] and J.parse_scores(reply, "evolution")
    assert RETRY_WAIT_MAX == 60.0 and judge_seconds(1, 1, 10.0, 1) == 2 * 10.0 + 60.0


def keep_alive(payload: dict) -> bytes:
    body = json.dumps(payload).encode()
    head = (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def two_replies(conn, body):
    """Answers a request, keeps the connection open, and answers it again on the next request it brings."""
    asked = body["messages"][-1]["content"]
    conn.sendall(keep_alive(completion(f"reply to {asked}")))
    conn.settimeout(5)
    if conn.recv(65536):  # the client sent its next request on this connection
        conn.sendall(keep_alive(completion(f"second reply to {asked}")))


def test_BoundedClient_never_takes_a_reply_left_on_a_connection_as_the_next_requests():
    server = RawJudgeServer(two_replies)
    try:
        judge = J.OpenAIJudge("judge-test", server.url, judge_args(server.url))
        replies = [
            judge.complete("evolution", [{"role": "user", "content": asked}])[0]
            for asked in ("first", "second", "third")
        ]
    finally:
        server.close()
    assert replies == ["reply to first", "reply to second", "reply to third"]


def schema_ignored_in_prose(body):
    """A server that ignores response_format: its model wraps the verdict asked for in words."""
    asked = body["messages"][-1]["content"].removeprefix(J.PROBE_TEXT)
    return 200, completion(f"Sure! Here it is:\n```json\n{asked.strip()}\n```")


def schema_ignored_obediently(body):
    """A server that ignores response_format: its model answers exactly the object the words ask for."""
    return 200, completion(body["messages"][-1]["content"].removeprefix(J.PROBE_TEXT).strip())


def schema_honoured(body):
    return 200, completion(json.dumps(J.probe_verdict()))


@pytest.mark.parametrize("behaviour", [schema_ignored_in_prose, schema_ignored_obediently])
def test_check_reachable_with_structured_on_refuses_a_judge_that_ignores_the_schema(
    tmp_path, capsys, secret_key, behaviour
):
    server = JudgeServer(behaviour, answer_probe=False)
    try:
        flags = ["--judge", "openai", "--judge-base-url", server.url, "--judge-model", "judge-test"]
        flags += ["--judge-structured", "on", "--steps", "1", "--out", str(tmp_path / "r")]
        err = error_of(capsys, SMALL + flags)
        args = judge_args(server.url, judge_model="judge-test")
        line = J.OpenAIJudge("judge-test", server.url, args).check_reachable()  # auto
    finally:
        server.close()
    assert "its reply does not follow the schema sent as response_format" in err
    assert "it ignores response_format: pass --judge-structured off (or auto)" in err
    assert not (tmp_path / "r").exists()
    assert line.endswith(
        "verdicts: free text, parsed; --judge-structured auto: the server refused or ignored the schema"
    )


def test_check_reachable_with_structured_on_takes_a_judge_that_honours_the_strict_schema(
    secret_key,
):
    server = JudgeServer(schema_honoured, answer_probe=False)
    try:
        args = judge_args(server.url, judge_model="judge-test", judge_structured="on")
        line = J.OpenAIJudge("judge-test", server.url, args).check_reachable()
    finally:
        server.close()
    assert "verdicts: structured (response_format" in line
    sent = server.requests[0]["body"]["response_format"]
    assert sent["json_schema"]["strict"] is True
    assert sent["json_schema"]["schema"] == judge_prompts.verdict_schema(J.PROBE_RUBRIC)


@pytest.mark.parametrize(
    "reply, follows",
    [
        ('{"alpha": 0.5, "sigma": 1, "rho": 0}', True),
        (' {"alpha": 0.5, "sigma": 1, "rho": 0}\n', True),
        ('{"alpha": 0.5, "sigma": 1, "rho": 0, "unscored": 1}', False),  # a key the schema forbids
        ('{"alpha": 0.5, "sigma": 1}', False),  # a key missing
        ('{"alpha": 0.25, "sigma": 1, "rho": 0}', False),  # not a level
        ('{"alpha": "0.5", "sigma": 1, "rho": 0}', False),  # a string, not a number
        ('{"alpha": true, "sigma": 1, "rho": 0}', False),  # a boolean, not a number
        ('Verdict: {"alpha": 0.5, "sigma": 1, "rho": 0}', False),  # words around it
    ],
)
def test_follows_schema_takes_the_schemas_object_and_nothing_else(reply, follows):
    assert J.follows_schema(reply, "transferability") is follows


# ---- the stand-in judge: repeats found in one pass, deepening as new words
def test_HeuristicJudge_repeated_reads_each_turn_once_and_sets_case_spacing_numbers_and_moves_aside(
    monkeypatch,
):
    read = []
    reasoning_text = judge_prompts.reasoning_text
    monkeypatch.setattr(
        judge_prompts, "reasoning_text", lambda x: read.append(x) or reasoning_text(x)
    )
    texts = [f"Turn {'i' * k}: I weigh it. \\boxed{{[{k}]}}" for k in range(1, 301)]
    assert not J.HeuristicJudge._repeated(texts) and len(read) == len(texts)  # 300, not 300 * 299
    assert J.HeuristicJudge._repeated([*texts, "turn I:  i weigh it. \\boxed{[bet]}"])
    assert J.HeuristicJudge._repeated(["I take cell 4.", "Round two.", "i take  cell 12."])


def deepens(*responses: str) -> float:
    turns = [S.Turn(f"board {k}", r, "[1]", [], []) for k, r in enumerate(responses)]
    text = J.render_for_judge(S.Trajectory("KuhnPoker-v1", 0, turns, 0.0))
    return J.HeuristicJudge().scores("evolution", text)["d"]


def test_HeuristicJudge_new_words_leave_out_the_move_of_the_last_turn():
    assert deepens("Round one.", "Round one. Round one. \\boxed{[raise]}") == 0.0
    assert deepens("Round one.", "Round one, raise. \\boxed{[raise]}") == 1.0


def test_HeuristicJudge_new_words_have_three_letters_or_more():
    assert deepens("Round one.", "Round one, go.") == 0.0  # two letters: not content
    assert deepens("Round one.", "Round one, bet.") == 1.0  # three letters: content


def test_HeuristicJudge_new_words_are_new_against_every_earlier_turn_not_only_the_first():
    assert deepens("Round one.", "Round one, fold now.", "Round one, fold.") == 0.0
    assert deepens("Round one.", "Round one, fold now.", "Round one, call.") == 1.0


def test_JudgeFailure_detail_is_scrubbed_of_a_bearer_token_whatever_the_key(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    failure = JudgeFailure("http_400", "HTTP 400: sent {'authorization': 'Bearer abc.def-123'}")
    assert failure.detail == "HTTP 400: sent {'authorization': 'Bearer ***'}"
