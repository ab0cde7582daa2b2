"""A fixed, seeded sample of the random differential cases of ``kernel_fuzz``: the compiled quantizers,
``round_to``, the emulated matmul and the fp32 sum of shards against the torch path, on sizes, offsets,
strides, thread counts and values drawn at random. Longer searches: ``python tests/kernel_fuzz.py --minutes 10``."""

from __future__ import annotations

import pytest

from kernel_fuzz import run_case
from mixprec import native

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no compiled kernels: {native.describe()}")


@pytest.mark.parametrize("block", range(4))
def test_random_cases_match_the_torch_path(block: int) -> None:
    failures = [f for f in (run_case(seed) for seed in range(250 * block, 250 * (block + 1))) if f is not None]
    assert not failures, "\n".join(failures)


def test_a_case_that_differs_is_reported_with_its_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check must be able to fail: a compiled round_to that adds 1 to its result is caught and named.
    import kernel_fuzz

    real = kernel_fuzz.round_to

    def wrong(*args, **kwargs):  # type: ignore[no-untyped-def]
        y = real(*args, **kwargs)
        return y if native.is_disabled() else y + 1

    monkeypatch.setattr(kernel_fuzz, "round_to", wrong)
    cases = kernel_fuzz.CASES
    seed = next(s for s in range(1000) if kernel_fuzz.random.Random(s).choice(cases) is kernel_fuzz.rounding_case)
    failure = run_case(seed)
    assert failure is not None and failure.startswith(f"seed {seed}: values differ: round_to(")
