"""The leaderboard's web page (leaderboards/site/index.html) in a real browser: headless Chromium,
driven by selenium, loads the published page from disk. No console error, every published
section, sorting, the layer filter, a row's provenance, a screenshot that is not blank, and no
request that leaves the machine; the family filter on a page this checkout renders. Needs Debian's chromium and chromium-driver and the selenium
package (`.ci/run` installs them); skipped without them, except under CI, where it fails."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "leaderboards" / "site" / "index.html"


def _driver():
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromium-driver are not installed (.ci/run installs them)")
        pytest.skip("needs Debian's chromium and chromium-driver")
    try:
        from selenium import webdriver
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("needs selenium (pip install 'memzoo[test]')")
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.binary_location = shutil.which("chromium")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    return webdriver.Chrome(options=opts, service=service)


@pytest.fixture(scope="module")
def browser():
    d = _driver()
    d.get(PAGE.as_uri())
    yield d
    d.quit()


def _visible_rows(table):
    return [r for r in table.find_elements("css selector", "tbody tr.row") if r.is_displayed()]


def test_the_page_loads_with_every_section_and_no_error_or_request_off_the_machine(browser, tmp_path):
    from PIL import Image

    headings = [h.text for h in browser.find_elements("css selector", "section > h2")]
    published = [h[3:].replace("`", "") for h in (ROOT / "leaderboards" / "README.md").read_text().splitlines()
                 if h.startswith("## ") and h != "## Runs"]
    assert headings == published and len(headings) >= 5
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
    urls = []
    for entry in browser.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    assert urls and all(u.startswith(("file://", "data:")) for u in urls), [u for u in urls if not u.startswith("file")]
    imgs = browser.find_elements("css selector", "img")
    assert imgs and all(browser.execute_script("return arguments[0].naturalWidth", i) > 0 for i in imgs)  # loaded
    shot = tmp_path / "page.png"
    browser.find_element("css selector", "section").screenshot(str(shot))
    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20  # text, tables and marks, not a blank page


def test_the_page_opens_on_the_overview_whose_cells_link_to_their_sections(browser):
    """The first section and table are the overview; every linked cell lands on a section that
    holds a row of the cell's layer, and following one scrolls there."""
    assert browser.find_element("css selector", "section").get_attribute("id") == "overview"
    first = browser.find_element("css selector", "table")
    assert first.get_attribute("id") == "overview-table"
    header = [h.text for h in first.find_elements("css selector", "th")]
    assert header[:2] == ["layer", "family"] and any(h.startswith("recall") for h in header)
    checked = browser.execute_script("""
        const out = [];
        document.querySelectorAll('#overview-table td a').forEach(a => {
          const layer = a.closest('tr').dataset.layer, id = a.getAttribute('href').slice(1);
          const sec = document.getElementById(id);
          out.push([layer, id, !!sec && sec.tagName === 'SECTION' && id !== 'overview'
                    && !!sec.querySelector(`tr.row[data-layer="${CSS.escape(layer)}"]`)]);
        });
        return out;""")
    assert len(checked) > 20 and all(ok for *_, ok in checked), [c for c in checked if not c[2]][:5]
    assert {"baseline", "ctrl:attention"} <= {layer for layer, *_ in checked}
    layer, target, _ = next(c for c in checked if c[0] == "mom")
    link = first.find_element("css selector", f'tr[data-layer="mom"] a[href="#{target}"]')
    link.click()
    assert browser.execute_script("return location.hash") == f"#{target}"
    top = browser.execute_script(f"return document.getElementById('{target}').getBoundingClientRect().top")
    assert 0 <= top < 200  # scrolled to its section (below the sticky filter bar)
    browser.execute_script("window.scrollTo(0, 0)")


def test_the_page_shows_recall_against_state_above_the_fold(browser):
    """The state sweep's figure opens the overview: loaded, and within the first screen of the page."""
    browser.execute_script("window.scrollTo(0, 0)")
    fig = browser.find_element("css selector", "#overview img.lead-figure")
    assert fig.get_attribute("alt") == "toys_mqar_state"
    assert browser.execute_script("return arguments[0].naturalWidth", fig) > 0  # the image loaded
    top, height = browser.execute_script("return [arguments[0].getBoundingClientRect().top, window.innerHeight]", fig)
    assert 0 <= top < height  # above the fold
    overview = browser.find_element("id", "overview-table")
    header = [h.text for h in overview.find_elements("css selector", "th")]
    assert "recall: smallest state at 0.9" in header
    cells = browser.execute_script("""return [...document.querySelectorAll('#overview-table td a')]
        .filter(a => a.textContent.includes('cap ')).map(a => a.textContent)""")
    assert cells and all(c.endswith("(recall-state)") for c in cells)  # the recall column names one preset


def test_the_readme_opens_on_the_overview_whose_links_name_its_sections():
    text = (ROOT / "leaderboards" / "README.md").read_text()
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads[0] == "## Overview"
    ids = set(re.findall(r'<a id="([^"]+)"></a>', text))
    overview = text.split("## Overview", 1)[1].split("<a id=", 1)[0]
    targets = set(re.findall(r"\]\(#([^)]+)\)", overview))
    assert len(targets) >= 5 and targets <= ids


def test_sorting_a_column_reorders_its_rows(browser):
    table = browser.find_element("css selector", "section:not(#overview) table")
    header = table.find_elements("css selector", "th")
    col = next(i for i, h in enumerate(header) if h.text.strip() in ("mean", "params (M)", "tokens/s", "params"))
    before = [r.find_elements("css selector", "td")[col].text for r in _visible_rows(table)]
    header[col].click()
    after = [r.find_elements("css selector", "td")[col].text for r in _visible_rows(table)]
    num = [float(re.match(r"[-+]?[\d.]+", v.replace(",", "")).group()) for v in after]
    assert sorted(before) == sorted(after) and num == sorted(num)  # the same rows, ascending
    header[col].click()
    again = [r.find_elements("css selector", "td")[col].text for r in _visible_rows(table)]
    assert again == after[::-1] or [float(re.match(r"[-+]?[\d.]+", v.replace(",", "")).group()) for v in again] == sorted(num, reverse=True)


