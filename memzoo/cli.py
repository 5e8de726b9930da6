"""The `memzoo` command: train, params, bench.

A user's mistake (a bad config or flag, a missing or unreadable file, an unwritable output, a
run that diverged) is one line on stderr and exit status 2, not a traceback; set MEMZOO_DEBUG
to see the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _expand(names: list[str]) -> list[str]:
    """Config names, files, or directories (every *.yaml inside, sorted, but _*.yaml: bases)."""
    from memzoo.config import config_dir

    out = []
    for n in names:
        for d in (Path(n), config_dir() / n):
            if d.is_dir():
                out += sorted(str(p) for p in d.glob("*.yaml") if not p.name.startswith("_"))
                break
        else:
            out.append(n)
    return out


def cmd_params(args) -> int:
    from memzoo.backbone.model import count_params
    from memzoo.config import ConfigError, load_config

    rows, failed = [], 0
    for name in _expand(args.configs):
        try:  # one bad file is reported and skipped; the others are still counted
            rc = load_config(name)
        except ConfigError as e:
            print(f"memzoo params: error: {e}", file=sys.stderr)
            failed += 1
            continue
        n = count_params(rc.model) / 1e6
        ref = rc.paper.get("params_m")
        rows.append((Path(rc.source).stem, rc.model.layout, n, ref))
    if not rows:
        return 1
    w, c = max(len(r[1]) for r in rows), max(6, max(len(r[0]) for r in rows))
    print(f"{'config':<{c}} {'layout':<{w}} {'memzoo (M)':>11} {'paper (M)':>10} {'diff':>8}")
    worst = 0.0
    for stem, layout, n, ref in rows:
        if ref is None:
            print(f"{stem:<{c}} {layout:<{w}} {n:>11.2f} {'-':>10} {'-':>8}")
            continue
        diff = 100 * (n - ref) / ref
        worst = max(worst, abs(diff))
        print(f"{stem:<{c}} {layout:<{w}} {n:>11.2f} {ref:>10.2f} {diff:>+7.3f}%")
    if any(r[3] is not None for r in rows):
        print(f"largest deviation from the paper: {worst:.3f}%")
    return 1 if failed else 0


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


def cmd_inspect(args) -> int:
    from memzoo.inspection import inspect_text

    text = Path(args.file).read_text() if args.file else args.text
    if not text:
        raise ValueError("give the text to read: --text '...' or --file PATH")
    print(inspect_text(args.model, text, top=args.top, max_tokens=args.max_tokens))
    return 0


def cmd_train(args) -> int:
    from memzoo.train import cmd_train as train  # torch: only when it trains

    return train(args)


def main(argv: list[str] | None = None) -> int:
    from memzoo.bench.suites import NAMES as SUITE_NAMES
    from memzoo.config import add_train_arguments

    p = argparse.ArgumentParser(prog="memzoo", description="A zoo of fast-weight memory layers: train, count, bench.")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE first, so the layers it registers (@memzoo.register_layer) are usable by name; "
                        "repeatable; added to $MEMZOO_PLUGINS (comma-separated), which bench workers inherit")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train a model from a config (YAML path or shipped name, e.g. tiny/gdn)")
    add_train_arguments(t)
    t.set_defaults(fn=cmd_train)

    q = sub.add_parser("params", help="count parameters on the meta device, beside the paper's figure")
    q.add_argument("configs", nargs="+", help="config files, shipped names (paper/gdn) or directories (paper)")
    q.set_defaults(fn=cmd_params)

    from memzoo.bench.common import preset_summaries

    presets = "\n".join(f"  {n:<11} {d}" for n, d in preset_summaries().items())
    b = sub.add_parser("bench", help="compare memory layers (and the plain backbone) on one backbone, data and budget",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=f"shipped presets (zoo_configs/bench/; a preset file of yours may say `base: NAME`):\n{presets}")
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
    b.set_defaults(fn=cmd_bench)

    lb = sub.add_parser("leaderboard", help="render OUT/README.md and figures from OUT/results.jsonl")
    lb.add_argument("--out", default="leaderboards", help="the folder of results.jsonl, where README.md and figures/ are written")
    lb.set_defaults(fn=cmd_leaderboard)

    v = sub.add_parser("verify", help="check every row of a results.jsonl (schema, config hash, commit, ranges, digest); "
                                      "with --rerun K, measure its K cheapest rows again")
    v.add_argument("results", nargs="?", default="leaderboards/results.jsonl", help="the file (default: %(default)s)")
    v.add_argument("--rerun", type=int, default=0, metavar="K",
                   help="re-measure the K rows cheapest to measure (cost counts, toys cells) and say whether they agree")
    v.add_argument("--lines", help="re-measure the rows at these line numbers instead (comma-separated)")
    v.add_argument("--history", action="store_true",
                   help="also check the file's git history: every line it ever held is still there, or in superseded/ "
                        "with its reason")
    v.set_defaults(fn=cmd_verify)

    i = sub.add_parser("inspect", help="per memory layer: gate values per token and the retrieval trace of a read")
    i.add_argument("model", help="a trained model: a `memzoo train` out dir or its ckpt.pt, or a bench LM dir (runs/bench/<preset>/lm/...)")
    i.add_argument("--text", help="the text to read")
    i.add_argument("--file", help="read the text from this file")
    i.add_argument("--top", type=int, default=4, help="slots shown per traced position")
    i.add_argument("--max-tokens", type=int, default=4096, help="read at most this many tokens of the text")
    i.set_defaults(fn=cmd_inspect)

    args = p.parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(f"\nmemzoo {args.cmd}: interrupted; what was recorded is kept"
              + (" (--resume continues)" if args.cmd == "bench" else ""), file=sys.stderr)
        return 130


def _run(args) -> int:
    try:
        from memzoo.registry import add_plugin, load_plugins

        for mod in args.plugin:
            add_plugin(mod)
        load_plugins()  # those named in MEMZOO_PLUGINS too: a bad name is an error before the verb runs
        return args.fn(args)
    except Exception as e:
        from memzoo.registry import PluginError
        from memzoo.train import Diverged  # already imported where training raised it

        if not isinstance(e, (ValueError, KeyError, OSError, Diverged, PluginError)) or "MEMZOO_DEBUG" in os.environ:
            raise
        print(f"memzoo {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
