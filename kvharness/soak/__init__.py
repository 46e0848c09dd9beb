"""The memory soak: :mod:`.run` (the soak and its samples), :mod:`.work` (the operations
and their checks), :mod:`.events` (the server's KV events and a subscriber's view).
"""
