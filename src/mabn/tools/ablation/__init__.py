"""The paper's ImageNet ablation (Tables 2 and 6) at small scale: ``python -m mabn ablation``.

``rows`` maps each table row to a norm preset and the paper's error (and makes the warm-start rows), ``shapes``
generates the default data set, ``model`` is the small ResNet, ``train`` the one training loop every row runs
(seeds paired across rows), ``probes`` record the per-step statistics of one layer, ``runner`` runs (row, seed)
pairs in parallel processes, ``stats`` holds the paired t-test, ``report``, ``figures`` and ``files`` write the
outputs.
"""
