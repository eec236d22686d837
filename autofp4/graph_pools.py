"""Building long-lived CUDA tensors outside CUDA graph memory pools."""
from __future__ import annotations

from typing import Any, Callable

import torch

_SIDE_STREAMS: dict[torch.device, Any] = {}


def outside_graph_pools(fn: Callable[[], Any], device: torch.device) -> Any:
    """``fn()`` (a one-off build of tensors kept for later calls: a packed weight) with its CUDA
    allocations outside any CUDA graph memory pool: on a side stream of ``device``.

    ``torch.compile(mode="reduce-overhead")`` warms a graph up with the current stream's
    allocations routed to the graph's private pool; a weight packed during that run would be a
    live tensor of the pool that the graph does not own, and recording the graph refuses it
    ("tensors in the cudagraph pool not tracked as outputs"). Allocations of another stream are
    not routed. The side stream waits for the current one before ``fn`` and the current one for
    it after, so the order of work is as if ``fn`` ran in line. Under stream capture (and off
    CUDA) ``fn`` runs as is."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return fn()
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    cur = torch.cuda.current_stream(device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        out = fn()
    cur.wait_stream(side)
    return out
