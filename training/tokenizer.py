"""Train north-nano's byte-level BPE tokenizer and save it as a transformers tokenizer folder.

The special tokens are North's, added first so that <PAD> is id 0:
  <PAD>=0 <BOS_TOKEN>=1 <EOS_TOKEN>=2 <|START_OF_TURN_TOKEN|>=3 <|END_OF_TURN_TOKEN|>=4 ...
The end-of-generation token is <|END_OF_TURN_TOKEN|> (tokenizer eos_token).

Usage: python training/tokenizer.py [--data training/build/train.jsonl] [--out megakernel/bundled/north_nano]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SPECIAL_TOKENS = [
    "<PAD>", "<BOS_TOKEN>", "<EOS_TOKEN>",
    "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
    "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
    "<|START_TEXT|>", "<|END_TEXT|>",
    "<|START_THINKING|>", "<|END_THINKING|>",
    "<|START_ACTION|>", "<|END_ACTION|>",
    "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>",
]
VOCAB_SIZE = 4096


def corpus_texts(data_path: str):
    """Plain texts for BPE training: every string inside the dialogues (no special tokens)."""
    with open(data_path) as fh:
        for line in fh:
            d = json.loads(line)
            if "tools" in d:
                yield json.dumps([t["function"] for t in d["tools"]])
            for m in d["messages"]:
                for key in ("content", "reasoning_content"):
                    v = m.get(key)
                    if isinstance(v, str):
                        yield v
                    elif v is not None:
                        yield json.dumps(v)
                for tc in m.get("tool_calls", []) or []:
                    yield json.dumps({"tool_call_id": "0", "tool_name": tc["function"]["name"],
                                      "parameters": tc["function"]["arguments"]})


def train_tokenizer(data_path: str, out_dir: str, vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(data_path), trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(HERE, "chat_template.jinja")) as fh:
        template = fh.read()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<BOS_TOKEN>",
        eos_token="<|END_OF_TURN_TOKEN|>",
        pad_token="<PAD>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.chat_template = template
    fast.save_pretrained(out_dir)
    # make sure the shipped template is the canonical file
    shutil.copyfile(os.path.join(HERE, "chat_template.jinja"), os.path.join(out_dir, "chat_template.jinja"))
    return fast


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(HERE, "build", "train.jsonl"))
    ap.add_argument("--out", default=os.path.join(REPO, "megakernel", "bundled", "north_nano"))
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    a = ap.parse_args()
    fast = train_tokenizer(a.data, a.out, a.vocab_size)
    print("vocab", len(fast), "saved to", a.out)
