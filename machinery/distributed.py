"""Data parallelism and the choice of device and generation engine.

`torchrun --nproc-per-node N stratagem.py ...` shards the learner with PyTorch's own FSDP2 and gives every
rank 1/N of the games; steps 2-3 of Algorithm 1 (RAE, judge, A_mod) run on rank 0 over the whole batch.
Without torchrun this is a world of one and every collective returns its input.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from machinery import UserError


class Dist:
    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.world > 1 and not torch.distributed.is_initialized():
            if torch.cuda.is_available():
                torch.cuda.set_device(self.local_rank)
            torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Leave together and tear the group down: a gloo group left to the interpreter's exit can
        abort the process ("terminate called without an active exception")."""
        if self.world > 1 and torch.distributed.is_initialized():  # vLLM's teardown may have done it
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def shard(model) -> None:
    """FSDP2 (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html): one unit per decoder
    layer, whose parameters are gathered only for its own compute; the root unit holds the embeddings,
    the final norm and the (tied) head. Gradients are reduce-scattered, i.e. averaged over ranks."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
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


def optimizer_state(model, optimizer) -> dict:
    """The optimizer's state as one whole dict (on rank 0 under FSDP)."""
    if (api := fsdp_api(model)) is None:
        return optimizer.state_dict()
    options = api.StateDictOptions(full_state_dict=True, cpu_offload=True)
    return api.get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model, optimizer, state: dict) -> None:
    if (api := fsdp_api(model)) is None:
        return optimizer.load_state_dict(state)
    api.set_optimizer_state_dict(model, optimizer, state, options=api.StateDictOptions(full_state_dict=True))


def pick_device(spec: str, local_rank: int = 0) -> torch.device:
    """'auto': this process's GPU if there is one, else the CPU. A device torch does not know, or a GPU
    this machine does not have, ends in one line before any work."""
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UserError(f"--device {spec!r} is not a torch device (auto, cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {spec}: no CUDA GPU is available here (use --device cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {spec}: MPS is not available here")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device {spec}: only cpu, cuda[:N] and mps are supported")
    return device


def pick_backend(spec: str, device: torch.device) -> tuple[str, str]:
    """--backend and why: 'auto' is vllm where vLLM is installed and the device is a GPU, else hf."""
    if spec != "auto":
        return spec, "--backend " + spec
    if device.type != "cuda":
        return "hf", f"auto: {device.type}, not a GPU"
    if importlib.util.find_spec("vllm") is None:
        return "hf", "auto: vLLM is not installed"
    return "vllm", "auto: a GPU and vLLM"
