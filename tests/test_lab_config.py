"""TrainConfig validation, TOML round trip, and the CLI's exit code 2 on bad configurations."""

from __future__ import annotations

import os

import pytest

from mixprec.cli.main import main
from mixprec.lab.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ScalerConfig,
    TrainConfig,
    TrainingConfig,
    config_from_toml,
    config_to_toml,
    field_docs,
    flat_fields,
    merge_config,
)


def test_every_field_has_a_docstring() -> None:
    docs = field_docs()
    missing = [f"{s}.{f.name}" for s, f in flat_fields() if not docs.get(f"{s}.{f.name}")]
    assert missing == []


def test_toml_round_trip(tmp_path) -> None:
    cfg = TrainConfig(
        model=ModelConfig(precision="fp16"),
        scaler=ScalerConfig(kind="static", init_scale=512.0),
        optimizer=OptimizerConfig(lr=3e-4, betas=(0.8, 0.95)),
        training=TrainingConfig(out_dir='a "quoted" dir'),
    )
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg, "header line"))
    assert merge_config(config_from_toml(str(path))) == cfg


def test_flags_win_over_file(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[model]\nprecision = "bf16"\n[training]\nsteps = 7\n')
    cfg = merge_config(config_from_toml(str(path)), {"training": {"steps": 9}, "model": {"precision": None}})
    assert (cfg.model.precision, cfg.training.steps) == ("bf16", 9)


def test_int_accepted_for_float_fields_and_bool_refused() -> None:
    assert OptimizerConfig(lr=1).lr == 1.0
    with pytest.raises(TypeError, match="sharded_optimizer"):
        ParallelConfig(sharded_optimizer=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="steps"):
        TrainingConfig(steps=2.0)  # type: ignore[arg-type]


def test_num_microbatches_and_auto_scaler() -> None:
    cfg = TrainConfig(
        data=DataConfig(global_batch_size=32, micro_batch_size=4),
        parallel=ParallelConfig(nproc=2),
        model=ModelConfig(precision="fp16"),
    )
    assert cfg.num_microbatches == 4
    assert cfg.resolved_loss_scaler == "dynamic"
    assert TrainConfig(model=ModelConfig(precision="bf16")).resolved_loss_scaler == "none"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        # a field's bare name at the top level: refused, naming its table
        ('precision = "fp16"\n', "unknown key(s) 'precision' ('precision' is model.precision: put it in the [model]"),
        ("steps = 3\n[model]\nn_layer = 1\n", "'steps' is training.steps: put it in the [training] table"),
        # a name that is no field: the closest sectioned name
        ("loss_scale = 8.0\n", "unknown key(s) 'loss_scale' (did you mean scaler.init_scale?)"),
        ("beta1 = 0.8\n", "unknown key(s) 'beta1' (did you mean optimizer.betas?)"),
        ("[model]\nn_layers = 2\n", "unknown key(s) 'n_layers' in [model] ('n_layers': did you mean 'n_layer'?)"),
    ],
)
def test_keys_outside_their_table_fail_in_one_line(tmp_path, capsys, text, words) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert _train(tmp_path, "--config", str(path)) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "run")


def test_a_fields_bare_name_is_no_flag(tmp_path, capsys) -> None:
    from mixprec.cli.main import build_parser
    from mixprec.cli.train import config_from_args

    parser = build_parser()
    cfg = config_from_args(parser.parse_args(["train", "--scaler.init-scale", "8", "--optimizer.betas", "0.8", "0.9"]))
    assert (cfg.scaler.init_scale, cfg.optimizer.betas) == (8.0, (0.8, 0.9))
    for flag, sectioned in (("--n-layer", "--model.n-layer"), ("--out-dir", "--training.out-dir")):
        assert _train(tmp_path, flag, "2") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{flag} is not a flag: use {sectioned}" in err[0], err
    assert _train(tmp_path, "--error-feedback") == 2
    assert "use --parallel.error-feedback" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run")


def test_from_fields_takes_the_fields_own_names_only() -> None:
    cfg = TrainConfig.from_fields({"n_layer": 1, "kind": "static", "steps": 2})
    assert (cfg.model.n_layer, cfg.scaler.kind, cfg.training.steps) == (1, "static", 2)
    with pytest.raises(ValueError, match=r"unknown field.*'loss_scaler'"):
        TrainConfig.from_fields({"loss_scaler": "static"})


