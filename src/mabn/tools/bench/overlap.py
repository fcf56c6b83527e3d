"""DDP's gradient all-reduce against a graphed backward: the buckets of PSPNet-101's gradients, and the all-reduce
time a step leaves exposed when the backward is one graph, one graph per ResNet stage and the head, or one per
bottleneck block (about what an eager backward overlaps).

A model, not a measurement: DDP's buckets as its reducer builds them after the first iteration (consecutive in the
order the gradients become ready; the first closes at 1 MiB, every later one at 25 MiB, the limits of the default
``bucket_cap_mb``), each launched when the segment holding its last gradient has run its backward, one at a time
on one communication stream, as a ring all-reduce of 2 (n - 1) / n x its bytes at a bus bandwidth. Each segment's
backward takes the step's backward time in proportion to its forward FLOPs (torch's FlopCounterMode, on the meta
device: nothing is allocated). ``python -c "from mabn.tools.bench import overlap; overlap.main()"`` prints the
tables docs/scaling.md quotes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

MiB = 1024**2
FIRST_BUCKET_BYTES = 1 * MiB  # DDP's first bucket under the default bucket_cap_mb (torch's _DEFAULT_FIRST_BUCKET_BYTES)
BUCKET_BYTES = 25 * MiB  # DDP's default bucket_cap_mb, 25 MiB

# Stage 2 at 2 nodes x 8 GPUs: the step of one H200 (docs/results.md, PSPNet-101, batch 2, crop 713, CUDA graphs).
STEP_S = 0.113
BACKWARD_SHARE = 2 / 3  # a conv's backward computes the input's and the weight's gradients: twice its forward
WORLD = 16
# Bus bandwidths of a ring all-reduce between nodes, GB/s: one 400 Gb/s link per GPU (NCCL reaches about 45), and
# one 100 Gb/s link per node (12.5).
BANDWIDTHS = {"400 Gb/s per GPU": 45.0, "100 Gb/s per node": 12.5}


def buckets(sizes: Sequence[int], first: int = FIRST_BUCKET_BYTES, cap: int = BUCKET_BYTES) -> list[list[int]]:
    """The indices of gradients of ``sizes`` bytes, given in the order they become ready, grouped into DDP's buckets
    (one dtype on one device): consecutive, a bucket closing once it holds at least its limit, ``first`` for the
    first bucket and ``cap`` for every later one; the last bucket holds what is left."""
    out: list[list[int]] = [[]]
    held = 0
    for i, size in enumerate(sizes):
        out[-1].append(i)
        held += size
        if held >= (first if len(out) == 1 else cap):
            out.append([])
            held = 0
    return [b for b in out if b]


@dataclass(frozen=True)
class Segment:
    """One graph of a segmented capture: its name and the modules it runs (paths in the model)."""

    name: str
    modules: tuple[str, ...]


def pspnet_segments(model: nn.Module, how: str) -> list[Segment]:
    """PSPNet's segments in forward order: ``whole`` (one graph), ``stages`` (the stem with layer1, layer2,
    layer3, layer4 and the heads), ``layer3x4`` (the stages with layer3's blocks in 4 graphs: its backward and its
    gradients are the largest) or ``blocks`` (the stem, each bottleneck block, the heads)."""
    stem = Segment("stem", ("encoder.conv1", "encoder.bn1"))
    heads = Segment("heads", ("ppm", "classifier", "aux"))
    layers = [f"encoder.layer{i}" for i in range(1, 5)]

    def blocks(path: str, parts: int | None = None) -> list[Segment]:
        """``path``'s blocks in ``parts`` graphs of consecutive blocks (None: one graph each)."""
        n = len(model.get_submodule(path))
        cuts = [round(n * k / (parts or n)) for k in range((parts or n) + 1)]
        name = path.split(".")[-1]
        return [
            Segment(f"{name}.{a}" + (f"-{b - 1}" if b - a > 1 else ""), tuple(f"{path}.{i}" for i in range(a, b)))
            for a, b in zip(cuts, cuts[1:])
        ]

    if how == "whole":
        return [Segment("whole", (*stem.modules, *layers, *heads.modules))]
    stages = [
        Segment("stem+layer1", (*stem.modules, layers[0])),
        *(Segment(p.split(".")[-1], (p,)) for p in layers[1:]),
    ]
    if how == "stages":
        return [*stages, heads]
    if how == "layer3x4":
        return [*stages[:2], *blocks(layers[2], 4), stages[3], heads]
    if how == "blocks":
        return [stem, *(b for path in layers for b in blocks(path)), heads]
    raise ValueError(f"segments {how!r}: {', '.join(SEGMENTINGS)}")


SEGMENTINGS = ("whole", "stages", "layer3x4", "blocks")


