"""The leaderboard as a web page: ``site/index.html``, rendered from the same sections as README.md.

One self-contained file (its style and script inline; the figures are the PNGs beside it under
``figures/``), so it opens from disk with no request leaving the machine. Each section (a suite and
preset on one machine model) shows the harness's validity and the controls first; every table sorts
by a click on a column's header (numbers by value, the rest by text) and follows the page's layer
and family filters (the rows of the chosen layer, and of layers of the chosen write-rule family, stay,
and the controls with them; a row shows where it passes both); a row opens to its provenance (the rows
behind it: seed, run, commit, machine, date, config hash, and the config itself, kept once per section
as JSON in the page); capped, diverged
and at-chance rows are marked. Nothing in it is measured here: it is the rows, laid out.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from memzoo.bench.common import BASELINE, CONTROLS
from memzoo.families import FAMILIES
from memzoo.registry import family_of
from memzoo.storage import write_text

#: words in a row that mark it (the toys' stop column): a statement about the budget, or a failure
MARKS = ("capped", "diverged", "chance")

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 auto; max-width: 1400px; padding: 0 1.5em 3em; color: #222; }
h1 { margin-top: 1em; } h2 { margin-top: 2.2em; border-bottom: 2px solid #ddd; } h3 { font-size: 14px; margin: 1.4em 0 .4em; }
#bar { position: sticky; top: 0; background: #fff; padding: .6em 0; border-bottom: 1px solid #eee; z-index: 2; }
nav a { margin-right: .8em; white-space: nowrap; }
table { border-collapse: collapse; margin: .3em 0 1em; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #ddd; padding: 2px 7px; text-align: right; white-space: nowrap; }
th { background: #f4f4f4; cursor: pointer; user-select: none; } th:first-child, td:first-child { text-align: left; }
th.asc::after { content: " \\25B2"; font-size: 9px; } th.desc::after { content: " \\25BC"; font-size: 9px; }
tr.row { cursor: pointer; } tr.row:hover { background: #f7fbff; }
tr.ctrl td:first-child { font-style: italic; }
tr.capped td:first-child, tr.chance td:first-child { border-left: 4px solid #e0a000; }
tr.diverged td:first-child { border-left: 4px solid #c00; }
tr.prov td { text-align: left; white-space: pre-wrap; background: #fafafa; font: 12px/1.3 ui-monospace, monospace; }
.up { color: #0a7d2c; font-weight: 600; } .down { color: #b00020; font-weight: 600; }
.valid { color: #0a7d2c; } .invalid { color: #b00020; font-weight: 600; } .unchecked { color: #666; }
.prov-line, .lead { color: #555; } img { max-width: 100%; border: 1px solid #eee; margin: .5em 0; }
.note { max-width: 60em; } #overview-table td, #overview-table th { text-align: left; } section { scroll-margin-top: 4.5em; }
"""

SCRIPT = """
function cellKey(td) {
  const t = td.textContent.trim(), m = t.match(/^[-+]?\\d[\\d,]*\\.?\\d*(e[-+]?\\d+)?/i);
  if (!m) return [1, t.toLowerCase()];
  let v = parseFloat(m[0].replace(/,/g, ''));
  const unit = t.slice(m[0].length).match(/^(k|M)\\b/);
  if (unit) v *= unit[1] === 'k' ? 1e3 : 1e6;
  return [0, v];
}
function sortBy(th) {
  const table = th.closest('table'), body = table.tBodies[0], col = th.cellIndex;
  const asc = !th.classList.contains('asc');
  table.querySelectorAll('th').forEach(h => h.classList.remove('asc', 'desc'));
  th.classList.add(asc ? 'asc' : 'desc');
  const pairs = [...body.querySelectorAll('tr.row')].map(r => [r, r.nextElementSibling]);
  pairs.sort((a, b) => {
    const x = cellKey(a[0].cells[col]), y = cellKey(b[0].cells[col]);
    const c = x[0] - y[0] || (x[1] < y[1] ? -1 : x[1] > y[1] ? 1 : 0);
    return asc ? c : -c;
  });
  pairs.forEach(([r, p]) => { body.appendChild(r); if (p && p.classList.contains('prov')) body.appendChild(p); });
}
function filterRows(layer, family) {
  document.querySelectorAll('tr.row').forEach(r => {
    const always = !r.dataset.layer || r.classList.contains('ctrl');
    const keep = always || ((!layer || r.dataset.layer === layer) && (!family || r.dataset.family === family));
    r.hidden = !keep;
    const p = r.nextElementSibling;
    if (p && p.classList.contains('prov') && !keep) p.hidden = true;
  });
}
document.addEventListener('DOMContentLoaded', () => {
  document.querySelectorAll('th').forEach(th => th.addEventListener('click', () => sortBy(th)));
  document.querySelectorAll('tr.row').forEach(r => r.addEventListener('click', () => {
    const p = r.nextElementSibling;
    if (p && p.classList.contains('prov')) { p.hidden = !p.hidden; return; }
    const blob = r.closest('section').querySelector('script.provenance');
    if (!blob) return;  // the overview: its cells link to the sections, whose rows open
    const text = (JSON.parse(blob.textContent)[r.dataset.layer]) || '(no provenance: a row of several layers)';
    const tr = document.createElement('tr'), td = document.createElement('td');
    tr.className = 'prov'; td.colSpan = r.cells.length; td.textContent = text;
    tr.appendChild(td); r.after(tr);
  }));
  const sel = document.getElementById('layer'), fam = document.getElementById('family');
  [sel, fam].forEach(s => s.addEventListener('change', () => filterRows(sel.value, fam.value)));
});
"""


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _cell(value) -> str:
    """A cell's text, its interval marks coloured."""
    text = "" if value is None or (isinstance(value, float) and value != value) else str(value)
    return _esc(text).replace("▲", '<span class="up">▲</span>').replace("▼", '<span class="down">▼</span>')


