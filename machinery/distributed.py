"""Data parallelism, the choice of device and generation engine, and stopping: the stop signals' handler, a
stuck collective that must not hold a stop up (stop_within), and a finished rank's exit.

`torchrun --nproc-per-node N stratagem.py ...` shards the learner with PyTorch's own FSDP2 and gives every
rank 1/N of the games; steps 2-3 of Algorithm 1 (RAE, judge, A_mod) run on rank 0 over the whole batch.
Without torchrun this is a world of one and every collective returns its input.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import math
import os
import signal
import sys
import threading
import time

import torch

from machinery import UserError
from machinery.openai_api import judge_seconds


def collective_timeout(args, world: int) -> float:
    """How long a rank waits in a collective before the run fails (--dist-timeout): by default torch's own
    30 minutes (for generation, learning, saving) plus the longest a step's judging can take, during which
    every other rank waits for rank 0. A step judges at most ceil(rate * T) trajectories, T <= its
    transitions <= world * (ceil(batch / world) + num_envs * max_turns) (games running at the target play
    on to their end). A --dist-timeout shorter than that judging is refused."""
    most = world * (math.ceil(args.batch_size / world) + args.num_envs * args.max_turns)
    requests = math.ceil(args.judge_sample_rate * most) * len(args.asked) * args.judge_samples
    judging = (
        judge_seconds(requests, args.judge_concurrency, args.judge_timeout, args.judge_retries)
        if args.asked and args.judge_kind.requests
        else 0.0
    )
    if world > 1 and 0 < args.dist_timeout < judging:
        raise UserError(
            f"--dist-timeout {args.dist_timeout:g} is shorter than a step's judging can take "
            f"({judging:g} s: {requests} requests, see docs/torchrun.md); the other ranks wait for it"
        )
    return args.dist_timeout or 1800.0 + judging


class Dist:
    """This process's place among torchrun's ranks. `args` (the run's) sets the collective timeout, see
    collective_timeout(); a collective that times out, or whose peer is gone, ends in one line."""

    def __init__(self, args=None):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.timeout = collective_timeout(args, self.world) if args is not None else None
        if self.world > 1 and not torch.distributed.is_initialized():
            if torch.cuda.is_available():
                torch.cuda.set_device(self.local_rank)
            torch.distributed.init_process_group(
                "nccl" if torch.cuda.is_available() else "gloo",
                timeout=datetime.timedelta(seconds=self.timeout or 1800),
            )

    @property
    def main(self) -> bool:
        return self.rank == 0

    @contextlib.contextmanager
    def collective(self):
        try:
            yield
        except RuntimeError as e:  # gloo's and NCCL's timeouts and lost peers
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"rank {self.rank}: a collective failed after waiting up to {self.timeout or 1800:g} s "
                f"(--dist-timeout): another rank is frozen or gone ({first[:200]}); continue from the "
                "last checkpoint with --resume"
            ) from None

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        with self.collective():
            torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        with self.collective():
            torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Leave together and tear the group down: a gloo group left to the interpreter's exit can
        abort the process ("terminate called without an active exception")."""
        if (
            self.world > 1 and torch.distributed.is_initialized()
        ):  # vLLM's teardown may have done it
            with self.collective():
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def shard(model) -> None:
    """FSDP2 (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html): one unit per decoder
    layer, whose parameters are gathered only for its own compute (a LoRA model's frozen base and its adapters
    together); the root unit holds the embeddings, the final norm and the (tied) head. Gradients are
    reduce-scattered, i.e. averaged over ranks."""
    from torch.distributed.fsdp import fully_shard

    base = (
        model.get_base_model() if hasattr(model, "get_base_model") else model
    )  # LoRA: the layers hold the adapters
    for layer in base.model.layers:
        fully_shard(layer)
    fully_shard(model)


def fsdp_api(model):
    """torch's full-state-dict API if `model` is sharded by FSDP (each call a collective: every rank makes
    it), else None."""
    from torch.distributed.checkpoint import state_dict
    from torch.distributed.fsdp import FSDPModule

    return state_dict if isinstance(model, FSDPModule) else None


def full_weights(model) -> dict[str, torch.Tensor]:
    """All of the model's weights on this rank."""
    if (api := fsdp_api(model)) is None:
        return dict(model.named_parameters())
    return api.get_model_state_dict(model, options=api.StateDictOptions(full_state_dict=True))


def even_micro_batches(chunks: list[list[tuple]], dist: Dist) -> tuple[list[list[tuple]], int]:
    """FSDP: every rank runs as many forward and backward passes as the others, since each is a
    collective. A rank with fewer micro-batches repeats its last one at advantage 0, which adds no
    gradient. Returns the micro-batches and how many of them are real."""
    real = len(chunks)
    repeat = [(prompt, response, 0.0, *rest) for prompt, response, _, *rest in chunks[-1]]
    return chunks + [repeat] * (max(dist.gather(real)) - real), real


def clip_grad_norm(model, max_norm: float) -> float:
    """torch's clip_grad_norm_, returning the norm over every rank's shard (FSDP: a DTensor)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()


def optimizer_state(model, optimizer) -> dict:
    """The optimizer's state as one whole dict (on rank 0 under FSDP)."""
    if (api := fsdp_api(model)) is None:
        return optimizer.state_dict()
    options = api.StateDictOptions(full_state_dict=True, cpu_offload=True)
    return api.get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model, optimizer, state: dict) -> None:
    if (api := fsdp_api(model)) is None:
        return optimizer.load_state_dict(state)
    api.set_optimizer_state_dict(
        model, optimizer, state, options=api.StateDictOptions(full_state_dict=True)
    )


