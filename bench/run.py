"""`memzoo bench`: run suites on the baseline and the named layers, record, print the tables.

    memzoo bench --layers fwpkm,mom,lact                      # tiny preset, all suites
    memzoo bench --layers all --suite ppl,niah --seed 1
    memzoo bench --suite cost --preset paper                  # Table 2 beside the paper

Rows are appended to ``<out>/results.jsonl`` as they are measured (a killed run keeps what
it finished); trained LMs are cached in the work dir (``runs/bench/<preset>``), so running
another suite later reuses them. ``memzoo leaderboard`` renders the published tables.

On a CPU the run is cut into jobs (each toy cell; each layer's other suites, in order), which
``--jobs`` worker processes (default: one per core, each with one thread) take from one queue
as they become free, the baseline's first and then the costliest: tiny models keep one core
busy but gain little from a second, so two single-thread workers finish the default comparison
in about half the time of one process with two threads. Every number a worker measures is
independent of the others (same seeds, same data), only wall times and throughput see the
neighbour. The workers share one torch.compile cache, kept in the work dir for the next run (`compile_cache`).

Progress is one bar over all workers, in units of work known before the first starts: training
steps (the toys' and the shared LMs') and evaluated cells (ppl's corpus and mode, NIAH's samples);
with an ETA and, after it, what each worker is doing. The models the cost suite times, alone and
first, have a bar of their own before it (a model timed takes many training steps' time: on one
bar its rate would set the ETA).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from memzoo.bench.common import (BASELINE, Context, Recorder, check_layers, compile_cache, load_preset, published_rows,
                                  read_results)
from memzoo.bench.report import print_closing, print_notes, print_tables
from memzoo.bench.suites import NAMES, get_suite
from memzoo.config import ConfigError


def parse_suites(spec: str | None) -> list[str]:
    if not spec or spec == "all":
        return list(NAMES)
    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in NAMES]
    if bad:
        raise ConfigError(f"unknown suite(s) {', '.join(map(repr, bad))}; valid suites: {', '.join(NAMES)} (or all)")
    return [s for s in NAMES if s in names]


def parse_layers(spec: str | None) -> list[str]:
    from memzoo.registry import layer_names

    if spec is None or spec.strip() == "":
        return [BASELINE]
    names = layer_names() if spec.strip().lower() == "all" else spec.split(",")
    return [BASELINE, *check_layers(names)]


def bench_cost(layer: str) -> float:
    """The relative CPU cost of a layer's suites (the baseline's is 1): its class's `bench_cost`
    (measured on the tiny preset), 1.5 for a layer that does not say."""
    from memzoo.registry import get_layer

    return 1.0 if layer == BASELINE else getattr(get_layer(layer.split("/")[0]), "bench_cost", 1.5)


@dataclass(frozen=True)
class Job:
    """What one worker takes whole: a suite's part for one layer (a toy cell), or the layer's
    suites that have no parts, in order (ppl and niah share the layer's LM: one job trains it)."""

    layer: str
    suites: tuple[str, ...]
    part: tuple | None = None
    cost: float = 1.0  # relative, for the order only
    group: tuple | None = None  # the jobs that compile the same graphs (a toy cell's other seeds)

    def run(self, ctx: Context) -> None:
        """Run the job's suites; one that raises is recorded as failed (`Context.fail`) and the
        run goes on."""
        for s in self.suites:
            try:
                if self.part is None:
                    get_suite(s).run(ctx, [self.layer])
                else:
                    get_suite(s).run(ctx, [self.layer], only=[self.part])
            except Exception as e:
                ctx.fail(s, self.layer, self.part, e)


def plan(ctx: Context, layers: list[str], todo: list[str]) -> list[Job]:
    """Every job of a run, in the order the workers take them from one queue: the baseline's
    first, so that a run cut short holds the reference rows (and the toys' controls, which run
    with it); then the others costliest first, so that the last jobs taken, the short ones,
    even out when the workers finish (a static share of layers per worker does not). A job's
    cost is its units of work (a suite's parts say their own) times its layer's `bench_cost`.
    Within each of the two, the first job of every group goes before the second of any: the jobs
    of a group compile the same graphs, and the later ones load them from the run's cache
    (`compile_cache`) once the first has compiled them, where queued side by side two workers
    would compile them at once. (The measurements behind both: docs/journal/bench.md.)"""
    jobs = []
    for layer in layers:
        whole = []
        for s in todo:
            suite = get_suite(s)
            if s in ALONE:
                jobs.append(Job(layer, (s,), None, work_units(ctx, [layer], [s]) * bench_cost(layer)))
            elif suite.parts is not None:
                w = bench_cost(layer)
                jobs += [Job(layer, (s,), part, c * w, group) for part, c, group in suite.parts(ctx, layer)]
            else:
                whole.append(s)
        if whole:
            jobs.append(Job(layer, tuple(whole), None, work_units(ctx, [layer], whole) * bench_cost(layer)))
    seen, later = set(), []
    for j in jobs:
        later.append(j.group is not None and j.group in seen)
        seen.add(j.group)
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].layer != BASELINE, later[i], -jobs[i].cost))
    return [jobs[i] for i in order]  # stable: ties keep the run order


