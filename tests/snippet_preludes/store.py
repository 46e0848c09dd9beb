# What the docs' fragments take as given: an open store and the keys of a stored prompt.
import atexit

import torch

from kvstore import KVLayout, KVStore

layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype=torch.float16)
store = KVStore(
    layout,
    {
        "tiers": [
            {"kind": "host", "capacity": "64MiB"},
            {"kind": "disk", "path": "kvcache", "capacity": "256MiB"},
        ]
    },
)
atexit.register(store.close)
token_ids = list(range(1000, 1096))  # six full chunks of 16
keys = store.hash_tokens(token_ids, namespace="toy-model@v1")
kv = torch.randn(layout.tensor_shape(len(keys)), dtype=layout.dtype)
store.put(keys, kv)
