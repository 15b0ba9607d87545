"""Reductions over a data-parallel group: the trainers' token and micro-batch counts, and DDP's
gradient average on CPU, through MPI where torch.distributed would use gloo.

gloo's TCP transport costs 180-275 us per all-reduce of one number and 1.5 ms for the tiny job's
300 KB gradient on this 2-core machine, where MPI takes 2-4 us and 0.07-0.2 ms (shared memory
inside a node, the fabric across nodes; `bench/dp_reduce.py`): with 3 counts and one gradient per
minibatch, and DDP's buffer broadcast before every forward (now off: the buffers are constants),
gloo was a fifth of the tiny job's train step (torch engine, dp=2: 52.7 -> 36.9 ms per step).
So when torch.distributed runs on the MPI world's ranks (hpcrl's runtime: torch rank = MPI rank),
a CPU group's reductions go through an MPI communicator of the same ranks; on GPUs (NCCL), or in
a process group of torch's alone, through the group itself.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

_COMMS: dict[tuple[int, ...], object] = {}   # one MPI communicator per set of world ranks
_MPI_TYPES = {torch.float32: "f", torch.float64: "d"}   # the MPI datatype by its typecode


def _mpi_comm(group: dist.ProcessGroup):
    """The MPI communicator of `group`'s ranks, or None when torch's world is not MPI's. Created
    collectively by the group's members (MPI_Comm_create_group), in the order they build their
    engines, and shared by every engine on the same ranks."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_size() != dist.get_world_size() or world.Get_rank() != dist.get_rank():
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _COMMS:
        _COMMS[ranks] = world.Create_group(world.Get_group().Incl(list(ranks)))
    return _COMMS[ranks]


class DataParallelReducer:
    """Sums and maxima of a few numbers, and DDP's gradient average, over `group` (None: one rank)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.device = device
        self.comm = _mpi_comm(self.group) if self.group is not None and device.type == "cpu" else None

    def sums(self, values: list[float]) -> list[float]:
        """Each value summed over the group."""
        return list(values) if self.group is None else self._gathered(values).sum(axis=0).tolist()

    def max(self, value: int) -> int:
        """The largest of the ranks' values."""
        return value if self.group is None else int(self._gathered([value]).max())

    def sums_and_max(self, values: list[float], count: int) -> tuple[list[float], int]:
        """`sums(values)` and `max(count)` in one collective: a minibatch's global token counts and
        micro-batch count, in one wait for the slowest peer."""
        if self.group is None:
            return list(values), count
        table = self._gathered([*values, count])
        return table[:, :-1].sum(axis=0).tolist(), int(table[:, -1].max())

    def _gathered(self, values: list[float]) -> np.ndarray:
        """Every rank's `values` as float64 rows [ranks, len(values)], in one all-gather: each rank
        then sums or maximises the same table, the same way."""
        mine = np.array(values, np.float64)
        if self.comm is not None:
            table = np.empty((self.comm.Get_size(), len(mine)), np.float64)
            self.comm.Allgather(mine, table)
            return table
        gathered = torch.empty(dist.get_world_size(self.group) * len(mine), dtype=torch.float64, device=self.device)
        dist.all_gather_into_tensor(gathered, torch.from_numpy(mine).to(self.device), group=self.group)
        return gathered.view(-1, len(mine)).cpu().numpy()

    def hook(self, model: torch.nn.parallel.DistributedDataParallel) -> bool:
        """Let `model` (DDP over this group) average its gradient buckets through MPI, when on CPU
        (gradients in a dtype MPI has: the trainers' fp32 masters); whether it does."""
        if self.comm is None or any(p.dtype not in _MPI_TYPES for p in model.parameters()):
            return False
        model.register_comm_hook(self.comm, _average_through_mpi)
        return True


def _average_through_mpi(comm, bucket):   # unannotated: DDP checks annotations, and these would be strings
    """DDP's comm hook (a dist.GradBucket in, a Future of its tensor out): the bucket's mean over
    the ranks, reduced in place (a CPU buffer)."""
    from mpi4py import MPI

    flat = bucket.buffer()
    # by address: a numpy view would pin the storage's size, which offload frees (hpcrl.engines.offload)
    memory = MPI.buffer.fromaddress(flat.data_ptr(), flat.numel() * flat.element_size())
    comm.Allreduce(MPI.IN_PLACE, [memory, _MPI_TYPES[flat.dtype]], op=MPI.SUM)
    flat.div_(comm.Get_size())
    done = torch.futures.Future()
    done.set_result(flat)
    return done
