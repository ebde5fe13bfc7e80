"""How the router chooses among the replicas of one model (the cluster file's `routing:`).

    settings.py  the policy names, their settings (router-wide defaults, per-model overrides), checks
    keys.py      the routing key of a request: its whole prompt as one string
    prefix.py    PrefixIndex: an approximate index of the prompts sent to each replica (bounded, LRU)
    policies.py  cache_aware, shortest_queue, round_robin, prefix_affinity (the default: unchanged behaviour)
    balancer.py  ModelRouting: the core's Balancer, one policy per model

The core calls `Balancer.pick(candidates, key)` with the up replicas of one model; nothing else of the
core is visible here, and a policy keeps no reference to a request.
"""
