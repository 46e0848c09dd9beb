"""What the vLLM connector's workers read from vLLM at run time: the attention backend's
cache-write kernel (to calibrate the page layout) and the worker's parallel ranks."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvstore.connectors.paged import PageMap

if TYPE_CHECKING:
    from kvstore.connectors.vllm_geometry import EngineGeometry

__all__ = ["cache_writer", "page_map_of", "parallel_ranks"]

log = logging.getLogger(f"vllm.{__name__}")


def page_map_of(vllm_config: Any, geometry: EngineGeometry, cache: torch.Tensor) -> PageMap:
    """How the engine's attention kernel packs a page of ``cache``: calibrated with the
    backend's own cache-write kernel, else vLLM's standard page (K and V side by side in
    each token's row, or one latent a row for MLA)."""
    name = geometry.layer_names[0]
    layer = vllm_config.compilation_config.static_forward_context.get(name)
    write = cache_writer(layer, getattr(layer, "impl", None), geometry.replicated)
    if write is not None:
        try:
            return PageMap.calibrate(
                write, cache, geometry.head_dim, geometry.model_dtype, kv_factor=geometry.kv_factor
            )
        except Exception:
            log.exception("kvstore: cannot calibrate the KV page layout of %s", name)
    if geometry.replicated:
        log.warning("kvstore: assuming one latent vector per token row of a page")
        return PageMap.latent(int(cache.shape[2]), geometry.head_dim)
    log.warning("kvstore: assuming K and V side by side in each token's row of a page")
    return PageMap.joined_last(int(cache.shape[2]), geometry.head_dim)


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
