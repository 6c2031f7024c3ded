"""docs/reference.md gives every public call's signature: each
``### `dq.NAME(...)` `` or ``dqt.NAME(...)`` heading, and each codec row of
its table (``| `dq.DynamiQ(...)` |``), names the same parameters, in the
same order and kinds (positional, keyword-only, ``**``), with the same
defaults, as the code (a class: its ``__init__``)."""
import ast
import inspect
import os
import re

import pytest

pytest.importorskip("torch")
import dynamiq_mpi as dq  # noqa: E402
import dynamiq_mpi.torch as dqt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADING = re.compile(r"^(?:### |\| )`(dqt?)\.(\w+)\((.*?)\)`(?:\s*$| \|)")
KINDS = {"args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
         "kwonlyargs": inspect.Parameter.KEYWORD_ONLY}


def _headings():
    with open(os.path.join(ROOT, "docs", "reference.md"), encoding="utf-8") as f:
        for line in f:
            m = HEADING.match(line)
            if m:
                yield m.groups()


def _documented(args: str) -> list:
    """(name, kind, default or Parameter.empty) of a heading's parameters."""
    fn = ast.parse(f"def f({args}): pass").body[0].args
    out = []
    positional = fn.posonlyargs + fn.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(fn.defaults)) + fn.defaults
    for a, d in zip(positional, defaults):
        out.append((a.arg, KINDS["args"], d))
    if fn.vararg:
        out.append((fn.vararg.arg, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
    for a, d in zip(fn.kwonlyargs, fn.kw_defaults):
        out.append((a.arg, KINDS["kwonlyargs"], inspect.Parameter.empty if d is None else d))
    if fn.kwarg:
        out.append((fn.kwarg.arg, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
    return [(n, k, d if d is inspect.Parameter.empty else eval(compile(ast.Expression(d), "", "eval")))
            for n, k, d in out]


def _actual(obj) -> list:
    sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    params = list(sig.parameters.values())
    if inspect.isclass(obj):
        params = params[1:]                         # self
    return [(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD
             if p.kind == inspect.Parameter.POSITIONAL_ONLY else p.kind, p.default)
            for p in params]


HEADINGS = list(_headings())


def test_the_reference_documents_the_public_calls():
    names = {f"{m}.{n}" for m, n, _ in HEADINGS}
    assert {"dq.allreduce", "dq.reduce_scatter", "dq.Collective", "dqt.HookState",
            "dqt.ReduceScatter", "dqt.register_comm_hook", "dq.DynamiQ", "dq.BF16", "dq.Exact",
            "dq.MXFP", "dq.THC", "dq.OmniReduce"} <= names, names


@pytest.mark.parametrize("module,name,args", HEADINGS, ids=[f"{m}.{n}" for m, n, _ in HEADINGS])
def test_a_headings_signature_is_the_codes(module, name, args):
    obj = getattr({"dq": dq, "dqt": dqt}[module], name)
    assert _documented(args) == _actual(obj), (
        f"docs/reference.md: {module}.{name}({args}) differs from the code's "
        f"{inspect.signature(obj)}")
