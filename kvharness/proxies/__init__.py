"""Proxies in front of real servers: :mod:`.fault` (HTTP: 5xx, stalls, cut bodies),
:mod:`.corrupting` (TCP: bytes damaged in flight), :mod:`.throttle` (TCP: a slow link).
"""
