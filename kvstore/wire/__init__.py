"""What kvstore-server and its clients share on the wire; imported by both, importing neither.

- :mod:`kvstore.wire.protocol` -- frames, ops, statuses and the encoding of their
  fields (docs/protocol.md); no I/O
- :mod:`kvstore.wire.blocks` -- a block on the wire: its header, its bytes, both
  ends' verification, and the server's cache of known headers
- :mod:`kvstore.wire.shm` -- shared memory between a server and same-host clients
- :mod:`kvstore.wire.auth` -- token authentication by challenge and response

Importing this package imports none of them.
"""
