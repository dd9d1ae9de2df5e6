"""``zeroshard bench``: memory by category next to the ZeRO formulas (``memory``), and step
time and memory against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed (``step``)."""
