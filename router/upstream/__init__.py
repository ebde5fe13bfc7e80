"""`url:` workers: servers the router did not start and reaches over HTTP (an upstream SGLang server, or
any OpenAI-compatible one), served as plain replicas of a model.

    spec.py     the cluster file's `url:` / `upstream:` settings of such a worker, checked
    openai.py   a worker request as an OpenAI request, and the upstream's SSE stream as worker outputs
    link.py     UpstreamLink: one upstream as a worker of the core (health checks, requests, aborts)
    pool.py     Upstreams: the links of a cluster, started and stopped with the router

A link speaks the worker protocol with the core in process (the same msgspec messages a worker sends over
ZeroMQ), so placement, accounting, metrics, aborts and failures treat it as any other worker.
"""
