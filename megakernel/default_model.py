"""The embedded default model: what `serve`, `generate` and `LLM()` use when no model is given.

north_nano (megakernel/bundled/north_nano, 14.6 MB) is a tiny cohere2_moe trained by this project on Python's
standard library and synthetic tool-use chats (see its README and training/).
"""

from __future__ import annotations

from pathlib import Path

from megakernel.errors import CheckpointError

EMBEDDED = Path(__file__).parent / "bundled" / "north_nano"


def resolve_model_path(model: str | Path | None) -> Path:
    if model is not None:
        return Path(model).expanduser()
    if not (EMBEDDED / "config.json").exists():
        raise CheckpointError(f"the embedded model is missing from this installation ({EMBEDDED}); pass --model")
    return EMBEDDED
