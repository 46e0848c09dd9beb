"""kvstore's connector under vLLM's hybrid KV cache manager (HMA), and the KV probe's cut
of a state block, against vLLM's own code but without an engine (whole hybrids run in
test_vllm_hybrid.py).

- vLLM keeps its hybrid KV cache manager on with a connector only if the connector
  class declares ``SupportsHMA`` (``KVConnectorFactory.create_connector`` raises
  otherwise), and then calls ``request_finished_all_groups`` with every group's blocks,
  never ``request_finished``. kvstore's saves are synchronous: for a finished request
  it returns ``(False, None)``, so vLLM frees the blocks at once (``True`` would keep
  them until ``get_finished`` names the request) with no transfer params.
- With the hybrid manager off (``--disable-hybrid-kv-cache-manager``), vLLM's own
  grouping makes a sliding-window layer full attention with its window recorded, and
  kvstore serves it as full attention.
- A chunked-local-attention, cross-attention or Mamba (``mamba_cache_mode`` none) group
  beside full attention: kvstore stores nothing for the model, and says why.
- The probe (examples/vllm_probe.py) hashes a state block's states, cut from the
  ``MambaSpec`` (shapes and dtypes), not the page's padding: checked on caches vLLM's
  ``allocate_kv_cache`` lays out (an attention group and a padded state group sharing
  one allocation, as vLLM lays out hybrids) and state views bound by vLLM's
  ``MambaBase.bind_kv_cache``, in two of vLLM's layouts (heads outside or inside a block's tokens).

vLLM lives in ``.venv-vllm``: the checks run there, in this file run as a script (through
the fork server of the engine tests, vllm_zygote.py), and write what they found to a JSON
file that the tests below read.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_venv import EXAMPLES, VLLM_PYTHON, engine_env, run_engine

pytestmark = [
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason=".venv-vllm is absent: run `bash scripts/setup-vllm.sh` (scripts/test.sh does)",
    ),
    pytest.mark.engine,
    pytest.mark.timeout(300),
]

BLOCK = 16
ATTN, STATE = "model.layers.1.self_attn.attn", "model.layers.0.mixer"
CONV, SSM = (3, 64), (2, 8, 16)  # a Mamba2 layer's conv state (bf16) and SSM state (fp32)
STATE_BYTES = 3 * 64 * 2 + 2 * 8 * 16 * 4  # 1408
PAGE = 2 * BLOCK * 2 * 64 * 2  # K and V, 2 heads of 64, bf16: 8192 (the state's padded page)


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("hma")
    out, log = work / "facts.json", work / "facts.log"
    cmd = [str(VLLM_PYTHON), str(Path(__file__).resolve()), str(work), str(out)]
    rc = run_engine(cmd, engine_env(), log, timeout=240)
    if rc != 0:
        pytest.fail(f"the checks in .venv-vllm failed (rc {rc}):\n{log.read_text()[-5000:]}")
    found: dict[str, Any] = json.loads(out.read_text())
    return found


def test_vllm_keeps_its_hybrid_manager_on_with_kvstores_connector(facts: dict[str, Any]) -> None:
    assert facts["supports_hma_class"] is True
    assert facts["supports_hma_instance"] is True
    assert facts["factory_supports_hma"] is True  # what create_connector checks
    assert facts["overrides_request_finished_all_groups"] is True
    assert facts["serves"] == (
        "kvstore serves 1 full-attention layers, 1 mamba2 state layers (2 tensors, "
        f"{STATE_BYTES} bytes each) in 2 KV cache groups"
    )


def test_a_finished_request_frees_its_blocks_at_once(facts: dict[str, Any]) -> None:
    # vLLM's contract: (delay_free, kv_transfer_params); kvstore never delays the free
    # (every save is done within its step) and has no params to return.
    finished = facts["request_finished_all_groups"]
    assert finished["looked_up"] == [0, False]  # a prompt shorter than a chunk: nothing
    assert finished["blocks"] == [False, None]  # its blocks in both groups
    assert finished["no_blocks"] == [False, None]  # vLLM passes no group's blocks
    assert finished["never_scheduled"] == [False, None]  # a request kvstore never saw


def test_with_the_hybrid_manager_off_a_window_is_served_as_full_attention(
    facts: dict[str, Any],
) -> None:
    # vLLM then keeps every token of a sliding-window layer (one group, FullAttentionSpec
    # with the window recorded), and kvstore stores and loads it as full attention.
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert facts["hma_off"]["groups"] == [[layers, "FullAttentionSpec", 128]]
    assert facts["hma_off"]["serves"] == "kvstore serves 2 full-attention layers"


def test_kinds_it_cannot_store_leave_the_whole_model_to_vllm(facts: dict[str, Any]) -> None:
    # A prefix needs every layer's KV or state: one group kvstore cannot store, and it
    # serves nothing (a warning at start-up says why; vLLM recomputes every prompt).
    whys = {
        "chunked_local": "1 ChunkedLocalAttentionSpec layers",
        "cross": "1 CrossAttentionSpec layers",
        "mamba_none": "mamba_cache_mode 'align'; this engine runs 'none'",
    }
    for kind, why in whys.items():
        line = facts["not_stored"][kind]
        assert line.startswith("kvstore stores nothing for this model: it cannot store"), kind
        assert why in line and line.endswith("every prompt is recomputed"), (kind, line)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_the_probe_hashes_a_state_blocks_states_not_its_padding(
    facts: dict[str, Any], layout: str
) -> None:
    probe = facts["probe"][layout]
    assert probe["attention_shape"] == [8, 2, BLOCK, 128]  # [blocks, heads, tokens, K|V]
    assert probe["state_shape"] == [8, 1, 1, STATE_BYTES]  # [blocks, 1, 1, state bytes]
    attention, state = probe["groups"]["0"], probe["groups"]["1"]
    assert attention["kind"] == "FullAttentionSpec" and attention["block_bytes"] == PAGE
    assert state["kind"] == "MambaSpec" and state["block_bytes"] == STATE_BYTES
    assert state["page_bytes"] == PAGE
    # Block 2 of the attention layer: every byte of it; the state group's block 3: its
    # conv and SSM states as the layer's own views hold them, whatever the padding
    # after them holds; the null block (0) is no block.
    assert attention["layers"][ATTN] == [probe["attention_block_2"], None]
    assert state["layers"][STATE] == [None, probe["state_block_3"]]
    assert probe["after_padding_changed"] == state["layers"][STATE][1]
    assert probe["after_ssm_changed"] != state["layers"][STATE][1]
    # The cut is checked against the layer's own state views at registration.
    assert probe["wrong_cut"] == f"the probe's cut of {STATE}'s state block is not its layer's"


# -- the checks, run in .venv-vllm -------------------------------------------------------
def _sha(parts: list[Any]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()[:24]


def _configs(work: Path) -> tuple[Any, Any]:
    """A two-group hybrid (an attention layer, a Mamba2 state layer in align mode) as
    vLLM's configs give it to a connector (the model config as plain attributes)."""
    from types import SimpleNamespace

    import torch
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )

    attention = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    state = MambaSpec(
        block_size=BLOCK,
        shapes=(CONV, SSM),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=attention.page_size_bytes,
        mamba_cache_mode="align",
    )
    blocks, page = 8, attention.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[  # the groups overlay one allocation, as in vLLM's hybrids
            KVCacheTensor(
                size=blocks * page, layers=[n], layer_stride=blocks * page, block_stride=page
            )
            for n in (ATTN, STATE)
        ],
        kv_cache_groups=[KVCacheGroupSpec([ATTN], attention), KVCacheGroupSpec([STATE], state)],
    )
    transfer = KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.connectors.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={
            "kvstore_config": {"tiers": [{"kind": "disk", "path": str(work / "store")}]},
            "chunk_tokens": BLOCK,
        },
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=transfer,
        model_config=SimpleNamespace(
            model="org/hybrid",
            revision=None,
            dtype=torch.bfloat16,
            quantization=None,
            get_total_num_hidden_layers=lambda: 2,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=None,
    )
    return vllm_config, kv_cache_config


