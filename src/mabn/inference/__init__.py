"""What a trained stage-2 checkpoint serves: reading it (``checkpoint``), scoring and configuring its data
(``stage2``), predictions (``predict``) and the folded TorchScript, torch.export and ONNX export (``export``)."""
