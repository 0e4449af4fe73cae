"""`tedebug.host_numpy.host_view`: a CPU tensor's values as a numpy array, which leaves a parameter's storage
resizable (``Tensor.numpy()`` marks it not resizable for good; FSDP resizes a gathered parameter's storage to 0:
tests/nn/test_fsdp.py)."""

import numpy as np
import torch

from tedebug.host_numpy import host_view


def test_a_parameter_is_read_without_pinning_its_storage():
    weight = torch.nn.Parameter(torch.randn(6, 8))
    view = host_view(weight)
    assert np.array_equal(view, weight.detach().clone().numpy()) and not view.flags.writeable
    assert weight.untyped_storage().resizable()
    plain = torch.randn(6, 8)
    assert np.array_equal(host_view(plain), plain.numpy())  # (a plain tensor: numpy() itself)
    assert not plain.untyped_storage().resizable()


def test_a_kept_view_reads_the_memory_as_it_is_now_and_strides_are_kept():
    weight = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4))
    first = host_view(weight)
    with torch.no_grad():
        weight.mul_(2)  # (an optimizer step)
    again = host_view(weight)
    assert again is first and np.array_equal(again, 2 * np.arange(12.0).reshape(3, 4))
    transposed = torch.arange(12.0).reshape(3, 4).t().as_subclass(torch.nn.Parameter)  # (strided, a subclass)
    assert type(transposed) is torch.nn.Parameter and not transposed.is_contiguous()
    assert np.array_equal(host_view(transposed), np.arange(12.0).reshape(3, 4).T)
    assert transposed.untyped_storage().resizable()
    half = torch.nn.Parameter(torch.randn(5, dtype=torch.float16))
    assert host_view(half).dtype == np.float16 and np.array_equal(host_view(half), half.detach().clone().numpy())
