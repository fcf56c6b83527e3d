"""The all-reduce model of docs/scaling.md (``mabn.tools.bench.overlap``): DDP's buckets held to DDP's own, the
timeline to hand-computed cases, and the docs' tables to the command written beside them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from mabn.tools.bench import overlap

MiB = 1024**2
DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_buckets_close_at_the_first_limit_then_at_the_cap():
    sizes = [1, MiB - 1, 1, 25 * MiB - 2, 1, 5]
    assert overlap.buckets(sizes) == [[0, 1], [2, 3, 4], [5]]


def test_buckets_are_the_ones_ddp_builds(tmp_path):
    """DDP's reducer with its default bucket_cap_mb, after the first iteration (when it rebuilds its buckets in the
    order the gradients became ready): each bucket a comm hook sees is one ``buckets`` makes of that order."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        # 4 MiB weights: a first bucket of at least 1 MiB, a 25 MiB one, and the rest.
        model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(10)))
        ready: list[nn.Parameter] = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(ready.append)
        ddp = nn.parallel.DistributedDataParallel(model)
        seen: list[list[int]] = []

        def record(state, bucket):
            seen.append([id(p) for p in bucket.parameters()])
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, record)
        for _ in range(2):
            ready.clear()
            seen.clear()
            ddp(torch.randn(2, 1024)).sum().backward()
    finally:
        dist.destroy_process_group()
    expected = overlap.buckets([p.numel() * p.element_size() for p in ready])
    assert len(expected) == 3
    assert sorted(seen) == sorted([id(ready[i]) for i in bucket] for bucket in expected)


def test_exposed_runs_the_buckets_one_after_another():
    """World 2: a ring all-reduce moves the bucket's bytes once; at 1 GB/s, 1 ms per MB."""
    b = [
        overlap.Bucket(("a",), 5_000_000, "s1", 0.010),  # 10 to 15 ms
        overlap.Bucket(("b",), 2_000_000, "s1", 0.012),  # waits for the first: 15 to 17 ms
        overlap.Bucket(("c",), 1_000_000, "s2", 0.020),  # 20 to 21 ms
    ]
    assert overlap.exposed_s(b, 0.020, world=2, bus_gbs=1.0) == pytest.approx(0.001)
    assert overlap.exposed_s(b[:2], 0.020, world=2, bus_gbs=1.0) == 0.0
    # 16 devices: 2 x 15 / 16 of the bytes.
    assert overlap.exposed_s(b[2:], 0.020, world=16, bus_gbs=1.0) == pytest.approx(1.875e-3)


def test_timeline_readies_each_bucket_when_its_last_gradients_segment_ends():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))  # 64 + 16 bytes, then 32 + 8
    segments = [overlap.Segment("a", ("0",)), overlap.Segment("b", ("1",))]
    buckets = overlap.timeline(model, segments, [0.3, 0.1], first=40, cap=100)
    assert [(b.names, b.bytes, b.segment) for b in buckets] == [
        (("1.bias", "1.weight"), 40, "b"),
        (("0.bias", "0.weight"), 80, "a"),
    ]
    assert [b.ready_s for b in buckets] == pytest.approx([0.1, 0.4])  # b's backward runs first
    with pytest.raises(ValueError, match="parameters in no segment: 1.weight, 1.bias"):
        overlap.timeline(model, segments[:1], [0.3], first=40, cap=100)


@pytest.fixture(scope="module")
def plan() -> overlap.Plan:
    return overlap.pspnet101_plan()


def test_pspnet101_whole_graph_exposes_the_whole_all_reduce(plan):
    total = sum(b.bytes for b in plan.buckets["whole"])
    assert total == 4 * plan.params
    for label, bus in overlap.BANDWIDTHS.items():
        assert plan.exposed["whole"][label] == pytest.approx(2 * 15 / 16 * total / (bus * 1e9))
        # Finer graphs leave less exposed, never more.
        ms = [plan.exposed[how][label] for how in overlap.SEGMENTINGS]
        assert all(finer <= coarser + 1e-12 for coarser, finer in zip(ms, ms[1:])) and ms[-1] < ms[0] / 4
    # One order of gradients for every segmenting: the same buckets, ready at other times.
    assert {tuple(b.names for b in bs) for bs in plan.buckets.values()} == {
        tuple(b.names for b in plan.buckets["whole"])
    }
    assert [len(s) for s in plan.segments.values()] == [1, 5, 8, 35]


def test_the_docs_tables_are_the_reports(plan):
    text = (DOCS / "scaling.md").read_text()
    lines = [line for line in overlap.report(plan).splitlines() if line]
    assert [line for line in lines if line not in text] == []
