"""Pytree nodes for the engine's value conversion (see src/python/values.h).

Containers registered with ``torch.utils._pytree`` (namedtuples, dicts with
non-str keys, user classes) travel through the engine as their children plus
an opaque marker holding the node type and flatten context.
"""
from torch.utils import _pytree


def flatten_node(obj):
    """``(node_type, children, context)`` for a registered node, else None."""
    node_type = _pytree._get_node_type(obj)
    node_def = _pytree.SUPPORTED_NODES.get(node_type)
    if node_def is None:
        return None
    children, context = node_def.flatten_fn(obj)
    return node_type, list(children), context


def unflatten_node(node_type, children, context):
    return _pytree.SUPPORTED_NODES[node_type].unflatten_fn(children, context)
