"""What kvstore-server and its clients share on the wire; imported by both, importing neither.

- :mod:`kvstore.wire.protocol` -- frames, ops, statuses and the encoding of their
  fields (docs/protocol.md); no I/O
- :mod:`kvstore.wire.blocks` -- a block on the wire: its header, its bytes, both
  ends' verification, and the server's cache of known headers
- :mod:`kvstore.wire.shm` -- shared memory between a server and same-host clients
- :mod:`kvstore.wire.auth` -- token authentication by challenge and response

Code outside this package imports their names from here (``Mapping`` is a shared-memory
mapping: importers name it ``ShmMapping``). Importing this package imports none of
them; each name is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.wire.auth import NONCE_BYTES, Authenticator, answer, new_nonce
    from kvstore.wire.blocks import (
        HeaderCache,
        encode_span,
        pieces_of,
        read_header,
        verify_span,
        wire_nbytes,
    )
    from kvstore.wire.protocol import (
        FRAME,
        MAGIC,
        MAX_JSON_META,
        VERSION,
        Flag,
        Frame,
        Op,
        SlotStatus,
        Status,
        decode_commit_request,
        decode_count,
        decode_get_reply,
        decode_get_request,
        decode_hint_request,
        decode_json,
        decode_keys,
        decode_put_reply,
        decode_reserve_reply,
        decode_tokens,
        decode_u64,
        encode_commit_request,
        encode_count,
        encode_get_reply,
        encode_get_request,
        encode_hint_request,
        encode_json,
        encode_keys,
        encode_put_reply,
        encode_reserve_reply,
        encode_tokens,
        encode_u64,
    )
    from kvstore.wire.shm import Mapping, attach, boot_id, describe_segment, receive_fd

__all__ = [
    "Authenticator",
    "FRAME",
    "Flag",
    "Frame",
    "HeaderCache",
    "MAGIC",
    "MAX_JSON_META",
    "Mapping",
    "NONCE_BYTES",
    "Op",
    "SlotStatus",
    "Status",
    "VERSION",
    "answer",
    "attach",
    "boot_id",
    "decode_commit_request",
    "decode_count",
    "decode_get_reply",
    "decode_get_request",
    "decode_hint_request",
    "decode_json",
    "decode_keys",
    "decode_put_reply",
    "decode_reserve_reply",
    "decode_tokens",
    "decode_u64",
    "describe_segment",
    "encode_commit_request",
    "encode_count",
    "encode_get_reply",
    "encode_get_request",
    "encode_hint_request",
    "encode_json",
    "encode_keys",
    "encode_put_reply",
    "encode_reserve_reply",
    "encode_span",
    "encode_tokens",
    "encode_u64",
    "new_nonce",
    "pieces_of",
    "read_header",
    "receive_fd",
    "verify_span",
    "wire_nbytes",
]

_EXPORTS = {
    "Authenticator": "kvstore.wire.auth",
    "FRAME": "kvstore.wire.protocol",
    "Flag": "kvstore.wire.protocol",
    "Frame": "kvstore.wire.protocol",
    "HeaderCache": "kvstore.wire.blocks",
    "MAGIC": "kvstore.wire.protocol",
    "MAX_JSON_META": "kvstore.wire.protocol",
    "Mapping": "kvstore.wire.shm",
    "NONCE_BYTES": "kvstore.wire.auth",
    "Op": "kvstore.wire.protocol",
    "SlotStatus": "kvstore.wire.protocol",
    "Status": "kvstore.wire.protocol",
    "VERSION": "kvstore.wire.protocol",
    "answer": "kvstore.wire.auth",
    "attach": "kvstore.wire.shm",
    "boot_id": "kvstore.wire.shm",
    "decode_commit_request": "kvstore.wire.protocol",
    "decode_count": "kvstore.wire.protocol",
    "decode_get_reply": "kvstore.wire.protocol",
    "decode_get_request": "kvstore.wire.protocol",
    "decode_hint_request": "kvstore.wire.protocol",
    "decode_json": "kvstore.wire.protocol",
    "decode_keys": "kvstore.wire.protocol",
    "decode_put_reply": "kvstore.wire.protocol",
    "decode_reserve_reply": "kvstore.wire.protocol",
    "decode_tokens": "kvstore.wire.protocol",
    "decode_u64": "kvstore.wire.protocol",
    "describe_segment": "kvstore.wire.shm",
    "encode_commit_request": "kvstore.wire.protocol",
    "encode_count": "kvstore.wire.protocol",
    "encode_get_reply": "kvstore.wire.protocol",
    "encode_get_request": "kvstore.wire.protocol",
    "encode_hint_request": "kvstore.wire.protocol",
    "encode_json": "kvstore.wire.protocol",
    "encode_keys": "kvstore.wire.protocol",
    "encode_put_reply": "kvstore.wire.protocol",
    "encode_reserve_reply": "kvstore.wire.protocol",
    "encode_span": "kvstore.wire.blocks",
    "encode_tokens": "kvstore.wire.protocol",
    "encode_u64": "kvstore.wire.protocol",
    "new_nonce": "kvstore.wire.auth",
    "pieces_of": "kvstore.wire.blocks",
    "read_header": "kvstore.wire.blocks",
    "receive_fd": "kvstore.wire.shm",
    "verify_span": "kvstore.wire.blocks",
    "wire_nbytes": "kvstore.wire.blocks",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