def _hma(work: Path) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorRole,
        SupportsHMA,
        supports_hma,
    )
    from vllm.v1.request import Request

    from kvstore.connectors.vllm import KVStoreConnector

    vllm_config, kv_cache_config = _configs(work)
    connector = KVStoreConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)

    def request(rid: str) -> Request:
        return Request(rid, list(range(3, 3 + BLOCK - 6)), SamplingParams(max_tokens=4), None)

    seen = request("seen")
    looked_up = connector.get_num_new_matched_tokens(seen, 0)
    finished = {
        "looked_up": list(looked_up),
        "blocks": list(connector.request_finished_all_groups(seen, ([5], [6]))),
        "no_blocks": list(connector.request_finished_all_groups(request("empty"), ())),
        "never_scheduled": list(
            connector.request_finished_all_groups(request("never"), ([1], [2]))
        ),
    }
    own = KVStoreConnector.request_finished_all_groups
    out = {
        "supports_hma_class": supports_hma(KVStoreConnector),
        "supports_hma_instance": supports_hma(connector),
        "factory_supports_hma": KVConnectorFactory.supports_hma_config(
            vllm_config.kv_transfer_config
        ),
        "overrides_request_finished_all_groups": own is not SupportsHMA.request_finished_all_groups,
        "serves": connector.geometry.describe(),
        "request_finished_all_groups": finished,
    }
    connector.shutdown()
    return out


