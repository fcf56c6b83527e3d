"""The paper's ImageNet ablation (Tables 2 and 6) at small scale: ``python -m mabn.ablation``.

``rows`` maps each table row to a norm preset and the paper's error, ``model`` is the small ResNet,
``train`` the one training loop every row runs, ``probes`` record the per-step statistics of one layer,
``runner`` runs (row, seed) pairs in parallel processes, ``report`` and ``figures`` write the outputs.
"""