#: the preset a run without --preset measures, by device: minutes on a 2-core CPU, or on one GPU
DEFAULT_PRESETS = {"cpu": "tiny", "cuda": "gpu"}

#: how the bench runs its jobs: the embedded process pool on this machine, or Ray tasks on a cluster
ENGINES = ("pool", "ray")

#: suites whose measurements are timings: the bench runs them first, in its own process, with every
#: core and no worker busy (a cost row timed beside a training worker measured the neighbour too)
ALONE = ("cost",)


def work_units(ctx: Context, layers: list[str], todo: list[str]) -> int:
    """The units of work of `todo` on `layers`: every suite's `work`, plus the training steps of
    each layer's shared LM where a suite evaluates it and it is not cached yet."""
    from memzoo.bench.lm import untrained_steps

    suites = [get_suite(s) for s in todo]
    lm = [su.name for su in suites if su.uses_lm]
    return sum(sum(su.work(ctx, layer) for su in suites) + untrained_steps(ctx, layer, lm) for layer in layers)


def exit_with(parent: int, poll_s: float = 1.0) -> None:
    """End this process when `parent` is gone (killed, even by SIGKILL, which no handler sees):
    a bench worker left behind would go on appending rows. A daemon thread watches the
    parent id, which changes when the parent dies and the process is re-parented."""
    import os
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _worker(args: dict, wid: int, jobs, threads: int, queue) -> None:
    """A worker process: runs (index, job) items from the `jobs` queue until it holds None,
    reporting ("start", wid, index, "") as it takes a job, ("work", wid, units, doing) for each
    unit of work, then ("end", wid, 0, ""). A worker that dies (killed mid-cell) has its job
    recorded failed by the bench, which starts another in its place. It ends with
    the bench process that started it. Its compile cache is the run's (the environment's: `compile_cache`)."""
    import signal

    import torch

    from memzoo.cpu import tune_cpu

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the terminal's whole group: the bench stops its workers
    exit_with(args["parent"])
    torch.set_num_threads(threads)
    tune_cpu()
    p = load_preset(args["preset"])
    rec = Recorder(args["out"], p.name, args["seed"], run_id=args["run_id"])
    ctx = Context(p, args["seed"], rec, Path(args["work_dir"]), args["device"], progress=False,
                  on_work=lambda units, doing: queue.put(("work", wid, units, doing)), resume=args["resume"])
    for i, job in iter(jobs.get, None):
        queue.put(("start", wid, i, ""))  # the bench records this job failed if the worker dies in it
        job.run(ctx)
    queue.put(("end", wid, 0, ""))


def published_beside(out: Path) -> list[dict]:
    """The rows a run's notes read as published: its out file's, and the checkout's leaderboard
    (`published_rows`) where the run wrote elsewhere (``--out``), so that a run in a folder of its
    own still finds the published long-budget verdicts."""
    rows = read_results(out)
    if (pub := published_rows()) is not None and pub.resolve() != Path(out).resolve():
        rows += read_results(pub)
    return rows


