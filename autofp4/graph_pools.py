"""Building long-lived CUDA tensors outside CUDA graph memory pools."""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

_SIDE_STREAMS: dict[torch.device, Any] = {}


def outside_graph_pools(fn: Callable[[], Any], device: torch.device) -> Any:
    """``fn()`` (a one-off build of tensors kept for later calls: a packed weight, a kernel's
    per-device state) with its CUDA allocations outside any CUDA graph memory pool.

    ``torch.compile(mode="reduce-overhead")`` warms a graph up with the allocations of the
    calling thread routed to the graph's private pool; a weight packed during that run would be
    a live tensor of the pool that the graph does not own, and recording the graph refuses it
    ("tensors in the cudagraph pool not tracked as outputs"). Allocations of another thread are
    not routed, so ``fn`` runs on a helper thread (with the caller's grad and inference modes),
    on a side stream of ``device`` that waits for the caller's current stream before ``fn``, the
    caller's stream waiting for it after: the order of work is as if ``fn`` ran in line. Its
    exception is raised here. Under stream capture (and off CUDA) ``fn`` runs as is."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return fn()
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    cur = torch.cuda.current_stream(device)

    def on_side() -> Any:
        with torch.cuda.device(device), torch.cuda.stream(side):
            side.wait_stream(cur)
            return fn()

    out = on_helper_thread(on_side)
    cur.wait_stream(side)
    return out


def on_helper_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a new thread (waited for) with this thread's grad and inference modes; its
    result returned, its exception raised here."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["err"] = e

    t = threading.Thread(target=work, name="autofp4-outside-graph-pools", daemon=True)
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]
