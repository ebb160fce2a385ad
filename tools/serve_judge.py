"""`stratagem.py serve-judge`: the heuristic stand-in judge behind a local OpenAI-compatible API,
for offline dry runs of the --judge openai path. It is NOT the paper's judge."""

from __future__ import annotations

import hashlib
import http.server
import json
import math
import random
import sys
import time

import judge_prompts
from machinery import UserError
from machinery.flags import FriendlyParser
from stratagem import HeuristicJudge


class JudgeHTTPServer(http.server.ThreadingHTTPServer):
    request_queue_size = 256  # the default backlog of 5 drops bursts of concurrent judge connections


def make_judge_server(host: str, port: int, noise: float, seed: int, delay: float = 0.0) -> JudgeHTTPServer:
    """The heuristic stand-in behind an OpenAI-compatible API (GET /v1/models, POST /v1/chat/completions).
    With `noise`, each level is replaced by a random one with that probability (seeded by the request),
    so it can play a second, disagreeing judge; `delay` seconds before each answer imitate a slow
    model. Usage counts ~4 characters per token."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"object": "list", "data": [{"id": "heuristic", "object": "model", "owned_by": "stratagem"}]})

        def _chat_request(self) -> tuple[dict, str] | None:
            """The request's JSON body and its last message's text; None for anything else (not JSON, not a
            chat request, a bad Content-Length), which is answered 400."""
            length = self.headers.get("Content-Length", "0")
            if not length.isascii() or not length.isdigit():
                return None
            try:
                body = json.loads(self.rfile.read(int(length)) or b"{}")
                content = body["messages"][-1]["content"]
            except (ValueError, RecursionError, KeyError, IndexError, TypeError):
                return None
            return (body, content) if isinstance(content, str) else None

        def do_POST(self):
            request = self._chat_request()
            body, content = request or ({}, "")
            rubric = next((r for r, spec in judge_prompts.RUBRICS.items() if spec["text"] in content), None)
            if rubric is None or judge_prompts.TRAJECTORY_OPEN not in content:
                return self._send(400, {"error": {"message": "not a stratagem rubric request" if request
                                                  else "not a JSON chat completion request"}})
            text = content.split(judge_prompts.TRAJECTORY_OPEN + "\n", 1)[1].rsplit("\n" + judge_prompts.TRAJECTORY_CLOSE, 1)[0]
            scores = HeuristicJudge().scores(rubric, text)
            draw = random.Random(hashlib.sha256(f"{seed}:{content}".encode()).digest())
            levels = judge_prompts.RUBRICS[rubric]["levels"]
            scores = {k: (draw.choice(levels) if draw.random() < noise else v) for k, v in scores.items()}
            reply = json.dumps(scores)
            time.sleep(delay)
            prompt_tokens = sum(len(str(m.get("content", ""))) for m in body["messages"] if isinstance(m, dict)) // 4
            self._send(200, {"id": "heuristic", "object": "chat.completion", "created": 0, "model": body.get("model"),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": reply}}],
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(reply) // 4,
                                       "total_tokens": prompt_tokens + len(reply) // 4}})

    return JudgeHTTPServer((host, port), Handler)


def main(argv: list[str]) -> int:
    p = FriendlyParser(prog="stratagem.py serve-judge", description=(
        "Serve the heuristic stand-in judge as an OpenAI-compatible endpoint, for offline dry runs of the "
        "--judge openai path (cost, cache, agreement). It is NOT the paper's judge."))
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8001, help="port (default: 8001)")
    p.add_argument("--noise", type=float, default=0.0, help="probability of replacing each level by a random one")
    p.add_argument("--seed", type=int, default=0, help="seed of the noise (default: 0)")
    p.add_argument("--delay", type=float, default=0.0, help="seconds to wait before each answer (default: 0)")
    ns = p.parse_args(argv)
    if not (0 <= ns.noise <= 1 and 0 <= ns.delay < math.inf):
        raise UserError("--noise must be in [0, 1] and --delay >= 0")
    if not 0 <= ns.port <= 65535:
        raise UserError(f"--port must be in [0, 65535] (0: any free port), got {ns.port}")
    try:
        server = make_judge_server(ns.host, ns.port, ns.noise, ns.seed, ns.delay)
    except OSError as e:
        raise UserError(f"cannot listen on {ns.host}:{ns.port}: {e.strerror}") from None
    try:  # the line inside: a Ctrl-C right after it is a stop too, not a traceback
        print(f"heuristic judge on http://{ns.host}:{server.server_address[1]}/v1 (Ctrl-C to stop)", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the normal way to stop a server
        print("serve-judge: stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
