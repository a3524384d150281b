"""Where the EFA device plugin runs: only on the instance types its chart lists.

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
