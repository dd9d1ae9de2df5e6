"""The collectives zeroshard issues, over an ordinary torch.distributed process group."""
from zeroshard.comm.process_group import Comm, Traffic, Work

__all__ = ["Comm", "Traffic", "Work"]