def run_bench(layers: str | None, suites: str | None = None, preset: str | None = None, seed: int = 0,
              out: str | Path = "leaderboards", work_dir: str | Path | None = None, device: str = "auto",
              progress: bool = True, jobs: int | None = None, resume: bool = False, engine: str = "pool",
              address: str | None = None, dry_run: bool = False) -> list[dict]:
    """Run the suites and return the recorded rows (also appended to <out>/results.jsonl).
    `preset`: a shipped name or a file; None: the default for the device, `tiny` on a CPU, `gpu`
    on CUDA (said in one line). `device`: cpu, cuda, cuda:N or auto (cuda where available).
    `jobs`: worker processes (None: one per CPU core on CPU, 1 on CUDA); with `engine` "ray", the
    most tasks at once (None: as many as the cluster's resources allow). `engine`: "pool", the
    embedded process pool, or "ray", each job a Ray task on the cluster at `address`
    (`memzoo.bench.ray_engine`). `resume`: a measurement already in <out>/results.jsonl with the
    same config (`protocol_hash`) and seed is skipped (the toys' cells; the ppl and niah suites' LMs, each once
    all its cells are recorded), so a killed run continues where it stopped. Bad arguments (a `jobs`
    below 1, a negative `seed`, an unavailable device, an unwritable `out` or `work_dir`) fail at once.
    `dry_run`: print the jobs, what is recorded and an estimate of the time (`memzoo.bench.dry_run`),
    run nothing and write nothing; the device need not be present."""
    import os

    from memzoo.cpu import tune_cpu
    from memzoo.storage import ensure_writable_dir

    _check_arguments(jobs, seed, engine, address)
    device = _device(device, engine, dry_run)
    resume = resume or dry_run  # a dry run marks the cells results.jsonl holds
    tune_cpu()
    p = load_preset(preset or _default_preset(device))
    names, todo = parse_layers(layers), parse_suites(suites or ",".join(p.default_suites))
    _check_run(p, names, todo, device, dry_run)
    rec = Recorder(Path(out) if dry_run else ensure_writable_dir(out), p.name, seed)
    work_dir = Path(work_dir or Path("runs") / "bench" / p.name)
    ctx = Context(p, seed, rec, work_dir if dry_run else ensure_writable_dir(work_dir), device, progress, resume=resume)
    queued = plan(ctx, names, todo)
    alone = [j for j in queued if j.suites[0] in ALONE]  # timed first, nothing else running
    queued = [j for j in queued if j.suites[0] not in ALONE]
    workers = 1 if engine == "ray" else max(1, min(jobs or (1 if device != "cpu" else os.cpu_count() or 1), len(queued)))
    total = work_units(ctx, names, todo)
    _say(ctx, names, todo, alone, queued, workers if not dry_run else jobs, engine, total, dry_run)
    if dry_run:
        return []
    t0 = time.time()
    timed = work_units(ctx, names, [s for s in todo if s in ALONE]) if alone else 0
    bars = Progress(total, timed, workers, progress, bool(queued))
    compile_cache(ctx.work_dir)
    ctx.on_work = lambda units, what: bars.show(0, units, what)
    execute(ctx, alone, bars)
    bars.next()
    execute(ctx, queued, bars, engine, workers, address, max_tasks=jobs)
    bars.close()
    _print_end(rec, names, todo, resume, time.time() - t0)
    return rec.rows


def _say(ctx: Context, names: list[str], todo: list[str], alone: list, queued: list, workers: int | None, engine: str,
         total: int, dry_run: bool) -> None:
    """The run's first line: preset, seed, layers, suites, jobs, workers and units of work; for a dry
    run the line and the plan (`memzoo.bench.dry_run`), with an estimate of the time."""
    p, jobs = ctx.preset, len(alone) + len(queued)
    head = f"preset {p.name}" + (f" on {ctx.device}" if dry_run else "") + f", seed {ctx.seed}, layers {', '.join(names)}, " \
           f"suites {', '.join(todo)}; {jobs} jobs"
    if dry_run:
        from memzoo.bench.dry_run import print_plan

        print(f"memzoo bench --dry-run: {head}; {total} units of work; nothing is run\n")
        return print_plan(ctx, alone + queued, ctx.device, workers if workers and workers > 1 else None)
    print(f"memzoo bench: {head}" + (f" ({len(alone)} timed alone first)" if alone and queued else "")
          + (f" for {workers} workers" if workers > 1 else "") + (" as Ray tasks" if engine == "ray" else "")
          + f"; {total} units of work (training steps, evaluated cells, measured models)")


def _check_arguments(jobs: int | None, seed: int, engine: str, address: str | None) -> None:
    """Bad arguments fail at once, before any import of the harness or any work."""
    if jobs is not None and jobs < 1:
        raise ConfigError(f"--jobs must be >= 1 (leave it out: one per CPU core on CPU, 1 on CUDA), got {jobs}")
    if seed < 0:
        raise ConfigError(f"--seed must be >= 0 (seeds N, N+1, ... are used), got {seed}")
    if engine not in ENGINES:
        raise ConfigError(f"--engine {engine!r}: one of {', '.join(ENGINES)}")
    if address and engine != "ray":
        raise ConfigError("--address names a Ray cluster: give it with --engine ray")
    if engine == "ray":
        from memzoo.bench.ray_engine import import_ray

        import_ray()  # not installed: one line saying how, before any work