def _layer_of(table, i) -> str | None:
    """The layer a table row is about (a `layer` column, or a `layer, corpus` one), if any."""
    for col in ("layer", "layer, corpus"):
        if col in table.columns:
            return str(table[col].iloc[i]).split(" ")[0]
    return None


def _json(x) -> str:
    """JSON for a script element: `</` escaped, so no text in it can close the element."""
    return json.dumps(x, sort_keys=True, ensure_ascii=False).replace("</", "<\\/")


def _provenance(rows: list[dict], layer: str) -> str:
    """What a row of a table stands on: every row of the layer in the section, and the config of
    its latest row."""
    mine = sorted((r for r in rows if r["layer"] == layer), key=lambda r: (r["seed"], json.dumps(r["setting"], sort_keys=True)))
    if not mine:
        return "(no rows)"
    lines = [f"{len(mine)} row(s) of {layer}:"]
    for r in mine:
        hw = r["hardware"].get("gpu") or f"{r['hardware']['cpu']} ({r['hardware'].get('threads', '?')} threads)"
        lines.append(f"  seed {r['seed']} {json.dumps(r['setting'], sort_keys=True)}: run {r['run_id']}, commit "
                     f"{r['git_sha'][:12]}, {hw}, torch {r.get('versions', {}).get('torch')}, {r['time']}, "
                     f"config {r['config_hash']}, {r['wall_s']:.0f} s")
    last = max(mine, key=lambda r: (r["time"], r["run_id"]))
    lines.append("config of the latest: " + json.dumps(last.get("config", {}), sort_keys=True))
    return "\n".join(lines)


def _table(table, tid: str, links: dict | None = None) -> list[str]:
    """A table's rows with their layer and family (for the filters) and marks; with `links`
    ((layer, column) -> a section's anchor), those cells link to their sections."""
    import pandas as pd

    if not isinstance(table.index, pd.RangeIndex):
        table = table.reset_index()
    cols = list(table.columns)
    out = [f'<table id="{tid}"><thead><tr>' + "".join(f"<th>{_esc(c)}</th>" for c in cols) + "</tr></thead><tbody>"]
    for i in range(len(table)):
        layer = _layer_of(table, i)
        cells = [table[c].iloc[i] for c in cols]
        text = " ".join(str(v) for v in cells)
        cls = ["row"] + (["ctrl"] if layer in CONTROLS else []) + [m for m in MARKS if m in text]
        attr = f' data-layer="{_esc(layer)}" data-family="{_esc(family_of(layer))}"' if layer else ""
        title = f' title="{_esc(", ".join(m for m in MARKS if m in text))}"' if any(m in text for m in MARKS) else ""
        tds = []
        for c, v in zip(cols, cells):
            anchor = (links or {}).get((layer, c))
            text = _cell(v)
            tds.append(f'<td><a href="#{_esc(anchor)}">{text}</a></td>' if anchor and text else f"<td>{text}</td>")
        out.append(f'<tr class="{" ".join(cls)}"{attr}{title}>' + "".join(tds) + "</tr>")
    out.append("</tbody></table>")
    return out


