"""The load test of `kvmem serve` (`kvmem eval --suite serve`): the workload and server harness (`harness`, shared with
the batching benchmark), the phases (`runner`) and the report (`report`)."""

PHASE_LABELS = {"store_on": "store on", "store_off": "store off", "soak": "soak (Redis only, restarted)",
                "cluster_soak": "soak (Redis Cluster, a node restarted)"}
NOT_LOAD = ("replicas", "batching", "cluster_replicas")  # phases with their own sections, no clients looping
