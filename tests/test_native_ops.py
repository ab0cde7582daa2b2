"""The C boundary of ``mixprec.native``: one dtype table, the typed wrappers' contract, the custom ops under
torch.compile, a dispatch mode and FakeTensorMode (bit for bit against the torch path), and cache pruning."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec.native as native
from mixprec.comm.fp32_sum import sum_shards_into
from mixprec.compress import BlockScaledWire, MinMaxUInt8, ScaledFP8
from mixprec.core.mx import fake_quantize, mx_quantize
from mixprec.core.rounding import round_to, round_to_
from mixprec.emulate import matmul
from mixprec.native import kernels, ops
from mixprec.native.dtypes import DTYPE_CODES

needs_kernels = pytest.mark.skipif(native.library() is None, reason=f"no compiled kernels: {native.describe()}")
CSRC = Path(native.__file__).with_name("csrc")


def test_one_dtype_table_on_both_sides_of_the_boundary() -> None:
    enum = re.search(r"enum \{([^}]*)\}", (CSRC / "dtypes.h").read_text()).group(1)
    c_side = {name.strip(): int(value) for name, value in (part.split("=") for part in enum.split(","))}
    names = {torch.float32: "MIXPREC_F32", torch.float16: "MIXPREC_F16", torch.bfloat16: "MIXPREC_BF16"}
    names[torch.float64] = "MIXPREC_F64"
    assert {names[d]: code for d, code in DTYPE_CODES.items()} == c_side
    # no kernel source keeps a private table: a dtype name set to a number instead of the shared name
    for src in CSRC.glob("*.c"):
        private = re.findall(r"\b(?:DT|SRC)_B?FP?(?:16|32|64)\s*=\s*\d", src.read_text())
        assert not private, (src.name, private)
    assert "MIXPREC_F32" in (CSRC / "fp32sum.c").read_text()
    assert "MIXPREC_BF16" in (CSRC / "mx.c").read_text()


@needs_kernels
@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_fp32_sum_reads_and_writes_each_dtype_as_itself(wire: torch.dtype, out_dtype: torch.dtype) -> None:
    # 1 + 2**-9 is an fp16 number but not a bf16 one; a swapped dtype code reads or writes the other format
    shards = torch.full((3, 5), 1 + 2.0**-9).to(wire)
    out = torch.empty(5, dtype=out_dtype)
    assert kernels.fp32_sum_rows(shards, out, False, None) == 0
    expected = (shards.float().sum(0)).to(out_dtype)
    assert torch.equal(out, expected), (out, expected)


# ------------------------------------------------------------------ the typed wrappers' contract
def _mx_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 e4m3's element and E8M0 scale value tables, as BlockScaledWire builds them."""
    return BlockScaledWire("mxfp8_e4m3")._value_tables(torch.device("cpu"))


