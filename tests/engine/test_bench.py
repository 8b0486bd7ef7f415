"""The roofline byte count against the published North Mini Code figures, and the bench command end to end."""

import subprocess
import sys

from megakernel.bench import kv_bytes_per_step, weight_bytes_per_step
from megakernel.config import north_mini_code_config
from tiny_models import write_checkpoint


def test_north_batch1_bytes_match_the_published_roofline():
    cfg = north_mini_code_config()
    weights = weight_bytes_per_step(cfg, [8] * 48, elt=2)
    assert abs(weights / 2 - 3.305e9) / 3.305e9 < 0.005          # 3.305 B params read per token
    kv = kv_bytes_per_step(cfg, [8192], elt=2)
    assert abs(kv - (13 * 8192 + 36 * 4096) * 2048) < 1          # 2 KiB per token per layer
    assert abs((weights + kv) / 1e9 - 7.13) < 0.05                # 7.13 GB per step at 8K context


def test_bench_command_runs_on_cpu(tmp_path):
    folder = write_checkpoint("north_like", tmp_path / "m")
    r = subprocess.run([sys.executable, "-m", "megakernel", "bench", "--model", str(folder), "--batch-size", "3",
                        "--context", "20", "--steps", "4", "--backend", "torch"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stdout and "backend torch (pipelined steps), batch 3" in r.stdout
