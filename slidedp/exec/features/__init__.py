"""The executor's plan features, one module each, registered below in one line each.

Each module holds everything the executor does for its feature (its kernels, buffers and step
hooks: base.py says how they plug into the engine), so that the interpreter and the base kernels
hold no branch on a feature. Order matters where two features touch one task: a later feature's
kernel for it wins.
"""

from slidedp.exec.features import deferred_update, embedding_rows, grad_widen, offload, split_update

FEATURES = (
    deferred_update.DeferredUpdate,
    split_update.SplitUpdate,
    grad_widen.WidenOnHost,
    offload.ActivationOffload,
    embedding_rows.SplitEmbedding,
)
