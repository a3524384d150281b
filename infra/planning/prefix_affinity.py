"""Prefix-cache hit rate when the balancer runs as several replicas, each with its own tree. Pure.

A cache-aware balancer (sglang-router's `cache_aware` policy; the endpoint picker's
prefix-cache scorer) remembers which worker served which prompt prefix and sends a request to
the worker holding the longest match. Replicas that do not share that memory each learn only
from the requests that reach them: behind a gateway that spreads requests over N replicas, a
conversation's next turn meets a replica that never saw its earlier turns about (N-1)/N of the
time and goes wherever that replica's fallback sends it, a worker that has none of its prefix.

sglang-router 0.3.2 exposes no way to share its tree (the wheel's router_args.py has no mesh or
HA option), so pdstack hashes each API key's requests to one router replica at the gateway
(Envoy Gateway consistent hashing on the client id header; a replica lost re-hashes only its
share). The endpoint picker elects a leader and so has one index (router_config.py). This model
measures the three arrangements on one synthetic multi-tenant chat workload; scripts/bench_balancer_replicas.py
prints the figures.

Model: prompts are chains of KV pages (a page's id hashes the chain up to it, as both the engine's
radix cache and the balancers' trees key prefixes); each worker caches pages with LRU eviction;
a balancer replica keeps a map page -> the worker it last sent that page to, and picks the
worker of the longest match when it covers more than `cache_threshold` of the prompt (the
router's --cache-threshold), else the worker whose tree (in this replica's view) is smallest
(sglang-router's cache_aware fallback). Load-balance overrides are left out: they apply equally
to every arrangement.
"""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

PAGE_TOKENS = 64


@dataclass(frozen=True)
class Workload:
    tenants: int = 24
    system_prompt_tokens: int = 2000
    turn_tokens: int = 350  # a user message and the answer that joins the history
    new_conversation_share: float = 0.25
    live_conversations_per_tenant: int = 40
    requests: int = 30000
    zipf: float = 1.1  # tenant popularity
    seed: int = 7


@dataclass
class Request:
    tenant: int
    pages: list[int]  # chain ids of the prompt's full pages


def requests(w: Workload):
    """The request stream: multi-turn conversations that re-send their history after a tenant's
    system prompt; a tenant's traffic follows a Zipf popularity."""
    rng = random.Random(w.seed)
    weights = [1 / (t + 1) ** w.zipf for t in range(w.tenants)]
    conversations: dict[int, list[list[int]]] = {t: [] for t in range(w.tenants)}
    next_id = 0

    def extend(chain: list[int], tokens: int) -> list[int]:
        nonlocal next_id
        out = list(chain)
        for _ in range(max(1, tokens // PAGE_TOKENS)):
            next_id += 1
            out.append(hash((out[-1] if out else 0, next_id)))
        return out

    systems = {t: extend([], w.system_prompt_tokens) for t in range(w.tenants)}
    for _ in range(w.requests):
        tenant = rng.choices(range(w.tenants), weights)[0]
        live = conversations[tenant]
        if not live or rng.random() < w.new_conversation_share:
            history = systems[tenant]
            if len(live) >= w.live_conversations_per_tenant:
                live.pop(rng.randrange(len(live)))
            live.append(history)
            index = len(live) - 1
        else:
            index = rng.randrange(len(live))
            history = live[index]
        prompt = extend(history, w.turn_tokens)
        live[index] = prompt
        yield Request(tenant, prompt)


@dataclass
class WorkerCache:
    capacity_pages: int
    pages: OrderedDict = field(default_factory=OrderedDict)

    def hit(self, chain: list[int]) -> int:
        """Pages of the prompt's prefix already cached; then the whole prompt is cached."""
        matched = 0
        for page in chain:
            if page not in self.pages:
                break
            matched += 1
        for page in chain:
            self.pages[page] = None
            self.pages.move_to_end(page)
        while len(self.pages) > self.capacity_pages:
            self.pages.popitem(last=False)
        return matched


@dataclass
class BalancerReplica:
    workers: int
    cache_threshold: float
    owner: dict = field(default_factory=dict)  # page -> worker it was last sent to
    sizes: list = field(default_factory=list)

    def __post_init__(self):
        self.sizes = [0] * self.workers

    def pick(self, chain: list[int]) -> int:
        best, matched = None, 0
        for page in chain:
            worker = self.owner.get(page)
            if worker is None:
                break
            best, matched = worker, matched + 1
        if best is None or matched / len(chain) <= self.cache_threshold:
            best = min(range(self.workers), key=lambda i: (self.sizes[i], i))
        for page in chain:
            if self.owner.get(page) != best:
                self.sizes[best] += 1
            self.owner[page] = best
        return best


@dataclass(frozen=True)
class Arrangement:
    name: str
    replicas: int
    spread: str  # "round_robin" or "hash_tenant"


def hit_rate(w: Workload, arrangement: Arrangement, workers: int = 8, capacity_pages: int = 6000,
             cache_threshold: float = 0.5) -> float:
    """Share of prompt pages served from the engines' prefix caches."""
    balancers = [BalancerReplica(workers, cache_threshold) for _ in range(arrangement.replicas)]
    caches = [WorkerCache(capacity_pages) for _ in range(workers)]
    hit = total = 0
    for n, req in enumerate(requests(w)):
        if arrangement.spread == "hash_tenant":
            replica = zlib.crc32(f"key-{req.tenant}".encode()) % arrangement.replicas  # the gateway's ring
        else:
            replica = n % arrangement.replicas
        worker = balancers[replica].pick(req.pages)
        hit += caches[worker].hit(req.pages)
        total += len(req.pages)
    return hit / total


ARRANGEMENTS = (
    Arrangement("one tree (1 replica, or an elected leader)", 1, "round_robin"),
    Arrangement("3 replicas, round robin", 3, "round_robin"),
    Arrangement("3 replicas, hashed by API key", 3, "hash_tenant"),
)