def pick_device(spec: str, local_rank: int = 0) -> torch.device:
    """'auto': this process's GPU if there is one, else the CPU. A device torch does not know, or a GPU
    this machine does not have, ends in one line before any work."""
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UserError(
            f"--device {spec!r} is not a torch device (auto, cpu, cuda, cuda:1, ...)"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {spec}: no CUDA GPU is available here (use --device cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(
            f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA GPU(s)"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {spec}: MPS is not available here")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device {spec}: only cpu, cuda[:N] and mps are supported")
    return device


def pick_threads(device: torch.device) -> tuple[int, str]:
    """torch's intra-op threads, set here, and why: OMP_NUM_THREADS when the user sets it; on a CPU learner half the
    cores this process may use (at least 1), because the games, the tokenizer and the rest of the machine need the
    others, and OpenMP threads that outnumber the free cores spin at every barrier (on the 2-core machine this
    project is built on, at load 8, a tiny step took 52 s with 2 threads and 3.6 s with 1: docs/speed.md); on a GPU
    torch's default (the GPU does the work)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) >= 1:
        threads, why = int(given), "OMP_NUM_THREADS"
    elif device.type == "cpu":
        cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
        threads, why = max(1, cores // 2), f"half of {cores} cores; OMP_NUM_THREADS sets it"
    else:
        return torch.get_num_threads(), "torch's default"
    torch.set_num_threads(threads)
    return threads, why


def pick_backend(spec: str, device: torch.device) -> tuple[str, str]:
    """--backend and why: 'auto' is vllm where vLLM is installed and the device is a GPU, else hf."""
    if spec != "auto":
        return spec, "--backend " + spec
    if device.type != "cuda":
        return "hf", f"auto: {device.type}, not a GPU"
    if importlib.util.find_spec("vllm") is None:
        return "hf", "auto: vLLM is not installed"
    return "vllm", "auto: a GPU and vLLM"


_stop_pipe: list[int] = []  # the read and write ends of stop_within()'s pipe, made once per process
_inside = threading.Event()  # set while the main thread is inside stop_within()
_entered = [0]  # how often it entered: a signal of an earlier context does not end a later one


@contextlib.contextmanager
def stop_within(seconds: float):
    """Within this context Ctrl-C, SIGTERM or SIGHUP ends the process within `seconds` even when its main thread
    cannot stop: Python runs signal handlers in the main thread between bytecodes, so a main thread blocked
    in C++ (a collective waiting for a frozen rank) never sees the signal. The C-level handler also writes
    the signal's number to a pipe (signal.set_wakeup_fd), which a daemon thread reads; if the main thread is
    still inside the context `seconds` later, the thread ends the process (exit code 128 + the signal, as the
    handler's would be). A main thread that has left it has stopped: its own exit (which load can make slower
    than `seconds`) is left alone."""
    if not _stop_pipe:
        _stop_pipe.extend(os.pipe())
        os.set_blocking(_stop_pipe[1], False)

        def watch() -> None:
            while True:
                signum = os.read(_stop_pipe[0], 1)[0]
                if signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    entered = _entered[0]
                    time.sleep(seconds)
                    held = any(h.held is not None and len(h.stopping) == 1 for h in HANDLERS)
                    if not _inside.is_set() or held or _entered[0] != entered:  # held: the step
                        continue  # ends, then it; a later context: that stop has ended
                    print(
                        f"stratagem: stopped by {signal.Signals(signum).name}; the run did not stop within "
                        f"{seconds:g} s (blocked in a collective?), so it was ended there",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(128 + signum)

        threading.Thread(target=watch, daemon=True).start()
    previous = signal.set_wakeup_fd(_stop_pipe[1], warn_on_full_buffer=False)
    _entered[0] += 1
    _inside.set()
    try:
        yield
    finally:
        _inside.clear()
        signal.set_wakeup_fd(previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, `kill`) or SIGHUP (a closed terminal or ssh session), raised where the program
    is, so it stops like Ctrl-C. Its argument is the signal's name."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stopped(signum: int) -> KeyboardInterrupt:
    """What a stop signal raises: KeyboardInterrupt for Ctrl-C, else Terminated."""
    return (
        KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signal.Signals(signum).name)
    )


HELD = b"stratagem: stopping once this step is done and saved (again to stop at once, losing it)\n"


def stop_handler():
    """The handler of STOP_SIGNALS: the first raises where the program is; later ones are ignored, so a
    second Ctrl-C cannot break the stop under way (releasing the run, saying how to resume, exiting) into a
    traceback. While `hold` is set (a step has updated the weights and is not yet saved: lifecycle), the
    first is held instead (`held`), and the step ends first; a second raises at once. stop_within() still
    ends a run that cannot stop. The handler's `stopping` lists the signals received."""

    def handler(signum, frame):
        handler.stopping.append(signum)
        if len(handler.stopping) == 1 and handler.hold:
            handler.held = signum
            os.write(2, HELD)  # print() is not safe in a signal handler
        elif len(handler.stopping) == 1 + (handler.held is not None):
            raise stopped(signum)

    handler.stopping, handler.hold, handler.held = [], False, None
    HANDLERS[:] = [handler]
    return handler


HANDLERS: list = []  # this process's stop handler, once cli.main has set it (lifecycle holds a stop)
ON_STOP: list = []  # what a stop signal does before the run ends (lifecycle.keep_step)


def hold(on: bool) -> None:
    """Hold a stop signal until the step ends (on), or stop holding and raise one held (off)."""
    for handler in HANDLERS:
        handler.hold = on
        if not on and handler.held is not None and len(handler.stopping) == 1:
            handler.stopping.append(handler.held)  # a later signal is ignored, as after a raise
            raise stopped(handler.held)


def leave(code: int) -> None:
    """The process's exit. A torchrun rank whose run has ended (its files closed, its process group destroyed)
    leaves without the interpreter's teardown: gloo's threads are still running then (torch's caches keep the
    group after destroy_process_group), and tearing down around them has aborted a rank ("terminate called
    without an active exception") on a busy machine."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
