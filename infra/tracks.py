"""Release tracks: several revisions serving side by side, each in its own namespace, with
the gateway splitting traffic between them by weight. Pure.

A rollout adds the new revision as a track with weight 0, moves weight to it stage by
stage, and keeps the previous one as a warm standby; a rollback moves the weight back.
The Pulumi program reads the tracks from the environment's release store (state.json
`tracks`, written by the rollout and the rollback before each change):

    {"7": 95, "8": 5}

and each revision's spec from its release record. Before the first rollout the program
deploys the stack's spec directly in the environment's namespace (one track, no split).

Capacity is shared, not doubled: a track may grow to the pool's maximum minus what the
other tracks hold at their minimum, and a track joining beside others starts at its
minimum. So the node pools' limits and the NVLink domains are never exceeded during a
canary; the spec checks run on every track's share and say when a canary cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from infra.spec import NAMESPACE_MAX, SpecError, StackSpec
from infra.spec_checks import parse_spec

WHERE = "release store tracks"  # how messages name what plan_tracks was given


@dataclass(frozen=True)
class Track:
    revision: int
    weight: int
    spec: StackSpec  # the revision's spec as this track deploys it (own namespace, own share)

    @property
    def namespace(self) -> str:
        return self.spec.environment.namespace


def track_namespace(namespace: str, revision: int) -> str:
    return f"{namespace}-r{revision}"


# A revision has at most the digits the spec leaves room for after '-r' (NAMESPACE_MAX: -r9999).
REVISION_DIGITS = 63 - NAMESPACE_MAX - len("-r")
# What a Kubernetes namespace (a DNS label) may hold besides digits.
_LABEL_NON_DIGITS = "-abcdefghijklmnopqrstuvwxyz"


def namespace_globs(namespace: str) -> tuple[list[str], list[str]]:
    """Glob patterns (`*` any run, `?` one character: all IAM's StringLike knows) that together
    match the environment's namespace and its release tracks' `<namespace>-r<revision>` and no
    other namespace: a name is one of them when it matches a pattern of the first list and none
    of the second. A `<namespace>-r*` alone would admit `<namespace>-research`; IAM has no
    character classes, so the revision's digits are what is left once every other character a
    namespace may hold is excluded, at most REVISION_DIGITS of them, no leading zero."""
    like = [namespace] + [f"{namespace}-r{'?' * n}" for n in range(1, REVISION_DIGITS + 1)]
    not_like = [f"{namespace}-r0*"] + [f"{namespace}-r*{c}*" for c in _LABEL_NON_DIGITS]
    return like, not_like


def serving_revision(traffic: dict[int, int]) -> int | None:
    """The revision that takes the most of `traffic` (revision -> percent), None if none does."""
    return max(traffic, key=traffic.get) if traffic else None


# What RE2 (Prometheus's regex matchers) reads as other than itself outside a character class.
_RE2_SPECIAL = frozenset("\\.+*?()|[]{}^$")


def promql_regex_literal(text: str) -> str:
    """`text` matched as itself inside a PromQL `=~"..."` string: RE2's special characters
    escaped, then the backslashes and quotes the string itself reads (PromQL strings take Go's
    escapes: prometheus/promql/parser lex.go). A DNS label comes out as it went in."""
    regex = "".join("\\" + c if c in _RE2_SPECIAL else c for c in text)
    return regex.replace("\\", "\\\\").replace('"', '\\"')


def namespaces_matcher(namespace: str, revision: int | None = None) -> str:
    """PromQL matcher for an environment's series, wherever they serve from: its namespace
    (no tracks) or its release tracks' namespaces (one revision's, or all)."""
    track = f"-r{revision}" if revision is not None else "-r[0-9]+"
    return f'namespace=~"{promql_regex_literal(namespace)}({track})?"'


def splits_traffic_by_weight(spec: StackSpec) -> bool:
    """Whether revisions can share traffic by weight. Not behind InferencePools: Envoy AI Gateway
    v1.1.0's extension server accepts one InferencePool per route rule (envoyproxy/ai-gateway,
    internal/extensionserver/post_route_modify.go)."""
    return spec.deployment.load_balancer.implementation != "gateway_epp"


def _parse(revision: int, data: dict) -> StackSpec:
    try:
        return parse_spec(data)
    except SpecError as exc:
        raise SpecError([f"{WHERE}: revision {revision}: {p}" for p in exc.problems]) from None


def plan_tracks(entries: list[tuple[int, int, dict]]) -> list[Track]:
    """(revision, weight, spec data) of every track -> the tracks to deploy, or SpecError."""
    if not entries:
        raise SpecError([f"{WHERE}: empty. Fix: at least one revision with weight 100"])
    weights = [w for _, w, _ in entries]
    # All at 0: an environment's first revision, deployed before anything serves (the route is
    # made, with the weights, only when traffic first moves: infra/rollout/pulumi_cluster.py).
    if sum(weights) not in (0, 100) or min(weights) < 0:
        raise SpecError([f"{WHERE}: weights {weights} must be 0..100 and add up to 100 (or all be 0 before "
                         "anything serves)"])
    revisions = [r for r, _, _ in entries]
    if len(set(revisions)) != len(revisions):
        raise SpecError([f"{WHERE}: revision listed twice in {revisions}"])
    if max(revisions) >= 10 ** REVISION_DIGITS:
        raise SpecError([f"{WHERE}: revision {max(revisions)} has more than {REVISION_DIGITS} digits, which neither its "
                         "track's namespace has room for nor the weights role admits (namespace_globs). Fix: start "
                         "the environment's releases again in a new release store"])
    newest = max(revisions)
    recorded = {revision: _parse(revision, data) for revision, _, data in entries}
    serving = [r for r, w, _ in entries if w > 0]
    if len(serving) > 1 and not splits_traffic_by_weight(recorded[newest]):
        raise SpecError([
            f"{WHERE}: revisions {serving} would split traffic by weight between InferencePools, which "
            "the gateway routes one per rule. Fix: with gateway_epp, move traffic whole (stages 100: a blue/green "
            "switch with the old revision kept at weight 0), or use implementation: sglang_router for canaries"])
    tracks = []
    for revision, weight, _ in entries:
        data = recorded[revision].model_dump(mode="json")
        dep = data["deployment"]
        counts = {}
        for role, phase in recorded[revision].deployment.pools().items():
            others_min = sum(other.deployment.pools()[role].bounds()[0] for r, other in recorded.items()
                             if r != revision and role in other.deployment.pools())
            lo, hi = phase.bounds()
            share = hi - others_min
            if share < max(lo, 1):
                raise SpecError([
                    f"{WHERE}: revision {revision} cannot fit beside the other tracks: {role} may grow "
                    f"to {hi} instances and the others hold {others_min}. Fix: lower deployment.{role}.scaling."
                    "min_instances, raise max_instances, or retire a track first"])
            start = lo if (len(entries) > 1 and revision == newest) else min(max(dep[role]["instances"], lo), share)
            dep[role]["instances"] = max(start, 1)
            dep[role]["scaling"] = {"min_instances": lo, "max_instances": share}
            counts[role] = dep[role]["instances"] * phase.gpus_per_instance()
        if "prefill" in counts and "decode" in counts:
            ratio = Fraction(counts["prefill"], counts["decode"])
            dep["pd_ratio"] = f"{ratio.numerator}:{ratio.denominator}"
        shared = _parse(revision, data)  # checked with the environment's namespace, which the spec holds to NAMESPACE_MAX
        # The track's own namespace is the environment's and '-r<revision>': a DNS label by that bound and
        # REVISION_DIGITS. Not checked again as an environment's: that rule leaves room for this suffix.
        own = shared.environment.model_copy(update={"namespace": track_namespace(shared.environment.namespace, revision)})
        tracks.append(Track(revision, weight, shared.model_copy(update={"environment": own})))
    return tracks