def _contract_cases() -> list[tuple[str, object]]:
    f32 = torch.ones(8)
    out = torch.empty(8)
    fmt = (5, 10, True, False, True)
    enc = torch.empty(2, 8 * 2 + 8, dtype=torch.uint8)
    nine = torch.ones(9)
    mxbuf = torch.empty(1, 33, dtype=torch.uint8)
    return [
        ("int tensor", lambda: kernels.round_nearest(torch.ones(8, dtype=torch.int32), out, *fmt)),
        ("strided src", lambda: kernels.round_nearest(torch.ones(16)[::2], out, *fmt)),
        ("meta dst", lambda: kernels.round_nearest(f32, torch.empty(8, device="meta"), *fmt)),
        ("fp16 dst", lambda: kernels.round_nearest(f32, torch.empty(8, dtype=torch.float16), *fmt)),
        ("overlap", lambda: kernels.round_nearest(nine[1:], nine[:8], *fmt)),
        ("short u", lambda: kernels.round_directed(f32, torch.rand(4, dtype=torch.float64), out, *fmt)),
        ("sum out", lambda: kernels.fp32_sum_rows(torch.ones(2, 8), torch.empty(7), False, None)),
        ("fp64 shards", lambda: kernels.fp32_sum_rows(torch.ones(2, 8).double(), out, False, None)),
        ("encode shape", lambda: kernels.quant_encode_u8(torch.ones(2, 8), enc[:, 1:], 4, False, 0, 0, 8)),
        ("encode cols", lambda: kernels.quant_encode_u8(torch.ones(8, 2).t(), enc, 4, False, 0, 0, 8)),
        ("fp8 fmt", lambda: kernels.quant_encode_fp8(torch.ones(2, 8), enc[:, :16], 4, 7, False, 0, 0, 8)),
        ("decode out", lambda: kernels.quant_decode_u8(enc, 8, torch.empty(2, 8, dtype=torch.int8), 4, False)),
        ("table", lambda: kernels.fp8_table_format(torch.ones(255))),
        ("mx block", lambda: kernels.mx_quantize(f32, out, None, 3, (4, 3, 448.0), 0, None, False, False, None)),
        ("mx mode", lambda: kernels.mx_quantize(f32, out, None, 8, (4, 3, 448.0), 9, None, False, False, None)),
        ("mx scales", lambda: kernels.mx_quantize(f32, out, out[:1], 8, (4, 3, 448.0), 0, None, False, True, None)),
        ("wire out", lambda: kernels.mx_wire_encode(torch.ones(2, 32), None, enc, (4, 3, 448.0), 3, 32, 32, 255,
                                                    None, 0, 32)),
        ("wire residual", lambda: kernels.mx_wire_encode(torch.ones(1, 32), torch.ones(1, 32).double(), mxbuf,
                                                         (4, 3, 448.0), 3, 32, 32, 255, None, 0, 32)),
        ("wire grid", lambda: kernels.mx_wire_decode(mxbuf, 32, torch.empty(1, 32), _mx_tables(), (4, 2), 32, 32,
                                                     False, 255, False)),
        ("wire table", lambda: kernels.mx_wire_decode(mxbuf, 32, torch.empty(32), (torch.ones(16), _mx_tables()[1]),
                                                      (4, 3), 32, 32, False, 255, True)),
        ("matmul b", lambda: kernels.matmul_model(torch.ones(1, 2, 3), torch.ones(1, 4, 2), torch.empty(1, 2, 2),
                                                  16, 0, 0, (23, -126, 127, 3e38, 3e38, 1e-38, True))),
    ]  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("case", range(len(_contract_cases())), ids=[c[0] for c in _contract_cases()])
def test_a_broken_contract_is_an_internal_error_before_anything_is_written(case: int) -> None:
    _, call = _contract_cases()[case]
    with pytest.raises(kernels.KernelContractError, match="a bug in mixprec") as info:
        call()
    assert not isinstance(info.value, ValueError | TypeError)  # not disguised as a user error


@needs_kernels
def test_every_wrapper_bumps_the_version_of_what_it_wrote() -> None:
    fmt = (5, 10, True, False, True)
    x = torch.randn(2, 64)
    q8 = torch.empty(2, 8 * 2 + 64, dtype=torch.uint8)
    fp8 = torch.empty(2, 4 * 2 + 64, dtype=torch.uint8)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mm = torch.empty(1, 2, 3)
    mxbuf = torch.empty(2, 2 + 64, dtype=torch.uint8)
    acc = (23, -126, 127, 3.4e38, float("inf"), 2.0**-126, True)
    writes = [
        (lambda o: kernels.round_nearest(x[0], o, *fmt), torch.empty(64)),
        (lambda o: kernels.round_directed(x[0], None, o, *fmt), torch.empty(64)),
        (lambda o: kernels.fp32_sum_rows(x, o, True, None), torch.empty(64)),
        (lambda o: kernels.quant_encode_u8(x, o, 32, False, 0, 0, 64), q8),
        (lambda o: kernels.quant_decode_u8(q8, 64, o, 32, False), torch.empty(2, 64)),
        (lambda o: kernels.quant_encode_fp8(x, o, 32, 0, False, 0, 0, 64), fp8),
        (lambda o: kernels.quant_decode_fp8(fp8, 64, o, 32, table, 0, True), torch.empty(64)),
        (lambda o: kernels.philox_bytes(5, 0, o), torch.empty(64, dtype=torch.uint8)),
        (lambda o: kernels.matmul_model(torch.ones(1, 2, 4), torch.ones(1, 4, 3), o, 16, 0, 0, acc), mm),
        (lambda o: kernels.mx_quantize(x, o, None, 32, (4, 3, 448.0), 3, None, False, True, 5), torch.empty(2, 64)),
        (
            lambda o: kernels.mx_quantize(x, torch.empty(2, 64), o, 32, (4, 3, 448.0), 0, None, True, False, None),
            torch.empty(2, 2),
        ),
        (lambda o: kernels.mx_wire_encode(x, None, o, (4, 3, 448.0), 3, 32, 32, 255, None, 0, 64), mxbuf),
        (lambda o: kernels.mx_wire_encode(x, o, mxbuf, (4, 3, 448.0), 3, 32, 32, 255, None, 0, 64), torch.zeros(2, 64)),
        (
            lambda o: kernels.mx_wire_decode(mxbuf, 64, o, _mx_tables(), (4, 3), 32, 32, False, 255, True),
            torch.empty(64),
        ),
    ]
    for i, (write, out) in enumerate(writes):
        before = out._version
        write(out)
        assert out._version > before, i


