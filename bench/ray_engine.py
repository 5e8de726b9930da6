"""`memzoo bench --engine ray [--address ADDR]`: the bench's jobs as Ray tasks, on one machine or a cluster.

Each job of the bench's plan (`memzoo.bench.run.plan`: a toy cell; a layer's LM with the suites that
share it) becomes one Ray task that asks for one CPU, where its torch runs one thread as a pool
worker's does, and on CUDA also a share of a GPU (`GPU_SHARE`). A task measures and returns its rows;
the driver alone appends them to results.jsonl (`Recorder.append`, one locked write a row), so
`--resume` and `memzoo leaderboard` read the file as they do after the embedded pool, and the nodes
need not share a file system. Progress comes back through a small actor, a few times a second, into
the bench's one bar.

A task whose worker process or node dies is retried once (Ray's `max_retries`); dying again, it is
recorded failed as the pool records a cell whose worker died, and `--resume` measures it again.
Ctrl-C ends the run's Ray job: the driver disconnects and Ray ends every task the driver owns, on
every node (a task shares its owner's fate); the rows already appended stay whole (the driver defers
the interrupt while it writes one). A caller that connected to Ray itself (`ray.init` before
`run_jobs`) keeps its connection, and its `ray.shutdown()` ends the tasks. The driver does not
`ray.cancel` them: Ray's force-cancel races the reply of the task it kills, and the driver's core
worker may die on an internal check (docs/bench.md, "Ctrl-C under Ray"). The timed suites (cost)
run on the driver's machine, alone, before any task starts, as with the pool: a timing taken beside
a neighbour measures the neighbour.

Ray is imported here only, so only with `--engine ray`: ``pip install 'memzoo[ray]'``. A task's
work dir (its LM cache, its cell checkpoints, the compile cache) is the run's `--work-dir` on the node
that runs it, so a cell resumes from its checkpoint only on a node that has it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from pathlib import Path

from memzoo.config import ConfigError

INSTALL = "pip install 'memzoo[ray]'"

#: the share of one GPU a task asks for on CUDA, by its first suite: a toy cell's model (d_model
#: 64-256, batch 32) uses a small part of a GPU, so eight run side by side; an LM job gets half
GPU_SHARE = {"toys": 0.125}
GPU_SHARE_DEFAULT = 0.5

#: seconds between a task's progress reports (the bar needs no more, and each is a remote call)
REPORT_EVERY_S = 0.5


def import_ray():
    """Ray, or a ConfigError whose one line says how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--engine ray needs Ray, which is not installed here: {INSTALL}") from None
    return ray


def resources(suite: str, device: str) -> dict:
    """What a task of `suite` asks the cluster for: one CPU, and on CUDA its GPU share."""
    if not device.startswith("cuda"):
        return {"num_cpus": 1}
    return {"num_cpus": 1, "num_gpus": GPU_SHARE.get(suite, GPU_SHARE_DEFAULT)}


class _Progress:
    """The actor the tasks report to: (task index, units, doing) items, taken by the driver."""

    def __init__(self):
        self.items: list[tuple] = []

    def put(self, items: list[tuple]) -> None:
        self.items += items

    def take(self) -> list[tuple]:
        items, self.items = self.items, []
        return items


class _Reporter:
    """A task's `Context.on_work`: sums units and sends them every REPORT_EVERY_S."""

    def __init__(self, actor, index: int):
        self.actor, self.index = actor, index
        self.units, self.doing, self.last = 0, "", 0.0

    def __call__(self, units: int, doing: str) -> None:
        self.units += units
        self.doing = doing
        if time.monotonic() - self.last >= REPORT_EVERY_S:
            self.flush()

    def flush(self) -> None:
        self.actor.put.remote([(self.index, self.units, self.doing)])
        self.units, self.last = 0, time.monotonic()


def _task(index: int, job, preset, seed: int, run_id: str, work_dir: str, device: str, resume: bool,
          done: list[dict], plugins: list[str], progress) -> list[dict]:
    """One job, measured in a Ray worker: the rows it recorded (its failures as `failed` rows)."""
    import torch

    from memzoo.bench.common import Collector, Context, compile_cache
    from memzoo.cpu import tune_cpu
    from memzoo.registry import add_plugin

    for module in plugins:  # the user layers the driver has (MEMZOO_PLUGINS, --plugin)
        add_plugin(module)
    torch.set_num_threads(1)
    tune_cpu()
    compile_cache(Path(work_dir))
    report = _Reporter(progress, index)
    report.actor.put.remote([(index, None, "start")])  # a retried task's units start again
    rec = Collector(preset.name, seed, run_id, done if resume else [])
    ctx = Context(preset, seed, rec, Path(work_dir), "cuda" if device.startswith("cuda") else device,
                  progress=False, on_work=report, resume=resume)
    job.run(ctx)
    report.flush()
    return rec.rows


