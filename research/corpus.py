"""The byte-level corpus of the training studies (mpi_examples/train_lm.py,
``python -m research train-sim``): modules of Python's standard library,
present under the same paths in Python 3.11 and 3.12, so the data ships with
every interpreter and nothing downloads.

In the sorted list ``CORPUS_FILES`` every 10th file (index % 10 == 9) is
validation, the rest training; files are joined by a NUL byte, the
vocabulary is the 256 byte values.  ``load_corpus`` records the corpus'
sha256, so runs are comparable only when it matches.
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig

_TOP = """_collections_abc _compression _markupbase _pydecimal _pyio _strptime _threading_local
_weakrefset abc argparse ast base64 bdb bisect calendar cmd code codecs codeop colorsys configparser
contextlib copy copyreg csv dataclasses difflib dis doctest enum filecmp fileinput fnmatch fractions
ftplib functools genericpath getopt gettext glob gzip hashlib heapq hmac imaplib inspect io
ipaddress keyword linecache locale lzma mailbox mimetypes netrc ntpath numbers opcode operator
optparse os pathlib pdb pickle pickletools pkgutil platform plistlib poplib posixpath pprint profile
pstats py_compile pydoc queue quopri random reprlib rlcompleter runpy sched secrets selectors shelve
shlex shutil signal site smtplib socket socketserver ssl stat statistics string stringprep struct
subprocess symtable tabnanny tarfile tempfile textwrap threading timeit token tokenize trace
traceback tracemalloc types typing uuid warnings wave weakref webbrowser zipapp zipimport"""
_PACKAGES = {
    "asyncio": "base_events events futures locks queues selector_events streams subprocess tasks "
               "transports unix_events",
    "collections": "__init__", "concurrent/futures": "_base process thread",
    "ctypes": "__init__ util", "email": "_header_value_parser _parseaddr _policybase base64mime "
    "charset contentmanager encoders errors feedparser generator header headerregistry iterators "
    "message parser policy quoprimime utils",
    "encodings": "__init__ idna punycode", "ensurepip": "__init__",
    "http": "__init__ client cookiejar cookies server",
    "importlib": "__init__ _bootstrap _bootstrap_external abc machinery util",
    "json": "__init__ decoder encoder scanner tool", "logging": "__init__ config handlers",
    "multiprocessing": "connection context managers pool process queues reduction synchronize util",
    "re": "__init__ _casefix _compiler _constants _parser", "sqlite3": "__init__ dbapi2",
    "tomllib": "_parser _re _types", "unittest": "case loader main mock result runner suite util",
    "urllib": "error parse request response robotparser", "venv": "__init__",
    "wsgiref": "handlers headers simple_server util validate",
    "xml/dom": "expatbuilder minidom pulldom", "xml/etree": "ElementPath ElementTree",
    "xml/sax": "expatreader handler saxutils", "xmlrpc": "client server",
}
CORPUS_FILES = sorted([f"{m}.py" for m in _TOP.split()]
                      + [f"{pkg}/{m}.py" for pkg, ms in _PACKAGES.items() for m in ms.split()])


def load_corpus(stdlib=None):
    """(train bytes, validation bytes, info dict) from CORPUS_FILES."""
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    train, val, missing = [], [], []
    for i, rel in enumerate(CORPUS_FILES):
        path = os.path.join(stdlib, rel)
        if not os.path.isfile(path):
            missing.append(rel)
            continue
        with open(path, "rb") as f:
            (val if i % 10 == 9 else train).append(f.read())
    train_b, val_b = b"\0".join(train), b"\0".join(val)
    info = {"stdlib": stdlib, "python": sys.version.split()[0], "files_train": len(train),
            "files_val": len(val), "bytes_train": len(train_b), "bytes_val": len(val_b),
            "missing": missing,
            "sha256": hashlib.sha256(train_b + b"\0\0" + val_b).hexdigest()}
    return train_b, val_b, info
