"""The `memzoo` command: train, params, bench."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _expand(names: list[str]) -> list[str]:
    """Config names, files, or directories (every *.yaml inside, sorted)."""
    from memzoo.config import config_dir

    out = []
    for n in names:
        for d in (Path(n), config_dir() / n):
            if d.is_dir():
                out += sorted(str(p) for p in d.glob("*.yaml"))
                break
        else:
            out.append(n)
    return out


def cmd_params(args) -> int:
    from memzoo.backbone.model import count_params
    from memzoo.config import load_config

    rows = []
    for name in _expand(args.configs):
        rc = load_config(name)
        n = count_params(rc.model) / 1e6
        ref = rc.paper.get("params_m")
        rows.append((Path(rc.source).stem, rc.model.layout, n, ref))
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
    return 0


def cmd_train(args) -> int:
    from memzoo.config import load_config
    from memzoo.train import train

    rc = load_config(args.config)
    overrides = {k: v for k, v in (("steps", args.steps), ("out_dir", args.out), ("seed", args.seed)) if v is not None}
    for k, v in overrides.items():
        setattr(rc.train, k, v)
    result = train(rc, resume=args.resume)
    print(
        f"done: step {result['step']}, train loss {result['train_loss']:.4f}, val loss {result['val_loss']:.4f} "
        f"(unigram entropy {result['unigram_entropy']:.4f} nats/token), checkpoint {result['checkpoint']}"
    )
    return 0


def cmd_bench(args) -> int:
    from memzoo.bench.run import run_bench

    run_bench(args.layers, args.suite, args.preset, args.seed, args.out, args.work_dir, args.device, not args.quiet, args.jobs)
    return 0


def cmd_leaderboard(args) -> int:
    from memzoo.bench.leaderboard import render

    for path in render(Path(args.out) / "results.jsonl"):
        print(path)
    return 0


def cmd_inspect(args) -> int:
    from memzoo.inspect import inspect_text

    text = Path(args.file).read_text() if args.file else args.text
    if not text:
        raise ValueError("give the text to read: --text '...' or --file PATH")
    print(inspect_text(args.model, text, top=args.top, max_tokens=args.max_tokens))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memzoo", description="A zoo of fast-weight memory layers: train, count, bench.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train a model from a config (YAML path or shipped name, e.g. tiny/gdn)")
    t.add_argument("config")
    t.add_argument("--resume", action="store_true", help="continue exactly from the last checkpoint in the out dir")
    t.add_argument("--steps", type=int, help="override train.steps")
    t.add_argument("--out", help="override train.out_dir")
    t.add_argument("--seed", type=int, help="override train.seed")
    t.set_defaults(fn=cmd_train)

    q = sub.add_parser("params", help="count parameters on the meta device, beside the paper's figure")
    q.add_argument("configs", nargs="+", help="config files, shipped names (paper/gdn) or directories (paper)")
    q.set_defaults(fn=cmd_params)

    b = sub.add_parser("bench", help="compare memory layers (and the plain backbone) on one backbone, data and budget")
    b.add_argument("--layers", default="", help="comma-separated layer names, or 'all'; the baseline is always included")
    b.add_argument("--suite", default="all", help="comma-separated: toys, ppl, niah, cost (default: all)")
    b.add_argument("--preset", default="tiny", help="tiny (CPU minutes), paper, or a preset YAML file")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="leaderboards", help="rows are appended to OUT/results.jsonl")
    b.add_argument("--work-dir", help="cache of trained LMs (default runs/bench/<preset>)")
    b.add_argument("--device", default="cpu")
    b.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per CPU core on CPU, 1 on CUDA)")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(fn=cmd_bench)

    lb = sub.add_parser("leaderboard", help="render OUT/README.md and figures from OUT/results.jsonl")
    lb.add_argument("--out", default="leaderboards")
    lb.set_defaults(fn=cmd_leaderboard)

    i = sub.add_parser("inspect", help="per memory layer: gate values per token and the retrieval trace of a read")
    i.add_argument("model", help="a trained model: a `memzoo train` out dir or its ckpt.pt, or a bench LM dir (runs/bench/<preset>/lm/...)")
    i.add_argument("--text", help="the text to read")
    i.add_argument("--file", help="read the text from this file")
    i.add_argument("--top", type=int, default=4, help="slots shown per traced position")
    i.add_argument("--max-tokens", type=int, default=4096)
    i.set_defaults(fn=cmd_inspect)

    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, KeyError, FileNotFoundError) as e:
        if getattr(args, "cmd", None) and "MEMZOO_DEBUG" not in __import__("os").environ:
            print(f"memzoo {args.cmd}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
