"""Plug-ins: register tier kinds, eviction policies and codecs of your own, and see what
is registered.

Each kind of plug-in has one registry (:class:`~kvstore.runtime.registry.Registry`);
this module gathers their register functions and read-only views::

    from kvstore.plugins import register_codec, register_policy, register_tier

    register_tier("mem2", "mypkg.tiers:Mem2Tier", options=Mem2Config)   # tiers/base.py
    register_codec("zstd", "mypkg.codecs:ZSTD")                         # a LayerCodec

    @register_policy
    class MyPolicy(EvictionPolicy):                                     # policy/base.py
        name = "mine"

A target named as ``"package.module:Attr"`` is imported when a config first names it.
An installed package may declare its plug-ins in the entry-point groups ``kvstore.tiers``,
``kvstore.policies`` and ``kvstore.codecs`` instead; they are read the first time a
config names something not registered. docs/tiers.md has the whole story for tiers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstore.format import CODECS, register_codec
from kvstore.policy import POLICIES, register_policy
from kvstore.runtime import Entry
from kvstore.tiers import TIERS, register_tier, registered_kinds

__all__ = [
    "codecs",
    "policies",
    "register_codec",
    "register_policy",
    "register_tier",
    "registered_kinds",
    "tier_kinds",
]


def tier_kinds() -> Mapping[str, Entry[Any]]:
    """The registered tier kinds by name (each entry pairs the tier class, or its
    ``"module:Attr"`` until loaded, with its config class): a read-only, live view."""
    return TIERS.view


def policies() -> Mapping[str, Entry[Any]]:
    """The registered eviction policies by name: a read-only, live view."""
    return POLICIES.view


def codecs() -> Mapping[str, Entry[Any]]:
    """The registered codecs by name (the built-in ones among them): a read-only, live
    view."""
    return CODECS.view
