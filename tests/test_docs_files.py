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


TOOL = re.compile(r"(?<![\w/])((?:tools|research)/[\w./-]*\w(?:\.py|\.sh)|(?:tools|research)/[\w-]+/)")
# a line that tells where a tool was (a run's record): its old path stands
HISTORY = re.compile(r"\b(was|now)\b")


def test_every_tool_path_named_in_a_document_exists():
    """Commands in README.md, docs/*.md, the Makefile and .ci/run name tools
    and studies where they are (tools/ is grouped by purpose: testing,
    device, profiling; the studies are in research/)."""
    docs = ([os.path.join(ROOT, name) for name in ("README.md", "Makefile", ".ci/run")]
            + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))))
    missing = set()
    for doc in docs:
        for line in open(doc, encoding="utf-8"):
            if HISTORY.search(line):        # "(was tools/x.sh)", "... now tools/device.sh ..."
                continue
            missing |= {(os.path.relpath(doc, ROOT), m.group(1)) for m in TOOL.finditer(line)
                        if not os.path.exists(os.path.join(ROOT, m.group(1)))}
    missing = sorted(missing)
    assert not missing, f"documents name tools that are not there: {missing}"


def test_tools_are_grouped():
    """`ls tools` shows at most eight entries (issue 33)."""
    assert len(os.listdir(os.path.join(ROOT, "tools"))) <= 8
