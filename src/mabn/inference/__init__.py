"""What a trained stage-2 checkpoint serves: reading it (``checkpoint``), scoring and configuring its data
(``stage2``), predictions (``predict``) and the folded TorchScript, torch.export and ONNX export (``export``)."""

# What ``export.export`` writes, in this order, unless told fewer: each is what another runtime reads. Here, beside
# no import, so that ``python -m mabn export --help`` lists them without loading the exporters.
FORMATS = ("torchscript", "pt2", "onnx")
