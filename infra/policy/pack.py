"""The rules of infra/policy/rules.py as pulumi-policy policies (what `policy/__main__.py` serves).

Resource rules become ResourceValidationPolicy, stack rules StackValidationPolicy; both
read the analyzer's plain properties. Mandatory rules block `pulumi preview`/`up`.
"""

from __future__ import annotations

from pulumi_policy import (
    EnforcementLevel,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from infra.policy.rules import RULES, Resource, Rule

PACK_NAME = "pdstack"
_LEVELS = {"mandatory": EnforcementLevel.MANDATORY, "advisory": EnforcementLevel.ADVISORY}


def _plain(props) -> dict:
    """The analyzer's property proxy as a plain dict (reading every value, as the rules do)."""
    if hasattr(props, "items"):
        return {k: _plain(v) for k, v in props.items()}
    if isinstance(props, (list, tuple)) or (hasattr(props, "__iter__") and not isinstance(props, (str, bytes))):
        return [_plain(v) for v in props]
    return props


def resource_policy(rule: Rule) -> ResourceValidationPolicy:
    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        resource = Resource(args.resource_type, args.name, _plain(args.props))
        for message in rule.check_resource(resource):
            report_violation(message, args.urn)

    return ResourceValidationPolicy(name=rule.name, description=rule.description,
                                    enforcement_level=_LEVELS[rule.level], validate=validate)


def stack_policy(rule: Rule) -> StackValidationPolicy:
    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        resources = [Resource(r.resource_type, r.name, _plain(r.props)) for r in args.resources]
        for message in rule.check_stack(resources):
            report_violation(message, None)

    return StackValidationPolicy(name=rule.name, description=rule.description,
                                 enforcement_level=_LEVELS[rule.level], validate=validate)


def policies() -> list:
    return [resource_policy(r) if r.check_resource else stack_policy(r) for r in RULES]
