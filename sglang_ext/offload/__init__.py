"""Remote attention: a share of a model's decode attention and KV runs on another worker's memory.

    sender (model A's worker)                      executor (hosted by model B's worker, or in-process)
    decode step: q, k, v of every row             ForeignKVPartition: A's pages carved from a byte budget
      local rows  -> local backend                AttentionExecutor: plan(step) once, attend(layer) per layer
      remote rows -> RemoteAttention.attend  ───>   writes the new k, v, attends over A's KV there
      outputs scattered back by row          <───   o

The feature reads across six folders (this package, transport/, engine/split_* and sm_partition,
scheduler/remote_residency.py, worker/remote_control.py and adrenaline.py, router/placement/): the map of
every file, grouped by data plane, control plane, scheduler and router, is at the top of
docs/remote_attention.md ("Where the code is").
"""
