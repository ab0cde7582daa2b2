"""Noise bands: the one-ulp perturbation, the band statistic on known curves, and the CLI round trip."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.cli.main import main
from mixprec.lab.band import band_verdicts, false_alarms, perturb_weights
from mixprec.lab.compare import RunLog, load_run

TINY = [
    "--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "16", "--model.block-size", "16",
    "--data.global-batch-size", "8",
    "--data.micro-batch-size", "2", "--data.eval-sequences", "8", "--training.eval-interval", "0", "--optimizer.lr",
    "0.01", "--training.steps", "4",
    "--training.checkpoint-interval", "0", "--model.precision", "bf16",
]  # fmt: skip


def run_log(name: str, losses: list[float]) -> RunLog:
    return RunLog(name, name, dict(enumerate(losses)), {}, 0, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_perturbation_moves_every_weight_exactly_one_ulp(dtype: torch.dtype) -> None:
    module = torch.nn.Linear(64, 32).to(dtype)
    torch.nn.init.zeros_(module.bias)  # zeros move to the smallest subnormal, still one ulp
    before = [p.detach().clone() for p in module.parameters()]
    perturb_weights(module, 3)
    for old, new in zip(before, module.parameters()):
        up = new > old
        inf = torch.tensor(math.inf, dtype=dtype)
        assert torch.equal(new, torch.nextafter(old, torch.where(up, inf, -inf)))
        assert 0.3 < up.float().mean() < 0.7  # both signs
    again = torch.nn.Linear(64, 32).to(dtype)
    again.load_state_dict(dict(zip(("weight", "bias"), before)))
    perturb_weights(again, 3)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), module.parameters()))  # seeded by k


def test_band_verdicts_on_known_curves() -> None:
    replicas = [run_log(f"r{i}", [2.0 + 0.01 * i] * 10) for i in range(4)]  # band [1.97, 2.06] at every step
    inside = run_log("inside", [2.05] * 10)
    late = run_log("late", [2.0] * 6 + [2.2] * 4)
    blip = run_log("blip", [2.0, 2.0, 1.5, 1.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0])  # 2 steps out: not persistent
    verdicts, (mean, sd) = band_verdicts(replicas, [inside, late, blip], widen=1.0, persist=3)
    by = {v.name: v for v in verdicts}
    assert by["inside"].leaves_at is None and by["inside"].outside == 0
    assert (by["late"].leaves_at, by["late"].side) == (6, "above")
    assert by["blip"].leaves_at is None and by["blip"].outside == pytest.approx(0.2)
    assert mean == pytest.approx(2.015) and by["late"].z_final == pytest.approx((2.2 - mean) / sd)
    assert false_alarms(replicas, widen=1.0) == 0
    with pytest.raises(ValueError, match="at least 2"):
        band_verdicts(replicas[:1], [inside])


def test_replicas_of_unequal_length_are_refused_not_cut(tmp_path, capsys) -> None:
    """Replicas of 5, 5 and 3 steps: the band would silently cover the 3 shared steps only."""
    replicas = [run_log("r0", [2.0] * 5), run_log("r1", [2.01] * 5), run_log("r2", [2.02] * 3)]
    message = r"replica r2 logged loss at 3 steps \(0..2\), but replica r0 at 5 steps \(0..4\)"
    with pytest.raises(ValueError, match=message):
        band_verdicts(replicas, [run_log("v", [2.0] * 5)])
    with pytest.raises(ValueError, match=r"replica r2 logged loss at 3 steps \(0..2\), but replica r\d at 5 steps"):
        false_alarms(replicas)
    for k, n in enumerate((5, 5, 3)):
        (tmp_path / "band" / f"replica-{k}").mkdir(parents=True)
        rows = "".join(f'{{"step": {s}, "loss": {2.0 + 0.01 * k}}}\n' for s in range(n))
        (tmp_path / "band" / f"replica-{k}" / "metrics.jsonl").write_text(rows)
    (tmp_path / "v.jsonl").write_text("".join(f'{{"step": {s}, "loss": 2.0}}\n' for s in range(5)))
    assert main(["compare", "--no-plot", "--band", str(tmp_path / "band"), str(tmp_path / "v.jsonl")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"replica {tmp_path / 'band' / 'replica-2' / 'metrics.jsonl'} logged loss at 3 steps (0..2)" in err


def test_replicas_and_compare_band_round_trip(tmp_path, capsys) -> None:
    assert main(["train", *TINY, "--replicas", "3", "--training.out-dir", str(tmp_path / "band")]) == 0
    assert sorted(p.name for p in (tmp_path / "band").iterdir()) == ["replica-0", "replica-1", "replica-2"]
    assert main(["train", *TINY, "--training.out-dir", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    assert main(["compare", "--no-plot", "--band", str(tmp_path / "band"), str(tmp_path / "plain")]) == 0
    out = capsys.readouterr().out
    assert "band: 3 replicas" in out and "| plain |" in out
    # replica 0 is the unperturbed configuration: the plain run is it, bit for bit
    assert load_run(str(tmp_path / "plain")).loss == load_run(str(tmp_path / "band" / "replica-0")).loss
    assert main(["train", *TINY, "--replicas", "1", "--training.out-dir", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()


def test_dp_band_section_states_a_verdict_per_size_and_band(tmp_path) -> None:
    from mixprec.lab.dp_band import run_dp_band

    setting = {"sizes": (2, 4), "global_batch_size": 8, "steps": 4, "replicas": 2}
    section, verdicts = run_dp_band(str(tmp_path), 0, setting, progress=False)
    assert len(verdicts) == 2 * 3  # per size: native and fp32acc against fp32, native against bf16 fp32acc
    assert "### P = 4" in section and all(("stays inside" in v) or ("leaves" in v) for v in verdicts)
    # the headline (the demo report's first verdict): the native ring against the fp32acc band at the largest P,
    # with the uncalibrated 2-replica band said to be a first look, whatever the verdict
    native = next(v for v in verdicts if v.startswith("P = 4: bf16-native") and "fp32-accumulate band" in v)
    assert verdicts.headline.startswith("at simulated DP 4, bf16 gradients summed by the backend's native ring")
    assert ("stay inside" in verdicts.headline) == ("stays inside" in native)
    assert "2 replicas" in verdicts.headline and "`mixprec demo --full`" in verdicts.headline


def test_dp_band_headline_says_verdict_or_hint_by_the_calibration() -> None:
    from mixprec.lab.band import BandVerdict
    from mixprec.lab.dp_band import _headline

    leaves = BandVerdict("bf16-native", 7, "above", 0.33, 2.75, 2.0)
    inside = BandVerdict("bf16-native", None, None, 0.0, 2.72, 0.2)
    assert "use `--parallel.reduce fp32_accumulate` at this scale" in _headline(1024, leaves, 8, 0, 40)
    hint = _headline(1024, leaves, 4, 1, 12)
    assert "1 of the 4 replicas also leaves the band" in hint and "a hint, not a verdict" in hint
    assert "2 replicas cannot calibrate the band" in _headline(16, leaves, 2, 0, 6)
    assert "does as well as the fp32 sum" in _headline(1024, inside, 8, 0, 40)
    assert "(1023 roundings to bf16)" in _headline(1024, inside, 8, 0, 40)
