"""`memzoo verify`: is every row of a results.jsonl one that `memzoo bench` wrote, unchanged, from
committed code, with figures inside their ranges; and, with ``--rerun K``, do its cheapest rows
measure the same again.

Checks, row by row (a failing row is one line, ``FILE:LINE: reason``; the exit status is 1):

- *whole*: the line is a JSON object (a torn or hand-broken line fails);
- *schema*: the keys and types a row has (suite, preset, layer, setting, seed, config, metrics, and
  the provenance: config hash, git sha, versions, hardware, wall time, run id, time);
- *config*: ``config_hash`` is the hash of ``config`` (a config edited by hand no longer matches);
- *code*: the git sha carries no ``+dirty`` and is a commit of this repository's history (a row of
  code nobody can check out is not a row anyone can verify);
- *ranges*: accuracies (and their recorded intervals) in [0, 1], losses finite and >= 0 (a diverged
  training may record none), counts and times >= 0;
- *digest*: the row's content digest (`row_digest`, written with the row) matches its content. A
  row from before the digest existed is a warning, not a failure, unless the file has a seal beside
  it (``sealed.txt``: the digests of the rows published before, taken once, `seal`): such a row
  must then be one of them, so that an edit of any published row fails.

``--rerun K`` measures again the K rows that are cheapest to measure (or the rows at the given line
numbers) from their recorded config, and says row by row whether the figures agree: the cost
suite's counts (parameters, both FLOPs counts) exactly; a toys cell retrained at its recorded lr and
seed within the interval of its layer's seeds in the same file (preset and machine), or 0.01 for a
layer of one seed. The code measuring is this checkout's: a row of an older commit that disagrees
names that commit (its protocol may have changed since).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from memzoo.bench.common import config_hash, row_digest

#: a row's keys and the types they hold
SCHEMA = {"suite": str, "preset": str, "layer": str, "setting": dict, "seed": int, "config": dict, "metrics": dict,
          "config_hash": str, "git_sha": str, "versions": dict, "hardware": dict, "wall_s": (int, float),
          "run_id": str, "time": str}
#: metric names (their last part, a path's index stripped) that are fractions in [0, 1]
FRACTIONS = re.compile(r"(^|\.)(accuracy(_lo|_hi)?|acc_by_kv\.[^.]+|val_accuracy|val_by_lr\.[^.]+|by_depth\.[^.]+|"
                       r"digit_accuracy(_half)?|history\[\]\.val|val_history_by_lr\.[^.]+\[\])$")
LOSSES = re.compile(r"(loss|nll|ppl|bits_per_byte)")
COUNTS = re.compile(r"(^|\.)(params|steps|sequences|tokens|n_samples|n_passages|lm_steps|timed_steps)$")


@dataclass
class Report:
    failures: list = field(default_factory=list)  # "FILE:LINE: reason"
    warnings: list = field(default_factory=list)
    rows: int = 0
    undigested: int = 0
    sealed: set | None = None  # the digests of sealed.txt beside the file, if it has one

    def fail(self, where: str, why: str) -> None:
        self.failures.append(f"{where}: {why}")


def _walk(x, path: str = ""):
    """(path, value) of every leaf of a metrics mapping, list indices written as []."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v, f"{path}[]")
    else:
        yield path, x


