"""Host-to-device copies that stop the host (issue 58 item 4). On CUDA a copy from pageable host
memory - `torch.as_tensor(cpu_tensor, device=cuda)`, `.to(cuda)` of an ordinary CPU tensor -
goes through a staging buffer and ends in a stream synchronize; the counter of host reads
(test_gpu_numerics.host_reads) cannot see it. Here a GPU is played on the CPU - the meta device
under a dispatch mode, or a fake pin_memory/.to - and any such copy fails; the CPU's bits stay
the ones of before."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import compress
from nanogeo.geometry import layers, rows


def old_bias_corrections(step, betas, device):
    """adamw_direction's bias corrections as they were computed before bias_corrections."""
    t = torch.as_tensor(step, dtype=torch.float64, device=device) + 1
    return [1 - beta ** t for beta in betas]


def bits(x):
    return x.view(torch.int64).item()


STEPS = [*range(0, 4001), *(2 ** k + d for k in range(15, 24) for d in (-1, 0, 1))]


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95), (0.8, 0.99)])
def test_bias_corrections_on_the_host_are_the_old_bits_at_every_step(betas):
    """On the CPU bias_corrections gives the old formula's float64 bits at steps 0-4,000 and
    about each power of two up to 2^23, whatever form AdamW's step takes (float32 tensor, as
    torch keeps it, float64, a number, absent)."""
    for step in STEPS:
        old = [bits(c) for c in old_bias_corrections(step, betas, "cpu")]
        for form in (torch.tensor(float(step)), torch.tensor(step, dtype=torch.float64), step):
            assert [bits(c) for c in compress.bias_corrections(form, betas, "cpu")] == old, step
    state = {}
    assert compress.adamw_direction(torch.ones(2), state, betas, 1e-8).shape == (2,)


def old_adamw_direction(g, state, betas, eps):
    """compress.adamw_direction as it was before bias_corrections (its body, verbatim)."""
    beta1, beta2 = betas
    step = torch.as_tensor(state.get("step", 0), dtype=torch.float64, device=g.device) + 1
    c1, c2 = 1 - beta1 ** step, 1 - beta2 ** step                       # no host sync
    m, v = (state[k].double() if k in state else torch.zeros_like(g, dtype=torch.float64)
            for k in ("exp_avg", "exp_avg_sq"))
    g = g.double()
    m_hat = (beta1 * m + (1 - beta1) * g) / c1
    v_hat = (beta2 * v + (1 - beta2) * g * g) / c2
    return m_hat / (v_hat.sqrt() + eps)


def test_adamw_direction_is_bit_identical_to_before_on_the_cpu():
    """The whole update direction (what the gain check compares) at many steps, bit for bit."""
    g = torch.Generator().manual_seed(0)
    for step in [None, 0, 1, 2, 3, 10, 99, 1000, 4097, 123_456]:
        grad = torch.randn(16, 24, generator=g)
        state = {} if step is None else {
            "step": torch.tensor(float(step)), "exp_avg": torch.randn(16, 24, generator=g),
            "exp_avg_sq": torch.rand(16, 24, generator=g)}
        for betas in [(0.9, 0.95), (0.9, 0.999)]:
            assert torch.equal(compress.adamw_direction(grad, state, betas, 1e-8),
                               old_adamw_direction(grad, state, betas, 1e-8)), step


