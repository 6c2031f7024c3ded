"""The documents' references to result files resolve: every ``results/...``
path named in README.md and docs/*.md (braces expanded, e.g.
``bench_paths_{nvlink,shm}_...json``) exists under docs/results/, and every
file there is named by some document."""
import glob
import itertools
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = re.compile(r"(?:docs/)?results/([\w./{},-]+\w)")


def _expand(path):
    parts = re.split(r"\{([^{}]*)\}", path)
    fixed, choices = parts[0::2], [p.split(",") for p in parts[1::2]]
    for pick in itertools.product(*choices):
        yield "".join(a + b for a, b in itertools.zip_longest(fixed, pick, fillvalue=""))


def _references():
    docs = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    for doc in docs:
        text = open(doc, encoding="utf-8").read()
        for m in REF.finditer(text):
            for path in _expand(m.group(1)):
                yield os.path.relpath(doc, ROOT), path


def test_every_result_file_named_in_a_document_exists():
    missing = sorted({(doc, p) for doc, p in _references()
                      if not os.path.exists(os.path.join(ROOT, "docs", "results", p))})
    assert not missing, f"documents name result files that are not there: {missing}"


def test_every_result_file_is_named_by_a_document():
    named = {p for _, p in _references()}
    folders = {os.path.dirname(p) for p in named}
    files = [os.path.relpath(f, os.path.join(ROOT, "docs", "results"))
             for f in glob.glob(os.path.join(ROOT, "docs", "results", "**", "*"), recursive=True)
             if os.path.isfile(f)]
    # a device log is named by its folder where a document cites the folder
    unnamed = sorted(f for f in files if f not in named and os.path.dirname(f) not in folders)
    assert not unnamed, f"result files no document names: {unnamed}"