def _device(device: str, engine: str, dry_run: bool) -> str:
    """The device the run measures on: a dry run plans for one this machine may lack, and Ray tasks
    run on the cluster's GPUs (ray_engine checks that it has one); otherwise it must be here."""
    import torch

    from memzoo.train import resolve_device

    if dry_run:
        return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if engine == "ray" and device.startswith("cuda") and not torch.cuda.is_available():
        return device
    return resolve_device(device)


def _default_preset(device: str) -> str:
    """The preset a run without --preset measures on `device` (said in one line on a GPU)."""
    preset = DEFAULT_PRESETS["cuda" if device.startswith("cuda") else "cpu"]
    if device.startswith("cuda"):
        print(f"memzoo bench: CUDA is available: preset {preset}, the default on a GPU (--preset tiny runs the "
              f"CPU's default; --device cpu keeps off the GPU)")
    return preset


def _check_run(p, names: list[str], todo: list[str], device: str, dry_run: bool) -> None:
    """Every suite's settings, and a variant named alone, checked before minutes are spent on the first."""
    import torch

    if ALONE[0] in todo and device.startswith("cuda") and not dry_run and not torch.cuda.is_available():
        raise ConfigError(f"--suite {ALONE[0]} times on this machine, which has no CUDA device; leave it out here "
                          f"(the Ray tasks run the other suites on the cluster's GPUs)")
    for s in todo:
        p.settings(s, get_suite(s).settings)
    if variants := [n for n in names if "/" in n]:  # a variant alone, e.g. fwpkm/token (toys), fwpkm/seq (niah)
        if others := [s for s in todo if s not in ("toys", "niah")]:
            raise ConfigError(f"--layers {variants[0]}: a variant is a row of the toys or niah suite, not of {others[0]}; "
                              f"run it with --suite toys or --suite niah")
        for s in todo:
            defined = p.settings(s, get_suite(s).settings).variants
            if bad := [n for n in variants if n not in defined]:
                raise ConfigError(f"--layers {bad[0]}: preset {p.name} defines no such {s} variant; it defines "
                                  f"{', '.join(defined) or 'none'}")


class Progress:
    """The run's progress: a bar of the jobs timed alone (models), then one of the rest (units of
    work) with what each worker is doing; `show` is what every engine reports to."""

    def __init__(self, total: int, timed: int, workers: int, shown: bool, more: bool):
        self.total, self.timed, self.workers, self.shown, self.more = total, timed, workers, shown, more
        self.doing = [""] * workers
        self.lanes = 1 if timed else workers  # per worker once the workers run
        self.bar = self._bar(timed, "timed alone", "model") if timed else self._bar(total, "bench", "unit")

    def _bar(self, units: int, desc: str, unit: str, shown: bool = True):
        from tqdm.auto import tqdm

        return tqdm(total=units, desc=desc, unit=unit, smoothing=0, dynamic_ncols=True, disable=not (self.shown and shown))

    def show(self, wid: int, units: int, what: str) -> None:
        self.doing[wid] = what
        self.bar.set_postfix_str(" | ".join(f"{i + 1}: {d}" if self.lanes > 1 else d
                                            for i, d in enumerate(self.doing[:self.lanes])), refresh=False)
        self.bar.update(units)

    def next(self) -> None:
        """The jobs timed alone are done: the bar of the rest."""
        if self.timed:
            self.bar.close()
            self.bar = self._bar(self.total - self.timed, "bench", "unit", shown=self.more)
            self.doing[0], self.lanes = "", self.workers

    def close(self) -> None:
        self.bar.close()


def execute(ctx: Context, jobs: list, progress: Progress, engine: str = "inline", workers: int = 1,
            address: str | None = None, max_tasks: int | None = None) -> None:
    """Run `jobs` and record their rows (``ctx.recorder.rows`` then holds the run's): the one
    function behind the engines. "inline": in this process, one after the other (the jobs timed
    alone, and a run of one worker); "pool": `workers` worker processes on this machine taking jobs
    from one queue (`_pool`); "ray": Ray tasks on a cluster (`memzoo.bench.ray_engine.run_jobs`)."""
    rec = ctx.recorder
    if not jobs:
        return
    if engine == "ray":
        from memzoo.bench.ray_engine import run_jobs

        run_jobs(ctx, jobs, address, max_tasks, progress.bar)
    elif engine == "inline" or workers == 1:
        for job in jobs:
            job.run(ctx)
        return
    else:
        _pool(ctx, jobs, workers, progress)
    rec.rows = [r for r in read_results(rec.path) if r["run_id"] == rec.run_id]


