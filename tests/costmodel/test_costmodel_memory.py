"""Per-device memory: DP, GPipe vs 1F1B in-flight activations, feasibility."""

from __future__ import annotations

import random

import pytest

from lightning_distplan.costmodel import MEMORY_KEYS, Hardware, in_flight_microbatches, predict
from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
from lightning_distplan.plan import Plan


def hw(memory: int = 16 << 30, **kw) -> Hardware:
    return Hardware(
        device_memory_bytes=memory, allreduce_latency_s=1e-4, allreduce_bandwidth_bytes_per_s=1e9,
        p2p_latency_s=1e-3, p2p_bandwidth_bytes_per_s=1e9, **kw,
    )


def profile(**kw):
    # params 1e6 per layer (4e6), grads = params, Adam state 2× params (8e6),
    # saved activations per sample [1, 2, 3, 4]e6 (whole step 10e6·m), fixed overhead 1e6
    layers = [
        LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=1_000_000, activation_bytes_per_sample=1e6),
        LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=1_000_000, activation_bytes_per_sample=2e6),
        LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=1_000_000, activation_bytes_per_sample=3e6),
        LayerSpec(fwd_alpha=0.03, bwd_alpha=0.06, param_bytes=1_000_000, activation_bytes_per_sample=4e6),
    ]
    return synthetic_profile(layers, fixed_overhead_bytes=1_000_000, **kw)


def test_dp_memory_one_microbatch_of_activations():
    plan = Plan(strategy="dp_ga", dp=2, micro_batch_size=2, accumulate_grad_batches=4, global_batch_size=16)
    pred = predict(profile(), plan, hw())
    # one gradient set, accumulated into (s = 4 as s = 1: measured so on an H100, each plan in a process of its own);
    # DDP's buckets are as large as the gradients
    assert pred.memory_breakdown == {"params": 4_000_000, "grads": 4_000_000, "optimizer": 8_000_000, "activations": 20_000_000,
                                     "ddp_buckets": 4_000_000, "overhead": 1_000_000}
    assert tuple(pred.memory_breakdown) == MEMORY_KEYS
    assert pred.peak_memory_bytes == 41_000_000
    one = predict(profile(), Plan(strategy="dp_ga", dp=2, micro_batch_size=2, accumulate_grad_batches=1, global_batch_size=4), hw())
    assert one.memory_breakdown == pred.memory_breakdown and one.peak_memory_bytes == 41_000_000


def test_gpipe_vs_1f1b_exact_counts():
    kw = dict(dp=1, pp=2, micro_batch_size=2, n_microbatches=4, global_batch_size=8, stage_boundaries=(3,))
    gpipe = predict(profile(), Plan(strategy="gpipe", **kw), hw())
    onef = predict(profile(), Plan(strategy="1f1b", **kw), hw())
    # stage 0 = layers 0..2: static 3/4·16e6 = 12e6, activations/micro-batch 2·(1+2+3)e6 = 12e6
    # stage 1 = layer 3:      static 1/4·16e6 = 4e6,  activations/micro-batch 2·4e6 = 8e6
    # GPipe keeps n = 4 on both stages; 1F1B keeps min(n, p−k) = 2 on stage 0 and 1 on stage 1
    assert gpipe.stage_memory_bytes == (12e6 + 4 * 12e6 + 1e6, 4e6 + 4 * 8e6 + 1e6)
    assert onef.stage_memory_bytes == (12e6 + 2 * 12e6 + 1e6, 4e6 + 1 * 8e6 + 1e6)
    assert gpipe.peak_memory_bytes == 61_000_000 and onef.peak_memory_bytes == 37_000_000
    assert onef.memory_breakdown == {"params": 3_000_000, "grads": 3_000_000, "optimizer": 6_000_000, "activations": 24_000_000, "ddp_buckets": 0, "overhead": 1_000_000}
    # where hand-overs cost nothing the two schedules differ in memory only (with a link over NCCL, 1F1B's
    # activations and gradients cross side by side, GPipe's one pass after the other)
    free = Hardware(device_memory_bytes=16 << 30, allreduce_latency_s=1e-4, allreduce_bandwidth_bytes_per_s=1e9, p2p_latency_s=0.0, p2p_bandwidth_bytes_per_s=1e9)
    gpipe_free, onef_free = (predict(profile(), Plan(strategy=s, **kw), free).step_time_s for s in ("gpipe", "1f1b"))
    assert gpipe_free == pytest.approx(onef_free, rel=1e-12)
    assert gpipe.step_time_s > onef.step_time_s


