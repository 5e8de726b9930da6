"""The bench's verbs of the `memzoo` command, registered with the core's (memzoo.cli): bench, leaderboard,
verify. The installed `memzoo` command runs this module's `main`: the core's verbs and these."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memzoo.cli import Command, main, register_command  # noqa: F401  (main: the `memzoo` command)


def cmd_bench(args) -> int:
    from memzoo.bench.run import run_bench

    rows = run_bench(args.layers, args.suite, args.preset, args.seed, args.out, args.work_dir, args.device, not args.quiet,
                     args.jobs, args.resume, args.engine, args.address, args.dry_run)
    if failed := sum(r["suite"] == "failed" for r in rows):
        print(f"memzoo bench: {failed} measurement{'s' if failed > 1 else ''} failed (above); the others are recorded",
              file=sys.stderr)
        return 1
    return 0


def cmd_leaderboard(args) -> int:
    from memzoo.bench.report import render

    for path in render(Path(args.out) / "results.jsonl"):
        print(path)
    return 0


def cmd_verify(args) -> int:
    from memzoo.bench.verify import verify

    lines = [int(x) for x in args.lines.split(",") if x.strip()] if args.lines else None
    return verify(args.results, rerun=args.rerun, lines=lines, with_history=args.history)


def _presets_epilog() -> str:
    from memzoo.bench.common import preset_summaries

    presets = "\n".join(f"  {n:<11} {d}" for n, d in preset_summaries().items())
    return f"shipped presets (zoo_configs/bench/; a preset file of yours may say `base: NAME`):\n{presets}"


def _bench_arguments(b) -> None:
    from memzoo.bench.schema import SUITE_NAMES

    b.add_argument("--layers", default="", help="comma-separated layer names (a toys or niah variant alone as layer/variant, e.g. fwpkm/token), or 'all'; the baseline is always included")
    b.add_argument("--suite", default="", help="comma-separated, of: " + ", ".join(SUITE_NAMES) + " or all (default: the preset's run.suites, else all)")
    b.add_argument("--preset", default=None, help="a shipped preset's name (listed below) or a preset YAML file "
                   "(default: tiny; gpu where the device is CUDA)")
    b.add_argument("--seed", type=int, default=0, help="the first seed: models and data of seed N, N+1, ... (a preset's "
                                                      "toys.seeds of them); the LM suites train one LM per seed")
    b.add_argument("--out", default="leaderboards", help="rows are appended to OUT/results.jsonl")
    b.add_argument("--work-dir", help="cache of trained LMs (default runs/bench/<preset>)")
    b.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (the default: cuda if available)")
    b.add_argument("--jobs", type=int, default=None, help="worker processes, >= 1 (default: one per CPU core on CPU, 1 on CUDA); "
                   "with --engine ray, the most tasks at once (default: as the cluster's resources allow)")
    b.add_argument("--engine", default="pool", choices=("pool", "ray"),
                   help="pool: worker processes on this machine (default); ray: each job a Ray task, on a local Ray "
                        "or the cluster at --address (pip install 'memzoo[ray]'; docs/bench.md)")
    b.add_argument("--address", help="with --engine ray: the Ray cluster's address (ray start --head prints it; "
                                     "'auto': the cluster on this machine); default RAY_ADDRESS, else a Ray started here")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.add_argument("--resume", action="store_true",
                   help="skip what OUT/results.jsonl already holds for the same config and seed (a killed run continues)")
    b.add_argument("--dry-run", action="store_true",
                   help="print the jobs, what is recorded and an estimate of the time on --device (present or not); run nothing")


def _leaderboard_arguments(lb) -> None:
    lb.add_argument("--out", default="leaderboards", help="the folder of results.jsonl, where README.md and figures/ are written")


def _verify_arguments(v) -> None:
    v.add_argument("results", nargs="?", default="leaderboards/results.jsonl", help="the file (default: %(default)s)")
    v.add_argument("--rerun", type=int, default=0, metavar="K",
                   help="re-measure the K rows cheapest to measure (cost counts, toys cells) and say whether they agree")
    v.add_argument("--lines", help="re-measure the rows at these line numbers instead (comma-separated)")
    v.add_argument("--history", action="store_true",
                   help="also check the file's git history: every line it ever held is still there, or in superseded/ "
                        "with its reason")


register_command(Command(
    "bench", "compare memory layers (and the plain backbone) on one backbone, data and budget", _bench_arguments, cmd_bench,
    parser={"formatter_class": argparse.RawDescriptionHelpFormatter, "epilog": _presets_epilog}, resumable=True))
register_command(Command("leaderboard", "render OUT/README.md and figures from OUT/results.jsonl", _leaderboard_arguments,
                         cmd_leaderboard))
register_command(Command("verify", "check every row of a results.jsonl (schema, config hash, commit, ranges, digest); "
                                   "with --rerun K, measure its K cheapest rows again", _verify_arguments, cmd_verify))


if __name__ == "__main__":
    sys.exit(main())
