"""Prefill/decode split through kvstore: one vLLM process prefills and stores the prompts' KV,
a separate vLLM process loads it and decodes, computing only each prompt's last token.

Runs with the vLLM virtualenv (``bash scripts/setup-vllm.sh`` creates it)::

    .venv-vllm/bin/python examples/prefill_decode_split.py --workdir /tmp/pd

The two roles share nothing but the store's disk directory (``<workdir>/store``); on
several machines that would be a shared tier (S3, Redis) in ``kvstore_config``. The
prefill process is a ``kv_producer`` (it saves, never loads), the decode process a
``kv_consumer`` (it loads, never saves). Uses the small random model and prompts of
examples/vllm_offline.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_offline  # (sets the CPU backend's environment before vLLM loads)

vllm_offline.bind_threads(1)


def engine(args: argparse.Namespace, role: str) -> Any:
    """A vLLM engine whose connector plays ``role`` on the shared store."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    workdir = Path(args.workdir)
    config = KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.connectors.vllm",
        kv_role="kv_producer" if role == "prefill" else "kv_consumer",
        kv_connector_extra_config={
            "kvstore_config": {"tiers": [{"kind": "disk", "path": str(workdir / "store")}]},
            "model_id": "kvstore-example-llama-12l",
            "stats_dir": str(workdir / f"stats-{role}"),
        },
    )
    return LLM(
        model=str(vllm_offline.write_model(workdir / "model")),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=8192,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        kv_transfer_config=config,
        disable_log_stats=False,
        seed=0,
    )


def run_role(args: argparse.Namespace) -> dict[str, Any]:
    """Prefill: one token per prompt (its KV is what matters). Decode: the whole answer."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine(args, args.role)
    max_tokens = 1 if args.role == "prefill" else args.max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = []
    for tokens in vllm_offline.make_prompts("first", 3300):
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        metrics = out.metrics
        results.append(
            {
                "prompt_tokens": len(tokens),
                "cached_tokens": out.num_cached_tokens or 0,
                "ttft_s": getattr(metrics, "first_token_latency", 0.0) if metrics else 0.0,
                "output": list(out.outputs[0].token_ids),
            }
        )
    del llm  # the engine shuts down; the prefill side has flushed every step already
    return {"role": args.role, "results": results}


def main() -> None:
    """Run the prefill process, then the decode process, and print what each did."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--role", choices=("prefill", "decode"), help="(internal) one role")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.role:
        print("RESULT " + json.dumps(run_role(args)))
        return
    for role in ("prefill", "decode"):
        start = time.perf_counter()
        cmd = [sys.executable, __file__, "--workdir", args.workdir, "--role", role]
        cmd += ["--max-tokens", str(args.max_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"{role} process failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        result = json.loads(lines[-1][len("RESULT ") :])
        print(f"{role} process ({time.perf_counter() - start:.0f} s):")
        for r in result["results"]:
            print(
                f"  {r['prompt_tokens']} prompt tokens, {r['cached_tokens']} loaded from kvstore, "
                f"TTFT {r['ttft_s'] * 1000:.0f} ms, output {r['output'][:6]}"
            )


if __name__ == "__main__":
    main()
