"""The load test of `kvmem serve` (`kvmem eval --suite serve`): the workload and server harness (`harness`, shared with
the batching benchmark), the phases (`runner`) and the report (`report`)."""

PHASE_LABELS = {"store_on": "store on", "store_off": "store off", "soak": "soak (Redis only, restarted)",
                "cluster_soak": "soak (Redis Cluster, a node restarted)"}
NOT_LOAD = ("replicas", "batching", "cluster_replicas")  # phases with their own sections, no clients looping


# the cluster soak's answers against its reference (a server without a store): used by the report and its plots
def reference_texts(phase: dict) -> dict[str, str]:
    """question -> the reference answer (the cluster soak's server without a store; ok answers only)."""
    return {r["question"]: r["text"] for r in phase.get("reference", {}).get("requests", []) if r["status"] == "ok"}


def wrong_answers(phase: dict) -> tuple[list[dict], int]:
    """(the ok requests, warm-up included, whose answer differs from the reference answer to their question, how
    many ok requests had a reference to compare with)."""
    ref = reference_texts(phase)
    checked = [r for r in phase["requests"] if r["status"] == "ok" and r["question"] in ref]
    return [r for r in checked if r["text"] != ref[r["question"]]], len(checked)
