"""The suite's own hygiene, for every test file: it ends with no process of its own left behind.

Every process a test starts (a run, torchrun and its ranks, vLLM's engine, a server) inherits this session's mark
in its environment; when the session ends, one still alive is reported as an error, and ended.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

MARK = "STRATAGEM_TEST_SESSION"


def marked(tag: str) -> dict[int, str]:
    """{pid: command line} of the live processes (zombies aside) whose environment carries this session's mark."""
    needle, found = f"{MARK}={tag}".encode(), {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0") and (proc / "stat").read_text().split()[2] != "Z":
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
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
