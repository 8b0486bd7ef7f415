"""Microbenchmark of the megakernel's GEMV inner loop on its own: the kernel's bulk-copy loader and GEMV cores
(csrc/mk_loader.cuh, mk_gemv_core.cuh, mk_gemv_swz.cuh, included unchanged) streaming weight tiles through every
SM, without the task list (see gemv_stream.cu for the modes: serial, double-buffered, loads only, math only, and
serial / double-buffered with tiles claimed from one global queue as MoE workers claim items, warp-specialised:
one loader warp, 15 compute warps, with and without the queue, the swizzled tiles' serial, double and math-only
modes, and serial tiles with a MoE gate/up item's tail: stores and a fenced release, the next tile issued before or
after it).

    python benchmarks/gemv_stream.py --json OUT.json        # on an sm_90 GPU, ~20 s

Per (tile shape, input rows, mode) it prints us per tile per SM and the GB/s of weights over all SMs, next to the
peak read bandwidth measured in the same run; it checks each tile's first and a last-row output against torch
(fp32) first. What it answers: how fast one SM can stream and multiply tiles when nothing else is in the way,
whether issuing the next tile before computing this one pays by itself (the megakernel's `prefetch` knob measured
slower in the step), what claiming each tile from a shared queue costs on top, and what the swizzled tiles gain.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from megakernel.kernel import build, opcodes as O

HERE = Path(__file__).parent
MODES = {"serial": 0, "double": 1, "load": 2, "compute": 3, "queue": 4, "queue2": 5, "ws": 6, "ws_queue": 7,
         "swz_serial": 8, "swz_double": 9, "swz_compute": 10, "epi": 11, "epi_early": 12, "epi_early_nf": 13,
         "epi_nf": 14}


def compile_bench(arch: str = "sm_90a") -> ctypes.CDLL:
    nvcc = build.find_nvcc()
    if nvcc is None:
        raise SystemExit("nvcc not found")
    d = Path(tempfile.mkdtemp(prefix="gemv_stream_"))
    for name, text in build.source_texts().items():
        (d / name).write_text(text)
    # the swizzled tiles' core: in csrc beside the kernel's sources, no longer part of the kernel's build (MK_SWZ)
    (d / "mk_gemv_swz.cuh").write_text((build.CSRC / "mk_gemv_swz.cuh").read_text())
    (d / "gemv_stream.cu").write_text((HERE / "gemv_stream.cu").read_text())
    lib = d / "libgemv_stream.so"
    cmd = [nvcc, *build.NVCC_FLAGS, *build.ARCH_FLAGS[arch], *build.switch_flags(), "-I", str(d),
           str(d / "gemv_stream.cu"), "-o", str(lib)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"nvcc failed:\n{res.stderr[-3000:]}")
    so = ctypes.CDLL(str(lib))
    so.gemv_stream_launch.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    so.gemv_stream_launch.restype = ctypes.c_int
    return so


def smem_for(R: int, K: int, nb: int, double: bool, swizzled: bool = False) -> tuple[int, int]:
    """(wbuf param, dynamic shared memory) of the kernel's layouts (plan.smem_bytes); swizzled: the swz modes'
    (1 KB to align the weight buffers, inputs at a pitch of K + 32)."""
    if swizzled:
        return 0, O.GEMV_SCRATCH_BYTES + O.SWZ_ALIGN + (2 if double else 1) * R * K * 2 + nb * (K + O.SWZ_X_PAD) * 2
    tile = (R * (K + O.ROW_PAD) * 2 + 15) // 16 * 16
    x = nb * (K + O.ROW_PAD) * 2
    if double:
        return tile, O.GEMV_SCRATCH_BYTES + 2 * tile + x
    return 0, O.GEMV_SCRATCH_BYTES + tile + x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="32x2048,24x2048,16x4096,12x4096,64x768,48x768",
                    help="RxK tile shapes: the plan's 128 KB tiles, and ~96 KB ones that fit twice (double mode)")
    ap.add_argument("--rows", default="1,8,16", help="input rows (batch)")
    ap.add_argument("--tiles", type=int, default=240,
                    help="tiles per SM per launch (at 48, the launch's own ~30-50 us added ~0.5 us per tile)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"modes to run, of {','.join(MODES)}")
    ap.add_argument("--swz-box-rows", type=int, default=0,
                    help="swz modes: rows per tensor-copy box (0: the whole tile in one box per 64 columns; 8 or 16: "
                         "the fixed box a megakernel map would use for every tile height; -1: the whole tile in ONE "
                         "3D tensor copy, same layout; -16: one 3D copy per 16 rows, into 16-row sub-tiles)")
    ap.add_argument("--grid", type=int, default=0,
                    help="blocks, one per SM (0: every SM); fewer leave each more bandwidth, so what an SM does "
                         "between its loads shows instead of the HBM ceiling")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = {m: MODES[m] for m in args.modes.split(",")}
    from megakernel.bench import measure_read_bandwidth, run_record

    dev = torch.device("cuda")
    so = compile_bench()
    n_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = min(args.grid or n_sms, n_sms)
    peak = measure_read_bandwidth(dev) / 1e9
    print(f"peak read bandwidth {peak:.0f} GB/s, {grid} of {n_sms} SMs, {args.tiles} tiles per SM", flush=True)
    stream = torch.cuda.current_stream(dev)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in args.shapes.split(","):
        R, K = (int(v) for v in shape.split("x"))
        W = (torch.randn(grid * args.tiles * R, K, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
        for nb in (int(v) for v in args.rows.split(",")):
            X = torch.randn(nb, K, device=dev, generator=gen).to(torch.bfloat16)
            ref = (W[::R].float() @ X[0].float())                  # each tile's row 0 times input row 0
            ref_last = (W[R - 1::R].float() @ X[nb - 1].float())   # its last row times the last input row
            # the swizzled modes check row R - 1 - (t & 7) of tile t of a block instead (every fragment row mapping
            # and swizzle value over the tiles)
            t_in_block = torch.arange(grid * args.tiles, device=dev) % args.tiles
            rows_swz = torch.arange(grid * args.tiles, device=dev) * R + R - 1 - (t_in_block & 7)
            ref_last_swz = W[rows_swz].float() @ X[nb - 1].float()
            table = torch.arange(grid * args.tiles, dtype=torch.int32, device=dev)   # queue modes: claim -> tile
            for mode, code in modes.items():
                if mode.startswith("swz") and (K % 64 or R % 8):
                    print(f"R={R} K={K} nb={nb} {mode}: skipped (swizzled tiles need K % 64 == 0, R % 8 == 0)")
                    continue
                if mode.startswith("swz") and args.swz_box_rows == -16 and R % 16:
                    print(f"R={R} K={K} nb={nb} {mode}: skipped (16-row sub-tiles need R % 16 == 0)")
                    continue
                wbuf, smem = smem_for(R, K, nb, mode in ("double", "queue2", "ws", "ws_queue", "swz_double"),
                                      mode.startswith("swz"))
                if smem > O.SMEM_LIMIT - O.SMEM_RESERVE:
                    print(f"R={R} K={K} nb={nb} {mode}: skipped ({smem} B of shared memory)")
                    continue
                params = np.zeros(O.NUM_PARAMS, dtype=np.int64)
                params[O.P["wbuf"]] = wbuf
                out = torch.zeros(grid * args.tiles, device=dev)
                out_last = torch.zeros(grid * args.tiles, device=dev)
                # queue modes: [0] the claim counter; epi modes: then a counter per block, every block's stored
                # outputs (R * nb floats) and, from sig_off (8-byte aligned), each block's cycles in the signal
                sig_off = (1 + grid + grid * R * nb + 1) // 2 * 2       # (gemv_stream.cu's fc_off)
                n_queue = sig_off + 2 * grid if mode.startswith("epi") else 1 + grid
                queue = torch.zeros(n_queue, dtype=torch.int32, device=dev)
                pp = params.ctypes.data_as(ctypes.POINTER(ctypes.c_longlong))

                def launch() -> None:
                    queue[:1].zero_()
                    rc = so.gemv_stream_launch(pp, W.data_ptr(), X.data_ptr(), args.tiles, R, K, nb, code,
                                               out.data_ptr(), out_last.data_ptr(), queue.data_ptr(),
                                               table.data_ptr(), grid, smem, stream.cuda_stream,
                                               args.swz_box_rows)
                    if rc:
                        raise SystemExit(f"launch failed: {rc}")

                launch()
                torch.cuda.synchronize()
                if mode not in ("load", "compute", "swz_compute"):
                    last = ref_last_swz if mode.startswith("swz") else ref_last
                    for got, want, what in ((out, ref, "first"), (out_last, last, "last")):
                        err = ((got - want).abs() / want.abs().clamp_min(1e-2)).max().item()
                        if err > 2e-2:
                            raise SystemExit(f"R={R} K={K} nb={nb} {mode}: {what} outputs off by {err:.3g} (rel)")
                times = []
                for _ in range(5):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record(stream)
                    launch()
                    b.record(stream)
                    b.synchronize()
                    times.append(a.elapsed_time(b) * 1e3)
                us = min(times)
                per_tile = us / args.tiles
                gbs = grid * args.tiles * R * K * 2 / (us * 1e3) if "compute" not in mode else 0.0
                row = dict(R=R, K=K, nb=nb, mode=mode, swz_box_rows=args.swz_box_rows, grid=grid,
                           us_per_tile=per_tile, gb_per_s=gbs, pct_of_peak=100 * gbs / peak)
                extra = ""
                if mode.startswith("epi"):       # thread 0's cycles in the signal, per tile (the last launch)
                    cyc = queue[sig_off:sig_off + 2 * grid].view(torch.int64).double().mean().item() / args.tiles
                    row["signal_cycles_per_tile"] = cyc
                    extra = f", signal {cyc:5.0f} cycles"
                rows.append(row)
                print(f"R={R:3d} K={K:5d} nb={nb:2d} {mode:8s}: {per_tile:6.2f} us/tile/SM"
                      + (f", {gbs:6.0f} GB/s ({100 * gbs / peak:4.1f}% of peak)" if gbs else "") + extra, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(**run_record(), peak_read_gb_per_s=peak,
                                                   kernel_defines=build.switch_flags(), points=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
