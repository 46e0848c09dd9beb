"""The block format: what leaves process memory, self-describing and verified.

- :mod:`kvstore.format.header` -- the block header (``BlockHeader``, ``Codec``,
  ``parse_header``, ``read_header``, ``header_size``): its layout, the sealed variant,
  parsing and checks
- :mod:`kvstore.format.codec` -- encoding and decoding a block's payload (per-layer
  checksums, the built-in codecs, ``choose_codec``)
- :mod:`kvstore.format.encodings` -- the lossy encodings a tier's ``encoding:`` names
  (``fp8_e4m3``, ``int8``, ``int4``; ``BlockEncoding``), their kernels and measured
  decode cost
- :mod:`kvstore.format.codecs` -- ``CODECS``, the registry of the codecs a tier's
  ``codec:`` may name (``register_codec``; plug-ins numbered 16-255)
- :mod:`kvstore.format.sealing` -- encryption at rest: ``BlockCipher`` seals and opens
  each stored layer with AES-256-GCM
- :mod:`kvstore.format.keyring` -- tenants' keys as the sealing takes them

Code outside this package imports these names from here. Importing the package imports
none of its modules: each name is imported on first use (the codec needs torch and lz4,
the sealing ``cryptography``; a config naming a codec or a keyring needs neither).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.format.codec import (
        LZ4_CODEC,
        RAW_CODEC,
        SHUFFLE_LZ4_CODEC,
        EncodedBlock,
        checksum_pieces,
        choose_codec,
        decode_block,
        decode_into,
        decode_layer,
        encode_block,
        layer_pieces,
        verify_layers,
    )
    from kvstore.format.codecs import (
        AUTO,
        BUILT_IN,
        CODECS,
        FIRST_PLUGIN_NUMBER,
        LayerCodec,
        codec_names,
        codec_numbered,
        plugin_codec,
        register_codec,
    )
    from kvstore.format.encodings import (
        DEFAULT_GROUP_SIZE,
        ENCODING_NAMES,
        BlockEncoding,
        Encoding,
        check_group_size,
        decode_seconds_per_byte,
        encoding_names,
    )
    from kvstore.format.header import (
        ENCODED_VERSION,
        FLAG_SEALED,
        HEADER_ALIGN,
        KEY_ID_BYTES,
        MAGIC,
        NONCE_BYTES,
        SEALED_VERSION,
        SEALED_VERSIONS,
        TAG_BYTES,
        VERSION,
        BlockHeader,
        Codec,
        codec_number,
        header_size,
        parse_header,
        read_header,
    )
    from kvstore.format.keyring import Keyring, KeyringSource, TenantKeys
    from kvstore.format.sealing import (
        DEFAULT_NAMESPACE,
        DEFAULT_TENANT,
        BlockCipher,
        aead_module,
        open_into,
        seal,
        sealed_nbytes,
        tenant_of,
        use_tenant_resolver,
    )

__all__ = [
    "AUTO",
    "BUILT_IN",
    "BlockCipher",
    "BlockEncoding",
    "BlockHeader",
    "CODECS",
    "Codec",
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_NAMESPACE",
    "DEFAULT_TENANT",
    "ENCODED_VERSION",
    "ENCODING_NAMES",
    "EncodedBlock",
    "Encoding",
    "FIRST_PLUGIN_NUMBER",
    "FLAG_SEALED",
    "HEADER_ALIGN",
    "KEY_ID_BYTES",
    "Keyring",
    "KeyringSource",
    "LZ4_CODEC",
    "LayerCodec",
    "MAGIC",
    "NONCE_BYTES",
    "RAW_CODEC",
    "SEALED_VERSION",
    "SEALED_VERSIONS",
    "SHUFFLE_LZ4_CODEC",
    "TAG_BYTES",
    "TenantKeys",
    "VERSION",
    "aead_module",
    "check_group_size",
    "checksum_pieces",
    "choose_codec",
    "codec_names",
    "codec_number",
    "codec_numbered",
    "decode_block",
    "decode_into",
    "decode_layer",
    "decode_seconds_per_byte",
    "encode_block",
    "encoding_names",
    "header_size",
    "layer_pieces",
    "open_into",
    "parse_header",
    "plugin_codec",
    "read_header",
    "register_codec",
    "seal",
    "sealed_nbytes",
    "tenant_of",
    "use_tenant_resolver",
    "verify_layers",
]

_EXPORTS = {
    "AUTO": "kvstore.format.codecs",
    "BUILT_IN": "kvstore.format.codecs",
    "BlockCipher": "kvstore.format.sealing",
    "BlockEncoding": "kvstore.format.encodings",
    "BlockHeader": "kvstore.format.header",
    "CODECS": "kvstore.format.codecs",
    "Codec": "kvstore.format.header",
    "DEFAULT_GROUP_SIZE": "kvstore.format.encodings",
    "DEFAULT_NAMESPACE": "kvstore.format.sealing",
    "DEFAULT_TENANT": "kvstore.format.sealing",
    "ENCODED_VERSION": "kvstore.format.header",
    "ENCODING_NAMES": "kvstore.format.encodings",
    "EncodedBlock": "kvstore.format.codec",
    "Encoding": "kvstore.format.encodings",
    "FIRST_PLUGIN_NUMBER": "kvstore.format.codecs",
    "FLAG_SEALED": "kvstore.format.header",
    "HEADER_ALIGN": "kvstore.format.header",
    "KEY_ID_BYTES": "kvstore.format.header",
    "Keyring": "kvstore.format.keyring",
    "KeyringSource": "kvstore.format.keyring",
    "LZ4_CODEC": "kvstore.format.codec",
    "LayerCodec": "kvstore.format.codecs",
    "MAGIC": "kvstore.format.header",
    "NONCE_BYTES": "kvstore.format.header",
    "RAW_CODEC": "kvstore.format.codec",
    "SEALED_VERSION": "kvstore.format.header",
    "SEALED_VERSIONS": "kvstore.format.header",
    "SHUFFLE_LZ4_CODEC": "kvstore.format.codec",
    "TAG_BYTES": "kvstore.format.header",
    "TenantKeys": "kvstore.format.keyring",
    "VERSION": "kvstore.format.header",
    "aead_module": "kvstore.format.sealing",
    "check_group_size": "kvstore.format.encodings",
    "checksum_pieces": "kvstore.format.codec",
    "choose_codec": "kvstore.format.codec",
    "codec_names": "kvstore.format.codecs",
    "codec_number": "kvstore.format.header",
    "codec_numbered": "kvstore.format.codecs",
    "decode_block": "kvstore.format.codec",
    "decode_into": "kvstore.format.codec",
    "decode_layer": "kvstore.format.codec",
    "decode_seconds_per_byte": "kvstore.format.encodings",
    "encode_block": "kvstore.format.codec",
    "encoding_names": "kvstore.format.encodings",
    "header_size": "kvstore.format.header",
    "layer_pieces": "kvstore.format.codec",
    "open_into": "kvstore.format.sealing",
    "parse_header": "kvstore.format.header",
    "plugin_codec": "kvstore.format.codecs",
    "read_header": "kvstore.format.header",
    "register_codec": "kvstore.format.codecs",
    "seal": "kvstore.format.sealing",
    "sealed_nbytes": "kvstore.format.sealing",
    "tenant_of": "kvstore.format.sealing",
    "use_tenant_resolver": "kvstore.format.sealing",
    "verify_layers": "kvstore.format.codec",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
