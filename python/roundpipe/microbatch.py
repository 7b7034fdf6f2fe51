"""Split and merge specs (SPEC 5), compatible with
``torch.distributed.pipelining.microbatch``'s classes (accepted as well)."""


class TensorChunkSpec:
    """Split (or, for outputs, concatenate) a tensor along ``split_dim``."""

    def __init__(self, split_dim=0):
        self.split_dim = split_dim

    def __repr__(self):
        return f"TensorChunkSpec({self.split_dim})"


class Replicate:
    """Give every microbatch the whole value (for outputs: all must be equal).
    Use the class itself or an instance."""

    def __repr__(self):
        return "Replicate"


class CustomReducer:
    """Merge outputs with ``reduce_fn(acc, x)``, starting from ``init_value``."""

    def __init__(self, init_value, reduce_fn):
        self.init_value = init_value
        self.reduce_fn = reduce_fn

    def __repr__(self):
        return f"CustomReducer({self.init_value!r}, {self.reduce_fn!r})"


__all__ = ["TensorChunkSpec", "Replicate", "CustomReducer"]
