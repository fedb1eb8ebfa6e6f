"""Sparse COO tensors on a remote GPU: they move both ways, compute as on a local device
(sparse-dense products, sums, coalescing, transposes, autograd through them, nn.Embedding's
sparse gradients and the optimizer steps that take them), and a forged one is refused at its
op with the session alive. The worker holds each one's indices and values; every op on one
asks the worker (the client cannot know how many values an op makes)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

aten = torch.ops.aten


def _sparse() -> torch.Tensor:
    indices = torch.tensor([[0, 1, 1, 2, 0], [2, 0, 2, 1, 2]])
    values = torch.tensor([3.0, 4.0, 5.0, 6.0, 7.0])
    return torch.sparse_coo_tensor(indices, values, (3, 3))  # uncoalesced: (0, 2) twice


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit against local CPU on a CPU worker (the same kernels); on a CUDA worker to
    float32 rounding, since its sparse products are cuSPARSE's, which sum in another order
    (an H100 worker's addmm and sparse.mm gradient differed from the CPU's in the last bits)."""
    from gpupool.torch import runtime

    if not runtime.stream(0).is_cuda_worker:
        return torch.equal(got, want)
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def _computed(s: torch.Tensor, d: torch.Tensor) -> dict[str, Any]:
    on = lambda t: t.cpu()  # noqa: E731
    return {
        "to_dense": on(s.to_dense()),
        "sparse.mm": on(torch.sparse.mm(s, d)),
        "matmul": on(s @ d),
        "addmm": on(torch.addmm(d[:, :3], s, d[:3, :3])),
        "coalesced nnz": s.coalesce()._nnz(),
        "coalesced values": on(s.coalesce().values()),
        "coalesced indices": on(s.coalesce().indices()),
        "sum": on(torch.sparse.sum(s)),
        "sum over a dim": on(torch.sparse.sum(s, 1).to_dense()),
        "add": on((s + s).to_dense()),
        "mul": on((s * 2.5).to_dense()),
        "transpose": on(s.t().to_dense()),
        "softmax": on(torch.sparse.softmax(s.coalesce(), 1).to_dense()),
    }


def test_a_sparse_tensor_moves_both_ways_and_computes_as_locally(
    attach: Callable[..., Any],
) -> None:
    s, d = _sparse(), torch.randn(3, 4)
    local = _computed(s, d)
    attach()
    remote = s.to("cuda")
    assert (remote.layout, remote.is_sparse, remote.device) == (
        torch.sparse_coo, True, torch.device("cuda:0")
    )  # fmt: skip
    assert remote.shape == (3, 3) and remote.dtype == torch.float32
    assert remote._nnz() == 5 and not remote.is_coalesced()
    back = remote.cpu()
    assert back.layout == torch.sparse_coo and not back.is_coalesced()
    assert torch.equal(back._indices(), s._indices()) and torch.equal(back._values(), s._values())
    got = _computed(remote, d.to("cuda"))
    for key, want in local.items():
        if isinstance(want, torch.Tensor):
            assert _same(got[key], want), key
        else:
            assert got[key] == want, key
    made = torch.sparse_coo_tensor(s._indices().to("cuda"), s._values().to("cuda"), (3, 3))
    assert made.is_sparse and torch.equal(made.cpu().to_dense(), s.to_dense())
    assert "indices=tensor(" in repr(remote) and "device='cuda:0'" in repr(remote)
    assert torch.equal(remote.double().cpu().to_dense(), s.to_dense().double())


def test_gradients_flow_through_sparse_products_and_sparse_embedding_gradients_train(
    attach: Callable[..., Any],
) -> None:
    s = _sparse()
    torch.manual_seed(0)
    weight = torch.randn(3, 4, requires_grad=True)
    torch.sparse.mm(s, weight).square().sum().backward()
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    remote_embedding = copy.deepcopy(embedding)
    tokens = torch.tensor([1, 2, 2, 7])
    embedding(tokens).square().sum().backward()
    local_grad = embedding.weight.grad
    assert local_grad is not None and local_grad.is_sparse
    torch.optim.SGD(embedding.parameters(), lr=0.1).step()
    attach()
    remote_weight = weight.detach().to("cuda").requires_grad_()
    torch.sparse.mm(s.to("cuda"), remote_weight).square().sum().backward()
    assert remote_weight.grad is not None and _same(remote_weight.grad.cpu(), weight.grad)
    remote_embedding = remote_embedding.to("cuda")
    remote_embedding(tokens.to("cuda")).square().sum().backward()
    grad = remote_embedding.weight.grad
    assert grad is not None and grad.is_sparse and grad.device == torch.device("cuda:0")
    assert _same(grad.cpu().to_dense(), local_grad.to_dense())
    torch.optim.SGD(remote_embedding.parameters(), lr=0.1).step()
    assert _same(remote_embedding.weight.detach().cpu(), embedding.weight.detach())


def test_a_forged_sparse_tensor_is_refused_at_its_op_and_the_session_lives_on(
    attach: Callable[..., Any],
) -> None:
    """The constructor the client calls (`_sparse_coo_tensor_with_dims_and_tensors`) trusts its
    indices; the worker checks them against the size before it makes the tensor."""
    attach()
    kept = torch.arange(4.0, device="cuda")
    out_of_range = torch.tensor([[0, 5], [0, 0]]).to("cuda")
    values = torch.tensor([1.0, 2.0]).to("cuda")
    with pytest.raises(RuntimeError, match="refused"):
        aten._sparse_coo_tensor_with_dims_and_tensors(
            2, 0, [3, 3], out_of_range, values, dtype=torch.float32, layout=torch.sparse_coo,
            device=torch.device("cuda:0"), is_coalesced=False,
        ).cpu()  # fmt: skip
    assert (kept + 1).sum().item() == 10.0


def test_a_sparse_tensor_on_a_worker_counts_against_the_lease(
    attach: Callable[..., Any],
) -> None:
    """Its indices and values are the lease's memory like any tensor's (a worker that held
    them uncounted would let a tenant past its limit)."""
    attach()
    before = torch.cuda.memory_allocated()
    n = 1 << 16
    indices = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)])
    remote = torch.sparse_coo_tensor(indices, torch.ones(n), (n, 1)).to("cuda")
    held = torch.cuda.memory_allocated() - before
    assert held >= n * (2 * 8 + 4)  # the indices (two int64 rows) and the values (float32)
    del remote
    assert torch.cuda.memory_allocated() - before < held


def test_a_sparse_tensor_saves_and_loads_as_torch_saves_one(attach: Callable[..., Any]) -> None:
    import io

    attach()
    remote = _sparse().to("cuda")
    buffer = io.BytesIO()
    torch.save({"s": remote}, buffer)
    buffer.seek(0)
    on_host = torch.load(buffer, map_location="cpu")["s"]
    assert on_host.layout == torch.sparse_coo and on_host.device.type == "cpu"
    assert torch.equal(on_host.to_dense(), _sparse().to_dense())
    buffer.seek(0)
    back = torch.load(buffer)["s"]  # cuda storages come back on the remote device
    assert back.is_sparse and back.device == torch.device("cuda:0")
    assert torch.equal(back.cpu().to_dense(), _sparse().to_dense())
