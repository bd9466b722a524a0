"""Model builders (random weights, no downloads) and the small bundled models.

`python3 -m models.build --out DIR [--small]` exports every model; `models/small/` holds the
committed small versions and their manifest. Importing this package does not import torch.
"""
