"""The codec registry: how a block's layers may be stored, by name (``codec:`` in a tier's
config).

Built in: ``raw``, ``lz4`` and ``shuffle-lz4`` (:mod:`kvstore.format.codec`; a tier's
``codec: auto`` picks between ``shuffle-lz4`` and ``raw`` per block). A codec of your own
is a :class:`LayerCodec`, registered before the config is read::

    register_codec("zstd", "mypkg.codecs:ZSTD")    # or the LayerCodec itself

or declared by an installed package in the ``kvstore.codecs`` entry-point group (naming
the :class:`LayerCodec`, or a function that registers). Its ``number`` is written in every
block it stores, so a store reading such a block needs the codec too: without it the
block is a miss, never wrong data. Plug-in codecs apply to the disk tier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import ConfigError
from kvstore.runtime import Registry

if TYPE_CHECKING:  # numpy is there whenever a codec runs; naming one needs none
    import numpy as np

__all__ = [
    "AUTO",
    "BUILT_IN",
    "CODECS",
    "FIRST_PLUGIN_NUMBER",
    "LayerCodec",
    "codec_names",
    "codec_numbered",
    "plugin_codec",
    "register_codec",
]

#: The codec numbers below this one are kvstore's own.
FIRST_PLUGIN_NUMBER = 16
#: ``codec: auto``: shuffle-lz4 for a block where it saves at least 10%, else raw.
AUTO = "auto"


@dataclass(frozen=True)
class LayerCodec:
    """A way to store one layer's bytes.

    ``number``: the byte in each block's header that says the codec (16-255 for plug-ins;
    0-15 are kvstore's). ``compress(layer, itemsize)``: the stored bytes of ``layer`` (a
    contiguous uint8 numpy array of one layer; ``itemsize``: bytes per element).
    ``decompress(stored, raw_nbytes, itemsize)``: the layer's uint8 array back (any other
    size is a corrupt block); raise any exception for stored bytes it cannot read.
    """

    number: int
    compress: Callable[[np.ndarray, int], bytes]
    decompress: Callable[[bytes, int, int], np.ndarray]


def _is_codec(obj: object) -> bool:
    return isinstance(obj, LayerCodec)


def _check_name(name: str) -> None:
    if name != name.lower() or name == AUTO or not name.replace("-", "").isalnum():
        raise ConfigError(
            f"codec {name!r}: use lowercase letters, digits and '-' ('auto' is taken)"
        )


#: The codecs by name: the built-in ones, those registered, and (once a config names one
#: not registered) those installed packages declare in ``kvstore.codecs`` entry points.
CODECS: Registry[LayerCodec] = Registry("codec", "kvstore.codecs", _is_codec, _check_name)
CODECS.register("raw", "kvstore.format.codec:RAW_CODEC")
CODECS.register("lz4", "kvstore.format.codec:LZ4_CODEC")
CODECS.register("shuffle-lz4", "kvstore.format.codec:SHUFFLE_LZ4_CODEC")


def register_codec(
    name: str, target: LayerCodec | str, install_hint: str = "", *, clobber: bool = False
) -> None:
    """Register codec ``name`` as a :class:`LayerCodec` or ``"package.module:ATTR"``
    (imported when a config first names it; ``install_hint``: what the error says when
    that import fails), so a tier's ``codec:`` may name it. A name registered already
    raises :class:`ConfigError` unless ``clobber=True``."""
    CODECS.register(name, target, install_hint=install_hint, clobber=clobber)


#: kvstore's own codecs, in the order the docs list them.
BUILT_IN = ("raw", "lz4", "shuffle-lz4")


def codec_names() -> list[str]:
    """What a tier's ``codec:`` may say: the built-in codecs, those registered, ``auto``."""
    return [*BUILT_IN, *(name for name in CODECS.names() if name not in BUILT_IN), AUTO]


def plugin_codec(name: str) -> LayerCodec:
    """The registered codec ``name``, checked to be a plug-in's (numbered 16-255, no
    other codec numbered alike); :class:`ConfigError` otherwise."""
    codec = CODECS.load(name)
    if not FIRST_PLUGIN_NUMBER <= codec.number <= 255:
        raise ConfigError(
            f"codec {name!r}: number {codec.number} is not in {FIRST_PLUGIN_NUMBER}..255"
        )
    for other, entry in CODECS.view.items():
        if other != name and entry.loaded and entry.target.number == codec.number:  # type: ignore[union-attr]
            raise ConfigError(f"codecs {name!r} and {other!r} both have number {codec.number}")
    return codec


def codec_numbered(number: int) -> LayerCodec | None:
    """The plug-in codec whose ``number`` is this (installed plug-ins read first), or None."""
    for attempt in range(2):
        for name in CODECS.names():
            try:
                codec = CODECS.load(name)
            except ConfigError:  # a codec whose dependency is missing reads nothing
                continue
            if codec.number == number and number >= FIRST_PLUGIN_NUMBER:
                return codec
        if attempt == 0:
            try:
                CODECS.load_plugins()
            except ConfigError:  # a broken plug-in: the block stays unreadable, a miss
                return None
    return None
