"""TrainConfig validation, TOML round trip, and the CLI's exit code 2 on bad configurations."""

from __future__ import annotations

import dataclasses
import os

import pytest

from mixprec.cli.main import main
from mixprec.lab.config import TrainConfig, config_from_toml, config_to_toml, field_docs, merge_config


def test_every_field_has_a_docstring() -> None:
    docs = field_docs()
    missing = [f.name for f in dataclasses.fields(TrainConfig) if not docs.get(f.name)]
    assert missing == []


def test_toml_round_trip(tmp_path) -> None:
    cfg = TrainConfig(precision="fp16", loss_scaler="static", loss_scale=512.0, lr=3e-4, out_dir='a "quoted" dir')
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg, "header line"))
    assert merge_config(config_from_toml(str(path))) == cfg


def test_flags_win_over_file(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('precision = "bf16"\nsteps = 7\n')
    cfg = merge_config(config_from_toml(str(path)), {"steps": 9, "precision": None})
    assert (cfg.precision, cfg.steps) == ("bf16", 9)


def test_int_accepted_for_float_fields_and_bool_refused() -> None:
    assert TrainConfig(lr=1).lr == 1.0
    with pytest.raises(TypeError, match="sharded_optimizer"):
        TrainConfig(sharded_optimizer=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="steps"):
        TrainConfig(steps=2.0)  # type: ignore[arg-type]


def test_num_microbatches_and_auto_scaler() -> None:
    cfg = TrainConfig(global_batch_size=32, micro_batch_size=4, nproc=2, precision="fp16")
    assert cfg.num_microbatches == 4
    assert cfg.resolved_loss_scaler == "dynamic"
    assert TrainConfig(precision="bf16").resolved_loss_scaler == "none"


def _train(tmp_path, *extra: str) -> int:
    return main(["train", "--out-dir", str(tmp_path / "run"), "--steps", "1", *extra])


def test_unknown_toml_key_exits_2(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text("steps = 3\nlearning_rate = 0.1\n")
    assert _train(tmp_path, "--config", str(path)) == 2
    err = capsys.readouterr().err
    assert "unknown key(s) 'learning_rate'" in err and "allowed keys" in err
    assert not os.path.exists(tmp_path / "run")


def test_toml_tables_are_unknown_keys(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[model]\nn_layer = 2\n")
    assert _train(tmp_path, "--config", str(path)) == 2
    assert "'model'" in capsys.readouterr().err


def test_invalid_toml_exits_2(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text("steps = = 3\n")
    assert _train(tmp_path, "--config", str(path)) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_gbs_not_divisible_exits_2(tmp_path, capsys) -> None:
    assert _train(tmp_path, "--global-batch-size", "10", "--micro-batch-size", "4", "--nproc", "2") == 2
    err = capsys.readouterr().err
    assert "global_batch_size 10 is not a multiple of micro_batch_size x data_parallel_size = 4 x 2 = 8" in err


def test_missing_corpus_exits_2(tmp_path, capsys) -> None:
    assert _train(tmp_path, "--corpus", str(tmp_path / "nope.txt")) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "nope.txt" in err
    assert not os.path.exists(tmp_path / "run")


def test_bad_choice_exits_2(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _train(tmp_path, "--precision", "fp8")
    assert info.value.code == 2
    path = tmp_path / "c.toml"
    path.write_text('reduce = "ring"\n')
    assert _train(tmp_path, "--config", str(path)) == 2
    assert "reduce must be one of 'native', 'fp32_accumulate', 'uint8', 'uint8_hierarchical'" in capsys.readouterr().err


def test_wrong_toml_type_exits_2(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text('n_layer = "two"\n')
    assert _train(tmp_path, "--config", str(path)) == 2
    assert "n_layer must be an integer" in capsys.readouterr().err


def test_head_must_divide_width() -> None:
    with pytest.raises(ValueError, match="n_embd"):
        TrainConfig(n_embd=30, n_head=4)


def test_missing_config_file_exits_2(tmp_path, capsys) -> None:
    assert _train(tmp_path, "--config", str(tmp_path / "absent.toml")) == 2
    assert "config file not found" in capsys.readouterr().err


def test_builtin_example_configs_are_valid_and_say_what_to_expect() -> None:
    from mixprec.lab.config import CONFIGS_DIR, builtin_configs

    names = builtin_configs()
    assert {"fp16_dynamic", "bf16_fp32acc", "seed002_fc_fp16", "gpu_bf16"} <= set(names)
    for name in names:
        with open(os.path.join(CONFIGS_DIR, name + ".toml")) as fh:
            text = fh.read()
        assert f"--config {name}" in text.splitlines()[0], name  # the first line is the command that runs it
        assert "Expect" in text and "EXPECT_" not in text, name
        cfg = merge_config(config_from_toml(name))  # by name, as --config NAME does
        assert cfg.num_microbatches >= 1


def test_config_name_or_missing_file(tmp_path, capsys) -> None:
    assert merge_config(config_from_toml("fp16_dynamic.toml")).precision == "fp16"
    with pytest.raises(ValueError, match=r"built-in examples: .*fp16_dynamic"):
        config_from_toml(str(tmp_path / "nope.toml"))


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"precision": "fp16", "loss_scale": 0.5}, ["init_scale (0.5) must be >= min_scale (1.0)", "loss_scale"]),
        ({"max_loss_scale": 0.5}, ["max_scale (0.5) must be >= min_scale", "max_loss_scale"]),
        ({"on_min_loss_scale": "boom"}, ["'raise', 'warn', 'ignore'", "on_min_loss_scale"]),
        ({"scale_min_patience": 0}, ["min_patience", "scale_min_patience"]),
        ({"scale_growth_factor": 1.0}, ["growth_factor must be > 1", "scale_growth_factor"]),
    ],
)
def test_scaler_fields_are_checked_by_the_scaler_and_named_as_fields(fields, words) -> None:
    """Checked whatever loss_scaler this run uses (a config file is reused), in this configuration's names."""
    with pytest.raises(ValueError) as info:
        TrainConfig(**fields)
    assert all(w in str(info.value) for w in words)


def test_build_scaler_carries_every_field() -> None:
    from mixprec.scaling import DynamicLossScaler, StaticLossScaler

    cfg = TrainConfig(
        precision="fp16", loss_scale=8.0, scale_growth_factor=4.0, scale_backoff_factor=0.25,
        scale_growth_interval=7, scale_hysteresis=3, scale_consecutive_hysteresis=True, min_loss_scale=0.5,
        max_loss_scale=64.0, scale_min_patience=4, on_min_loss_scale="warn",
    )  # fmt: skip
    scaler = cfg.build_scaler()
    assert isinstance(scaler, DynamicLossScaler)
    got = (scaler.get_scale(), scaler.growth_factor, scaler.backoff_factor, scaler.growth_interval,
           scaler.hysteresis, scaler.consecutive_hysteresis, scaler.min_scale, scaler.max_scale,
           scaler.min_patience, scaler.on_min_scale)  # fmt: skip
    assert got == (8.0, 4.0, 0.25, 7, 3, True, 0.5, 64.0, 4, "warn")
    # 0 = none of its own for the floor and the ceiling.
    free = TrainConfig(precision="fp16", min_loss_scale=0.0, max_loss_scale=0.0).build_scaler()
    assert free.max_scale is None and free.min_scale is None  # (the scaler's own floor is fp32's smallest normal)
    assert type(TrainConfig(loss_scaler="static", loss_scale=16.0).build_scaler()) is StaticLossScaler
    assert TrainConfig(loss_scaler="static", loss_scale=16.0).build_scaler().get_scale() == 16.0
    assert TrainConfig().build_scaler().get_scale() == 1.0  # fp32, 'auto' -> none: scale 1, still detects inf/NaN
