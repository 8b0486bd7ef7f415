"""Errors a user can act on. Each carries a one-line message; the CLI prints it without a traceback."""


class MegakernelError(Exception):
    """Base class of every error megakernel raises on purpose."""


class ConfigError(MegakernelError):
    """The checkpoint's config.json describes a model or an option this engine does not support."""


class CheckpointError(MegakernelError):
    """The checkpoint folder is missing, incomplete, truncated or holds tensors of the wrong shape."""


class OutOfKVBlocks(MegakernelError):
    """The KV block pool cannot satisfy an allocation. Nothing was allocated; the caller may free or wait."""

    def __init__(self, group: str, needed: int, free: int) -> None:
        super().__init__(f"out of KV blocks in the {group} pool: needed {needed}, {free} free")
        self.group = group
        self.needed = needed
        self.free = free


class RequestError(MegakernelError):
    """A request cannot be served as given (prompt too long, bad sampling parameters, ...)."""
