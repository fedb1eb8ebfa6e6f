"""Remote tensors behave as local ones where PyTorch's C++ makes tensors, and in their math bits.

Each idiom runs locally and on a remote device; the values must be equal. These are the
idioms whose C++ composites or autograd formulas make new tensors with a remote tensor's
options (which became plain meta tensors while a remote tensor's C++ device was meta), the lazy
conjugate and negative bits, complex32, and sparse tensors failing at their op.
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


def test_a_sparse_tensor_fails_at_its_op_and_the_session_lives_on(
    attach: Callable[..., Any],
) -> None:
    attach()
    kept = torch.arange(4.0, device="cuda") * 2
    with pytest.raises(NotImplementedError, match="sparse_coo tensors are not supported"):
        torch.eye(3).to_sparse().to("cuda")
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
