"""The command line as a new user meets it: --version, --log-level before or after the verb in any case, defaults
in every verb's --help, vLLM flags that do not apply accepted with one warning each, unknown flags refused in
the verb's name with close matches."""
from __future__ import annotations

import argparse
import importlib.metadata
import logging

import pytest

import strata.cli
from strata.cli import build_parser, main
from strata.cli_common import ENGINE_FLAGS, SERVER_FLAGS, _verb_parsers
from strata.config.engine_args import EngineArgs


def test_version_prints_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out == f"strata {importlib.metadata.version('strata')}\n"


@pytest.fixture
def ran(monkeypatch) -> list:
    """main() up to running the verb: the parsed args and the logging level it set, nothing run."""
    seen = []
    monkeypatch.setattr(strata.cli, "_run", lambda args: seen.append(args) or 0)
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: seen.append(kw["level"]))
    return seen


@pytest.mark.parametrize("argv, level", [
    (["serve", "--log-level", "debug"], "DEBUG"),
    (["--log-level", "error", "plan", "m"], "ERROR"),
    (["--log-level", "error", "bench", "latency", "--model", "m", "--log-level", "Warn"], "WARNING"),
    (["bench", "serve", "--model", "m"], "INFO"),
])
def test_log_level_is_taken_before_or_after_the_verb_in_any_case(ran, argv, level):
    assert main(argv) == 0
    assert ran[0] == level and logging.getLevelName(level) in (10, 20, 30, 40)


def test_an_unknown_log_level_is_refused_with_the_levels(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--log-level", "verbose"])
    assert stopped.value.code == 2
    assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in capsys.readouterr().err


def _option_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    formatter = parser._get_formatter()
    return {a.option_strings[-1]: formatter._expand_help(a) for a in parser._actions
            if a.option_strings and a.help not in (None, argparse.SUPPRESS)}


def test_every_verbs_help_shows_each_default_once():
    parser = build_parser()
    verbs = list(_verb_parsers(parser))
    assert len(verbs) >= 6
    for verb in verbs:
        helps = _option_help(verb)
        for action in verb._actions:
            shown = action.default is not None and action.default is not argparse.SUPPRESS and action.nargs != 0
            if action.option_strings and shown:
                text = helps[action.option_strings[-1]]
                assert "default" in text.lower(), (verb.prog, action.option_strings)
        assert all(text.count("(default:") <= 1 for text in helps.values()), verb.prog
    serve = next(v for v in verbs if v.prog == "strata serve")
    assert "(default: 8000)" in _option_help(serve)["--port"]
    assert "(default: 1)" in _option_help(serve)["--tensor-parallel-size"]
    assert "(default: 8000)" in serve.format_help().replace("\n", " ").replace("  ", " ")


def test_vllm_flags_that_do_not_apply_are_accepted_with_one_warning_each(ran, caplog):
    argv = ["serve", "m", "--trust-remote-code", "--enforce-eager", "--swap-space", "4", "--enforce-eager",
            "--disable-log-stats", "--disable-frontend-multiprocessing", "--compilation-config", '{"level": 3}']
    with caplog.at_level(logging.WARNING, logger="strata.cli_common"):
        assert main(argv) == 0
    warned = [r.getMessage().split(" ")[1] for r in caplog.records if r.getMessage().startswith("ignoring ")]
    assert sorted(warned) == sorted(["--trust-remote-code", "--enforce-eager", "--swap-space", "--disable-log-stats",
                                     "--disable-frontend-multiprocessing", "--compilation-config"])
    # They change nothing: the engine options are the defaults.
    assert EngineArgs.from_cli_args(ran[1], "m") == EngineArgs("m")


@pytest.mark.parametrize("argv", [["bench", "throughput", "--model", "m"], ["bench", "latency", "--model", "m"],
                                  ["plan", "m"]])
def test_every_engine_verb_accepts_the_ignored_engine_flags(ran, argv):
    for flag in ENGINE_FLAGS:
        assert main(argv + [flag.flag] + (["1"] if flag.takes_value else [])) == 0


def test_server_only_flags_are_refused_by_other_verbs_in_their_own_name(capsys):
    flag = SERVER_FLAGS[0].flag
    with pytest.raises(SystemExit):
        main(["plan", "m", flag])
    assert f"strata plan: error: unrecognized arguments: {flag}" in capsys.readouterr().err


def test_a_misspelt_flag_is_refused_with_the_verbs_close_matches(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "m", "--max-model-lenn", "5"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert "strata serve: error: unrecognized arguments: --max-model-lenn (did you mean --max-model-len" in err
    assert "usage: strata serve" in err


def test_uvicorn_flags_of_vllm_are_real_flags_of_serve(ran):
    assert main(["serve", "--uvicorn-log-level", "WARNING", "--disable-uvicorn-access-log"]) == 0
    assert ran[1].uvicorn_log_level == "warning" and ran[1].disable_uvicorn_access_log
