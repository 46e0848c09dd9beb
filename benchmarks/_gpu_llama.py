"""The model side of ``bench_gpu_model.py``: a Llama of given shapes (random bf16 weights,
HF transformers, SDPA) and what a prefill over a cache of kvstore's layout needs: the
forward, caches whose layers are views of a (L, 2, P, H, D) tensor, greedy decoding and
per-layer hooks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

try:
    import torch
except ImportError:  # bench_gpu_model reports it as a skip
    torch = None  # type: ignore[assignment]

GREEDY_TOKENS = 16
# Llama-3.1-8B's rope scaling (its config.json), in transformers 5's rope_parameters form.
ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Spec:
    """Model shapes and the store's chunk size."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    block_tokens: int


LLAMA_8B = Spec("llama-3.1-8b-shapes-random-bf16", 32, 4096, 32, 8, 128, 14336, 128256, 256)
TINY = Spec("tiny-llama-random-bf16", 4, 256, 4, 2, 64, 512, 1024, 32)


# -- the model ------------------------------------------------------------------------------
def build_model(spec: Spec, device: Any) -> Any:
    """A Llama causal LM of ``spec``'s shapes, random bf16 weights created on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=131072,
        rope_parameters=dict(ROPE),
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):  # 16 GB of weights made where they run, never on the host
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def sync(device: Any) -> None:
    """Wait for the device's queued work (every timing includes it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def new_cache(model: Any) -> Any:
    """An empty DynamicCache: one DynamicLayer per decoder layer."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_over(model: Any, kv: Any) -> Any:
    """A DynamicCache whose layers *are* views of ``kv`` (kvstore's (L, 2, P, H, D) layout).

    Layer i holds ``kv[i, 0]`` / ``kv[i, 1]`` seen as HF's (1, H, P, D) and the cache
    reports P tokens, so masks and positions start at P. Nothing is read here: layer i's
    first ``update`` concatenates the view, after that layer's pre-hook waited for it.
    """
    cache = new_cache(model)
    for i, layer in enumerate(cache.layers):
        keys = kv[i, 0].permute(1, 0, 2).unsqueeze(0)
        values = kv[i, 1].permute(1, 0, 2).unsqueeze(0)
        layer.lazy_initialization(keys, values)  # dtype, device, is_initialized
        layer.keys, layer.values = keys, values
    if (len(cache.layers), cache.get_seq_length()) != (kv.shape[0], kv.shape[2]):
        raise RuntimeError(f"cache: {len(cache.layers)} layers, {cache.get_seq_length()} tokens")
    return cache


def forward(model: Any, ids: Any, start: int, cache: Any) -> Any:
    """One forward of ``ids`` (1-D) at positions ``start...``; the last position's logits."""
    positions = torch.arange(start, start + ids.shape[0], device=ids.device).unsqueeze(0)
    out = model(
        input_ids=ids.unsqueeze(0),
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,  # a 32K prompt's full logits would take 8 GiB
    )
    return out.logits[0, -1]


def greedy(model: Any, cache: Any, logits: Any, position: int) -> list[int]:
    """``GREEDY_TOKENS`` greedy tokens: argmax of ``logits``, then decode steps over ``cache``."""
    tokens = [int(logits.argmax())]
    for step in range(GREEDY_TOKENS - 1):
        ids = torch.tensor([tokens[-1]], device=logits.device)
        tokens.append(int(forward(model, ids, position + step, cache).argmax()))
    return tokens


def layer_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a decoder layer was called with (transformers renamed the argument from
    ``past_key_values`` to ``cache`` after 5.17)."""
    return kwargs["cache"] if "cache" in kwargs else kwargs["past_key_values"]


@contextlib.contextmanager
def layer_hooks(
    model: Any,
    pre: Callable[[int], None] | None = None,
    post: Callable[[int, Any], None] | None = None,
) -> Iterator[None]:
    """Call ``pre(i)`` before and ``post(i, cache)`` after decoder layer i runs."""
    handles = []
    try:
        for i, layer in enumerate(model.model.layers):
            if pre is not None:
                handles.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: pre(i)))
            if post is not None:
                hook = lambda _m, _a, kw, _o, i=i: post(i, layer_cache(kw))  # noqa: E731
                handles.append(layer.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