@needs_kernels
def test_backward_through_a_graph_that_saved_a_kernel_output_raises() -> None:
    """The version bump is what makes autograd notice: a kernel write into a saved tensor must not be used."""
    w = torch.randn(64, requires_grad=True)
    out = torch.randn(64)
    loss = (w * out).sum()  # saves out
    kernels.round_nearest(torch.randn(64), out, 5, 10, True, False, True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ------------------------------------------------------------------ custom ops: tracing and dispatch modes
def _workloads() -> dict[str, object]:
    """Functions of a tensor that end in each kernel, all deterministic (fixed keys, seeded generators)."""
    q8, fp8, q8s = MinMaxUInt8(chunk_size=64), ScaledFP8("e5m2", chunk_size=64), MinMaxUInt8(rounding="stochastic")

    def quant(q):
        def run(x):
            buf = torch.empty(x.shape[0], q.encoded_nbytes(x.shape[1]), dtype=torch.uint8)
            q.encode_rows(x, buf, key=2**63 + 12345)
            dec = torch.empty(x.shape[1])
            q.decode_rows(buf, x.shape[1], dec, reduce=True)
            return buf, dec

        return run

    def wire(w, feedback=False):
        def run(x):
            buf = torch.empty(x.shape[0], w.encoded_nbytes(x.shape[1]), dtype=torch.uint8)
            if feedback:
                residual = torch.full(x.shape, 1e-3)
                w.encode_feedback_rows(x, residual, buf, key=2**63 + 12345)
            else:
                residual = torch.empty(0)
                w.encode_rows(x, buf, key=2**63 + 12345)
            dec = torch.empty(x.shape[1])
            w.decode_rows(buf, x.shape[1], dec, reduce=True)
            rows = torch.empty(x.shape, dtype=torch.bfloat16)
            w.decode_rows(buf, x.shape[1], rows)
            return buf, dec, rows, residual

        return run

    def fp32_sum(x):
        out = torch.empty(x.shape[1], dtype=torch.bfloat16)
        sum_shards_into(out, x.to(torch.float16), average=True, rounding="nearest", generator=None, factor=0.5)
        return out

    def inplace(x):
        y = x.double() * 3
        round_to_(y, "fp8_e5m2")
        return y

    return {
        "round_nearest": lambda x: round_to(x * 2, "bf16") + 1,
        "round_fp64_out": lambda x: round_to(x.double(), "fp16", out=torch.empty(x.shape, dtype=torch.float64)),
        "round_inplace": inplace,
        "toward_zero": lambda x: round_to(x, "fp8_e4m3", "toward_zero"),
        "uint8": quant(q8),
        "uint8_stochastic": quant(q8s),
        "fp8": quant(fp8),
        "fp32_sum": fp32_sum,
        "matmul": lambda x: matmul(x[:, :48].reshape(3, 4, 12), x[0, :60].reshape(12, 5), mode="fp16/16"),
        "mx_quantize": lambda x: mx_quantize(x[:, :992], "mxfp4_e2m1", scale_mode="even").elements,
        "mx_fake_quantize": lambda x: fake_quantize(x[:, :992].bfloat16(), "nvfp4", tensor_scale=0.25),
        "mx_round_to": lambda x: round_to(x[:, :992], "mxfp8_e4m3"),
        "mx_stochastic": lambda x: fake_quantize(x[:, :992], "mxfp8_e5m2", "stochastic", key=2**63 + 7),
        "mx_wire": wire(BlockScaledWire("mxfp8_e4m3", chunk_size=64)),
        "mx_wire_nvfp4_stochastic": wire(BlockScaledWire("nvfp4", chunk_size=64, rounding="stochastic")),
        "mx_wire_feedback": wire(BlockScaledWire("mxfp4_e2m1", chunk_size=64), feedback=True),
    }


def _assert_same(a: object, b: object) -> None:
    for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert torch.equal(u.view(-1).view(torch.uint8), v.view(-1).view(torch.uint8))


X = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))


