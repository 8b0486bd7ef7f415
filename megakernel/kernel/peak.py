"""The roofline's peak read bandwidth by the copies the megakernel streams with (csrc/mk_peak.cuh: every SM reads its
share of a buffer through 16 KB bulk copies, 128 KB in flight). On the H200 such copies reached 4.62 TB/s where a
torch reduction over the same bytes reaches 3.97-4.17 (benchmarks/mem_latency.cu, SPEED_NOTES' twentieth session),
so a roofline measured by the reduction alone flatters a kernel that streams by TMA. sm_90 GPUs only."""

from __future__ import annotations

import ctypes

import torch

from megakernel.kernel import build
from megakernel.kernel.tuning import select_card_build


def available(device: torch.device) -> bool:
    """Whether the bulk-copy measurement can run here: a CUDA device of compute capability 9.x and nvcc."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and build.find_nvcc() is not None)


def bulk_read_bandwidth(buf: torch.Tensor, repeats: int = 5) -> float:
    """Best of `repeats` timed reads of `buf` (a CUDA tensor) by every SM's bulk copies, in bytes/s (the bytes read:
    the buffer rounded down to whole 16 KB chunks per SM)."""
    dev = buf.device
    # (this card's build switches, as the backend selects them: the same library when both run in one process)
    select_card_build(torch.cuda.get_device_name(dev))
    lib = build.load("sm_90a")
    grid = torch.cuda.get_device_properties(dev).multi_processor_count
    stream = torch.cuda.current_stream(dev)
    read = ctypes.c_longlong(0)
    best = float("inf")
    for i in range(repeats + 1):                 # (the first launch also loads the module: not timed)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        rc = lib.mk_read_peak_launch(dev.index if dev.index is not None else torch.cuda.current_device(),
                                     ctypes.c_void_p(buf.data_ptr()), buf.numel() * buf.element_size(), grid,
                                     ctypes.c_void_p(stream.cuda_stream), ctypes.byref(read))
        end.record(stream)
        if rc != 0:
            raise RuntimeError(f"mk_read_peak_launch: {lib.mk_error_string(rc).decode()}")
        end.synchronize()
        if i > 0:
            best = min(best, start.elapsed_time(end) / 1e3)
    return read.value / best
