"""The `memzoo` command: its verbs registered by name (`register_command`), as layers are. The core
registers train, params, inspect and generate; the bench (memzoo.bench.cli, which the installed `memzoo` command
runs) registers bench, leaderboard and verify, so the core imports nothing of the bench.

A user's mistake (a bad config or flag, a missing or unreadable file, an unwritable output, a
run that diverged) is one line on stderr and exit status 2, not a traceback; set MEMZOO_DEBUG
to see the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


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


def cmd_inspect(args) -> int:
    from memzoo.inspection import inspect_text

    text = Path(args.file).read_text() if args.file else args.text
    if not text:
        raise ValueError("give the text to read: --text '...' or --file PATH")
    print(inspect_text(args.model, text, top=args.top, max_tokens=args.max_tokens))
    return 0


def cmd_generate(args) -> int:
    from memzoo.generation import cmd_generate as generate  # torch and transformers: only when it runs

    return generate(args)


def _generate_arguments(g) -> None:
    from memzoo.generation import arguments

    arguments(g)


def cmd_train(args) -> int:
    from memzoo.train import cmd_train as train  # torch: only when it trains

    return train(args)


@dataclass(frozen=True)
class Command:
    """A verb of the `memzoo` command: `arguments(parser)` adds its arguments, `run(args)` runs it (its exit
    status); `parser` holds more keyword arguments of its sub-parser (a formatter; an epilog, which may be a
    callable, called when the parser is built); `resumable`: a verb whose interrupted run `--resume` continues."""

    name: str
    help: str
    arguments: Callable
    run: Callable
    parser: dict = field(default_factory=dict)
    resumable: bool = False


COMMANDS: dict[str, Command] = {}


def register_command(command: Command) -> Command:
    """Add a verb to the `memzoo` command (a later one of the same name replaces it)."""
    COMMANDS[command.name] = command
    return command


def _train_arguments(t) -> None:
    from memzoo.config import add_train_arguments

    add_train_arguments(t)


def _params_arguments(q) -> None:
    q.add_argument("configs", nargs="+", help="config files, shipped names (paper/gdn) or directories (paper)")


def _inspect_arguments(i) -> None:
    i.add_argument("model", help="a trained model: a `memzoo train` out dir or its ckpt.pt, or a bench LM dir (runs/bench/<preset>/lm/...)")
    i.add_argument("--text", help="the text to read")
    i.add_argument("--file", help="read the text from this file")
    i.add_argument("--top", type=int, default=4, help="slots shown per traced position")
    i.add_argument("--max-tokens", type=int, default=4096, help="read at most this many tokens of the text")


register_command(Command("train", "train a model from a config (YAML path or shipped name, e.g. tiny/gdn)", _train_arguments,
                         cmd_train))
register_command(Command("params", "count parameters on the meta device, beside the paper's figure", _params_arguments,
                         cmd_params))
register_command(Command("inspect", "per memory layer: gate values per token and the retrieval trace of a read",
                         _inspect_arguments, cmd_inspect))
register_command(Command("generate", "continue a prompt with a trained model (a run, an attached model, a bench LM)",
                         _generate_arguments, cmd_generate))


def main(argv: list[str] | None = None) -> int:
    """Run the `memzoo` command with the verbs registered so far (`python -m memzoo.cli`: the core's;
    the installed `memzoo`, memzoo.bench.cli's main: the bench's too)."""
    p = argparse.ArgumentParser(prog="memzoo", description="A zoo of fast-weight memory layers: train, count, bench.")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE first, so the layers it registers (@memzoo.register_layer) are usable by name; "
                        "repeatable; added to $MEMZOO_PLUGINS (comma-separated), which bench workers inherit")
    sub = p.add_subparsers(dest="cmd", required=True)
    for c in COMMANDS.values():
        kw = dict(c.parser)
        if callable(kw.get("epilog")):  # computed when the parser is built (the bench's presets)
            kw["epilog"] = kw["epilog"]()
        sp = sub.add_parser(c.name, help=c.help, **kw)
        c.arguments(sp)
        sp.set_defaults(fn=c.run)

    args = p.parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(f"\nmemzoo {args.cmd}: interrupted; what was recorded is kept"
              + (" (--resume continues)" if COMMANDS[args.cmd].resumable else ""), file=sys.stderr)
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