def _train(tmp_path, *extra: str) -> int:
    return main(["train", "--training.out-dir", str(tmp_path / "run"), "--training.steps", "1", *extra])


def test_unknown_toml_key_exits_2(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[optimizer]\nlearning_rate = 0.1\n")
    assert _train(tmp_path, "--config", str(path)) == 2
    err = capsys.readouterr().err
    assert "unknown key(s) 'learning_rate' in [optimizer]" in err and "allowed keys" in err
    assert not os.path.exists(tmp_path / "run")


def test_unknown_toml_tables_are_unknown_keys(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[modle]\nn_layer = 2\n")
    assert _train(tmp_path, "--config", str(path)) == 2
    assert "'modle'" in capsys.readouterr().err


def test_invalid_toml_exits_2(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text("steps = = 3\n")
    assert _train(tmp_path, "--config", str(path)) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_deeply_nested_toml_exits_2_in_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text("steps = " + "[" * 5000 + "]" * 5000 + "\n")
    assert _train(tmp_path, "--config", str(path)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nests arrays or tables too deeply" in err and "Traceback" not in err


def test_gbs_not_divisible_exits_2(tmp_path, capsys) -> None:
    assert (
        _train(tmp_path, "--data.global-batch-size", "10", "--data.micro-batch-size", "4", "--parallel.nproc", "2") == 2
    )
    err = capsys.readouterr().err
    assert "global_batch_size 10 is not a multiple of micro_batch_size x data_parallel_size = 4 x 2 = 8" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # accepted before, and ignored: native reductions have no nodes
        (
            ["--parallel.reduce", "native", "--parallel.nproc", "2", "--parallel.ranks-per-node", "3"],
            "ranks_per_node applies to the hierarchical reductions only (fp32_accumulate_hierarchical, "
            "uint8_hierarchical, fp8_hierarchical, mxfp8_hierarchical, nvfp4_hierarchical); reduce is 'native'",
        ),
        (
            ["--parallel.reduce", "uint8", "--parallel.nproc", "2", "--parallel.ranks-per-node", "1"],
            "ranks_per_node applies to the hierarchical reductions only",
        ),
        (
            ["--parallel.reduce", "fp32_accumulate", "--parallel.nproc", "2", "--parallel.link-gbps", "5"],
            "link_gbps applies to the adaptive reduction only (auto); reduce is 'fp32_accumulate'",
        ),
        (
            ["--parallel.reduce", "native", "--parallel.nproc", "2", "--parallel.error-feedback"],
            "error_feedback applies to the compressed reductions only (uint8, uint8_hierarchical, fp8, "
            "fp8_hierarchical, mxfp8, mxfp8_hierarchical, nvfp4, nvfp4_hierarchical, auto); reduce is 'native'",
        ),
        (
            ["--parallel.reduce", "native", "--parallel.nproc", "2", "--parallel.link-gbps", "-5"],
            "link_gbps must be a finite number >= 0",
        ),
    ],
)
def test_a_parallel_field_the_reduction_ignores_exits_2(tmp_path, capsys, flags, message) -> None:
    """A field that only other reductions read would change nothing: refused, as --link-gbps -5 is."""
    assert _train(tmp_path, *flags) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not os.path.exists(tmp_path / "run")


def test_parallel_fields_of_the_chosen_reduction_are_accepted() -> None:
    assert ParallelConfig(reduce="uint8_hierarchical", nproc=4, ranks_per_node=2).ranks_per_node == 2
    assert ParallelConfig(reduce="auto", nproc=2, link_gbps=5, error_feedback=True).link_gbps == 5.0
    assert ParallelConfig(reduce="fp8_hierarchical", nproc=4, ranks_per_node=2, error_feedback=True).error_feedback


def test_missing_corpus_exits_2(tmp_path, capsys) -> None:
    assert _train(tmp_path, "--data.corpus", str(tmp_path / "nope.txt")) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "nope.txt" in err
    assert not os.path.exists(tmp_path / "run")


def test_bad_choice_exits_2(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _train(tmp_path, "--model.precision", "fp8")
    assert info.value.code == 2
    path = tmp_path / "c.toml"
    path.write_text('[parallel]\nreduce = "ring"\n')
    assert _train(tmp_path, "--config", str(path)) == 2
    choices = "'native', 'fp32_accumulate', 'fp32_accumulate_hierarchical', 'uint8', 'uint8_hierarchical', 'fp8', "
    choices += "'fp8_hierarchical', 'mxfp8', 'mxfp8_hierarchical', 'nvfp4', 'nvfp4_hierarchical', 'auto'"
    assert f"reduce must be one of {choices}; got 'ring'" in capsys.readouterr().err


def test_wrong_toml_type_exits_2(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[model]\nn_layer = "two"\n')
    assert _train(tmp_path, "--config", str(path)) == 2
    assert "n_layer must be an integer" in capsys.readouterr().err


def test_head_must_divide_width() -> None:
    with pytest.raises(ValueError, match="n_embd"):
        ModelConfig(n_embd=30, n_head=4)


def test_missing_config_file_exits_2(tmp_path, capsys) -> None:
    assert _train(tmp_path, "--config", str(tmp_path / "absent.toml")) == 2
    assert "config file not found" in capsys.readouterr().err


def test_builtin_example_configs_are_valid_and_say_what_to_expect() -> None:
    from mixprec.lab.config import CONFIGS_DIR, builtin_configs

    names = builtin_configs()
    assert {"fp16_dynamic", "bf16_fp32acc", "fc_fp16_accumulate", "gpu_bf16"} <= set(names)
    for name in names:
        with open(os.path.join(CONFIGS_DIR, name + ".toml")) as fh:
            text = fh.read()
        assert f"--config {name}" in text.splitlines()[0], name  # the first line is the command that runs it
        assert "Expect" in text and "EXPECT_" not in text, name
        cfg = merge_config(config_from_toml(name))  # by name, as --config NAME does
        assert cfg.num_microbatches >= 1


def test_config_name_or_missing_file(tmp_path, capsys) -> None:
    assert merge_config(config_from_toml("fp16_dynamic.toml")).model.precision == "fp16"
    with pytest.raises(ValueError, match=r"built-in examples: .*fp16_dynamic"):
        config_from_toml(str(tmp_path / "nope.toml"))


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"model": {"precision": "fp16"}, "scaler": {"init_scale": 0.5}},
         ["init_scale (0.5) must be >= min_scale (1.0)"]),
        ({"scaler": {"max_scale": 0.5}}, ["max_scale (0.5) must be >= min_scale"]),
        ({"scaler": {"on_min_scale": "boom"}}, ["'raise', 'warn', 'ignore'", "on_min_scale"]),
        ({"scaler": {"min_patience": 0}}, ["min_patience"]),
        ({"scaler": {"growth_factor": 1.0}}, ["growth_factor must be > 1"]),
    ],
)  # fmt: skip
def test_scaler_fields_are_checked_by_the_scaler_and_named_as_fields(fields, words) -> None:
    """Checked whatever kind of scaler this run uses (a config file is reused); the scaler's own argument names
    are the fields' names, so its message names the field as written."""
    with pytest.raises(ValueError) as info:
        merge_config(fields)
    assert all(w in str(info.value) for w in words)


