"""``mixprec demo``: the README's main job, on built-in defaults."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the built-in demonstration (a few minutes on 2 CPU cores)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mixprec.lab.demo import run_demo

    return run_demo(seed=args.seed)
