"""Prefix-affinity routing for minillm.serving.cluster: a Ray Serve RequestRouter (imported by path,
so it lives in a module of its own that needs Ray).

A request goes first to the replica that rendezvous hashing assigns to its first PREFIX_TOKENS
prompt tokens: a chat's next turn, and every chat that shares a system prompt, meet the replica
whose prefix cache holds that start. When that replica has no free slot, Ray takes the least
loaded of the others (the second rank of choose_replicas). Adding or removing a replica moves
only the prefixes it gains or loses.
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import RequestRouter

PREFIX_TOKENS = 64  # the prompt tokens that pick a replica: two prefix-cache blocks




def prefix_key(prompt) -> bytes:
    """What routes a request: a digest of its first PREFIX_TOKENS token ids (the same in every
    process, unlike Python's salted string hash)."""
    head = ",".join(str(int(t)) for t in list(prompt)[:PREFIX_TOKENS])
    return hashlib.blake2b(head.encode(), digest_size=16).digest()


def preferred_replica(key: bytes, replica_ids: list[str]) -> str:
    """Rendezvous hashing: the replica with the highest weight for this key."""
    return max(replica_ids, key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest())


class PrefixAffinityRouter(RequestRouter):
    """The replica whose prefix cache most likely holds the prompt's start first; then the others,
    of which Ray picks the least loaded one with a free slot."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        prompt = _prompt_of(pending_request)
        if prompt is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        best = preferred_replica(prefix_key(prompt), sorted(by_id))
        # for the ingress's /metrics: the spec is the caller's own dict (the router runs in its
        # process, with its own copy of this module, so module state would not be shared)
        pending_request.args[0]["preferred_replica"] = best
        # when neither rank has a free slot, Ray waits before asking again; otherwise its routing
        # loop asks again at once, forever, and starves the event loop that would free a slot
        pending_request.routing_context.should_backoff = True
        return [[by_id[best]], [r for r in candidate_replicas if r.replica_id.unique_id != best]]


def _prompt_of(pending_request):
    """The prompt ids of an EngineReplica.generate call (its spec), None for other calls."""
    if pending_request is None or not pending_request.args:
        return None
    spec = pending_request.args[0]
    return spec.get("prompt") if isinstance(spec, dict) else None
