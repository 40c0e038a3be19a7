"""Low-latency all-reduce for the small messages of batch-1 tensor parallelism (a hidden row or a few: 5-64 KB).

``OneShotAllReduce`` runs torch symmetric memory's one-shot kernel: the local input is copied into this rank's
slot of a buffer every rank can read over NVLink peer memory, the ranks meet at a signal-pad barrier, and each
rank sums all slots itself, in rank order (so every rank gets the same bits). One kernel per call, no NCCL
protocol, and it can be captured in CUDA graphs; the kernel ends with a second barrier, so the buffer can be
reused by the next call. It uses plain peer loads, not NVLink multicast, which stays off on the project's
machines (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, set by baton.env.configure_tp_environment).

Messages it does not accept (larger than its buffer, other dtypes, misaligned) take NCCL through
``baton.dist.all_reduce``. ``python -m benchmarks.ops.bench_allreduce`` times both paths, in and out of CUDA graphs.
This module imports on CPU; only ``create_one_shot`` touches CUDA.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 1024  # above this NCCL's ring is as fast, and the buffer stays small
_DTYPES = (torch.bfloat16, torch.float32)  # what the symmetric-memory kernel reduces
_ALIGN = 16  # bytes: the kernel's vector width; inputs must match the buffer's alignment


class OneShotAllReduce:
    """Sum over the ranks of ``group`` with ``torch.ops.symm_mem.one_shot_all_reduce_copy``."""

    def __init__(self, group, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch; harmless on newer
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        for dtype in _DTYPES:
            elem = torch.empty((), dtype=dtype).element_size()
            buf = symm_mem.empty(max_bytes // elem, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, self.group_name)
            self.buffers[dtype] = buf
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy

    def accepts(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dtype in self.buffers and x.is_contiguous() and 0 < x.nbytes <= self.max_bytes
                and x.nbytes % _ALIGN == 0 and x.data_ptr() % _ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.buffers[x.dtype].narrow(0, 0, x.numel()).view(x.shape)
        return self._op(buf, x, "sum", self.group_name)


def create_one_shot(group, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> OneShotAllReduce | None:
    """The one-shot all-reduce for ``group``, or None (with the reason logged) where symmetric memory does not
    set up: no peer access between the GPUs, a torch without the op, ..."""
    if device.type != "cuda" or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        log.info("one-shot all-reduce unavailable (device %s); using NCCL", device)
        return None
    try:
        impl = OneShotAllReduce(group, device, max_bytes)
        probe = torch.ones(_ALIGN // 2, dtype=torch.bfloat16, device=device)
        got = impl(probe)
        torch.cuda.synchronize(device)
        world = torch.distributed.get_world_size(group)
        if not torch.equal(got, torch.full_like(probe, world)):
            raise RuntimeError(f"probe summed to {got.tolist()}, expected {world}")
    except Exception as e:  # an optional fast path: NCCL still works
        log.warning("one-shot all-reduce over symmetric memory unavailable (%s: %s); using NCCL", type(e).__name__, e)
        return None
    log.info("one-shot all-reduce over symmetric memory for messages up to %d KB", max_bytes // 1024)
    return impl
