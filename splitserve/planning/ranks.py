"""Where the ranks a tensor-parallel profile spawns meet (``measure`` for the splitserve engine, ``measure_vllm``
for the vllm backend): loopback, and how long they wait for each other."""

HOST = "127.0.0.1"
TP_SETUP_TIMEOUT_S = 120.0  # every rank reaches the store and builds its shard within this
TP_GROUP_TIMEOUT_S = 60.0  # a collective of the group (rank 0's next step, at most) within this