class HostToDevice(TorchDispatchMode):
    """Every copy from a CPU tensor to another device, and every read of a device tensor's
    value, that passes through the dispatcher while active."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is None:
            return func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and source.is_cpu and \
                torch.device(kwargs.get("device") or "cpu").type != "cpu":
            self.seen.append(("copy to", str(kwargs["device"])))
        if func is torch.ops.aten.copy_.default and not source.is_cpu and args[1].is_cpu:
            self.seen.append(("copy into", str(source.device)))
        if func is torch.ops.aten._local_scalar_dense.default and not source.is_cpu:
            self.seen.append(("read", str(source.device)))
        return func(*args, **kwargs)


def test_adamw_error_copies_nothing_from_the_host_to_a_gpu():
    """A non-fused AdamW keeps `step` on the CPU: the gain check's AdamW error (1 + K W update
    directions per judged step) reads it there and copies nothing to the device (the meta
    device plays the GPU); the old formula's copy is seen by the same spy."""
    meta = torch.device("meta")
    state = {"step": torch.tensor(7.0), "exp_avg": torch.empty(16, 24, device=meta),
             "exp_avg_sq": torch.empty(16, 24, device=meta)}
    mean, delta = torch.empty(16, 24, device=meta), torch.empty(16, 24, device=meta)
    with HostToDevice() as spy:
        compress.adamw_error(state, (0.9, 0.95), 1e-8, mean, workers=4)(delta)
    assert spy.seen == []
    with HostToDevice() as spy:
        old_bias_corrections(state["step"], (0.9, 0.95), meta)
    assert spy.seen == [("copy to", "meta")]
    with HostToDevice() as spy:     # a fused AdamW's step, on the device: stays there
        compress.bias_corrections(torch.empty((), device=meta), (0.9, 0.95), meta)
    assert spy.seen == []


class FakeGpuCopies:
    """Tensor.pin_memory and Tensor.to as on a GPU, on a CPU-only torch: a CPU tensor sent to
    "cuda" stays on the CPU and the call is recorded; one sent from memory that was not pinned,
    or blocking, or cast to another dtype on the way (CUDA casts it on the host into pageable
    memory first), fails the test."""

    def __init__(self, monkeypatch):
        self.calls, pinned, real_to = [], set(), torch.Tensor.to

        def pin_memory(t):
            self.calls.append("pin_memory")
            pinned.add(t.data_ptr())
            return t

        def to(t, *args, **kwargs):
            device = next((a for a in args if isinstance(a, (str, torch.device))),
                          kwargs.get("device"))
            if device is None or torch.device(device).type != "cuda":
                return real_to(t, *args, **kwargs)
            blocking = not kwargs.get("non_blocking", False)
            assert t.data_ptr() in pinned and not blocking, "a host-to-device copy that waits"
            # CUDA casts a host tensor on the host, into a pageable temporary it copies from
            dtype = next((a for a in args if isinstance(a, torch.dtype)), kwargs.get("dtype"))
            assert dtype in (None, t.dtype), "a host-to-device copy that waits (a cast)"
            self.calls.append(("to", str(device)))
            return t
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch.Tensor, "to", to)


