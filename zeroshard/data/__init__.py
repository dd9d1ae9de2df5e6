"""Data position that survives a restart (see ``ResumableSampler``)."""
from zeroshard.data.sampler import ResumableSampler

__all__ = ["ResumableSampler"]
