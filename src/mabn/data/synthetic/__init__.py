"""Generated data sets in the real on-disk layouts (ImageNet's folders, Cityscapes', a user's own), so that every
stage runs end to end on a machine without the real data."""
