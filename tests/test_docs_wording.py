"""The documentation describes the product: README.md, docs/*.md and the
package's docstrings carry no diary of the work that made it - no numbered
work periods, no issue numbers, no account of which machine was or was not
available.  (Dates, commands, devices and result paths are facts and stay.)"""
import ast
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DIARY = {
    "a work period": re.compile(r"\b(?:work(?:ing)?[- ]periods?|sessions?)\b", re.I),
    "an issue number": re.compile(r"\bissues?\s+(?:no\.?\s*)?#?\d+\b(?![.,]\d)"
                                  r"|(?<![\w&/#])#\d+\b", re.I),
    "machine availability": re.compile(
        r"\b(?:was|were|wasn't|weren't)\s+(?:not\s+|un)?(?:available|lent)\b"
        r"|\bnot\s+lent\b|\bstatus\s+(?:listed|said|showed)\b", re.I),
}


def _documents():
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs",
                                                                                 "*.md"))):
        yield os.path.relpath(path, ROOT), open(path, encoding="utf-8").read()


def _docstrings():
    for path in sorted(glob.glob(os.path.join(ROOT, "dynamiq_mpi", "**", "*.py"),
                                 recursive=True)):
        tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    name = getattr(node, "name", "module docstring")
                    yield f"{os.path.relpath(path, ROOT)} ({name})", doc


def diary_hits(text: str) -> list:
    """(kind, the words around it) for every diary phrase in ``text``."""
    hits = []
    for kind, pattern in DIARY.items():
        for m in pattern.finditer(text):
            hits.append((kind, " ".join(text[max(0, m.start() - 40):m.end() + 30].split())))
    return hits


@pytest.mark.parametrize("source", ["documents", "docstrings"])
def test_no_diary_wording(source):
    texts = _documents() if source == "documents" else _docstrings()
    found = [f"{where}: {kind}: ...{words}..." for where, text in texts
             for kind, words in diary_hits(text)]
    assert not found, "diary wording in the documentation:\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "measured in session 12", "the 7th session's run", "in the third work period",
    "see issue 42", "as Issue #17 asks", "fixed in #42", "the H200 was not available",
    "no GPU: the machines were unavailable", "H100s were not lent", "status listed no H200"])
def test_the_check_catches_diary_wording(text):
    assert diary_hits(text), text


@pytest.mark.parametrize("text", [
    "the schedulers issue 1.04e12 warp instructions/s", "2x H200, 2026-11-24",
    "RuntimeError when the CUDA path is not available", "`#include <cuda.h>`",
    "&#42; an HTML entity", "section 2.0h of docs/benchmarks.md"])
def test_the_check_passes_product_wording(text):
    assert not diary_hits(text), diary_hits(text)
