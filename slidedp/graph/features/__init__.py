"""The plan features the graph builder and the memory model apply, one line each, in the order
their hooks run (features/base.py lists the hooks)."""

from slidedp.graph.features.base import Feature
from slidedp.graph.features.compact_moments import CompactMoments
from slidedp.graph.features.deferred_update import DeferredUpdate
from slidedp.graph.features.embedding_rows import EmbeddingRows
from slidedp.graph.features.grad_widen import HostWiden
from slidedp.graph.features.internode import Internode
from slidedp.graph.features.offload import Offload
from slidedp.graph.features.split_update import SplitUpdate

FEATURES: tuple[type[Feature], ...] = (
    Offload,
    HostWiden,
    DeferredUpdate,
    SplitUpdate,
    EmbeddingRows,
    CompactMoments,
    Internode,
)
