"""Turn a training output (weights.safetensors + config.json + loss_log.json from train_north_nano.py)
into the shipped folder megakernel/bundled/north_nano: save_pretrained in bf16 (safetensors), config.json with
first_k_dense_replace kept, generation_config.json, a loss-curve PNG and training/loss_log.json.

  python training/finalize_north_nano.py --run /path/to/train/output
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL_DIR = os.path.join(REPO, "megakernel", "bundled", "north_nano")
EOT_ID = 4


def finalize(run_dir: str, out_dir: str = MODEL_DIR, logs: list[str] | None = None):
    from safetensors.torch import load_file
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM, GenerationConfig

    cfg = Cohere2MoeConfig.from_pretrained(run_dir)
    model = Cohere2MoeForCausalLM(cfg)
    sd = load_file(os.path.join(run_dir, "weights.safetensors"))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    os.makedirs(out_dir, exist_ok=True)
    for stale in ("model.safetensors", "model.safetensors.index.json"):
        p = os.path.join(out_dir, stale)
        if os.path.exists(p):
            os.remove(p)
    model.save_pretrained(out_dir, safe_serialization=True)
    gen = GenerationConfig(bos_token_id=1, eos_token_id=EOT_ID, pad_token_id=0, do_sample=False,
                           max_new_tokens=256)
    gen.save_pretrained(out_dir)
    # keep the North-style field in config.json (transformers derives mlp_layer_types from it; both are kept)
    cp = os.path.join(out_dir, "config.json")
    with open(cp) as fh:
        c = json.load(fh)
    c["first_k_dense_replace"] = 1
    c["eos_token_id"] = EOT_ID
    with open(cp, "w") as fh:
        json.dump(c, fh, indent=2, sort_keys=True)
        fh.write("\n")
    # loss logs (one per training stage) + curve
    logs = logs or [os.path.join(run_dir, "loss_log.json")]
    stages = []
    for i, lp in enumerate(logs, 1):
        with open(lp) as fh:
            stages.append(json.load(fh))
        shutil.copyfile(lp, os.path.join(HERE, f"loss_log_stage{i}.json"))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3), dpi=100)
        offset = 0
        for i, st in enumerate(stages, 1):
            steps = [offset + r["step"] for r in st["log"]]
            ax.plot(steps, [r["loss"] for r in st["log"]], lw=1,
                    label=f"stage {i}: {st['device']}, batch {st['args']['batch_size']}")
            offset = steps[-1]
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("assistant-token loss")
        ax.set_title("north-nano training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "loss_curve.png"))
    except ImportError:
        print("matplotlib missing: no loss_curve.png")
    for f in os.listdir(out_dir):
        if os.path.isfile(os.path.join(out_dir, f)):
            os.chmod(os.path.join(out_dir, f), 0o644)
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir)
                if os.path.isfile(os.path.join(out_dir, f)))
    print(f"wrote {out_dir}: {total / 1e6:.2f} MB")
    return stages


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--out", default=MODEL_DIR)
    ap.add_argument("--logs", nargs="*", default=None, help="loss_log.json of each stage, in order")
    a = ap.parse_args()
    finalize(a.run, a.out, a.logs)
