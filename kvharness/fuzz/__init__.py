"""The wire fuzzer of ``kvstore-server``: :mod:`.run` (the fuzzer), :mod:`.model` (the
protocol's ops and a connection's state), :mod:`.cases` and :mod:`.mutate` (valid frames
and their mutations), :mod:`.oracle` (what the server must answer).
"""
