"""A tensor-parallel worker, worker side: rank 0's link to its other ranks (``rank_link``), what it tells
them in order with the step plans (``rank_notices``), its KV endpoints as one (``kv``: ``TPSender``,
``TPReceiver``) and the other ranks themselves (``follower``).

The engine's side (shards, the step plan, the group) is in ``splitserve.engine``; the KV hand-off's own
pieces (which transfers, head ranges, the hand-off handle) in ``splitserve.kv_transfer.tp``. ``kv`` stays
here rather than there: it mirrors the parts the followers move through the rank link (``FollowerLink``,
ended by those ranks' reports over gRPC) and starts them with a notice on the plan channel, and both
belong to the worker's group, whose lost rank fails the worker as a whole (``WorkerBase.group_failed``).
Moving it down would take the rank link, and the ``TensorParallelRank`` service with it, into the KV
transfer.
"""
