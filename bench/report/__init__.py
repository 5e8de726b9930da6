"""Rows -> report: every table, figure and reading note of the bench, rendered from rows alone.

`memzoo leaderboard` writes ``leaderboards/README.md`` and the figures from results.jsonl;
`memzoo bench` prints the same tables of the rows it measured. Each suite's half is a module
here (``report.toys``, ...): ``tables(df)``, ``figures(df, out_dir)``, ``NOTE`` (the reading
note: protocol text, no measured number) and optionally ``notes(rows, published)`` (lines
printed under a run's tables), ``summary(df)`` (its clause of the line that ends a run's output,
`print_closing`) and ``HEADLINES`` (its columns of the overview that opens the leaderboard, as data:
``report.overview.Headline``; the tables they read tagged with `keyed`). The suites themselves (``bench/suites/``) only measure.

Rendering reads nothing but results.jsonl, so the published tables and plots can always be
regenerated and checked: the same file gives the same bytes (sorted rows, no clock, PNGs
without metadata). Where a (suite, preset, layer, setting) was measured more than once on one
machine model and protocol, the latest row counts (per seed); a section measured again elsewhere
stays whole until all of it was (`_groups`); every row's provenance stays in results.jsonl and the
README lists the runs behind the tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from memzoo.bench.common import BASELINE, RESULTS, protocol, protocol_hash, read_results
from memzoo.bench.report import cost, niah, pairs, ppl, toys
from memzoo.bench.report.common import (  # noqa: F401  (the tables' helpers, imported from here by callers)
    fewer_seeds, keyed, lm_host, lm_lines, machine, save_png, shared_count, versus, with_family, with_seed, with_texts,
)
from memzoo.bench.schema import SUITE_NAMES as NAMES
from memzoo.bench.schema import layer_order, lead  # noqa: F401  (layer_order: callers import it from here)
from memzoo.registration import did_you_mean
from memzoo.storage import write_text

#: each suite's report half, by the suite's name
MODULES: dict[str, ModuleType] = {"cost": cost, "pairs": pairs, "toys": toys, "ppl": ppl, "niah": niah}


def module(name: str) -> ModuleType:
    """The report half of suite `name`."""
    if name not in MODULES:
        raise ValueError(f"unknown suite {name!r}{did_you_mean(name, NAMES)}; "
                         f"valid suites: {', '.join(NAMES)}")
    return MODULES[name]

_DROP = ("config", "versions", "hardware")  # provenance kept in results.jsonl, not in the tables


def latest(rows: list[dict], pooled: bool = False) -> list[dict]:
    """The last row of every (suite, preset, layer, setting, seed), in a fixed order. `pooled`: the
    last of every processor model too, among the rows of the config its latest row measured, whatever
    its training seed (the same cell measured on several processors: an accuracy pools them; `pooled_suite`)."""
    keep: dict[tuple, dict] = {}
    ordered = sorted(rows, key=lambda r: (r["time"], r["run_id"]))
    cell = lambda r: (r["suite"], r["preset"], r["layer"], json.dumps(r["setting"], sort_keys=True))  # noqa: E731
    config = {cell(r): protocol_hash(r["config"], any_seed=True) for r in ordered}  # what each cell's latest row measured
    for r in ordered:
        if pooled and protocol_hash(r["config"], any_seed=True) != config[cell(r)]:
            continue
        keep[(*cell(r), r["seed"], machine(r) if pooled else "")] = r
    return [keep[k] for k in sorted(keep)]


def pooled_suite(name: str) -> bool:
    """Whether a suite's tables pool processor models (its module's ``POOLED``: accuracies, which a
    protocol fixes; timings belong to one processor model)."""
    return bool(getattr(module(name), "POOLED", False))


def borrowed(name: str, preset: str, rows: list[dict]) -> list[dict]:
    """The rows a section of `preset` shows from the presets it reuses (its module's ``BORROWS``:
    the same cells, counted by the suite's ``reuse``), of the protocol versions its own rows have."""
    others = getattr(module(name), "BORROWS", {}).get(preset, ())
    mine = {_kind(r, True)[1] for r in rows if r["suite"] == name and r["preset"] == preset}
    return [r for r in rows if r["suite"] == name and r["preset"] in others and _kind(r, True)[1] in mine]


def frame(rows: list[dict]):
    import pandas as pd

    return pd.json_normalize([{**{k: v for k, v in r.items() if k not in _DROP},
                               **({"machine": machine(r)} if "hardware" in r else {}),
                               **({"host": h} if (h := lm_host(r)) else {})} for r in rows])


def _groups(rows: list[dict], with_rows: bool = False, only: str | None = None):
    """(suite, preset, module, DataFrame) for every table section, in the suites' order (and the
    rows themselves, with `with_rows`). A section is one suite and preset on one machine model and
    one protocol version (rows of others become a section of their own, named by `section_name`,
    never mixed into one table), with that machine's latest row of each measurement. A section is
    shown whole while any of its measurements is the latest of all, and is gone once every one was
    measured again later on another machine or protocol: its controls and baseline stay beside its
    rows (a layer measured again elsewhere, with more seeds, does not leave a table without them).
    `only`: the sections of that preset alone (the rows of presets it borrows from shown inside them)."""
    for name in NAMES:
        pooled = pooled_suite(name)
        for preset in sorted({r["preset"] for r in rows if r["suite"] == name and only in (None, r["preset"])}):
            sub = [r for r in rows if r["suite"] == name and r["preset"] == preset]
            sub += borrowed(name, preset, rows)
            for key in _shown(sub, pooled):
                part = latest([r for r in sub if _kind(r, pooled) == key], pooled)
                yield (name, preset, module(name), frame(part)) + ((part,) if with_rows else ())


def _shown(rows: list[dict], pooled: bool = False) -> list[tuple[str, str]]:
    """The (machine, protocol) kinds of one suite's and preset's rows that still hold a latest row,
    GPUs and CPUs apart: a CPU's row does not retire a GPU's (nor the reverse), since a GPU's timing
    is not what a CPU measures again."""
    return sorted({_kind(r, pooled) for gpu in (True, False)
                   for r in latest([x for x in rows if bool(x["hardware"].get("gpu")) == gpu])})


def _kind(r: dict, pooled: bool = False) -> tuple[str, str]:
    """(machine model, protocol version) of a row: what a table may not mix; `pooled`: the protocol
    only (each row names its processor). A suite whose module names its configs' ``LAYER_KEYS`` (a
    layer's own options) tells protocols apart by the rest of the config too, the preset's protocol
    (its short hash), since its presets changed without a version."""
    version = str(r.get("config", {}).get("version", ""))
    own = getattr(module(r["suite"]), "LAYER_KEYS", None) if pooled else None
    if own is not None:
        version += ("/" if version else "") + protocol_hash(r["config"], any_seed=True, without=own)[:8]
    return "" if pooled else machine(r), version


def _folder(section: str, preset: str) -> str:
    """A section's figure folder: the preset's name, with the machine and protocol of a section
    that shares its preset with others."""
    import re

    extra = section.split(f"`{preset}`", 1)[1].strip(" —")
    return preset + ("-" + re.sub(r"[^a-z0-9]+", "-", extra.lower()).strip("-") if extra else "")


def section_name(name: str, preset: str, rows: list[dict], all_rows: list[dict]) -> str:
    """The heading of a section: suite and preset, and the machine model and protocol version where
    the suite and preset have rows of several."""
    pooled = pooled_suite(name)
    kinds = _shown([r for r in all_rows if r["suite"] == name and r["preset"] == preset], pooled)
    head = f"{name} — preset `{preset}`"
    if len(kinds) > 1:
        m, v = _kind(rows[0], pooled)
        head += (f" — {m}" if m else "") + (f", protocol {v}" if len({k[1] for k in kinds}) > 1 and v else "")
    return head


def provenance(rows: list[dict]) -> str:
    """One line: the processors and code versions the shown rows come from, marked where they mix."""
    def count(key) -> list[tuple[str, int]]:
        seen: dict[str, int] = {}
        for r in rows:
            seen[key(r)] = seen.get(key(r), 0) + 1
        return sorted(seen.items(), key=lambda kv: (-kv[1], kv[0]))

    procs = count(machine)
    shas = count(lambda r: r["git_sha"][:7] + ("+dirty" if r["git_sha"].endswith("+dirty") else ""))
    protos = count(lambda r: str(r.get("config", {}).get("version", "")))
    where = ", ".join(f"{p} ({n} row{'s' if n > 1 else ''})" for p, n in procs)
    code = ", ".join(f"{s} ({n})" for s, n in shas[:6]) + (f" and {len(shas) - 6} more" if len(shas) > 6 else "")
    line = f"*Measured on {where}" + ("" if len(procs) == 1 else ": **mixes processors**")
    line += f"; code of {len(shas)} commit{'s' if len(shas) > 1 else ''} ({code})"
    runs = count(lambda r: r["run_id"])
    if len(runs) > 1:  # a table never combines calls without saying so
        ids = ", ".join(f"{rid} ({n})" for rid, n in runs[:4]) + (f" and {len(runs) - 4} more" if len(runs) > 4 else "")
        line += f"; **combines {len(runs)} runs**: {ids}"
    if len(protos) > 1:
        line += "; **mixes protocol versions** " + ", ".join(f"{v or 'unversioned'} ({n})" for v, n in protos)
    elif protos[0][0]:
        line += f"; protocol version {protos[0][0]}"
    return line + ".*"


def markdown(table) -> str:
    """A table as markdown; a plain 0..n-1 row index is left out."""
    import pandas as pd

    return table.to_markdown(index=not isinstance(table.index, pd.RangeIndex))


@dataclass
class Section:
    """One published section: a suite and preset on one machine model and protocol version, with
    everything both renderings (README.md, the site) show of it."""

    suite: str
    preset: str
    heading: str
    lead: str  # what the suite measures (its docstring's first paragraph)
    provenance: str
    tables: dict  # title -> DataFrame
    note: str  # the suite's reading note (protocol text)
    reading: list  # lines computed from the rows
    figures: list  # paths of the PNGs drawn
    problems: list | None  # what makes the harness invalid here (empty: valid; None: no harness check)
    rows: list  # the rows shown
    anchor: str = ""  # its id in both renderings (README.md's `<a id>`, the page's section), from the heading
    headline: dict | None = None  # its cells of the overview, from the suite's HEADLINES (`overview.headline`)
    lead_figures: list | None = None  # its figures the overview shows first (the suite's LEAD_FIGURES, with a headline)

    def table(self, key: str):
        """The table its suite tagged `key` (`keyed`), or None."""
        return next((t for t in self.tables.values() if t.attrs.get("table") == key), None)


def sections(rows: list[dict], out: Path) -> list[Section]:
    """Every section of `rows`, with its figures drawn under ``out/figures``. Rows of a suite that
    no module renders are left out with a warning (as a torn last line is)."""
    import warnings

    from memzoo.bench.report.overview import headline as overview_headline

    unknown = sorted({r["suite"] for r in rows} - set(NAMES) - {"failed"})
    if unknown:
        warnings.warn(f"rows of unknown suite(s) {', '.join(unknown)} are not rendered", stacklevel=2)
    out_sections = []
    anchors: set[str] = set()
    for name, preset, mod, df, shown in _groups(rows, with_rows=True):
        heading = section_name(name, preset, shown, rows)
        anchor = base = anchor_of(heading)
        while anchor in anchors:
            anchor = f"{base}-{len(anchors)}"
        anchors.add(anchor)
        out_sections.append(Section(
            suite=name, preset=preset, heading=heading,
            lead=lead(name),
            provenance=provenance(shown)[:-2] + _differs(name, preset, shown, rows) + ".*", tables=mod.tables(df), note=getattr(mod, "NOTE", "").strip(),
            reading=list(_reading(mod, df, rows)),
            figures=list(mod.figures(df, out / "figures" / _folder(heading, preset))),
            problems=getattr(mod, "problems", lambda df: None)(df), rows=shown, anchor=anchor))
        sec = out_sections[-1]
        sec.headline = overview_headline(sec, getattr(mod, "HEADLINES", ()))
        sec.lead_figures = [p for p in sec.figures if p.stem in getattr(mod, "LEAD_FIGURES", ())] if sec.headline else []
    return out_sections


def _differs(name: str, preset: str, shown: list[dict], rows: list[dict]) -> str:
    """Where a preset's sections are protocols of a suite that tells them apart by config (``LAYER_KEYS``):
    '; protocol P sets k v, ... (Q: w, ...)', what this section's protocol sets otherwise than each other
    one shown, from their rows' configs; else ''."""
    own = getattr(module(name), "LAYER_KEYS", None)
    kinds = _shown([r for r in rows if r["suite"] == name and r["preset"] == preset], True)
    if own is None or len(kinds) < 2:
        return ""

    def flat(cfg: dict, path: str = "") -> dict:
        out = {}
        for k, v in cfg.items():
            out.update(flat(v, f"{path}{k}.") if isinstance(v, dict) and v else {f"{path}{k}": v})
        return out

    def setting(r: dict) -> dict:
        return flat(protocol(r["config"], any_seed=True, without=own))

    mine = _kind(shown[0], True)[1]
    here = setting(shown[0])
    parts = []
    for _, other in kinds:
        if other == mine:
            continue
        there = setting(next(r for r in rows if r["suite"] == name and r["preset"] == preset and _kind(r, True)[1] == other))
        keys = sorted(k for k in set(here) | set(there) if here.get(k) != there.get(k))
        parts.append(", ".join(f"{k} {here.get(k, '(unset)')}" for k in keys)
                     + f" ({other}: " + ", ".join(str(there.get(k, "(unset)")) for k in keys) + ")")
    return f"; protocol {mine} sets " + "; ".join(parts)


def anchor_of(heading: str) -> str:
    """A section's id: its heading's words, lower case, joined by hyphens ("toys-recall-amd-epyc")."""
    import re

    return "-".join(re.findall(r"[a-z0-9]+", heading.replace("preset", "").replace("(R)", "").lower()))


def _reading(mod, df, rows: list[dict]) -> list[str]:
    """A section's reading lines; a suite whose `reading` takes the published rows too gets them."""
    import inspect

    fn = getattr(mod, "reading", None)
    if fn is None:
        return []
    return fn(df, rows) if len(inspect.signature(fn).parameters) > 1 else fn(df)


def render(results: str | Path = "leaderboards/results.jsonl", out_dir: str | Path | None = None) -> list[Path]:
    """Write README.md, the PNGs and the site (``site/index.html``) next to results.jsonl (or into
    `out_dir`); return the paths. Figures no section draws any more are removed."""
    import matplotlib

    from memzoo.bench.report.overview import NOTE as OVERVIEW_NOTE
    from memzoo.bench.report.overview import markdown as overview_markdown
    from memzoo.bench.report.overview import overview
    from memzoo.bench.report.site import write_site

    matplotlib.use("Agg")
    results = Path(results)
    out = Path(out_dir) if out_dir else results.parent
    rows = read_results(results)
    if not rows:
        raise FileNotFoundError(f"no results in {results}: run `memzoo bench` first")
    secs = sections(rows, out)
    ov = overview(secs)
    written = [p for sec in secs for p in sec.figures]
    lines = [
        "# memzoo leaderboard",
        "",
        f"Rendered by `memzoo leaderboard` from `{RESULTS}` ({len(rows)} rows) and nothing else; every number",
        "below was measured by `memzoo bench` (the runs are listed at the end, each row's full config,",
        "versions and hardware are in the JSONL). Where a setting was measured more than once, the latest",
        "row is shown. To sort, filter and open each row's provenance: `site/index.html` (open it in a browser).",
        "",
        "## Overview",
        "",
        *[x for path in ov.figures for x in (f"![{path.stem}]({path.relative_to(out).as_posix()})", "")],
        OVERVIEW_NOTE,
        "",
        overview_markdown(ov),
        "",
    ]
    for sec in secs:
        lines += [f'<a id="{sec.anchor}"></a>', "", f"## {sec.heading}", "", sec.lead, "", sec.provenance, ""]
        for title, table in sec.tables.items():
            lines += [f"**{title}**", "", markdown(table), ""]
        if sec.note:
            lines += [sec.note, ""]
        if sec.reading:
            lines += [*(f"- {line}" for line in sec.reading), ""]
        lines += [x for path in sec.figures for x in (f"![{path.stem}]({path.relative_to(out).as_posix()})", "")]
    lines += ["## Runs", "", *_runs_table(rows), ""]
    readme = out / "README.md"
    write_text(readme, "\n".join(lines))
    site = write_site(secs, rows, out, ov)
    for stale in sorted((out / "figures").rglob("*.png")) if (out / "figures").is_dir() else []:
        if stale not in written:  # a figure no section draws any more (a section renamed or withheld)
            stale.unlink()
    for folder in sorted((out / "figures").glob("*/")) if (out / "figures").is_dir() else []:
        if not any(folder.iterdir()):
            folder.rmdir()
    return [readme, site, *written]


def _runs_table(rows: list[dict]) -> list[str]:
    runs: dict[str, dict] = {}
    for r in rows:
        d = runs.setdefault(r["run_id"], {**r, "rows": 0, "wall_s": 0.0, "suites": set(), "layers": set()})
        d["rows"] += 1
        d["wall_s"] += r["wall_s"]
        d["suites"].add(r["suite"])
        d["layers"].add(r["layer"])
    out = ["| run | preset | seed | git sha | hardware | torch | suites | layers | rows | measured s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for rid in sorted(runs):
        d = runs[rid]
        hw = d["hardware"].get("gpu") or f"{d['hardware']['cpu']} ({d['hardware']['threads']} threads)"
        out.append(
            f"| {rid} | {d['preset']} | {d['seed']} | {d['git_sha'][:12]} | {hw} | {d['versions'].get('torch')} | "
            f"{', '.join(sorted(d['suites']))} | {len(d['layers'])} | {d['rows']} | {d['wall_s']:.0f} |"
        )
    return out


def print_tables(rows: list[dict], only: str | None = None) -> None:
    """The tables of `rows` (of preset `only`'s sections alone, if given), as `memzoo bench` prints them at
    the end of a run, each section's reading lines (stops, noisy timings, ...) under its tables."""
    for name, preset, mod, df in _groups(rows, only=only):
        for title, table in mod.tables(df).items():
            print(f"### {name} ({preset}): {title}\n")
            print(markdown(table))
            print()
        if lines := list(getattr(mod, "reading", lambda df: [])(df)):
            print("\n".join(f"- {line}" for line in lines) + "\n")


def print_closing(rows: list[dict], layers: list[str], preset: str, published_preset: str = "recall") -> None:
    """The three lines that end a run's output: what it showed (each suite's `summary`), where the
    full tables are, and (for a run with toys rows of named layers) the command that measures the same
    layers at the published budget."""
    said = []
    for name, _, mod, df in _groups(rows, only=preset):
        if (fn := getattr(mod, "summary", None)) and (line := fn(df)):
            said.append(line)
    print(f"What this run showed ({preset} preset): " + ("; ".join(said) if said else "no rows") + ".")
    print("The full tables, every published row beside the controls: leaderboards/README.md (it opens on an "
          "overview of every layer) and the page leaderboards/site/index.html (open it in a browser).")
    named = ",".join(n for n in layers if n != BASELINE)
    if named and any(r["suite"] == "toys" for r in rows):
        print(f"The same at the published budget (3 seeds, each lr chosen on validation; hours on 2 cores, resumable): "
              f"memzoo bench --preset {published_preset} --layers {named} --suite toys --resume")


def print_notes(rows: list[dict], published: list[dict], suites: list[str]) -> None:
    """What each suite's report says of a run's rows beside the published ones (toys: what a
    short budget can show), under the run's tables."""
    for s in suites:
        if lines := getattr(module(s), "notes", lambda rows, published: [])(rows, published):
            print("\n".join(lines) + "\n")
