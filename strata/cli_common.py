"""What every verb of the command line shares: `--log-level` after the verb too, defaults shown in `--help`, and
the vLLM flags that do not apply to strata, accepted with a warning so that a vLLM command line runs as it is."""
from __future__ import annotations

import argparse
import difflib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Where an ignored flag's value lands: a dest no real option can have, so that its presence alone says it was given.
_IGNORED_PREFIX = "ignored_vllm_flag:"
# The parser of the verb that parsed a command line (the innermost sets it last), to refuse leftovers in its name.
_VERB_PARSER = "verb_parser:"


def log_level(value: str) -> str:
    """`--log-level debug` as well as DEBUG; WARN is WARNING (logging's alias)."""
    level = value.strip().upper()
    level = "WARNING" if level == "WARN" else level
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)} (any case), got {value!r}")
    return level


@dataclass(frozen=True)
class IgnoredFlag:
    """A vLLM flag whose effect strata has no counterpart for, or always has: accepted, warned about, no effect."""

    flag: str
    why: str
    takes_value: bool = False


# Only flags whose absence changes no output and no limit: performance knobs of machinery strata does not have.
ENGINE_FLAGS = (
    IgnoredFlag("--trust-remote-code", "strata runs no code from a checkpoint; it reads only config and weights"),
    IgnoredFlag("--no-trust-remote-code", "strata never runs code from a checkpoint"),
    IgnoredFlag("--enforce-eager", "strata captures no CUDA graphs: it always runs eagerly"),
    IgnoredFlag("--no-enforce-eager", "strata captures no CUDA graphs"),
    IgnoredFlag("--disable-custom-all-reduce", "strata's all-reduce is torch.distributed's own"),
    IgnoredFlag("--swap-space", "strata swaps no KV blocks to CPU memory: preempted requests are recomputed", True),
    IgnoredFlag("--max-seq-len-to-capture", "strata captures no CUDA graphs", True),
    IgnoredFlag("--compilation-config", "strata uses neither torch.compile nor CUDA graphs", True),
    IgnoredFlag("--disable-log-stats", "strata logs no periodic engine stats (see GET /metrics)"),
    IgnoredFlag("--enable-chunked-prefill", "strata always prefills long prompts in chunks"),
    IgnoredFlag("--max-parallel-loading-workers", "strata loads the weights of each rank in one pass", True),
    IgnoredFlag("--use-v2-block-manager", "strata has one block manager"),
    IgnoredFlag("--disable-async-output-proc", "strata has no separate output-processing thread to disable"),
    IgnoredFlag("--async-scheduling", "strata schedules each step after the last one's tokens are known"),
)
SERVER_FLAGS = (
    IgnoredFlag("--disable-frontend-multiprocessing", "strata's HTTP server and engine share one process"),
    IgnoredFlag("--max-log-len", "strata logs no prompt text", True),
)


def finish_parser(parser: argparse.ArgumentParser) -> None:
    """For every verb below `parser`: `--log-level` after it, defaults in `--help`, the ignored vLLM flags (engine
    ones where the verb takes engine options, server ones on `serve`). Call it after every verb was added."""
    for sub in _verb_parsers(parser):
        sub.set_defaults(**{_VERB_PARSER: sub})
        dests = {a.dest for a in sub._actions}
        if "log_level" not in dests:
            # SUPPRESS: given after the verb it overrides the one before; absent, it leaves that one alone.
            sub.add_argument("--log-level", type=log_level, default=argparse.SUPPRESS,
                             help="logging level, any case: debug, info, warning, error or critical "
                                  "(default: info; also accepted before the verb)")
        if "tensor_parallel_size" in dests:
            _add_ignored(sub, ENGINE_FLAGS + (SERVER_FLAGS if "served_model_name" in dests else ()))
    for p in [parser, *_verb_parsers(parser)]:
        for action in p._actions:
            _show_default(action)


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse; what no option of the verb takes is refused with the verb's usage (not the top-level one) and the
    verb's close matches of each unknown flag."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        verb = getattr(args, _VERB_PARSER, parser)
        options = [s for a in verb._actions for s in a.option_strings]
        hints = []
        for arg in unknown:
            close = difflib.get_close_matches(arg.partition("=")[0], options, n=2) if arg.startswith("-") else []
            hints.append(f"{arg} (did you mean {' or '.join(close)}?)" if close else arg)
        verb.error(f"unrecognized arguments: {' '.join(hints)}; `{verb.prog} --help` lists the options")
    return args


def warn_ignored_flags(args: argparse.Namespace) -> list[str]:
    """One warning for each ignored vLLM flag given; the flags, in the order of the tables."""
    given = [f for f in (*ENGINE_FLAGS, *SERVER_FLAGS) if hasattr(args, _IGNORED_PREFIX + f.flag)]
    for f in given:
        logger.warning("ignoring %s (a vLLM flag): %s", f.flag, f.why)
    return [f.flag for f in given]


def _add_ignored(parser: argparse.ArgumentParser, flags: tuple[IgnoredFlag, ...]) -> None:
    group = parser.add_argument_group("vLLM flags accepted and ignored (each with a warning)")
    for f in flags:
        dest = _IGNORED_PREFIX + f.flag
        if f.takes_value:
            group.add_argument(f.flag, dest=dest, default=argparse.SUPPRESS, metavar="VALUE", help=f.why)
        else:
            group.add_argument(f.flag, dest=dest, action="store_true", default=argparse.SUPPRESS, help=f.why)


def _verb_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every parser of a verb (`serve`, `bench latency`, ...) below `parser`, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield sub
                yield from _verb_parsers(sub)


def _show_default(action: argparse.Action) -> None:
    """Append `(default: X)` to an option's help, as ArgumentDefaultsHelpFormatter does, except where the help says
    its default already, or the default is nothing to show (None, an unset switch's False)."""
    if not action.option_strings or action.help == argparse.SUPPRESS:
        return
    if action.default is None or action.default is argparse.SUPPRESS or action.nargs == 0:
        return  # nargs 0: a switch, whose default is plainly "not given"
    text = action.help or ""
    if "%(default)" in text or "default" in text.lower():
        return
    action.help = f"{text} (default: %(default)s)" if text else "default: %(default)s"
