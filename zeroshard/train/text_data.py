"""A local text corpus as fixed-length token blocks for causal-LM fine-tuning.

Input: a ``.txt`` file (one document; blank lines are kept) or JSON Lines (``.jsonl``,
``.json`` with one object per line; the ``text_field`` of each). Documents are tokenised with
the model's tokenizer when its directory has one, else with ``ByteTokenizer`` (UTF-8 bytes
as ids 0-255), joined with the end-of-sequence id, and cut into blocks of ``seq_len``
tokens (the tail shorter than a block is dropped). Blocks are what the sampler shuffles.

Tokenising is done once: rank 0 writes the blocks to a cache file keyed by the input's
path, size, mtime, the tokenizer and ``seq_len``, the other ranks wait and read it (a
restarted run reads it too).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class ByteTokenizer:
    """UTF-8 bytes as token ids: works with any model whose vocabulary has >= 256 entries."""

    name = "bytes"

    def __init__(self, eos_token_id: Optional[int] = None) -> None:
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def has_tokenizer(model_dir: Optional[str]) -> bool:
    return bool(model_dir) and any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES)


def load_tokenizer(model_dir: Optional[str], vocab_size: int, eos_token_id: Optional[int]) -> Any:
    """The model's tokenizer if ``model_dir`` has one, else ``ByteTokenizer``."""
    if has_tokenizer(model_dir):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model_dir)
    if vocab_size < 256:
        raise ValueError(f"the model has no tokenizer and vocab_size={vocab_size} < 256, so the byte-level "
                         "fallback cannot encode text; add tokenizer files to the model directory or use a "
                         "vocabulary of at least 256 tokens")
    eos = eos_token_id if eos_token_id is not None and eos_token_id < vocab_size else None
    return ByteTokenizer(eos)


def read_documents(path: str, text_field: str = "text") -> Iterator[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path!r} does not exist; give a .txt or .jsonl file")
    if path.endswith((".jsonl", ".json", ".ndjson")):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n} is not a JSON object ({exc}); JSON Lines need one per line") from exc
                if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                    raise ValueError(f"{path}:{n} has no string field {text_field!r} (it has {keys}); "
                                     "choose the field with --text-field")
                yield obj[text_field]
    else:
        with open(path, encoding="utf-8") as f:
            yield f.read()


def tokenize_blocks(path: str, encode: Callable[[str], list[int]], eos: Optional[int], seq_len: int,
                    text_field: str = "text") -> np.ndarray:
    ids: list[int] = []
    for doc in read_documents(path, text_field):
        ids.extend(encode(doc))
        if eos is not None:
            ids.append(eos)
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"{path} gives {len(ids)} tokens, fewer than one block of --seq-len {seq_len}; "
                         "use more text or a shorter --seq-len")
    return np.asarray(ids[:n * seq_len], dtype=np.int64).reshape(n, seq_len)


def _cache_key(path: str, tokenizer: Any, seq_len: int, text_field: str) -> str:
    st = os.stat(path)
    who = getattr(tokenizer, "name_or_path", None) or getattr(tokenizer, "name", type(tokenizer).__name__)
    raw = json.dumps([os.path.abspath(path), st.st_size, st.st_mtime_ns, str(who),
                      getattr(tokenizer, "vocab_size", None), seq_len, text_field])
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def load_blocks(path: str, tokenizer: Any, seq_len: int, cache_dir: str, text_field: str = "text") -> torch.Tensor:
    """``[n_blocks, seq_len]`` int64 token ids, the same on every rank (see module docstring)."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2 (a causal LM predicts the next token)")
    os.makedirs(cache_dir, exist_ok=True)
    cache = os.path.join(cache_dir, f"blocks-{_cache_key(path, tokenizer, seq_len, text_field)}.npy")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    error = None
    if rank == 0 and not os.path.isfile(cache):
        try:
            encode = tokenizer.encode if isinstance(tokenizer, ByteTokenizer) else \
                (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
            blocks = tokenize_blocks(path, encode, tokenizer.eos_token_id, seq_len, text_field)
            tmp = f"{cache}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                np.save(f, blocks, allow_pickle=False)
            os.replace(tmp, cache)
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    if distributed:  # the other ranks wait for the cache, and learn about rank 0's error
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ValueError(f"preparing {path} failed on rank 0: {error}")
    return torch.from_numpy(np.load(cache, allow_pickle=False))
