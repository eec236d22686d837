"""outside_graph_pools' helper thread: what it carries over from the caller (CPU; the CUDA side
stream and the graph pools themselves are covered by tests/test_gpu_api.py on the GPU)."""
from __future__ import annotations

import threading

import pytest
import torch

from autofp4.graph_pools import on_helper_thread, outside_graph_pools


def _state():
    return threading.current_thread(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_the_helper_thread_runs_fn_with_the_callers_autograd_modes(mode):
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]
    with ctx():
        thread, grad, inference = on_helper_thread(_state)
        assert thread is not threading.current_thread()
        assert (grad, inference) == (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        x = torch.randn(8, 8)
        y = on_helper_thread(lambda: x @ x)  # a tensor of the caller's mode, usable back here
        assert torch.allclose(y + 0, x @ x)


def test_the_helper_threads_exception_is_raised_in_the_caller():
    def boom():
        raise ValueError("a bad weight")

    with pytest.raises(ValueError, match="a bad weight"):
        on_helper_thread(boom)


def test_off_cuda_fn_runs_in_line():
    thread, _, _ = outside_graph_pools(_state, torch.device("cpu"))
    assert thread is threading.current_thread()