def test_in_flight_counts():
    assert [in_flight_microbatches("1f1b", 8, 4, k) for k in range(4)] == [4, 3, 2, 1]
    assert [in_flight_microbatches("1f1b", 2, 4, k) for k in range(4)] == [2, 2, 2, 1]
    assert [in_flight_microbatches("gpipe", 8, 4, k) for k in range(4)] == [8, 8, 8, 8]


def test_1f1b_never_needs_more_than_gpipe_random():
    rng = random.Random(1)
    for _ in range(40):
        layers = [
            LayerSpec(fwd_alpha=rng.uniform(0, 1), bwd_alpha=rng.uniform(0, 1), param_bytes=rng.randrange(0, 10**7), activation_bytes_per_sample=rng.uniform(0, 1e7))
            for _ in range(rng.randint(2, 8))
        ]
        prof = synthetic_profile(layers)
        p = rng.randint(2, len(layers))
        n = rng.randint(p, 12)
        kw = dict(dp=1, pp=p, micro_batch_size=rng.randint(1, 4), n_microbatches=n)
        kw["global_batch_size"] = kw["micro_batch_size"] * n
        g = predict(prof, Plan(strategy="gpipe", **kw), hw())
        o = predict(prof, Plan(strategy="1f1b", stage_boundaries=g.stage_boundaries, **kw), hw())
        assert all(x <= y for x, y in zip(o.stage_memory_bytes, g.stage_memory_bytes))
        assert o.peak_memory_bytes <= g.peak_memory_bytes


def test_feasibility_uses_the_margin_and_marks_infeasible():
    kw = dict(dp=1, pp=2, micro_batch_size=2, n_microbatches=4, global_batch_size=8)
    device = 50_000_000  # usable 0.9 × 50e6 = 45e6
    onef = predict(profile(), Plan(strategy="1f1b", **kw), hw(device))
    gpipe = predict(profile(), Plan(strategy="gpipe", **kw), hw(device))
    assert onef.feasible and onef.peak_memory_bytes == 37_000_000 and onef.stage_boundaries == (3,)
    assert "fits" in onef.reason
    # GPipe's 4 micro-batches fit no split: (3,) needs 61e6 on stage 0, (2,) 64e6+... on stage 1
    assert not gpipe.feasible
    assert "exceeds 90%" in gpipe.reason and "no split into 2 stages fits" in gpipe.reason
    dp = predict(profile(), Plan(strategy="dp_ga", micro_batch_size=2, accumulate_grad_batches=4, global_batch_size=8), hw(device, memory_margin=0.7))
    assert not dp.feasible  # 41e6 > 0.7 × 50e6


def test_memory_cap_steers_the_partition():
    # equal times, very unequal activations: the time-optimal split (2,) does not fit, (3,) does
    layers = [LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, activation_bytes_per_sample=a) for a in (1e6, 1e6, 8e6, 1e6)]
    prof = synthetic_profile(layers)
    plan = Plan(strategy="gpipe", dp=1, pp=2, micro_batch_size=1, n_microbatches=2, global_batch_size=2)
    assert predict(prof, plan, hw()).stage_boundaries == (2,)
    capped = predict(prof, plan, hw(int(20e6 / 0.9) + 1))  # usable just above 20e6: (2,) puts 2·9e6 = 18e6 on stage 1, fits
    assert capped.stage_boundaries == (2,)
    tight = predict(prof, plan, hw(int(17e6 / 0.9)))  # usable ~17e6: stage 1 of (2,) needs 18e6; (3,) needs 2·10e6 = 20e6 on stage 0
    assert not tight.feasible
    tighter_ok = synthetic_profile([LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, activation_bytes_per_sample=a) for a in (1e6, 1e6, 1e6, 8e6)])
    split = predict(tighter_ok, plan, hw(int(17e6 / 0.9)))
    # time-optimal (2,) puts 2·9e6 = 18e6 on stage 1 (too much); (3,) puts 6e6 | 16e6 and is chosen
    assert split.stage_boundaries == (3,) and split.feasible


