"""profile_module on tiny real models: fits, hand-counted activations/FLOPs, JSON round trip, errors."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _profiling_models import MLP, NoParams, OOMAbove, xy_batches  # noqa: E402

from lightning_distplan.errors import InfeasiblePlanError  # noqa: E402
from lightning_distplan.profile import Profile  # noqa: E402
from lightning_distplan.profiling import ProfilingError, default_micro_batch_sizes, device_info, profile_module  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def mlp_profile() -> Profile:
    torch.manual_seed(0)
    return profile_module(MLP(), xy_batches(), micro_batch_sizes=[1, 2, 4, 8], repeats=2)


def test_fits_and_samples(mlp_profile: Profile) -> None:
    p = mlp_profile
    assert p.micro_batch_sizes == (1, 2, 4, 8)
    assert [s.micro_batch_size for s in p.step.samples] == [1, 2, 4, 8]
    assert all(s.forward_s > 0 and s.backward_s > 0 for s in p.step.samples)
    for fit in (p.step.forward, p.step.backward):
        assert fit.r2 <= 1.0 and fit.r2 == fit.r2  # present and finite
    assert [layer.name for layer in p.layers] == ["net.0", "net.1", "net.2"]
    for layer in p.layers:
        assert len(layer.samples) == 4
        assert layer.forward.r2 <= 1.0
    assert p.device.type == "cpu" and p.device.total_memory_bytes > 0 and p.device.memory_source
    assert p.profiling_time_s > 0 and p.versions["torch"] == torch.__version__
    assert p.optimizer.name == "Adam" and p.optimizer.step_time_s > 0
    assert not p.splittable and "pipeline_spec" in p.split_reason


def test_activation_and_flop_counts_match_hand_computation(mlp_profile: Profile) -> None:
    # float32 = 4 bytes. Linear(8,16) saves its input x (8 floats; the weight is a parameter -> excluded),
    # ReLU saves its output (16 floats), Linear(16,4) saves its input = the ReLU output (same storage ->
    # counted once), mse_loss (glue after net.2 -> charged to net.2) saves prediction and target (4 + 4).
    net0, net1, net2 = mlp_profile.layers
    assert net0.activation_bytes_per_sample == pytest.approx(8 * 4)
    assert net1.activation_bytes_per_sample == pytest.approx(16 * 4)
    assert net2.activation_bytes_per_sample == pytest.approx(8 * 4)
    assert mlp_profile.memory.activation.alpha == pytest.approx(128)
    assert mlp_profile.memory.activation.beta == pytest.approx(0, abs=1e-6)
    # outputs a pipeline would send
    assert [l.output_bytes_per_sample for l in mlp_profile.layers] == pytest.approx([64, 64, 16])
    # of them, saved where: net.0's output by nobody (ReLU saves its result), net.1's by ReLU itself, net.2's by
    # the loss charged to it; none first by a later layer
    assert [l.output_saved_bytes_per_sample for l in mlp_profile.layers] == pytest.approx([0, 64, 16])
    assert [l.output_saved_later_bytes_per_sample for l in mlp_profile.layers] == pytest.approx([0, 0, 0])
    # FLOPs: 2*in*out forward; backward = weight grad (+ input grad where the input needs grad)
    assert net0.flops_forward_per_sample == pytest.approx(2 * 8 * 16)
    assert net0.flops_backward_per_sample == pytest.approx(2 * 8 * 16)  # x needs no grad
    assert net2.flops_forward_per_sample == pytest.approx(2 * 16 * 4)
    assert net2.flops_backward_per_sample == pytest.approx(2 * 2 * 16 * 4)
    # memory: weights 8*16+16+16*4+4 = 212 floats; Adam keeps 2 moments + a step scalar per tensor
    assert mlp_profile.memory.param_bytes == 212 * 4 == mlp_profile.memory.grad_bytes
    assert mlp_profile.memory.optimizer_state_bytes == 2 * 212 * 4 + 4 * 4
    assert mlp_profile.memory.fixed_overhead_bytes == 0 and mlp_profile.memory.measured_peak_bytes == {}


def test_json_round_trip(mlp_profile: Profile, tmp_path: Path) -> None:
    path = mlp_profile.save(tmp_path / "p.json")
    assert Profile.load(path) == mlp_profile


def test_self_log_is_silenced() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile_module(MLP("sgd"), xy_batches(), micro_batch_sizes=[1, 2, 4], repeats=1)
    assert not [w for w in caught if "log" in str(w.message)]


def test_oom_is_recorded_not_raised() -> None:
    data = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(8)]
    for kind in ("cuda", "cpu"):
        p = profile_module(OOMAbove(limit=4, kind=kind), data, micro_batch_sizes=[1, 2, 4, 8, 16], repeats=1)
        assert p.micro_batch_sizes == (1, 2, 4)
        assert p.infeasible_micro_batch_sizes == (8,)  # larger sizes are not tried after the first OOM
        assert p.max_feasible_micro_batch_size == 7
    # default sizes (b/2, b, 2b, 4b = 2, 4, 8, 16): OOM at 8 leaves 2 sizes, so a smaller one is added
    p = profile_module(OOMAbove(limit=4), data, repeats=1)
    assert p.infeasible_micro_batch_sizes == (8,) and p.micro_batch_sizes == (1, 2, 4)
    with pytest.raises(InfeasiblePlanError, match="HINT"):
        profile_module(OOMAbove(limit=0), data, micro_batch_sizes=[2], repeats=1)
    # the user's sizes where only two fit: the line through them is said to show nothing
    with pytest.warns(UserWarning, match=r"measured at 2 micro-batch size\(s\) only \(\[1, 2\]\): two points fit any line"):
        profile_module(OOMAbove(limit=2), data, micro_batch_sizes=[1, 2, 4], repeats=1)


def test_default_sizes() -> None:
    assert default_micro_batch_sizes(8) == [4, 8, 16, 32]
    assert default_micro_batch_sizes(1) == [1, 2, 4, 8]
    assert len(default_micro_batch_sizes(2)) >= 3


def test_errors_have_hints() -> None:
    with pytest.raises(ProfilingError, match="no trainable parameters.*HINT"):
        profile_module(NoParams(), xy_batches())
    with pytest.raises(ProfilingError, match="yielded no batches.*HINT"):
        profile_module(MLP(), [])
    with pytest.raises(ValueError, match="micro_batch_sizes.*HINT"):
        profile_module(MLP(), xy_batches(), micro_batch_sizes=[0, 2])
    per_sample = MLP()  # one loss per sample: Trainer.fit's backward raises "grad can be implicitly created only for scalar outputs"
    per_sample.training_step = lambda batch, batch_idx: ((per_sample.net(batch[0]) - batch[1]) ** 2).mean(dim=1)
    with pytest.raises(ProfilingError, match=r"returned a loss of shape \(2,\), and Lightning's backward needs a scalar loss\. HINT"):
        profile_module(per_sample, xy_batches(), micro_batch_sizes=[2, 4], repeats=1, loop_overhead=False)
    manual = MLP()
    manual.automatic_optimization = False
    with pytest.raises(ProfilingError, match="manual optimization.*HINT"):
        profile_module(manual, xy_batches())
    # a lazy module not run yet: copying its parameters for the snapshot raised torch's own ValueError
    lazy = MLP()
    lazy.net[0] = torch.nn.LazyLinear(16)
    with pytest.raises(ProfilingError, match=r"parameters that are not initialized yet \(net.0.weight, net.0.bias: a lazy module.*HINT: Initialize"):
        profile_module(lazy, xy_batches())
    # one whose only uninitialized tensors are buffers (a LazyBatchNorm1d without affine weights): the same ValueError
    lazy = MLP()
    lazy.net[1] = torch.nn.Sequential(torch.nn.LazyBatchNorm1d(affine=False), lazy.net[1])
    with pytest.raises(ProfilingError, match=r"not initialized yet \(net.1.0.running_mean, net.1.0.running_var.*HINT: Initialize"):
        profile_module(lazy, xy_batches())


def test_a_loss_in_any_mapping_is_profiled_and_compared_with_the_pipelines() -> None:
    """Lightning reads the loss from any Mapping training_step returns (ClosureResult); the profiler read it from a
    dict only, refused a mappingproxy Lightning trains, and skipped the pipeline-loss comparison for it."""
    import types

    import torch.nn.functional as F

    class MappingLoss(MLP):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.scale = scale

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return types.MappingProxyType({"loss": self.scale * F.mse_loss(self.net(x), y), "acc": 0.5})

        def pipeline_loss(self, output, batch):  # noqa: ANN001, ANN201
            return F.mse_loss(output, batch[1])

    same = profile_module(MappingLoss(1.0), xy_batches(), micro_batch_sizes=[1, 2, 4], repeats=1, loop_overhead=False)
    assert same.micro_batch_sizes == (1, 2, 4) and same.splittable
    other = profile_module(MappingLoss(2.0), xy_batches(), micro_batch_sizes=[1, 2, 4], repeats=1, loop_overhead=False)
    assert not other.splittable and "would train another objective" in other.split_reason


def test_a_pipeline_loss_that_is_not_a_scalar_leaves_the_model_data_parallel() -> None:
    """The pipeline's last stage refuses a loss that is not a scalar (_check_scalar_loss, at the first step of the fit);
    the profiler averaged it, found it equal to training_step's, and called the model splittable."""
    import torch.nn.functional as F

    class VectorPipelineLoss(MLP):
        def pipeline_loss(self, output, batch):  # noqa: ANN001, ANN201
            return F.mse_loss(output, batch[1], reduction="none")

    profile = profile_module(VectorPipelineLoss(), xy_batches(), micro_batch_sizes=[1, 2, 4], repeats=1, loop_overhead=False)
    assert profile.micro_batch_sizes == (1, 2, 4)  # profiled through training_step, whose loss is a scalar
    assert not profile.splittable and "the pipeline's loss is a tensor of shape (1, 4), not a scalar" in profile.split_reason