def check_row(row, where: str, report: Report, commits: "Commits") -> None:
    """Every check but the rerun, on one parsed line."""
    if not isinstance(row, dict):
        return report.fail(where, f"not a row (a JSON {type(row).__name__})")
    missing = [k for k in SCHEMA if k not in row]
    if missing:
        return report.fail(where, f"lacks {', '.join(missing)}")
    wrong = [f"{k} is a {type(row[k]).__name__}" for k, t in SCHEMA.items()
             if not isinstance(row[k], t) or (t is int and isinstance(row[k], bool))]
    if wrong:
        return report.fail(where, "; ".join(wrong))
    if config_hash(row["config"]) != row["config_hash"]:
        report.fail(where, f"config_hash {row['config_hash']} is not the hash of its config ({config_hash(row['config'])}): "
                           "the config was changed after the row was written")
    sha = row["git_sha"]
    if sha.endswith("+dirty"):
        report.fail(where, f"measured from a tree with uncommitted changes ({sha[:12]}+dirty): no one can check out that code")
    elif (why := commits.unknown(sha)):
        report.fail(where, why)
    stop = row["metrics"].get("stop")
    for path, v in _walk(row["metrics"]):
        if isinstance(v, bool) or not (v is None or isinstance(v, (int, float))):
            continue
        if FRACTIONS.search(path) and v is not None and not 0 <= v <= 1:
            report.fail(where, f"metrics.{path} = {v} is not in [0, 1]")
        elif LOSSES.search(path.rsplit(".", 1)[-1]) and not path.startswith(("history", "val_history")):
            if v is None and stop != "diverged":
                report.fail(where, f"metrics.{path} is missing (not finite) in a training that did not diverge")
            elif v is not None and (not math.isfinite(v) or v < 0):
                report.fail(where, f"metrics.{path} = {v} is not a finite loss >= 0")
        elif COUNTS.search(path) and v is not None and v < 0:
            report.fail(where, f"metrics.{path} = {v} is negative")
    m = row["metrics"]
    if all(isinstance(m.get(k), (int, float)) for k in ("accuracy", "accuracy_lo", "accuracy_hi")):
        if not m["accuracy_lo"] - 1e-9 <= m["accuracy"] <= m["accuracy_hi"] + 1e-9:  # (a bound computed in floats)
            report.fail(where, f"metrics.accuracy {m['accuracy']} lies outside its interval "
                               f"[{m['accuracy_lo']}, {m['accuracy_hi']}]")
    if row["wall_s"] < 0:
        report.fail(where, f"wall_s = {row['wall_s']} is negative")
    if "digest" not in row:
        report.undigested += 1
        if report.sealed is not None and row_digest(row) not in report.sealed:
            report.fail(where, "it has no digest and is not one of the rows sealed before digests (sealed.txt): "
                               "changed or added by hand")
    elif row["digest"] != row_digest(row):
        report.fail(where, "its content does not match its digest: the row was changed after `memzoo bench` wrote it")


#: beside a results.jsonl: the digests of its rows written before `memzoo bench` recorded one
SEAL = "sealed.txt"


def seal(path: str | Path) -> Path:
    """Write ``sealed.txt`` beside `path`: the digest of each of its rows that has none (taken once,
    for the rows published before the digest existed; git keeps when)."""
    path = Path(path)
    digests = sorted({row_digest(r) for line in path.read_text().splitlines() if line.strip()
                      for r in [json.loads(line)] if "digest" not in r})
    out = path.parent / SEAL
    out.write_text("# the content digests (memzoo.bench.common.row_digest) of the rows of results.jsonl written before\n"
                   "# `memzoo bench` recorded a digest with each row; `memzoo verify` fails a row that has neither\n"
                   + "".join(d + "\n" for d in digests))
    return out


class Commits:
    """Which commits are in this repository's history (asked once per sha)."""

    def __init__(self, *roots: Path):
        """The first of `roots` (the results file's folder, then the working directory) that is in a
        git checkout."""
        self._seen: dict[str, str] = {}
        self.git, self.root = False, Path.cwd()
        for root in (*roots, Path.cwd()):
            try:
                top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
            except OSError:
                break
            if top.returncode == 0:
                self.git, self.root = True, Path(top.stdout.strip())
                break

    def unknown(self, sha: str) -> str:
        """'' for a commit that HEAD descends from, else why not."""
        if not self.git:
            return ""  # said once, as a warning (`verify`)
        if not re.fullmatch(r"[0-9a-f]{7,40}", sha):
            return f"git sha {sha!r} is not a commit id"
        if sha not in self._seen:
            ok = subprocess.run(["git", "merge-base", "--is-ancestor", sha, "HEAD"], cwd=self.root,
                                capture_output=True).returncode == 0
            self._seen[sha] = "" if ok else f"git sha {sha[:12]} is not a commit of this repository's history"
        return self._seen[sha]


