"""The reference the trainer-adapter tests compare against: an example script's run under mixprec's own wrapper.

``examples/integrations/*.py`` each define ``make_model``, ``batch``, ``make_scaler``, ``make_schedule``, ``STEPS``
and ``UINT8``; :func:`wrapper_run` trains that model on one rank of a forked gloo group with
``mixprec.parallel.DistributedDataParallel``, the same reducer and a skip-aware scheduler, so an adapter's result
can be held to it bit for bit.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "integrations"


def load_example(name: str) -> ModuleType:
    """``examples/integrations/<name>.py`` as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wrapper_run(ex: ModuleType, rank: int, *, reduce: str, schedule_steps: int = 1) -> dict:
    """The example's training under mixprec's wrapper on this rank: final weight, skips, scale and learning rate.

    ``schedule_steps``: scheduler steps per optimizer step (Accelerate's prepared scheduler steps once per process).
    """
    from mixprec.parallel import DistributedDataParallel
    from mixprec.scaling import SkipAwareLR

    torch.set_num_threads(1)
    net = ex.make_model()
    ddp = DistributedDataParallel(net, reduce=reduce, reduce_options=ex.UINT8 if reduce == "uint8" else {})
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    scaler = ex.make_scaler()
    sched = SkipAwareLR(ex.make_schedule(opt), scaler)
    for step in range(ex.STEPS):
        x, y = ex.batch(step, rank)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(ddp(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        for _ in range(schedule_steps):
            sched.step()
    return {
        "weight": net[0].weight.detach().clone(),
        "skipped": scaler.steps_skipped,
        "scale": scaler.get_scale(),
        "lr": sched.get_last_lr()[0],
    }
