"""The ``python benchmarks/...`` and ``python examples/...`` commands the docs show, and a
parse-only run of each (for tests/unit/test_doc_commands.py).

Run as a script with a JSON list of commands (argv lists) on stdin, it runs each script as
``__main__`` with ``argparse``'s ``parse_args`` / ``parse_known_args`` replaced by one that
parses and then stops the script: the command line is checked by the script's own parser
(types, choices, ``type=`` validators) and nothing is measured. It prints one JSON object:
command -> "parsed" or the parser's error.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ("README.md", "docs/design.md", "docs/results.md", "examples/README.md")
_COMMAND = re.compile(r"(?:sudo )?python3? ((?:benchmarks|examples)/[A-Za-z0-9_]+\.py)((?: [^`|#\n]*)?)")


def _pieces(text: str) -> list[tuple[int, str]]:
    """(line, text) of each command-bearing piece: a fenced block's logical line (``\\``
    continuations joined) or an inline code span (which may wrap onto the next line)."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    i, fence = 0, False
    para: list[tuple[int, str]] = []

    def flush() -> None:
        joined = " ".join(t for _, t in para)
        for m in re.finditer(r"`([^`]+)`", joined):
            out.append((para[0][0], m.group(1)))
        para.clear()

    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            flush()
            fence = not fence
        elif fence:
            start = i
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            out.append((start + 1, line))
        elif line.strip():
            para.append((i + 1, line.strip()))
        else:
            flush()
        i += 1
    flush()
    return out


def doc_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of each documented command."""
    out = []
    for doc in DOCS:
        path = os.path.join(ROOT, doc)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            pieces = _pieces(f.read())
        for lineno, piece in pieces:
            for m in _COMMAND.finditer(piece):
                args = m.group(2).strip()
                if args.endswith("..."):  # (an elided command: its script is checked to exist only)
                    args = ""
                out.append((f"{doc}:{lineno}", [m.group(1)] + shlex.split(args)))
    return out


def uses_argparse(script: str) -> bool:
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        return bool(re.search(r"parse_(known_)?args\(", f.read()))


class _Parsed(Exception):
    pass


def parse_only(argv: list[str]) -> str:
    """"parsed", or what the script's parser said about ``argv``."""
    real = (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args)

    def stop(kind: int):
        def parse(self: argparse.ArgumentParser, *a: object, **k: object) -> None:
            real[kind](self, *a, **k)
            raise _Parsed()
        return parse

    err = io.StringIO()
    argparse.ArgumentParser.parse_args = stop(0)  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = stop(1)  # type: ignore[method-assign]
    old_argv = sys.argv
    sys.argv = [argv[0]] + argv[1:]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(os.path.join(ROOT, argv[0]), run_name="__main__")
        return "the script ran to its end without parsing its arguments"
    except _Parsed:
        return "parsed"
    except SystemExit as exc:
        return f"exit {exc.code}: {err.getvalue().strip()[-400:]}"
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = real  # type: ignore[method-assign]
        sys.argv = old_argv


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    commands = json.load(sys.stdin)
    print(json.dumps({shlex.join(c): parse_only(c) for c in commands}))
