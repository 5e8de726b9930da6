"""Every GPU check in one command, sized for a short loan of one GPU.

    python -m memzoo.bench.gpu_check --out DIR        # on a CUDA machine, from a checkout
    python -m memzoo.bench.gpu_check --dry-run        # anywhere: the steps, their limits, their commands

The steps run in order, each in its own process under its own time limit (a hung or failed step
costs its limit, not the loan), with its log in DIR/<step>.log:

    tests    tests/test_cuda.py: the Triton kernels compiled (not interpreted) against the torch
             path at the paper's sizes, FwPKM's kernel path deterministic, bf16 training, generation
    train    a short bf16 training of paper/gdn-fwpkm2-6-10 (Table 3's model, 8 x 4096 tokens a
             step) on Shakespeare (the paper's corpus streams from the Hub): loss, tokens/s, memory
    cost     the paper preset's cost suite on CUDA: Table 2's configs, GDN, +FwPKM, +PKM first,
             as many as fit its limit; rows in DIR/results.jsonl
    kernels  bench_kernels: each FwPKM kernel and one FwPKM layer step against the torch path (last:
             it takes the time left, at least its reserve, which the steps before it leave)

and, named in ``--only`` (each a slice of the GPU issue's work, sized for one short loan):

    gdn      bench_gdn_op: one GDN op, forward and backward, at the paper's shape: the eager torch
             path, the compiled one (the mixer's on CUDA without fla) and fla where it runs
    profile  profile_fwpkm: the FwPKM layer step's top operations and its launches, syncs, copies
    pack     cells an hour of one small toys run at --jobs 1 and at --jobs 4 on the GPU (each cold:
             a compile cache of its own), DIR/pack.json
    recall   the recall-gpu preset for the time left (the controls, the baseline, fwl, linear, fwpkm
             first), resumed from the checkout's published rows; its new rows in DIR/recall.jsonl
    main     the main job as a user runs it (`memzoo bench --layers fwpkm,mom,lact`: the gpu preset
             where CUDA is), timed: DIR/main.log

A step that measures as much as its limit allows (cost, kernels) and is stopped there is reported as
such, not as a failure; the command exits 1 only when a step failed or was skipped.

Then DIR/summary.md and DIR/summary.json: per step its status, time and figures, and the device.
The cost rows are bench rows (`memzoo leaderboard` renders them): append DIR/results.jsonl to
leaderboards/results.jsonl to publish them. Scratch (the trained model, the bench's work dir)
goes to a temporary directory, so DIR holds 8 files at most.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

TRAIN_CONFIG = "paper/gdn-fwpkm2-6-10"


@dataclass
class Step:
    name: str
    limit_s: int  # its own cap; 0: what the budget has left
    what: str
    reserve_s: int = 0  # kept for it from the budget while the steps before it run
    open_ended: bool = False  # measures as much as its limit allows: stopped there by design, not failed

    def command(self, out: Path, scratch: Path, train_steps: int) -> list[str]:
        py = [sys.executable, "-m"]
        if self.name == "tests":
            cuda = tests_file()
            return [*py, "pytest", str(cuda), str(cuda.with_name("test_fla_paths.py")), "-q", "-s", "-p", "no:cacheprovider"]
        if self.name == "kernels":
            return [*py, "memzoo.bench.benchmarks.bench_kernels"]
        if self.name == "train":
            return [*py, "memzoo.bench.gpu_check", "--train-only", str(train_steps), "--out", str(out)]
        if self.name == "gdn":
            return [*py, "memzoo.bench.benchmarks.bench_gdn_op", "--json", str(out / "gdn.json")]
        if self.name == "profile":
            return [*py, "memzoo.bench.benchmarks.profile_fwpkm", "--out", str(out)]
        if self.name == "pack":
            return [*py, "memzoo.bench.gpu_check", "--pack-only", "--out", str(out)]
        if self.name == "recall":
            return [*py, "memzoo.bench.cli", "bench", "--preset", "recall-gpu", "--layers", RECALL_LAYERS, "--suite", "toys",
                    "--device", "cuda", "--jobs", str(RECALL_JOBS), "--resume", "--quiet", "--out", str(scratch / "recall"),
                    "--work-dir", str(scratch / "recall-work")]
        if self.name == "main":
            return [*py, "memzoo.bench.cli", "bench", "--layers", "fwpkm,mom,lact", "--out", str(scratch / "main"),
                    "--work-dir", str(scratch / "main-work")]
        return [*py, "memzoo.bench.cli", "bench", "--suite", "cost", "--preset", str(scratch / "paper.yaml"), "--layers", "baseline",
                "--device", "cuda", "--jobs", "1", "--quiet", "--out", str(scratch / "rows"),
                "--work-dir", str(scratch / "work")]


STEPS = [
    Step("tests", 180, "tests/test_cuda.py: kernels compiled vs torch, determinism, bf16 training, generation; "
                       "tests/test_fla_paths.py: each op's fla path vs its torch path on the GPU"),
    Step("train", 120, f"a short bf16 training of {TRAIN_CONFIG} on Shakespeare"),
    Step("cost", 150, "the paper preset's cost suite on CUDA (Table 2's configs, GDN, +FwPKM, +PKM first)",
         open_ended=True),
    Step("kernels", 0, "bench_kernels: each FwPKM kernel and one layer step vs the torch path", reserve_s=90,
         open_ended=True),
]


def limits(steps: list[Step], budget: float, elapsed: float, i: int) -> int:
    """Step i's time limit: its own cap, within what the budget has left once the later steps'
    reserves are set aside (the kernels step always gets its reserve)."""
    left = budget - elapsed - sum(s.reserve_s for s in steps[i + 1:])
    return int(min(steps[i].limit_s, left) if steps[i].limit_s else left)


#: steps run only when named in --only, between cost and kernels
EXTRA = [
    Step("gdn", 150, "bench_gdn_op: one GDN op fwd+bwd at the paper's shape, eager / compiled / fla"),
    Step("profile", 120, "profile_fwpkm: the FwPKM layer step's top operations, launches, syncs and copies"),
    Step("pack", 300, "cells an hour of a small toys run at --jobs 1 and --jobs 4"),
    Step("recall", 0, "a slice of the recall-gpu preset, resumed from the published rows", open_ended=True),
    Step("main", 600, "the main job (memzoo bench --layers fwpkm,mom,lact: the gpu preset), timed"),
]
ORDER = [*STEPS[:-1], *EXTRA, STEPS[-1]]

#: the recall step's layers (the issue's first rows: with the baseline come both controls) and packing
RECALL_LAYERS, RECALL_JOBS = "fwl,linear,fwpkm", 8

FIRST = ["paper/gdn", "paper/gdn-fwpkm2-6-10", "paper/gdn-pkm2-6-10"]  # Table 2's rows wanted most


def write_cost_preset(scratch: Path) -> Path:
    """The paper preset with its cost configs reordered, `FIRST` first (named paper: its rows are
    the paper preset's)."""
    import yaml

    from memzoo.bench.common import SUITES, config_dir
    from memzoo.config import read_config

    data, _ = read_config(config_dir() / "bench" / "paper.yaml", ("model", "layers", "train", *SUITES))
    configs = data["cost"]["configs"]
    data["cost"]["configs"] = [c for c in FIRST if c in configs] + [c for c in configs if c not in FIRST]
    path = scratch / "paper.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def tests_file() -> Path:
    """tests/test_cuda.py of the checkout (the working directory's, else the package's)."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (root / "tests" / "test_cuda.py").is_file():
            return root / "tests" / "test_cuda.py"
    return Path("tests/test_cuda.py")


# ---- the train step (run in its own process) ---------------------------------------------------


def train_only(steps: int, out: Path, config: str = TRAIN_CONFIG, device: str = "cuda") -> None:
    """Train `config` for `steps` steps of one micro-batch in bf16; write out/train.json."""
    from memzoo.config import load_config
    from memzoo.train import train

    rc = load_config(config)
    tc = rc.train
    tc.corpus, tc.device, tc.precision, tc.steps, tc.grad_accum = "shakespeare", device, "bf16", steps, 1
    tc.warmup, tc.eval_every, tc.eval_batches, tc.ckpt_every = min(tc.warmup, steps // 4), steps, 2, 10**9
    times: list[float] = []
    with tempfile.TemporaryDirectory() as d:  # the checkpoint (GBs) stays out of `out`
        tc.out_dir = d
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        res = train(rc, progress=False, on_step=lambda r: times.append(time.perf_counter()))
    gaps = [b - a for a, b in zip(times, times[1:])][steps // 4:]  # past compilation and warm-up
    step_s = sorted(gaps)[len(gaps) // 2]
    losses = [r["loss"] for r in res["history"]]
    from memzoo.bench.common import device_name

    fig = {"config": config, "device": device_name(device), "precision": "bf16",
           "tokens_per_step": tc.batch_size * tc.seq_len, "steps": steps, "first_loss": losses[0],
           "last_loss": losses[-1], "val_loss": res["val_loss"], "median_step_s": step_s,
           "tokens_per_s": tc.batch_size * tc.seq_len / step_s,
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")}
    (out / "train.json").write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig))


# ---- the pack step (run in its own process) ----------------------------------------------------

#: the pack step's run: the gpu preset's toys, short, two seeds (the baseline, both controls and linear: 8 cells)
PACK = {"base": "gpu", "toys": {"seeds": 2, "max_steps": 300, "min_steps": 300, "eval_every": 100}}


def pack(out: Path, device: str = "cuda", jobs: tuple[int, ...] = (1, 4), layers: str = "linear",
         preset: dict | None = None) -> dict:
    """Cells an hour of one toys run at each of `jobs` worker processes on `device`, each run cold
    (its own work dir, so its own compile cache); out/pack.json."""
    import yaml

    from memzoo.bench.common import device_name
    from memzoo.bench.run import run_bench

    spec = preset or PACK
    res = {"device": device_name(device), "preset": spec, "layers": layers, "runs": []}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "pack.yaml"
        path.write_text(yaml.safe_dump(spec))
        for n in jobs:
            t0 = time.perf_counter()
            rows = run_bench(layers, "toys", str(path), out=Path(d) / f"rows{n}", work_dir=Path(d) / f"work{n}",
                             device=device, progress=False, jobs=n)
            wall = round(time.perf_counter() - t0, 2)
            cells = sum(r["suite"] == "toys" for r in rows)
            res["runs"].append({"jobs": n, "cells": cells, "failed": sum(r["suite"] == "failed" for r in rows),
                                "wall_s": wall, "cells_per_hour": round(cells / wall * 3600, 1)})
    (out / "pack.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return res


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


# ---- the summary ------------------------------------------------------------------------------


def figures(name: str, out: Path, log: str) -> list[str]:
    """What a step measured, as lines for the summary."""
    if name == "tests":
        return [ln for ln in log.splitlines() if (" passed" in ln or " failed" in ln or "error" in ln) and ln.strip()][-1:]
    if name == "kernels":
        return [ln for ln in log.splitlines() if ln.startswith(("# ", "op ")) or "x   (" in ln]
    if name == "train" and (out / "train.json").exists():
        f = json.loads((out / "train.json").read_text())
        return [f"{f['steps']} steps of {f['tokens_per_step']} tokens: loss {f['first_loss']:.3f} -> {f['last_loss']:.3f} "
                f"(val {f['val_loss']:.3f}), {f['tokens_per_s']:,.0f} tokens/s (median step {f['median_step_s']:.3f} s), "
                f"peak {f['peak_mem_gb']:.1f} GiB"]
    if name == "gdn" and (out / "gdn.json").exists():
        return [f"{r['path']}: not timed ({r['skipped']})" if "skipped" in r else
                f"{r['path']}: {r['ms']:.2f} ms ({r['vs_torch']:.2f}x the eager torch path; first call {r['first_call_s']:.0f} s; "
                f"max rel diff {r['max_rel_diff']:.1e})" for r in json.loads((out / "gdn.json").read_text())]
    if name == "profile":
        return [ln[3:] for ln in log.splitlines() if ln.startswith("## ")]
    if name == "pack" and (out / "pack.json").exists():
        return [f"--jobs {r['jobs']}: {r['cells']} cells in {r['wall_s']:.0f} s, {r['cells_per_hour']:.0f} cells an hour"
                + (f" ({r['failed']} failed)" if r["failed"] else "") for r in json.loads((out / "pack.json").read_text())["runs"]]
    if name == "recall" and (out / "recall.jsonl").exists():
        rows = [json.loads(ln) for ln in (out / "recall.jsonl").read_text().splitlines()]
        return [f"{r['layer']} d={r['setting']['d_model']} seed {r['seed']}: test {r['metrics']['accuracy']:.3f} "
                f"({r['metrics']['stop']}, lr {r['metrics']['lr']:g}, {r['metrics']['sequences']:,} sequences)"
                for r in rows if r["suite"] == "toys"] or ["no cell finished"]
    if name == "main":
        return [ln for ln in log.splitlines() if ln.startswith("memzoo bench: ")][:2]
    if name == "cost" and (out / "results.jsonl").exists():
        lines = []
        for row in map(json.loads, (out / "results.jsonl").read_text().splitlines()):
            m, cfg = row["metrics"], row["setting"].get("config") or row["layer"]
            if "tokens_per_s" not in m:
                lines.append(f"{cfg}: {m.get('throughput_error', 'not timed')}")
                continue
            paper = f", paper {m['samples_per_s_paper']:.2f}" if m.get("samples_per_s_paper") else ""
            lines.append(f"{cfg}: {m['samples_per_s']:.2f} samples/s{paper}; {m['tokens_per_s']:,.0f} tokens/s; "
                         f"{m['flops_per_s'] / 1e12:.0f} TFLOP/s = {100 * m['mfu']:.0f}% of the measured "
                         f"{m['peak_flops_per_s'] / 1e12:.0f}; {m.get('peak_mem_gb', float('nan')):.1f} GiB")
        return lines
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memzoo.bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="logs, rows and the summary go here (at most 8 files)")
    ap.add_argument("--budget", type=int, default=450, help="seconds for all steps together (default 450)")
    ap.add_argument("--only", help="comma-separated steps to run (default: all, in order)")
    ap.add_argument("--train-steps", type=int, default=20, help="steps of the train step (default 20)")
    ap.add_argument("--dry-run", action="store_true", help="list the steps and exit")
    ap.add_argument("--train-only", type=int, metavar="STEPS", help=argparse.SUPPRESS)
    ap.add_argument("--pack-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.train_only is not None:
        train_only(a.train_only, a.out)
        return 0
    if a.pack_only:
        pack(a.out)
        return 0
    names = [s.name for s in ORDER]
    only = a.only.split(",") if a.only else [s.name for s in STEPS]
    if bad := [n for n in only if n not in names]:
        ap.error(f"unknown step(s) {', '.join(bad)}; the steps are {', '.join(names)} (the default: "
                 f"{', '.join(s.name for s in STEPS)})")
    steps = [s for s in ORDER if s.name in only]
    out = a.out or Path("gpu_check")
    if a.dry_run:
        print(f"gpu_check: {len(steps)} steps in at most {a.budget} s, logs and rows under {out}/")
        for s in steps:
            cap = f"{s.limit_s} s" if s.limit_s else "the time left"
            print(f"  {s.name:8s} {s.what} (at most {cap})\n           $ {' '.join(s.command(out, Path('$TMP'), a.train_steps))}")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA device (none here); --dry-run lists what it would run", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    from memzoo.bench.common import published_rows
    from memzoo.ops.gated_delta_rule import gdn_op

    device = torch.cuda.get_device_name()
    gdn = gdn_op("cuda")
    summary = {"device": device, "torch": torch.__version__, "gdn_op": gdn,
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
    t_start = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    write_cost_preset(scratch)
    try:
        for i, s in enumerate(steps):
            limit = limits(steps, a.budget, time.time() - t_start, i)
            if limit < 20:
                summary["steps"][s.name] = {"status": "skipped (no time left)", "seconds": 0, "figures": []}
                continue
            print(f"gpu_check: {s.name} (at most {limit} s) ...", flush=True)
            if s.name == "recall":  # resumed from the published rows: a copy, whose new rows come back
                (scratch / "recall").mkdir(exist_ok=True)
                if (src := published_rows()) is not None:
                    shutil.copy(src, scratch / "recall" / "results.jsonl")
                before = len(read_lines(scratch / "recall" / "results.jsonl"))
            t0 = time.time()
            with open(out / f"{s.name}.log", "w") as log:
                try:
                    rc = subprocess.run(s.command(out, scratch, a.train_steps), stdout=log, stderr=subprocess.STDOUT,
                                        timeout=limit).returncode
                    status = "passed" if rc == 0 else f"failed (rc {rc})"
                except subprocess.TimeoutExpired:
                    status = f"stopped at its limit ({limit} s)" + (", by design" if s.open_ended else "")
            if s.name == "cost" and (scratch / "rows" / "results.jsonl").exists():
                shutil.copy(scratch / "rows" / "results.jsonl", out / "results.jsonl")
            if s.name == "recall":
                new = read_lines(scratch / "recall" / "results.jsonl")[before:]
                (out / "recall.jsonl").write_text("".join(ln + "\n" for ln in new))
            text = (out / f"{s.name}.log").read_text(errors="replace")
            summary["steps"][s.name] = {"status": status, "seconds": round(time.time() - t0, 1),
                                        "figures": figures(s.name, out, text)}
            print(f"gpu_check: {s.name} {status} in {time.time() - t0:.0f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = [f"# gpu_check on {device} (torch {torch.__version__}), {summary['started']}", "",
             f"The gated delta rule ran on: {gdn}.", ""]
    for name, r in summary["steps"].items():
        lines += [f"- **{name}**: {r['status']}, {r['seconds']} s", *[f"  - {f}" for f in r["figures"]]]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = all(r["status"] == "passed" or r["status"].endswith("by design") for r in summary["steps"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
