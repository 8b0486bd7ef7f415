"""Output text that grows with the tokens, decoding a few tokens per step instead of the whole output.

Decoding every output in full after every step costs O(n) per token, O(n^2) per sequence: at a few thousand
tokens and a batch of 16 that is more host time per step than the decode kernel takes, and the host could no
longer prepare step t+1 while the GPU runs step t. The usual incremental scheme (as the big engines do): decode
a short window that starts one emission back, and append the part that goes past the previous window. A window
ending inside a multi-byte character ("\ufffd") waits for the next token. If a tokenizer ever breaks the
prefix property, the text is rebuilt with one full decode.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DetokState:
    prefix_offset: int = 0     # window start: one emission back, so the tokenizer sees the left context
    read_offset: int = 0       # tokens already turned into text


def detokenize_step(tokenizer, ids: list[int], n: int, text: str, st: DetokState,
                    skip_special_tokens: bool) -> str:
    """The text of ids[:n], the output tokens known so far, given `text`: what this returned last time."""
    if n <= st.read_offset:
        return text
    prefix_text = tokenizer.decode(ids[st.prefix_offset:st.read_offset], skip_special_tokens=skip_special_tokens)
    new_text = tokenizer.decode(ids[st.prefix_offset:n], skip_special_tokens=skip_special_tokens)
    if not new_text.startswith(prefix_text):
        st.prefix_offset = st.read_offset = n
        return tokenizer.decode(ids[:n], skip_special_tokens=skip_special_tokens)
    if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
        text += new_text[len(prefix_text):]
        st.prefix_offset, st.read_offset = st.read_offset, n
    return text