def history(path: str | Path) -> list[str]:
    """What the file's git history says was changed without a trace: every line it held at any
    commit (every line a commit added to it) is still in it byte for byte, or in a folder of
    ``superseded/`` beside it, whose README.md row says why it left. One failure per line, naming the
    commit that added it and where it was; [] if git has no history of the file."""
    import subprocess

    path = Path(path).resolve()
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path.parent, capture_output=True, text=True)
    if root.returncode:
        return []
    rel = path.relative_to(Path(root.stdout.strip()).resolve()).as_posix()
    log = subprocess.run(["git", "log", "--reverse", "--format=commit %H", "-p", "--unified=0", "--no-color", "--",
                          rel], cwd=root.stdout.strip(), capture_output=True, text=True, check=True).stdout
    now = set(path.read_text().splitlines()) if path.is_file() else set()
    aside = path.parent / "superseded"
    why = (aside / "README.md").read_text() if (aside / "README.md").is_file() else ""
    kept: set[str] = set()
    for f in sorted(aside.glob("*/*.jsonl")) if aside.is_dir() else []:
        if f"`{f.parent.name}`" in why:  # a folder the README gives its reason for
            kept |= set(f.read_text().splitlines())
    failures, commit, seen = [], "", set()
    for line in log.splitlines():
        if line.startswith("commit "):
            commit = line.split()[1][:12]
        elif line.startswith("+") and not line.startswith("+++") and line[1:].strip():
            row = line[1:]
            if row not in now and row not in kept and row not in seen:
                seen.add(row)
                failures.append(f"{path.name}: a line that commit {commit} added is no longer in it, nor in a "
                                f"superseded/ folder with its reason: {row[:120]}{'...' if len(row) > 120 else ''}")
    return failures


def verify(path: str | Path, rerun: int = 0, lines: list[int] | None = None, out=None, with_history: bool = False) -> int:
    """Check every row of `path` (and re-measure `rerun` rows, or those at `lines`); print one line
    per failing row and a summary (to `out`, default stdout); return the exit status (0: every row
    passes)."""
    out = out or sys.stdout
    path = Path(path)
    if not path.is_file():
        print(f"memzoo verify: no file {path}", file=out)
        return 1
    report, commits = Report(), Commits(path.resolve().parent)
    if (seal_file := path.parent / SEAL).is_file():
        report.sealed = {x for x in seal_file.read_text().split() if not x.startswith("#")}
    if not commits.git:
        report.warnings.append(f"{path} is not in a git checkout: the rows' commits are not checked")
    parsed: list[tuple[int, dict]] = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            report.fail(where, f"not a whole JSON row ({e.msg}, column {e.colno}): torn or edited by hand")
            continue
        report.rows += 1
        before = len(report.failures)
        check_row(row, where, report, commits)
        if isinstance(row, dict) and len(report.failures) == before:
            parsed.append((i, row))
    if report.undigested:
        report.warnings.append(f"{report.undigested} row(s) predate the content digest (written before it existed): "
                               + ("checked against the seal beside the file" if report.sealed is not None
                                  else "their content cannot be checked against an edit"))
    if with_history:
        report.failures += history(path)
    agreed = None
    if rerun or lines:
        from memzoo.bench.rerun import rerun_rows

        agreed = rerun_rows(path, parsed, rerun, lines, out)
        report.failures += agreed.failures
    for w in report.warnings:
        print(f"memzoo verify: warning: {w}", file=out)
    for f in report.failures:
        print(f, file=out)
    summary = (f"memzoo verify: {report.rows} rows in {path}: "
               + (f"{len(report.failures)} failing" if report.failures else "every row passes")
               + (f"; {report.undigested} without a digest (warned)" if report.undigested else "")
               + (f"; rerun {agreed.agree} of {agreed.total} agree" if agreed is not None else "")
               + ("; its history: every line ever published is still there or superseded with a reason"
                  if with_history and not any(": a line that commit " in f for f in report.failures) else ""))
    print(summary, file=out)
    return 1 if report.failures else 0
