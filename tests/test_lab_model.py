"""The lab's corpus, batches and GPT, and the precision contract of its low-precision parameters."""

from __future__ import annotations

import copy

import pytest
import torch

from mixprec.lab.corpus import SPLIT_CHUNK, CorpusError, load_corpus
from mixprec.lab.data import eval_chunks, train_microbatches
from mixprec.lab.model import GPT, GPTConfig


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("stdlib")


def test_stdlib_corpus_is_deterministic_and_split(corpus) -> None:
    again = load_corpus("stdlib")
    assert again.sha256 == corpus.sha256
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)
    assert list(corpus.vocab) == sorted(set(corpus.vocab))
    total = corpus.train.numel() + corpus.val.numel()
    # Every 10th chunk of SPLIT_CHUNK characters is validation: 10 % up to one chunk.
    assert abs(corpus.val.numel() - total / 10) <= SPLIT_CHUNK
    assert "def " in corpus.decode(corpus.train[:5000])


def test_corpus_from_path(tmp_path) -> None:
    text = "".join(f"line {i}: héllo wörld\n" for i in range(2000))
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    c = load_corpus(str(path))
    assert c.vocab_size == len(set(text))
    # The split interleaves chunks: train + val, re-interleaved, is the text.
    chunks_t = list(c.train.split(SPLIT_CHUNK))
    chunks_v = list(c.val.split(SPLIT_CHUNK))
    rebuilt = []
    for i in range(len(chunks_t) + len(chunks_v)):
        rebuilt.append(chunks_v.pop(0) if i % 10 == 9 else chunks_t.pop(0))
    assert c.decode(torch.cat(rebuilt)) == text


def test_corpus_errors(tmp_path) -> None:
    with pytest.raises(CorpusError, match="no such file"):
        load_corpus(str(tmp_path / "missing.txt"))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(CorpusError, match="at least"):
        load_corpus(str(short))
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe" * 10000)
    with pytest.raises(CorpusError, match="not UTF-8"):
        load_corpus(str(binary))


def test_ranks_together_see_the_single_rank_batch(corpus) -> None:
    common = dict(seed=3, step=5, global_batch_size=8, micro_batch_size=2, block_size=16)
    single = train_microbatches(corpus.train, rank=0, world_size=1, **common)
    split = [mb for r in range(2) for mb in train_microbatches(corpus.train, rank=r, world_size=2, **common)]
    assert len(single) == 4 and len(split) == 4
    for (x1, y1), (x2, y2) in zip(single, split):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    other_step = train_microbatches(corpus.train, rank=0, world_size=1, **{**common, "step": 6})
    assert not torch.equal(other_step[0][0], single[0][0])


def test_eval_chunks_do_not_depend_on_world_size(corpus) -> None:
    common = dict(seed=0, eval_sequences=10, micro_batch_size=4, block_size=16)
    one = eval_chunks(corpus.val, rank=0, world_size=1, **common)
    two = [eval_chunks(corpus.val, rank=r, world_size=2, **common) for r in range(2)]
    assert [x.shape[0] for x, _ in one] == [4, 4, 2]
    assert torch.equal(two[0][0][0], one[0][0]) and torch.equal(two[1][0][0], one[1][0])
    assert torch.equal(two[0][1][0], one[2][0])


def test_block_size_too_large_for_split(corpus) -> None:
    with pytest.raises(ValueError, match="block_size"):
        train_microbatches(
            corpus.train[:10],
            seed=0,
            step=0,
            global_batch_size=2,
            micro_batch_size=2,
            block_size=16,
            rank=0,
            world_size=1,
        )


def _tiny(vocab: int = 50) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, block_size=16, n_layer=2, n_head=2, n_embd=16))


def test_shapes_and_loss() -> None:
    model = _tiny()
    idx = torch.randint(0, 50, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 50) and loss.dtype == torch.float32
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_compute_in_fp32_and_round_grads_once(dtype) -> None:
    """Oracle: an fp32 model holding the same (rounded) weights. Its forward is the same fp32 computation, so the
    losses must be equal bit for bit, and each low-precision gradient must be that fp32 gradient rounded once."""
    low = _tiny().to(dtype)
    ref = copy.deepcopy(low).float()
    idx = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(2))
    _, loss_low = low(idx, tgt)
    _, loss_ref = ref(idx, tgt)
    assert loss_low.item() == loss_ref.item()
    loss_low.backward()
    loss_ref.backward()
    for (name, p_low), p_ref in zip(low.named_parameters(), ref.parameters()):
        assert p_low.grad.dtype == dtype, name
        assert torch.equal(p_low.grad, p_ref.grad.to(dtype)), name


def test_autocast_branch_passes_weights_untouched_and_keeps_gradient_dtypes() -> None:
    """The GPU path (autocast) on the CPU with bf16: _in_compute_dtype hands the bf16 weight to the op unchanged
    (autocast does the casting), and backward leaves bf16 gradients on the bf16 parameters."""
    from mixprec.lab.model import Linear, _in_compute_dtype

    torch.manual_seed(0)
    layer = Linear(8, 4).to(torch.bfloat16)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _in_compute_dtype(layer.weight, x) is layer.weight
        y = layer(x)
    # autocast rounds the fp32 input to bf16 and runs the bf16 linear: exactly torch's own bf16 op.
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, torch.nn.functional.linear(x.bfloat16(), layer.weight, layer.bias))
    # Outside autocast the weight is upcast (exactly) to the input's dtype instead.
    assert _in_compute_dtype(layer.weight, x).dtype == torch.float32

    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.bfloat16 and layer.bias.grad.dtype == torch.bfloat16
    # dW = ones^T @ x_bf16: three bf16 terms per entry, whose fp32 sum is exact (randn magnitudes, 8-bit
    # significands), then one rounding to bf16.
    expected = x.bfloat16().float().sum(0).expand(4, 8)
    assert torch.equal(layer.weight.grad.float(), expected.bfloat16().float())
    # (The whole GPT is not run under CPU autocast: CPU autocast does not cast layer_norm's arguments to fp32 as
    # CUDA autocast does, so bf16 LayerNorm weights meet the fp32 residual stream there. The lab uses autocast
    # only on CUDA.)
