"""Gradient reduction strategies, one class per file behind the Reducer interface (base.py)."""

from pydtnn.distributed.reducers.base import Reducer
from pydtnn.distributed.reducers.blocking import BlockingReducer
from pydtnn.distributed.reducers.bucketed import BucketedReducer
from pydtnn.distributed.reducers.hierarchical import HierarchicalReducer
from pydtnn.distributed.reducers.per_layer import PerLayerReducer
from pydtnn.distributed.reducers.topk import TopKReducer
from pydtnn.errors import ConfigError

_CLASSES = {c.name: c for c in (BlockingReducer, PerLayerReducer, BucketedReducer, HierarchicalReducer, TopKReducer)}
NAMES = tuple(_CLASSES)


def create(name, comm, **options):
    """Reducer by name: blocking, per_layer, bucketed, hierarchical or topk; options: compression ("none" or
    "fp16"), progress ("test", or for per_layer and bucketed "thread"), for bucketed and hierarchical bucket_mb, first_bucket_mb, for hierarchical ranks_per_node,
    for topk density."""
    if name not in _CLASSES:
        raise ConfigError(f"unknown reduction strategy {name!r}; expected one of {', '.join(NAMES)}")
    return _CLASSES[name](comm, **options)


__all__ = ["Reducer", "BlockingReducer", "PerLayerReducer", "BucketedReducer", "HierarchicalReducer", "TopKReducer",
           "create", "NAMES"]
