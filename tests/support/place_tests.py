"""Puts test files left at the root of tests/ into their folder, and fixes what names them.

    python tests/support/place_tests.py            # move (git mv) and rewrite references
    python tests/support/place_tests.py --dry-run  # say what it would do

Re-runnable: branches written before the tree (issue 44, item 7) add ``tests/test_*.py`` and
helper modules at the root; after merging one, run this. It

- moves each root ``test_*.py`` to the folder (and name) in ``TESTS``; an unknown name goes by
  its prefix (``FOLDER_BY_PREFIX``), else to ``unit/``, and is reported so the table can grow;
- moves every other root module (workers, shared models, helpers) to ``support/`` (``SUPPORT``
  renames a few); ``conftest.py`` and ``__init__.py`` stay;
- rewrites, in every text file of the repository that can name a test, the old module names
  (``tests.models``, ``from tests import ckpt_worker``, ``from .test_io_helpers import``) and
  paths (``tests/test_api.py::...`` in tests/quick_tier.txt, ``"tests", "exit_worker.py"``);
- makes ``os.path.dirname(os.path.dirname(os.path.abspath(__file__)))`` one level deeper in the
  files it moved in this run (the repository root seen from one folder further down), and lists
  any other ``__file__`` use in them to check by hand.

Rewrites of names are idempotent (a new name never contains an old one), so running it again
over a merged tree only touches what still uses an old name.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS_DIR)
FOLDERS = ("unit", "dist", "offload", "checkpoint", "ops", "io", "train", "integrations")

# Root test file -> "folder" (same name) or "folder/new_name.py" (named by behaviour). Includes the
# files of branches not merged yet when this was written (agree, corners, front, kinds, int).
TESTS: dict[str, str] = {
    # single process: the public API, construction, configuration, planner, static checks
    "test_api.py": "unit",
    "test_bad_arguments.py": "unit",
    "test_engine_boundary.py": "unit",
    "test_edges_construction.py": "unit/test_construction_refusals.py",
    "test_conformance_causes.py": "unit/test_torch_optim_semantics.py",
    "test_planner.py": "unit",
    "test_structure.py": "unit",
    "test_stage3_local.py": "unit",
    "test_accumulation.py": "unit",
    "test_grad_buckets.py": "unit",
    "test_optim_corners.py": "unit",
    "test_ci_setup.py": "unit",
    "test_doc_commands.py": "unit",
    # several ranks: parity, stage 3, hpZ, tensor and pipeline parallelism, launchers
    "test_parity.py": "dist",
    "test_dropin.py": "dist",
    "test_stage3.py": "dist",
    "test_hpz.py": "dist",
    "test_tensor_parallel.py": "dist",
    "test_pipeline.py": "dist",
    "test_multinode.py": "dist",
    "test_whole_tensor.py": "dist",
    "test_clean_exit.py": "dist",
    "test_conformance_port.py": "dist/test_ported_peer_suites.py",
    "test_features.py": "dist/test_sharded_state_and_memory.py",
    "test_edges_interrupts.py": "dist/test_interrupted_steps.py",
    "test_exit_endings.py": "dist",
    "test_rank_agreement.py": "dist",
    # CPU and NVMe offload, placement, swap files
    "test_offload_auto.py": "offload",
    "test_offload_nvme.py": "offload",
    "test_offload_params_nvme.py": "offload",
    "test_auto_frozen.py": "offload",
    "test_nvme_torch_ops.py": "offload",
    "test_overlapped_step.py": "offload",
    "test_host_pool.py": "offload",
    "test_swap_alignment.py": "offload",
    "test_swap_damage.py": "offload",
    "test_policy_example.py": "offload/test_custom_placement_policy.py",
    "test_offload_auto_budget.py": "offload",
    # checkpoints
    "test_checkpoint_async.py": "checkpoint",
    "test_checkpoint_crash.py": "checkpoint",
    "test_checkpoint_damage.py": "checkpoint",
    "test_checkpoint_export.py": "checkpoint",
    "test_checkpoint_hostile.py": "checkpoint/test_hostile_checkpoints_every_consumer.py",
    "test_checkpoint_readpath.py": "checkpoint",
    "test_checkpoint_resume.py": "checkpoint",
    "test_checkpoint_roundtrip.py": "checkpoint",
    "test_checkpoint_sampler.py": "checkpoint",
    "test_old_checkpoints.py": "checkpoint",
    "test_edges_checkpoint.py": "checkpoint/test_frozen_base_checks_and_lean_saves.py",
    "test_edges_exports.py": "checkpoint/test_peft_exports.py",
    "test_convert_partitions.py": "checkpoint",
    "test_pipeline_groups.py": "checkpoint",
    "test_state_kinds.py": "checkpoint",
    "test_tied_export.py": "checkpoint",
    # kernels
    "test_ops_adam.py": "ops",
    "test_ops_build_progress.py": "ops",
    "test_ops_cuda.py": "ops",
    "test_ops_cuda_plan.py": "ops",
    "test_ops_fused_adam.py": "ops",
    "test_ops_loader.py": "ops",
    "test_sqnorm.py": "ops",
    "test_kernel_cache_key.py": "ops",
    # the I/O engine
    "test_io_cli.py": "io",
    "test_io_direct_gather.py": "io",
    "test_io_engine.py": "io",
    "test_io_errors.py": "io",
    # fine-tuning, the CLI, benchmarks' own code, the DeepSpeed front
    "test_finetune_deepspeed.py": "train",
    "test_finetune_e2e.py": "train",
    "test_finetune_units.py": "train",
    "test_edges_cli_messages.py": "train/test_finetune_cli_messages.py",
    "test_deepspeed_front.py": "train",
    "test_bench_memory.py": "train",
    "test_bench_step.py": "train",
    "test_planner_bench.py": "train/test_planner_matches_measurements.py",
    "test_deepspeed_scripts.py": "train",
    # other libraries driving a ZeroOptimizer
    "test_integrations.py": "integrations",
    "test_lora.py": "integrations",
    "test_trainer_resume.py": "integrations",
    "test_trainer_optimizer.py": "integrations",
}

# An unknown test file goes by the first prefix it has (checked in order), else to unit/.
FOLDER_BY_PREFIX: tuple[tuple[str, str], ...] = (
    ("test_checkpoint", "checkpoint"), ("test_ckpt", "checkpoint"), ("test_ops_", "ops"),
    ("test_io_", "io"), ("test_offload", "offload"), ("test_nvme", "offload"), ("test_swap", "offload"),
    ("test_placement", "offload"), ("test_finetune", "train"), ("test_bench", "train"),
    ("test_deepspeed", "train"), ("test_cli", "train"), ("test_stage3", "dist"), ("test_hpz", "dist"),
    ("test_tensor_parallel", "dist"), ("test_tp_", "dist"), ("test_pipeline", "dist"),
    ("test_multinode", "dist"), ("test_rank", "dist"), ("test_parity", "dist"), ("test_lora", "integrations"),
    ("test_hf_", "integrations"), ("test_peft", "integrations"), ("test_integration", "integrations"),
)

# Root helper modules renamed on their way to support/ (the others keep their name).
SUPPORT: dict[str, str] = {
    "test_io_helpers.py": "io_helpers.py",  # shared fixtures, no tests
    "edges_worker.py": "construction_worker.py",
    "edges_mesh_worker.py": "mesh_refusal_worker.py",
    "edges_interrupts_worker.py": "interrupted_steps_worker.py",
    "features_worker.py": "sharded_state_worker.py",
}
SUPPORT_DIRS = ("conformance", "fixtures")  # root folders that move to support/ whole
STAY = {"__init__.py", "conftest.py"}

DEEPER = ("os.path.dirname(os.path.dirname(os.path.abspath(__file__)))",
          "os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))")
# Where references to tests live: text files under these, plus the top-level files.
SCAN = ("tests", "docs", "benchmarks", "zeroshard", "examples", ".ci", "csrc")
SCAN_SUFFIXES = (".py", ".md", ".txt", ".sh", ".toml", ".cfg", ".ini", ".yml", ".yaml", ".h", ".cu", ".cpp")
SCAN_FILES = ("README.md", "setup.py", ".ci/run")


def test_destination(name: str) -> str:
    """``folder/file.py`` under tests/ for a root test file ``name``."""
    where = TESTS.get(name)
    if where is None:
        where = next((folder for prefix, folder in FOLDER_BY_PREFIX if name.startswith(prefix)), "unit")
    return where if where.endswith(".py") else f"{where}/{name}"


def renames() -> dict[str, str]:
    """Every old root path (relative to tests/, ``.py`` or folder) -> its new one: the tables, and
    whatever already sits in a folder under its own name (moved by an earlier run)."""
    table = {}
    for folder in FOLDERS + ("support",):
        for name in sorted(os.listdir(os.path.join(TESTS_DIR, folder))):
            if name.endswith(".py") and name not in STAY and name != os.path.basename(__file__):
                table[name] = f"{folder}/{name}"
    table.update({name: test_destination(name) for name in TESTS})
    table.update({name: f"support/{new}" for name, new in SUPPORT.items()})
    table.update({d: f"support/{d}" for d in SUPPORT_DIRS})
    return table


def planned_moves() -> dict[str, str]:
    """What is at the root of tests/ now and where it goes."""
    moves = {}
    for name in sorted(os.listdir(TESTS_DIR)):
        path = os.path.join(TESTS_DIR, name)
        if name in STAY:
            continue
        if os.path.isdir(path):
            if name in SUPPORT_DIRS:
                moves[name] = f"support/{name}"
            continue
        if not name.endswith(".py"):
            continue
        if name.startswith("test_") and name not in SUPPORT:
            moves[name] = test_destination(name)
        else:
            moves[name] = f"support/{SUPPORT.get(name, name)}"
    return moves


def _module(rel: str) -> str:
    return "tests." + rel[:-3].replace("/", ".") if rel.endswith(".py") else "tests." + rel.replace("/", ".")


def _rewrite(text: str, table: dict[str, str]) -> str:
    for old, new in table.items():
        old_mod, new_mod = _module(old), _module(new)
        old_leaf, new_leaf = old_mod.rsplit(".", 1)[1], new_mod.rsplit(".", 1)[1]
        new_pkg = new_mod.rsplit(".", 1)[0]
        # paths: tests/test_api.py, tests/conformance/ ; and os.path.join(..., "tests", "exit_worker.py")
        # (also after a "\n" escape inside a string: "...\ntests/test_api.py::x")
        text = re.sub(rf"(?:(?<![\w/.-])|(?<=\\n))tests/{re.escape(old)}(?![\w])", f"tests/{new}", text)
        parts = ", ".join(f'"{p}"' for p in new.split("/"))
        text = text.replace(f'"tests", "{old}"', f'"tests", {parts}')
        # dotted module names: tests.models, -m tests.hostile_consumers, tests.conformance.common
        text = re.sub(rf"(?<![\w.])tests\.{re.escape(old_leaf)}(?![\w])", new_mod, text)
        # from tests import a, b as c -> one line per package
        text = re.sub(rf"^(\s*)from tests import {re.escape(old_leaf)}\b( as \w+)?(?=\s*(#.*)?$)",
                      lambda m: f"{m.group(1)}from {new_pkg} import {new_leaf}"
                                + (m.group(2) or (f" as {old_leaf}" if new_leaf != old_leaf else "")),
                      text, flags=re.M)
        # relative imports between root modules: from .test_io_helpers import x
        text = re.sub(rf"^(\s*)from \.{re.escape(old_leaf)} import", rf"\1from {new_mod} import", text, flags=re.M)
    return _split_from_tests(text, table)


def _split_from_tests(text: str, table: dict[str, str]) -> str:
    """``from tests import a, b`` naming several moved modules: one import per new package."""
    leaves = {_module(o).rsplit(".", 1)[1]: _module(n) for o, n in table.items()}

    def split(m: re.Match) -> str:
        names = [n.strip() for n in m.group(2).split(",")]
        if len(names) < 2 or not all(n.split(" as ")[0] in leaves for n in names):
            return m.group(0)
        lines = []
        for n in names:
            leaf, _, alias = n.partition(" as ")
            pkg, new_leaf = leaves[leaf].rsplit(".", 1)
            alias = alias or (leaf if new_leaf != leaf else "")
            lines.append(f"{m.group(1)}from {pkg} import {new_leaf}" + (f" as {alias}" if alias else ""))
        return "\n".join(lines) + (m.group(3) or "")

    return re.sub(r"^(\s*)from tests import ([\w, ]+?)(\s*#.*)?$", split, text, flags=re.M)


def _scanned_files() -> list[str]:
    out = [os.path.join(REPO, f) for f in SCAN_FILES if os.path.isfile(os.path.join(REPO, f))]
    for top in SCAN:
        for root, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "fixtures", ".venv", "build")]
            out += [os.path.join(root, f) for f in files if f.endswith(SCAN_SUFFIXES)]
    return sorted(set(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the moves and rewrites, change nothing")
    args = parser.parse_args(argv)
    moves = planned_moves()
    for old, new in moves.items():
        guessed = old.startswith("test_") and old not in TESTS and old not in SUPPORT
        print(f"tests/{old} -> tests/{new}" + ("   (not in TESTS: placed by its name; add it)" if guessed else ""))
        if args.dry_run:
            continue
        dest = os.path.join(TESTS_DIR, new)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        for folder in {os.path.dirname(new), os.path.dirname(os.path.dirname(new))} - {""}:
            init = os.path.join(TESTS_DIR, folder, "__init__.py")
            if not os.path.exists(init) and os.path.isdir(os.path.join(TESTS_DIR, folder)):
                open(init, "w").close()
                subprocess.run(["git", "add", init], cwd=REPO, check=True)
        subprocess.run(["git", "mv", os.path.join(TESTS_DIR, old), dest], cwd=REPO, check=True)
    table = renames() | moves
    moved_files = {os.path.join(TESTS_DIR, new) for new in moves.values() if new.endswith(".py")}
    for path in _scanned_files():
        if path == os.path.abspath(__file__):
            continue
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
        new_text = _rewrite(text, table)
        if path in moved_files and not args.dry_run:
            new_text = new_text.replace(*DEEPER)
            if "__file__" in new_text.replace(DEEPER[1], ""):
                print(f"check by hand: {os.path.relpath(path, REPO)} uses __file__")
        if new_text != text:
            print(f"rewrote {os.path.relpath(path, REPO)}")
            if not args.dry_run:
                with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
                    f.write(new_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
