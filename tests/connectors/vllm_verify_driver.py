"""Shadow verification in a real vLLM (run with .venv-vllm's python): blocks of another
prompt planted under a prompt's keys are caught, correct blocks pass.

``python vllm_verify_driver.py --workdir W --store S --out R.json [--phases ...]`` runs,
in one vLLM process with the kvstore connector on a disk-only store and
``verify_sample_rate`` 1, the phases named (default all, in this order):

- ``store``: prompts A and B, one at a time: misses; their chunks are stored.
- ``plant``: through the store API (a second store on the same directory, as an engine
  with a changed layout that kept the namespace would), chunks :data:`PLANTED` of A are
  replaced by B's chunks of the same index.
- ``verify``: A alone, then B and C batched (B's recompute in another batch shape than
  its original), then A again. Every hit is sampled: A's planted chunks must mismatch
  and be quarantined, its other chunks and B's must match; the last A finds only its
  unplanted chunks stored.

Phases may also run in separate processes (``--phases store`` then ``--phases plant
verify`` with another ``--max-num-batched-tokens``: the recompute chunked otherwise than
the original), which is how docs/vllm.md's tolerance figures were measured. The JSON
result: each request's output tokens, the connector's counters by role, and the keys
(hex) of A's and B's chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import vllm_offline  # noqa: E402  (the example's random Llama and stats reader)

MODEL_ID = "kvstore-verify-llama-12l"
CHUNK = 256
PROMPT_TOKENS = 4 * CHUNK + 76  # four full chunks and a tail the engine computes itself
PLANTED = (2, 3)  # A's chunks that get B's KV
PHASES = ("store", "plant", "verify")


def make_prompts() -> dict[str, list[int]]:
    """Prompts A, B and C: unrelated random token ids."""
    rng = random.Random(32)
    vocab = int(vllm_offline.MODEL["vocab_size"])
    return {n: [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for n in "ABC"}


def layout(dtype: str) -> Any:
    """The connector's KV layout for the example Llama in ``dtype``."""
    import torch

    from kvstore import KVLayout

    m = vllm_offline.MODEL
    return KVLayout(
        num_layers=int(m["num_hidden_layers"]),
        num_kv_heads=int(m["num_key_value_heads"]),
        head_dim=int(m["head_dim"]),
        block_tokens=CHUNK,
        dtype=getattr(torch, dtype),
    )


def chunk_keys(tokens: list[int], dtype: str) -> list[Any]:
    """The connector's keys of ``tokens``' full chunks (TP rank 0 of 1)."""
    from kvstore import Namespace
    from kvstore.keys import chain_keys, tokens_to_bytes

    lay = layout(dtype)
    ns = Namespace(model=MODEL_ID, layout=lay, tp_rank=0, tp_size=1)
    full = len(tokens) // CHUNK * CHUNK
    return chain_keys(tokens_to_bytes(tokens[:full]), CHUNK, ns.seed)


def store_config(path: str) -> dict[str, Any]:
    """Disk only: the worker reads what is on disk (a host tier would keep its own copy)."""
    return {"tiers": [{"kind": "disk", "path": path, "capacity": "1GiB"}]}


def plant(args: argparse.Namespace, prompts: dict[str, list[int]]) -> None:
    """Put B's chunks :data:`PLANTED` under A's keys of the same chunks."""
    from kvstore import KVStore

    a, b = chunk_keys(prompts["A"], args.dtype), chunk_keys(prompts["B"], args.dtype)
    with KVStore(layout(args.dtype), store_config(args.store)) as store:
        for i in PLANTED:
            kv = store.get([b[i]])
            assert store.delete([a[i]]) == 1, f"A's chunk {i} is not stored"
            assert store.put([a[i]], kv) == 1, f"cannot plant A's chunk {i}"


def engine(args: argparse.Namespace) -> Any:
    """vLLM on the example Llama with the connector, every hit sampled."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = {
        "kvstore_config": store_config(args.store),
        "model_id": MODEL_ID,
        "stats_dir": args.stats_dir,
        "verify_sample_rate": 1,
    }
    return LLM(
        model=str(vllm_offline.write_model(Path(args.workdir) / "model")),
        skip_tokenizer_init=True,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=4096,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # every hit is kvstore's
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.connectors.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        seed=0,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The phases asked for, in order; the requests' outputs by name."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = make_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, seed=0)
    llm = engine(args) if {"store", "verify"} & set(args.phases) else None
    outputs: dict[str, list[int]] = {}

    def generate(*names: str, label: str = "") -> None:
        assert llm is not None
        batch = [TokensPrompt(prompt_token_ids=prompts[n]) for n in names]
        for n, out in zip(names, llm.generate(batch, params, use_tqdm=False), strict=True):
            outputs[n + label] = list(out.outputs[0].token_ids)

    for phase in args.phases:
        if phase == "store":
            generate("A", label="1")
            generate("B", label="1")
        elif phase == "plant":
            plant(args, prompts)
        else:
            generate("A", label="2")
            generate("B", "C", label="2")
            generate("A", label="3")
    llm = None  # shuts the engine down (the last reference): the counters are written
    keys = {n: [k.hex() for k in chunk_keys(prompts[n], args.dtype)] for n in "AB"}
    return {"outputs": outputs, "keys": keys}


def main() -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--stats-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    vllm_offline.bind_threads(1)
    result = run(args)
    result["stats"] = vllm_offline.read_stats(args.stats_dir)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