def test_cold_start_copies_are_pinned_and_non_blocking_on_a_gpu(monkeypatch):
    """The rotation's cold start: its random start directions and the core's swaps (two index
    tensors, one copy) reach a GPU from pinned memory, non_blocking; on the CPU nothing is
    pinned and the tensors are those of before."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    omega = torch.randn(96, 8, generator=torch.Generator().manual_seed(5))
    swaps = compress.core_swaps((64, 96), 8, 32)
    assert torch.equal(rows.seeded_directions(96, 8, 5, cpu), omega)
    fake = FakeGpuCopies(monkeypatch)
    assert torch.equal(rows.seeded_directions(96, 8, 5, cpu), omega)
    assert layers.swaps_on(swaps, cpu) == swaps and fake.calls == []
    assert torch.equal(rows.seeded_directions(96, 8, 5, cuda, torch.float64), omega.double())
    assert fake.calls == ["pin_memory", ("to", "cuda:0")]
    fake.calls.clear()
    a, b = layers.swaps_on(swaps, cuda)
    assert torch.equal(a, swaps[0]) and torch.equal(b, swaps[1])
    assert fake.calls == ["pin_memory", ("to", "cuda:0")]
    with pytest.raises(AssertionError, match="waits"):      # the spy sees a pageable copy
        swaps[0].to(cuda)


class MetaGpu(HostToDevice):
    """HostToDevice, with the meta device playing a GPU through whole steps: every read of a
    meta tensor's values on the host (.cpu(), .numpy()) is recorded ("to host") and answered
    with zeros - a finite step, zero measured errors - so that the step goes on; and every
    tensor made on it from host data by torch.tensor, as_tensor, asarray or Tensor.new_tensor
    (on a GPU a copy from pageable memory; on meta no op is dispatched: watched by name)."""

    def __init__(self, monkeypatch):
        super().__init__()
        for name in ("tensor", "as_tensor", "asarray"):
            monkeypatch.setattr(torch, name, self.watched(getattr(torch, name), data_at=0))
        monkeypatch.setattr(torch.Tensor, "new_tensor",
                            self.watched(torch.Tensor.new_tensor, data_at=1))

    def watched(self, make, data_at):
        def call(*args, **kwargs):
            out, data = make(*args, **kwargs), args[data_at]
            if not out.is_cpu and not (isinstance(data, torch.Tensor)
                                       and data.device == out.device):
                self.seen.append(("copy to", str(out.device)))
            return out
        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is torch.ops.aten._to_copy.default and source is not None and source.is_meta \
                and torch.device(kwargs.get("device") or "meta").type == "cpu":
            self.seen.append(("to host", tuple(source.shape)))
            return torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype)
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("select", ["all", "gain"])
def test_a_whole_reduce_copies_nothing_from_the_host_after_the_cold_start(monkeypatch, select):
    """Item 4's spy over whole steps: ProductionCommunicator.reduce of cpu-tiny's gradients on the
    meta device (a GPU's stand-in; rank 0 of nanogeo.lab.reduce_memory's Loopback group),
    the rotation through a cold start, refreshes, judged steps and ordinary steps - in use on
    every matrix (select="all") or measured and left out (select="gain", zero errors). Only the
    cold start copies from the host (its random start directions and the core's swaps: pinned
    on a GPU, tests above); after it no step copies from the host or reads a value with .item(),
    a refresh or judged step reads the device once (geometry_step.host_read: the finiteness
    flag, the ranks' agreement, the measured errors) and an ordinary step never."""
    import torch.distributed as dist
    import model as model_lib
    from nanogeo.geometry import agreement
    from nanogeo.lab import reduce_memory
    from nanogeo.wire import packing
    for made_once in (packing.on_device, packing.count_divisor_on, compress.e2m1_grid,
                      compress.random_start):     # as in a fresh process: nothing made yet
        made_once.cache_clear()
    # (a zero agreement flag reads as "the ranks differ": no repair - the spy's answer, not theirs)
    monkeypatch.setattr(agreement, "repair_geometry", lambda *args, **kwargs: False)
    with torch.device("meta"):
        net = model_lib.Llama(model_lib.model_config("cpu-tiny"))
    params = [p for p in net.parameters() if p.requires_grad]
    reduce_memory.join_loopback(2)
    try:
        communicator = reduce_memory.communicator_for(net, dict(
            geometry="subspace", select=select, geo_warmup=1, geo_refresh=4))
        seen, rotated = [], []
        for _ in range(10):
            for p in params:
                p.grad = torch.empty(p.shape, device="meta")
            with monkeypatch.context() as patch, MetaGpu(patch) as spy:
                communicator.reduce([p.grad for p in params])
            seen.append([kind for kind, _ in spy.seen])
            rotated.append(sum(map(communicator.sent_in_geometry, communicator.names)))
    finally:
        dist.destroy_process_group()
    matrices = len(communicator.layers)     # the cold start's copies, and the wire's zeros
    assert 0 < seen[0].count("copy to") <= 3 * matrices + 1     # (packing.on_device's zeros)
    assert seen[0].count("to host") == 1
    for step, kinds in enumerate(seen[1:], 1):
        assert set(kinds) <= {"to host"} and len(kinds) <= 1, (step, kinds)
    # steps 1..9: the judged step after the cold start, refreshes after 4 and 8 steps and the
    # judged steps after them read once; the other four are ordinary steps and read nothing
    assert [len(kinds) for kinds in seen[1:]] == [1, 0, 1, 1, 0, 0, 1, 1, 0]
    assert rotated[1:] == [matrices if select == "all" else 0] * 9
