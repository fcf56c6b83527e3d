"""The step benchmark's workloads by name, importable without the models: the GPU check names them in its plan and
its first section, the kernel tests, runs on a machine whose Python has torch and Triton alone (no smp, no
albumentations, no jsonargparse), which ``mabn.tools.bench.step`` needs."""

MODELS = {"pspnet101": "PSPNet-101", "resnet101": "ResNet-101 (stage 1)", "resnet50": "ResNet-50"}
BF16 = "bf16-mixed"  # the one mixed precision the step bench runs (Lightning's name for it)
# The recipe's per-device batch is one ghost batch of 2: BRN and MABN normalize groups of this size.
NORM_BATCH_SIZE = 2
BASELINE = "bn"  # every ratio is to BN: torch's BatchNorm2d over each device's whole batch
