"""The demo's studies: the flush measurement, the uint8 shadow reduction, the AdamW update model, the worker
pool, and one small end-to-end loss-scale section."""

from __future__ import annotations

import copy
import multiprocessing

import pytest
import torch

from mixprec.lab.build import build_parts
from mixprec.lab.compare import load_run
from mixprec.lab.config import TrainConfig
from mixprec.lab.corpus import load_corpus
from mixprec.lab.launch import launch
from mixprec.lab.metrics import SUMMARY_NAME
from mixprec.lab.pool import train_all
from mixprec.lab.simulate import SimulatedRanks
from mixprec.lab.studies.scale_study import measure_flush, run_scale_study
from mixprec.lab.studies.uint8_study import _adamw_update, measure_shadow, offset_verdict

TINY = {
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 16,
    "block_size": 16,
    "global_batch_size": 8,
    "micro_batch_size": 1,
    "eval_sequences": 4,
    "eval_interval": 2,
    "checkpoint_interval": 0,
    "headroom_interval": 0,
    "lr": 0.01,
    "steps": 3,
    "device": "cpu",
}


def tiny(tmp_path, name: str, **changes) -> TrainConfig:
    return TrainConfig.from_fields({**TINY, "out_dir": str(tmp_path / name), **changes})


def test_flush_grows_as_the_per_microbatch_factor_shrinks(tmp_path) -> None:
    corpus = load_corpus("stdlib")
    fp16 = {"precision": "fp16", "kind": "static", "simulate_dp": 2}  # 4 microbatches per rank
    flush = [
        measure_flush(tiny(tmp_path, "f", **fp16, init_scale=4 * factor), corpus, step=0)
        for factor in (2.0**12, 2.0**-12, 2.0**-20)
    ]
    assert all(0 <= f.rank <= 1 and 0 <= f.reduced <= 1 and 0 <= f.norm_share <= 1 for f in flush)
    assert flush[0].rank < flush[1].rank < flush[2].rank
    assert flush[0].reduced < flush[1].reduced < flush[2].reduced
    assert flush[0].overflow == 0
    # 2**40 times a gradient of order 1e-3 is far beyond fp16's 65504
    assert measure_flush(tiny(tmp_path, "f", **fp16, init_scale=2.0**40), corpus, step=0).overflow > 0


def test_a_shadow_reduction_sees_the_same_gradients_and_leaves_the_run_alone(tmp_path) -> None:
    cfg = tiny(tmp_path, "s", simulate_dp=4)
    corpus = load_corpus("stdlib")
    losses = []
    for shadow in (None, "fp32_accumulate"):
        parts = build_parts(cfg, corpus.vocab_size, torch.device("cpu"), 1)
        sim = SimulatedRanks(parts, cfg, corpus, torch.device("cpu"), shadow=shadow)
        losses.append([sim.step(step).loss for step in range(2)])
        if shadow:
            # the same per-rank buckets through the same reduction model: the same bits
            assert all(torch.equal(a, b) for a, b in zip(sim.reduced, sim.shadow_reduced, strict=True))
            assert [t.shape for t in sim.unpack(sim.reduced)] == [p.shape for p in parts.module.parameters()]
    assert losses[0] == losses[1]


def test_adamw_update_model_is_torchs_step(tmp_path) -> None:
    cfg = tiny(tmp_path, "a")
    corpus = load_corpus("stdlib")
    parts = build_parts(cfg, corpus.vocab_size, torch.device("cpu"), 1)
    params = list(parts.module.parameters())
    opt = parts.optimizer
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # the first step (empty state) and later ones
        grads = [torch.randn(p.shape, generator=gen) * 1e-3 for p in params]
        state = [copy.deepcopy(opt.state[p]) for p in params]
        predicted = _adamw_update(opt, grads, state)
        before = torch.cat([p.detach().reshape(-1).clone() for p in params])
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        moved = torch.cat([p.detach().reshape(-1) for p in params]) - before
        # same formula, other operation order: agreement to a few fp32 roundings of the weights
        tol = 8 * torch.finfo(torch.float32).eps * before.abs().clamp_min(predicted.abs())
        assert bool(((moved - predicted).abs() <= tol + 1e-12).all())


def test_uint8_shadow_is_unbiased_and_close(tmp_path) -> None:
    stats = measure_shadow(tiny(tmp_path, "u", simulate_dp=2, reduce="native", steps=2))
    assert stats.steps == 2
    assert 0.99 < stats.grad_cosine <= 1 and 0.98 < stats.projection < 1.02
    assert 0.5 < stats.update_norm_ratio < 1.5

    assert stats.projection_sd >= 0


def test_offset_verdict_claims_only_what_was_tested() -> None:
    same_sign = offset_verdict([0.01, 0.03], step_change=False, bias=False)
    assert "chaos" not in same_sign and "not distinguishable from the seed-to-seed spread with 2 seed" in same_sign
    assert "chaos" in offset_verdict([0.01, -0.03, 0.02], step_change=False, bias=False)
    assert "perturbation" not in same_sign and "no bias" not in same_sign
    systematic = offset_verdict([0.1, 0.1001, 0.0999], step_change=False, bias=True)
    assert systematic.startswith("a property of the compression") and "bias along the gradient" in systematic


def test_worker_pool_gives_the_runs_trained_alone(tmp_path) -> None:
    configs = [tiny(tmp_path, f"p{k}", simulate_dp=2, perturb=k) for k in range(2)]
    assert train_all(configs, workers=2) == [None, None]
    for k, cfg in enumerate(configs):
        alone = cfg.replace(training={"out_dir": str(tmp_path / f"alone{k}")})
        launch(alone, progress=False)
        assert load_run(cfg.training.out_dir).loss == load_run(alone.training.out_dir).loss
    with pytest.raises(ValueError, match="nproc"):
        train_all([tiny(tmp_path, "n", nproc=2)])


def test_worker_pool_ends_its_runs_at_the_first_error(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    broken = tiny(tmp_path / "file", "run")  # refused in its worker: not a failed run, it propagates
    queued = [tiny(tmp_path, f"q{k}", simulate_dp=2, steps=400) for k in range(6)]
    with pytest.raises(ValueError, match="out_dir"):
        train_all([broken, *queued], workers=2)
    assert not multiprocessing.active_children()
    # the runs started beside it were ended, not finished; the queued ones never started
    assert not any((tmp_path / f"q{k}" / SUMMARY_NAME).exists() for k in range(6))
    assert not (tmp_path / "q5").exists()


def test_loss_scale_section_states_a_verdict_per_broken_configuration(tmp_path) -> None:
    setting = {"sizes": (2, 8), "global_batch_size": 8, "steps": 3, "replicas": 2, "workers": 1}
    section, verdicts = run_scale_study(str(tmp_path), 0, setting)
    assert len(verdicts) == 3
    assert "scale-below-microbatches" in section and "| check-config |" in section
    assert all(("stays inside" in v) or ("leaves it" in v) for v in verdicts)
    # the headline (the demo report's second verdict) counts the configurations that left the band
    left = sum("leaves it" in v for v in verdicts)
    assert (f"{left} of 3 misscaled" if left else "none of 3 misscaled") in verdicts.headline
    assert all(name in verdicts.headline for name in ("below-microbatches", "far-below", "not-rescaled-up"))


def test_every_study_size_plans_valid_runs(tmp_path) -> None:
    from mixprec.lab.demo import STUDY_SIZES, plan_studies

    for size in STUDY_SIZES:
        plan_studies(str(tmp_path), 0, size)  # every configuration checked; nothing written
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="study size"):
        plan_studies(str(tmp_path), 0, "huge")
