"""The commands around training that nothing else imports: ``bench`` (the cost of each norm), ``ablation`` (the
paper's ImageNet ablation at small scale) and ``plots`` (a run's curves and norm statistics)."""
