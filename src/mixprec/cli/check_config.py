"""``mixprec check-config``: the loss-scale advisor on a (GBS, MBS, DP, loss_scale) configuration."""

from __future__ import annotations

import argparse

from mixprec.scaling.advisor import advise, rescale_for_dp


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check-config",
        help="check loss_scale vs num_microbatches vs data-parallel size",
        description=(
            "Check a batch/loss-scale configuration against the rules of seed 002. "
            "Exit 0 when consistent, 1 when a rule is broken, 2 on invalid input."
        ),
    )
    p.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step, all ranks")
    p.add_argument("--micro-batch-size", type=int, required=True, help="samples per forward/backward per rank")
    p.add_argument("--dp", type=int, required=True, help="data-parallel size (number of replicas)")
    p.add_argument("--loss-scale", type=float, required=True, help="the loss scale (static or initial)")
    p.add_argument("--new-dp", type=int, default=None, help="also advise for a new data-parallel size")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    advice = advise(args.global_batch_size, args.micro_batch_size, args.dp, args.loss_scale)
    print(advice.format())
    ok = advice.ok
    if args.new_dp is not None:
        new_scale = rescale_for_dp(args.loss_scale, args.dp, args.new_dp)
        print()
        print(
            f"DP {args.dp} -> {args.new_dp}: keep loss_scale / num_microbatches constant with "
            f"loss_scale = {args.loss_scale:g} x {args.dp} / {args.new_dp} = {new_scale:g}"
        )
        new_advice = advise(args.global_batch_size, args.micro_batch_size, args.new_dp, new_scale)
        print(new_advice.format())
        ok = ok and new_advice.ok
    return 0 if ok else 1
