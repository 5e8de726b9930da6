"""`memzoo bench --engine ray` (issue 55): on a local Ray cluster of two nodes of one CPU each, a tiny
toys run gives the rows the embedded pool gives for the same seeds; a node killed mid-run, or a task
whose worker dies on both tries, leaves the run finishing, the cell retried or recorded failed, and
--resume completes it; without Ray, one line says how to install it."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import yaml

from memzoo.bench.common import read_results

from test_toys import MICRO as TOYS

ray = pytest.importorskip("ray")

#: the slow tier (several processes of the library at once): `python -m pytest -m slow`, which CI runs too
pytestmark = pytest.mark.slow

#: what differs between two runs of one cell by design: when and where it ran, and how fast
TIMING = {"tokens_per_s", "compile_s", "eval_s"}
PROVENANCE = {"run_id", "time", "wall_s", "hardware", "digest"}  # (the digest covers the provenance too)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """What the nodes see (their raylets inherit this environment when they start): the tests'
    plugin folder on PYTHONPATH, and where the plugin's layers look for their cues."""
    path = tmp_path_factory.mktemp("shared")
    (path / "ray_test_plugin.py").write_text(PLUGIN)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(path), os.environ.get("PYTHONPATH")) if p),
           "KILLER_ARMED": str(path / "armed"), "DOOMED_MARK": str(path / "running")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.path.insert(0, str(path))
    try:
        yield path
    finally:  # the plugin's layers leave the registry (the property tests run on every registered layer)
        from memzoo import registry

        for name in ("ray_doomed", "ray_killer"):
            registry._LAYERS.pop(name, None)
        sys.modules.pop("ray_test_plugin", None)
        sys.path.remove(str(path))
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def cluster(shared):
    """A head and a worker node, one CPU each, on this machine."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        c.shutdown()


def _preset(tmp_path, **toys) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"base": "_base", "toys": {**TOYS, "tasks": ["mqar"], "widths": [16], "seeds": 1,
                                                            "lrs": [1e-2], **toys}}))
    return str(path)


def _same(row: dict) -> tuple:
    """A row as the comparison sees it: everything but its timings and its provenance."""
    metrics = {k: v for k, v in row["metrics"].items() if k not in TIMING}
    rest = {k: v for k, v in row.items() if k not in PROVENANCE | {"metrics"}}
    return repr(sorted(rest.items())), metrics


def _close(a, b, tol=1e-6) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) <= tol
    return a == b


def test_the_same_cells_give_the_same_rows_under_either_engine(cluster, tmp_path):
    from memzoo.bench.run import run_bench

    kw = dict(suites="toys", preset=_preset(tmp_path), work_dir=tmp_path / "work", progress=False)
    pool = run_bench("linear,ba", **kw, out=tmp_path / "pool", jobs=2)
    on_ray = run_bench("linear,ba", **kw, out=tmp_path / "ray", engine="ray", address=cluster.address)
    assert not [r for r in pool + on_ray if r["suite"] == "failed"]
    key = lambda r: (r["layer"], r["seed"], r["config_hash"])  # noqa: E731
    assert sorted(map(key, pool)) == sorted(map(key, on_ray))
    assert {r["layer"] for r in pool} == {"baseline", "linear", "ba", "ctrl:attention", "ctrl:none"}
    by = {key(r): r for r in pool}
    for r in on_ray:
        (rest_a, m_a), (rest_b, m_b) = _same(by[key(r)]), _same(r)
        assert rest_a == rest_b and _close(m_a, m_b), (r["layer"], r["seed"])
    assert read_results(tmp_path / "ray" / "results.jsonl") == on_ray  # the driver wrote each row once


PLUGIN = '''
import os, pathlib, signal, time
from memzoo.layers.linear_attention import LinearAttentionMemory
from memzoo.registry import register_layer

@register_layer("ray_doomed")
class Doomed(LinearAttentionMemory):
    """Linear attention that, training the first time, writes its node's id to DOOMED_MARK and waits
    there to be killed; trained again (the file exists), it trains."""
    def forward(self, x, *args, **kwargs):
        mark = pathlib.Path(os.environ["DOOMED_MARK"])
        if self.training and not mark.exists():
            import ray
            mark.write_text(f"{ray.get_runtime_context().get_node_id()} {os.getpid()}")
            time.sleep(600)
        return super().forward(x, *args, **kwargs)

@register_layer("ray_killer")
class Killer(LinearAttentionMemory):
    """Linear attention whose training kills its process, while the file KILLER_ARMED exists (a line
    added to it for each kill)."""
    def forward(self, x, *args, **kwargs):
        armed = pathlib.Path(os.environ["KILLER_ARMED"])
        if self.training and armed.exists():
            with open(armed, "a") as f:
                f.write("killed\\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x, *args, **kwargs)
'''


def _plugin_env(monkeypatch):
    monkeypatch.setenv("MEMZOO_PLUGINS", "ray_test_plugin")  # the engine passes it on to the tasks
    import importlib

    from memzoo import registry

    importlib.import_module("ray_test_plugin")
    monkeypatch.setattr(registry, "_PLUGINS", {*registry._PLUGINS, "ray_test_plugin"})


def test_a_task_whose_worker_dies_twice_is_recorded_failed_and_resume_measures_it(cluster, shared, tmp_path,
                                                                                   monkeypatch):
    from memzoo.bench.run import run_bench

    _plugin_env(monkeypatch)
    (shared / "armed").write_text("")
    kw = dict(suites="toys", preset=_preset(tmp_path), out=tmp_path / "out", work_dir=tmp_path / "work",
              progress=False, engine="ray", address=cluster.address)
    rows = run_bench("ray_killer,linear", **kw)
    failed = [r for r in rows if r["suite"] == "failed"]
    assert [r["layer"] for r in failed] == ["ray_killer"] and "died twice" in failed[0]["metrics"]["error"]
    assert {r["layer"] for r in rows if r["suite"] == "toys"} == {"baseline", "linear", "ctrl:attention", "ctrl:none"}
    assert (shared / "armed").read_text().split() == ["killed", "killed"]  # tried, retried once, recorded
    (shared / "armed").unlink()
    again = run_bench("ray_killer,linear", **kw, resume=True)
    assert [r["layer"] for r in again] == ["ray_killer"]  # the others were recorded: skipped
    done = [r for r in read_results(tmp_path / "out" / "results.jsonl") if r["suite"] == "toys"]
    assert sorted(r["layer"] for r in done) == ["baseline", "ctrl:attention", "ctrl:none", "linear", "ray_killer"]


def test_a_node_killed_mid_run_its_cell_runs_again_on_another(shared, tmp_path, monkeypatch):
    """A node dies while a cell trains on it (a machine lost): Ray runs the cell again on the
    other node, the run finishes with every row, and --resume finds nothing left to do. The head
    holds no CPU here, so that every cell runs on one of the two worker nodes, which may be killed."""
    from ray.cluster_utils import Cluster

    from memzoo.bench.run import run_bench

    _plugin_env(monkeypatch)
    (shared / "running").unlink(missing_ok=True)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    killed = []

    def kill_where_it_runs():
        mark, deadline = shared / "running", time.time() + 600
        while not (mark.exists() and mark.read_text()) and time.time() < deadline:
            time.sleep(0.2)
        node = next(n for n in nodes if n.node_id == mark.read_text().split()[0])
        c.remove_node(node, allow_graceful=False)
        killed.append(node.node_id)

    try:
        killer = threading.Thread(target=kill_where_it_runs, daemon=True)
        killer.start()
        kw = dict(suites="toys", preset=_preset(tmp_path), out=tmp_path / "out", work_dir=tmp_path / "work",
                  progress=False, engine="ray", address=c.address)
        rows = run_bench("ray_doomed,linear", **kw)
        killer.join(5)
        assert killed and not killer.is_alive()
        assert not [r for r in rows if r["suite"] == "failed"]
        assert {r["layer"] for r in rows} == {"baseline", "ray_doomed", "linear", "ctrl:attention", "ctrl:none"}
        assert run_bench("ray_doomed,linear", **kw, resume=True) == []
    finally:
        c.shutdown()


def test_ctrl_c_ends_the_tasks_and_leaves_the_results_whole(cluster, shared, tmp_path):
    """SIGINT to a bench whose cell is training on the cluster: the bench exits 130 saying
    --resume continues, the task's process is gone, and results.jsonl holds whole rows only."""
    import signal
    import subprocess
    import warnings

    (shared / "running").unlink(missing_ok=True)
    env = {**os.environ, "MEMZOO_PLUGINS": "ray_test_plugin"}
    cmd = [sys.executable, "-m", "memzoo.bench.cli", "bench", "--layers", "ray_doomed", "--suite", "toys", "--quiet",
           "--preset", _preset(tmp_path), "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"),
           "--engine", "ray", "--address", cluster.address]
    # as a terminal's foreground job: run as a shell's background job (`cmd &`, how CI may run the tests),
    # the tests start with SIGINT ignored, and an ignored disposition survives exec
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    mark, deadline = shared / "running", time.time() + 600
    while not (mark.exists() and mark.read_text()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    pid = int(mark.read_text().split()[1])
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the bench did not end within 120 s of Ctrl-C; its stderr ends: {err[-2000:]}")
    assert proc.returncode == 130 and "interrupted" in err and "--resume continues" in err, err[-2000:]
    deadline = time.time() + 60
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        time.sleep(0.5)
    assert not os.path.exists(f"/proc/{pid}")  # the task ended with its job, not left sleeping
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a torn last line would warn
        rows = read_results(tmp_path / "out" / "results.jsonl")
    assert "ray_doomed" not in {r["layer"] for r in rows}


def test_the_ray_engine_without_ray_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    from memzoo.bench.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["bench", "--engine", "ray", "--suite", "toys", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["memzoo bench: error: --engine ray needs Ray, which is not installed here: pip install 'memzoo[ray]'"]


def test_the_default_engine_imports_no_ray():
    import subprocess

    code = ("import sys; from memzoo.bench.run import run_bench; import memzoo.bench.cli; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_head_without_a_gpu_hands_cuda_cells_to_the_cluster(monkeypatch, tmp_path):
    """--engine ray --device cuda on a machine without CUDA: the cells go to the cluster (whose
    GPUs ray_engine checks), not refused here; the cost suite, which times on this machine, is."""
    import torch

    from memzoo.bench import ray_engine
    from memzoo.bench.run import run_bench
    from memzoo.config import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seen = []
    monkeypatch.setattr(ray_engine, "run_jobs", lambda ctx, jobs, *a: seen.append((ctx.device, len(jobs))))
    run_bench("linear", "toys", _preset(tmp_path), out=tmp_path, work_dir=tmp_path / "w", progress=False,
              engine="ray", device="cuda")
    assert seen == [("cuda", 4)]  # the baseline, both controls and linear, as tasks for the cluster's GPUs
    with pytest.raises(ConfigError, match="--suite cost times on this machine, which has no CUDA device"):
        run_bench("linear", "cost,toys", _preset(tmp_path), out=tmp_path, progress=False, engine="ray", device="cuda")
    with pytest.raises(ConfigError, match="not available"):
        run_bench("linear", "toys", _preset(tmp_path), out=tmp_path, progress=False, device="cuda")  # the pool: here