def test_profiled_oom_micro_batch_is_infeasible_for_dp():
    prof = profile(infeasible_micro_batch_sizes=(8,))
    ok = predict(prof, Plan(strategy="dp_ga", micro_batch_size=4, accumulate_grad_batches=2, global_batch_size=8), hw())
    oom = predict(prof, Plan(strategy="dp_ga", micro_batch_size=8, accumulate_grad_batches=1, global_batch_size=8), hw())
    assert ok.feasible
    assert not oom.feasible and "ran out of memory while profiling" in oom.reason
    # on a device larger than the profiled one, the profiled OOM no longer binds; the model decides
    bigger = predict(prof, Plan(strategy="dp_ga", micro_batch_size=8, accumulate_grad_batches=1, global_batch_size=8), hw(32 << 30))
    assert bigger.feasible


def test_extrapolated_micro_batch_is_flagged():
    pred = predict(profile(), Plan(strategy="dp_ga", micro_batch_size=16, accumulate_grad_batches=1, global_batch_size=16), hw())
    assert pred.feasible and "extrapolated beyond the profiled sizes (up to 8)" in pred.reason


def test_receiving_stage_keeps_a_copy_of_the_boundary_activation():
    # Layer 2 outputs 0.5e6 bytes per sample. On one device that tensor is saved once; across a stage
    # boundary it lands in the receiving stage's receive buffer, which its first layer saves (measured in
    # tests/strategies/test_pipeline_math.py). torch's PipelineStage allocates one such buffer per
    # micro-batch and keeps them all, so the receiver holds n of them under 1F1B too.
    specs = [LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=1_000_000, activation_bytes_per_sample=a, output_bytes_per_sample=o)
             for a, o in ((1e6, 0.0), (2e6, 0.0), (3e6, 0.5e6), (4e6, 0.0))]
    prof = synthetic_profile(specs, fixed_overhead_bytes=1_000_000)
    kw = dict(dp=1, pp=2, micro_batch_size=2, n_microbatches=4, global_batch_size=8, stage_boundaries=(3,))
    gpipe = predict(prof, Plan(strategy="gpipe", **kw), hw())
    onef = predict(prof, Plan(strategy="1f1b", **kw), hw())
    # per micro-batch: stage 0 saves 2·(1+2+3)e6 = 12e6, stage 1 2·4e6 = 8e6; the boundary tensor is 2·0.5e6 = 1e6,
    # with n = 4 buffers of it on each side (stage 1's inputs, stage 0's gradients back)
    assert gpipe.stage_memory_bytes == (12e6 + 4 * 12e6 + 4 * 1e6 + 1e6, 4e6 + 4 * 8e6 + 4 * 1e6 + 1e6)
    assert onef.stage_memory_bytes == (12e6 + 2 * 12e6 + 4 * 1e6 + 1e6, 4e6 + 1 * 8e6 + 4 * 1e6 + 1e6)


