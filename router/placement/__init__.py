"""How requests are placed over more than one worker, and the worker links that takes.

    base.py        PlacementStrategy (what the router core calls), RouterHandle (what a strategy may
                   use of the core), Placement
    strategies.py  the strategies a router runs, from its configuration
    pd.py          prefill/decode placement: KV pairs, a (prefill, decode) choice per request
    offload.py     remote attention: senders paired with executors (the cluster file's `offload:`)
    adrenaline.py  which disaggregated requests keep their KV on the prefill worker's executor
    pairing.py     one offload pairing; steer.py its policy's decisions on events; metrics.py as series
    planning/      the offload policies (fixed, adrenaline, adaptive): a share from a `PairView`
"""
