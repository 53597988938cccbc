"""The CPU's stand-ins for what a GPU feels (nanogeo/lab/probes.py) count what they claim."""
import torch

from nanogeo.lab.probes import NO_KERNEL, MemoryPeak, OpCounter


def test_op_counter_counts_kernels_and_host_waits():
    x = torch.randn(32, 32)
    with OpCounter() as ops:
        torch.linalg.svd(x)                 # waits for the device on CUDA
        torch.linalg.cholesky_ex(x @ x.T + torch.eye(32))   # the _ex variant does not
        (x @ x).sum().item()                # a host read
        torch.tensor([1.0, 2.0])            # host data
        x.view(-1)                          # no kernel
    assert ops.syncing == 3, ops.counts
    assert ops.counts["view"] == 1
    assert ops.total == sum(n for name, n in ops.counts.items() if name not in NO_KERNEL)
    assert ops.total < sum(ops.counts.values()) == ops.dispatched


def test_memory_peak_follows_storages_until_freed():
    n = 4 * 1000 * 1000
    with MemoryPeak() as mem:
        a = torch.randn(1000, 1000)
        b = a * 2
        del a                               # freed: a and b were the peak
        c = b + 1
        b.add_(1)                           # in place: nothing new
        v = c.view(-1)                      # a view: nothing new
        del b
    assert mem.peak == 2 * n and mem.alive == n
    assert v.numel() == 1000 * 1000


def test_memory_peak_counts_no_view_of_a_tensor_made_before():
    """A gradient exists before the block: its views and in-place writes are no new memory
    (they were counted as a new storage of the gradient's size before the probe looked at the
    op's inputs)."""
    grad = torch.randn(1000, 1000)
    with MemoryPeak() as mem:
        flat = grad.view(-1)                # views of it, at any depth
        part = flat[:500_000].view(500, 1000)
        part.mul_(2)                        # in place
        same = grad.float()                 # already fp32: the tensor itself
        copy = part + 1                     # new: 500 x 1000 fp32
    assert mem.peak == 2 * 1000 * 1000 and mem.alive == 2 * 1000 * 1000
    assert same is grad and copy.numel() == flat.numel() // 2
