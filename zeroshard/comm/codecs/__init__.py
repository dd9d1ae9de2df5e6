"""Codecs for collectives (ZeRO++ qwZ / qgZ): Notes [codec error bounds] (formats.py),
[quantized collectives] (coded.py), [gradient error feedback] (link_codecs.py)."""
from zeroshard.comm.codecs.codec_formats import CODEC_NAMES, Codec, make_codec
from zeroshard.comm.codecs.link_codecs import LinkCodecs
from zeroshard.comm.codecs.codec_options import CollectiveCodecs

__all__ = ["CODEC_NAMES", "Codec", "CollectiveCodecs", "LinkCodecs", "make_codec"]
