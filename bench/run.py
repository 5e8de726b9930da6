"""`memzoo bench`: run suites on the baseline and the named layers, record, print the tables.

    memzoo bench --layers fwpkm,mom,lact                      # tiny preset, all suites
    memzoo bench --layers all --suite ppl,niah --seed 1
    memzoo bench --suite cost --preset paper                  # Table 2 beside the paper

Rows are appended to ``<out>/results.jsonl`` as they are measured (a killed run keeps what
it finished); trained LMs are cached in the work dir (``runs/bench/<preset>``), so running
another suite later reuses them. ``memzoo leaderboard`` renders the published tables.

On a CPU the layers are shared out among ``--jobs`` worker processes (default: one per core,
each with one thread): tiny models keep one core busy but gain little from a second, so two
single-thread workers finish the default comparison in about half the time of one process
with two threads. Every number a worker measures is independent of the others (same seeds,
same data), only wall times and throughput see the neighbour.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

from memzoo.bench.common import BASELINE, SUITES, Context, Recorder, check_layers, load_preset
from memzoo.config import ConfigError

ORDER = ("cost", "toys", "ppl", "niah")  # cheapest first; ppl and niah share the trained LMs
# relative CPU cost of a layer's suites (measured on the tiny preset), to share layers out evenly
COST = {"baseline": 1.0, "linear": 1.1, "pkm": 1.3, "ba": 1.5, "fwmlp": 1.4, "fwl": 1.6, "fwpkm": 1.6, "lact": 1.6, "mom": 2.0}


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


def share_out(layers: list[str], jobs: int) -> list[list[str]]:
    """Layers in `jobs` groups of about equal cost (longest first onto the lightest group)."""
    groups: list[list[str]] = [[] for _ in range(jobs)]
    load = [0.0] * jobs
    for layer in sorted(layers, key=lambda n: -COST.get(n, 1.5)):
        i = load.index(min(load))
        groups[i].append(layer)
        load[i] += COST.get(layer, 1.5)
    return [g for g in groups if g]


def _work(ctx: Context, layers: list[str], todo: list[str], done=None) -> None:
    """Layer by layer (each layer's LM is trained once, then used by ppl and niah), suite by suite."""
    for layer in layers:
        for s in todo:
            suite_module(s).run(ctx, [layer])
            if done is not None:
                done.put((layer, s))


def _worker(args: dict, layers: list[str], todo: list[str], threads: int, done) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    p = load_preset(args["preset"])
    rec = Recorder(args["out"], p.name, args["seed"], run_id=args["run_id"])
    _work(Context(p, args["seed"], rec, Path(args["work_dir"]), args["device"], progress=False), layers, todo, done)


def run_bench(
    layers: str | None,
    suites: str | None = None,
    preset: str = "tiny",
    seed: int = 0,
    out: str | Path = "leaderboards",
    work_dir: str | Path | None = None,
    device: str = "cpu",
    progress: bool = True,
    jobs: int = 0,
) -> list[dict]:
    """Run the suites and return the recorded rows (also appended to <out>/results.jsonl).
    `jobs`: worker processes (0 = one per CPU core on CPU, 1 on CUDA). Bad arguments (a
    negative `jobs`, an unavailable device, an unwritable `out` or `work_dir`) fail at once."""
    import multiprocessing as mp
    import os

    import torch
    from tqdm.auto import tqdm

    from memzoo.bench.common import read_results
    from memzoo.storage import ensure_writable_dir
    from memzoo.train import resolve_device

    if jobs < 0:
        raise ConfigError(f"--jobs must be >= 0 (0: one per CPU core on CPU, 1 on CUDA), got {jobs}")
    device = resolve_device(device)
    torch.set_flush_denormal(True)  # GDN's strong decays make subnormals, ~10x slower on CPU
    names, todo, p = parse_layers(layers), parse_suites(suites), load_preset(preset)
    for s in todo:  # check every suite's settings before spending minutes on the first
        mod = suite_module(s)
        p.settings(mod.NAME, mod.Settings)
    cores = os.cpu_count() or 1
    jobs = jobs or (1 if device != "cpu" else cores)
    groups = share_out(names, max(1, min(jobs, len(names))))
    rec = Recorder(ensure_writable_dir(out), p.name, seed)
    work_dir = ensure_writable_dir(work_dir or Path("runs") / "bench" / p.name)
    print(f"memzoo bench: preset {p.name}, seed {seed}, layers {', '.join(names)}, suites {', '.join(todo)}"
          + (f", {len(groups)} workers: " + " | ".join(",".join(g) for g in groups) if len(groups) > 1 else ""))
    t0 = time.time()
    if len(groups) == 1:
        _work(Context(p, seed, rec, work_dir, device, progress), names, todo)
    else:
        ctx = mp.get_context("spawn")
        done = ctx.Queue()
        args = {"preset": p.source, "seed": seed, "out": str(out), "work_dir": str(work_dir), "device": device,
                "run_id": rec.run_id}
        threads = max(1, cores // len(groups))
        procs = [ctx.Process(target=_worker, args=(args, g, todo, threads, done)) for g in groups]
        for proc in procs:
            proc.start()
        bar = tqdm(total=len(names) * len(todo), desc="bench (layer, suite)", disable=not progress)
        finished = 0
        while finished < len(names) * len(todo):
            try:
                layer, s = done.get(timeout=5)
            except Exception:  # queue.Empty: check that no worker died
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    for proc in procs:
                        proc.kill()
                    raise RuntimeError("a bench worker failed (its traceback is above); rows measured so far are kept")
                continue
            finished += 1
            bar.set_postfix_str(f"{layer} {s} done, {time.time() - t0:.0f} s")
            bar.update(1)
        bar.close()
        for proc in procs:
            proc.join()
        rec.rows = [r for r in read_results(rec.path) if r["run_id"] == rec.run_id]
    print(f"\nmemzoo bench: {len(rec.rows)} rows in {time.time() - t0:.0f} s -> {rec.path}\n")
    print_tables(rec.rows)
    return rec.rows


def print_tables(rows: list[dict]) -> None:
    from memzoo.bench.leaderboard import markdown, suite_tables

    for suite, preset, title, table in suite_tables(rows):
        print(f"### {suite} ({preset}): {title}\n")
        print(markdown(table))
        print()
