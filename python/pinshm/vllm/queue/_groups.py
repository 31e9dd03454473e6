"""Building a queue over a process group, as vLLM's
``create_from_process_group`` and ``create_from_process_group_single_reader``
do: a torch ``ProcessGroup`` (gloo) or vLLM's ``StatelessProcessGroup``
carries the writer's handle to every rank."""

from __future__ import annotations

from typing import Any


def create_from_process_group(
    cls: Any,
    pg: Any,
    max_chunk_bytes: int,
    max_chunks: int,
    writer_rank: int = 0,
    external_writer_handle: Any = None,
    blocking: bool = True,
) -> Any:
    """As vLLM: the writer rank creates the queue and broadcasts its
    handle over `pg` (a torch ProcessGroup or vLLM's
    StatelessProcessGroup); every other rank attaches."""
    stateless = hasattr(pg, "broadcast_obj")
    if stateless:
        group_rank, world, global_ranks = pg.rank, pg.world_size, list(range(pg.world_size))
    else:
        import torch.distributed as dist

        group_rank = dist.get_rank(pg)
        world = dist.get_world_size(pg)
        global_ranks = dist.get_process_group_ranks(pg)
    status = _same_node(pg, writer_rank, world)
    if group_rank == writer_rank:
        if external_writer_handle is not None:
            mq = cls.create_from_handle(external_writer_handle, group_rank)
        else:
            same = [i for i, s in enumerate(status) if s]
            local = [i for i in same if i != writer_rank]
            mq = cls(
                n_reader=world - 1,
                n_local_reader=len(local),
                local_reader_ranks=local,
                max_chunk_bytes=max_chunk_bytes,
                max_chunks=max_chunks,
            )
        handle = mq.export_handle()
        if stateless:
            pg.broadcast_obj(handle, writer_rank)
        else:
            import torch.distributed as dist

            dist.broadcast_object_list([handle], src=global_ranks[writer_rank], group=pg)
    else:
        if stateless:
            handle = pg.broadcast_obj(None, writer_rank)
        else:
            import torch.distributed as dist

            recv = [None]
            dist.broadcast_object_list(recv, src=global_ranks[writer_rank], group=pg)
            handle = recv[0]
        mq = cls.create_from_handle(handle, group_rank)
    if blocking:
        mq.wait_until_ready()
    return mq


def create_from_process_group_single_reader(
    cls: Any,
    pg: Any,
    max_chunk_bytes: int,
    max_chunks: int,
    reader_rank: int = 0,
    blocking: bool = False,
) -> tuple[Any, list[Any]]:
    """As vLLM: every rank writes its own queue to `reader_rank`, which
    gathers the handles."""
    import torch.distributed as dist

    try:
        from vllm.platforms import current_platform
        from vllm.platforms.interface import get_assigned_physical_gpu_ids

        ids = get_assigned_physical_gpu_ids()
        local_size = len(ids) if ids is not None else current_platform.device_count()
    except ImportError:
        local_size = 0
    rank = dist.get_rank()
    same_node = local_size <= 0 or rank // local_size == reader_rank // local_size
    mq = cls(
        n_reader=1,
        n_local_reader=1 if same_node else 0,
        max_chunk_bytes=max_chunk_bytes,
        max_chunks=max_chunks,
    )
    handle = mq.export_handle()
    handles = [None] * dist.get_world_size(pg) if rank == reader_rank else None
    dist.gather_object(handle, handles, dst=reader_rank, group=pg)
    if blocking:
        mq.wait_until_ready()
    return mq, handles or []


def _same_node(pg: Any, writer_rank: int, world: int) -> list[bool]:
    """Which ranks share the writer's machine: vLLM's answer where vLLM is
    installed, else all of them."""
    try:
        from vllm.distributed.parallel_state import in_the_same_node_as
    except ImportError:
        return [True] * world
    return list(in_the_same_node_as(pg, source_rank=writer_rank))
