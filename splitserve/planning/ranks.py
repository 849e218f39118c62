"""Where the ranks a tensor-parallel profile spawns meet (``measure`` for the splitserve engine, ``measure_vllm``
for the vllm backend): loopback, and how long they wait for each other."""

HOST = "127.0.0.1"
TP_SETUP_TIMEOUT_S = 120.0  # every rank reaches the store and builds its shard within this
TP_GROUP_TIMEOUT_S = 60.0  # a collective of the group (rank 0's next step, at most) within this


def spawn_followers(size: int, target, args):
    """Rank 0's rendezvous store on ``HOST``, and ranks 1 .. size-1 spawned, each running
    ``target(*args(port, rank, errors))``: returns (store, port, processes, errors), where a rank puts what went
    wrong on ``errors`` (``end_followers`` raises it)."""
    import torch.multiprocessing as mp

    from splitserve.engine.tp.distributed import bind_store

    store, port = bind_store(HOST, 0, TP_SETUP_TIMEOUT_S)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=target, args=args(port, rank, errors)) for rank in range(1, size)]
    for process in procs:
        process.start()
    return store, port, procs, errors


def end_followers(procs, errors) -> None:
    """Wait for the spawned ranks (rank 0 has told them to stop), kill one that does not end, and raise the first
    error a rank reported."""
    for process in procs:
        process.join(30)
        if process.is_alive():
            process.kill()
    if not errors.empty():
        raise RuntimeError(errors.get())
