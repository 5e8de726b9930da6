"""The building blocks that layers, ops and the backbone share, each written once (fla's
``fla/modules`` is the model): the RMSNorm (:mod:`.norm`), the short causal convolution
(:mod:`.conv`), the decay gates' inits (:mod:`.gates`) and the fast weights' precision
(:mod:`.precision`). Nothing here imports a layer, the backbone or the bench."""
