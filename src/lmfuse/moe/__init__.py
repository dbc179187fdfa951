"""Mixture-of-experts MLP: routed tokens through each expert's gate/up projection, the
(router-weighted) activation and the down projection, forward and backward."""
