"""`memzoo verify`: the published rows pass; an edited metric, an edited config, a commit that is not
in the history, a torn line and a row without a digest that the seal does not hold each fail, named
by line; `--rerun` measures a cost row's counts again and says whether they agree."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from memzoo.bench.common import Recorder, row_digest
from memzoo.bench.verify import SEAL, seal, verify

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "leaderboards" / "results.jsonl"


def _published(n: int, suite: str = "cost", preset: str = "tiny") -> list[dict]:
    rows = [json.loads(line) for line in PUBLISHED.read_text().splitlines()
            if f'"suite": "{suite}"' in line and f'"preset": "{preset}"' in line]
    assert len(rows) >= n
    return rows[:n]


def _sealed(row: dict) -> dict:
    """The row as `memzoo bench` writes it now: with its digest."""
    return {**row, "digest": row_digest(row)}


def _write(path: Path, rows: list, tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows) + tail)
    return path


def test_the_published_rows_pass(capsys):
    """What CI runs: a published row edited by hand (or added without `memzoo bench`) fails the tests."""
    assert verify(PUBLISHED) == 0, capsys.readouterr().out
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("memzoo verify: ") and "every row passes" in out[-1]


def test_no_published_row_ever_left_the_file_without_a_trace():
    """What CI runs: every line leaderboards/results.jsonl held at any commit is still there, or in a
    superseded/ folder whose README row says why (issue 79: a digest catches an accident, history a
    deliberate edit)."""
    from memzoo.bench.verify import history

    assert history(PUBLISHED) == []


def test_the_history_check_names_an_edited_row_and_accepts_a_superseded_one(tmp_path, capsys):
    """In a temporary repository: a commit that edits a published row fails, naming the line and the
    commit that added it; a row moved to superseded/ with its reason passes."""
    from memzoo.bench.verify import history

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    board = tmp_path / "leaderboards"
    board.mkdir()
    rows = ['{"a": 1}', '{"a": 2}', '{"a": 3}']
    (board / "results.jsonl").write_text("\n".join(rows) + "\n")
    git("add", ".")
    git("commit", "-qm", "rows")
    (board / "results.jsonl").write_text("\n".join([rows[0], '{"a": 2.5}', rows[2], '{"a": 4}']) + "\n")
    git("commit", "-qam", "an edit")
    out = history(board / "results.jsonl")
    assert len(out) == 1 and 'a line that commit ' in out[0] and out[0].endswith('{"a": 2}')
    assert verify(board / "results.jsonl", with_history=True) == 1
    assert '{"a": 2}' in capsys.readouterr().out
    aside = board / "superseded" / "old-a"
    aside.mkdir(parents=True)
    (aside / "results.jsonl").write_text(rows[1] + "\n")
    (board / "superseded" / "README.md").write_text("| `old-a` | the row a = 2 | measured again |\n")
    git("add", ".")
    git("commit", "-qm", "superseded with a reason")
    assert history(board / "results.jsonl") == []
    (board / "superseded" / "README.md").write_text("no reason given\n")  # a folder without its reason does not count
    assert len(history(board / "results.jsonl")) == 1


def test_an_edit_of_any_kind_is_named_by_line_and_fails(tmp_path, capsys):
    rows = [_sealed(r) for r in _published(4)]
    metric = json.loads(json.dumps(rows[0]))
    metric["metrics"]["params"] += 1  # a figure changed after the row was written
    config = json.loads(json.dumps(rows[1]))
    config["config"]["settings"]["steps"] = 99
    config["digest"] = row_digest(config)  # even with its digest made again, the config hash tells
    sha = _sealed({**rows[2], "git_sha": "0123456789abcdef0123456789abcdef01234567"})
    path = _write(tmp_path / "results.jsonl", [metric, config, sha, rows[3]], tail=json.dumps(rows[3])[:50])
    assert verify(path) == 1
    out = capsys.readouterr().out
    assert f"{path}:1: its content does not match its digest" in out
    assert f"{path}:2: config_hash {rows[1]['config_hash']} is not the hash of its config" in out
    assert f"{path}:3: git sha 0123456789ab is not a commit of this repository's history" in out
    assert f"{path}:5: not a whole JSON row" in out
    assert f"{path}:4" not in out  # the untouched row passes
    assert "4 failing" in out.strip().splitlines()[-1]


def test_ranges_a_dirty_tree_and_the_seal(tmp_path, capsys):
    row = _published(1, "toys", "tiny")[0]
    bad = json.loads(json.dumps(row))
    bad["metrics"]["accuracy"] = 1.5
    dirty = {**row, "git_sha": row["git_sha"] + "+dirty"}
    path = _write(tmp_path / "results.jsonl", [_sealed(bad), _sealed(dirty)])
    assert verify(path) == 1
    out = capsys.readouterr().out
    assert f"{path}:1: metrics.accuracy = 1.5 is not in [0, 1]" in out and f"{path}:2: measured from a tree with uncommitted" in out
    # rows from before the digest: a warning, unless a seal beside the file leaves them out
    old = _published(2)
    path = _write(tmp_path / "results.jsonl", old)
    assert verify(path) == 0 and "2 row(s) predate the content digest" in capsys.readouterr().out
    seal(path)
    assert (tmp_path / SEAL).is_file() and verify(path) == 0
    capsys.readouterr()
    edited = json.loads(json.dumps(old[1]))
    edited["metrics"]["tokens_per_s"] *= 2
    _write(path, [old[0], edited])
    assert verify(path) == 1 and f"{path}:2: it has no digest and is not one of the rows sealed" in capsys.readouterr().out


def test_the_bench_writes_each_row_with_its_digest(tmp_path):
    rec = Recorder(tmp_path, "tiny", 0, run_id="t")
    rec.add("toys", "linear", {"task": "mqar"}, {"accuracy": 0.5, "loss": float("nan")}, {"a": 1}, 1.0)
    row = json.loads((tmp_path / "results.jsonl").read_text())
    assert row["digest"] == row_digest(row) and row["metrics"]["loss"] is None


def test_rerun_measures_the_cheapest_rows_again(tmp_path, capsys):
    rows = [_sealed(r) for r in _published(2)]
    path = _write(tmp_path / "results.jsonl", rows)
    assert verify(path, rerun=1) == 0
    out = capsys.readouterr().out
    assert "rerun" in out and "params" in out and ": agree" in out and "rerun 1 of 1 agree" in out
    wrong = json.loads(json.dumps(rows[0]))
    wrong["metrics"]["flops_full"] *= 1.1
    _write(path, [_sealed(wrong)])
    assert verify(path, lines=[1]) == 1
    assert f"{path}:1: rerun of cost tiny {wrong['layer']} seed 0 disagrees" in capsys.readouterr().out


def test_the_cli_verb(tmp_path):
    path = _write(tmp_path / "results.jsonl", [_sealed(_published(1)[0])])
    done = subprocess.run(["memzoo", "verify", str(path)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and "every row passes" in done.stdout
    path.write_text(path.read_text()[:-20])
    done = subprocess.run(["memzoo", "verify", str(path)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1 and f"{path}:1: not a whole JSON row" in done.stdout


@pytest.mark.parametrize("missing", ["config", "git_sha"])
def test_a_row_without_its_provenance_fails(tmp_path, capsys, missing):
    row = {k: v for k, v in _published(1)[0].items() if k != missing}
    assert verify(_write(tmp_path / "results.jsonl", [row])) == 1
    assert f":1: lacks {missing}" in capsys.readouterr().out
