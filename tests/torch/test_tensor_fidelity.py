"""Remote tensors behave as local ones where PyTorch's C++ makes tensors, and in their math bits.

Each idiom runs locally and on a remote device; the values must be equal. These are the
idioms whose C++ composites or autograd formulas make new tensors with a remote tensor's
options (which became plain meta tensors while a remote tensor's C++ device was meta), the lazy
conjugate and negative bits, complex32, and compressed sparse tensors failing at their op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow

Idiom = Callable[[Callable[[torch.Tensor], torch.Tensor]], Any]


def _same_locally_and_remotely(idiom: Idiom) -> None:
    """`idiom(put)` builds its inputs with put(host tensor): once on the host, once remote."""
    expected = idiom(lambda t: t.clone())
    actual = idiom(lambda t: t.to("cuda"))
    _assert_same(actual, expected)


def _assert_same(actual: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.device.type == "cuda"
        torch.testing.assert_close(actual.cpu(), expected, equal_nan=True)
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _assert_same(a, e)
    else:
        assert actual == expected


def _grad(fn: Callable[[torch.Tensor], torch.Tensor]) -> Idiom:
    def idiom(put: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        a = put(torch.linspace(-2.0, 2.0, 12).reshape(3, 4)).requires_grad_(True)
        fn(a).sum().backward()
        return a.grad

    return idiom


def test_index_assignment_with_scalars_masks_and_lists(attach: Callable[..., Any]) -> None:
    attach()

    def assign(put: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        x = put(torch.arange(12.0).reshape(3, 4))
        x[0] = 5
        x[:, 0] = 7
        x[x > 9] = 0
        x[..., -1] = -1.5
        return x

    _same_locally_and_remotely(assign)
    _same_locally_and_remotely(lambda put: put(torch.arange(6.0))[[0, 2]])
    _same_locally_and_remotely(lambda put: put(torch.arange(12.0).reshape(3, 4))[[0, 2], 1:])


def test_where_with_a_python_scalar(attach: Callable[..., Any]) -> None:
    attach()
    _same_locally_and_remotely(
        lambda put: torch.where(put(torch.tensor([True, False, True])), 0.0, put(torch.ones(3)))
    )


@pytest.mark.parametrize(
    "formula",
    [
        pytest.param(lambda a: a.clamp(-1.0, 1.0), id="clamp"),
        pytest.param(lambda a: torch.where(a > 0, a, a * 2), id="where"),
        pytest.param(lambda a: a.prod(dim=1), id="prod"),
        pytest.param(lambda a: a.abs().pow(a.detach() + 3), id="pow_tensor"),
        pytest.param(lambda a: F.normalize(a, dim=1), id="normalize"),
        pytest.param(lambda a: torch.masked.sum(a, 1, mask=a > 0), id="masked_sum"),
        pytest.param(lambda a: torch.cov(a), id="cov"),
        pytest.param(lambda a: torch.quantile(a, 0.25, dim=1), id="quantile"),
        pytest.param(lambda a: torch.linalg.pinv(a), id="pinv"),
    ],
)
def test_backward_of_formulas_that_make_tensors_in_cpp(
    attach: Callable[..., Any], formula: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    attach()
    _same_locally_and_remotely(_grad(formula))


def test_tensors_cpp_makes_from_a_remote_one_are_remote_on_its_device(
    attach: Callable[..., Any],
) -> None:
    from gpupool.torch import RemoteTensor

    attach(2)
    x = torch.ones(3, device="cuda:1")
    x[0] = 5  # the 5 is wrapped into a tensor with x's options, in C++
    assert x.device == torch.device("cuda", 1)
    grad_of = torch.ones(3, device="cuda:1", requires_grad=True)
    grad_of.clamp(0, 0.5).sum().backward()
    assert isinstance(grad_of.grad, RemoteTensor) and grad_of.grad.device == x.device
    assert grad_of.grad.cpu().tolist() == [0.0, 0.0, 0.0]
    meta = torch.zeros(2, device="meta")  # a program's own meta tensors stay plain
    assert type(meta) is torch.Tensor and meta.is_meta


def test_conjugate_and_negative_bits_are_kept(attach: Callable[..., Any]) -> None:
    attach()
    z_host = torch.tensor([1 + 2j, 3 - 4j])
    z = z_host.to("cuda")
    c = z.conj()
    assert c.is_conj() and not z.is_conj()
    assert c.cpu().resolve_conj().tolist() == [1 - 2j, 3 + 4j]
    assert c[0].item() == 1 - 2j
    assert c.tolist() == [1 - 2j, 3 + 4j]
    assert c.resolve_conj().tolist() == [1 - 2j, 3 + 4j] and not c.resolve_conj().is_conj()
    imag = c.imag
    assert imag.is_neg() and imag.tolist() == [-2.0, 4.0]
    assert (imag * 2).tolist() == [-4.0, 8.0]
    _same_locally_and_remotely(lambda put: put(z_host).conj() @ put(z_host))
    _same_locally_and_remotely(lambda put: put(z_host).conj() + 1)

    def write_through(put: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        t = put(z_host.clone())
        t.conj().add_(1)
        target = put(torch.zeros(2, dtype=torch.cfloat))
        target.conj().copy_(put(z_host))
        return t, target

    _same_locally_and_remotely(write_through)


def test_fft_of_a_real_input_is_not_conjugated(attach: Callable[..., Any]) -> None:
    attach()
    host = torch.arange(8.0)
    remote = torch.fft.ifft(host.to("cuda"))
    local = torch.fft.ifft(host)
    assert remote.is_conj() == local.is_conj()
    torch.testing.assert_close(remote.cpu(), local)
    torch.testing.assert_close(remote.resolve_conj().cpu(), local.resolve_conj())


def test_complex32_travels_both_ways(attach: Callable[..., Any]) -> None:
    attach()
    host = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex32)
    remote = host.to("cuda")
    assert remote.dtype == torch.complex32
    doubled = (remote * 2).cpu()
    assert doubled.dtype == torch.complex32
    assert doubled.to(torch.complex64).tolist() == [2 + 4j, -6 + 1j]


def test_a_compressed_sparse_tensor_fails_at_its_op_and_the_session_lives_on(
    attach: Callable[..., Any],
) -> None:
    """COO tensors move and compute (tests/torch/test_sparse.py); CSR ones fail loudly."""
    attach()
    kept = torch.arange(4.0, device="cuda") * 2
    with pytest.raises(NotImplementedError, match="sparse_csr"):
        torch.eye(3).to_sparse_csr().cuda()
    with pytest.raises(NotImplementedError, match="aten::"):  # PyTorch's own, naming the op
        torch.zeros(2, 2, layout=torch.sparse_coo, device="cuda")
    assert kept.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert (kept + 1).sum().item() == 16.0


def test_an_error_inside_backward_reaches_the_caller_and_the_session_lives_on(
    attach: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpupool.torch import dispatch

    attach()
    sgn = torch.ops.aten.sgn.default

    def refused(func: Any, args: Any, kwargs: Any) -> Any:
        raise NotImplementedError(f"{func} refused here")

    monkeypatch.setitem(dispatch._SPECIAL, id(sgn), refused)
    monkeypatch.delitem(dispatch._ROUTES, id(sgn), raising=False)
    a = torch.ones(3, device="cuda", requires_grad=True)
    with pytest.raises(NotImplementedError, match="refused here"):
        a.abs().sum().backward()  # abs's backward formula calls sgn, in C++
    monkeypatch.undo()
    dispatch._ROUTES.pop(id(sgn), None)
    b = torch.ones(3, device="cuda", requires_grad=True)
    b.abs().sum().backward()
    assert b.grad is not None and b.grad.tolist() == [1.0, 1.0, 1.0]
    assert (a * 3).sum().item() == 9.0


def test_linear_without_a_gradient_goes_whole_and_with_one_as_its_parts(
    attach: Callable[..., Any],
) -> None:
    from gpupool.torch import runtime

    attach()
    torch.manual_seed(3)
    x, w, b = torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(6)
    rx, rw, rb = (t.cuda() for t in (x, w, b))
    with torch.no_grad():
        assert torch.equal(F.linear(rx, rw, rb).cpu(), F.linear(x, w, b))
    with torch.inference_mode():
        assert torch.equal(F.linear(rx[0], rw).cpu(), F.linear(x[0], w))
    names = runtime.stream(0).op_names()
    assert "aten::linear" in names and not names & {"aten::addmm", "aten::mm", "aten::t"}
    # A gradient to record: the composite's parts, each with its autograd node.
    lw, lb = w.clone().requires_grad_(), b.clone().requires_grad_()
    gw, gb = rw.detach().requires_grad_(), rb.detach().requires_grad_()
    F.linear(x, lw, lb).pow(2).sum().backward()
    out = F.linear(rx, gw, gb)
    assert out.requires_grad and out.grad_fn is not None
    out.pow(2).sum().backward()
    assert "aten::addmm" in runtime.stream(0).op_names()
    assert torch.equal(gw.grad.cpu(), lw.grad) and torch.equal(gb.grad.cpu(), lb.grad)
    # Forward-mode AD sees the linear too.
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        local = fwAD.unpack_dual(F.linear(fwAD.make_dual(x, torch.ones_like(x)), w)).tangent
        dual = fwAD.make_dual(rx, torch.ones_like(rx))
        remote = fwAD.unpack_dual(F.linear(dual, rw)).tangent
    assert remote is not None and torch.equal(remote.cpu(), local)


def test_linear_of_a_transposed_input_and_a_trainable_weight_folds_as_locally(
    attach: Callable[..., Any],
) -> None:
    """Under no_grad, matmul folds a non-contiguous 3-d input into one matrix product when the
    weight requires grad, and multiplies batch by batch when it does not: the two round
    differently (an nn.GRU's input projection with batch_first, in eval mode, differed by one
    ulp on an AVX2 host). The worker's weights never require grad, so that linear is
    decomposed in the client, where the weight's flag is the program's."""
    attach()
    torch.manual_seed(5)
    x = torch.randn(3, 5, 8).transpose(0, 1)
    weight, bias = torch.randn(18, 8, requires_grad=True), torch.randn(18, requires_grad=True)
    remote = [t.detach().cuda().requires_grad_() for t in (weight, bias)]
    with torch.no_grad():
        for args in ((weight, bias), (weight,)):
            local = F.linear(x, *args)
            got = F.linear(x.cuda(), *remote[: len(args)]).cpu()
            assert torch.equal(got, local), len(args)
        frozen = [t.detach() for t in (weight, bias)]
        assert torch.equal(
            F.linear(x.cuda(), *(t.cuda() for t in frozen)).cpu(), F.linear(x, *frozen)
        )


def test_views_made_in_inference_mode_are_what_a_local_device_makes(
    attach: Callable[..., Any],
) -> None:
    """A view of a normal tensor made in inference mode is a normal tensor; anything else made
    there is an inference tensor (serving code runs under torch.inference_mode())."""
    attach()

    def idiom(put: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        x = put(torch.arange(12.0).reshape(3, 4))
        with torch.inference_mode():
            made = {
                "select": x[0], "view": x.view(4, 3), "t": x.t(), "detach": x.detach(),
                "add": x + 1, "view_of_new": (x * 2)[1:], "transpose_of_new": (x - 1).mT,
            }  # fmt: skip
            inner = made["add"].view(2, 6)
        return [(name, t.is_inference(), t) for name, t in {**made, "inner": inner}.items()]

    expected, actual = idiom(lambda t: t.clone()), idiom(lambda t: t.to("cuda"))
    assert [(n, i) for n, i, _ in actual] == [(n, i) for n, i, _ in expected]
    _assert_same([t for _, _, t in actual], [t for _, _, t in expected])


class _Served(torch.nn.Module):
    """What serving code runs under inference mode: linears, norms, attention, a recurrent
    layer, reshapes and a read to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)
        self.norm = torch.nn.LayerNorm(8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.rnn = torch.nn.LSTM(8, 8, batch_first=True)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(self.norm(x)).reshape(x.shape[0], x.shape[1], 3, 8).unbind(2)
        h = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        h = self.bn(self.drop(h).transpose(1, 2)).transpose(1, 2)
        out, _ = self.rnn(F.gelu(h))
        return out.flatten(1).softmax(-1)


def test_a_model_served_under_inference_mode_gives_the_local_values(
    attach: Callable[..., Any],
) -> None:
    attach()
    torch.manual_seed(4)
    local = _Served().eval()
    remote = _Served().eval()
    remote.load_state_dict(local.state_dict())
    remote.cuda()
    x = torch.randn(3, 5, 8)
    with torch.inference_mode():
        expected = local(x)
        got = remote(x.cuda())
        host = got.cpu()  # read inside inference mode, as a server replies
    assert type(host) is torch.Tensor and host.device.type == "cpu" and host.is_inference()
    assert got.is_inference() and got.device.type == "cuda"
    assert torch.equal(host, expected)
