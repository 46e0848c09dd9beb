"""Worker mode of ``bench_vllm.py``: one configuration's vLLM process.

``bench_vllm.py`` starts each configuration as ``.venv-vllm/bin/python bench_vllm.py
--worker NAME --spec SPEC --out OUT``; that dispatches to :func:`worker` here, which
writes the random model if it is not there yet, runs the whole workload in one vLLM
engine and writes its results as JSON to ``OUT``. torch, safetensors and vLLM are
imported inside the functions that need them: the parent (main venv) imports this module
for :func:`kv_transfer_config` only and has none of them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import log

if TYPE_CHECKING:
    import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: Per-layer Llama projections: name -> (rows, columns) in terms of the geometry's
#: hidden size ``h``, query width ``q``, KV width ``kv`` and MLP width ``inter``.
_PROJECTIONS = {
    "self_attn.q_proj": ("q", "h"),
    "self_attn.k_proj": ("kv", "h"),
    "self_attn.v_proj": ("kv", "h"),
    "self_attn.o_proj": ("h", "q"),
    "mlp.gate_proj": ("inter", "h"),
    "mlp.up_proj": ("inter", "h"),
    "mlp.down_proj": ("h", "inter"),
}


def _llama_weights(
    geometry: dict[str, int], tdtype: torch.dtype, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Every tensor of a random Llama of ``geometry``: weights ~ N(0, 0.02), norms 1."""
    import torch

    h, inter, vocab = geometry["hidden_size"], geometry["intermediate_size"], geometry["vocab_size"]
    dims = {
        "h": h,
        "inter": inter,
        "q": geometry["num_attention_heads"] * geometry["head_dim"],
        "kv": geometry["num_key_value_heads"] * geometry["head_dim"],
    }

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(tdtype)

    # The draw order (embeddings, head, then layer by layer) fixes the weights for a seed.
    weights = {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h)}
    weights["model.norm.weight"] = torch.ones(h, dtype=tdtype)
    for i in range(geometry["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        for name, (rows, cols) in _PROJECTIONS.items():
            weights[f"{prefix}{name}.weight"] = rand(dims[rows], dims[cols])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{prefix}{norm}.weight"] = torch.ones(h, dtype=tdtype)
    return weights


def _llama_config(geometry: dict[str, int], dtype: str) -> dict[str, Any]:
    """The ``config.json`` of a Llama of ``geometry`` stored in ``dtype``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **geometry,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_model(path: Path, geometry: dict[str, int], dtype: str, seed: int = 0) -> Path:
    """A random Llama checkpoint (config.json + model.safetensors) at ``path``; weights
    ~ N(0, 0.02), norms 1. Reused if present (written to a temp name, then renamed)."""
    import torch
    from safetensors.torch import save_file

    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = _llama_weights(geometry, getattr(torch, dtype), gen)
    save_file(weights, str(path / "model.safetensors.tmp"))
    (path / "config.json").write_text(json.dumps(_llama_config(geometry, dtype), indent=1))
    # The rename comes last, so a checkpoint that exists is a complete one.
    os.replace(path / "model.safetensors.tmp", path / "model.safetensors")
    return path


def kv_transfer_config(name: str, spec: dict[str, Any]) -> dict[str, Any] | None:
    """The ``KVTransferConfig`` fields of configuration ``name`` (None: no connector)."""
    if name == "nocache":
        return None
    if name == "kvstore":
        return {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "kvstore_config": {
                    "tiers": [
                        {"kind": "host", "capacity": spec["host_capacity"]},
                        {"kind": "disk", "path": spec["store_dir"], "capacity": "8GiB"},
                    ]
                },
                "chunk_tokens": spec["chunk_tokens"],
                "model_id": spec["model_id"],
                "stats_dir": spec["stats_dir"],
            },
        }
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": spec["offload_bytes"],
            "block_size": spec["chunk_tokens"],
        },
    }


def _start_llm(model: Path, spec: dict[str, Any], fields: dict[str, Any] | None) -> Any:
    """The vLLM engine for ``model`` with connector ``fields`` (None: no connector)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype=spec["dtype"],
        enforce_eager=True,
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_model_len"],  # a prefill is one step
        enable_prefix_caching=False,
        max_num_seqs=1,
        kv_transfer_config=KVTransferConfig(**fields) if fields else None,
        disable_log_stats=False,  # per-request metrics (TTFT)
        seed=0,
    )


def _generate(llm: Any, params: Any, tokens: list[int]) -> dict[str, Any]:
    """One request: its token counts, what vLLM served from cache, its TTFT and duration."""
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
    took = time.perf_counter() - t0
    metrics = out.metrics
    return {
        "prompt_tokens": len(tokens),
        "generated_tokens": len(out.outputs[0].token_ids),
        "cached_tokens": out.num_cached_tokens or 0,
        "ttft_s": getattr(metrics, "first_token_latency", None) if metrics else None,
        "request_s": took,
    }


def _run_turns(name: str, llm: Any, params: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The workload's requests in order, one at a time; each turn's figures."""
    turns = []
    for req in spec["requests"]:
        turns.append(
            {
                "session": req["session"],
                "turn": req["turn"],
                **_generate(llm, params, req["tokens"]),
            }
        )
        log(f"[{name}] session {req['session']} turn {req['turn']}: {turns[-1]}")
    return turns


def worker(name: str, spec_path: str, out_path: str) -> None:
    """Worker mode (runs in .venv-vllm): one vLLM process, the whole workload, JSON out."""
    sys.path.insert(0, str(EXAMPLES))
    import vllm_offline  # sets VLLM_CPU_KVCACHE_SPACE unless set

    vllm_offline.bind_threads(1)  # the same OMP threads with and without a connector
    spec = json.loads(Path(spec_path).read_text())
    model = write_model(Path(spec["model_dir"]), spec["geometry"], spec["dtype"])

    from vllm import SamplingParams

    fields = kv_transfer_config(name, spec)
    start = time.perf_counter()
    llm = _start_llm(model, spec, fields)
    startup_s = time.perf_counter() - start
    params = SamplingParams(
        temperature=0.0, max_tokens=spec["answer_tokens"], ignore_eos=True, seed=0
    )
    warmup = [_generate(llm, params, spec["warmup_tokens"]) for _ in range(2)]
    turns = _run_turns(name, llm, params, spec)
    del llm  # shuts the engine down; the kvstore workers flush and write their stats
    result = {
        "config": name,
        "kv_transfer_config": fields,
        "startup_s": startup_s,
        "warmup": warmup,
        "turns": turns,
    }
    Path(out_path).write_text(json.dumps(result))
