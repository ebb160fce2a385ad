"""A script's entry point, shared by stratagem.py and spyrl.py: parse, train (or run a command), and
end every mistake a user can make in one line with exit code 2; stop signals end a run in one line
that says how to resume it. A finished run prints its closing line (watch.closing_line)."""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import signal
import sys
import threading
from pathlib import Path

from machinery import UserError, runfiles, visible, watch
from machinery.distributed import ON_STOP, STOP_SIGNALS, Terminated, stop_handler, stop_within

# The commands around the trainer (`stratagem.py COMMAND`): each is tools/<module>.py, imported
# by its name when it is run, so --help and a training run load none of them.
TOOLS = {
    "eval": "eval",
    "plot": "plot",
    "show": "show",
    "agree": "agree",
    "serve-judge": "serve_judge",
    "bench": "bench",
    "random-model": "random_model",
    "sync-check": "sync_check",
    "merge-lora": "merge_lora",
    "real-model": "real_model",
    "warmstart": "warmstart",
    "ablation": "ablation",
    "refresh-docs": "refresh_docs",
}


def run_tool(name: str, argv: list[str]) -> int:
    """`stratagem.py NAME ...`: tools/<module>.py's main(argv)."""
    return importlib.import_module(f"tools.{TOOLS[name]}").main(argv)


OS_ERRORS = {  # the file system's refusals a user can cause, in words
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.ENAMETOOLONG: "a file name is too long",
    errno.EFBIG: "a file would grow too large",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "no permission",
    errno.EPERM: "the operation is not permitted",
}


def os_error(e: OSError, run_dir: Path | None) -> str:
    """One line for an OSError: what happened, to which file, and how to go on (a full disk: make room, resume)."""
    what, full = (
        OS_ERRORS.get(e.errno, e.strerror or type(e).__name__),
        e.errno in (errno.ENOSPC, errno.EDQUOT),
    )
    if full:
        return f"{what} writing {e.filename or 'a file'}" + (
            f"; make room, then continue with --resume --out {run_dir}" if run_dir else ""
        )
    return f"{what}: {e.filename}" if e.filename else what


def main(prog: str, argv: list[str], parse, train, commands=()) -> int:
    """`prog [flags]` trains: `parse(argv)` -> the run's arguments, `train(args)` -> its folder (None on
    other ranks, for --dry-run and for a finished run); `prog COMMAND ...` runs a command of
    `commands` (names of TOOLS) with the rest."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    on_stop = (
        stop_handler()
    )  # machinery/distributed.py: the first stop signal stops, later ones wait
    previous = {s: signal.signal(s, on_stop) for s in STOP_SIGNALS} if in_main_thread else {}
    run_dir = None  # set once a training run is resolved: the resume advice names it
    try:
        if argv and argv[0] in commands:
            return run_tool(argv[0], argv[1:])
        args = parse(argv)
        run_dir = Path(args.out)
        with stop_within(5.0) if in_main_thread else contextlib.nullcontext():  # a stuck collective
            out = train(args)
        if out is not None:  # a run trained (rank 0): its outputs (best.json's), the commands next
            print(visible(watch.closing_line(out, args), lines=False), flush=True)
    except UserError as e:
        print(f"{prog}: error: {visible(str(e), lines=False)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `stratagem.py show RUN | head` closed the pipe: not an error
        os.dup2(
            os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno()
        )  # no second complaint at exit
        return 0
    except (
        OSError
    ) as e:  # the file system said no: a name too long, a full disk, a read-only folder, ...
        print(f"{prog}: error: {visible(os_error(e, run_dir), lines=False)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        with contextlib.suppress(UserError, OSError):  # a step that cannot be saved is lost
            for keep in ON_STOP:  # the last finished step, saved where it was not
                keep()
        name = e.args[0] if isinstance(e, Terminated) else "SIGINT"
        how = "Ctrl-C" if name == "SIGINT" else name
        advice = visible(runfiles.resume_advice(run_dir), lines=False)
        print(f"{prog}: stopped by {how}{advice}", file=sys.stderr)
        return 128 + signal.Signals[name]  # as the signal's default action would: 130, 143, 129
    finally:
        ON_STOP.clear()  # the run's: a later command in this process has its own
        runfiles.release_runs()
        for s, handler in (
            previous.items() if not on_stop.stopping else ()
        ):  # stopped: it stays till exit
            signal.signal(s, handler)
    return 0