def test_build_scaler_carries_every_field() -> None:
    from mixprec.scaling import DynamicLossScaler, StaticLossScaler

    cfg = TrainConfig(model=ModelConfig(precision="fp16"), scaler=ScalerConfig(
        init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7, hysteresis=3,
        consecutive_hysteresis=True, min_scale=0.5, max_scale=64.0, min_patience=4, on_min_scale="warn",
    ))  # fmt: skip
    scaler = cfg.build_scaler()
    assert isinstance(scaler, DynamicLossScaler)
    got = (scaler.get_scale(), scaler.growth_factor, scaler.backoff_factor, scaler.growth_interval,
           scaler.hysteresis, scaler.consecutive_hysteresis, scaler.min_scale, scaler.max_scale,
           scaler.min_patience, scaler.on_min_scale)  # fmt: skip
    assert got == (8.0, 4.0, 0.25, 7, 3, True, 0.5, 64.0, 4, "warn")
    # 0 = none of its own for the floor and the ceiling.
    free = merge_config({"model": {"precision": "fp16"}, "scaler": {"min_scale": 0.0, "max_scale": 0.0}})
    free_scaler = free.build_scaler()
    assert free_scaler.max_scale is None and free_scaler.min_scale is None  # (its own floor: fp32's smallest normal)
    static = merge_config({"scaler": {"kind": "static", "init_scale": 16.0}})
    assert type(static.build_scaler()) is StaticLossScaler
    assert static.build_scaler().get_scale() == 16.0
    assert TrainConfig().build_scaler().get_scale() == 1.0  # fp32, 'auto' -> none: scale 1, still detects inf/NaN
