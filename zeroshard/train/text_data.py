"""A local text corpus as fixed-length token blocks for causal-LM fine-tuning.

Input: a ``.txt`` file (one document; blank lines are kept), JSON Lines (``.jsonl``,
``.json`` with one object per line; the ``text_field`` of each) or a ``.json`` file holding
one array of such objects. Documents are tokenised with
the model's tokenizer when its directory has one, else with ``ByteTokenizer`` (UTF-8 bytes
as ids 0-255), joined with the end-of-sequence id, and cut into blocks of ``seq_len``
tokens (the tail shorter than a block is dropped). Blocks are what the sampler shuffles.

Token ids are int32 (every vocabulary fits; half the memory of int64); the loss function
widens a batch to int64. Tokenising is done once: rank 0 writes the blocks to a cache file keyed by the input's
path, size, mtime, the tokenizer and ``seq_len``, the other ranks wait and read it (a
restarted run reads it too).
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from zeroshard.train.finetune_config import JSON_SUFFIXES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class ByteTokenizer:
    """UTF-8 bytes as token ids: works with any model whose vocabulary has >= 256 entries."""

    name = "bytes"

    def __init__(self, eos_token_id: Optional[int] = None) -> None:
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def has_tokenizer(model_dir: Optional[str]) -> bool:
    if not model_dir:
        return False
    return any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES)


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


PIECE_CHARS = 1 << 20
"""Text is tokenised in pieces of about this many characters (memory stays a few pieces, not
the file: a 64 MiB line as a Python list of ints would take about 2 GB)."""


def _cut(text: str, final: bool) -> int:
    """Where to end the piece of ``text`` sent now: before the last whitespace of a long text
    (a word-level tokenizer sees whole words, and GPT-2's keeps the space with the word after
    it), all of it when ``final``."""
    if final or len(text) <= PIECE_CHARS:
        return len(text) if final else 0
    cut = max(text.rfind(" ", 0, PIECE_CHARS), text.rfind("\n", 0, PIECE_CHARS))
    return cut if cut > 0 else PIECE_CHARS


def _pieces(chunks: Iterator[str]) -> Iterator[str]:
    """Re-cuts a stream of text chunks into pieces ending before whitespace (see ``_cut``)."""
    carry = ""
    for chunk in chunks:
        carry += chunk
        while True:
            n = _cut(carry, final=False)
            if n == 0:
                break
            yield carry[:n]
            carry = carry[n:]
    if carry:
        yield carry


def _data_file(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"--data {path!r} does not exist; give a .txt or .jsonl file")
    if not os.path.isfile(path):  # a directory, FIFO or device would hang or fail deep inside
        raise ValueError(f"--data {path!r} is not a regular file; give a .txt or .jsonl file")


MAX_JSON_ARRAY_BYTES = 256 << 20
"""A ``.json`` file holding one JSON array of documents is parsed whole (about ten times its
size in memory); larger ones must be JSON Lines, which are read a line at a time."""


def _json_kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _document_text(obj: Any, text_field: str, where: str) -> str:
    """The text of one JSON document; an error names the field looked for, the fields there
    and the flag that chooses another."""
    if isinstance(obj, dict) and isinstance(obj.get(text_field), str):
        return obj[text_field]
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is a JSON {_json_kind(obj)}, not an object with a string field {text_field!r}; "
                         "each document is an object such as {\"text\": \"...\"} (--text-field names the field)")
    found = "it is missing" if text_field not in obj else f"it is {_json_kind(obj[text_field])}, not a string"
    fields = sorted(obj)[:20]
    raise ValueError(f"{where} has no string field {text_field!r} ({found}; its fields: {fields}); choose the field "
                     "with --text-field NAME")


def _is_json_array(path: str) -> bool:
    if not path.endswith(".json"):
        return False
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def _array_documents(path: str, text_field: str) -> Iterator[Iterator[str]]:
    size = os.path.getsize(path)
    if size > MAX_JSON_ARRAY_BYTES:
        raise ValueError(f"--data {path!r} is one JSON array of {size >> 20} MiB; above "
                         f"{MAX_JSON_ARRAY_BYTES >> 20} MiB give JSON Lines (.jsonl, one object per line), e.g. "
                         f"jq -c '.[]' {path} > data.jsonl")
    with open(path, encoding="utf-8") as f:
        try:
            docs = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--data {path!r} starts a JSON array but is not valid JSON ({exc})") from None
        except RecursionError:
            raise ValueError(f"--data {path!r} nests too deeply to be a list of documents") from None
    for n, obj in enumerate(docs):
        text = _document_text(obj, text_field, f"{path}[{n}]")
        yield _pieces(text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS))


def read_documents(path: str, text_field: str = "text") -> Iterator[Iterator[str]]:
    """The documents of ``path``, each as an iterator of text pieces (see ``PIECE_CHARS``)."""
    _data_file(path)
    try:
        if _is_json_array(path):
            yield from _array_documents(path, text_field)
        elif path.endswith(JSON_SUFFIXES):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{n} is not a JSON object ({exc}); JSON Lines need one per "
                                         "line") from None
                    except RecursionError:
                        raise ValueError(f"{path}:{n} nests too deeply to be a document; JSON Lines hold one "
                                         "object with a text field per line") from None
                    text = _document_text(obj, text_field, f"{path}:{n}")
                    del obj, line
                    yield _pieces(text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS))
        else:
            with open(path, encoding="utf-8") as f:
                yield _pieces(_chunks(f, path))
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, exc) from None


def _not_utf8(path: str, exc: UnicodeDecodeError) -> ValueError:
    return ValueError(f"--data {path!r} is not UTF-8 text ({exc.reason}); give a .txt or .jsonl file")


def _chunks(f: Any, path: str) -> Iterator[str]:
    """A text file in chunks of PIECE_CHARS characters (read as the consumer asks for them)."""
    while True:
        try:
            chunk = f.read(PIECE_CHARS)
        except UnicodeDecodeError as exc:
            raise _not_utf8(path, exc) from None
        if not chunk:
            return
        yield chunk


def tokenize_blocks(path: str, encode: Callable[[str], Any], eos: Optional[int], seq_len: int,
                    text_field: str = "text") -> np.ndarray:
    """``[n, seq_len]`` int32 token ids; the tokens are kept as int32 arrays piece by piece."""
    parts: collections.deque[np.ndarray] = collections.deque()
    total = 0
    eos_part = np.asarray([eos], dtype=np.int32) if eos is not None else None
    for doc in read_documents(path, text_field):
        for piece in doc:
            ids = encode(piece)  # (the byte tokenizer's uint8 arrays stay a byte per token until copied)
            ids = ids if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu" else np.asarray(ids, dtype=np.int32)
            parts.append(ids)
            total += ids.size
        if eos_part is not None:
            parts.append(eos_part)
            total += 1
    n = total // seq_len
    if n == 0:
        raise ValueError(f"{path} gives {total} tokens, fewer than one block of --seq-len {seq_len}; "
                         "use more text or a shorter --seq-len")
    out = np.empty(n * seq_len, dtype=np.int32)
    pos = 0
    while parts and pos < out.size:  # filled piece by piece, each freed once copied
        ids = parts.popleft()[:out.size - pos]
        out[pos:pos + ids.size] = ids
        pos += ids.size
    return out.reshape(n, seq_len)


def _cache_key(path: str, tokenizer: Any, seq_len: int, text_field: str) -> str:
    st = os.stat(path)
    who = getattr(tokenizer, "name_or_path", None) or getattr(tokenizer, "name", type(tokenizer).__name__)
    raw = json.dumps([os.path.abspath(path), st.st_size, st.st_mtime_ns, str(who),
                      getattr(tokenizer, "vocab_size", None), seq_len, text_field])
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def load_blocks(path: str, tokenizer: Any, seq_len: int, cache_dir: str, text_field: str = "text") -> torch.Tensor:
    """``[n_blocks, seq_len]`` int32 token ids, the same on every rank (see module docstring)."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2 (a causal LM predicts the next token)")
    _data_file(path)
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
            del blocks  # read back below: never two copies at once
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    if distributed:  # the other ranks wait for the cache, and learn about rank 0's error
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ValueError(f"preparing {path} failed on rank 0: {error}")
    return torch.from_numpy(np.load(cache, allow_pickle=False))
