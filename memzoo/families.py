"""The write-rule families of the memory layers, with no torch (the leaderboard's family column
and filter read them): a layer names its family by key (``MemoryLayer.family``)."""

FAMILIES = {
    "hebbian": "Hebbian outer product",                    # S += k vᵀ (linear attention, Ba)
    # S ← Diag(α_t) S + k vᵀ with a decay (chosen by the input in Mamba-2's SSD and GLA, fixed per head in
    # RetNet): the same write, but what is held fades, so recall at equal state reads differently from the
    # ungated sum's (a decayed memory forgets old pairs instead of piling up their crosstalk)
    "gated_hebbian": "gated Hebbian outer product",
    "delta": "delta rule",                                 # S += β k (v − Sᵀk)ᵀ and its gated / DPLR kin
    # a model fitted to the sequence by a regression loss: a small network trained by gradient steps (TTT, Titans,
    # LaCT, FwMLP, FWL), or a linear map solved to the loss's minimum (MesaNet): the label names both
    "regression": "regression loss: gradient steps or exact solve",
    # key-value rows a query scores: a few of many read and written (PKM, FwPKM: top-k of sparse rows) or all of a
    # few (GSA: m slots written through a forget gate, read by a softmax over them), so no longer "sparse slots"
    "slots": "slots",
}