def test_receive_buffers_are_held_per_micro_batch_under_both_schedules():
    # torch.distributed.pipelining's PipelineStage (_setup_forward_recv_info, _setup_backward_recv_info)
    # allocates, once and for good, one activation receive buffer per micro-batch on every stage but the
    # first and one gradient receive buffer per micro-batch on every stage but the last (2 gloo ranks,
    # Schedule1F1B, n = 8, Linear(64, 64), m = 4: stage 0 held 8 gradient buffers of 1 KiB, stage 1 8
    # activation buffers of 1 KiB). 1F1B's min(n, p − k) in-flight count bounds saved activations, not them.
    prof = synthetic_profile([LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, output_bytes_per_sample=1e6) for _ in range(2)])
    for strategy in ("gpipe", "1f1b"):
        plan = Plan(strategy=strategy, dp=1, pp=2, micro_batch_size=1, n_microbatches=8, global_batch_size=8, stage_boundaries=(1,))
        pred = predict(prof, plan, hw())
        assert pred.stage_memory_bytes == (8_000_000, 8_000_000), strategy
    # the split sees them too: a cap that holds the buffers of one cut but not of the other steers it
    specs = [LayerSpec(fwd_alpha=a, bwd_alpha=2 * a, output_bytes_per_sample=o) for a, o in ((0.1, 1e6), (0.1, 4e6), (0.2, 0.0))]
    prof = synthetic_profile(specs)
    plan = Plan(strategy="1f1b", dp=1, pp=2, micro_batch_size=1, n_microbatches=4, global_batch_size=4)
    assert predict(prof, plan, hw()).stage_boundaries == (2,)  # the balanced cut, 2:2 against 1:3
    capped = predict(prof, plan, hw(int(10e6 / 0.9)))  # usable 10e6: cut (2,) holds 4·4e6 per side, (1,) 4·1e6
    assert capped.stage_boundaries == (1,) and capped.feasible and capped.peak_memory_bytes == 4_000_000


def test_a_stage_keeps_its_unsaved_output_and_its_first_layers_saved_input_is_the_receive_buffer():
    # Measured on 2 gloo ranks (torch 2.14 PipelineStage, ScheduleGPipe / Schedule1F1B, m = 2, n = 4) for
    # [Linear(16, 32), ReLU, Linear(32, 48), LayerNorm(48), Linear(48, 8)] + ((out - y)**2).mean(): live unique
    # storages of the receive buffers, the gradient receive buffers, the saved tensors and the outputs the stage
    # caches until their backward (the input batch as its micro-batches in flight), per stage. A stage keeps its
    # output until that micro-batch's backward (fwd_cache), a copy where no layer of its own saved it; a first
    # layer that saves its input saves the receive buffer, no second copy. Profile per sample, from LayerRecorder.
    import dataclasses

    acts, outs = (64, 128, 0, 200, 224), (128, 128, 192, 192, 32)
    saved, later = (0, 128, 0, 0, 0), (0, 0, 192, 192, 0)
    specs = [LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, activation_bytes_per_sample=a, output_bytes_per_sample=o) for a, o in zip(acts, outs)]
    old = synthetic_profile(specs)
    new = dataclasses.replace(old, layers=tuple(
        dataclasses.replace(layer, output_saved_bytes_per_sample=s, output_saved_later_bytes_per_sample=t)
        for layer, s, t in zip(old.layers, saved, later)))
    measured = {  # (cut, schedule): bytes per stage
        (2, "gpipe"): (2560, 4672), (2, "1f1b"): (1792, 1936),  # stage 1 starts with a Linear whose input the ReLU saved
        (3, "gpipe"): (4608, 3648), (3, "1f1b"): (3072, 2064),  # ... with a LayerNorm saving an input nobody saved before
        (1, "gpipe"): (2560, 5696), (1, "1f1b"): (1792, 2192),  # ... with a ReLU (saves its output, not its input)
    }
    before = {(3, "gpipe"): (3072, 4928), (3, "1f1b"): (2304, 2384)}  # the cut before the LayerNorm, counts missing
    for (cut, strategy), want in measured.items():
        plan = Plan(strategy=strategy, dp=1, pp=2, micro_batch_size=2, n_microbatches=4, global_batch_size=8, stage_boundaries=(cut,))
        assert predict(new, plan, hw()).stage_memory_bytes == want, (cut, strategy)
        if (cut, strategy) in before:  # older profiles: read as before
            assert predict(old, plan, hw()).stage_memory_bytes == before[cut, strategy]
    # the split prices stages the same way: under a 4650-byte cap the older reading keeps the cut (2,) (2560 | 4416),
    # the counts move it to (3,) (4608 | 3648), as (2,) holds 4672 on stage 1
    from lightning_distplan.costmodel._partition import partition_pipeline

    kw = dict(static_memory=[0.0] * 5, activation_memory=[2.0 * a for a in acts], cut_times=[0.0] * 5, cut_memory=[2.0 * o for o in outs],
              in_flight=[4, 4], receive_buffers=4)
    assert partition_pipeline([1.0] * 5, 2, memory_cap=4650.0, **kw) == (2,)
    counted = dict(output_kept=[2.0 * (o - s) for o, s in zip(outs, saved)], received_saved=[2.0 * t for t in later])
    assert partition_pipeline([1.0] * 5, 2, memory_cap=4650.0, **kw, **counted) == (3,)