def test_filtering_to_one_layer_leaves_its_rows_and_the_controls(browser):
    from selenium.webdriver.support.ui import Select

    layer = "linear"
    Select(browser.find_element("id", "layer")).select_by_value(layer)
    shown = [r for r in browser.find_elements("css selector", "tr.row[data-layer]") if r.is_displayed()]
    kinds = {r.get_attribute("data-layer") for r in shown}
    assert layer in kinds and kinds <= {layer, "ctrl:attention", "ctrl:none"}
    Select(browser.find_element("id", "layer")).select_by_value("")
    assert len([r for r in browser.find_elements("css selector", "tr.row[data-layer]") if r.is_displayed()]) > len(shown)


@pytest.fixture(scope="module")
def family_page(tmp_path_factory):
    """A page rendered by this checkout (the published one may predate the family filter): the
    published toys rows of the long-budget preset (a delta-rule layer, mom; Hebbian ones, linear and
    ba; the controls and the baseline), with mom's rows copied as deltanet's, a second delta-rule
    layer."""
    from memzoo.bench.report import render
    from memzoo.bench.report.toys import LONG

    rows = [json.loads(line) for line in (ROOT / "leaderboards" / "results.jsonl").read_text().splitlines()
            if '"suite": "toys"' in line and f'"preset": "{LONG}"' in line]
    rows += [{**r, "layer": "deltanet"} for r in rows if r["layer"] == "mom"]
    assert {"mom", "deltanet", "linear", "ctrl:attention", "ctrl:none"} <= {r["layer"] for r in rows}
    d = _driver()  # (skips without a browser before rendering anything)
    out = tmp_path_factory.mktemp("family")
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    render(out / "results.jsonl")
    d.get((out / "site" / "index.html").as_uri())
    yield d
    d.quit()


def test_filtering_to_one_family_leaves_its_layers_rows_and_the_controls(family_page):
    from selenium.webdriver.support.ui import Select

    family = Select(family_page.find_element("id", "family"))
    assert [o.text for o in family.options][:3] == ["all families", "Hebbian outer product", "delta rule"]
    everything = [r for r in family_page.find_elements("css selector", "tr.row[data-layer]") if r.is_displayed()]
    family.select_by_visible_text("delta rule")
    rows = family_page.find_elements("css selector", "tr.row[data-layer]")
    shown = [r for r in rows if r.is_displayed()]
    kinds = {r.get_attribute("data-layer") for r in shown}
    assert kinds == {"mom", "deltanet", "ctrl:attention", "ctrl:none"}
    layers = [r for r in shown if not r.get_attribute("data-layer").startswith("ctrl:")]
    assert all(r.get_attribute("data-family") == "delta rule" for r in layers)
    first = family_page.find_element("css selector", "section:not(#overview) table")  # the first section's first table
    col = [h.text for h in first.find_elements("css selector", "th")].index("family")
    assert {r.find_elements("css selector", "td")[col].text for r in _visible_rows(first)
            if r.get_attribute("data-layer") == "mom"} == {"delta rule"}
    linear = [r for r in rows if r.get_attribute("data-layer") == "linear"]
    assert linear and not any(r.is_displayed() for r in linear)  # a Hebbian layer's rows are hidden
    assert all(r.get_attribute("data-family") == "Hebbian outer product" for r in linear)
    layer = Select(family_page.find_element("id", "layer"))
    layer.select_by_value("linear")  # the two filters combine: a Hebbian layer in the delta family is no row
    assert {r.get_attribute("data-layer") for r in rows if r.is_displayed()} == {"ctrl:attention", "ctrl:none"}
    layer.select_by_value("")
    family.select_by_value("")
    assert [r for r in family_page.find_elements("css selector", "tr.row[data-layer]") if r.is_displayed()] == everything


def test_a_row_opens_its_provenance(browser):
    row = next(r for r in browser.find_elements("css selector", "section:not(#overview) tr.row[data-layer]")
               if r.is_displayed())
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", row)
    row.click()
    prov = row.find_element("xpath", "following-sibling::tr[1]")
    assert "prov" in prov.get_attribute("class") and prov.is_displayed()
    assert "run " in prov.text and "commit " in prov.text and "config of the latest" in prov.text
    row.click()
    assert not prov.is_displayed()


def test_a_torn_last_line_and_an_unknown_suite_still_write_the_page(tmp_path):
    """As the Markdown does: a warning for each, and the page of the rest."""
    from memzoo.bench.report import render

    rows = [json.loads(line) for line in (ROOT / "leaderboards" / "results.jsonl").read_text().splitlines()
            if '"suite": "cost"' in line and '"preset": "tiny"' in line][:3]
    assert rows
    odd = {**rows[0], "suite": "speed", "run_id": "x"}
    text = "".join(json.dumps(r) + "\n" for r in [*rows, odd]) + json.dumps(rows[0])[:40]
    (tmp_path / "results.jsonl").write_text(text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = render(tmp_path / "results.jsonl")
    said = " ".join(str(w.message) for w in caught)
    assert "the last line is not a whole row" in said and "unknown suite(s) speed" in said
    page = (tmp_path / "site" / "index.html").read_text()
    assert tmp_path / "site" / "index.html" in paths and "cost — preset tiny" in page and "speed" not in page
