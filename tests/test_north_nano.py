"""north-nano, the embedded default model: folder contents, tokenizer and North chat template, that transformers
loads it, that the engine (its PyTorch path, on CPU) matches transformers token for token (fp32 greedy), and the
quality bars on the held-out prompts measured with the engine (>= 50% parseable code, >= 90% well-formed tool
calls). The decode megakernel's own greedy check on this model is tests/kernel/test_gpu.py (GPU).

Runs on CPU in a couple of minutes (all 100 held-out prompts are generated in one batch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from training import evaluate_north_nano as ev

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "megakernel" / "bundled" / "north_nano"

SPECIALS = ["<PAD>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
            "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|START_TEXT|>", "<|END_TEXT|>",
            "<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>",
            "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"]
EOT_ID = 4


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Cohere2MoeForCausalLM

    torch.set_num_threads(min(2, torch.get_num_threads()))
    return Cohere2MoeForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    from megakernel import LLM

    return LLM(model=str(MODEL_DIR), device="cpu", dtype="float32", max_num_seqs=100, max_num_batched_tokens=8192)


def _engine_generate(llm):
    from megakernel import SamplingParams

    def generate(prompts, max_tokens):
        outs = llm.generate([list(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                            use_tqdm=False)
        return [list(o.token_ids) for o in outs]

    return generate


# ----------------------------------------------------------------------------- folder and config


def test_folder_size_and_files():
    files = {p.name for p in MODEL_DIR.iterdir()}
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json", "README.md"):
        assert f in files, f
    total = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert total <= 16 * 1024 * 1024, total
    from safetensors import safe_open

    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in keys)
    assert "lm_head.weight" not in keys  # tied
    assert "model.layers.0.mlp.gate_proj.weight" in keys  # dense prefix layer
    assert "model.layers.1.mlp.gate.weight" in keys  # router


def test_config_has_north_features():
    c = json.loads((MODEL_DIR / "config.json").read_text())
    n = c["num_hidden_layers"]
    assert c["model_type"] == "cohere2_moe"
    assert c["layer_types"] == ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)]
    assert c["mlp_layer_types"][0] == "dense" and all(t == "sparse" for t in c["mlp_layer_types"][1:])
    assert c["first_k_dense_replace"] == 1 and c["prefix_dense_sliding_window_pattern"] == 1
    assert c["expert_selection_fn"] == "sigmoid" and c["norm_topk_prob"] is False
    assert c["num_shared_experts"] == 0 and c["tie_word_embeddings"] is True
    assert c["rms_norm_eps"] == 1e-6 and c["logit_scale"] == 1.0
    assert c["rope_parameters"]["rope_theta"] == 50000.0
    assert c["sliding_window"] < 256 and c["num_experts"] >= 8 and c["num_experts_per_tok"] == 2
    assert c["eos_token_id"] == EOT_ID
    g = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert g["eos_token_id"] == EOT_ID


# ----------------------------------------------------------------------------- tokenizer and template


def test_tokenizer_special_tokens(tok):
    from transformers import PreTrainedTokenizerFast

    assert isinstance(tok, PreTrainedTokenizerFast)
    for i, s in enumerate(SPECIALS):
        assert tok.convert_tokens_to_ids(s) == i, s
    assert tok.pad_token_id == 0 and tok.eos_token == "<|END_OF_TURN_TOKEN|>" and tok.eos_token_id == EOT_ID
    ids = tok("def f(x):\n    return x", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "def f(x):\n    return x"
    # special tokens are single tokens inside text
    ids = tok("<|START_ACTION|>[]<|END_ACTION|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 12 and ids[-1] == 13


def test_chat_template_north_format(tok):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "reasoning_content": "Call the tool.", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": {"temp": 3}},
        {"role": "assistant", "reasoning": "Answer.", "content": "It is 3 degrees."},
        {"role": "user", "content": "Thanks"},
    ]
    s = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    expected = (
        '<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TEXT|>Be brief.\n\n# Available Tools\n```json\n[\n'
        '    {"name": "get_weather", "description": "Get the weather.", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}, "required": ["city"]}}\n]\n```<|END_TEXT|><|END_OF_TURN_TOKEN|>'
        '<|START_OF_TURN_TOKEN|><|USER_TOKEN|><|START_TEXT|>Weather in Oslo?<|END_TEXT|><|END_OF_TURN_TOKEN|>'
        '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>Call the tool.<|END_THINKING|>'
        '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Oslo"}}]'
        '<|END_ACTION|><|END_OF_TURN_TOKEN|>'
        '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>[{"tool_call_id": "0", "results": '
        '{"0": {"temp": 3}}, "is_error": null}]<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>'
        '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>Answer.<|END_THINKING|>'
        '<|START_TEXT|>It is 3 degrees.<|END_TEXT|><|END_OF_TURN_TOKEN|>'
        '<|START_OF_TURN_TOKEN|><|USER_TOKEN|><|START_TEXT|>Thanks<|END_TEXT|><|END_OF_TURN_TOKEN|>'
        '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>'
    )
    assert s == expected
    # the assistant's tool call parses back
    assert ev.tool_ok(s, tools)
    # reasoning off
    for kw in ({"reasoning": False}, {"enable_thinking": False}):
        s2 = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True, **kw)
        assert s2.endswith("<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    # no system message, no tools: no system turn
    s3 = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert s3 == ("<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|><|START_TEXT|>hi<|END_TEXT|><|END_OF_TURN_TOKEN|>"
                  "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>")
    # OpenAI-style string arguments and string tool results; two parallel calls
    msgs2 = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                 {"id": "b", "type": "function", "function": {"name": "g", "arguments": {}}}]},
             {"role": "tool", "tool_call_id": "a", "content": "one"},
             {"role": "tool", "tool_call_id": "b", "content": [{"k": 2}]}]
    s4 = tok.apply_chat_template(msgs2, tokenize=False)
    assert ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": {"a": 1}}, '
            '{"tool_call_id": "1", "tool_name": "g", "parameters": {}}]<|END_ACTION|>') in s4
    assert ('<|START_TOOL_RESULT|>[{"tool_call_id": "0", "results": {"0": {"content": "one"}}, "is_error": null}, '
            '{"tool_call_id": "1", "results": {"0": [{"k": 2}]}, "is_error": null}]<|END_TOOL_RESULT|>') in s4


def test_eval_helpers():
    assert ev.code_ok("<|START_TEXT|>```python\ndef f():\n    return 1\n```<|END_TEXT|>")
    assert not ev.code_ok("<|START_TEXT|>```python\ndef f(:\n```<|END_TEXT|>")
    assert not ev.code_ok("<|START_TEXT|>no code<|END_TEXT|>")
    tools = [{"name": "t", "parameters": {"required": ["a"]}}]
    assert ev.tool_ok('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "t", "parameters": {"a": 1}}]'
                      '<|END_ACTION|>', tools)
    assert not ev.tool_ok('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "t", "parameters": {}}]'
                          '<|END_ACTION|>', tools)
    assert not ev.tool_ok('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "u", "parameters": {"a": 1}}]'
                          '<|END_ACTION|>', tools)
    code, tool = ev.load_sets()
    assert len(code) == 50 and len(tool) == 50


# ----------------------------------------------------------------------------- model


def test_transformers_loads_and_answers(tok, hf_model):
    cfg = hf_model.config
    assert cfg.layer_types[0] == "full_attention" and cfg.mlp_layer_types[0] == "dense"
    n = sum(p.numel() for p in hf_model.parameters())
    assert 3_000_000 <= n <= 8_000_000, n
    code_set, tool_set = ev.load_sets()
    code_p, tool_p = ev.render_prompts(tok, code_set[:2], tool_set[:2])
    x = torch.tensor([tool_p[0]])
    with torch.no_grad():
        out = hf_model.generate(input_ids=x, max_new_tokens=120, do_sample=False, eos_token_id=EOT_ID, pad_token_id=0)
    text = tok.decode(out[0, x.shape[1]:], skip_special_tokens=False)
    assert ev.tool_ok(text, tool_set[0]["tools"]), text


def _prompts_for_parity(tok):
    code_set, tool_set = ev.load_sets()
    code_p, tool_p = ev.render_prompts(tok, code_set[:3], tool_set[:2])
    plain = tok.apply_chat_template([{"role": "user", "content": "Write a function `add(a, b)`."}], tokenize=False,
                                    add_generation_prompt=True, reasoning=False)
    return code_p + tool_p + [tok(plain, add_special_tokens=False)["input_ids"]]


def test_engine_cpu_matches_transformers_greedy(tok, hf_model, llm):
    prompts = _prompts_for_parity(tok)
    assert max(len(p) for p in prompts) > json.loads((MODEL_DIR / "config.json").read_text())["sliding_window"]
    max_tokens = 48
    ref = []
    for p in prompts:  # one at a time: no padding on the transformers side
        x = torch.tensor([p])
        with torch.no_grad():
            out = hf_model.generate(input_ids=x, max_new_tokens=max_tokens, do_sample=False, eos_token_id=EOT_ID,
                                    pad_token_id=0)
        ref.append(ev.strip_eos(out[0, x.shape[1]:].tolist(), EOT_ID))
    got = [ev.strip_eos(o, EOT_ID) for o in _engine_generate(llm)(prompts, max_tokens)]
    for i, (r, g) in enumerate(zip(ref, got)):
        assert g == r, f"prompt {i}: engine {g} != transformers {r}"


@pytest.mark.slow
def test_quality_bars_engine_cpu(tok, llm):
    r = ev.evaluate(_engine_generate(llm), tok, max_tokens=ev.MAX_TOKENS)
    assert r["code_parse_rate"] >= 0.5, r["code_parse_rate"]
    assert r["tool_call_rate"] >= 0.9, r["tool_call_rate"]