def test_a_frozen_stage_holds_no_gradients_or_optimizer_state():
    """Fine-tuning with a frozen backbone: gradients, optimizer state, the optimizer step and the dp all-reduce
    follow the trainable bytes of each stage, not its share of all parameters (a reviewer's Adam run: the
    frozen stage was charged 2.6 MB it never holds, the trainable one 2.5 MB too little)."""
    import dataclasses

    base = profile(grad_bytes=2_000_000, optimizer_state_bytes=4_000_000, optimizer_step_time_s=0.01)
    layers = tuple(dataclasses.replace(layer, trainable_param_bytes=0 if i < 2 else layer.param_bytes) for i, layer in enumerate(base.layers))
    frozen = dataclasses.replace(base, layers=layers)
    plan = Plan(strategy="gpipe", dp=2, pp=2, micro_batch_size=2, n_microbatches=4, global_batch_size=16, stage_boundaries=(2,))
    pred = predict(frozen, plan, hw())
    # stage 0: its params 2e6, no grads or Adam state, 4 in-flight micro-batches of (1e6 + 2e6)·2 activations, overhead 1e6
    # stage 1: params 2e6 + every gradient 2e6 + all Adam state 4e6, 4 × (3e6 + 4e6)·2 activations, overhead 1e6
    assert pred.stage_memory_bytes == (2e6 + 24e6 + 1e6, 2e6 + 2e6 + 4e6 + 56e6 + 1e6)
    assert pred.memory_breakdown["grads"] == 2_000_000 and pred.memory_breakdown["optimizer"] == 4_000_000
    assert pred.breakdown["optimizer"] == pytest.approx(0.01)  # stage 1 steps every trainable parameter
    full = predict(base, plan, hw())  # the same model all trainable: the step is split over both stages
    assert full.breakdown["optimizer"] == pytest.approx(0.005)
    assert full.breakdown["exposed_comm"] > 0 and pred.breakdown["exposed_comm"] > full.breakdown["exposed_comm"]


def test_a_plan_no_split_of_which_fits_still_says_so():
    """Where no split into pp stages fits in memory, the automatic split's reason says so, and stays the programme's:
    four layers of 100 MiB on a 300 MiB device, GPipe at n = 1. The search over every split's step time took the
    fastest infeasible split, priced without the note, so the plan read as if another split might fit."""
    layers = [LayerSpec(fwd_alpha=1e-3, bwd_alpha=2e-3, param_bytes=100 << 20, activation_bytes_per_sample=1e6, output_bytes_per_sample=out)
              for out in (1e3, 1e8, 1e3, 1e3)]
    device = Hardware(device_memory_bytes=300 << 20, allreduce_latency_s=5e-5, allreduce_bandwidth_bytes_per_s=1e9,
                      p2p_latency_s=5e-5, p2p_bandwidth_bytes_per_s=1e9)
    pred = predict(synthetic_profile(layers), Plan(strategy="gpipe", dp=1, pp=2, micro_batch_size=1, n_microbatches=1, global_batch_size=1), device)
    assert not pred.feasible
    assert "exceeds 90%" in pred.reason and "no split into 2 stages fits every stage in memory" in pred.reason