@needs_kernels
@pytest.mark.parametrize("name", list(_workloads()))
def test_torch_compile_runs_the_compiled_kernel_as_an_op(name: str) -> None:
    fn = _workloads()[name]
    with native.disabled():
        expected = fn(X)
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(fn, backend=backend)(X)
    _assert_same(got, expected)
    op = "torch.ops.mixprec." + ("mx_" if name.startswith("mx_") else "")
    assert any(op in code for code in graphs), graphs  # the kernel, not the torch path


@needs_kernels
@pytest.mark.parametrize("name", ["uint8", "mx_wire_feedback"])
def test_torch_compile_with_aot_autograd_functionalizes_the_mutating_ops(name: str) -> None:
    fn = _workloads()[name]
    with native.disabled():
        expected = fn(X)
    torch._dynamo.reset()
    _assert_same(torch.compile(fn, backend="aot_eager")(X), expected)


class _Log(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@needs_kernels
@pytest.mark.parametrize("name", list(_workloads()))
def test_a_dispatch_mode_sees_the_kernel_and_gets_the_same_bits(name: str) -> None:
    fn = _workloads()[name]
    with native.disabled():
        expected = fn(X)
    with _Log() as log:
        got = fn(X)
    _assert_same(got, expected)
    prefix = "mixprec." + ("mx_" if name.startswith("mx_") else "")
    assert any(op.startswith(prefix) for op in log.ops), log.ops


@needs_kernels
def test_fake_tensor_mode_gives_shapes_from_the_fake_kernels() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(4, 6))
        y = round_to(x, "fp16")
        z = round_to(x.double(), "bf16", "toward_zero", out=torch.empty(4, 6, dtype=torch.float64))
        m = matmul(x, x.t().contiguous())
    assert (y.shape, y.dtype, z.dtype, m.shape) == ((4, 6), torch.float32, torch.float64, (4, 4))
    with FakeTensorMode() as mode:
        q = mx_quantize(mode.from_tensor(torch.randn(4, 64)).half(), "mxfp8_e4m3")
    assert (q.elements.shape, q.elements.dtype, q.scales.shape) == ((4, 64), torch.float32, (4, 2))


def _op_samples() -> dict[str, tuple]:
    x = torch.randn(2, 96)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    q8, fp8 = torch.empty(2, 8 * 3 + 96, dtype=torch.uint8), torch.empty(2, 4 * 3 + 96, dtype=torch.uint8)
    kernels.quant_encode_u8(x, q8, 32, False, 0, 0, 96)
    kernels.quant_encode_fp8(x, fp8, 32, 0, False, 0, 0, 96)
    acc = (10, -14, 15, 65504.0, float("inf"), 2.0**-14, True)
    w4 = BlockScaledWire("mxfp4_e2m1", chunk_size=32)
    mx4 = torch.empty(2, w4.encoded_nbytes(96), dtype=torch.uint8)
    w4.encode_rows(x, mx4)
    tables = w4._value_tables(torch.device("cpu"))
    return {
        "round_nearest": (x, 5, 10, True, False, True, False),
        "round_directed": (x.double(), torch.rand(2, 96, dtype=torch.float64), 4, 3, False, False, True, True),
        "fp32_sum_rows": (x.half(), torch.empty(96, dtype=torch.bfloat16), True, 0.25),
        "quant_encode_u8": (x, torch.empty_like(q8), 32, True, -5, 7, 96),
        "quant_encode_fp8": (x, torch.empty_like(fp8), 32, 1, True, 3, 0, 100),
        "quant_decode_u8": (q8, 96, torch.empty(96), 32, True),
        "quant_decode_fp8": (fp8, 96, torch.empty(2, 96, dtype=torch.float16), 32, table, 0, False),
        "matmul_model": (x[:, :64].reshape(2, 4, 16).half(), x[0, :80].reshape(1, 16, 5).half(), 16, 0, 1, *acc),
        "mx_quantize": (x.bfloat16(), 16, 2, 1, 6.0, 5, torch.tensor(0.5), False, True, True, -3),
        "mx_wire_encode": (x, torch.randn(2, 96), torch.empty_like(mx4), 2, 1, 6.0, 3, 32, 32, 255, True, 9, 0, 96),
        "mx_wire_decode": (mx4, 96, torch.empty(2, 96, dtype=torch.float16), *tables, 2, 1, 32, 32, False, 255, False),
    }


