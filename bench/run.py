"""`memzoo bench`: run suites on the baseline and the named layers, record, print the tables.

    memzoo bench --layers fwpkm,mom,lact                      # tiny preset, all suites
    memzoo bench --layers all --suite ppl,niah --seed 1
    memzoo bench --suite cost --preset paper                  # Table 2 beside the paper

Rows are appended to ``<out>/results.jsonl`` as they are measured (a killed run keeps what
it finished); trained LMs are cached in the work dir (``runs/bench/<preset>``), so running
another suite later reuses them. ``memzoo leaderboard`` renders the published tables.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

from memzoo.bench.common import BASELINE, SUITES, Context, Recorder, check_layers, load_preset
from memzoo.config import ConfigError

ORDER = ("cost", "toys", "ppl", "niah")  # cheapest first; ppl and niah share the trained LMs


def suite_module(name: str):
    return importlib.import_module(f"memzoo.bench.{name}")


def parse_suites(spec: str | None) -> list[str]:
    if not spec or spec == "all":
        return list(ORDER)
    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in SUITES]
    if bad:
        raise ConfigError(f"unknown suite(s) {', '.join(map(repr, bad))}; valid suites: {', '.join(ORDER)} (or all)")
    return [s for s in ORDER if s in names]


def parse_layers(spec: str | None) -> list[str]:
    from memzoo.registry import layer_names

    if spec is None or spec.strip() == "":
        return [BASELINE]
    names = layer_names() if spec.strip().lower() == "all" else spec.split(",")
    return [BASELINE, *check_layers(names)]


def run_bench(
    layers: str | None,
    suites: str | None = None,
    preset: str = "tiny",
    seed: int = 0,
    out: str | Path = "leaderboards",
    work_dir: str | Path | None = None,
    device: str = "cpu",
    progress: bool = True,
) -> list[dict]:
    """Run the suites and return the recorded rows (also appended to <out>/results.jsonl)."""
    import torch

    torch.set_flush_denormal(True)  # GDN's strong decays make subnormals, ~10x slower on CPU
    names, todo, p = parse_layers(layers), parse_suites(suites), load_preset(preset)
    for s in todo:  # check every suite's settings before spending minutes on the first
        mod = suite_module(s)
        p.settings(mod.NAME, mod.Settings)
    ctx = Context(
        preset=p,
        seed=seed,
        recorder=Recorder(out, p.name, seed),
        work_dir=Path(work_dir or Path("runs") / "bench" / p.name),
        device=device,
        progress=progress,
    )
    print(f"memzoo bench: preset {p.name}, seed {seed}, layers {', '.join(names)}, suites {', '.join(todo)}")
    t0 = time.time()
    for s in todo:
        ts = time.time()
        print(f"\n== {s} ==", flush=True)
        suite_module(s).run(ctx, names)
        print(f"{s}: {time.time() - ts:.0f} s", flush=True)
    print(f"\nmemzoo bench: {len(ctx.recorder.rows)} rows in {time.time() - t0:.0f} s -> {ctx.recorder.path}\n")
    print_tables(ctx.recorder.rows)
    return ctx.recorder.rows


def print_tables(rows: list[dict]) -> None:
    from memzoo.bench.leaderboard import suite_tables

    for suite, preset, title, table in suite_tables(rows):
        print(f"### {suite} ({preset}): {title}\n")
        print(table.to_markdown())
        print()
