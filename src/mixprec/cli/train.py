"""mixprec train: train the lab's small GPT with the precision, scaling and reduction under study.

The configuration has one TOML table per component ([model], [data], [scaler], [optimizer], [parallel],
[training]); every field is also a flag, --section.field (--model.n-layer, --training.out-dir). Flags win over
the --config file, the file over the defaults; --resume starts from the run directory's saved config.toml. See
docs/lab.md.

Exit codes: 0 done; 1 a rank failed (the others were stopped), the run diverged (the loss scaler stuck at its
floor, or max_consecutive_skips skipped steps in a row) or the disk refused a write; 2 invalid configuration or
input (checked before anything is written); 130 interrupted (SIGINT); 143 terminated (SIGTERM).

With several nodes (torchrun), --training.out-dir must be on a filesystem every node sees: rank 0 writes the run files
and every rank reads the checkpoint on --resume.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable
from typing import Any

from mixprec.lab.config import (
    DEVICES,
    FP8_FORMATS,
    LOSS_SCALERS,
    LR_SCHEDULES,
    OPTIMIZERS,
    PRECISIONS,
    REDUCE_ROUNDINGS,
    REDUCTIONS,
    SECTIONS,
    TrainConfig,
    builtin_configs,
    config_from_toml,
    field_docs,
    flat_fields,
    merge_config,
)

_CHOICES: dict[str, tuple[str, ...]] = {
    "model.precision": PRECISIONS,
    "scaler.kind": LOSS_SCALERS,
    "optimizer.name": OPTIMIZERS,
    "optimizer.schedule": LR_SCHEDULES,
    "parallel.reduce": REDUCTIONS,
    "parallel.rounding": REDUCE_ROUNDINGS,
    "parallel.fp8_format": FP8_FORMATS,
    "training.device": DEVICES,
}
_TYPES = {"int": int, "float": float, "str": str}
# A full disk, a file-size or disk quota, a read-only filesystem, no permission: the environment, not a bug.
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
# dest prefix of a field's bare name as a flag (--n-layer): not read, refused with the --section.field to use
_BARE = "bare."


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per field, ``--section.field`` (``--model.n-layer``), defaulting to None so that unset flags do
    not override the TOML file. A field's bare name (``--n-layer``) is refused by :func:`_flag_layer`."""
    docs = field_docs()
    defaults = TrainConfig()
    groups = {name: p.add_argument_group(f"[{name}] (TOML table; flags win)") for name in SECTIONS}
    for section, f in flat_fields():
        dest = f"{section}.{f.name}"
        flag = f"--{section}.{f.name.replace('_', '-')}"
        default = getattr(getattr(defaults, section), f.name)
        help_text = f"{docs.get(dest, '')} (default: {default!r})".replace("%", "%%")
        group = groups[section]
        if f.type == "bool":
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif str(f.type).startswith("tuple"):
            group.add_argument(flag, dest=dest, type=float, nargs=2, default=None, metavar=("B1", "B2"), help=help_text)
        else:
            group.add_argument(
                flag,
                dest=dest,
                type=_TYPES[str(f.type)],
                choices=_CHOICES.get(dest),
                default=None,
                metavar=f.name.upper() if dest not in _CHOICES else None,
                help=help_text,
            )
        # Hidden: the bare name, so that it gets an error naming the flag to use instead of argparse's usage.
        group.add_argument(_flag(f.name), dest=_BARE + dest, nargs="*", default=None, help=argparse.SUPPRESS)


