"""One kernel commits every layer's staged state of one dtype: program (layer, chunk) copies ``BLOCK`` elements of
``staged[l] + index * stage_stride[l]`` to ``dst[l]``. The tensors' base addresses sit in int64 tables on the device
(built once: a cache's buffers never move), ``index`` is read on the device, so the launch is capture-safe."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.env import triton_interpret

BLOCK = 4096


@triton.jit
def commit_kernel(src_ptrs, dst_ptrs, stage_strides, numels, index_ptr, BLOCK: tl.constexpr,
                  DTYPE: tl.constexpr):
    layer = tl.program_id(0)
    chunk = tl.program_id(1)
    n = tl.load(numels + layer)
    start = chunk.to(tl.int64) * BLOCK
    if start < n:
        idx = tl.load(index_ptr).to(tl.int64)
        src = tl.load(src_ptrs + layer).to(tl.pointer_type(DTYPE))
        dst = tl.load(dst_ptrs + layer).to(tl.pointer_type(DTYPE))
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        src_off = idx * tl.load(stage_strides + layer) + offs
        tl.store(dst + offs, tl.load(src + src_off, mask=mask), mask=mask)


_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def supports(staged: torch.Tensor, dst: torch.Tensor) -> bool:
    """Contiguous tensors of a supported dtype on CUDA (the interpreter has no device addresses to load)."""
    return (staged.is_cuda and dst.is_cuda and staged.is_contiguous() and dst.is_contiguous()
            and dst.dtype in _DTYPES and not triton_interpret())


class CommitTables:
    """The device tables of one model's pairs, grouped by dtype: one launch per dtype."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        device = pairs[0][1].device
        groups: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for staged, dst in pairs:
            groups.setdefault(dst.dtype, []).append((staged, dst))
        self.launches = []
        for dtype, group in groups.items():
            def table(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int64, device=device)

            numels = [d.numel() for _, d in group]
            self.launches.append((
                table([s.data_ptr() for s, _ in group]), table([d.data_ptr() for _, d in group]),
                table([s.stride(0) for s, _ in group]), table(numels),
                (len(group), triton.cdiv(max(numels), BLOCK)), _DTYPES[dtype]))
        self._keep = pairs  # the tables hold raw addresses: keep the tensors alive with them

    def __call__(self, index: torch.Tensor) -> None:
        for src, dst, strides, numels, grid, dtype in self.launches:
            commit_kernel[grid](src, dst, strides, numels, index, BLOCK=BLOCK, DTYPE=dtype, num_warps=4)