def test_the_batch_transfer_hooks_run_on_every_micro_batch_as_in_the_training_loop(caplog: pytest.LogCaptureFixture) -> None:
    """Lightning's loop runs on_before_batch_transfer, transfer_batch_to_device and on_after_batch_transfer before
    training_step; the profiler only moved the batch, so a hook that turns uint8 images into floats (Lightning's
    documented place for device-side preprocessing) failed profiling (and strategy='auto_plan') with a dtype error,
    and one that resized or augmented was timed on inputs training never sees."""
    seen: list[tuple[str, torch.dtype]] = []

    class Uint8Inputs(MLP):
        def on_before_batch_transfer(self, batch, dataloader_idx):  # noqa: ANN001, ANN201
            seen.append(("before", batch[0].dtype))
            return batch

        def on_after_batch_transfer(self, batch, dataloader_idx):  # noqa: ANN001, ANN201
            seen.append(("after", batch[0].dtype))
            return batch[0].float() / 255, batch[1]

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            seen.append(("step", batch[0].dtype))
            return super().training_step(batch, batch_idx)

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 256, (4, 8), dtype=torch.uint8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(4)]
    profile = profile_module(Uint8Inputs(), data, micro_batch_sizes=[1, 2, 4], repeats=1, loop_overhead=False)
    assert profile.micro_batch_sizes == (1, 2, 4)
    assert set(seen) == {("before", torch.uint8), ("after", torch.uint8), ("step", torch.float32)}

    class NeedsTrainer(MLP):  # Lightning's augmentation pattern: on the device, in training only
        def on_after_batch_transfer(self, batch, dataloader_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return (x.float() / 255 if self.trainer.training else x.float()), y

    # outside a fit it cannot run: the batches are moved only (they were before the hooks ran here), with one warning
    floats = [(x.float(), y) for x, y in data]
    with caplog.at_level(logging.WARNING, logger="lightning_distplan.profiling._profiler"):
        profile = profile_module(NeedsTrainer(), floats, micro_batch_sizes=[1, 2], repeats=1, loop_overhead=False)
    assert profile.micro_batch_sizes == (1, 2)
    warned = [r.getMessage() for r in caplog.records if "need a Trainer" in r.getMessage()]
    assert len(warned) == 1 and "moved to the device without them" in warned[0] and "strategy='auto_plan'" in warned[0]

    class Broken(MLP):  # any other failure of a hook is still one error naming the hooks
        def on_after_batch_transfer(self, batch, dataloader_idx):  # noqa: ANN001, ANN201
            raise KeyError("labels")

    with pytest.raises(ProfilingError, match=r"Broken's batch transfer hooks .* failed .*KeyError.*HINT: "):
        profile_module(Broken(), data, micro_batch_sizes=[1, 2], repeats=1, loop_overhead=False)


def test_a_datamodules_hook_that_needs_a_trainer_is_skipped_outside_a_fit(caplog: pytest.LogCaptureFixture) -> None:
    """A LightningDataModule's trainer is None outside a fit (a LightningModule's raises 'not attached to a `Trainer`'),
    so its `if self.trainer.training:` augmentation failed with an AttributeError that stopped `distplan profile
    --datamodule` with a ProfilingError, where the same hook on the module is skipped with one warning."""
    import lightning.pytorch as pl

    class Augments(pl.LightningDataModule):
        def on_after_batch_transfer(self, batch, dataloader_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return (x * 2 if self.trainer.training else x), y

    data = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="lightning_distplan.profiling._profiler"):
        profile = profile_module(MLP(), data, micro_batch_sizes=[1, 2], repeats=1, loop_overhead=False, datamodule=Augments())
    assert profile.micro_batch_sizes == (1, 2)
    warned = [r.getMessage() for r in caplog.records if "need a Trainer" in r.getMessage()]
    assert len(warned) == 1 and "moved to the device without them" in warned[0]


def test_cuda_request_without_gpu() -> None:
    from lightning_distplan.errors import DeviceUnavailableError

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(DeviceUnavailableError, match="HINT"):
        profile_module(MLP(), xy_batches(), device="cuda")
    info = device_info("cpu")
    assert info.type == "cpu" and info.total_memory_bytes > 2**20
    assert info.memory_source in ("host RAM (sysconf)", "cgroup memory limit")


def test_nvml_is_asked_for_the_mig_instance_cuda_reports_not_the_whole_gpu() -> None:
    """In MIG mode CUDA reports the MIG instance's UUID, which NVML names MIG-<uuid>. Asked for GPU-<uuid> only, NVML
    found nothing and the PCI bus fallback named the whole GPU: a 1g slice of an H200 was profiled with the full
    GPU's memory, so plans that do not fit were kept."""
    from lightning_distplan.profiling._device import nvml_uuids

    raw = "5f2c3c4e-0000-1111-2222-333344445555"
    assert nvml_uuids(raw) == (f"GPU-{raw}", f"MIG-{raw}")
    assert nvml_uuids(f"MIG-{raw}") == (f"MIG-{raw}",) and nvml_uuids(f"GPU-{raw}") == (f"GPU-{raw}",)
    if torch.cuda.is_available():  # the device's own memory, not its parent GPU's (a MIG slice is 1/7 to 1/2 of it)
        info = device_info("cuda")
        assert info.total_memory_bytes <= 1.05 * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def test_default_sizes_stop_on_time_and_keep_three() -> None:
    from lightning_distplan.profiling._profiler import _next_sizes

    say = lambda _: None  # noqa: E731
    # fast steps: keep going
    assert _next_sizes([16, 32], [4, 8], [], [], step_s=0.1, m=8, say=say) == [16, 32]
    # slow with 3 sizes done: stop
    assert _next_sizes([32], [4, 8, 16], [], [], step_s=1.0, m=16, say=say) == []
    # slow with fewer than 3 sizes: go below the smallest (cheap) instead of above
    assert _next_sizes([8, 16, 32], [4], [], [], step_s=2.0, m=4, say=say) == [2]
    assert _next_sizes([], [4, 2], [], [], step_s=2.0, m=2, say=say) == [1]
    # at size 1 already: take the next larger one anyway to reach 3 sizes
    assert _next_sizes([], [2, 1], [], [], step_s=2.0, m=1, say=say) == [4]


def test_flops_from_one_size_match_the_exact_slope(mlp_profile: Profile) -> None:
    # flop_sizes=1 (what auto_plan uses in fit) counts at the first size only and divides by m:
    # the MLP has no batch-independent FLOPs, so it must equal the two-size slope exactly.
    torch.manual_seed(0)
    one = profile_module(MLP(), xy_batches(), micro_batch_sizes=[2, 4, 8], repeats=1, flop_sizes=1)
    for a, b in zip(one.layers, mlp_profile.layers):
        assert a.flops_forward_per_sample == pytest.approx(b.flops_forward_per_sample)
        assert a.flops_backward_per_sample == pytest.approx(b.flops_backward_per_sample)
    assert one.layers[0].flops_forward_per_sample == pytest.approx(2 * 8 * 16)
    # the FLOP counter does not disturb the saved-bytes count of the same run
    assert [l.activation_bytes_per_sample for l in one.layers] == pytest.approx([32, 64, 32])
    with pytest.raises(ProfilingError, match="flop_sizes") as info:
        profile_module(MLP(), xy_batches(), micro_batch_sizes=[2, 4], flop_sizes=3)
    assert "HINT" in str(info.value)


def test_flops_of_grouped_convolutions_and_cpu_attention_match_hand_counts() -> None:
    """torch's FlopCounterMode counts a grouped convolution's weight gradient `groups` times over and does not
    count the attention kernel F.scaled_dot_product_attention takes on a CPU without a mask at all."""
    import torch.nn.functional as F
    from lightning.pytorch import LightningModule
    from torch import nn

    T, d, heads = 16, 32, 4

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)

        def forward(self, x):
            q, k, v = (t.view(x.shape[0], T, heads, d // heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape[0], T, d)

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(T, T, 3, padding=1)
            self.grouped = nn.Conv1d(T, T, 3, padding=1, groups=4)
            self.attn = Attention()

        def training_step(self, batch, batch_idx=0):
            return self.attn(self.grouped(self.conv(batch[0]))).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    batches = [(torch.randn(4, T, d),) for _ in range(4)]
    profile = profile_module(Net(), batches, micro_batch_sizes=[2, 4, 8], repeats=1)
    layers = {layer.name: layer for layer in profile.layers}
    grouped_forward = 2 * d * T * (T // 4) * 3
    assert layers["grouped"].flops_forward_per_sample == pytest.approx(grouped_forward)
    assert layers["grouped"].flops_backward_per_sample == pytest.approx(2 * grouped_forward)  # input and weight gradients
    attention = 2 * 2 * heads * T * T * (d // heads)  # Q·Kᵀ and P·V
    assert layers["attn"].flops_forward_per_sample == pytest.approx(2 * T * d * 3 * d + attention)
    # The convolutions' share, which follows cuDNN's TF32 switch and not the matmuls' (the projection's peaks)
    for name in ("conv", "grouped"):
        assert layers[name].conv_flops_forward_per_sample == layers[name].flops_forward_per_sample > 0
        assert layers[name].conv_flops_backward_per_sample == layers[name].flops_backward_per_sample > 0
    assert layers["attn"].conv_flops_forward_per_sample == layers["attn"].conv_flops_backward_per_sample == 0
    from lightning_distplan.profiling._device import tf32_switches

    assert (profile.device.tf32_matmul, profile.device.tf32_conv) == tf32_switches()  # the process's, whatever they are


def test_tf32_switches_read_both_of_torchs_interfaces() -> None:
    """torch >= 2.9 sets TF32 per backend with `fp32_precision`; reading the older `allow_tf32` after that raises, so
    the newer is read first. set_float32_matmul_precision("high") is the usual way to TF32 matmuls."""
    from lightning_distplan.profiling._device import tf32_switches

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (torch.get_float32_matmul_precision(), getattr(matmul, "fp32_precision", None), getattr(getattr(cudnn, "conv", None), "fp32_precision", None))
    before = tf32_switches()
    try:
        torch.set_float32_matmul_precision("highest")
        assert tf32_switches()[0] is False
        torch.set_float32_matmul_precision("high")
        assert tf32_switches()[0] is True
        if saved[1] is not None:
            matmul.fp32_precision = "ieee"
            cudnn.conv.fp32_precision = "ieee"
            assert tf32_switches() == (False, False)
            cudnn.conv.fp32_precision = "tf32"
            assert tf32_switches() == (False, True)
    finally:
        torch.set_float32_matmul_precision(saved[0])
        if saved[1] is not None:
            matmul.fp32_precision, cudnn.conv.fp32_precision = saved[1], saved[2]
    assert tf32_switches() == before  # left as it was for the tests after


def test_hand_edited_profiles_that_cannot_be_are_refused(mlp_profile: Profile) -> None:
    import dataclasses

    from lightning_distplan.errors import ProfileFormatError

    memory = mlp_profile.memory
    for broken, match in (
        (dataclasses.replace(mlp_profile, memory=dataclasses.replace(memory, param_bytes=10**19)), r"memory.param_bytes = 10000000000000000000, beyond any device"),
        (dataclasses.replace(mlp_profile, memory=dataclasses.replace(memory, grad_bytes=memory.param_bytes + 4)), r"more gradient bytes .* than parameter bytes"),
        (dataclasses.replace(mlp_profile, infeasible_micro_batch_sizes=(3,)), r"lists micro-batch 3 as out of memory but profiled 8"),
    ):
        with pytest.raises(ProfileFormatError, match=match + ".*HINT"):
            Profile.from_dict(broken.to_dict())
    # times the cost model reads, edited beyond belief, and a splittable flag that is not a boolean (the string "no" is true)
    for edit, match in (
        (lambda d: d["step"]["forward"].update(alpha=1e300), r"step.forward.alpha = 1e\+300, beyond any device"),
        (lambda d: d["layers"][1]["backward"].update(beta=-1e30), r"layers\[1\].backward.beta = -1e\+30, beyond any device"),
        (lambda d: d["framework"].update(per_batch_s=1e300), r"framework.per_batch_s = 1e\+300, beyond any device"),
        (lambda d: d.update(splittable="no"), r"splittable = 'no'; it must be true or false"),
        # a string field holding another type passed the loader and crashed the planner ("argument of type 'int' is not
        # iterable" from the link's backend) or the tuner's GPU lookup (the device's name)
        (lambda d: d.update(links=[{"kind": "p2p", "backend": 3, "world_size": 2, "latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9}]),
         r"links\[0\].backend = 3; it must be a string"),
        (lambda d: d["device"].update(name=["H100"]), r"device.name = \['H100'\]; it must be a string"),
        (lambda d: d["optimizer"].update(name=None), r"optimizer.name = None; it must be a string"),
    ):
        data = mlp_profile.to_dict()
        edit(data)
        with pytest.raises(ProfileFormatError, match=match + ".*HINT"):
            Profile.from_dict(data)


def test_recorder_tells_where_each_output_is_saved() -> None:
    """What a pipeline cut needs: of each layer's output, the bytes saved by it (ReLU: its result) and those first
    saved by the next layer (Linear, LayerNorm: their input), which on a receiving stage is the receive buffer."""
    from lightning_distplan.profiling._recorder import LayerRecorder

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 48), torch.nn.LayerNorm(48), torch.nn.Linear(48, 8)]
    seq = torch.nn.Sequential(*layers)
    x, y = torch.randn(2, 16), torch.randn(2, 8)
    params = {t.untyped_storage().data_ptr() for t in seq.parameters()}
    with LayerRecorder(layers, torch.device("cpu"), exclude_storages=params) as rec:
        r = rec.run(lambda: ((seq(x) - y) ** 2).mean(), count_saved=True)
    assert r.output_bytes == [256, 256, 384, 384, 64]
    assert r.saved_bytes == [128, 256, 0, 400, 448]  # LayerNorm: its input + mean and rstd; the last: its input + (out - y)
    assert r.output_saved_bytes == [0, 256, 0, 0, 0]
    assert r.output_saved_later_bytes == [0, 0, 384, 384, 0]


def test_recorder_counts_only_the_next_layers_save_as_saved_later() -> None:
    """A layer's output saved two layers on (past a view layer that saves a tensor of its own) is not "saved by the
    next layer": a cut after it would take the in-between layer's own save for the receive buffer and under-count."""
    from lightning_distplan.profiling._recorder import LayerRecorder

    class ViewWithASave(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.exp(self.p * 1.0)  # saves its 256-byte result, unrelated to x
            return x.view_as(x)

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), ViewWithASave(), torch.nn.Linear(32, 8)]
    seq = torch.nn.Sequential(*layers)
    x, y = torch.randn(2, 16), torch.randn(2, 8)
    params = {t.untyped_storage().data_ptr() for t in seq.parameters()}
    with LayerRecorder(layers, torch.device("cpu"), exclude_storages=params) as rec:
        r = rec.run(lambda: ((seq(x) - y) ** 2).mean(), count_saved=True)
    assert r.saved_bytes[1] == 256 and r.output_bytes[:2] == [256, 256]
    assert r.output_saved_later_bytes == [0, 256, 0]  # the last Linear saves the view's output (layer 0's storage)


def test_recorder_does_not_credit_a_freed_output_with_saves_of_a_later_tensor_at_its_address() -> None:
    """An output nobody saved is freed during the forward and its address handed to a later tensor (CUDA's caching
    allocator does this all the time); that tensor's save is not a save of the dead output. Emulated deterministically:
    each ``Into`` call returns a new storage over the same numpy buffer."""
    import numpy as np

    from lightning_distplan.profiling._recorder import LayerRecorder

    buf = np.zeros((2, 32), dtype=np.float32)

    class Into(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(buf).copy_(x)

    torch.manual_seed(0)
    nn = torch.nn
    layers = [nn.Linear(16, 32), Into(), nn.ReLU(), nn.Linear(32, 32), Into(), nn.Linear(32, 8)]
    seq = nn.Sequential(*layers)
    x, y = torch.randn(2, 16), torch.randn(2, 8)
    params = {t.untyped_storage().data_ptr() for t in seq.parameters()}
    with LayerRecorder(layers, torch.device("cpu"), exclude_storages=params) as rec:
        r = rec.run(lambda: ((seq(x) - y) ** 2).mean(), count_saved=True)
    assert r.output_bytes == [256, 256, 256, 256, 256, 64]
    assert r.output_saved_bytes == [0, 0, 256, 0, 0, 0]  # ReLU saves its result
    # the first Into's output only fed the ReLU (which saves its result) and died; the Linear saves the second's
    assert r.output_saved_later_bytes == [0, 0, 0, 0, 256, 0]


def test_progress_never_prints_a_nonzero_time_as_zero() -> None:
    """The progress lines printed ms with fixed decimals: a tiny model's forward of some 30 µs read "forward 0.0 ms", its
    optimizer step "step 0.02 ms". Under 1 ms they print 3 significant figures (format_ms), from 1 ms up as before. (No
    loop overhead: its fit is clamped at 0, which prints as the 0 it is.)"""
    import re

    lines: list[str] = []
    profile_module(MLP(), xy_batches(), micro_batch_sizes=[1, 2, 4], repeats=1, loop_overhead=False, progress=lines.append)
    said = [m for line in lines for m in re.findall(r"(-?[0-9.]+) ms\b", line)]
    assert any("forward" in line for line in lines) and any("] optimizer " in line for line in lines), lines
    assert said, lines
    for number in said:
        digits = number.lstrip("-0.").replace(".", "")
        assert float(number) != 0 and len(digits) >= 2, (number, lines)
