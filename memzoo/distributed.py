"""Training on several processes (torchrun): data parallel with DDP, or sharded with FSDP2.

    torchrun --nproc_per_node 8 -m memzoo.train paper/gdn-fwpkm2-6-10              # DDP
    torchrun --nproc_per_node 8 -m memzoo.train paper/gdn-pkm2-6-10 --parallel fsdp  # FSDP2

One process is the plain run. With a world of N processes (torchrun's RANK / WORLD_SIZE /
LOCAL_RANK; NCCL on CUDA, one GPU per process, gloo on CPU):

* The global batch stays the config's, whatever N: a step is ``grad_accum`` micro-batches of
  ``batch_size`` sequences, micro-batch i of step s being the stream's batch ``s * grad_accum + i``
  on every world size; rank r takes i = r, r + N, ... (so ``grad_accum`` must be a multiple of N).
  Gradients are averaged over the ranks; the logged loss is the mean over all micro-batches. A
  run on N processes follows the 1-process loss curve (tests/test_distributed.py).
* ``--parallel ddp`` (default) keeps a model per rank; ``fsdp`` shards every block's parameters
  and their optimizer state over the ranks (``fully_shard``): the paper's PKM value tables (262K
  x 512 per layer) are parameters and get sharded.
* Fast weights that persist across steps (FwPKM's, FwMLP's: buffers, not parameters) are neither
  averaged nor sharded: each rank's memory starts from the same initial value and then evolves on
  its own, written by that rank's sequences only, as the authors' release trains it (DDP with
  ``broadcast_buffers=False``). A checkpoint keeps rank 0's.
* Checkpoints hold full (unsharded) model and optimizer states, written by rank 0, so a run resumes
  on any world size and in either mode.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn

PARALLEL = ("ddp", "fsdp")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "World":
        """torchrun's world, or one process."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size == 1:
            return cls()
        return cls(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def join(self, device: str) -> str:
        """Start the process group (NCCL on CUDA, gloo on CPU); this rank's device."""
        if self.size == 1:
            return device
        import torch.distributed as dist

        if device.startswith("cuda"):
            device = f"cuda:{self.local_rank}"
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        return device

    def wrap(self, model: nn.Module, parallel: str, device: str) -> nn.Module:
        """The module to train: `model` itself (one process), DDP around it, or `model` sharded
        in place (FSDP2: each block, then the rest)."""
        if parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
        if self.size == 1:
            return model
        if parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [torch.device(device).index] if device.startswith("cuda") else None
            return DDP(model, device_ids=ids, broadcast_buffers=False)  # fast weights stay each rank's
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model

    def mean(self, x: float) -> float:
        """The mean of a number over the ranks."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        t = torch.tensor([x], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
        return t.item() / self.size

    def all(self, flag: bool) -> bool:
        return self.mean(float(flag)) == 1.0

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        """Leave the process group. The barrier first lets gloo's worker thread finish (and free)
        every earlier collective while this thread waits without the GIL: torn down with one
        still pending, its destructor waits for the GIL that the tearing-down thread holds."""
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts, full and on the CPU on rank 0 (a collective under FSDP2;
    other ranks get empty dicts). The optimizer's is keyed by parameter name, so it loads into any
    world size and mode."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    opts = StateDictOptions(full_state_dict=True, cpu_offload=sharded)
    return get_state_dict(model, opt, options=opts)


def load_full_state(model: nn.Module, opt: torch.optim.Optimizer, model_state: dict, opt_state: dict) -> None:
    """Load what `full_state` returned (on every rank) into a model and optimizer of any mode."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if any(isinstance(p, int) for g in opt_state.get("param_groups", []) for p in g["params"]):
        # a checkpoint of a one-process run from before memzoo.distributed (keyed by position)
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
        return
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=opt_state,
                   options=StateDictOptions(full_state_dict=True))


def no_sync(module: nn.Module, last: bool):
    """Gradients are averaged over the ranks at the last micro-batch of a step only (DDP)."""
    sync = getattr(module, "no_sync", None)
    return contextlib.nullcontext() if last or sync is None else sync()
