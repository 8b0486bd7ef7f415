"""Checkpoint loading: sharded files, dtypes, clear errors for broken checkpoints, the random-weights builder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megakernel.config import ModelConfig, north_mini_code_config
from megakernel.errors import CheckpointError, ConfigError
from megakernel.model.weights import load_checkpoint, random_weights
from tiny_models import write_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint("softmax_2dense_bias", tmp_path_factory.mktemp("ck"))


def test_sharded_equals_single_file(folder, tmp_path):
    from transformers import Cohere2MoeForCausalLM

    sharded = tmp_path / "sharded"
    Cohere2MoeForCausalLM.from_pretrained(folder).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    cfg = ModelConfig.from_pretrained(folder)
    a = load_checkpoint(folder, cfg, progress=False)
    b = load_checkpoint(sharded, cfg, progress=False)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
    assert a.layers[2].moe.experts_gate_up.shape == (8, 64, 64)
    assert a.layers[0].qkv_bias is not None and a.layers[0].dense is not None


def test_dtypes_and_tied_embeddings(folder):
    cfg = ModelConfig.from_pretrained(folder)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = load_checkpoint(folder, cfg, dtype=dtype, progress=False)
        assert w.dtype == dtype and all(t.dtype == dtype for t in w.tensors())
        assert w.lm_head is w.embed


def _broken_copy(folder, tmp_path, edit) -> str:
    dst = tmp_path / "broken"
    shutil.copytree(folder, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_unexpected_and_misshapen_tensors_are_named(folder, tmp_path):
    cfg = ModelConfig.from_pretrained(folder)
    name = "model.layers.3.mlp.experts.5.up_proj.weight"
    with pytest.raises(CheckpointError, match=f"lacks tensor {name}"):
        load_checkpoint(_broken_copy(folder, tmp_path / "a", lambda t: t.pop(name)), cfg, progress=False)
    with pytest.raises(CheckpointError, match="unexpected tensor model.extra"):
        load_checkpoint(_broken_copy(folder, tmp_path / "b", lambda t: t.update({"model.extra": torch.ones(2)})),
                        cfg, progress=False)
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \[3\], expected \[64\]"):
        load_checkpoint(_broken_copy(folder, tmp_path / "c", lambda t: t.update({"model.norm.weight": torch.ones(3)})),
                        cfg, progress=False)


def test_unsupported_options_are_refused_by_name(folder):
    raw = json.loads((folder / "config.json").read_text())
    for key, value, needle in (("model_type", "llama", "model_type 'llama'"),
                               ("expert_selection_fn", "relu", "expert_selection_fn 'relu'"),
                               ("hidden_act", "gelu", "hidden_act 'gelu'"),
                               ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1.0}, "RoPE type 'yarn'")):
        with pytest.raises(ConfigError, match=needle):
            ModelConfig.from_dict({**raw, key: value})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megakernel", *args], capture_output=True, text=True, timeout=120)


def test_cli_bad_inputs_give_one_line_errors(folder, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    trunc = tmp_path / "trunc"
    shutil.copytree(folder, trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    for path, needle in ((tmp_path / "missing", "does not exist"), (other, "unsupported model_type"),
                         (trunc, "cannot read")):
        r = _cli("generate", "--model", str(path), "--prompt", "1 2 3")
        assert r.returncode == 2
        lines = [l for l in r.stderr.splitlines() if l.startswith("error:")]
        assert len(lines) == 1 and needle in lines[0], r.stderr
        assert "Traceback" not in r.stderr


def test_cli_generate_prints_tokens(folder):
    r = _cli("generate", "--model", str(folder), "--prompt", "5 6 7", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 4


def test_random_builder_is_seeded_and_sized():
    cfg = ModelConfig.from_dict({**json.loads(json.dumps(_tiny_raw())), "num_shared_experts": 1})
    a, b = random_weights(cfg, seed=1), random_weights(cfg, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
    assert not torch.equal(random_weights(cfg, seed=2).embed, a.embed)
    north = north_mini_code_config()
    params = sum(n.numel() for n in random_weights_meta(north))
    assert 30.0e9 < params < 31.0e9          # 30.5B parameters, as published


def _tiny_raw():
    from tiny_models import make_config

    return make_config("north_like").to_dict()


def random_weights_meta(cfg):
    return list(random_weights(cfg, device="meta").tensors())


_RSS_PROBE = r"""
import sys, threading, time, torch
from megakernel.config import ModelConfig
from megakernel.model.weights import load_checkpoint

def anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

peak, stop = [0], []
def sample():
    while not stop:
        peak[0] = max(peak[0], anon_kb()); time.sleep(0.002)
cfg = ModelConfig.from_pretrained(sys.argv[1])
base = anon_kb()
t = threading.Thread(target=sample); t.start()
w = load_checkpoint(sys.argv[1], cfg, progress=False)
stop.append(1); t.join()
print((peak[0] - base) * 1024, w.num_bytes())
"""


def test_loading_holds_about_one_copy_in_host_memory(tmp_path):
    """Anonymous (non-file) memory while loading stays near the size of the weights: no double copies."""
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM

    cfg = Cohere2MoeConfig(vocab_size=8192, hidden_size=512, head_dim=64, num_attention_heads=8,
                           num_key_value_heads=2, num_hidden_layers=4, intermediate_size=512,
                           prefix_dense_intermediate_size=1024, num_experts=16, num_experts_per_tok=2,
                           first_k_dense_replace=1, expert_selection_fn="sigmoid", norm_topk_prob=False,
                           sliding_window=64, rms_norm_eps=1e-6, logit_scale=1.0,
                           layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                        "sliding_attention"])
    Cohere2MoeForCausalLM(cfg).save_pretrained(tmp_path / "mid")
    r = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(tmp_path / "mid")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    peak, size = map(int, r.stdout.split())
    assert size > 100e6
    print(f"peak {peak/1e6:.0f} MB for {size/1e6:.0f} MB")
    assert peak < 1.25 * size, f"peak anonymous memory {peak / 1e6:.0f} MB for {size / 1e6:.0f} MB of weights"