def _pool(ctx: Context, jobs: list, workers: int, progress: Progress) -> None:
    """`workers` processes (`_worker`) take `jobs` from one queue and report their work; a worker
    that dies (a SIGKILL, the kernel's OOM killer) has its job recorded failed and is replaced. An
    error or Ctrl-C here stops the workers too."""
    import multiprocessing as mp
    import os
    import queue as queue_mod

    rec = ctx.recorder
    mpc = mp.get_context("spawn")
    queue, jobq = mpc.Queue(), mpc.Queue()
    args = {"preset": ctx.preset.source, "seed": ctx.seed, "out": str(rec.path.parent), "work_dir": str(ctx.work_dir),
            "device": ctx.device, "run_id": rec.run_id, "resume": ctx.resume, "parent": os.getpid()}
    for item in [*enumerate(jobs), *[None] * workers]:  # a None per worker: the end
        jobq.put(item)
    threads = max(1, (os.cpu_count() or 1) // workers)

    def start(wid: int):
        proc = mpc.Process(target=_worker, args=(args, wid, jobq, threads, queue))
        proc.start()
        return proc

    procs = [start(i) for i in range(workers)]
    current: dict[int, int | None] = dict.fromkeys(range(workers))  # the job each worker runs
    done = [False] * workers
    try:
        while not all(done):
            try:
                kind, wid, units, what = queue.get(timeout=5)
            except queue_mod.Empty:  # a worker killed (by the kernel's OOM killer, a SIGKILL): its job failed
                for wid, proc in enumerate(procs):
                    if done[wid] or proc.exitcode in (None, 0):
                        continue
                    if current[wid] is not None:
                        job = jobs[current[wid]]
                        ctx.fail(job.suites[0], job.layer, job.part,
                                 RuntimeError(f"the worker running it died (exit code {proc.exitcode})"))
                    current[wid] = None
                    procs[wid] = start(wid)  # a new worker takes the queue's next jobs
                    progress.show(wid, 0, "restarted")
                continue
            if kind == "start":
                current[wid] = units  # the job's index
            elif kind == "end":
                done[wid] = True
                progress.show(wid, 0, "done")
            else:
                progress.show(wid, units, what)
    finally:  # (a SIGKILL: exit_with in each worker)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()


def _print_end(rec: Recorder, names: list[str], todo: list[str], resume: bool, seconds: float) -> None:
    """The run's tables (with resume: the whole comparison it completes), its notes, the closing
    lines, and each failed measurement in one line on stderr."""
    failed = [r for r in rec.rows if r["suite"] == "failed"]
    print(f"\nmemzoo bench: {len(rec.rows) - len(failed)} rows in {seconds:.0f} s -> {rec.path}\n")
    shown = _with_recorded(rec, names, todo) if resume else rec.rows
    print_tables(shown, rec.preset)
    print_notes(shown, published_beside(rec.path), todo)
    if not failed:
        print_closing(shown, names, rec.preset)
    for r in failed:
        print(f"memzoo bench: FAILED {r['setting']['suite']} {r['layer']} {' '.join(map(str, r['setting']['part'] or []))}: "
              f"{r['metrics']['error']} (traceback: {r['metrics']['log']})", file=sys.stderr)


def _with_recorded(rec: Recorder, names: list[str], suites: list[str]) -> list[dict]:
    """The rows of a resumed run's preset, suites and layers (variants such as fwpkm/shared, and
    the controls with the baseline), recorded earlier or now, with those of the presets its sections
    borrow (the cells it reuses: recall-state's top sizes and controls are the recall preset's): the
    comparison the run completes, not only its last cells (the tables keep the latest row per
    setting and seed)."""
    from memzoo.bench.common import CONTROLS, read_results
    from memzoo.bench.report import borrowed

    def ours(layer: str) -> bool:
        return layer in names or layer.split("/")[0] in names or (layer in CONTROLS and BASELINE in names)

    rows = read_results(rec.path)
    lent = [r for s in suites for r in borrowed(s, rec.preset, rows)]
    return [r for r in [*(r for r in rows if r["preset"] == rec.preset), *lent] if r["suite"] in suites and ours(r["layer"])]
