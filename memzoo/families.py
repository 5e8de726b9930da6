"""The write-rule families of the memory layers, with no torch (the leaderboard's family column
and filter read them): a layer names its family by key (``MemoryLayer.family``)."""

FAMILIES = {
    "hebbian": "Hebbian outer product",                    # S += k vᵀ (linear attention, Ba)
    "delta": "delta rule",                                 # S += β k (v − Sᵀk)ᵀ and its gated / DPLR kin
    "regression": "gradient steps on a regression loss",   # a small network trained on the sequence
    "slots": "sparse slots",                               # a few of many key-value rows read and written
}
