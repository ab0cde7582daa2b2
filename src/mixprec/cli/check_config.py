"""``mixprec check-config``: the loss-scale advisor on a (GBS, MBS, DP, loss_scale) configuration."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from mixprec.scaling import advise, rescale_for_dp


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check-config",
        help="check loss_scale vs num_microbatches vs data-parallel size",
        description=(
            "Check a batch / loss-scale configuration against the loss-scale rules for gradient accumulation: "
            "each microbatch's loss is divided by num_microbatches = GBS / (MBS x DP), so loss_scale must be a "
            "power-of-two multiple of num_microbatches (at least num_microbatches), and it must be rescaled "
            "by old DP / new DP when the data-parallel size changes. "
            "Exit 0 when consistent, 1 when a rule is broken, 2 on invalid input."
        ),
    )
    p.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step, all ranks")
    p.add_argument("--micro-batch-size", type=int, required=True, help="samples per forward/backward per rank")
    p.add_argument("--dp", type=int, required=True, help="data-parallel size (number of replicas)")
    p.add_argument("--loss-scale", type=float, required=True, help="the loss scale (static or initial)")
    p.add_argument("--new-dp", type=int, default=None, help="also advise for a new data-parallel size")
    p.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check the arguments (the advisor validates them at its entry); the work prints the advice."""
    advice = advise(args.global_batch_size, args.micro_batch_size, args.dp, args.loss_scale)
    rescaled = None
    if args.new_dp is not None:
        new_scale = rescale_for_dp(args.loss_scale, args.dp, args.new_dp)
        rescaled = new_scale, advise(args.global_batch_size, args.micro_batch_size, args.new_dp, new_scale)

    def work() -> int:
        print(advice.format())
        ok = advice.ok
        if rescaled is not None:
            new_scale, new_advice = rescaled
            print()
            print(
                f"DP {args.dp} -> {args.new_dp}: keep loss_scale / num_microbatches constant with "
                f"loss_scale = {args.loss_scale:g} x {args.dp} / {args.new_dp} = {new_scale:g}"
            )
            print(new_advice.format())
            ok = ok and new_advice.ok
        return 0 if ok else 1

    return work
