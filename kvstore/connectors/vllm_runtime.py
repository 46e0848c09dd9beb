"""What the vLLM connector's workers read from vLLM at run time: the attention backend's
cache-write kernel (to calibrate the page layout) and the worker's parallel ranks."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cache_writer", "parallel_ranks"]


def cache_writer(layer: Any, impl: Any, latent: bool) -> Any:
    """The backend's cache-write kernel as ``write(k, v, cache, slots)``, or None.

    For MLA the "K" is the latent: split into the compressed KV and the rope part
    the kernel takes (``kv_c_normed [T, rank]``, ``k_pe [T, 1, rope]``).
    """
    if impl is None or not hasattr(impl, "do_kv_cache_update"):
        return None
    if not latent:

        def write(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
            impl.do_kv_cache_update(layer, k, v, c, s)

        return write
    rank = getattr(layer, "kv_lora_rank", None) or getattr(impl, "kv_lora_rank", None)
    if rank is None:
        return None

    def write_latent(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
        latent = k[:, 0, :]
        kv_c, k_pe = latent[:, :rank].contiguous(), latent[:, rank:].unsqueeze(1).contiguous()
        dtype = getattr(layer, "kv_cache_dtype", "auto")
        impl.do_kv_cache_update(kv_c, k_pe, c, s, dtype, getattr(layer, "_k_scale", None))

    return write_latent


def parallel_ranks() -> tuple[int, int]:
    """This worker's (tensor-parallel rank, pipeline stage); (0, 0) without those groups."""
    from vllm.distributed import parallel_state

    try:
        tp = int(parallel_state.get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):  # no TP group (a single process)
        tp = 0
    try:
        pp = int(parallel_state.get_pp_group().rank_in_group)
    except (AssertionError, RuntimeError, AttributeError):
        pp = 0
    return tp, pp