@needs_kernels
@pytest.mark.parametrize("name", list(_op_samples()))
def test_opcheck(name: str) -> None:
    torch.library.opcheck(getattr(torch.ops.mixprec, name).default, _op_samples()[name])


@needs_kernels
def test_ops_module_names_every_registered_op() -> None:
    assert set(_op_samples()) == {n.removeprefix("_") for n in vars(ops) if n.startswith("_") and n[1:] in ops.__all__}


# ------------------------------------------------------------------ the cache
def test_stale_cache_entries_are_pruned_and_nothing_else(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MIXPREC_CACHE_KEEP_DAYS", raising=False)
    now = time.time()
    day = 86400.0
    files = {
        "mixprec_native-" + "a" * 20 + ".so": 100 * day,  # current: kept however old
        "mixprec_native-" + "b" * 20 + ".so": 31 * day,  # another build, unused for a month: pruned
        "mixprec_native-" + "c" * 20 + ".so": 2 * day,  # another build, recently loaded: kept
        ".mixprec_native-" + "b" * 20 + ".so.123.0123456789ab.tmp": 2 * day,  # a dead build: pruned
        ".mixprec_native-" + "c" * 20 + ".so.124.0123456789ab.tmp": 60.0,  # a build under way: kept
        "mixprec_native-notahash.so": 100 * day,  # not a name we create: kept
        "notes.txt": 100 * day,
    }
    for name, age in files.items():
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (now - age, now - age))
    os.symlink(tmp_path / "notes.txt", tmp_path / ("mixprec_native-" + "d" * 20 + ".so"))
    os.utime(tmp_path / ("mixprec_native-" + "d" * 20 + ".so"), (now - 99 * day,) * 2, follow_symlinks=False)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        removed = native.prune_cache(dfd, "mixprec_native-" + "a" * 20 + ".so", now)
    finally:
        os.close(dfd)
    stale = ["mixprec_native-" + "b" * 20 + ".so", ".mixprec_native-" + "b" * 20 + ".so.123.0123456789ab.tmp"]
    assert sorted(removed) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(set(files) - set(stale)), "mixprec_native-" + "d" * 20 + ".so"]  # a link is never followed or removed
    )
    monkeypatch.setenv("MIXPREC_CACHE_KEEP_DAYS", "1")
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert native.prune_cache(dfd, "mixprec_native-" + "a" * 20 + ".so", now) == [
            "mixprec_native-" + "c" * 20 + ".so"
        ]
    finally:
        os.close(dfd)


@needs_kernels
def test_a_load_refreshes_its_library_and_prunes_the_cache(tmp_path, monkeypatch) -> None:
    """End to end: a build prunes a stale library of another build, and a load refreshes the loaded library's
    time, so that it is not pruned while in use."""
    stale = tmp_path / ("mixprec_native-" + "e" * 20 + ".so")
    stale.write_bytes(b"old")
    old = time.time() - 40 * 86400.0
    os.utime(stale, (old, old))
    tmp_path.chmod(0o700)
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    lib, why = native._build()
    assert lib is not None, why
    assert not stale.exists()
    (built,) = tmp_path.glob("mixprec_native-*.so")
    os.utime(built, (old, old))
    lib, again = native._build()
    assert again == why  # the same library, loaded from the cache
    assert time.time() - built.stat().st_mtime < 3600
