"""Training inside the Hugging Face Trainer, Accelerate and Lightning with a ZeroOptimizer.

One module per library; each imports its library only when it is imported itself, so
zeroshard works without any of them installed:

- ``zeroshard.integrations.transformers.ZeroCallback``: ``Trainer(..., callbacks=[ZeroCallback()])``;
- ``zeroshard.integrations.accelerate.attach(accelerator, optimizer)``: before ``prepare``;
- ``zeroshard.integrations.lightning.ZeroStrategy``: ``lightning.Trainer(strategy=ZeroStrategy())``;
- ``zeroshard.integrations.peft_export``: ``save_adapter`` (PEFT's format) and ``export_merged``
  (the merged model for ``from_pretrained``) of a PEFT model (``zeroshard.save_adapter``...).

What they share (complete checkpoints from libraries that write on rank 0): ``_common.py``,
Note [rank-0 saves].
"""