def write_site(secs: list, rows: list[dict], out: Path, ov=None) -> Path:
    """Write ``out/site/index.html`` for the sections `secs` (:func:`memzoo.bench.report.sections`),
    opening on their overview `ov` (:func:`memzoo.bench.report.overview.overview`); figures are
    linked from ``out/figures``. The same sections give the same bytes."""
    from memzoo.bench.report.overview import NOTE, overview

    ov = ov if ov is not None else overview(secs)
    layers = sorted({r["layer"] for s in secs for r in s.rows if r["layer"] not in CONTROLS},
                    key=lambda n: (n != BASELINE, n))
    labels = list(FAMILIES.values())  # the families of the rows' layers, in FAMILIES' order (a plugin's own last)
    families = sorted({f for n in layers if (f := family_of(n))},
                      key=lambda f: (labels.index(f) if f in labels else len(labels), f))
    body = [
        "<h1>memzoo leaderboard</h1>",
        f"<p>Rendered by <code>memzoo leaderboard</code> from results.jsonl ({len(rows)} rows) and nothing else, as "
        "README.md beside it. Click a column's header to sort, a row to open its provenance; the layer filter keeps "
        "the chosen layer's rows and the controls, the family filter those of the layers of the chosen write-rule "
        "family and the controls; a row shows where it passes both. Rows marked on the left: capped, at chance (a "
        "budget, not a verdict) or diverged.</p>",
        '<div id="bar"><label>Layer: <select id="layer"><option value="">all layers</option>'
        + "".join(f'<option value="{_esc(n)}">{_esc(n)}</option>' for n in layers) + "</select></label> &nbsp; "
        + '<label>Family: <select id="family"><option value="">all families</option>'
        + "".join(f'<option value="{_esc(f)}">{_esc(f)}</option>' for f in families) + "</select></label> &nbsp; <nav>"
        + '<a href="#overview">Overview</a>'
        + "".join(f'<a href="#{_esc(s.anchor)}">{_esc(s.heading.replace("`", ""))}</a>' for s in secs) + "</nav></div>",
        '<section id="overview"><h2>Overview</h2>',
        *(f'<img class="lead-figure" alt="{_esc(p.stem)}" src="{_esc("../" + p.relative_to(out).as_posix())}">'
          for p in ov.figures),
        '<div class="note">' + "".join(f"<p>{_esc(p)}</p>" for p in NOTE.split("\n\n")) + "</div>",
        *_table(ov.table, "overview-table", ov.links),
        "</section>",
    ]
    for i, s in enumerate(secs):
        body.append(f'<section id="{_esc(s.anchor)}"><h2>{_esc(s.heading.replace("`", ""))}</h2>')
        body.append(f'<p class="lead">{_esc(s.lead)}</p>')
        if s.problems is None:
            body.append('<p class="validity unchecked">No harness check for this section (no controls here).</p>')
        elif s.problems:
            body.append('<p class="validity invalid">HARNESS INVALID: ' + _esc("; ".join(s.problems))
                        + " (layer rows withheld)</p>")
        else:
            ctrl = sorted({r["layer"] for r in s.rows if r["layer"] in CONTROLS})
            body.append('<p class="validity valid">Harness valid: the controls (' + _esc(", ".join(ctrl) or "none")
                        + ") pass in every seed.</p>")
        body.append(f'<p class="prov-line">{_esc(s.provenance.strip("*"))}</p>')
        for j, (title, table) in enumerate(s.tables.items()):
            body.append(f"<h3>{_esc(title)}</h3>")
            body += _table(table, f"s{i}t{j}")
        if s.note:
            body.append('<div class="note">' + "".join(f"<p>{_esc(p)}</p>" for p in s.note.split("\n\n")) + "</div>")
        if s.reading:
            body.append("<ul>" + "".join(f"<li>{_esc(x)}</li>" for x in s.reading) + "</ul>")
        for path in s.figures:
            rel = "../" + path.relative_to(out).as_posix()
            body.append(f'<img alt="{_esc(path.stem)}" src="{_esc(rel)}">')
        prov = {n: _provenance(s.rows, n) for n in sorted({r["layer"] for r in s.rows})}
        body.append(f'<script type="application/json" class="provenance">{_json(prov)}</script>')
        body.append("</section>")
    page = ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>memzoo leaderboard</title>"
            f"<meta name=\"viewport\" content=\"width=device-width\"><style>{STYLE}</style></head><body>\n"
            + "\n".join(body) + f"\n<script>{SCRIPT}</script>\n</body></html>\n")
    path = out / "site" / "index.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, page)
