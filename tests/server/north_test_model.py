"""The model the server tests run on.

The embedded default model when it ships a tokenizer with a chat template (north_nano); otherwise a tiny random
cohere2_moe checkpoint with a small byte-level BPE tokenizer that has North's special tokens and the North chat
template (tests/server/assets/chat_template.jinja), built once into a cache folder.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path

HERE = Path(__file__).parent
SPECIAL_TOKENS = [
    "<PAD>", "<BOS_TOKEN>", "<EOS_TOKEN>",
    "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
    "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
    "<|START_TEXT|>", "<|END_TEXT|>",
    "<|START_THINKING|>", "<|END_THINKING|>",
    "<|START_ACTION|>", "<|END_ACTION|>",
    "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>",
]
EOT_ID = 4
VERSION = "1"


def default_model_usable() -> Path | None:
    """The embedded model's folder if it is a trained North model with tokenizer and chat template."""
    from megakernel.default_model import EMBEDDED

    if (EMBEDDED / "config.json").exists() and (EMBEDDED / "tokenizer.json").exists() and \
            ((EMBEDDED / "chat_template.jinja").exists() or "chat_template" in
             (EMBEDDED / "tokenizer_config.json").read_text()):
        return EMBEDDED
    return None


def _corpus():
    import json as _json
    import textwrap

    # Deterministic text from the standard library (code and prose) plus chat-like snippets.
    for mod in (json, os, shutil, inspect, textwrap, _json.decoder):
        src = inspect.getsource(mod)
        for i in range(0, len(src), 2000):
            yield src[i:i + 2000]
    for city in ("Paris", "London", "Tokyo", "Berlin"):
        yield f'[{{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {{"city": "{city}"}}}}]'
        yield f"The weather in {city} is sunny. Hello! How can I help you today?"


def build_tiny_north(folder: Path, vocab_size: int = 1024, seed: int = 0) -> Path:
    """A tiny random cohere2_moe checkpoint with a North-format tokenizer and chat template."""
    folder = Path(folder)
    stamp = folder / ".complete"
    if stamp.exists() and stamp.read_text() == VERSION:
        return folder
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<BOS_TOKEN>", eos_token="<|END_OF_TURN_TOKEN|>",
                                   pad_token="<PAD>", additional_special_tokens=SPECIAL_TOKENS[2:],
                                   clean_up_tokenization_spaces=False, model_max_length=4096)
    fast.save_pretrained(tmp)
    shutil.copy(HERE / "assets" / "chat_template.jinja", tmp / "chat_template.jinja")
    n = 5
    cfg = Cohere2MoeConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=n, intermediate_size=32, prefix_dense_intermediate_size=96, num_experts=8,
        num_experts_per_tok=2, first_k_dense_replace=1, expert_selection_fn="sigmoid", norm_topk_prob=False,
        sliding_window=24, rope_theta=5e4, rms_norm_eps=1e-6, logit_scale=1.0, bos_token_id=1, eos_token_id=EOT_ID,
        pad_token_id=0, max_position_embeddings=4096,
        layer_types=["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)],
    )
    torch.manual_seed(seed)
    model = Cohere2MoeForCausalLM(cfg)
    with torch.no_grad():   # far from uniform, so greedy outputs vary with the prompt
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp)
    GenerationConfig(bos_token_id=1, eos_token_id=EOT_ID, pad_token_id=0).save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    stamp.write_text(VERSION)
    return folder


def test_model_path() -> Path:
    env = os.environ.get("MEGAKERNEL_TEST_SERVER_MODEL")
    if env:
        return Path(env)
    return default_model_usable() or build_tiny_north(
        Path(os.environ.get("MEGAKERNEL_CACHE", Path.home() / ".cache" / "megakernel")) / "tiny-north-test")
