"""EFA per instance type: where the device plugin runs (only on the types its chart lists) and
which network cards take the EFA interfaces (EFA_CARDS, below).

aws/eks-charts stable/aws-efa-k8s-device-plugin templates/daemonset.yaml requires
node.kubernetes.io/instance-type In supportedInstanceLabels.values (its values.yaml). On a type the
installed chart version does not list, no plugin pod runs, no node offers vpc.amazonaws.com/efa,
and every pod requesting it stays Pending. So each instance type of a node class that attaches
EFA must be listed by the chart version the catalog row installs.

The chart's list is kept here by hand, not extracted: aws/eks-charts is no Go module and is in
no package this project pins, so its values cannot be read at a pinned version (upstream/
PROVENANCE.json lists the table as hand-kept).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The first chart version whose values.yaml lists each instance type pdstack's specs name (none
# has been removed since), from the chart's release history: each aws/eks-charts pull request
# that changed the list bumped the chart's version.
EFA_PLUGIN_LISTED_FROM = {
    "p4d.24xlarge": "v0.4.2",  # the chart's first version (aws/eks-charts #1040)
    "p5.48xlarge": "v0.4.2",  # the chart's first version (#1040)
    "p5e.48xlarge": "v0.5.5",  # #1151 "Add latest instance types that support EFA"
    "p5en.48xlarge": "v0.5.6",  # #1182 "Add P5en to list of EFA supported instances"
    "p6-b200.48xlarge": "v0.5.9",  # #1211 "update efa device plugin instance list"
    "p6e-gb200.36xlarge": "v0.5.14",  # #1236 "update efa supported instance types for gb200"
}
EFA_PLUGIN_LISTED_FROM_ORIGIN = ("aws/eks-charts stable/aws-efa-k8s-device-plugin: the chart version of the pull "
                                 "request that added each type to values.yaml supportedInstanceLabels.values")


def chart_version(version: str) -> tuple[int, ...]:
    """A chart version as numbers, so that v0.5.6 sorts before v0.5.14: "v0.5.30" is (0, 5, 30)."""
    if not re.fullmatch(r"v?\d+(\.\d+)*", version):
        raise ValueError(f"{version!r} is not a chart version such as v0.5.30")
    return tuple(int(part) for part in version.lstrip("v").split("."))


def efa_plugin_problems(spec, chart: str) -> list[str]:
    """Each instance type of an EFA node class of `spec` (a PlatformSpec) that chart version
    `chart` of the EFA device plugin does not list, or that the table does not know."""
    if spec.cloud.provider != "aws":
        return []
    problems = []
    for family in spec.cloud.node_classes:
        for itype in family.instance_types if family.efa_interfaces else ():
            where = f"cloud.node_classes[{family.name}].instance_types: {itype}"
            first = EFA_PLUGIN_LISTED_FROM.get(itype)
            if first is None:
                problems.append(
                    f"{where}: not in the table of instance types the EFA device plugin's chart lists "
                    f"(infra/platform_stack/efa.py EFA_PLUGIN_LISTED_FROM), so chart {chart} cannot be checked "
                    "for it. Fix: add it with the first chart version whose values.yaml supportedInstanceLabels "
                    "lists it (the chart's release history), or use an instance type the table has")
            elif chart_version(chart) < chart_version(first):
                problems.append(
                    f"{where}: the EFA device plugin's chart {chart} does not list it (it is listed from {first} "
                    "on): no node of it would offer vpc.amazonaws.com/efa, so every pod requesting it would stay "
                    f"Pending. Fix: aws-efa-k8s-device-plugin's chart at {first} or later "
                    "(infra/platform_stack/catalog.py), or an instance type it lists")
    return problems


# --- where the EFA devices go: each instance type's network cards -----------------------------------
#
# An EFA device is an interface on a network card that takes one; which cards do is the instance
# type's. AWS's rule (EC2 User Guide, "Maximize network bandwidth on Amazon EC2 instances with
# multiple network cards", efa-acc-inst-types): the primary interface is an ENA one (card 0,
# device 0; an EFA-only interface cannot be primary); if card 0 supports EFA, an EFA-only
# interface at card 0, device 1; each further one on the next unused card, device 0.
# p6e-gb200's card 0 takes no EFA device and its odd cards take EFA-only interfaces only: AWS's
# own ParallelCluster builds its launch templates so (aws/aws-parallelcluster
# cli/src/pcluster/templates/queues_stack.py add_network_interfaces: "NCI-0 does NOT support
# EFA (e.g., B300, GB200)", "odd cards ... only support efa-only"), so its EFA devices go on
# cards 1, 3, 5 and so on. Kept by hand: DescribeInstanceTypes needs an account, and the pinned
# karpenter-provider-aws's copy (pkg/providers/instancetype/zz_generated.vpclimits.go, each
# type's NetworkCards) has no p6e-gb200 entry; tests/test_platform.py holds every type it does
# have to it.


@dataclass(frozen=True)
class EfaCards:
    network_cards: int | None  # how many the type has; None: no source this project can read says
    efa_cards: tuple[int, ...]  # the cards that take an EFA device, in the order they are used

    def card_zero_takes_efa(self) -> bool:
        return 0 in self.efa_cards


def _every_card(n: int) -> EfaCards:
    return EfaCards(n, tuple(range(n)))


EFA_CARDS = {
    "p4d.24xlarge": _every_card(4),
    "p5.48xlarge": _every_card(32),
    "p5e.48xlarge": _every_card(32),
    "p5en.48xlarge": _every_card(16),
    "p6-b200.48xlarge": _every_card(8),
    "p6e-gb200.36xlarge": EfaCards(None, tuple(range(1, 17, 2))),
}


def efa_network_interfaces(instance_type: str, count: int) -> list[dict]:
    """EC2NodeClass networkInterfaces for `count` EFA devices on `instance_type` (EFA_CARDS):
    the primary ENA interface, then one efa-only interface per card that takes EFA, in order.
    Karpenter's CEL rules on the field (karpenter-provider-aws v1.14.1 pkg/apis/v1/ec2nodeclass.go):
    a primary {card 0, device 0, interface}, unique (card, device) pairs, one efa-only per card."""
    if count == 0:
        return []
    cards = EFA_CARDS[instance_type].efa_cards[:count]
    return [{"networkCardIndex": 0, "deviceIndex": 0, "interfaceType": "interface"},
            *({"networkCardIndex": card, "deviceIndex": 1 if card == 0 else 0, "interfaceType": "efa-only"}
              for card in cards)]


def efa_layout_problems(spec) -> list[str]:
    """Each EFA node class of `spec` (a PlatformSpec) must name instance types whose cards
    EFA_CARDS knows, that take `efa_interfaces` devices, all in one layout (a node class has one
    networkInterfaces list for every type it may launch)."""
    if spec.cloud.provider != "aws":
        return []
    problems = []
    for family in spec.cloud.node_classes:
        if not family.efa_interfaces:
            continue
        where = f"cloud.node_classes[{family.name}]"
        unknown = [t for t in family.instance_types if t not in EFA_CARDS]
        if unknown:
            problems.append(f"{where}.instance_types: {', '.join(unknown)}: not in the table of the network cards "
                            "that take EFA (infra/platform_stack/efa.py EFA_CARDS), so its EFA interfaces cannot be "
                            "laid out. Fix: add it from AWS's EC2 documentation of the type's network cards, or use "
                            "a type the table has")
            continue
        for itype in family.instance_types:
            if family.efa_interfaces > len(EFA_CARDS[itype].efa_cards):
                problems.append(f"{where}.efa_interfaces: {family.efa_interfaces}, but {itype} takes "
                                f"{len(EFA_CARDS[itype].efa_cards)} EFA devices. Fix: at most that many")
        layouts = {tuple(map(str, efa_network_interfaces(t, family.efa_interfaces))) for t in family.instance_types
                   if family.efa_interfaces <= len(EFA_CARDS[t].efa_cards)}
        if len(layouts) > 1:
            problems.append(f"{where}.instance_types: {', '.join(family.instance_types)} put their EFA devices on "
                            "different network cards, and a node class has one networkInterfaces list. Fix: one node "
                            "class per layout")
    return problems
