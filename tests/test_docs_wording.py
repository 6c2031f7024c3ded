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


# The pages a user reads first speak of the library alone: no specification
# outside the repository ("spec 5c", "../shared/spec") and no internal device
# runner (benchmarks.md and the pages for contributors may name the scripts
# that reproduce a measurement).
USER_DOCS = ("README.md", "CHANGELOG.md", "docs/getting-started.md", "docs/tuning.md",
             "docs/reference.md", "docs/troubleshooting.md")
OUTSIDE = {
    "a specification outside the repository": re.compile(
        r"\bspec(?:ification)?s?\s+(?:section\s+)?\d|\(spec\b|\bthe spec\b|\.\./shared\b"
        r"|paper-notes", re.I),
    "the internal device runner": re.compile(r"tools/device(?:\.sh|/)"),
}


def outside_hits(text: str) -> list:
    return [(kind, " ".join(text[max(0, m.start() - 40):m.end() + 30].split()))
            for kind, pattern in OUTSIDE.items() for m in pattern.finditer(text)]


def test_user_docs_name_no_outside_spec_or_internal_runner():
    found = [f"{name}: {kind}: ...{words}..." for name in USER_DOCS
             for kind, words in outside_hits(open(os.path.join(ROOT, name), encoding="utf-8").read())]
    assert not found, "\n".join(found)


def test_public_docstrings_name_no_outside_spec():
    """The installed package's docstrings (the research studies aside)."""
    found = [f"{where}: ...{words}..." for where, text in _docstrings()
             if "/studies/" not in where.replace(os.sep, "/")
             for kind, words in outside_hits(text) if kind.startswith("a spec")]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("text", ["as spec 5c says", "spec section 2", "see ../shared/spec",
                                  "bash tools/device.sh build", "(paper-notes 7.4)"])
def test_the_check_catches_outside_references(text):
    assert outside_hits(text), text


@pytest.mark.parametrize("text", ["CallSpec(codec)", "the paper's Table 7", "a spectrum",
                                  "tools/profiling/p2p.py probe"])
def test_the_check_passes_own_references(text):
    assert not outside_hits(text), outside_hits(text)
