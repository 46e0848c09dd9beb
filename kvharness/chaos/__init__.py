"""The cluster's chaos soak: :mod:`.run` (the soak), :mod:`.config` (what it runs),
:mod:`.cluster` (the processes), :mod:`.work` (the workload and its checks),
:mod:`.faults` (the fault driver), :mod:`.events` (the nodes' KV events and a view of them).
"""