def _hma_off() -> dict[str, Any]:
    """vLLM's grouping of a full-attention and a sliding-window layer with its hybrid KV
    cache manager off, and what kvstore serves of it."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

    from kvstore.connectors.vllm_geometry import EngineGeometry

    shape: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64}
    shape["dtype"] = torch.bfloat16
    specs = {
        "model.layers.0.self_attn.attn": SlidingWindowSpec(**shape, sliding_window=128),
        "model.layers.1.self_attn.attn": FullAttentionSpec(**shape),
    }
    off = SimpleNamespace(scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True))
    groups = get_kv_cache_groups(off, specs)  # type: ignore[arg-type]
    vllm_config, _ = _configs(Path("."))
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    return {
        "groups": [
            [g.layer_names, type(g.kv_cache_spec).__name__, g.kv_cache_spec.sliding_window]
            for g in groups
        ],
        "serves": EngineGeometry.from_vllm(vllm_config, config, None).describe(),
    }


def _not_stored() -> dict[str, str]:
    """What kvstore says of a full-attention group beside each kind it cannot store."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from kvstore.connectors.vllm_geometry import EngineGeometry

    shape: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64}
    shape["dtype"] = torch.bfloat16
    others = {
        "chunked_local": ChunkedLocalAttentionSpec(**shape, attention_chunk_size=64),
        "cross": CrossAttentionSpec(**shape),
        "mamba_none": MambaSpec(
            block_size=BLOCK, shapes=(CONV, SSM), dtypes=(torch.bfloat16, torch.float32)
        ),
    }
    vllm_config, _ = _configs(Path("."))
    out = {}
    for name, spec in others.items():
        groups = [KVCacheGroupSpec([ATTN], FullAttentionSpec(**shape))]
        groups.append(KVCacheGroupSpec(["model.layers.0.other"], spec))
        config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
        out[name] = EngineGeometry.from_vllm(vllm_config, config, None).describe()
    return out


def _probe(work: Path, layout_name: str) -> dict[str, Any]:
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    sys.path.insert(0, str(EXAMPLES))
    import vllm_probe

    _, config = _configs(work)
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout_name])
    spec = config.kv_cache_groups[1].kv_cache_spec
    layer = SimpleNamespace(
        get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes
    )
    MambaBase.bind_kv_cache(layer, caches[STATE])  # the layer's own state views
    gen = torch.Generator().manual_seed(0)
    attention = caches[ATTN]
    attention.copy_(torch.randn(attention.shape, generator=gen).to(attention.dtype))
    conv, ssm = layer.kv_cache
    conv.copy_(torch.randn(conv.shape, generator=gen).to(conv.dtype))
    ssm.copy_(torch.randn(ssm.shape, generator=gen))
    probe = vllm_probe.KVProbe(config)
    try:  # a layer whose states lie elsewhere than the spec's cut says
        probe.register(caches, {STATE: SimpleNamespace(kv_cache=(ssm, conv))})
        wrong_cut = "accepted"
    except RuntimeError as exc:
        wrong_cut = str(exc)
    probe.register(caches, {STATE: layer})
    # A prompt of two blocks: the attention group's block 2 then vLLM's null block (0),
    # the state group's null block then block 3.
    record = {"req": "r", "prompt_tokens": 2 * BLOCK, "first_computed": 0}
    blocks = [[2, 0], [0, 3]]
    out: dict[str, Any] = {
        "attention_shape": list(attention.shape),
        "state_shape": list(caches[STATE].shape),
        "attention_block_2": _sha([attention[2].view(torch.uint8)]),
        "state_block_3": _sha([conv[3].view(torch.uint8), ssm[3].view(torch.uint8)]),
        "groups": probe._hashes({**record, "blocks": blocks})["groups"],
        "wrong_cut": wrong_cut,
    }
    # The padding after block 3's states (its page's last bytes), then its SSM state.
    pages = caches[STATE].as_strided((config.num_blocks, PAGE), (PAGE, 1))
    pages[3, STATE_BYTES:] = 7
    after = probe._hashes({**record, "blocks": blocks})["groups"]["1"]["layers"][STATE][1]
    out["after_padding_changed"] = after
    ssm[3].add_(1.0)
    after = probe._hashes({**record, "blocks": blocks})["groups"]["1"]["layers"][STATE][1]
    out["after_ssm_changed"] = after
    return out


def _main(work: Path, out: Path) -> None:
    facts = _hma(work)
    facts["hma_off"] = _hma_off()
    facts["not_stored"] = _not_stored()
    facts["probe"] = {name: _probe(work, name) for name in ("LBHNC", "LBNHC")}
    out.write_text(json.dumps(facts))


if __name__ == "__main__":
    _main(Path(sys.argv[1]), Path(sys.argv[2]))
