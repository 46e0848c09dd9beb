"""The vLLM connector against vLLM's own code (needs vllm: runs in .venv-vllm).

- The page layout conversion against vLLM's CPU cache-write kernels, for every ISA
  path (vec, vec16, amx) and dtype: what we gather is what the kernel wrote, what we
  scatter is what the kernel would have written.
- The translation of vLLM's scheduler output and KV cache config.

In a venv without vllm these tests skip; test_vllm_e2e.py runs them in .venv-vllm.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed in this venv")

from vllm import _custom_ops as ops
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
from vllm.v1.core.sched.output import CachedRequestData
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvstore.connectors.paged import PagedKV, PageMap
from kvstore.connectors.vllm import (
    EngineGeometry,
    KVStoreConnector,
    KVStoreConnectorStats,
)
from kvstore.connectors.vllm_requests import scheduled_requests
from kvstore.errors import ConfigError

BLOCKS, HEADS, BLOCK = 5, 2, 128


def has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (the machines CI runs on vary)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def cpu_writer(isa: str) -> Any:
    """vLLM's CPU backend's do_kv_cache_update, for one ISA path."""

    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        nb, h, n, _ = cache.shape
        key_cache, value_cache = cache.view(nb, h, 2 * n, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)

    return write


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_conversion_matches_the_cpu_kernels(isa: str, dtype: torch.dtype, head_dim: int) -> None:
    if isa == "amx" and dtype != torch.bfloat16:
        pytest.skip("vLLM uses its AMX path for bf16 only")
    if isa == "amx" and not has_amx():
        pytest.skip("this CPU has no AMX tiles (vLLM refuses its AMX path here)")
    write = cpu_writer(isa)
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * head_dim, dtype=dtype)
    paged = PagedKV([cache], PageMap.calibrate(write, cache, head_dim, dtype), BLOCK)
    blocks, tokens = [3, 0, 4], 300
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(tokens, HEADS, head_dim, generator=gen).to(dtype) for _ in range(2))
    flat = torch.as_tensor(blocks)[torch.arange(tokens) // BLOCK] * BLOCK
    flat += torch.arange(tokens) % BLOCK
    write(k, v, cache, flat)
    out = torch.empty(2, tokens, HEADS, head_dim, dtype=dtype)
    paged.gather(0, paged.slots(blocks, 0, tokens), out)
    assert torch.equal(out[0], k) and torch.equal(out[1], v)
    # A load that starts and ends mid-block writes exactly what the kernel would.
    ours, theirs = torch.zeros_like(cache), torch.zeros_like(cache)
    loaded = PagedKV([ours], PageMap.calibrate(write, ours, head_dim, dtype), BLOCK)
    loaded.scatter(0, loaded.slots(blocks, 100, 257), out[:, 100:257])
    write(k[100:257], v[100:257], theirs, flat[100:257])
    assert torch.equal(ours, theirs)
    # Whole blocks move through strided views of each ISA's pages, the same bytes.
    pages = paged.pages(blocks, 0, 256)
    assert pages is not None, f"{isa} pages are not strided"
    whole = torch.empty(2, 256, HEADS, head_dim, dtype=dtype)
    paged.gather(0, paged.slots(blocks, 0, 256), whole, pages)
    assert torch.equal(whole, out[:, :256])
    ours.zero_()
    theirs.zero_()
    loaded.scatter(0, loaded.slots(blocks, 0, 256), whole, pages)
    write(k[:256], v[:256], theirs, flat[:256])
    assert torch.equal(ours, theirs)


def test_cpu_vec_layout_is_k_transposed_then_v() -> None:
    cache = torch.zeros(1, 1, BLOCK, 64, dtype=torch.bfloat16)
    page_map = PageMap.calibrate(cpu_writer("vec"), cache, 32, torch.bfloat16)
    t, d = torch.arange(BLOCK)[:, None], torch.arange(32)[None, :]
    assert torch.equal(page_map.k_pos, d * BLOCK + t)
    assert torch.equal(page_map.v_pos, BLOCK * 32 + t * 32 + d)


class _Req:
    def __init__(self, req_id: str, block_ids: list[int], computed: int) -> None:
        self.req_id, self.block_ids, self.num_computed_tokens = req_id, (block_ids,), computed


class _Out:
    def __init__(self, new: list[_Req], cached: CachedRequestData, counts: dict[str, int]) -> None:
        self.scheduled_new_reqs, self.scheduled_cached_reqs = new, cached
        self.num_scheduled_tokens = counts


def test_scheduler_output_translation() -> None:
    cached = CachedRequestData(
        req_ids=["b", "c", "d"],
        resumed_req_ids={"c"},
        new_token_ids=[[], [], []],
        all_token_ids={},
        new_block_ids=[([7],), ([1, 2],), None],
        num_computed_tokens=[256, 0, 300],
        num_output_tokens=[0, 0, 1],
    )
    out = _Out([_Req("a", [4, 5], 128)], cached, {"a": 100, "b": 128, "c": 64, "d": 1})
    got = [
        (s.req_id, s.block_ids, s.replace_blocks, s.num_computed, s.num_scheduled)
        for s in scheduled_requests(out)
    ]
    assert got == [
        ("a", ([4, 5],), True, 128, 100),
        ("b", ([7],), False, 256, 128),
        ("c", ([1, 2],), True, 0, 64),
        ("d", None, False, 300, 1),
    ]


class _Cfg:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def vllm_config(tp: int = 1, pp: int = 1) -> Any:
    model = _Cfg(model="org/m", revision=None, dtype=torch.bfloat16, quantization=None)
    parallel = _Cfg(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    return _Cfg(model_config=model, parallel_config=parallel)


def kv_config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=list(groups))


def full(names: list[str]) -> KVCacheGroupSpec:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    return KVCacheGroupSpec(names, spec)


def test_geometry_from_vllm_configs() -> None:
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0)]
    geo = EngineGeometry.from_vllm(vllm_config(tp=2), kv_config(full(names)), None)
    assert geo.layer_names[:3] == tuple(f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2))
    assert (geo.block_size, geo.num_kv_heads, geo.head_dim, geo.tp_size) == (16, 4, 64, 2)
    assert geo.model_id == "org/m@default|torch.bfloat16"
    layout = geo.layout(256)
    assert layout.tensor_shape(1) == (4, 2, 256, 4, 64)
    assert (
        EngineGeometry.from_vllm(vllm_config(), kv_config(full(names)), "mine").model_id == "mine"
    )


def sliding(names: list[str], window: int = 128, heads: int = 4) -> KVCacheGroupSpec:
    spec = SlidingWindowSpec(
        block_size=16, num_kv_heads=heads, head_size=64, dtype=torch.bfloat16, sliding_window=window
    )
    return KVCacheGroupSpec(names, spec)


def mla(names: list[str]) -> KVCacheGroupSpec:
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    return KVCacheGroupSpec(names, spec)


def test_geometry_of_a_hybrid_sliding_window_model() -> None:
    config = kv_config(full(["l.5", "l.11"]), sliding(["l.0", "l.6"]), sliding(["l.1", "l.7"]))
    geo = EngineGeometry.from_vllm(vllm_config(tp=2), config, None)
    assert geo.layer_names == ("l.0", "l.1", "l.5", "l.6", "l.7", "l.11")
    assert geo.layer_groups() == [1, 2, 0, 1, 2, 0]
    assert geo.sliding_groups() == {1, 2}
    assert geo.serves and geo.per_request_loads and not geo.replicated
    assert (
        "2 full-attention layers, 4 sliding-window (128) layers in 3 KV cache groups"
        in geo.describe()
    )
    assert geo.layout(256).tensor_shape(1) == (6, 2, 256, 4, 64)


def test_geometry_of_mla_is_one_latent_shared_by_every_rank() -> None:
    geo = EngineGeometry.from_vllm(vllm_config(tp=4), kv_config(mla(["a.0", "a.1"])), None)
    assert (geo.kv_factor, geo.num_kv_heads, geo.head_dim) == (1, 1, 576)
    assert geo.replicated and not geo.per_request_loads
    assert geo.layout(64).tensor_shape(2) == (2, 1, 128, 1, 576)
    assert "one copy shared by every TP rank" in geo.describe()


def test_geometry_with_mamba_layers_serves_them_only_in_align_mode() -> None:
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    geo = EngineGeometry.from_vllm(
        vllm_config(), kv_config(full(["a"]), KVCacheGroupSpec(["m"], mamba)), None
    )
    assert not geo.serves  # vLLM's default mamba_cache_mode keeps no state per block
    assert "1 mamba2 state layers" in geo.describe() and "recomputed" in geo.describe()
    aligned = MambaSpec(
        block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,), mamba_cache_mode="align"
    )
    geo = EngineGeometry.from_vllm(
        vllm_config(), kv_config(full(["a"]), KVCacheGroupSpec(["m"], aligned)), None
    )
    assert geo.serves and geo.states[0].layer_names == ("m",)
    assert "|state=" in geo.model_id


def test_geometry_refuses_what_it_cannot_key() -> None:
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    with pytest.raises(ConfigError, match="no attention layers"):
        EngineGeometry.from_vllm(vllm_config(), kv_config(KVCacheGroupSpec(["m"], mamba)), None)
    with pytest.raises(ConfigError, match="one KV shape"):
        EngineGeometry.from_vllm(
            vllm_config(), kv_config(full(["a"]), sliding(["b"], heads=2)), None
        )
    with pytest.raises(ConfigError, match="split evenly across 2 pipeline stages"):
        EngineGeometry.from_vllm(vllm_config(pp=2), kv_config(full(["a"])), None)


def test_geometry_under_pipeline_parallelism_needs_even_stages() -> None:
    config = vllm_config(pp=2)
    config.model_config.hf_config = _Cfg(num_hidden_layers=4)
    geo = EngineGeometry.from_vllm(config, kv_config(full(["l.0", "l.1"])), None)
    assert geo.pp_size == 2 and len(geo.layer_names) == 2
    config.model_config.hf_config = _Cfg(num_hidden_layers=5)
    with pytest.raises(ConfigError, match="layers \\(5\\) split evenly"):
        EngineGeometry.from_vllm(config, kv_config(full(["l.0", "l.1"])), None)


def test_mla_conversion_matches_the_cpu_mla_kernel() -> None:
    rank, rope, dtype = 512, 64, torch.bfloat16

    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        latent = k[:, 0, :]
        kv_c, k_pe = latent[:, :rank], latent[:, rank:].unsqueeze(1)
        CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, cache, slots, "auto", None)  # type: ignore[arg-type]

    cache = torch.zeros(BLOCKS, BLOCK, rank + rope, dtype=dtype).unsqueeze(1)
    page_map = PageMap.calibrate(write, cache, rank + rope, dtype, kv_factor=1)
    assert page_map.v_pos is None
    assert torch.equal(page_map.k_pos, PageMap.latent(BLOCK, rank + rope).k_pos)
    paged = PagedKV([cache], page_map, BLOCK)
    blocks, tokens = [2, 4], 200
    latent = torch.randn(tokens, 1, rank + rope).to(dtype)
    flat = torch.as_tensor(blocks)[torch.arange(tokens) // BLOCK] * BLOCK
    write(latent, latent, cache, flat + torch.arange(tokens) % BLOCK)
    out = torch.empty(1, tokens, 1, rank + rope, dtype=dtype)
    paged.gather(0, paged.slots(blocks, 0, tokens), out)
    assert torch.equal(out[0], latent)


def test_stats_aggregate_across_workers() -> None:
    a = KVStoreConnector.build_kv_connector_stats({"load_chunks": 2})
    b = KVStoreConnectorStats(data={"load_chunks": 3, "save_chunks_stored": 1})
    assert a is not None
    assert a.aggregate(b).reduce() == {"load_chunks": 5, "save_chunks_stored": 1}
    a.reset()
    assert a.is_empty()
