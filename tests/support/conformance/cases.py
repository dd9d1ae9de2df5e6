"""Issue 12: the peers' own test suites, ported onto zeroshard's API (written anew, not copied).

Each case names its original: ``torch:`` PyTorch's test/test_optim.py (TestOptimRenewed over
optim_db), ``zero:`` test/distributed/optim/test_zero_redundancy_optimizer.py, ``ds:``
DeepSpeed's tests/unit/runtime/zero and tests/unit/checkpoint. A case runs on every rank
of a gloo group (or alone at world 1) and raises on a mismatch; ``run`` writes each rank's
verdicts. ``NOT_APPLICABLE`` lists the originals left out and why.
"""
from __future__ import annotations

import json
import traceback

import torch.distributed as dist

from tests.support.conformance import ds_cases, torch_cases, zero_cases  # noqa: F401 - they register the cases
from tests.support.conformance.common import CASES

# Known open (issue 12, left to the lead's stage-3 representation change): stage 3 takes the
# module, not param groups, so the case above fails with that refusal.
KNOWN_FAILING: dict[str, str] = {}

NOT_APPLICABLE = {
    "torch: test_forloop_goes_right_direction_multigpu / test_mixed_device_dtype / *_cuda*":
        "CUDA and multi-device parameters; this port runs on CPU (one device per optimizer)",
    "torch: test_fused_* / test_foreach_* / test_capturable_* / test_cpu_load_state_dict":
        "implementation choices of torch's kernels; zeroshard keeps the user's flags on the inner optimizer",
    "torch: test_rosenbrock_sparse / SparseAdam / sparse gradients":
        "sparse gradients are refused with a clear error (flat dense buffers)",
    "torch: LBFGS configurations":
        "couples every parameter through its closure: refused by design (zeroshard/units/elementwise.py); "
        "Adafactor and Muon take the whole-tensor path instead (tests/dist/test_whole_tensor.py)",
    "torch: test_differentiable_* / test_step_is_differentiable":
        "differentiable optimizers need autograd through the step; ZeRO's step is a no_grad collective",
    "torch: test_deepcopy_copies_all_public_attrs (attribute equality)":
        "a deep copy is refused (the port checks the refusal instead)",
    "zero: test_ddp_zero_overlap / overlap_with_ddp":
        "a DDP communication-hook API; zeroshard reduces in its own hooks",
    "zero: test_zero_model_parallel / test_zero_join / parameters_as_bucket_view":
        "ZeroRedundancyOptimizer-specific APIs (Join, model-parallel groups, bucket views)",
    "ds: TestZero3ParamPartitioningBase (ds_tensor, ds_status) / zero.Init / GatheredParameters":
        "DeepSpeed's parameter attributes and contexts; zeroshard's stage 3 is covered by tests/dist/test_stage3.py",
    "ds: test_checkpoint_moe / pipeline / sparse_attention":
        "MoE, pipeline parallelism and sparse attention are not zeroshard features",
    "ds: safe_set_full_fp32_param / safe_set_full_optimizer_state":
        "writes through the per-parameter view are refused (documented); load_state_dict changes state",
}


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    results = {}
    for name in names:
        origin, worlds, fn = CASES[name]
        if world not in worlds:
            continue
        try:
            fn(rank, world)
            results[name] = "pass"
        except Exception:  # noqa: BLE001 - a verdict per case; the traceback is the detail
            results[name] = "fail: " + traceback.format_exc()[-1500:]
        if dist.is_initialized():
            dist.barrier()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)
