"""``--help`` of every command and study: plain text (no reStructuredText), lists kept as lists, defaults shown."""

from __future__ import annotations

import re

import pytest

from mixprec.cli.main import build_parser, main

COMMANDS = [[], ["demo"], ["train"], ["compare"], ["check-config"], ["study"]]
STUDIES = [["study", "matmul-error"], ["study", "reduction-error"]]


def help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", COMMANDS + STUDIES, ids=lambda a: " ".join(a) or "mixprec")
def test_help_is_plain_text(argv, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    text = help_of(argv, capsys)
    assert "``" not in text
    assert not re.search(r":(class|func|meth|attr|mod):`", text)


def test_reduction_error_help_keeps_its_list(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    lines = help_of(["study", "reduction-error"], capsys).splitlines()
    for method in ("ring", "tree", "fp32_accumulate", "fp32_accumulate_sr", "fp32_sum_fp32_out"):
        assert any(line.startswith(f"* {method}: ") for line in lines), method


def test_study_options_show_their_defaults(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    text = help_of(["study", "matmul-error"], capsys)
    assert "(default: 256,1024,4096)" in text and "(default: 256)" in text and "(default: cpu)" in text
    assert "(default: fp16/16,two_stage,fp16/32,fp16/32-h100,bf16/32,fp8/promote128,fp8/nopromote)" in text
    assert "minutes" in text  # the run time on defaults is stated
    text = help_of(["study", "reduction-error"], capsys)
    assert "(default: 8,64,512,4096)" in text and "(default: 8192)" in text and "(default: 0.001)" in text


def test_plain_text_removes_roles_and_literals() -> None:
    from mixprec.cli.main import plain_text

    assert plain_text("see :class:`mixprec.Updater` and ``n_layer`` (:func:`~x.y`)") == (
        "see mixprec.Updater and n_layer (x.y)"
    )


def test_every_subcommand_checks_its_arguments_before_work() -> None:
    """Each subcommand registers ``prepare`` (argument checks, then the work), so that only a ValueError or
    TypeError from those checks becomes exit 2."""
    parser = build_parser()
    for argv in (
        ["demo"],
        ["train"],
        ["compare", "x"],
        ["check-config", "--global-batch-size", "1", "--micro-batch-size", "1", "--dp", "1", "--loss-scale", "1"],
        ["study", "matmul-error"],
        ["study", "reduction-error"],
    ):
        assert callable(getattr(parser.parse_args(argv), "prepare", None)), argv
