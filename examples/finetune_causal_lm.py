"""Fine-tune a Hugging Face causal LM with zeroshard, launched with torchrun.

    # a model from a local directory (config.json + *.safetensors, tokenizer optional)
    torchrun --nproc-per-node 2 examples/finetune_causal_lm.py \\
        --model ./my-model --data corpus.jsonl --output-dir runs/ft \\
        --stage 2 --bf16 --micro-batch-size 4 --grad-accum 8 --lr 2e-5 --warmup-steps 100 \\
        --max-steps 2000 --save-interval 200 --keep-last 3

    # or a model built from a config (random init; what the tests and the demo use)
    torchrun --nproc-per-node 2 examples/finetune_causal_lm.py \\
        --model-config tiny/config.json --data corpus.txt --output-dir runs/tiny --max-steps 50

    # or bring a DeepSpeed config (flags given explicitly override it)
    torchrun --nproc-per-node 2 examples/finetune_causal_lm.py --deepspeed examples/ds_config.json ...

Resuming needs no flag: run the same command again and it continues from the newest valid
checkpoint in --output-dir/checkpoints. SIGTERM or SIGUSR1 (spot reclaim, scheduler
preemption) saves at the next step boundary on every rank and exits 0; with
``torchrun --max-restarts 3`` a crashed rank makes torchrun restart the job, which resumes.
A rank that dies makes the others exit (status 3) within --collective-timeout seconds.

Progress: a bar on rank 0 (a line per --log-interval steps when not on a terminal), logs in
--output-dir/logs/ (rank-NNNNN.log, metrics.jsonl, summary.json), and a final summary line.
At the end the weights are exported to --output-dir/hf (or --export-dir) in the Hugging Face
layout: ``AutoModelForCausalLM.from_pretrained(that_dir)``.

All options: ``python examples/finetune_causal_lm.py --help``. The pieces (DeepSpeed-config
translation, schedules, preemption, the loop) live in ``zeroshard/train/`` for your own loops.
"""
import faulthandler

from zeroshard.train.failures import end_process
from zeroshard.train.finetune import main

if __name__ == "__main__":
    faulthandler.enable()  # a native crash prints every thread's Python stack
    end_process(main())  # exits without interpreter teardown: see Note [teardown]
