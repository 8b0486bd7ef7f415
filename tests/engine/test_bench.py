"""The roofline byte count against the published North Mini Code figures, and the bench command end to end."""

import json
import subprocess
import sys

import pytest

from megakernel.bench import kv_bytes_per_step, weight_bytes_per_step
from megakernel.config import ModelConfig, north_mini_code_config
from tiny_models import write_checkpoint


def test_north_batch1_bytes_match_the_published_roofline():
    cfg = north_mini_code_config()
    weights = weight_bytes_per_step(cfg, [8] * 48, elt=2)
    assert abs(weights / 2 - 3.305e9) / 3.305e9 < 0.005          # 3.305 B params read per token
    kv = kv_bytes_per_step(cfg, [8192], elt=2)
    assert abs(kv - (13 * 8192 + 36 * 4096) * 2048) < 1          # 2 KiB per token per layer
    assert abs((weights + kv) / 1e9 - 7.13) < 0.05                # 7.13 GB per step at 8K context


def test_bench_command_runs_on_cpu(tmp_path):
    """`megakernel bench` end to end on a tiny checkpoint: its figures agree with each other and with the byte
    model (weights read with between k and min(E, B*k) routed experts per MoE layer, plus the live KV)."""
    folder = write_checkpoint("north_like", tmp_path / "m")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "megakernel", "bench", "--model", str(folder), "--batch-size", "3",
                        "--context", "20", "--steps", "4", "--backend", "torch", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "backend torch (pipelined steps), batch 3, context 20" in r.stdout
    doc = json.loads(out.read_text())
    (p,) = doc["points"]
    assert (p["backend"], p["batch_size"], p["context"], p["steps"], p["kv_fill"]) == ("torch", 3, 20, 4, "synthetic")
    assert p["ms_per_step"] > 0 and p["tokens_per_s"] == pytest.approx(3 * 1000 / p["ms_per_step"], rel=1e-6)
    cfg = ModelConfig.from_pretrained(folder)
    k, n_moe = cfg.num_experts_per_tok, len(cfg.moe_layers)
    kv = kv_bytes_per_step(cfg, [20 + 4 // 2] * 3, elt=4)                  # fp32 on CPU
    lo = weight_bytes_per_step(cfg, [k] * n_moe, elt=4) + kv
    hi = weight_bytes_per_step(cfg, [min(cfg.num_experts, 3 * k)] * n_moe, elt=4) + kv
    assert lo <= p["bytes_per_step"] <= hi, (lo, p["bytes_per_step"], hi)
    assert p["gb_per_s"] == pytest.approx(p["bytes_per_step"] / (p["ms_per_step"] / 1e3) / 1e9, rel=1e-6)
    assert p["roofline_pct"] is None and doc["gpu"] == "cpu"      # no roofline without a GPU to measure


def test_peak_methods_and_their_refusals():
    """The roofline's peak read methods: an unknown one is refused by name; the bulk-copy method is unavailable on a
    CPU device (it needs an sm_90 GPU and nvcc); `--peak` takes the three names and nothing else."""
    import torch

    from megakernel.bench import PEAK_METHODS, measure_read_bandwidths
    from megakernel.kernel import peak

    assert PEAK_METHODS == ("torch", "bulk", "best")
    with pytest.raises(ValueError, match="peak method 'fastest'"):
        measure_read_bandwidths(torch.device("cpu"), "fastest")
    assert not peak.available(torch.device("cpu"))
    r = subprocess.run([sys.executable, "-m", "megakernel", "bench", "--peak", "fastest"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "--peak" in r.stderr and "fastest" in r.stderr


@pytest.mark.gpu
def test_bulk_read_peak_on_the_gpu():
    """On an sm_90 GPU the bulk-copy read of 1 GiB is timed and lands between a plausible floor and the card's
    spec, and within 30% of the torch reduction's (they read the same bytes by different means)."""
    import torch

    from megakernel.bench import measure_read_bandwidths
    from megakernel.kernel import peak

    if not torch.cuda.is_available() or not peak.available(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU and nvcc")
    rates = measure_read_bandwidths(torch.device("cuda"), "best", gib=1.0)
    assert set(rates) == {"torch", "bulk"}
    assert 0.5e12 < rates["bulk"] < 6e12, rates
    assert 0.7 < rates["bulk"] / rates["torch"] < 1.3, rates
    print({k: round(v / 1e9) for k, v in rates.items()}, "GB/s")


def test_run_record_names_the_build_overrides(monkeypatch):
    """A result file says which build made it when the environment changed the build (switches, ring depth, chunk)."""
    from megakernel.bench import run_record

    for k in ("MEGAKERNEL_KERNEL_DEFINES", "MEGAKERNEL_MK_TUNING", "MEGAKERNEL_BLOCKS_PER_SM", "MEGAKERNEL_ATTN_CHUNK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MEGAKERNEL_KERNEL_DEFINES", "MK_ATTN_BULK=1")
    monkeypatch.setenv("MEGAKERNEL_ATTN_MAX_STAGES", "3")
    rec = run_record()
    assert rec["env"] == {"MEGAKERNEL_KERNEL_DEFINES": "MK_ATTN_BULK=1", "MEGAKERNEL_ATTN_MAX_STAGES": "3"}
    assert {"commit", "date", "gpu", "command"} <= set(rec)


def _bench_with_a_small_pool(tmp_path, batch: int, blocks: int, ctx: int, reason: str) -> None:
    """`megakernel bench` on the torch backend at contexts ctx and 20 with `blocks` KV blocks per group: the ctx
    point is skipped with `reason` (in the output and the JSON's `skipped`), the 20-token point still runs."""
    folder = write_checkpoint("north_like", tmp_path / "m")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "megakernel", "bench", "--model", str(folder), "--batch-size",
                        str(batch), "--context", f"{ctx},20", "--steps", "2", "--backend", "torch", "--num-kv-blocks",
                        f"{blocks},{blocks}", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"backend torch, batch {batch}, context {ctx}: skipped ({reason}" in r.stdout
    doc = json.loads(out.read_text())
    assert [(p["batch_size"], p["context"]) for p in doc["points"]] == [(batch, 20)]
    (s,) = doc["skipped"]
    assert (s["backend"], s["batch_size"], s["context"]) == ("torch", batch, ctx) and s["reason"].startswith(reason)


def test_bench_skips_a_point_its_kv_pool_cannot_hold(tmp_path):
    """A point whose prompts do not fit the engine's KV pool (the graph backend's pool at 256K on an 80 GB card) is
    skipped with the engine's reason, listed under `skipped` in the JSON, and the other points still run."""
    _bench_with_a_small_pool(tmp_path, batch=1, blocks=4, ctx=600, reason="the prompt needs")


def test_bench_skips_a_point_whose_prompts_do_not_fit_together(tmp_path):
    """Each prompt fits the pool alone but the batch's prompts do not fit together (4 rows of 128K on an 80 GB card):
    the synthetic fill runs out of blocks, the point is skipped with that reason, its requests are aborted, and the
    next point runs on the freed pool."""
    _bench_with_a_small_pool(tmp_path, batch=2, blocks=5, ctx=200, reason="out of KV blocks")