def _flag_layer(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    bare = [k.removeprefix(_BARE) for k, v in vars(args).items() if k.startswith(_BARE) and v is not None]
    if bare:
        section, name = bare[0].split(".", 1)
        raise ValueError(
            f"{_flag(name)} is not a flag: use --{section}.{name.replace('_', '-')} (flags are --section.field)"
        )
    layer: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for section, f in flat_fields():
        layer[section][f.name] = getattr(args, f"{section}.{f.name}")
    return layer


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults < the run directory's config.toml (with --resume) < --config FILE < flags."""
    flags = _flag_layer(args)
    env_world = os.environ.get("WORLD_SIZE") if all(k in os.environ for k in ("RANK", "LOCAL_RANK")) else None
    if env_world is not None and flags["parallel"]["nproc"] is None and env_world.isdigit():
        flags["parallel"]["nproc"] = int(env_world)  # under torchrun: validate batch sizes against the real world
    file_layer = config_from_toml(args.config) if args.config else {}
    layers = [file_layer, flags]
    if getattr(args, "resume", False):
        out_dir = (
            flags["training"]["out_dir"]
            or file_layer.get("training", {}).get("out_dir")
            or TrainConfig().training.out_dir
        )
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
        help="TOML file of [section] tables (see docs/lab.md), or the name of a built-in example: "
        + ", ".join(builtin_configs()),
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --training.out-dir from its checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --training.out-dir")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on rank 0 (default: when stderr is a terminal)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="K",
        help="noise band: train K copies into OUT_DIR/replica-0 .. replica-(K-1) that differ only by a last-bit "
        "perturbation of the initial weights (replica 0 unperturbed), for `mixprec compare --band OUT_DIR`",
    )
    p.add_argument(
        "--replica-kind",
        choices=("ulp", "seed"),
        default="ulp",
        help="ulp: replica k sets training.perturb = k (chaos alone); seed: training.seed + k (data and initial "
        "weights: the mean and spread of the final loss). Default: ulp",
    )
    add_config_arguments(p)
    p.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Every check the user's input can fail, before anything is written (a ValueError here exits 2)."""
    from mixprec.lab.launch import preflight, torchrun_env

    cfg = config_from_args(args)
    nproc = getattr(args, "parallel.nproc")
    if nproc is not None and nproc > 1 and torchrun_env() is not None:
        raise ValueError(
            "--parallel.nproc starts ranks itself; under torchrun the world size comes from torchrun instead"
        )
    if args.replicas is not None:
        from mixprec.lab.band import replica_configs

        if args.resume:
            raise ValueError(
                "--replicas cannot --resume; resume each replica with --training.out-dir OUT_DIR/replica-K"
            )
        replicas = replica_configs(cfg, args.replicas, args.replica_kind)
        for replica in replicas:
            preflight(replica, resume=False, overwrite=args.overwrite)
        return lambda: _run_replicas(args, replicas)
    cfg = preflight(cfg, resume=args.resume, overwrite=args.overwrite)
    return lambda: run(args, cfg)


def _run_replicas(args: argparse.Namespace, replicas: list[TrainConfig]) -> int:
    for replica in replicas:
        code = run(args, replica)
        if code:
            return code
    band_dir = os.path.dirname(replicas[0].training.out_dir)
    print(
        f"mixprec train: {len(replicas)} replicas in {band_dir}; compare with: mixprec compare --band {band_dir} RUN..."
    )
    return 0


def run(args: argparse.Namespace, cfg: TrainConfig) -> int:
    from mixprec.lab.checkpoint import CheckpointWriteError
    from mixprec.lab.launch import Terminated, TrainingFailed, launch, sigterm_as_interrupt
    from mixprec.lab.train import TrainingDiverged
    from mixprec.scaling import LossScaleFloorError

    try:
        with sigterm_as_interrupt():
            summary = launch(cfg, resume=args.resume, overwrite=args.overwrite, progress=args.progress, checked=True)
    except (TrainingFailed, TrainingDiverged, LossScaleFloorError, CheckpointWriteError) as exc:
        # A rank failed, the run diverged, or the disk refused a write: a message, not a traceback (the last
        # checkpoint is intact).
        print(f"mixprec train: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno not in _STORAGE_ERRNOS:
            raise
        print(f"mixprec train: error: cannot write the run directory: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        print(f"mixprec train: {how}; the last checkpoint is intact (continue with --resume)", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    if summary is not None:
        print(
            f"mixprec train: done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}"
            + (f", val loss {summary['final_eval_loss']:.4f}" if summary.get("final_eval_loss") is not None else "")
            + f", {summary['skipped_steps']} skipped, {summary['tokens_per_s_median']:,.0f} tokens/s (median); "
            f"run directory {os.path.abspath(cfg.training.out_dir)}"
        )
    return 0