def forward_flops(model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
    """FLOPs of ``model``'s training forward of ``sample`` per module path ("" the whole model), counted by torch's
    FlopCounterMode (convolutions and matrix products)."""
    counter = torch.utils.flop_counter.FlopCounterMode(display=False)
    model.train()
    with counter:
        model(sample)
    root = type(model).__name__
    return {
        ("" if name in ("Global", root) else name.removeprefix(root + ".")): sum(ops.values())
        for name, ops in counter.get_flop_counts().items()
    }


@dataclass(frozen=True)
class Bucket:
    names: tuple[str, ...]  # its gradients' parameters, in the order they become ready
    bytes: int
    segment: str  # the segment holding its last gradient
    ready_s: float  # when that segment ends its backward, from the backward's start


def timeline(model: nn.Module, segments: list[Segment], seconds: Sequence[float], first: int, cap: int) -> list[Bucket]:
    """DDP's buckets of ``model``'s gradients under a backward that runs ``segments`` in reverse, segment k's taking
    ``seconds[k]``: each parameter's gradient is ready when its segment's backward ends, the parameters of one
    segment in reverse order of registration (autograd's order for one layer after another)."""
    of: dict[str, int] = {}
    for k, segment in enumerate(segments):
        for path in segment.modules:
            for name, _ in model.get_submodule(path).named_parameters(prefix=path):
                of[name] = k
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, _ in params if name not in of]
    if missing:
        raise ValueError(f"parameters in no segment: {', '.join(missing[:5])}")
    order = sorted(range(len(params)), key=lambda i: (-of[params[i][0]], -i))  # the last segment's backward first
    end, t = {}, 0.0
    for k in reversed(range(len(segments))):
        t += seconds[k]
        end[k] = t
    sizes = [params[i][1].numel() * params[i][1].element_size() for i in order]
    result = []
    for bucket in buckets(sizes, first, cap):
        names = tuple(params[order[j]][0] for j in bucket)
        last = of[names[-1]]
        result.append(Bucket(names, sum(sizes[j] for j in bucket), segments[last].name, end[last]))
    return result


def allreduce_s(nbytes: int, world: int, bus_gbs: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``world`` devices: each sends and receives 2 (world - 1) / world of it."""
    return 2 * (world - 1) / world * nbytes / (bus_gbs * 1e9)


def exposed_s(bucket_list: Sequence[Bucket], backward_s: float, world: int, bus_gbs: float) -> float:
    """The all-reduce time left after a backward of ``backward_s``: the buckets one after another in their order,
    each from when it is ready or the one before it ends."""
    done = 0.0
    for bucket in bucket_list:
        done = max(done, bucket.ready_s) + allreduce_s(bucket.bytes, world, bus_gbs)
    return max(0.0, done - backward_s)


@dataclass(frozen=True)
class Plan:
    """The exposed all-reduce of each segmenting, and the buckets of each, for PSPNet-101 at the recipe's shapes."""

    params: int
    step_s: float
    backward_s: float
    buckets: dict[str, list[Bucket]]
    segments: dict[str, list[Segment]]
    seconds: dict[str, list[float]]  # segmenting -> each segment's backward, in forward order
    exposed: dict[str, dict[str, float]]  # segmenting -> bandwidth label -> seconds


def pspnet101_plan(
    step_s: float = STEP_S,
    world: int = WORLD,
    bandwidths: dict[str, float] = BANDWIDTHS,
    crop: int = 713,
    batch: int = 2,
    arch: str = "resnet101",
) -> Plan:
    """The recipe's PSPNet (encoder ``arch``) with MABN (parameters) and its BN twin (FLOPs: the norms compute none
    that the counter counts), on the meta device, at ``batch`` crops of ``crop``."""
    from ...models.pspnet import PSPNet

    with torch.device("meta"):
        model, twin = PSPNet(norm="mabn", arch=arch), PSPNet(norm="bn", arch=arch)
        flops = forward_flops(twin, torch.empty(batch, 3, crop, crop))
    backward_s = step_s * BACKWARD_SHARE
    plan = Plan(sum(p.numel() for p in model.parameters() if p.requires_grad), step_s, backward_s, {}, {}, {}, {})
    for how in SEGMENTINGS:
        segments = pspnet_segments(model, how)
        per = [sum(flops.get(path, 0) for path in s.modules) for s in segments]
        if sum(per) != flops[""]:  # a module in no segment: its backward would be left out of the timeline
            raise ValueError(f"segments {how!r} count {sum(per):,} of the forward's {flops['']:,} FLOPs")
        seconds = [backward_s * f / sum(per) for f in per]
        bucket_list = timeline(model, segments, seconds, FIRST_BUCKET_BYTES, BUCKET_BYTES)
        plan.segments[how], plan.buckets[how], plan.seconds[how] = segments, bucket_list, seconds
        plan.exposed[how] = {label: exposed_s(bucket_list, backward_s, world, bw) for label, bw in bandwidths.items()}
    return plan


def report(plan: Plan, world: int = WORLD, bandwidths: dict[str, float] = BANDWIDTHS) -> str:
    """The bucket table under the stage segmenting and the exposed all-reduce of each segmenting, in markdown."""
    total = sum(b.bytes for b in plan.buckets["whole"])
    lines = [
        f"PSPNet-101 (mabn): {plan.params:,} trainable parameters, {total / 1e6:.0f} MB of float32 gradients; "
        f"backward {plan.backward_s * 1e3:.0f} ms of a {plan.step_s * 1e3:.0f} ms step; {world} devices",
        "",
        "stages' backward, in the order it runs them: "
        + ", ".join(
            f"{s.name} {t * 1e3:.1f} ms"
            for s, t in reversed(list(zip(plan.segments["stages"], plan.seconds["stages"], strict=True)))
        ),
        "",
        "| bucket | MB | first and last parameter | ready after (stages) | ms into the backward |",
        "|---:|---:|---|---|---:|",
    ]
    for i, b in enumerate(plan.buckets["stages"]):
        lines.append(
            f"| {i} | {b.bytes / 1e6:.1f} | {b.names[0]} .. {b.names[-1]} | {b.segment} | {b.ready_s * 1e3:.1f} |"
        )
    lines += ["", "| capture | graphs | buckets | " + " | ".join(f"exposed, {label}" for label in bandwidths) + " |"]
    lines.append("|---|---:|---:|" + "---:|" * len(bandwidths))
    for how, by_bw in plan.exposed.items():
        cells = " | ".join(f"{s * 1e3:.1f} ms ({s / plan.step_s:.0%})" for s in by_bw.values())
        lines.append(f"| {how} | {len(plan.segments[how])} | {len(plan.buckets[how])} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    print(report(pspnet101_plan()))
