"""``mixprec train``: train the lab's small GPT with the precision, scaling and reduction under study.

Every field of :class:`mixprec.lab.config.TrainConfig` is a flag (``n_layer`` -> ``--n-layer``) and a key of the
``--config`` TOML file; flags win over the file, the file over the defaults. ``--resume`` starts from the run
directory's saved ``config.toml``. Exit codes: 0 done, 1 a rank failed (the others were stopped) or the run
diverged (the loss scaler stuck at its floor, or ``max_consecutive_skips`` skipped steps in a row), 2 invalid
configuration or input (checked before anything is written), 130 interrupted.

With several nodes (torchrun), ``--out-dir`` must be on a filesystem every node sees: rank 0 writes the run files
and every rank reads the checkpoint on ``--resume``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from mixprec.lab.config import (
    DEVICES,
    LINEAR_MODES,
    LOSS_SCALERS,
    ON_MIN_LOSS_SCALE,
    OPTIMIZERS,
    PRECISIONS,
    REDUCE_ROUNDINGS,
    REDUCTIONS,
    TrainConfig,
    builtin_configs,
    config_from_toml,
    field_docs,
    merge_config,
)

_CHOICES: dict[str, tuple[str, ...]] = {
    "precision": PRECISIONS,
    "loss_scaler": LOSS_SCALERS,
    "reduce": REDUCTIONS,
    "reduce_rounding": REDUCE_ROUNDINGS,
    "on_min_loss_scale": ON_MIN_LOSS_SCALE,
    "optimizer": OPTIMIZERS,
    "linear_mode": LINEAR_MODES,
    "device": DEVICES,
}
_TYPES = {"int": int, "float": float, "str": str}


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, defaulting to None so that unset flags do not override the TOML file."""
    docs = field_docs()
    defaults = TrainConfig()
    group = p.add_argument_group("run configuration (also TOML keys; flags win)")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{docs.get(f.name, '')} (default: {getattr(defaults, f.name)!r})".replace("%", "%%")
        if f.type == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(
                flag,
                dest=f.name,
                type=_TYPES[str(f.type)],
                choices=_CHOICES.get(f.name),
                default=None,
                metavar=f.name.upper() if f.name not in _CHOICES else None,
                help=help_text,
            )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults < the run directory's config.toml (with --resume) < --config FILE < flags."""
    flags = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    env_world = os.environ.get("WORLD_SIZE") if all(k in os.environ for k in ("RANK", "LOCAL_RANK")) else None
    if env_world is not None and flags["nproc"] is None and env_world.isdigit():
        flags["nproc"] = int(env_world)  # under torchrun: validate batch sizes against the real world size
    file_layer: dict[str, Any] = config_from_toml(args.config) if args.config else {}
    layers = [file_layer, flags]
    if getattr(args, "resume", False):
        out_dir = flags.get("out_dir") or file_layer.get("out_dir") or TrainConfig().out_dir
        saved = os.path.join(out_dir, "config.toml")
        if not os.path.isfile(saved):
            raise ValueError(f"--resume: {out_dir!r} holds no config.toml (is it a mixprec train run directory?)")
        layers.insert(0, config_from_toml(saved))
    return merge_config(*layers)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a small GPT on Python's stdlib sources with the precision/reduction under study",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML file of configuration keys (flat), or the name of a built-in example: "
        + ", ".join(builtin_configs()),
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out-dir from its checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --out-dir")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on rank 0 (default: when stderr is a terminal)",
    )
    add_config_arguments(p)
    p.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Every check the user's input can fail, before anything is written (a ValueError here exits 2)."""
    from mixprec.lab.launch import check_run, resolve_device, torchrun_env

    cfg = config_from_args(args)
    if args.nproc is not None and args.nproc > 1 and torchrun_env() is not None:
        raise ValueError("--nproc starts ranks itself; under torchrun the world size comes from torchrun instead")
    # launch() checks the configuration with the loss scaler resolved, as the run directory saves it.
    check_run(
        dataclasses.replace(cfg, loss_scaler=cfg.resolved_loss_scaler), resume=args.resume, overwrite=args.overwrite
    )
    resolve_device(cfg)
    return lambda: run(args)


def run(args: argparse.Namespace) -> int:
    from mixprec.lab.launch import TrainingFailed, launch, torchrun_env
    from mixprec.lab.train import TrainingDiverged
    from mixprec.scaling.scaler import LossScaleFloorError

    cfg = config_from_args(args)
    if args.nproc is not None and args.nproc > 1 and torchrun_env() is not None:
        raise ValueError("--nproc starts ranks itself; under torchrun the world size comes from torchrun instead")
    try:
        summary = launch(cfg, resume=args.resume, overwrite=args.overwrite, progress=args.progress)
    except TrainingFailed as exc:
        print(f"mixprec train: error: {exc}", file=sys.stderr)
        return 1
    except (TrainingDiverged, LossScaleFloorError) as exc:
        # The run itself failed (one rank, here): a message, not a traceback; the checkpoint is intact.
        print(f"mixprec train: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mixprec train: interrupted; the last checkpoint is intact (continue with --resume)", file=sys.stderr)
        return 130
    if summary is not None:
        print(
            f"mixprec train: done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}"
            + (f", val loss {summary['final_eval_loss']:.4f}" if summary.get("final_eval_loss") is not None else "")
            + f", {summary['skipped_steps']} skipped, {summary['tokens_per_s_median']:,.0f} tokens/s (median); "
            f"run directory {cfg.out_dir if os.path.isabs(cfg.out_dir) else os.path.abspath(cfg.out_dir)}"
        )
    return 0
