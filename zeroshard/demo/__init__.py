"""The README's first demo, ``python -m zeroshard.demo`` (``__main__``): stages 0-3 side by side,
then a checkpoint and a bit-identical resume (``stages_and_resume``). The fine-tuning demo
(preemption, auto-resume, export) is ``python -m zeroshard.train.demo``."""