@contextlib.contextmanager
def _no_interrupt():
    """Ctrl-C waits until the block ends (a row being appended is written whole)."""
    import threading

    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    got = []
    old = signal.signal(signal.SIGINT, lambda *a: got.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got:
            raise KeyboardInterrupt


def run_jobs(ctx, jobs: list, address: str | None, max_tasks: int | None, bar) -> None:
    """Run `jobs` as Ray tasks (at most `max_tasks` at once; None: as many as the cluster's
    resources allow) and append their rows through `ctx.recorder`. `address`: a running
    cluster's (``ray start --head`` prints it; "auto": the one on this machine); None: RAY_ADDRESS
    if set, else a Ray started here for this run."""
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False, include_dashboard=False, logging_level=logging.ERROR)
    try:
        _run(ray, ctx, jobs, max_tasks, bar)
    except BaseException:  # Ctrl-C, or the driver failing: the job ends, and with it its tasks
        if started:
            with contextlib.suppress(Exception):  # a failing shutdown must not hide why the driver leaves
                ray.shutdown()
        raise
    if started:
        ray.shutdown()


def _run(ray, ctx, jobs, max_tasks, bar) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from memzoo.bench.common import read_results
    from memzoo.registry import plugin_modules

    rec = ctx.recorder
    if ctx.device.startswith("cuda") and not ray.cluster_resources().get("GPU"):
        raise ConfigError(f"--device {ctx.device}: the Ray cluster has no GPU ({ray.cluster_resources()})")
    # what a resumed run skips: this preset's rows in the file, sent to the cluster once
    done = ray.put([r for r in read_results(rec.path) if r["preset"] == ctx.preset.name] if ctx.resume else [])
    plugins = list(plugin_modules())
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    progress = ray.remote(num_cpus=0)(_Progress).options(scheduling_strategy=here).remote()  # dies with the driver only
    task = ray.remote(max_retries=1, retry_exceptions=False)(_task)
    todo = list(enumerate(jobs))
    running: dict = {}  # object ref -> job index
    units = [0] * len(jobs)  # reported per job (a retried job's go back off the bar)
    doing: dict[int, str] = {}
    started: set[int] = set()  # the jobs whose task runs now (the others wait for resources)

    def submit() -> None:
        while todo and (max_tasks is None or len(running) < max_tasks):
            i, job = todo.pop(0)
            opts = resources(job.suites[0], ctx.device)
            ref = task.options(**opts).remote(i, job, ctx.preset, ctx.seed, rec.run_id, str(ctx.work_dir),
                                              ctx.device, ctx.resume, done, plugins, progress)
            running[ref] = i

    def show(items: list[tuple]) -> None:
        for i, n, what in items:
            if n is None:  # the task (re)started
                bar.update(-units[i])
                units[i] = 0
                started.add(i)
                continue
            units[i] += n
            doing[i] = what
            bar.update(n)
        now = [doing[i] for i in running.values() if i in doing]
        bar.set_postfix_str(f"{len(started)} running, {len(running) - len(started)} waiting"
                            + (f"; {now[-1]}" if now else ""), refresh=False)

    submit()
    while running:
        ready, _ = ray.wait(list(running), num_returns=1, timeout=REPORT_EVERY_S)
        show(ray.get(progress.take.remote()))
        for ref in ready:
            i = running.pop(ref)
            started.discard(i)
            job = jobs[i]
            try:
                rows = ray.get(ref)
            except ray.exceptions.RayError as e:  # the worker or node died on both tries
                why = " ".join(str(e).split())[:200]
                with _no_interrupt():
                    ctx.fail(job.suites[0], job.layer, job.part,
                             RuntimeError(f"the Ray task running it died twice ({type(e).__name__}: {why})"))
                continue
            with _no_interrupt():
                for row in rows:
                    rec.append(row)
            doing.pop(i, None)
        submit()
    show(ray.get(progress.take.remote()))
