"""``python -m zeroshard.demo``: the code lives in ``stages_and_resume`` (a module the spawned
ranks can import their functions from; this one runs as ``__main__``)."""
from zeroshard.demo.stages_and_resume import main

main()
